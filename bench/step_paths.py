"""``python -m bench.step_paths``: one target step on the fast path's three ways of running its
layers, alternated in one process: every decoder layer in one native call (``fused``, the
default), layer by layer from Python with the native rotary write (``layered``), and layer by
layer with torch's rotary ops (``torch-rotary``). The serve config's target (int4), a
``--context``-token prefix, steps of ``sequences x tokens``; the median of ``--repeats`` each,
``--rounds`` times."""

from __future__ import annotations

import argparse
import contextlib
import time

from bench.bench import write_json

SHAPES = ((1, 1), (1, 5), (8, 1), (8, 5))
PATHS = ("fused", "layered", "torch-rotary")


def measure(context: int = 128, repeats: int = 30, rounds: int = 2, threads: int = 2) -> list[dict]:
    import torch

    from deployments.launch import read_config
    from drafts.build import load_weights
    from speculative.fast import FastRunner
    from speculative.runner import ForwardCall

    torch.set_num_threads(threads)
    _, cfg, _ = read_config()
    r = FastRunner(load_weights(cfg.engine.model), name="target", bits=4)
    if r._table is None:
        raise SystemExit("the one-call path is not available here (a kernel did not build)")
    rope = r.rope_kernel
    prefix = list(range(100, 100 + context))

    def step_ms(shape, path) -> float:
        r.rope_kernel = None if path == "torch-rotary" else rope
        seqs, tokens = shape
        with contextlib.nullcontext() if path == "fused" else r.layer_by_layer():
            for b in range(seqs):
                r.forward(f"s{b}", 0, prefix)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r.forward_batch([ForwardCall(f"s{b}", context, [5] * tokens, tokens) for b in range(seqs)])
                times.append(time.perf_counter() - t0)
            for b in range(seqs):
                r.release(f"s{b}")
        return 1e3 * sorted(times)[len(times) // 2]

    rows = []
    for rnd in range(rounds):
        for shape in SHAPES:
            rows.append({"round": rnd, "sequences": shape[0], "tokens": shape[1],
                         **{f"{p}_ms": step_ms(shape, p) for p in PATHS}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_paths", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = measure(args.context, args.repeats, args.rounds)
    for r in rows:
        print(f"round {r['round']}, {r['sequences']} x {r['tokens']}: one call {r['fused_ms']:.2f} ms, "
              f"layer by layer {r['layered_ms']:.2f} ms, torch rotary {r['torch-rotary_ms']:.2f} ms")
    write_json({"context": args.context, "repeats": args.repeats, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
