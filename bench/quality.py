"""How close each runtime is to a reference: teacher-forced top-1 agreement, and whole greedy outputs.

The reference (``--reference``) decodes held-out prompts greedily: the float32 model (Hugging Face
eager, the GGUF dequantised), or llama.cpp on the same GGUF (what llama-server answers; one token a
call, as it decodes). Each runtime then scores those same sequences in one forward, and we count
the output positions where its argmax is the reference's token, and the prompts whose whole output
it would decode the same (every position agrees, the end of sequence included). Runtimes: int4
(the default; 8-bit head), int4 with a 4-bit head, int8, int4 on torch's kernels (bfloat16
activations instead of the native kernels' 8 bits), and llama.cpp when installed, scoring each
sequence in one call (``logits_all``): against float32 with the given attention path
(``--flash-attn``), against its own greedy outputs with both (its batched rows are not bitwise
its one-by-one ones, and its two attention paths round differently).

    python -m bench.quality --n 24 --max-tokens 48 --json results/fast/quality.json
    python -m bench.quality --reference llamacpp --workload bench/data/open.jsonl --n 100 --max-tokens 48
"""

from __future__ import annotations

import numpy as np
import torch

from config import ModelConfig
from speculative.fast import FastRunner
from speculative.models import encode_prompt, load_model
from workloads import load_workload

from .bench import hf_greedy_generate, measurement_cli, select
from .llamacpp import BackendUnavailable, gguf_of, llamacpp_greedy, load_llamacpp

REFERENCES = ("float32", "llamacpp")


def _tally(argmax: torch.Tensor, out: list[int], max_tokens: int, eos: set[int]) -> tuple[int, bool]:
    """(positions of ``out`` where ``argmax`` [len(out) + 1] holds its token, whether greedy
    decoding would give ``out`` whole: every position agrees and, where ``out`` stopped before
    ``max_tokens``, the next is an end of sequence)."""
    hits = int((argmax[: len(out)] == torch.tensor(out, dtype=torch.long)).sum())
    ended = len(out) >= max_tokens or int(argmax[len(out)]) in eos
    return hits, hits == len(out) and ended


RUNTIMES = ("int4", "int4+head4", "int8", "int4 (torch kernels)")


def _runner(target, name: str) -> FastRunner:
    return {"int4": lambda: FastRunner(target, bits=4), "int4+head4": lambda: FastRunner(target, bits=4, head_bits=4),
            "int8": lambda: FastRunner(target, bits=8),
            "int4 (torch kernels)": lambda: FastRunner(target, bits=4, native=False)}[name]()


def agreement(target_name: str, workload: str, n: int, max_tokens: int, threads: int = 2,
              reference: str = "float32", domains: list[str] | None = None, runtimes: tuple[str, ...] = RUNTIMES,
              flash_attn: bool = False) -> dict:
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, not {reference!r}")
    target, tok = load_model(ModelConfig(name=target_name, quantize="none"))
    eos = {tok.eos_token_id}
    records = select(load_workload(workload), n, domains)
    llm = None
    if reference == "llamacpp":
        llm = load_llamacpp(gguf_of(target_name), threads, flash_attn=flash_attn)
    seqs = []
    for r in records:
        ids = encode_prompt(tok, r.text)
        ref = llamacpp_greedy(llm, ids, max_tokens, eos)[0] if llm is not None else hf_greedy_generate(target, ids, max_tokens, eos)[0]
        seqs.append((r.domain, ids, ref))
    out: dict = {"reference": reference, "flash_attn": flash_attn, "prompts": len(seqs), "tokens": sum(len(o) for _, _, o in seqs),
                 "max_tokens": max_tokens, "agreement": {}, "sequences_equal": {}, "sequences_equal_domain": {},
                 "skipped": {}}

    def score(name: str, argmax_of) -> None:  # argmax_of(ids, o) -> argmax rows [len(o) + 1]
        hit = same = 0
        by_dom: dict[str, list[int]] = {}
        for dom, ids, o in seqs:
            h, equal = _tally(argmax_of(ids, o), o, max_tokens, eos)
            hit, same = hit + h, same + equal
            by_dom.setdefault(dom, [0, 0])
            by_dom[dom][0] += equal
            by_dom[dom][1] += 1
        out["agreement"][name] = round(hit / max(out["tokens"], 1), 4)
        out["sequences_equal"][name] = same
        out["sequences_equal_domain"][name] = {d: f"{a} of {b}" for d, (a, b) in by_dom.items()}

    for name in runtimes:
        runner = _runner(target, name)

        def ours(ids: list[int], o: list[int]) -> torch.Tensor:
            rows = runner.forward("q", 0, ids + o, len(o) + 1)  # row i predicts o[i]; the last, what follows o
            runner.release("q")
            return rows.argmax(-1)

        score(name, ours)
    # llama.cpp scored as a runtime, all positions of a sequence in one call: against float32 with the
    # given attention path; against its own greedy outputs (one token a call) with both paths: how far
    # its batched rows are from its one-by-one ones, and its two paths from each other
    try:
        for fa in [flash_attn] if reference == "float32" else [flash_attn, not flash_attn]:
            scorer = load_llamacpp(gguf_of(target_name), threads, logits_all=True, flash_attn=fa)

            def theirs(ids: list[int], o: list[int]) -> torch.Tensor:
                scorer.reset()
                scorer.eval(ids + o)
                return torch.from_numpy(np.asarray(scorer.scores[len(ids) - 1 : len(ids) + len(o)]).argmax(-1))

            score(f"llama.cpp, flash_attn {fa}, batched", theirs)
    except BackendUnavailable as e:
        out["skipped"]["llama.cpp"] = str(e)
    return out


def main(argv=None) -> int:
    def add_args(ap):
        ap.add_argument("--workload", default="bench/data/workload.jsonl")
        ap.add_argument("--n", type=int, default=24)
        ap.add_argument("--max-tokens", type=int, default=48)
        ap.add_argument("--reference", choices=REFERENCES, default="float32")
        ap.add_argument("--domains", nargs="*", default=None)
        ap.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
        ap.add_argument("--flash-attn", action="store_true", help="llama.cpp with its fused attention (llama-server's default)")

    return measurement_cli("python -m bench.quality", __doc__, add_args,
                           lambda a: agreement(a.target, a.workload, a.n, a.max_tokens, a.threads, a.reference,
                                               a.domains, tuple(a.runtimes), a.flash_attn), argv)


if __name__ == "__main__":
    raise SystemExit(main())
