"""``python -m bench.processed``: what penalties and structured output cost a request.

The serve config's engine (int4 target, ``--proposers``) decodes chat prompts of the workload
(``--workload``, ``--domains``: sources no proposer was built on) greedily in four ways, taken in
turn prompt by prompt (the order rotated each prompt, so a drift of the machine falls on every
way): plain; with OpenAI's frequency and presence penalties; as any JSON object
(``response_format: json_object``); and as JSON of a small schema. The outputs differ between
ways (that is the point of the parameters), so the figures are each way's tokens a second of its
own output, whole and after the first token (a shorter output spreads the prompt's forward over
fewer tokens), with its drafted tokens' acceptance; the JSON outputs are checked to parse.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.bench import write_json

SCHEMA = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40},
                                           "summary": {"type": "string", "maxLength": 200},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["topic", "summary", "score"], "additionalProperties": False}


def ways() -> dict:
    from config import Grammar

    return {"plain": {}, "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.3},
            "json_object": {"grammar": Grammar(kind="json", source='{"type": "object"}')},
            "json_schema": {"grammar": Grammar(kind="json", source=json.dumps(SCHEMA))}}


def run(workload: str, domains: list[str], n: int, max_tokens: int, proposers: list[str]) -> dict:
    from config import DraftConfig, SamplingParams
    from deployments.launch import read_config
    from drafts.build import build_engine

    _, cfg, _ = read_config()
    select = "controller" if len(proposers) > 1 else "order"
    engine = build_engine(cfg.engine.model_copy(update={"draft": DraftConfig(proposers=proposers, select=select)}))
    records = [json.loads(line) for line in open(workload)]
    texts = [r["text"][:1500] for r in records if r.get("domain") in domains][:n]
    table = ways()
    tally = {name: {"tokens": 0, "seconds": 0.0, "decode_tokens": 0, "decode_s": 0.0, "proposed": 0, "accepted": 0,
                    "parsed": 0, "complete": 0} for name in table}
    order = list(table)
    for extra in table.values():  # warm (llguidance's view of the tokenizer is made at the first grammar)
        engine.generate(texts[0], SamplingParams(max_tokens=8, **extra))
    for i, text in enumerate(texts):
        order = order[1:] + order[:1]
        for name in order:
            params = SamplingParams(max_tokens=max_tokens, **table[name])
            prompt = f"{text}\n\nAnswer in JSON." if "json" in name else text
            steps: list = []
            t0 = time.perf_counter()
            gen = engine.generate(prompt, params, on_step=steps.append)
            t = tally[name]
            t["seconds"] += time.perf_counter() - t0
            t["tokens"] += len(gen.token_ids)
            if gen.first_token_s is not None:  # after the first token: the decode alone, whatever the prompt
                t["decode_tokens"] += len(gen.token_ids) - 1
                t["decode_s"] += gen.seconds - gen.first_token_s
            t["proposed"] += sum(s.proposed for s in steps)
            t["accepted"] += sum(s.accepted for s in steps)
            if "json" in name:
                t["complete"] += gen.finish_reason == "stop"
                try:
                    json.loads(gen.text)
                    t["parsed"] += 1
                except ValueError:
                    pass
    out = {}
    plain = tally["plain"]
    for name, t in tally.items():
        out[name] = {"tokens_per_s": t["tokens"] / t["seconds"], "tokens": t["tokens"],
                     "decode_tokens_per_s": t["decode_tokens"] / t["decode_s"],
                     "acceptance": t["accepted"] / t["proposed"] if t["proposed"] else None,
                     "over_plain": (t["tokens"] / t["seconds"]) / (plain["tokens"] / plain["seconds"]),
                     "decode_over_plain": (t["decode_tokens"] / t["decode_s"]) / (plain["decode_tokens"] / plain["decode_s"])}
        if "json" in name:
            out[name] |= {"complete": t["complete"], "parsed": t["parsed"], "prompts": len(texts)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="bench/data/open.jsonl")
    p.add_argument("--domains", nargs="+", default=["chat", "code", "sql"])
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--proposers", default="suffix,ngram", help="comma-separated, as draft.proposers")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    res = run(a.workload, a.domains, a.n, a.max_tokens, a.proposers.split(","))
    for name, r in res.items():
        extra = f", {r['parsed']} of {r['prompts']} parse, {r['complete']} complete" if "parsed" in r else ""
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        print(f"{name:12s} {r['tokens_per_s']:6.1f} tokens/s ({r['over_plain']:.3f}x plain), decode "
              f"{r['decode_tokens_per_s']:6.1f} ({r['decode_over_plain']:.3f}x), {r['tokens']} tokens, acceptance {acc}{extra}")
    write_json({"args": vars(a), "ways": res}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
