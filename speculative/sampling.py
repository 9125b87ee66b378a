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

from config import GREEDY_BELOW, SamplingParams


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The request's law of the next token: its warp's stages in ``params.order``, then softmax.

    logits: [T, V] (processed, :mod:`speculative.processors`) -> probs [T, V]. Must be applied
    identically to target and draft logits. Greedy (temperature 0) gives a one-hot at the
    argmax (:func:`greedy_pick`). Each stage drops tokens (to -inf) or rescales the row, as
    llama.cpp's samplers of the same names do to its candidates; a dropped token is no
    candidate of a later stage. XTC is the one random stage: the law is the mixture of the rest
    of the chain with it and without it, weighted by its probability, which is exactly the law of
    a sampler that tosses its coin.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_pick(logits, params), logits.shape[-1]).float()
    return _chain(logits.float(), params.order, params)


def greedy_pick(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[T, V] -> [T] long: greedy decoding's token. The argmax, after the stages before the
    temperature that can drop it (typical-p, where the order puts it first: llama.cpp's)."""
    if not params.greedy_rows:
        return logits.argmax(-1)
    order = params.order  # greedy: the temperature is in it
    z = logits.float()
    for stage in order[: order.index("temperature")]:
        z = _STAGES[stage](z, params) if stage != "xtc" else z  # (greedy takes no XTC: refused)
    return z.argmax(-1)


def _chain(z: torch.Tensor, order: tuple[str, ...], params: SamplingParams) -> torch.Tensor:
    """The stages of ``order`` on logits z [T, V], then softmax; XTC splits the law in two."""
    for i, stage in enumerate(order):
        if stage == "xtc" and params.xtc_on:
            cut = _xtc_cut(z, params)  # [T, V]: the tokens XTC drops when it fires
            if not bool(cut.any()):
                continue
            rest = order[i + 1 :]
            fired = _chain(z.masked_fill(cut, float("-inf")), rest, params)
            return (1.0 - params.xtc_probability) * _chain(z, rest, params) + params.xtc_probability * fired
        if stage != "xtc":
            z = _STAGES[stage](z, params)
    return z.softmax(-1)


def _temperature(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Divide by the temperature; with a dynamic range, a row's own temperature from its
    normalised entropy (llama.cpp's ``temp_ext``); a row at temperature 0 keeps its argmax only."""
    t = torch.full((z.shape[0], 1), params.temperature)  # [T, 1]
    if params.dynatemp_range > 0:
        live = torch.isfinite(z)
        n = live.sum(-1, keepdim=True)  # [T, 1] candidates
        p = z.softmax(-1)
        entropy = -(p * torch.log(p.clamp_min(1e-38))).masked_fill(~live | (p == 0), 0.0).sum(-1, keepdim=True)
        norm = entropy / torch.log(n.clamp_min(2).float())
        lo, hi = max(0.0, params.temperature - params.dynatemp_range), params.temperature + params.dynatemp_range
        dyn = lo + (hi - lo) * norm.clamp_min(0.0).pow(params.dynatemp_exponent)
        t = torch.where(n > 1, dyn, torch.ones_like(dyn))  # one candidate: left as it is
    cold = t < GREEDY_BELOW  # [T, 1]
    if bool(cold.any()):
        top = torch.nn.functional.one_hot(z.argmax(-1), z.shape[-1]).bool()
        z = torch.where(cold & ~top, torch.full_like(z, float("-inf")), z)
    return z / torch.where(cold, torch.ones_like(t), t)


def _floor(keep: torch.Tensor, z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``keep`` [T, V] with at least ``params.min_keep`` of each row's most likely tokens (min-p
    keeps the most likely one anyway: a floor of one changes nothing)."""
    if params.min_keep <= 1:
        return keep
    top = torch.topk(z, min(params.min_keep, z.shape[-1]), dim=-1)
    floor = torch.zeros_like(keep).scatter(-1, top.indices, torch.isfinite(top.values))
    return keep | floor


def _min_p(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Keep v while p(v) >= min_p * max p, that is logit(v) >= max logit + log(min_p)."""
    if params.min_p <= 0.0:
        return z
    floor = z.max(-1, keepdim=True).values + torch.log(torch.tensor(params.min_p))  # [T, 1]
    return z.masked_fill(~_floor(z >= floor, z, params), float("-inf"))


def _top_k(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Keep the top_k largest logits and every logit tied with the k-th (0: all)."""
    if not params.top_k or params.top_k >= z.shape[-1]:
        return z
    kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]  # [T, 1]
    return z.masked_fill(z < kth, float("-inf"))


def _top_p(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Keep a token while the mass strictly before it (most likely first) is below top_p."""
    if params.top_p >= 1.0:
        return z
    sorted_logits, order = torch.sort(z, dim=-1, descending=True)  # [T, V]
    sorted_probs = sorted_logits.softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = mass_before < params.top_p
    keep_sorted[..., 0] = True  # rounding can leave the first's "mass before" above a tiny top_p
    keep_sorted[..., : params.min_keep] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return z.masked_fill(~(keep & torch.isfinite(z)), float("-inf"))


def _top_n_sigma(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Keep the logits at least max - n * std (population std over the candidates)."""
    if params.top_n_sigma <= 0.0:
        return z
    live = torch.isfinite(z)
    n = live.sum(-1, keepdim=True)  # [T, 1]
    zl = z.masked_fill(~live, 0.0)  # (a row keeps its most likely token: n >= 1)
    mean = zl.sum(-1, keepdim=True) / n
    std = (((zl - mean) ** 2).masked_fill(~live, 0.0).sum(-1, keepdim=True) / n).sqrt()
    floor = z.max(-1, keepdim=True).values - params.top_n_sigma * std  # one candidate: std 0, it stays
    return z.masked_fill(z < floor, float("-inf"))


def _typical(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Locally typical sampling: order the candidates by |surprise - entropy| and keep them up to
    the first that takes their mass past typical_p (and at least min_keep)."""
    if params.typical_p >= 1.0:
        return z
    p = z.softmax(-1)  # [T, V]
    logp = torch.log_softmax(z, -1)
    live = p > 0
    entropy = -(p * logp).masked_fill(~live, 0.0).sum(-1, keepdim=True)  # [T, 1]
    score = (-logp - entropy).abs().masked_fill(~live, float("inf"))
    ranked, order = torch.sort(score, dim=-1, stable=True)  # [T, V] most typical first
    mass = torch.gather(p, -1, order).cumsum(-1)
    passed = (mass > params.typical_p) & (torch.arange(z.shape[-1]) >= params.min_keep - 1)  # [T, V]
    first = torch.where(passed.any(-1, keepdim=True), passed.float().argmax(-1, keepdim=True),
                        torch.full_like(mass[..., :1], z.shape[-1] - 1).long())  # [T, 1] the last one kept
    keep_sorted = (torch.arange(z.shape[-1]) <= first) & torch.isfinite(ranked)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return z.masked_fill(~keep, float("-inf"))


def _xtc_cut(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[T, V] bool: the tokens XTC drops when it fires: every candidate at least xtc_threshold
    likely but the least likely of them, where there are two such and the rest keep min_keep."""
    p = z.softmax(-1)
    above = p >= params.xtc_threshold  # [T, V]
    count = above.sum(-1, keepdim=True)  # [T, 1]
    least = torch.where(above, p, torch.full_like(p, 2.0)).argmin(-1, keepdim=True)  # [T, 1]
    cut = above & ~torch.zeros_like(above).scatter(-1, least, True)
    left = torch.isfinite(z).sum(-1, keepdim=True) - (count - 1)
    return cut & (left >= params.min_keep)  # (one token above the threshold: it is the least, nothing is cut)


_STAGES = {"temperature": _temperature, "min_p": _min_p, "top_k": _top_k, "top_p": _top_p,
           "top_n_sigma": _top_n_sigma, "typ_p": _typical}


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
