"""``python -m bench.scoring``: what scoring a prompt costs over HTTP (OpenAI's echo with
logprobs, as evaluation harnesses send it: ``max_tokens`` 1, ``logprobs`` 1, greedy).

For each prompt of the workload (``--workload``, ``--domains``), three requests in turn (so that a
drift of the machine falls on all three): plain with its prompt computed, plain with its prompt
from the prefix cache, and scoring it (:func:`measure`). Reported: each way's mean seconds a
request, the prompts' mean length in tokens, the milliseconds a scored prompt token costs against
a prefilled one, and a check of every scored answer (one log-probability a prompt token, the
first null, none above 0).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

from bench.bench import write_json


def _ask(url: str, body: dict, key: str | None) -> dict:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def measure(url: str, prompts: list[str], key: str | None) -> dict:
    """Per prompt: a plain request (its prompt computed: cold), the same again (its prompt from the
    prefix cache: warm), then the scoring one (warm too, plus the scoring forward, which reads no
    cache). The scoring's cost is scored - warm; a prompt's own prefill, cold - warm."""
    cold_s, warm_s, scored_s, lengths, well_formed = [], [], [], [], 0
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1}
        for way, ask in ((cold_s, body), (warm_s, body), (scored_s, {**body, "echo": True})):
            t = time.perf_counter()
            r = _ask(url, ask, key)
            way.append(time.perf_counter() - t)
        n = r["usage"]["prompt_tokens"]
        lengths.append(n)
        lp = r["choices"][0]["logprobs"]["token_logprobs"]
        well_formed += len(lp) == n + r["usage"]["completion_tokens"] and lp[0] is None and all(v <= 0 for v in lp[1:])
    k = len(prompts)
    cold, warm, scored, tokens = sum(cold_s) / k, sum(warm_s) / k, sum(scored_s) / k, sum(lengths) / k
    return {"prompts": k, "prompt_tokens_mean": tokens, "cold_s_mean": cold, "warm_s_mean": warm, "scored_s_mean": scored,
            "scoring_ms_per_prompt_token": 1e3 * (scored - warm) / tokens,
            "prefill_ms_per_prompt_token": 1e3 * (cold - warm) / tokens, "well_formed": well_formed,
            "cold_s": cold_s, "warm_s": warm_s, "scored_s": scored_s, "prompt_tokens": lengths}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scoring", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--key", default=None, help="the server's API key, if it has keys")
    p.add_argument("--workload", default="bench/data/open.jsonl")
    p.add_argument("--domains", nargs="+", default=["sql", "code", "chat"])
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    records = [json.loads(line) for line in open(a.workload)]
    by_domain = {d: [r["text"][:3000] for r in records if r.get("domain") == d] for d in a.domains}
    prompts = [t for group in zip(*by_domain.values()) for t in group][: a.n]
    out = measure(a.url, prompts, a.key)
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}, indent=1))
    write_json(out, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
