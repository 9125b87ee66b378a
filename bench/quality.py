"""How close each runtime is to the float32 reference: teacher-forced top-1 agreement.

The float32 model (Hugging Face eager) decodes held-out prompts greedily; each runtime then scores
those same sequences in one forward, and we count the output positions where its argmax is the
reference's token. Runtimes: int4 (the default; 8-bit head), int4 with a 4-bit head, int8, int4
on torch's kernels (bfloat16 activations instead of the native kernels' 8 bits), and llama.cpp on
the same GGUF when installed.

    python -m bench.quality --n 24 --max-tokens 48 --json results/fast/quality.json
"""

from __future__ import annotations

import numpy as np
import torch

from config import ModelConfig
from speculative.fast import FastRunner
from speculative.models import encode_prompt, load_model
from workloads import load_workload

from .bench import hf_greedy_generate, measurement_cli, select
from .llamacpp import BackendUnavailable, gguf_of, load_llamacpp


def agreement(target_name: str, workload: str, n: int, max_tokens: int, threads: int = 2) -> dict:
    target, tok = load_model(ModelConfig(name=target_name, quantize="none"))
    eos = {tok.eos_token_id}
    seqs = []
    for r in select(load_workload(workload), n):
        ids = encode_prompt(tok, r.text)
        seqs.append((ids, hf_greedy_generate(target, ids, max_tokens, eos)[0]))
    tokens = sum(len(o) for _, o in seqs)
    out = {"prompts": len(seqs), "tokens": tokens, "agreement": {}, "skipped": {}}
    runners = {"int4": FastRunner(target, bits=4), "int4+head4": FastRunner(target, bits=4, head_bits=4),
               "int8": FastRunner(target, bits=8), "int4 (torch kernels)": FastRunner(target, bits=4, native=False)}
    for name, r in runners.items():
        hit = 0
        for ids, o in seqs:
            rows = r.forward("q", 0, ids + o, len(o) + 1)[:-1]  # row i predicts o[i]
            r.release("q")
            hit += int((rows.argmax(-1) == torch.tensor(o)).sum())
        out["agreement"][name] = round(hit / tokens, 4)
    try:
        llm = load_llamacpp(gguf_of(target_name), threads, logits_all=True)
        hit = 0
        for ids, o in seqs:
            llm.reset()
            llm.eval(ids + o)
            scores = np.asarray(llm.scores[len(ids) - 1 : len(ids) - 1 + len(o)])
            hit += int((scores.argmax(-1) == np.asarray(o)).sum())
        out["agreement"]["llama.cpp"] = round(hit / tokens, 4)
    except BackendUnavailable as e:
        out["skipped"]["llama.cpp"] = str(e)
    return out


def main(argv=None) -> int:
    def add_args(ap):
        ap.add_argument("--workload", default="bench/data/workload.jsonl")
        ap.add_argument("--n", type=int, default=24)
        ap.add_argument("--max-tokens", type=int, default=48)

    return measurement_cli("python -m bench.quality", __doc__, add_args,
                           lambda a: agreement(a.target, a.workload, a.n, a.max_tokens, a.threads), argv)


if __name__ == "__main__":
    raise SystemExit(main())
