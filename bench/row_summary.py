"""``python -m bench.row_summary``: what a verification keeps of its logits (argmax, top-k
distribution, tail), by the native pass (:mod:`speculative.summary`) against torch's ops.

1. The call alone, on random rows of the target's vocabulary: median ms for 1, 5 and 40 rows.
2. The serve config's engine (int4 target, ``--proposers``) decoding the same prompts both ways,
   alternated prompt by prompt (and the order swapped each prompt), so a drift of the machine
   falls on both: one stream at a time (``SpeculativeEngine.generate``), then ``--concurrency``
   sequences at a time through the engine loop (:class:`speculative.scheduler.EngineLoop`).
   The prompts (``--workload``, every 7th record, their last ``--prompt-tokens``) are decoded by both ways in turn, so the
   second way of a pair meets a suffix tree that has seen the first's output: the alternation
   gives that to each way half the time."""

from __future__ import annotations

import argparse
import json
import time

from bench.bench import write_json

VOCAB = 49152


def call_ms(repeats: int = 300) -> list[dict]:
    import torch

    from speculative.summary import load_summary, summarise, torch_summary

    if load_summary() is None:
        raise SystemExit("the native row summary does not build here")
    g = torch.Generator().manual_seed(0)
    out = []
    for rows in (1, 5, 40):
        logits = torch.randn(rows, VOCAB, generator=g) * 4
        row = {"rows": rows}
        for name, fn in (("native", summarise), ("torch", torch_summary)):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(logits, 16)
                times.append(time.perf_counter() - t0)
            row[f"{name}_ms"] = 1e3 * sorted(times)[len(times) // 2]
        out.append(row)
    return out


def engine_ab(workload: str, n: int, max_tokens: int, proposers: list[str], concurrency: int, prompt_tokens: int) -> dict:
    import speculative.runner as runner_mod
    from config import DraftConfig, LoopConfig, SamplingParams
    from deployments.launch import read_config
    from drafts.build import build_engine
    from speculative.scheduler import EngineLoop, Failed, Finished, Sequence
    from speculative.summary import summarise, torch_summary

    _, cfg, _ = read_config()
    select = "controller" if len(proposers) > 1 else "order"
    engine = build_engine(cfg.engine.model_copy(update={"draft": DraftConfig(proposers=proposers, select=select)}))
    texts = [json.loads(line)["text"] for line in open(workload)][::7][:n]
    prompts = [engine.tokenizer(t)["input_ids"][-prompt_tokens:] for t in texts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ways = {"torch": torch_summary, "native": summarise}
    loop = EngineLoop(engine.target, LoopConfig(), 60000, cfg.engine.k.k_max)

    def batch(ps: list[list[int]], tag: str) -> tuple[int, float]:
        done: list = []
        seqs = [Sequence(engine, f"{tag}-{i}", p, params, lambda ev: done.append(ev) if isinstance(ev, (Finished, Failed)) else None)
                for i, p in enumerate(ps)]
        t0 = time.perf_counter()
        for s in seqs:
            loop.submit(s)
        while len(done) < len(seqs):
            loop.step()
        if not all(isinstance(e, Finished) for e in done):
            raise SystemExit(f"a request failed: {done}")
        return sum(len(e.state.output) for e in done), time.perf_counter() - t0

    def stream(p: list[int], tag: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        return len(engine.generate(p, params).token_ids), time.perf_counter() - t0

    out = {}
    for label, size, run in (("one stream", 1, stream), (f"{concurrency} at a time", concurrency, batch)):
        run(prompts[0] if size == 1 else prompts[:size], "warm")  # type: ignore[arg-type]
        tally = {name: [0, 0.0] for name in ways}
        order = list(ways)
        for b in range(0, len(prompts), size):
            order.reverse()
            for name in order:
                runner_mod.summarise = ways[name]  # type: ignore[attr-defined]
                tokens, secs = run(prompts[b] if size == 1 else prompts[b : b + size], f"{name}{b}")  # type: ignore[arg-type]
                tally[name][0] += tokens
                tally[name][1] += secs
        runner_mod.summarise = summarise  # type: ignore[attr-defined]
        tps = {name: t / s for name, (t, s) in tally.items()}
        out[label] = {"tokens_per_s": tps, "native_over_torch": tps["native"] / tps["torch"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="bench/data/open.jsonl")
    p.add_argument("--n", type=int, default=48, help="prompts (every 7th record of the workload)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=400, help="each prompt's last this many tokens")
    p.add_argument("--proposers", default="suffix", help="comma-separated, as draft.proposers")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    res = {"call": call_ms(), "engine": engine_ab(a.workload, a.n, a.max_tokens, a.proposers.split(","), a.concurrency, a.prompt_tokens)}
    for row in res["call"]:
        print(f"{row['rows']:>3} rows: native {row['native_ms']:.3f} ms, torch {row['torch_ms']:.3f} ms")
    for label, r in res["engine"].items():
        tps = r["tokens_per_s"]
        print(f"{label}: native {tps['native']:.1f} tok/s, torch {tps['torch']:.1f} tok/s ({r['native_over_torch']:.3f}x)")
    write_json(res, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
