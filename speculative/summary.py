"""What the engine keeps of a verification's logits: each row's argmax (what greedy acceptance
compares with), and the target's distribution stored sparsely (top-k ids, their probabilities and
the tail mass: what the learner trains on, and what a request's ``logprobs`` are read from,
:func:`token_logprobs`).

On the CPU this is one native pass over each row (``csrc/rows.c``) instead of torch's softmax,
top-k and argmax, three passes and three calls for each sequence of a step: 0.28 ms for a
sequence's 5 rows of SmolLM2's 49,152 logits, a few percent of a decode step. The argmax follows
torch's rule (the first of equal values), so greedy outputs are the same on either path; the
probabilities are as near the exact softmax as torch's float32 ones (within 1e-5 relative over
49,152 logits; the C's ``exp`` is a polynomial, and the sum runs in 16 float32 lanes),
and equal values among the top k come smaller index first. Where the kernel cannot be built, or
the logits are not float32 rows on the CPU (the GPU path), torch computes the same.
"""

from __future__ import annotations

import ctypes
import math
import uuid
from functools import lru_cache

import torch

from .native import Kernel, load
from .sampling import sparse_top_k

#: the most ids the native pass keeps a row (the engine keeps ``record_top_k``, 16 by default)
MAX_K = 64


@lru_cache(maxsize=1)
def load_summary() -> Kernel | None:
    """The compiled row summary (:mod:`speculative.native`), or None where it cannot be built."""
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    return load("rows.c", "osd_row_summary", [P, I64, I64, I64, I64, P, P, P, P, ctypes.c_int], "row summary kernel",
                load_summary)


def torch_summary(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, V] -> argmax [T] long, and :func:`speculative.sampling.sparse_top_k`'s top ids
    [T, k] long, their probs [T, k] float and tail [T] float: torch's ops, on any device."""
    return (logits.argmax(-1), *sparse_top_k(logits, k))


def summarise(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`torch_summary`'s four, by the native pass where it applies (float32 rows on the CPU,
    ``1 <= k <= MAX_K``), else by torch."""
    kernel = load_summary() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernel is None or logits.dim() != 2 or logits.stride(-1) != 1 or not 1 <= min(k, logits.shape[-1]) <= MAX_K:
        return torch_summary(logits, k)
    T, V = logits.shape
    k = min(k, V)
    argmax, ids = torch.empty(T, dtype=torch.long), torch.empty(T, k, dtype=torch.long)
    probs, tail = torch.empty(T, k), torch.empty(T)
    rc = kernel(logits.data_ptr(), logits.stride(0), T, V, k, argmax.data_ptr(), ids.data_ptr(), probs.data_ptr(),
                tail.data_ptr(), torch.get_num_threads())
    if rc == -2:  # a row the pass does not take (NaN, or fewer than k values above -inf)
        return torch_summary(logits, k)
    if rc != 0:
        raise RuntimeError(f"row summary kernel failed ({rc}) on logits {tuple(logits.shape)}, k {k}")
    return argmax, ids, probs, tail


def token_logprobs(top_ids: torch.Tensor, top_probs: torch.Tensor, logits: torch.Tensor | None, tokens: list[int],
                   n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each of ``tokens`` (token j scored by row j) with its log-probability under the target and
    the ``n`` most likely tokens' there, [(id, logprob)], at temperature 1 (the model's own law).

    top_ids, top_probs: [rows, K] (the summary's); logits: [rows, V] where the step kept them (a
    sampled request's, or one with penalties, biases or a grammar: unprocessed), else None. A token outside its row's top K (sampled) is read from the
    logits; a greedy step's tokens are the argmax, first of the top K. Past the top K, -inf."""
    out = []
    for j, tok in enumerate(tokens):
        ids, probs = top_ids[j].tolist(), top_probs[j].tolist()
        if logits is not None:
            lp = float(torch.log_softmax(logits[j].float(), -1)[tok])
        elif tok in ids:
            lp = _log(probs[ids.index(tok)])
        else:
            lp = float("-inf")
        out.append((lp, [(i, _log(p)) for i, p in zip(ids[:n], probs[:n])]))
    return out


def _log(p: float) -> float:
    return math.log(p) if p > 0.0 else float("-inf")


def prompt_logprobs(runner, tokens: list[int], n: int, chunk: int = 128) -> list[tuple[float, list[tuple[int, float]], int]]:
    """Each of ``tokens`` after the first with its log-probability under ``runner`` (the target)
    given the tokens before it, the ``n`` most likely tokens' there, [(id, logprob)], and its rank
    among them (1: the most likely; vLLM's): temperature 1, unprocessed, the model's own law, as
    :func:`token_logprobs` gives the output's. One forward over the tokens, ``chunk`` positions at
    a time (:func:`score_chunk`), on a sequence of its own released at the end (no prefix cache:
    every row is computed). On the thread that steps the runner."""
    seq = f"prompt-logprobs-{uuid.uuid4().hex}"
    out = []
    try:
        for start in range(0, len(tokens) - 1, chunk):
            out += score_chunk(runner, seq, tokens, start, n, chunk)
    finally:
        runner.release(seq)
    return out


def score_chunk(runner, seq: str, tokens: list[int], start: int, n: int, chunk: int) -> list[tuple[float, list[tuple[int, float]], int]]:
    """:func:`prompt_logprobs` of the tokens after positions ``start`` .. ``start + chunk - 1``:
    their forward on sequence ``seq``, which holds the positions before ``start``."""
    piece = tokens[start : min(start + chunk, len(tokens) - 1)]  # row i scores token i + 1; the last scores nothing
    rows = torch.log_softmax(runner.forward(seq, start, piece, keep_last=len(piece)).float(), -1)  # [P, V]
    nxt = torch.tensor(tokens[start + 1 : start + 1 + len(piece)])  # [P]
    lps = rows.gather(1, nxt[:, None])  # [P, 1]
    ranks = (rows > lps).sum(-1) + 1  # [P]
    top = torch.topk(rows, n, dim=-1) if n else None
    out = []
    for j in range(len(piece)):
        best = [] if top is None else list(zip(top.indices[j].tolist(), top.values[j].tolist()))
        out.append((float(lps[j, 0]), best, int(ranks[j])))
    return out
