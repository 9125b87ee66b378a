"""Acceptance rules of speculative decoding, as pure functions.

Vocabulary (after vLLM's rejection sampler):
  - *draft tokens*: the k tokens the proposer suggests, ``d_1..d_k``.
  - *p* is always the **target** distribution, *q* the **draft** distribution.
  - *accepted tokens*: the longest prefix of draft tokens the rule keeps.
  - *recovered token*: on the first rejection, a token drawn from norm(max(0, p - q)).
  - *bonus token*: when all k are accepted, a token drawn from p at position k+1.
  - *output tokens*: accepted tokens + (recovered or bonus) token: always 1..k+1 tokens.

Greedy: accept while the draft token equals argmax p; the next token is argmax p at the first
mismatch (or the bonus). Sampling: accept d_i with probability min(1, p(d_i) / q(d_i)); this
leaves the output distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023).

Seeded sampling (a request with a seed) must give the same text every time, whatever the draft,
its version and the k chosen. It samples by an *exponential race*: the token at sequence position
t is argmax_v p_t(v) / E_t(v), with E_t(v) ~ Exp(1) drawn from a generator fixed by (seed, t);
token v wins with probability exactly p_t(v) (the Gumbel-max trick in another form). The draft
races its q with the same noise, so the draft token and the target's agree often when q is close
to p, and verification is greedy against the target's race winners: every output token is the
target's own race winner, a function of the seed and the target alone.
"""

from __future__ import annotations

import torch

from config import SamplingParams


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p (nucleus) filtering, then softmax (vLLM's order).

    logits: [T, V] -> probs [T, V]. Must be applied identically to target and draft logits.
    Greedy (temperature 0) gives a one-hot at the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.min_p > 0.0:  # keep v while p(v) >= min_p * max p: logit(v) >= max logit + log(min_p)
        floor = logits.max(-1, keepdim=True).values + torch.log(torch.tensor(params.min_p))  # [T, 1]
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [T, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [T, V]
        sorted_probs = sorted_logits.softmax(-1)
        # keep a token while the mass strictly before it is < top_p (always keeps the first)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep_sorted[..., 0] = True  # rounding can leave the first's "mass before" above a tiny top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.softmax(-1)


def greedy_accept(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """Longest prefix of draft tokens equal to the target's argmax, then the target's own token.

    draft_tokens: [k] long; target_argmax: [k+1] long, argmax of target row i, which scores the
    token after d_1..d_i. Returns (number accepted n in 0..k, next token = target_argmax[n]).
    """
    k = draft_tokens.shape[0]
    match = (draft_tokens == target_argmax[:k]).long()  # [k]
    n = int(match.cumprod(0).sum())
    return n, int(target_argmax[n])


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling: accept d_i w.p. min(1, p_i(d_i)/q_i(d_i)); resample on rejection.

    draft_tokens: [k] long; draft_probs q: [k, V]; target_probs p: [k+1, V] (already warped).
    Returns (number accepted n, next token: recovered from norm(max(0, p_n - q_n)) if n < k,
    else the bonus token from p_k).
    """
    k = draft_tokens.shape[0]
    if k:
        idx = torch.arange(k)
        p_d = target_probs[idx, draft_tokens]  # [k]
        q_d = draft_probs[idx, draft_tokens]  # [k]
        u = torch.rand(k, generator=generator)  # [k]
        # u < p/q  <=>  u * q < p  (no division by a zero q)
        accepted = (u * q_d < p_d).long()
        n = int(accepted.cumprod(0).sum())
    else:
        n = 0
    if n < k:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0)  # [V]
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
            residual = target_probs[n]
        return n, int(torch.multinomial(residual, 1, generator=generator))  # multinomial normalises
    return n, int(torch.multinomial(target_probs[k], 1, generator=generator))


def race_noise(seed: int, positions: range | list[int], vocab: int) -> torch.Tensor:
    """Exp(1) noise of sequence positions ``positions`` for a seeded request: [T, vocab], each row
    drawn from its own generator seeded by (seed, position), so a row never depends on how the
    sequence was split into steps."""
    rows = []
    for t in positions:
        g = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + t) % (1 << 63))
        rows.append(torch.empty(vocab).exponential_(generator=g))
    return torch.stack(rows) if rows else torch.empty(0, vocab)


def race_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax_v probs[v] / noise[v] wins with probability probs[v] exactly.

    probs: [T, V] (warped, rows sum to 1); noise: [T, V] Exp(1). Returns [T] long."""
    return (probs / noise).argmax(-1)


def sparse_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distribution softmax(logits) stored sparsely: top-k ids, their probs, and the tail mass.

    logits: [T, V] -> ids [T, k] long, probs [T, k] float, tail [T] float (1 - sum probs, >= 0).
    This is what the learner trains on; it is computed from the verification pass itself.
    """
    probs = logits.float().softmax(-1)
    top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    tail = (1.0 - top.values.sum(-1)).clamp_min(0.0)
    return top.indices, top.values, tail
