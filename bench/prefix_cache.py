"""``python -m bench.prefix_cache``: target-only decoding with the KV pool's prefix caching on and
off, in one process, prompt by prompt (the order alternating, so drift falls on both): tokens/s
and the prompt positions found cached. The prompts go through the chat template, so every request
shares at least its system prompt with the ones before. ``--turns T``: conversations of T turns,
each turn's prompt the previous prompt, its output and the next record's prompt (history re-sent,
as a chat client does)."""

from __future__ import annotations

import argparse
import json
import time

import torch


def run(workload: str, n: int, max_tokens: int, threads: int, turns: int = 1) -> dict:
    from config import DraftConfig, EngineConfig, ModelConfig, SamplingParams
    from drafts.build import build_engine
    from speculative.engine import SpeculativeEngine
    from speculative.runtime import make_runner
    from workloads import load_workload

    torch.set_num_threads(threads)
    records = load_workload(workload)[:n]
    engine = build_engine(EngineConfig(model=ModelConfig(), draft=DraftConfig(proposers=[])), calibrate=False)
    cached = engine.target
    cached.prefix_caching = True
    plain = SpeculativeEngine(make_runner(cached.model, "int4", name="target"), engine.tokenizer, None, engine.cfg)
    params = SamplingParams(max_tokens=max_tokens)
    tally = {"on": [0, 0.0], "off": [0, 0.0]}
    history: list[int] = []
    for i, rec in enumerate(records):
        ids = history + engine.encode(rec.text)
        runs = (("on", engine), ("off", plain))
        for name, e in runs if i % 2 else runs[::-1]:
            t0 = time.perf_counter()
            out = e.generate(ids, params)
            if i:  # the first prompt warms both up
                tally[name][0] += len(out.token_ids)
                tally[name][1] += time.perf_counter() - t0
        history = ids + out.token_ids if (i + 1) % turns else []  # greedy: both outputs are the same
    stats = cached.pool.prefix_stats
    return {"prompts": len(records), "turns": turns, "max_tokens": max_tokens, "workload": workload,
            "tokens_per_s": {k: round(t / s, 1) for k, (t, s) in tally.items()},
            "prompt_positions_looked_up": stats["looked_up"], "found_cached": stats["hit"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="bench/data/workload.jsonl")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--turns", type=int, default=1, help="conversations of this many turns (history re-sent)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = run(args.workload, args.n, args.max_tokens, args.threads, args.turns)
    from .bench import write_json

    print(json.dumps(res))
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
