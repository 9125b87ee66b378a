"""``python -m bench.draft_batch``: what the engine loop saves by running the learned draft's
forwards of several sequences together. The serve config's draft (its runtime, as served) takes
one-token steps at a ``--context``-token prefix for 1, 4 and 8 sequences, once batched (one
forward, as the loop's propose phase runs a round) and once one sequence at a time (as each
proposal ran its own); best of ``--repeats``."""

from __future__ import annotations

import argparse
import time

from bench.bench import write_json


def measure(sequences: tuple[int, ...] = (1, 4, 8), context: int = 100, repeats: int = 20, threads: int = 2) -> list[dict]:
    import torch

    from deployments.launch import read_config
    from drafts.build import build_engine
    from speculative.proposers import learned_draft
    from speculative.runner import ForwardCall

    _, cfg, _ = read_config()
    engine_cfg = cfg.engine.model_copy(update={"model": cfg.engine.model.model_copy(update={"num_threads": threads})})
    draft = learned_draft(build_engine(engine_cfg, calibrate=False).proposer)
    if draft is None:
        raise SystemExit("the serve config's engine has no learned draft")
    runner = draft.runner
    torch.set_num_threads(threads)
    rows = []
    for n in sequences:
        ids = [f"s{i}" for i in range(n)]
        for s in ids:
            runner.forward(s, 0, list(range(10, 10 + context)))
        batched = alone = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward_batch([ForwardCall(s, context, [5], 1) for s in ids])
            batched = min(batched, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for s in ids:
                runner.forward(s, context, [5], 1)
            alone = min(alone, time.perf_counter() - t0)
        for s in ids:
            runner.release(s)
        rows.append({"sequences": n, "batched_ms": 1e3 * batched, "one_by_one_ms": 1e3 * alone})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.draft_batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = measure(context=args.context, repeats=args.repeats)
    for r in rows:
        print(f"{r['sequences']} sequences: one round batched {r['batched_ms']:.2f} ms, one by one {r['one_by_one_ms']:.2f} ms")
    write_json({"context": args.context, "repeats": args.repeats, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
