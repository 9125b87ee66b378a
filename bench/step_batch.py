"""What one target forward costs as sequences share it (``python -m bench.step_batch``).

Times the fast runtime's forward over B sequences of n new tokens each after ``--context`` cached
positions (median of ``--repeats``), and fits the engine loop's cost model (``StepCost``: base +
per token + per sequence) that caps drafting in shared steps. Loopback-free, in-process, CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from config import ModelConfig
from speculative.fast import FastRunner
from speculative.models import load_weights
from speculative.runner import ForwardCall
from speculative.scheduler import calibrate_step_cost


def step_times(runner: FastRunner, shapes: list[tuple[int, int]], context: int, repeats: int) -> list[dict]:
    seqs = [f"s{b}" for b in range(max(b for b, _ in shapes))]
    for b, s in enumerate(seqs):
        runner.forward(s, 0, [(100 + b + i) % runner.vocab_size for i in range(context)])
    out = []
    for b, n in shapes:
        calls = [ForwardCall(s, context, [5] * n, n) for s in seqs[:b]]
        xs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward_batch(calls)
            xs.append(time.perf_counter() - t0)
        out.append({"sequences": b, "tokens_each": n, "ms": round(1e3 * statistics.median(xs), 2)})
    for s in seqs:
        runner.release(s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_batch", description=__doc__)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runner = FastRunner(load_weights(ModelConfig()), name="target", bits=4)
    shapes = [(1, 1), (1, 8), (8, 1), (8, 2), (8, 4), (8, 7)]
    rows = step_times(runner, shapes, args.context, args.repeats)
    cost = calibrate_step_cost(runner)
    for r in rows:
        print(f"{r['sequences']} sequences x {r['tokens_each']} tokens: {r['ms']:.1f} ms")
    print(f"fitted step cost: {1e3 * cost.base:.1f} ms + {1e3 * cost.per_token:.2f} ms a token + "
          f"{1e3 * cost.per_seq:.2f} ms a sequence")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "threads": args.threads, "rows": rows,
                       "step_cost_s": {"base": cost.base, "per_token": cost.per_token, "per_seq": cost.per_seq}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
