"""``python -m bench.choices``: what a request of ``n`` choices costs, and what starting its later
choices from the prefix cache saves.

The serve config's engine (int4 target, its proposers) in one engine loop, stepped in this
process as a draft replica steps it: for each prompt of the workload (``--workload``,
``--domains``: sources no proposer was built on), one request alone, then ``n`` choices of it
submitted together (seeded sampling, choice j with seed + j, as the server does), with
``loop.share_prompt_min`` at the config's value (the later choices wait for the first one's prompt
and start from the cache) and at 0 (each computes the prompt itself), the two taken in turn prompt
by prompt so that a drift of the machine falls on both. The prefix cache is emptied before every
run, so each starts cold. Reported per way: wall seconds and output tokens a second, the time to
every choice's first token, and the positions the target computed; each choice's text is checked to
be the same either way (the cache changes no output).
"""

from __future__ import annotations

import argparse
import json
import time

from bench.bench import write_json


def run(workload: str, domains: list[str], n_prompts: int, n: int, max_tokens: int, temperature: float) -> dict:
    from config import SamplingParams
    from deployments.launch import read_config
    from drafts.build import build_engine
    from speculative.scheduler import EngineLoop, Finished, Sequence, Step

    _, cfg, _ = read_config()
    engine = build_engine(cfg.engine)
    target = engine.target
    target.prefix_caching = True
    records = [json.loads(line) for line in open(workload)]
    by_domain = {d: [r["text"][:3000] for r in records if r.get("domain") == d] for d in domains}
    texts = [t for group in zip(*by_domain.values()) for t in group][:n_prompts]  # the domains in turn
    share = cfg.loop.share_prompt_min
    loops = {"alone": EngineLoop(target, cfg.loop, 1 << 20, engine.cfg.k.k_max),
             "shared": EngineLoop(target, cfg.loop, 1 << 20, engine.cfg.k.k_max),
             "unshared": EngineLoop(target, cfg.loop.model_copy(update={"share_prompt_min": 0}), 1 << 20, engine.cfg.k.k_max)}
    tally = {name: {"runs": 0, "seconds": 0.0, "tokens": 0, "first_token_s": 0.0, "fed": 0} for name in loops}
    same = True

    def once(name: str, ids: list[int], count: int, seed: int) -> list[list[int]]:
        loop = loops[name]
        target.pool.drop_index()  # a cold start for every run
        outs: list[list[int]] = [[] for _ in range(count)]
        firsts: list[float | None] = [None] * count
        done = [False] * count
        t0 = time.perf_counter()

        def sink(j: int):
            def take(ev):
                if isinstance(ev, Step):
                    outs[j] += ev.result.emitted
                    if firsts[j] is None and ev.result.emitted:
                        firsts[j] = time.perf_counter() - t0
                elif isinstance(ev, Finished):
                    done[j] = True
            return take
        fed = loop.tokens
        for j in range(count):
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + j, ignore_eos=True)
            loop.submit(Sequence(engine, f"{name}-{seed}-{j}", ids, params, sink(j)))
        while not all(done):
            loop.step()
        t = tally[name]
        t["runs"] += 1
        t["seconds"] += time.perf_counter() - t0
        t["tokens"] += sum(len(o) for o in outs)
        t["first_token_s"] += sum(f or 0.0 for f in firsts) / count
        t["fed"] += loop.tokens - fed  # positions the target computed: prompts, drafts, outputs
        return outs

    once("alone", engine.encode(texts[0]), 1, 0)  # warm
    tally["alone"] = {"runs": 0, "seconds": 0.0, "tokens": 0, "first_token_s": 0.0, "fed": 0}
    for i, text in enumerate(texts):
        ids = engine.encode(text)
        once("alone", ids, 1, 1000 * i)
        order = ["shared", "unshared"] if i % 2 else ["unshared", "shared"]
        got = {name: once(name, ids, n, 1000 * i) for name in order}
        same = same and got["shared"] == got["unshared"]
    out = {"workload": workload, "domains": domains, "prompts": len(texts), "n": n, "max_tokens": max_tokens,
           "temperature": temperature, "share_prompt_min": share, "same_outputs": same,
           "prompt_tokens_mean": round(sum(len(engine.encode(t)) for t in texts) / len(texts), 1)}
    for name, t in tally.items():
        out[name] = {"tokens_per_s": round(t["tokens"] / t["seconds"], 1), "seconds_per_request": round(t["seconds"] / t["runs"], 3),
                     "first_token_s": round(t["first_token_s"] / t["runs"], 3),
                     "fed_per_request": round(t["fed"] / t["runs"], 1)}
    out["shared_over_unshared"] = round(out["shared"]["tokens_per_s"] / out["unshared"]["tokens_per_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="bench/data/open.jsonl")
    p.add_argument("--domains", nargs="+", default=["sql", "code", "chat"])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = run(args.workload, args.domains, args.prompts, args.n, args.max_tokens, args.temperature)
    print(json.dumps(res, indent=1))
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
