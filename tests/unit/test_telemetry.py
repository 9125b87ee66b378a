"""Meters and the hub, by hand: counts add up across replicas, a restarted replica counts from
zero without a double count, label sets stay bounded, the exposition parses, stats scope by tenant."""

from __future__ import annotations

import io
import math
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from config import MetricsConfig
from telemetry import CATALOG, Hub, Meter
from telemetry.catalog import OTHER, exported_series
from telemetry.hub import quantile

SPEC = dict(tenant="t1", domain="code", language="en", draft="general")


def samples(hub: Hub) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(hub.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(hub: Hub, name: str, **labels) -> float:
    return samples(hub).get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)


def test_counts_add_up_across_replicas_and_snapshots():
    a, b, hub = Meter("DraftPool", replica="a"), Meter("DraftPool", replica="b"), Hub()
    a.inc("osd_spec_decode_num_draft_tokens_total", 5, **SPEC)
    b.inc("osd_spec_decode_num_draft_tokens_total", 3, **SPEC)
    hub.merge(a.snapshot())
    hub.merge(b.snapshot())
    assert value(hub, "osd_spec_decode_num_draft_tokens_total", **SPEC) == 8
    a.inc("osd_spec_decode_num_draft_tokens_total", 2, **SPEC)
    hub.merge(a.snapshot())
    hub.merge(b.snapshot())  # nothing new from b
    assert value(hub, "osd_spec_decode_num_draft_tokens_total", **SPEC) == 10


def test_a_snapshot_merged_twice_or_late_counts_once():
    a, hub = Meter("Ingress", replica="a"), Hub()
    a.inc("osd_requests_total", tenant="t", status="200")
    old = a.snapshot()
    a.inc("osd_requests_total", tenant="t", status="200")
    new = a.snapshot()
    hub.merge(new)
    hub.merge(new)
    hub.merge(old)  # arrived late: already covered by ``new``
    assert value(hub, "osd_requests_total", tenant="t", status="200") == 2


def test_a_restarted_replica_is_counted_from_zero_and_keeps_what_was_merged():
    hub = Hub()
    first = Meter("Ingress", replica="r1")
    first.inc("osd_requests_total", 7, tenant="t", status="200")
    first.observe("osd_e2e_request_latency_seconds", 0.3, n=7, tenant="t")
    hub.merge(first.snapshot())
    again = Meter("Ingress", replica="r1")  # the same replica name after a restart: a new epoch
    again.inc("osd_requests_total", 2, tenant="t", status="200")
    again.observe("osd_e2e_request_latency_seconds", 2.0, n=2, tenant="t")
    hub.merge(again.snapshot())
    assert value(hub, "osd_requests_total", tenant="t", status="200") == 9
    assert value(hub, "osd_e2e_request_latency_seconds_count", tenant="t") == 9
    assert value(hub, "osd_e2e_request_latency_seconds_sum", tenant="t") == pytest.approx(0.3 * 7 + 4.0)
    assert value(hub, "osd_e2e_request_latency_seconds_bucket", tenant="t", le="0.5") == 7


def test_a_hub_that_restarts_recovers_the_live_replicas_totals():
    a = Meter("Ingress", replica="a")
    a.inc("osd_requests_total", 4, tenant="t", status="200")
    Hub().merge(a.snapshot())
    fresh = Hub()
    fresh.merge(a.snapshot())
    assert value(fresh, "osd_requests_total", tenant="t", status="200") == 4


def test_gauges_sum_over_live_replicas_and_vanish_with_them():
    a, b, hub = Meter("Target", replica="a"), Meter("Target", replica="b"), Hub()
    a.set("osd_target_kv_caches", 3)
    b.set("osd_target_kv_caches", 4)
    hub.merge(a.snapshot())
    hub.merge(b.snapshot())
    assert value(hub, "osd_target_kv_caches") == 7
    hub.retain({"a"}, hub.replicas_of("Target"))  # b did not answer the last pull
    assert value(hub, "osd_target_kv_caches") == 3


def test_histogram_buckets_follow_prometheus_le():
    m, hub = Meter("Target", replica="a"), Hub()
    for v in (0.1, 0.1000001, 500.0):
        m.observe("osd_target_forward_seconds", v)
    hub.merge(m.snapshot())
    assert value(hub, "osd_target_forward_seconds_bucket", le="0.1") == 1  # le is inclusive
    assert value(hub, "osd_target_forward_seconds_bucket", le="0.25") == 2
    assert value(hub, "osd_target_forward_seconds_bucket", le="160.0") == 2
    assert value(hub, "osd_target_forward_seconds_bucket", le="+Inf") == 3
    assert value(hub, "osd_target_forward_seconds_count") == 3


def test_label_values_are_capped_per_label_and_per_family():
    cfg = MetricsConfig(max_tenants=2, max_series=10)
    m, hub = Meter("Ingress", cfg, replica="a"), Hub(cfg)
    for t in ("a", "b", "c", "d"):
        m.inc("osd_requests_total", tenant=t, status="200")
    hub.merge(m.snapshot())
    assert value(hub, "osd_requests_total", tenant=OTHER, status="200") == 2
    for i in range(30):
        m.inc("osd_routes_total", reason="classifier", domain=f"d{i}")  # domains capped at 24, series at 10
    hub.merge(m.snapshot())
    routes = [k for k in samples(hub) if k[0] == "osd_routes_total"]
    assert len(routes) <= 10 and value(hub, "osd_routes_total", reason=OTHER, domain=OTHER) == 21
    assert sum(v for k, v in samples(hub).items() if k[0] == "osd_routes_total") == 30


def test_the_union_of_replicas_is_capped_at_the_hub():
    cfg = MetricsConfig(max_tenants=2)
    hub = Hub(cfg)
    for r, t in (("a", "x"), ("b", "y"), ("c", "z")):
        m = Meter("Ingress", cfg, replica=r)
        m.inc("osd_requests_total", tenant=t, status="200")
        hub.merge(m.snapshot())
    tenants = {dict(k[1])["tenant"] for k in samples(hub) if k[0] == "osd_requests_total"}
    assert tenants == {"x", "y", OTHER}


def test_old_draft_versions_fold_into_old_and_the_sum_is_kept():
    cfg = MetricsConfig(keep_versions=2)
    m, hub = Meter("DraftPool", cfg, replica="a"), Hub(cfg)
    for v in range(1, 6):
        m.inc("osd_spec_decode_draft_version_draft_tokens_total", 10, draft="g", draft_version=v)
        hub.merge(m.snapshot())
    got = {dict(k[1])["draft_version"]: v for k, v in samples(hub).items()
           if k[0] == "osd_spec_decode_draft_version_draft_tokens_total"}
    assert got == {"4": 10, "5": 10, "old": 30}


def test_unknown_labels_and_negative_counts_are_errors():
    m = Meter("Ingress")
    with pytest.raises(ValueError):
        m.inc("osd_requests_total", tenant="t")
    with pytest.raises(ValueError):
        m.inc("osd_requests_total", -1, tenant="t", status="200")


def test_disabled_meter_counts_nothing():
    m = Meter("Ingress", MetricsConfig(enabled=False))
    m.inc("osd_requests_total", tenant="t", status="200")
    assert m.snapshot()["counters"] == {}


def test_events_arrive_once_across_pulls():
    m, hub = Meter("Learner", replica="l"), Hub()
    m.event("publish", draft="g", version=1)
    hub.merge(m.snapshot())
    hub.merge(m.snapshot())
    m.event("reject", draft="g", reason="non-finite parameter")
    hub.merge(m.snapshot())
    assert [e["kind"] for e in hub.events] == ["publish", "reject"]


def test_every_family_is_exported_with_conventional_names():
    hub = Hub()
    names = {f.name for f in text_string_to_metric_families(hub.exposition().decode())}
    for fam in CATALOG.values():
        assert fam.name.startswith("osd_")
        assert fam.name.endswith("_total") == (fam.kind == "counter"), fam.name
        assert fam.name.removesuffix("_total") in names or fam.name in names
    assert "osd_spec_decode_num_accepted_tokens_per_pos_total" in exported_series()


def test_quantile_interpolates_inside_the_bucket():
    buckets = (1.0, 2.0, 4.0)
    assert quantile(0.5, buckets, [0, 10, 0, 0]) == pytest.approx(1.5)
    assert quantile(0.9, buckets, [10, 0, 0, 0]) == pytest.approx(0.9)
    assert quantile(0.99, buckets, [0, 0, 0, 5]) == 4.0  # +Inf: the highest finite bound
    assert quantile(0.5, buckets, [0, 0, 0, 0]) is None


def test_stats_acceptance_rates_and_tenant_scope():
    cfg = MetricsConfig(sample_s=1.0)
    m, hub = Meter("DraftPool", cfg, replica="a"), Hub(cfg)
    i = Meter("Ingress", cfg, replica="i")
    hub.merge(m.snapshot())
    hub.sample(now=100.0)
    m.inc("osd_spec_decode_num_draft_tokens_total", 10, **SPEC)
    m.inc("osd_spec_decode_num_accepted_tokens_total", 6, **SPEC)
    m.inc("osd_spec_decode_num_draft_tokens_total", 4, **{**SPEC, "tenant": "t2", "domain": "sql"})
    m.inc("osd_spec_decode_num_accepted_tokens_total", 1, **{**SPEC, "tenant": "t2", "domain": "sql"})
    i.inc("osd_requests_total", 3, tenant="t1", status="200")
    i.inc("osd_requests_total", 1, tenant="t2", status="500")
    i.inc("osd_generation_tokens_total", 40, tenant="t1", status="200")
    hub.merge(m.snapshot())
    hub.merge(i.snapshot())
    hub.sample(now=102.0)
    s = hub.stats()
    assert s["acceptance"]["code"]["alpha"] == 0.6 and s["acceptance"]["sql"]["alpha"] == 0.25
    assert s["series"]["acceptance"]["code"] == [None, 0.6]
    assert s["series"]["requests_per_s"][-1] == 2.0 and s["series"]["tokens_per_s"][-1] == 20.0
    assert s["totals"] == {"requests": 4, "errors": 1, "generation_tokens": 40}
    mine = hub.stats(tenant="t2", admin=False)
    assert set(mine["acceptance"]) == {"sql"} and mine["totals"]["requests"] == 1
    assert "learner" not in mine and "events" not in mine and "drafts" not in mine
    assert math.isclose(s["series"]["errors_per_s"][-1], 0.5)


def _dashboard_queries() -> list[str]:
    import json
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[2] / "ops/grafana/osd-serve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs + [a["expr"] for a in dash["annotations"]["list"]]


def test_every_series_a_grafana_panel_queries_is_exported():
    import re

    exported = exported_series()
    queries = _dashboard_queries()
    assert len(queries) >= 15
    used = set()
    for q in queries:
        names = re.findall(r"\bosd_[a-z0-9_]+", q)
        assert names, q
        for n in names:
            assert n in exported, f"{n} (in {q!r}) is not a series the server exports"
            used.add(n)
        # every label a query groups or filters by is one of its metrics' labels (or le)
        fams = [f for f in CATALOG.values() if any(n in (f.name, f"{f.name}_bucket", f"{f.name}_sum", f"{f.name}_count") for n in names)]
        labels = {"le"} | {lab for f in fams for lab in f.labels}
        for group in re.findall(r"by \(([^)]*)\)", q):
            for lab in (x.strip() for x in group.split(",")):
                assert lab in labels, f"{q!r} groups by {lab!r}"
        for lab in re.findall(r"\{(\w+)[!=]", q):
            assert lab in labels, f"{q!r} filters on {lab!r}"
    # the dashboard covers the headline families
    for n in ("osd_spec_decode_num_accepted_tokens_total", "osd_e2e_request_latency_seconds_bucket",
              "osd_learner_rounds_total", "osd_generation_tokens_total", "osd_requests_total"):
        assert n in used


def test_the_scrape_config_targets_the_metrics_path():
    from pathlib import Path

    import yaml

    cfg = yaml.safe_load((Path(__file__).parents[2] / "ops/prometheus.yml").read_text())
    job = cfg["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]


def test_top_renders_the_stats_figures():
    from rich.cells import cell_len
    from rich.console import Console

    from telemetry.top import render

    cfg = MetricsConfig(sample_s=1.0)
    m, i, hub = Meter("DraftPool", cfg, replica="a"), Meter("Ingress", cfg, replica="i"), Hub(cfg)
    hub.sample(now=10.0)
    m.inc("osd_spec_decode_num_draft_tokens_total", 8, **SPEC)
    m.inc("osd_spec_decode_num_accepted_tokens_total", 3, **SPEC)
    m.inc("osd_spec_decode_num_steps_total", 4, **SPEC)  # 10 tokens in 4 steps that cost 5 target-only steps
    m.inc("osd_spec_decode_emitted_tokens_total", 10, **SPEC)
    m.inc("osd_spec_decode_step_cost_total", 5.0, **SPEC)
    m.inc("osd_spec_decode_num_draft_tokens_total", 4, **{**SPEC, "domain": "c2/zh"})
    i.inc("osd_requests_total", 17, tenant="t1", status="200")
    router = Meter("Router", cfg, replica="r")  # a discovered domain with a long name of wide characters
    router.replace("osd_domain_info", {("c2/zh", "你好世界你好世界你好世界 天气怎么样今天天气怎么样 " * 2): 1})
    hub.merge(router.snapshot())
    lm = Meter("Learner", cfg, replica="l")
    lm.set("osd_draft_version", 4, draft="general")
    lm.event("publish", draft="general", version=4)
    for meter in (m, i, lm):
        hub.merge(meter.snapshot())
    hub.sample(now=11.0)
    console = Console(file=io.StringIO(), width=150)
    console.print(render(hub.stats(), "http://127.0.0.1:8000"))
    screen = console.file.getvalue()
    row = next(line for line in screen.splitlines() if line.strip().startswith("code "))
    assert "0.375" in row and " 8 " in row + " " and "17" in screen
    assert "2.50" in row and "2.00x" in row  # tokens a step, the estimated speed-up
    named = [line for line in screen.splitlines() if line.strip().startswith("c2/zh ")]
    assert len(named) == 1 and "你好" in named[0] and "0.000" in named[0]  # found by its id, its name cut to one line
    lines = screen.splitlines()
    after = lines[lines.index(named[0]) + 1]
    assert "天气" not in after and "你好" not in after  # not wrapped onto the next line
    assert cell_len(named[0].strip()[: named[0].strip().index("…") + 1]) == 44  # the column's width: 44 cells
    assert "general v4" in screen and "publish general v4" in screen
    tenant_view = Console(file=io.StringIO(), width=150)
    tenant_view.print(render(hub.stats("t1", admin=False), "u"))
    assert "learner" not in tenant_view.file.getvalue()


def test_top_fits_a_terminal_shorter_than_the_domain_table_with_the_busiest_domains():
    """``osd top`` redraws in place, and a frame taller than the terminal would lose its last lines:
    with more domains than lines, it shows the busiest domains that fit, one row counting the others,
    and the learner's state; printed once (``--once``), the frame is whole."""
    from rich.console import Console

    from telemetry.top import fit, render

    cfg = MetricsConfig(sample_s=1.0)
    m, lm, hub = Meter("DraftPool", cfg, replica="a"), Meter("Learner", cfg, replica="l"), Hub(cfg)
    for j in range(20):  # c19 the busiest; the names' order is not the traffic's
        m.inc("osd_spec_decode_num_draft_tokens_total", 4 + j, **{**SPEC, "domain": f"c{j}"})
        m.inc("osd_spec_decode_num_accepted_tokens_total", j % 3, **{**SPEC, "domain": f"c{j}"})
    lm.set("osd_draft_version", 4, draft="general")
    for meter in (m, lm):
        hub.merge(meter.snapshot())
    hub.sample(now=11.0)
    console = Console(file=io.StringIO(), width=150, height=16, force_terminal=True)
    frame = fit(hub.stats(), "u", console)
    assert len(console.render_lines(frame, pad=False)) == 15  # a line spare: drawing it never scrolls
    shown = Console(file=io.StringIO(), width=150)
    shown.print(frame)
    screen = shown.file.getvalue()
    rows = [line.split()[0] for line in screen.splitlines() if re.match(r"\s*c\d+ ", line)]
    more = re.search(r"\+(\d+) more domains\s+(\S+)\s+(\d+)\s+(\d+)", screen)
    assert rows and more, screen
    assert rows == [f"c{j}" for j in range(19, 19 - len(rows), -1)]  # busiest first
    rest = range(20 - len(rows))  # the others: c0 .. on the one row, their tokens added up
    assert int(more[1]) == len(rest) and int(more[3]) == sum(4 + j for j in rest) and int(more[4]) == sum(j % 3 for j in rest)
    assert float(more[2]) == pytest.approx(int(more[4]) / int(more[3]), abs=5e-4)
    assert "general v4" in screen
    whole = Console(file=io.StringIO(), width=150, height=16)
    whole.print(render(hub.stats(), "u"))
    assert "c0 " in whole.file.getvalue() and "more domains" not in whole.file.getvalue()


def test_top_cuts_a_frame_one_line_too_tall_and_keeps_one_that_fits():
    """The frame is cut exactly when it would reach the terminal's last line; a terminal too short for
    any domain row shows the row counting them all; domains of equal traffic come in name order."""
    from rich.console import Console

    from telemetry.top import fit, render

    cfg = MetricsConfig(sample_s=1.0)
    m, hub = Meter("DraftPool", cfg, replica="a"), Hub(cfg)
    for d, accepted in (("b", 1), ("a", 0), ("c", 2)):  # equal traffic, different acceptance
        m.inc("osd_spec_decode_num_draft_tokens_total", 4, **{**SPEC, "domain": d})
        m.inc("osd_spec_decode_num_accepted_tokens_total", accepted, **{**SPEC, "domain": d})
    hub.merge(m.snapshot())
    hub.sample(now=11.0)
    stats = hub.stats()

    def lines(height: int) -> list[str]:
        console = Console(file=io.StringIO(), width=150, height=height)
        shown = Console(file=io.StringIO(), width=150)
        shown.print(fit(stats, "u", console))
        return shown.file.getvalue().splitlines()

    tall = len(Console(file=io.StringIO(), width=150).render_lines(render(stats, "u")))
    rows = [line.split()[0] for line in lines(tall + 1) if re.match(r"\s*[abc] ", line)]
    assert rows == ["a", "b", "c"]  # it fits with a line to spare: whole, ties by name
    cut = lines(tall)
    assert len(cut) == tall - 1 and [line.split()[0] for line in cut if re.match(r"\s*[abc] ", line)] == ["a"]
    assert any("+2 more domains" in line for line in cut)
    tiny = lines(3)  # not even one domain row fits: the count of them all
    assert not any(re.match(r"\s*[abc] ", line) for line in tiny) and any("+3 more domains" in line for line in tiny)
    every = Console(file=io.StringIO(), width=150)
    every.print(render(stats, "u", max_rows=3))  # as many rows as domains: no count row
    assert "more domains" not in every.file.getvalue()


def test_a_counter_at_zero_is_exported_so_that_ratios_have_both_sides():
    m, hub = Meter("DraftPool", replica="a"), Hub()
    m.inc("osd_spec_decode_num_draft_tokens_total", 4, **SPEC)
    m.inc("osd_spec_decode_num_accepted_tokens_total", 0, **SPEC)
    hub.merge(m.snapshot())
    key = ("osd_spec_decode_num_accepted_tokens_total", tuple(sorted(SPEC.items())))
    assert key in samples(hub) and samples(hub)[key] == 0


def test_the_docs_list_every_metric():
    from pathlib import Path

    root = Path(__file__).parents[2]
    text = (root / "docs/observability.md").read_text()  # the reference; the README names the parts
    missing = [f.name for f in CATALOG.values() if f"`{f.name}`" not in text]
    assert not missing, f"docs/observability.md does not list {missing}"


def test_stats_stay_valid_json_when_a_figure_is_not_finite():
    import json

    m, hub = Meter("Learner", replica="l"), Hub()
    m.set("osd_learner_loss", float("nan"), draft="general")
    m.event("reject", draft="general", loss=float("inf"))
    hub.merge(m.snapshot())
    hub.sample()
    s = hub.stats()
    json.dumps(s, allow_nan=False)  # what the HTTP layer does: NaN would be a 500
    assert s["learner"]["loss"] == {"general": None}


def test_quantile_walks_the_buckets_by_cumulative_count():
    buckets = (1.0, 2.0, 4.0)
    assert quantile(0.75, buckets, [2, 2, 0, 0]) == pytest.approx(1.5)  # rank 3: one of two into (1, 2]
    assert quantile(0.5, buckets, [1, 0, 0, 0]) == pytest.approx(0.5)  # a single observation
    assert quantile(0.5, buckets, [0, 1, 0, 0]) == pytest.approx(1.5)
    assert quantile(0.0, buckets, [0, 3, 0, 0]) == pytest.approx(1.0)  # empty buckets are skipped, even at rank 0
    assert quantile(0.9, buckets, [5, 0, 5, 0]) == pytest.approx(2.0 + 2.0 * 4 / 5)
    assert quantile(0.5, buckets, [2, 0, 2, 0]) == 1.0  # a rank at a bucket's top: its bound, as Prometheus


def test_a_histogram_merged_snapshot_after_snapshot_adds_only_what_is_new():
    m, hub = Meter("Ingress", replica="a"), Hub()
    m.observe("osd_e2e_request_latency_seconds", 0.3, tenant="t")
    m.observe("osd_e2e_request_latency_seconds", 20.0, tenant="t")
    hub.merge(m.snapshot())
    m.observe("osd_e2e_request_latency_seconds", 0.3, n=2, tenant="t")  # the 20 s bucket does not move
    hub.merge(m.snapshot())
    assert value(hub, "osd_e2e_request_latency_seconds_count", tenant="t") == 4
    assert value(hub, "osd_e2e_request_latency_seconds_bucket", tenant="t", le="0.5") == 3
    assert value(hub, "osd_e2e_request_latency_seconds_sum", tenant="t") == pytest.approx(0.9 + 20.0)
    hub.merge(m.snapshot())  # nothing new
    assert value(hub, "osd_e2e_request_latency_seconds_count", tenant="t") == 4


def test_no_observation_makes_no_series():
    m = Meter("Ingress", replica="a")
    m.observe("osd_e2e_request_latency_seconds", 0.3, n=0, tenant="t")
    assert m.snapshot()["hists"] == {}
    off = Meter("Ingress", MetricsConfig(enabled=False), replica="b")
    off.observe("osd_e2e_request_latency_seconds", 0.3, tenant="t")
    off.set("osd_target_kv_caches", 3)
    off.event("publish", draft="g", version=1)
    snap = off.snapshot()
    assert (snap["hists"], snap["gauges"], snap["events"]) == ({}, {}, [])


def test_an_event_after_eventless_snapshots_is_merged():
    m, hub = Meter("Learner", replica="l"), Hub()
    hub.merge(m.snapshot())
    m.event("publish", draft="g", version=1)
    hub.merge(m.snapshot())
    assert [(e["kind"], e["source"]) for e in hub.events] == [("publish", "Learner")]


def test_retain_forgets_nothing_recent_and_every_silent_replica_without_a_source_list():
    a, b, hub = Meter("Target", replica="a"), Meter("DraftPool", replica="b"), Hub()
    a.inc("osd_requests_total", 2, tenant="t", status="200")
    a.set("osd_target_kv_caches", 3)
    b.set("osd_draft_pool_requests_running", 5)
    hub.merge(a.snapshot())
    hub.merge(b.snapshot())
    hub.retain({"a", "b"})
    a.inc("osd_requests_total", 1, tenant="t", status="200")
    hub.merge(a.snapshot())  # the epoch's last snapshot was kept: only the new request is added
    assert value(hub, "osd_requests_total", tenant="t", status="200") == 3
    hub.retain({"a"})  # no source list: every replica that did not answer is dropped
    assert value(hub, "osd_draft_pool_requests_running") == 0 and value(hub, "osd_target_kv_caches") == 3
    assert hub.replicas_of("DraftPool") == set() and hub.replicas_of("Target") == {"a"}


def test_a_version_older_than_every_kept_one_is_counted_as_old():
    cfg = MetricsConfig(keep_versions=2)
    m, hub = Meter("DraftPool", cfg, replica="a"), Hub(cfg)
    for v in (4, 5, 3):  # a replica still serving version 3 reports after 4 and 5 were seen
        m.inc("osd_spec_decode_draft_version_draft_tokens_total", v, draft="g", draft_version=v)
        hub.merge(m.snapshot())
    got = {dict(k[1])["draft_version"]: v for k, v in samples(hub).items()
           if k[0] == "osd_spec_decode_draft_version_draft_tokens_total"}
    assert got == {"4": 4, "5": 5, "old": 3}
    assert hub.versions["g"] == [4, 5]


def test_stats_series_are_windowed_over_the_trailing_window():
    """sample_s = 10 s: the window (30 s) is 3 samples back; each point's acceptance, rates and
    latency quantiles come from what happened since the point 3 samples before it."""
    cfg = MetricsConfig(sample_s=10.0, acceptance_window_s=30.0)
    d, i, hub = Meter("DraftPool", cfg, replica="d"), Meter("Ingress", cfg, replica="i"), Hub(cfg)
    spec = {**SPEC, "domain": "sql"}
    per_sample = [(3, 1, 0.3), (3, 2, 0.3), (0, 0, 3.0), (6, 6, 3.0), (3, 0, 3.0)]  # drafted, accepted, latency
    hub.sample(now=1000.1234)
    for n, (drafted, accepted, lat) in enumerate(per_sample, start=1):
        d.inc("osd_spec_decode_num_draft_tokens_total", drafted, **spec)
        d.inc("osd_spec_decode_num_accepted_tokens_total", accepted, **spec)
        i.inc("osd_requests_total", n, tenant="t1", status="200")  # n requests in the n-th interval
        i.inc("osd_generation_tokens_total", 10 * n, tenant="t1", status="200")
        i.observe("osd_e2e_request_latency_seconds", lat, n=n, tenant="t1")
        i.observe("osd_time_to_first_token_seconds", lat / 10, n=n, tenant="t1")
        hub.merge(d.snapshot())
        hub.merge(i.snapshot())
        hub.sample(now=1000.1234 + 10 * n)
    s = hub.stats()["series"]
    assert s["t"][:2] == [1000.123, 1010.123]
    # drafted, accepted since 3 samples before (or the first): (3, 1), (6, 3), (6, 3), (9, 8), (9, 6)
    assert s["acceptance"]["sql"] == [None, round(1 / 3, 4), 0.5, 0.5, round(8 / 9, 4), round(6 / 9, 4)]
    assert s["drafted"]["sql"] == [0, 3, 6, 6, 9, 9]  # what each point stands on
    # requests in the window / its seconds: 1/10, 3/20, 6/30, then (2+3+4)/30, (3+4+5)/30
    assert s["requests_per_s"] == [None, 0.1, 0.15, 0.2, 0.3, 0.4]
    assert s["tokens_per_s"] == [None, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert s["errors_per_s"] == [None, 0.0, 0.0, 0.0, 0.0, 0.0]
    buckets = CATALOG["osd_e2e_request_latency_seconds"].buckets
    assert s["latency_p50_s"][0] is None and s["latency_p50_s"][1] == quantile(0.5, buckets, _counts(buckets, {0.3: 1}))
    # the requests of each point's window: point 2, intervals 1-2; point 4, 2-4; point 5, 3-5
    assert s["latency_p50_s"][2] == quantile(0.5, buckets, _counts(buckets, {0.3: 3}))
    assert s["latency_p50_s"][5] == quantile(0.5, buckets, _counts(buckets, {3.0: 12}))
    assert s["latency_p95_s"][4] == quantile(0.95, buckets, _counts(buckets, {0.3: 2, 3.0: 7}))
    assert s["latency_p50_s"][4] == quantile(0.5, buckets, _counts(buckets, {0.3: 2, 3.0: 7}))
    assert s["latency_p50_s"][4] != s["latency_p95_s"][4]
    assert s["ttft_p50_s"][2] == quantile(0.5, buckets, _counts(buckets, {0.03: 3}))
    assert s["ttft_p50_s"][4] == quantile(0.5, buckets, _counts(buckets, {0.03: 2, 0.3: 7}))


def test_stats_windows_of_one_sample_sub_second_rates_and_the_overflow_bucket():
    """A sample period longer than the window: each point is against the one before it. Rates over
    sub-second gaps keep four decimals; one drafted token is enough for an acceptance figure; a
    latency beyond the highest bound stays in the quantiles (at that bound)."""
    cfg = MetricsConfig(sample_s=60.0, acceptance_window_s=30.0)
    d, i, hub = Meter("DraftPool", cfg, replica="d"), Meter("Ingress", cfg, replica="i"), Hub(cfg)
    hub.sample(now=50.0)
    d.inc("osd_spec_decode_num_draft_tokens_total", 1, **SPEC)
    d.inc("osd_spec_decode_num_accepted_tokens_total", 1, **SPEC)
    i.inc("osd_requests_total", 1, tenant="t1", status="200")
    i.observe("osd_e2e_request_latency_seconds", 0.3, n=3, tenant="t1")
    i.observe("osd_e2e_request_latency_seconds", 1e4, tenant="t1")
    i.observe("osd_time_to_first_token_seconds", 0.03, tenant="t1")
    i.observe("osd_time_to_first_token_seconds", 1e4, tenant="t1")
    for m in (d, i):
        hub.merge(m.snapshot())
    hub.sample(now=50.6)
    i.inc("osd_requests_total", 1, tenant="t1", status="200")
    hub.merge(i.snapshot())
    hub.sample(now=53.6)
    s = hub.stats()["series"]
    assert s["acceptance"]["code"] == [None, 1.0, None]  # the third point: nothing drafted since the second
    assert s["requests_per_s"] == [None, round(1 / 0.6, 4), round(1 / 3, 4)]
    buckets = CATALOG["osd_e2e_request_latency_seconds"].buckets
    assert s["latency_p95_s"][1] == buckets[-1] and s["latency_p50_s"][1] < 0.5
    assert s["ttft_p50_s"][1] == quantile(0.5, buckets, _counts(buckets, {0.03: 1, 1e4: 1}))


def _counts(buckets: tuple[float, ...], obs: dict[float, int]) -> list[float]:
    """Non-cumulative bucket counts (last: +Inf) of ``obs`` (value -> how many)."""
    import bisect

    out = [0.0] * (len(buckets) + 1)
    for v, n in obs.items():
        out[bisect.bisect_left(buckets, v)] += n
    return out


def test_stats_totals_scope_running_gauges_and_events():
    cfg = MetricsConfig(events=500)
    a, b, lm, hub = Meter("Target", cfg, replica="a"), Meter("Target", cfg, replica="b"), Meter("Learner", cfg, replica="l"), Hub(cfg)
    a.set("osd_target_kv_caches", 3)
    b.set("osd_target_kv_caches", 4)
    a.inc("osd_spec_decode_num_draft_tokens_total", 8, **SPEC)
    a.inc("osd_spec_decode_num_accepted_tokens_total", 2, **SPEC)
    a.inc("osd_spec_decode_num_draft_tokens_total", 5, **{**SPEC, "domain": "sql"})
    a.inc("osd_spec_decode_num_accepted_tokens_total", 0, **{**SPEC, "domain": "sql"})
    for n in range(150):
        lm.event("publish", draft="g", version=n)
    for m in (a, b, lm):
        hub.merge(m.snapshot())
    s = hub.stats()
    assert s["scope"] == "all" and hub.stats("t1")["scope"] == "t1"
    assert s["running"]["kv_caches"] == 7
    assert s["acceptance"]["code"] == {"drafted": 8, "accepted": 2, "alpha": 0.25, "name": None}  # a named domain: no words
    assert s["acceptance"]["sql"] == {"drafted": 5, "accepted": 0, "alpha": 0.0, "name": None}  # none accepted is 0, not unknown
    assert [e["version"] for e in s["events"]] == list(range(50, 150))  # the newest 100


def test_stats_learner_figures_add_up_by_result():
    lm, hub = Meter("Learner", replica="l"), Hub()
    for draft in ("g", "d:sql"):
        lm.inc("osd_learner_records_total", 10, draft=draft)
        lm.inc("osd_learner_steps_total", 4, draft=draft)
        lm.inc("osd_learner_train_seconds_total", 2.0, draft=draft)
    lm.inc("osd_learner_rounds_total", 3, draft="g", result="published")
    lm.inc("osd_learner_rounds_total", 1, draft="d:sql", result="rejected")
    lm.set("osd_learner_loss", 1.5, draft="g")
    lm.set("osd_learner_paused", 1)
    lm.inc("osd_learner_against_traffic_seconds_total", 1.25)
    lm.inc("osd_learner_rounds_cut_total", 2, draft="g")
    hub.merge(lm.snapshot())
    got = hub.stats()["learner"]
    assert got == {"records": 20, "published": 3, "rejected": 1, "rounds": 4, "steps": 8, "cut_rounds": 2, "step_seconds": 0.5,
                   "against_traffic_s": 1.25, "paused": True, "loss": {"g": 1.5}}


class _StatsServer:
    """A real HTTP server on 127.0.0.1 answering GET /v1/stats with a hub's stats (or an error),
    recording each request's path and Authorization header."""

    def __init__(self, stats: dict, status: int = 200):
        import http.server
        import json
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                seen.append((self.path, self.headers.get("Authorization")))
                body = json.dumps(stats if status == 200 else {"error": {"message": "invalid API key"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _admin_stats() -> dict:
    cfg = MetricsConfig(sample_s=1.0)
    m, lm, hub = Meter("DraftPool", cfg, replica="a"), Meter("Learner", cfg, replica="l"), Hub(cfg)
    hub.sample(now=10.0)
    m.inc("osd_spec_decode_num_draft_tokens_total", 8, **SPEC)
    m.inc("osd_spec_decode_num_accepted_tokens_total", 3, **SPEC)
    for v in range(1, 8):
        lm.event("publish", draft="general", version=v)
    for meter in (m, lm):
        hub.merge(meter.snapshot())
    hub.sample(now=11.0)
    hub.sample(now=12.0)  # nothing drafted in the last window: the recent alpha is that of the one before
    return hub.stats()


def test_top_fetches_the_stats_with_the_key_and_refreshes_as_many_times_as_told(capsys):
    from telemetry.top import main

    server = _StatsServer(_admin_stats())
    try:
        assert main(["--url", server.url + "/", "--key", "sk-1", "--once"]) == 0
        screen = capsys.readouterr().out
        assert server.seen == [("/v1/stats", "Bearer sk-1")]
        assert main(["--url", server.url, "--interval", "0.01", "--iterations", "2"]) == 0
        assert server.seen[1:] == [("/v1/stats", None)] * 3  # the first frame, then two refreshes
    finally:
        server.close()
    lines = screen.splitlines()
    row = next(line for line in lines if line.startswith(" code "))  # the domain column is left-aligned
    assert row.split()[1:3] == ["0.375", "0.375"]  # alpha, and the recent alpha of the last window that drafted
    assert "latency p50" in screen and "drafts general" not in screen and "drafts -" in screen
    shown = [line.split()[-1] for line in lines if " publish general v" in line]
    assert shown == ["v7", "v6", "v5", "v4", "v3"]  # the newest five events, newest first


def test_top_says_why_it_has_no_figures(capsys):
    from telemetry.top import main

    server = _StatsServer({}, status=401)
    try:
        assert main(["--url", server.url, "--once"]) == 0
        assert "HTTP 401: invalid API key" in capsys.readouterr().out
    finally:
        server.close()
    with pytest.raises(SystemExit):
        main(["--interval", "0", "--once"])


def test_the_acceptance_chart_draws_the_busiest_domains_and_adds_up_the_rest_over_its_own_window():
    """chart_domains 2 of 4 domains: the two with the most draft tokens are lines, the other two one
    line of their sums; acceptance looks back acceptance_window_s (40 s = 4 samples), not 30 s."""
    cfg = MetricsConfig(sample_s=10.0, chart_domains=2, acceptance_window_s=40.0)
    d, hub = Meter("DraftPool", cfg, replica="d"), Hub(cfg)
    hub.sample(now=0.0)
    per_domain = {"a": (40, 30), "b": (30, 3), "c": (8, 8), "e": (2, 0)}  # drafted, accepted per interval
    for n in range(1, 6):
        for dom, (drafted, accepted) in per_domain.items():
            d.inc("osd_spec_decode_num_draft_tokens_total", drafted, **{**SPEC, "domain": dom})
            d.inc("osd_spec_decode_num_accepted_tokens_total", accepted, **{**SPEC, "domain": dom})
        hub.merge(d.snapshot())
        hub.sample(now=10.0 * n)
    s = hub.stats()["series"]
    assert sorted(s["acceptance"]) == ["(other domains)", "a", "b"]
    assert s["acceptance"]["(other domains)"][-1] == round(8 / 10, 4) and s["drafted"]["(other domains)"][-1] == 40  # 4 intervals
    assert s["drafted"]["a"][-1] == 160 and s["acceptance"]["b"][-1] == 0.1
    assert sorted(hub.stats()["acceptance"]) == ["a", "b", "c", "e"]  # the table keeps every domain
    d.inc("osd_spec_decode_num_draft_tokens_total", 1000, **{**SPEC, "domain": "other"})  # past the label cap
    hub.merge(d.snapshot())
    hub.sample(now=60.0)
    assert sorted(hub.stats()["series"]["acceptance"]) == ["(other domains)", "a", "b"]  # never a line of its own


def test_per_domain_tokens_per_step_and_what_each_proposer_drafted_scoped_by_tenant():
    d, hub = Meter("DraftPool", replica="d"), Hub(MetricsConfig())
    sql = {**SPEC, "domain": "sql"}
    for emitted, cost in ((3, 1.5), (1, 1.0), (2, 1.25), (2, 1.25)):  # four steps of alice's sql: 8 tokens for 5 plain steps
        d.inc("osd_spec_decode_num_steps_total", **sql)
        d.inc("osd_spec_decode_emitted_tokens_total", emitted, **sql)
        d.inc("osd_spec_decode_step_cost_total", cost, **sql)
    for proposer, drafted, accepted in (("suffix", 6, 5), ("draft", 2, 0), ("suffix", 4, 1)):
        d.inc("osd_spec_decode_proposer_draft_tokens_total", drafted, tenant=SPEC["tenant"], domain="sql", proposer=proposer)
        d.inc("osd_spec_decode_proposer_accepted_tokens_total", accepted, tenant=SPEC["tenant"], domain="sql", proposer=proposer)
    d.inc("osd_spec_decode_num_steps_total", **{**SPEC, "tenant": "bob", "domain": "chat"})
    hub.merge(d.snapshot())
    got = hub.stats()["domains"]
    assert got["sql"]["tokens_per_step"] == 2.0 and got["chat"]["tokens_per_step"] == 0.0
    assert got["sql"]["speedup"] == 8 / 5 and got["chat"]["speedup"] is None  # chat's step carried no cost
    assert got["sql"]["proposers"] == {"suffix": {"drafted": 10, "accepted": 6, "share": 10 / 12, "alpha": 0.6},
                                       "draft": {"drafted": 2, "accepted": 0, "share": 2 / 12, "alpha": 0.0}}
    assert set(hub.stats(tenant="bob", admin=False)["domains"]) == {"chat"}  # a tenant sees its own domains
