"""Observability of the live application: /metrics moves exactly as the responses' usage says,
a real Prometheus scrapes it and answers acceptance per domain, the built-in dashboard renders
one line per domain in headless Chromium, ``osd top`` shows the figures under tmux."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import free_port

from config import AppConfig

from .conftest import ADMIN_KEY, KEY, MODEL, PROMPTS, _call, scrape, total

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]


def mixed_traffic(server: str, n: int = 6) -> list[dict]:
    """Completions and streamed chats as tenant alice; the usage each response reported."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    usages = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2 == 0:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
            usages.append(r.usage.model_dump())
        else:
            chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                         max_tokens=12, temperature=0.7, stream=True,
                                                         stream_options={"include_usage": True}))
            usages.append(chunks[-1].usage.model_dump())
    return usages


def test_counter_deltas_equal_the_usage_the_responses_reported(server):
    before = scrape(server)
    usages = mixed_traffic(server)
    assert _call(server + "/v1/completions", {"model": MODEL, "prompt": "x"}, key="sk-wrong")[0] == 401
    after = scrape(server)

    def delta(name, **where):
        return total(after, name, **where) - total(before, name, **where)

    spec = [u["speculative"] for u in usages]
    assert delta("osd_requests_total", tenant="alice", status="200") == len(usages)
    assert delta("osd_requests_total", tenant="unauthenticated", status="401") == 1
    assert delta("osd_prompt_tokens_total", tenant="alice") == sum(u["prompt_tokens"] for u in usages)
    assert delta("osd_generation_tokens_total", tenant="alice") == sum(u["completion_tokens"] for u in usages)
    assert delta("osd_e2e_request_latency_seconds_count", tenant="alice") == len(usages)
    assert delta("osd_time_to_first_token_seconds_count", tenant="alice") == len(usages)
    # speculative decoding: per domain, as each response's usage said; a domain past
    # metrics.max_domains distinct ones (the router's clusters, which earlier tests of this server
    # grow) is counted as "other": first come, first kept
    from telemetry.catalog import OTHER

    named = {dict(labels).get("domain") for name, labels in after if name == "osd_spec_decode_num_steps_total"}
    by_domain = defaultdict(lambda: [0, 0, 0])
    for s in spec:
        label = s["domain"] if s["domain"] in named else OTHER
        by_domain[label][0] += s["proposed"]
        by_domain[label][1] += s["accepted"]
        by_domain[label][2] += s["steps"]
    for domain, (proposed, accepted, steps) in by_domain.items():
        assert delta("osd_spec_decode_num_draft_tokens_total", tenant="alice", domain=domain) == proposed, domain
        assert delta("osd_spec_decode_num_accepted_tokens_total", tenant="alice", domain=domain) == accepted, domain
        assert delta("osd_spec_decode_num_steps_total", tenant="alice", domain=domain) == steps, domain
    proposed = sum(s["proposed"] for s in spec)
    assert delta("osd_spec_decode_num_draft_tokens_per_pos_total") == proposed
    assert delta("osd_spec_decode_k_sum") == proposed
    assert delta("osd_spec_decode_num_accepted_tokens_per_pos_total") == sum(s["accepted"] for s in spec)
    assert delta("osd_routes_total") == len(usages)
    assert delta("osd_target_verify_calls_total") >= sum(s["steps"] for s in spec)
    # every family of the catalogue is declared, gauges present
    from telemetry import CATALOG

    text_names = {n for (n, _) in after}
    for fam in CATALOG.values():
        if fam.kind == "gauge" and not fam.labels:
            assert fam.name in text_names, fam.name


def test_metrics_and_stats_need_the_right_key(server):
    for key, status in ((None, 401), ("sk-wrong", 401), (KEY, 403)):
        req = urllib.request.Request(server + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            urllib.request.urlopen(req, timeout=30)
            got = 200
        except urllib.error.HTTPError as e:
            got = e.code
        assert got == status, key
    status, mine, _ = _call(server + "/v1/stats?tenant=ops", key=KEY)  # a tenant cannot widen its scope
    assert status == 200 and mine["scope"] == "alice" and "learner" not in mine and "events" not in mine
    status, everything, _ = _call(server + "/v1/stats", key=ADMIN_KEY)
    assert status == 200 and everything["scope"] == "all" and "learner" in everything and "drafts" in everything
    assert everything["totals"]["requests"] >= mine["totals"]["requests"] > 0
    status, scoped, _ = _call(server + "/v1/stats?tenant=alice", key=ADMIN_KEY)
    assert scoped["scope"] == "alice" and scoped["totals"] == mine["totals"]
    assert _call(server + "/v1/stats", key="sk-wrong")[0] == 401


def _grafana_queries() -> list[str]:
    dash = json.loads((REPO / "ops/grafana/osd-serve.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]] + [a["expr"] for a in dash["annotations"]["list"]]


def test_prometheus_scrapes_the_app_and_answers_acceptance_per_domain(server, tmp_path):
    prometheus = shutil.which("prometheus")
    assert prometheus, "Debian's prometheus package is needed (make test installs it)"
    mixed_traffic(server, n=2)
    target = urllib.parse.urlparse(server).netloc
    (tmp_path / "admin_key").write_text(ADMIN_KEY)
    cfg = {"global": {"scrape_interval": "1s"}, "scrape_configs": [{
        "job_name": "osd", "metrics_path": "/metrics", "static_configs": [{"targets": [target]}],
        "authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "admin_key")}}]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(cfg))
    port = free_port()
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--web.listen-address=127.0.0.1:{port}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    query = ("sum by (domain) (osd_spec_decode_num_accepted_tokens_total) / "
             "sum by (domain) (osd_spec_decode_num_draft_tokens_total)")

    def ask(q: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(q)}", timeout=5) as r:
            return json.loads(r.read())

    try:
        deadline, result = time.time() + 60, []
        while time.time() < deadline and not result:
            time.sleep(1)
            try:
                result = ask(query)["data"]["result"]
            except OSError:
                continue
        # every query of the Grafana dashboard is one this Prometheus evaluates on the app's series
        failed = {}
        for q in _grafana_queries():
            try:
                answer = ask(q.replace("$__rate_interval", "1m").replace("$__range", "5m"))
            except urllib.error.HTTPError as e:
                answer = {"status": "error", "error": e.read()[:300]}
            if answer["status"] != "success":
                failed[q] = answer
        # the named acceptance panel: its rates need two scrapes of the app, not one
        named, panel = [], _grafana_queries()[0].replace("$__rate_interval", "1m").replace("$__range", "5m")
        while time.time() < deadline + 30 and not named:
            named = ask(panel)["data"]["result"]
            time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert result, "Prometheus answered no acceptance per domain within 60 s"
    assert not failed, failed
    # the busiest domains' acceptance, each with a readable name (a discovered one's words, a named one's id)
    assert named and all(r["metric"].get("name") for r in named), named
    got = {r["metric"]["domain"]: float(r["value"][1]) for r in result}
    stats = _call(server + "/v1/stats", key=ADMIN_KEY)[1]["acceptance"]
    want = {d: a["alpha"] for d, a in stats.items() if a["drafted"] > 0}
    assert set(got) == set(want)
    for d in want:  # no traffic in between: Prometheus' answer is the server's own figure
        assert got[d] == pytest.approx(want[d], abs=1e-9), d


def _palette() -> list[tuple[int, int, int]]:
    js = (REPO / "deployments/static/dashboard.js").read_text()
    colours = re.findall(r'"#([0-9a-f]{6})"', js.split("const PALETTE = [", 1)[1].split("];", 1)[0])
    return [tuple(int(c[i:i + 2], 16) for i in (0, 2, 4)) for c in colours]


def pixels_near(img, rgb, tol: int = 12) -> int:
    import numpy as np

    a = np.asarray(img.convert("RGB")).astype(int)
    return int((np.abs(a - np.array(rgb)).max(axis=2) <= tol).sum())


def test_dashboard_draws_one_line_per_domain_with_traffic(server, tmp_path):
    from PIL import Image
    from selenium.webdriver.common.by import By

    from telemetry.browser import chromium, open_dashboard

    for _ in range(3):  # traffic spread over a few sample periods: lines, not points
        mixed_traffic(server, n=2)
        time.sleep(2.5)  # one sample period (serve_config.yaml: 2 s): the last traffic is in a point
    browser = chromium()
    try:
        open_dashboard(browser, server, ADMIN_KEY)
        browser.execute_script("clearInterval(window.osdRefresh)")  # hold the data still while looking
        stats = browser.execute_script("return window.osdStats")  # what the page drew
        labels = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#acceptance .u-legend .u-series .u-label")]
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        canvas = browser.find_element(By.CSS_SELECTOR, "#acceptance canvas")
        series = stats["series"]["acceptance"]
        domains = sorted(series)
        palette = _palette()

        def shot():
            return Image.open(io.BytesIO(canvas.screenshot_as_png))

        drawn = browser.execute_script("return window.osdPlots.acceptance.series.length") - 1  # the x axis first
        alone = {}
        for i, d in enumerate(domains, start=1):  # each domain's line on its own (legend toggles)
            browser.execute_script("const u = window.osdPlots.acceptance;"
                                   "for (let j = 1; j < u.series.length; j++) u.setSeries(j, {show: j === arguments[0]});", i)
            alone[d] = pixels_near(shot(), palette[(i - 1) % len(palette)])
    finally:
        browser.quit()
    lines = [d for d in domains if sum(x is not None for x in series[d]) >= 2]
    cap = AppConfig().metrics.chart_domains
    assert lines and len(domains) <= cap + 1 and set(domains) - {"(other domains)"} <= set(stats["acceptance"])
    names = stats["domain_names"]
    # the legend: the x axis, then one entry per line, a discovered domain by its name
    assert labels[1:] == [f"{names[d]} ({d})" if d in names else d for d in domains]
    for d in lines:  # a domain with traffic in two or more samples is drawn as a line of its colour
        assert alone[d] >= 20, f"no line for {d} ({alone[d]} pixels of its colour)"
    # no line for a domain without traffic: the plot holds a series per domain of the data, no more
    # (counted in the plot, not by colour: where two lines cross, antialiasing blends their colours
    # into pixels near an unused palette entry)
    assert drawn == len(domains)


def test_osd_top_shows_the_figures_under_tmux(server, tmp_path):
    tmux = shutil.which("tmux")
    assert tmux, "tmux is needed (make test installs it)"
    mixed_traffic(server, n=2)
    session = f"osdtop{os.getpid()}"
    err = tmp_path / "top.err"  # what the command said (a traceback), for the failure's message
    cmd = f"{sys.executable} -m telemetry.top --url {server} --key {ADMIN_KEY} --interval 1 --iterations 120 2> {err}"
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "160", "-y", "50", cmd], check=True,
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        # the figures reach /v1/stats one sample period after the traffic (the metrics deployment
        # pulls them): look until a frame shows what /v1/stats says just after it was drawn
        deadline, screen, problems, stats = time.time() + 90, "", ["no frame"], {}
        while time.time() < deadline and problems:
            time.sleep(1)
            screen = subprocess.run([tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
            if "acceptance per domain" in screen:
                stats = _call(server + "/v1/stats", key=ADMIN_KEY)[1]
                problems = _top_problems(screen, stats)
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)
    said = err.read_text() if err.exists() else "(no stderr file)"
    assert "acceptance per domain" in screen, f"{screen}\nstderr: {said}"
    seen = json.dumps({k: stats.get(k) for k in ("t", "totals", "acceptance")})
    assert not problems, f"{problems}\n{screen}\n{seen}\nstderr: {said}"


def _top_problems(screen: str, stats: dict) -> list:
    """What the screen of ``osd top`` gets wrong against ``/v1/stats`` (empty: nothing)."""
    problems = []
    if f"{stats['totals']['requests']:.0f}" not in screen:
        problems.append(("requests", stats["totals"]["requests"]))
    # the busiest domains that fit the terminal, one row counting the others
    busiest = sorted(stats["acceptance"].items(), key=lambda da: (-da[1]["drafted"], da[0]))
    more = re.search(r"\+(\d+) more domains", screen)
    hidden = int(more[1]) if more else 0
    if hidden >= len(busiest):
        problems.append(("more domains than there are", hidden, len(busiest)))
    for d, a in busiest[: len(busiest) - hidden]:
        row = next((line for line in screen.splitlines() if line.strip().startswith(d + " ")), None)
        if row is None or (f"{a['alpha']:.3f}" not in row if a["alpha"] is not None else "-" not in row):
            problems.append((d, a["alpha"], row))
    flowed = " ".join(screen.split())  # the drafts' list wraps wherever the terminal's width falls
    if not ("learner" in flowed and "general v" in flowed):
        problems.append("no learner line")
    return problems


def test_counts_survive_a_killed_draft_replica_without_double_counting(server):
    """Kill a draft replica after its counts were pulled: Serve replaces it, the totals keep every
    count (nothing lost) and the replacement starts from zero (nothing counted twice)."""
    import ray
    from ray import serve

    mixed_traffic(server, n=2)
    before = scrape(server)
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True) if "osd#DraftPool#" in a["name"])
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    pool = serve.get_deployment_handle("DraftPool", "osd")
    deadline, answered = time.monotonic() + 180, []
    while time.monotonic() < deadline and len(answered) < 2:
        try:
            answered = pool.broadcast("preload", "general").results()
        except Exception:  # noqa: BLE001 - the dead replica answers with an error until it is replaced
            time.sleep(2)
    assert len(answered) == 2
    after = scrape(server)
    counters = [k for k in before if k[0].endswith(("_total", "_count", "_sum", "_bucket"))]
    assert counters
    for k in counters:
        if k[0].startswith(("osd_spec_decode", "osd_requests", "osd_generation", "osd_prompt")):
            assert after.get(k) == before[k], k  # no traffic in between: unchanged, not doubled
        else:
            assert after.get(k, 0.0) >= before[k], k  # other counters only grow
    usages = mixed_traffic(server, n=2)
    again = scrape(server)
    assert (total(again, "osd_spec_decode_num_draft_tokens_total") - total(after, "osd_spec_decode_num_draft_tokens_total")
            == sum(u["speculative"]["proposed"] for u in usages))
