"""``osd bench-serve``: drive a running server over HTTP with a workload, at several concurrencies.

Each level sends ``--n`` chat requests (round-robin over the workload's domains) from that many
client threads, streaming (SSE) so that time to first token and inter-token gaps are seen as a
client sees them; a level stops at ``--n`` requests or ``--level-seconds``, whichever comes first.
Reported per level: output tokens/s (aggregate), TTFT and inter-token latency p50/p99, request
latency p50/p99, acceptance per workload domain (from each response's usage extension), errors
by status. ``--inprocess`` also decodes the same prompts with the in-process engine (same engine
config as the server's ``serve_config.yaml``, greedy, one at a time) for the ratio of concurrency 1
to it. ``--metrics-cost R`` starts the server itself, with metrics off and on in turn, R rounds, and
reports tokens/s on over off. ``--load SECONDS`` runs the bounded load test of
:mod:`bench.load` instead. ``--against URL`` sends the same prompts at the same concurrencies to
another OpenAI-compatible server (e.g. llama.cpp's ``llama-server``) in the same run, level by
level in turn (ours, then theirs, at each concurrency), and reports the ratio. ``--distinct-levels``
gives each level prompts of its own, so that no level meets prompts an earlier one sent (cached
prefixes, suffix trees). ``--turns T``: each client holds conversations of T turns, re-sending the
history every turn. Loopback only.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from tqdm import tqdm

from .bench import select
from workloads import load_workload, load_workloads

DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "data" / "workload.jsonl"


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def one_request(client, model: str, text: str | list[dict], max_tokens: int) -> dict:
    """One streamed chat request (a user's text, or a conversation's messages): token arrival
    times and the final usage (or the error status)."""
    import openai

    t0 = time.perf_counter()
    arrivals, usage, text_out = [], None, []
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    try:
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter() - t0)
                text_out.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
    except openai.APIStatusError as e:
        return {"status": e.status_code, "seconds": time.perf_counter() - t0}
    except openai.APIConnectionError:
        return {"status": "connection", "seconds": time.perf_counter() - t0}
    except openai.APIError:  # an error event inside a stream that had started with 200
        return {"status": "stream-error", "seconds": time.perf_counter() - t0}
    return {"status": 200, "seconds": time.perf_counter() - t0, "arrivals": arrivals, "usage": usage, "text": "".join(text_out)}


def run_level(client, model: str, records, concurrency: int, max_tokens: int, level_seconds: float,
              turns: int = 1) -> dict:
    """``records`` from ``concurrency`` clients at once; ``turns`` > 1: each client holds
    conversations of that many consecutive records, every turn re-sending the history (its earlier
    questions and the server's answers), as a chat client does."""
    results: list[tuple[object, dict]] = []
    lock, stop_at = threading.Lock(), time.perf_counter() + level_seconds
    it = iter([records[i : i + turns] for i in range(0, len(records), turns)])
    bar = tqdm(total=len(records), desc=f"concurrency {concurrency}", unit="req", leave=False)

    def worker():
        while time.perf_counter() < stop_at:
            with lock:
                conversation = next(it, None)
            if conversation is None:
                return
            history: list[dict] = []
            for rec in conversation:
                history.append({"role": "user", "content": rec.text})
                res = one_request(client, model, list(history), max_tokens)
                with lock:
                    results.append((rec, res))
                    bar.update(1)
                if res["status"] != 200:
                    break
                history.append({"role": "assistant", "content": res["text"]})

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    bar.close()
    return summarise_level(results, concurrency, wall)


def summarise_level(results, concurrency: int, wall: float) -> dict:
    # a server that sends no usage (or no speculative extension): its tokens are the chunks it streamed
    ok = [(rec, r) for rec, r in results if r["status"] == 200 and (r["usage"] or r["arrivals"])]
    errors: dict[str, int] = defaultdict(int)
    for _, r in results:
        if r["status"] != 200:
            errors[str(r["status"])] += 1
    tokens = sum(r["usage"]["completion_tokens"] if r["usage"] else len(r["arrivals"]) for _, r in ok)
    ttft = [r["arrivals"][0] for _, r in ok if r["arrivals"]]
    itl = [b - a for _, r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    lat = [r["seconds"] for _, r in ok]
    by_domain: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    wait = target = steps = 0.0
    for rec, r in ok:
        spec = (r["usage"] or {}).get("speculative")
        if spec is None:
            continue
        by_domain[rec.domain][0] += spec["accepted"]
        by_domain[rec.domain][1] += spec["proposed"]
        steps += spec["steps"]
        wait += spec.get("verify_wait_ms", 0.0) * spec["steps"]
        target += spec.get("target_ms", 0.0) * spec["steps"]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(ok),
        "errors": dict(errors),
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else None,
        "ttft_ms": {"p50": _ms(_pct(ttft, 50)), "p99": _ms(_pct(ttft, 99))},
        "itl_ms": {"p50": _ms(_pct(itl, 50)), "p99": _ms(_pct(itl, 99))},
        "latency_ms": {"p50": _ms(_pct(lat, 50)), "p99": _ms(_pct(lat, 99))},
        "alpha_by_domain": {d: (a / p if p else None) for d, (a, p) in sorted(by_domain.items())},
        "steps": int(steps),
        # per speculative step: waiting on verification, and the target forward's share of it
        "verify_wait_ms_per_step": wait / steps if steps else None,
        "target_ms_per_step": target / steps if steps else None,
        "outputs": [r.get("text") for _, r in results],
    }


def metrics_cost(records, rounds: int, concurrency: int, max_tokens: int, config: str | None, port: int) -> dict:
    """Serving tokens/s with metrics off and on: the server is started on each setting in turn
    (off, on, off, on, ...: drift hits both), the same requests each time, the learner off in both
    (its rounds would add noise unrelated to metrics)."""
    import tempfile

    import openai
    import yaml

    from deployments import launch

    doc = yaml.safe_load(Path(config or launch.DEFAULT_CONFIG).read_text())
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for enabled in (False, True):
                args = doc["applications"][0]["args"]
                args["metrics"] = {**(args.get("metrics") or {}), "enabled": enabled}
                args["learner"] = {**(args.get("learner") or {}), "enabled": False}
                path = Path(tmp) / f"metrics_{enabled}.yaml"
                path.write_text(yaml.safe_dump(doc))
                url = launch.start(path, port=port, temp_dir=str(Path(tmp) / f"ray{r}{int(enabled)}"))
                try:
                    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
                    model = client.models.list().data[0].id
                    run_level(client, model, records[:concurrency], concurrency, max_tokens, 600.0)  # warm up
                    level = run_level(client, model, records, concurrency, max_tokens, 600.0)
                finally:
                    from ray import serve
                    import ray

                    serve.shutdown()
                    ray.shutdown()
                level.pop("outputs")
                runs.append({"round": r, "metrics": enabled, **level})
                print(f"round {r} metrics {'on ' if enabled else 'off'}: {level['tokens_per_s']:.2f} tok/s "
                      f"({level['ok']}/{level['requests']} ok)", flush=True)
    on = [x["tokens_per_s"] for x in runs if x["metrics"]]
    off = [x["tokens_per_s"] for x in runs if not x["metrics"]]
    return {"runs": runs, "on_tokens_per_s": float(np.mean(on)), "off_tokens_per_s": float(np.mean(off)),
            "ratio_on_to_off": float(np.mean(on) / np.mean(off)),
            "ratio_per_round": [a / b for a, b in zip(on, off)]}


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 1)


def inprocess_tokens_per_s(records, max_tokens: int, config: str | None) -> dict:
    """The in-process engine (the server config's engine, two torch threads) on the same prompts."""
    from config import SamplingParams
    from deployments.launch import read_config
    from drafts.build import build_engine

    _, cfg, _ = read_config(config) if config else read_config()
    engine_cfg = cfg.engine.model_copy(update={"model": cfg.engine.model.model_copy(update={"num_threads": 2})})
    engine = build_engine(engine_cfg)
    tokens, t0, outputs = 0, time.perf_counter(), []
    for rec in tqdm(records, desc="in-process", unit="req", leave=False):
        gen = engine.generate(rec.text, SamplingParams(max_tokens=max_tokens))
        tokens += len(gen.token_ids)
        outputs.append(gen.text)
    wall = time.perf_counter() - t0
    return {"requests": len(records), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "outputs": outputs}


def proposer_totals(url: str, api_key: str = "none") -> dict[str, list[float]]:
    """The server's ``/metrics``: draft tokens proposed and accepted per proposer ("draft" for the
    learned draft, "suffix", "ngram"), summed over tenants and domains: {proposer: [proposed, accepted]}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url.rstrip("/") + "/metrics", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            for i, name in enumerate(("osd_spec_decode_proposer_draft_tokens_total",
                                      "osd_spec_decode_proposer_accepted_tokens_total")):
                if smp.name == name:
                    out[smp.labels["proposer"]][i] += smp.value
    return dict(out)


def learning_curve(client, model: str, records, concurrency: int, max_tokens: int, window: int,
                   metrics_url: str | None = None, api_key: str = "none", rate: float | None = None,
                   seed: int = 0) -> dict:
    """Serve ``records`` in order (``concurrency`` at a time) while the learner runs: acceptance per
    workload domain over consecutive windows of ``window`` requests, and the draft versions served.
    With ``metrics_url``: the server's ``/metrics`` is read each time ``window`` more requests have
    finished, for each proposer's acceptance (the learned draft's apart from the suffix tree's) and
    the output tokens/s over that window. The metrics replica adds up the replicas' counts every
    ``metrics.sample_s`` (2 s in serve_config.yaml), so a window's edges lag by up to that.

    ``rate``: open-loop arrivals instead, as traffic comes to a service: request i is sent at the
    i-th time of a Poisson process of ``rate`` requests a second (exponential gaps, seeded), whether
    or not the earlier ones have finished (``concurrency`` caps those in flight; one sent late is
    counted in ``late``). Traffic then leaves gaps, where a learner that trains between requests
    runs; a window's tokens/s is arrival-bound, so each window also reports the requests' own
    speed (their output tokens over their seconds, time to first token included)."""
    rows, lock, it = [], threading.Lock(), iter(enumerate(records))
    sends = None
    if rate is not None:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(records))
        sends = np.cumsum(gaps) - gaps[0]  # the first at once
    late = [0]
    t_start = time.perf_counter()
    bar = tqdm(total=len(records), desc="learning curve", unit="req", leave=False)
    edges: list[tuple[float, int, dict]] = []  # (time, output tokens so far, proposer totals)
    done = [0, 0]  # requests finished, output tokens

    def edge():
        if metrics_url is not None:
            with lock:
                tokens = done[1]
            edges.append((time.perf_counter(), tokens, proposer_totals(metrics_url, api_key)))

    def worker():
        while True:
            with lock:
                item = next(it, None)
            if item is None:
                return
            i, rec = item
            if sends is not None:
                wait = t_start + sends[i] - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                elif wait < -0.05:
                    with lock:
                        late[0] += 1
            res = one_request(client, model, rec.text, max_tokens)
            with lock:
                usage = res.get("usage") or {}
                spec = usage.get("speculative")
                rows.append({"i": i, "domain": rec.domain, "status": res["status"], "seconds": res["seconds"],
                             "completion_tokens": usage.get("completion_tokens", 0),
                             **({k: spec[k] for k in ("accepted", "proposed", "draft_id", "draft_version")} if spec else {})})
                done[0] += 1
                done[1] += (res.get("usage") or {}).get("completion_tokens", 0)
                at_edge = done[0] % window == 0 or done[0] == len(records)
                bar.update(1)
            if at_edge:
                edge()

    edge()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    bar.close()
    out = {"requests": len(rows), "window": window, "windows": curve_windows(rows, edges, window), "rows": rows,
           "seconds": time.perf_counter() - t_start}
    if rate is not None:
        out.update(rate=rate, seed=seed, late=late[0])
    return out


def curve_windows(rows: list[dict], edges: list[tuple[float, int, dict]], window: int) -> list[dict]:
    """The learning curve's windows of ``window`` requests: acceptance per domain from the
    responses' usage (``rows``, by request index) and, where ``edges`` (time, output tokens so far,
    proposer totals, read as each window finished) cover it, tokens/s and each proposer's alpha."""
    rows = sorted(rows, key=lambda r: r["i"])
    edges = sorted(edges, key=lambda e: e[0])
    windows = []
    for n, start in enumerate(range(0, len(rows), window)):
        part = [r for r in rows[start : start + window] if r["status"] == 200]
        dom: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in part:
            dom[r["domain"]][0] += r["accepted"]
            dom[r["domain"]][1] += r["proposed"]
        acc, prop = sum(a for a, _ in dom.values()), sum(p for _, p in dom.values())
        w = {"requests": f"{start + 1}-{start + len(rows[start : start + window])}",
             "alpha": acc / prop if prop else None,
             "alpha_by_domain": {d: (a / p if p else None) for d, (a, p) in sorted(dom.items())},
             "draft_versions": sorted({r["draft_version"] for r in part}),
             "request_tokens_per_s": (sum(r.get("completion_tokens", 0) for r in part) / secs
                                      if (secs := sum(r.get("seconds", 0.0) for r in part)) else None)}
        if n + 1 < len(edges):
            (t0, k0, m0), (t1, k1, m1) = edges[n], edges[n + 1]
            w["tokens_per_s"] = (k1 - k0) / (t1 - t0)
            w["by_proposer"] = {}
            for name in sorted(m1):
                p0, a0 = m0.get(name, [0.0, 0.0])
                proposed, accepted = m1[name][0] - p0, m1[name][1] - a0
                w["by_proposer"][name] = {"proposed": proposed, "accepted": accepted,
                                          "alpha": accepted / proposed if proposed else None}
        windows.append(w)
    return windows


def format_curve(curve: dict) -> str:
    lines = [f"alpha over {curve['requests']} served requests (windows of {curve['window']})"
             + (f", sent at {curve['rate']} a second (Poisson), {curve['late']} sent late:" if "rate" in curve else ":")]
    for w in curve["windows"]:
        dom = " ".join(f"{d}={a:.2f}" for d, a in w["alpha_by_domain"].items() if a is not None)
        overall = f"{w['alpha']:.3f}" if w["alpha"] is not None else "-"
        line = f"  {w['requests']:>9}  alpha {overall}  {dom}  versions {w['draft_versions']}"
        if w.get("request_tokens_per_s") is not None:
            line += f"  a request {w['request_tokens_per_s']:.1f} tok/s"
        if "tokens_per_s" in w:
            by = " ".join(f"{p}={v['alpha']:.3f}/{v['proposed']:.0f}" for p, v in w["by_proposer"].items()
                          if v["alpha"] is not None)
            line += f"  {w['tokens_per_s']:.1f} tok/s  by proposer (alpha/proposed) {by}"
        lines.append(line)
    return "\n".join(lines)


def format_table(result: dict) -> str:
    lines = ["conc  req  ok  tok/s   TTFT p50/p99 ms   ITL p50/p99 ms   latency p50/p99 ms   "
             "verify wait / target ms per step   errors   alpha by domain"]
    for lv in result["levels"]:
        alpha = " ".join(f"{d}={a:.2f}" for d, a in lv["alpha_by_domain"].items() if a is not None)
        wait, tgt = lv["verify_wait_ms_per_step"], lv["target_ms_per_step"]
        per_step = f"{wait:.1f} / {tgt:.1f}" if wait is not None else "-"
        lines.append(
            f"{lv['concurrency']:>4} {lv['requests']:>4} {lv['ok']:>3} {lv['tokens_per_s'] or 0:>6.1f}   "
            f"{lv['ttft_ms']['p50']}/{lv['ttft_ms']['p99']}   {lv['itl_ms']['p50']}/{lv['itl_ms']['p99']}   "
            f"{lv['latency_ms']['p50']}/{lv['latency_ms']['p99']}   {per_step}   {lv['errors'] or '-'}   {alpha}")
    if result.get("inprocess"):
        ip = result["inprocess"]
        lines.append(f"in-process engine: {ip['tokens_per_s']:.1f} tok/s; concurrency 1 / in-process = "
                     f"{result['ratio_c1_to_inprocess']:.2f}")
    c = {lv["concurrency"]: lv["tokens_per_s"] for lv in result["levels"]}
    if 1 in c and max(c) > 1 and c[1]:
        lines.append(f"aggregate tok/s at concurrency {max(c)} / concurrency 1 = {c[max(c)] / c[1]:.2f}")
    if result.get("against"):
        lines.append(f"against {result['against']['url']} (same prompts, same run, levels in turn):")
        for ours, theirs in zip(result["levels"], result["against"]["levels"]):
            a, b = ours["tokens_per_s"] or 0.0, theirs["tokens_per_s"] or 0.0
            lines.append(f"  concurrency {ours['concurrency']}: ours {a:.1f} tok/s, theirs {b:.1f} tok/s "
                         f"({theirs['ok']}/{theirs['requests']} ok, TTFT p50 {theirs['ttft_ms']['p50']} ms): "
                         f"ratio {a / b if b else float('nan'):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="osd bench-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--n", type=int, default=24, help="requests per concurrency level (round-robin over domains)")
    ap.add_argument("--turns", type=int, default=1,
                    help="conversations of this many turns, each re-sending its history (--n counts turns)")
    ap.add_argument("--distinct-levels", action="store_true",
                    help="each level sends prompts of its own (else the same --n at every level: a later level then "
                         "meets prompts the server has cached and its suffix trees hold)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--level-seconds", type=float, default=600.0, help="a level stops after this long")
    ap.add_argument("--inprocess", action="store_true", help="also time the in-process engine on the same prompts")
    ap.add_argument("--config", default=None, help="serve config for --inprocess / --metrics-cost (default serve_config.yaml)")
    ap.add_argument("--curve", type=int, default=0,
                    help="instead of the levels: serve this many records in order while the learner runs, "
                         "alpha per domain per window")
    ap.add_argument("--window", type=int, default=40)
    ap.add_argument("--curve-concurrency", type=int, default=4)
    ap.add_argument("--curve-rate", type=float, default=None,
                    help="with --curve: open-loop arrivals at this many requests a second (Poisson; "
                         "--curve-concurrency caps those in flight) instead of back to back")
    ap.add_argument("--curve-seed", type=int, default=0, help="with --curve-rate: the arrival times' seed")
    ap.add_argument("--curve-order", choices=["domains", "file"], default="domains",
                    help="with --curve: the records round-robin over domains, or in the files' order")
    ap.add_argument("--curve-metrics", action="store_true",
                    help="with --curve: also read /metrics at each window's edge (each proposer's acceptance, tokens/s)")
    ap.add_argument("--sources", nargs="*", default=None,
                    help="with --curve: keep only records of these sources (the part of a record's source before ':'); "
                         "--workload may then name several files, comma-separated, each text read once")
    ap.add_argument("--metrics-cost", type=int, default=0, metavar="ROUNDS",
                    help="instead: start the server (on --config) with metrics off and on, ROUNDS times each, "
                         "alternating; tokens/s on vs off at the first --concurrency")
    ap.add_argument("--port", type=int, default=8000, help="with --metrics-cost: the port of the servers it starts")
    ap.add_argument("--load", type=float, default=0, metavar="SECONDS",
                    help="instead: a bounded load test for SECONDS (bench/load.py): --clients threads, chat and "
                         "completions, streamed and not, then a --burst of requests at once")
    ap.add_argument("--long-prompts", type=int, default=0, metavar="N",
                    help="instead: N prompts of --prompt-chars characters at once (EOS ignored): their time and the "
                         "replicas' memory growth per cached token")
    ap.add_argument("--prompt-chars", type=int, default=12000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--burst", type=int, default=0, help="with --load: this many requests at once at the end")
    ap.add_argument("--against", default=None, metavar="URL",
                    help="another OpenAI-compatible server (e.g. llama-server) driven with the same prompts and "
                         "concurrencies in the same run, level by level in turn")
    ap.add_argument("--against-model", default=None, help="the model name to send to --against (default: its first)")
    ap.add_argument("--against-key", default="none")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for url in (args.url, args.against):
        host = urlparse(url).hostname if url else "127.0.0.1"
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"bench-serve drives loopback servers only, not {host!r}")
    import openai

    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0, timeout=300)
    if args.metrics_cost:
        records = select(load_workload(args.workload), args.n)
        cost = metrics_cost(records, args.metrics_cost, args.concurrency[0], args.max_tokens, args.config, args.port)
        print(f"metrics on / off: {cost['ratio_on_to_off']:.3f} ({cost['on_tokens_per_s']:.2f} vs "
              f"{cost['off_tokens_per_s']:.2f} tok/s; per round {[round(x, 3) for x in cost['ratio_per_round']]})")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"workload": args.workload, "n": len(records), "max_tokens": args.max_tokens,
                                                   "concurrency": args.concurrency[0], **cost}, indent=1))
        return 0
    model = args.model or client.models.list().data[0].id
    if args.load:
        from .load import format_load, run_load

        texts = [r.text for r in load_workload(args.workload)]
        res = run_load(args.url.rstrip("/"), args.api_key, model, texts, args.clients, args.load, args.max_tokens, args.burst)
        print(format_load(res))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"url": args.url, "workload": args.workload, **res}, indent=1))
        return 0 if res["server_errors"] == 0 and res["complete"] == res["served"] else 1
    if args.long_prompts:
        from .load import format_long_prompts, run_long_prompts

        texts = [r.text for r in load_workload(args.workload)]
        res = run_long_prompts(args.url.rstrip("/"), args.api_key, model, texts, args.long_prompts, args.prompt_chars,
                               args.max_tokens)
        print(format_long_prompts(res))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"url": args.url, "workload": args.workload, **res}, indent=1))
        return 0 if res["ok"] == res["requests"] else 1
    if args.curve:
        records = load_workloads(args.workload.split(","), args.sources)
        records = select(records, args.curve) if args.curve_order == "domains" else records[: args.curve]
        curve = learning_curve(client, model, records, args.curve_concurrency, args.max_tokens, args.window,
                               metrics_url=args.url if args.curve_metrics else None, api_key=args.api_key,
                               rate=args.curve_rate, seed=args.curve_seed)
        print(format_curve(curve))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"url": args.url, "workload": args.workload, "max_tokens": args.max_tokens,
                                                   "concurrency": args.curve_concurrency, **curve}, indent=1))
        return 0
    levels = len(args.concurrency) if args.distinct_levels else 1
    pool_records = select(load_workload(args.workload), args.n * levels)
    by_level = [pool_records[i * args.n : (i + 1) * args.n] for i in range(levels)]
    records = by_level[0]
    result = {"url": args.url, "model": model, "workload": args.workload, "n": len(records), "max_tokens": args.max_tokens,
              "distinct_levels": bool(args.distinct_levels), "turns": args.turns, "levels": []}
    other = None
    if args.against:
        other = openai.OpenAI(base_url=args.against.rstrip("/") + "/v1", api_key=args.against_key, max_retries=0, timeout=300)
        result["against"] = {"url": args.against, "model": args.against_model or other.models.list().data[0].id,
                             "levels": []}
    for i, c in enumerate(args.concurrency):  # with --against, each level on both servers in turn: drift falls on both alike
        level_records = by_level[i % levels]
        result["levels"].append(run_level(client, model, level_records, c, args.max_tokens, args.level_seconds, args.turns))
        if other is not None:
            result["against"]["levels"].append(
                run_level(other, result["against"]["model"], level_records, c, args.max_tokens, args.level_seconds, args.turns))
    if args.inprocess:
        result["inprocess"] = inprocess_tokens_per_s(records, args.max_tokens, args.config)
        c1 = next((lv for lv in result["levels"] if lv["concurrency"] == 1), None)
        result["ratio_c1_to_inprocess"] = c1["tokens_per_s"] / result["inprocess"]["tokens_per_s"] if c1 else None
        if c1:
            result["c1_equals_inprocess"] = sum(a == b for a, b in zip(c1["outputs"], result["inprocess"]["outputs"]))
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, ensure_ascii=False))
    return 0
