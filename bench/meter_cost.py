"""CPU cost of metrics, measured directly (``python -m bench.meter_cost``): what one speculative
step and one request add to the serving path, and what one pull of a replica's snapshot costs the
replica and the hub. With the measured step rate this bounds the share of serving time metrics take,
without the run-to-run noise of an end-to-end comparison."""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

from config import MetricsConfig
from telemetry import Hub, Meter


def _per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def measure(n: int = 20000, k: int = 4) -> dict:
    from deployments.drafts import DraftPool
    from deployments.ingress import Timing

    pool = SimpleNamespace(meter=Meter("DraftPool", MetricsConfig(), replica="p"))
    step = SimpleNamespace(draft_tokens=[1] * k, accepted=2, draft_s=0.01, source="draft", draft_version=3)
    labels = {"tenant": "t", "domain": "code", "language": "en", "draft": "general"}
    step_s = _per_call(lambda: DraftPool._count_step(pool, step, labels, 0.1), n)

    ingress = Meter("Ingress", MetricsConfig(), replica="i")

    def request():
        t = Timing(ingress, "t")
        for _ in range(10):
            t.chunk()
        t.done(200, {"prompt_tokens": 20, "completion_tokens": 30})

    request_s = _per_call(request, n // 10)
    hub = Hub()
    snap_s = _per_call(pool.meter.snapshot, 2000)
    snaps = [pool.meter.snapshot() for _ in range(2000)]
    it = iter(snaps)
    merge_s = _per_call(lambda: hub.merge(next(it)), 2000)
    return {"k": k, "step_us": step_s * 1e6, "request_us_10_chunks": request_s * 1e6,
            "snapshot_us": snap_s * 1e6, "merge_us": merge_s * 1e6,
            "series_in_snapshot": len(snaps[-1]["counters"]) + len(snaps[-1]["hists"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.meter_cost", description=__doc__)
    ap.add_argument("--steps-per-s", type=float, default=12.0, help="speculative steps per second served (measured)")
    ap.add_argument("--requests-per-s", type=float, default=0.5)
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--replicas", type=int, default=5, help="replicas pulled per period")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    m = measure()
    cpu_s_per_s = (m["step_us"] * args.steps_per_s + m["request_us_10_chunks"] * args.requests_per_s
                   + (m["snapshot_us"] + m["merge_us"]) * args.replicas / args.sample_s) * 1e-6
    m.update(vars(args), cpu_share=cpu_s_per_s)
    print(f"one step (k={m['k']}): {m['step_us']:.1f} us; one request (10 chunks): {m['request_us_10_chunks']:.1f} us; "
          f"snapshot {m['snapshot_us']:.1f} us + merge {m['merge_us']:.1f} us per replica and pull "
          f"({m['series_in_snapshot']} series)")
    print(f"at {args.steps_per_s} steps/s, {args.requests_per_s} requests/s, {args.replicas} replicas every "
          f"{args.sample_s} s: {cpu_s_per_s * 1e3:.2f} ms of CPU per second = {100 * cpu_s_per_s:.3f}% of one core")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
