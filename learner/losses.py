"""Distillation losses between a student's logits and a sparse target distribution.

The target LM's distribution at each position is stored sparsely (see
:class:`SparseDist`): the top-K token ids, their probabilities, and the tail
mass ``1 - sum(top-K probs)``.  Every loss here compares the student with that
target on the *coarsened* (K+1)-bin distribution: the K named ids plus one
"tail" bin holding every other token of the vocabulary.

With ``q = softmax(student_logits / T)`` over the vocabulary V and the target
ids ``S`` (|S| = K), the bins are::

    p_b = probs[b],                 q_b = q[ids[b]]            for b < K
    p_tail = tail,                  q_tail = sum_{v not in S} q[v]

``log q_tail`` is a logsumexp over the student's log-probs outside ``S``, never
``log(1 - sum q_b)``, so it stays accurate when the top-K covers nearly all of
the student's mass.  When K = V there are no tokens outside ``S``; the tail bin
is then empty for both distributions and dropped (the target's stored tail is
only rounding error there), so every loss equals its exact full-vocabulary
value.

Per position (all sums over the K+1 bins, with ``0 * log 0 = 0``)::

    forward_kl = KL(p || q) = sum_b p_b (log p_b - log q_b)
    reverse_kl = KL(q || p) = sum_b q_b (log q_b - log max(p_b, min_target_prob))
    jsd_beta   = beta KL(p || M) + (1 - beta) KL(q || M),  M = beta p + (1 - beta) q
    tvd        = 0.5 * sum_b |p_b - q_b|

``jsd`` is the generalised Jensen-Shannon divergence of GKD (Agarwal et al.
2024, "On-Policy Distillation of Language Models").  For beta in (0, 1) it is
the value above, unscaled (``jsd(beta=0.5) <= ln 2``).  It vanishes at both
endpoints, but ``jsd_beta / beta -> KL(p || q)`` as beta -> 0 and
``jsd_beta / (1 - beta) -> KL(q || p)`` as beta -> 1, so following GKD (and
TRL's GKD trainer) the endpoints are defined as those limits:
``beta = 0`` is ``forward_kl`` and ``beta = 1`` is ``reverse_kl``.

Reverse KL is infinite where the target gives a bin zero mass (e.g. a stored
tail of exactly 0) but the student does not; the target's probabilities are
therefore floored at ``min_target_prob`` inside the logarithm of ``reverse_kl``
only.  Bins with ``p_b >= min_target_prob`` are unaffected.  Forward KL, JSD
(for beta < 1) and TVD are finite without a floor.

Temperature ``T`` divides the student logits only; the target probabilities
are used as given.  All losses are pure functions, differentiable with respect
to the student logits, computed in float32 (or the logits' wider dtype), and
return one value per position, shape ``[N]``; callers apply position masks and
reduce.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Dict

import torch

__all__ = [
    "SparseDist",
    "sparse_from_logits",
    "forward_kl",
    "reverse_kl",
    "draft_opd",
    "jsd",
    "tvd",
    "top1_agreement",
    "feature_regression",
    "LOSSES",
    "get_loss",
]

DEFAULT_MIN_TARGET_PROB = 1e-10


@dataclass
class SparseDist:
    """Sparse target distribution: top-K ids, their probabilities, tail mass.

    The ids of a row must be distinct (``torch.topk`` guarantees this).
    """

    ids: torch.Tensor  # [N, K] long, target token ids (in the student's vocabulary index space)
    probs: torch.Tensor  # [N, K] float, target probabilities of those ids
    tail: torch.Tensor  # [N] float, 1 - probs.sum(-1), clamped >= 0

    def __post_init__(self) -> None:
        if self.ids.dim() != 2 or self.probs.shape != self.ids.shape:
            raise ValueError(
                f"SparseDist: ids and probs must both be [N, K], got "
                f"{tuple(self.ids.shape)} and {tuple(self.probs.shape)}"
            )
        if self.tail.shape != self.ids.shape[:1]:
            raise ValueError(
                f"SparseDist: tail must be [N] with N={self.ids.shape[0]}, "
                f"got {tuple(self.tail.shape)}"
            )

    @property
    def k(self) -> int:
        return self.ids.shape[1]


def sparse_from_logits(logits: torch.Tensor, k: int) -> SparseDist:
    """Sparse top-``k`` summary of ``softmax(logits)`` (detached: targets are constants).

    logits: [N, V]. Returns ids/probs [N, k] sorted by decreasing probability and
    tail [N] = max(1 - sum(probs), 0); the tail is exactly 0 when k == V.
    """
    if logits.dim() != 2:
        raise ValueError(f"sparse_from_logits: logits must be [N, V], got {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if not 1 <= k <= vocab:
        raise ValueError(f"sparse_from_logits: k must be in [1, {vocab}], got {k}")
    with torch.no_grad():
        probs_full = torch.softmax(_as_float(logits), dim=-1)  # [N, V]
        probs, ids = torch.topk(probs_full, k, dim=-1)  # [N, k], [N, k]
        if k == vocab:
            tail = torch.zeros_like(probs[:, 0])  # [N]
        else:
            tail = (1.0 - probs.sum(dim=-1)).clamp_min(0.0)  # [N]
    return SparseDist(ids=ids, probs=probs, tail=tail)


# ---------------------------------------------------------------------------
# Coarsening onto the K+1 bins
# ---------------------------------------------------------------------------


@dataclass
class _Bins:
    """Student and target on the K+1 bins (last bin = tail).

    Bins that do not exist (the tail bin of a row whose ids cover the whole
    vocabulary) hold p = q = 0 and log q = 0, so every formula gives them 0
    with finite gradients.
    """

    p: torch.Tensor  # [N, K+1] target probabilities
    q: torch.Tensor  # [N, K+1] student probabilities
    log_q: torch.Tensor  # [N, K+1] student log-probabilities (finite)


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """Upcast half/bfloat16 to float32; keep float32/float64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _coarsen(student_logits: torch.Tensor, target: SparseDist, temperature: float) -> _Bins:
    # student_logits: [N, V]
    if student_logits.dim() != 2:
        raise ValueError(f"student_logits must be [N, V], got {tuple(student_logits.shape)}")
    n, vocab = student_logits.shape
    if target.ids.shape[0] != n:
        raise ValueError(f"target has {target.ids.shape[0]} positions, student_logits has {n}")
    if target.k > vocab:
        raise ValueError(f"target K={target.k} exceeds the student's vocabulary V={vocab}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    logits = _as_float(student_logits)
    if temperature != 1.0:
        logits = logits / temperature
    log_q_full = torch.log_softmax(logits, dim=-1)  # [N, V]
    ids = target.ids.to(device=logits.device, dtype=torch.long)  # [N, K]

    log_q_top = log_q_full.gather(1, ids)  # [N, K]

    # Student tail: logsumexp over the tokens outside the target's ids.  Masked
    # entries are filled with the most negative finite value rather than -inf so
    # that a row with no outside tokens yields a finite logsumexp (and finite
    # gradients) before it is discarded below.
    keep_outside = torch.ones_like(log_q_full, dtype=torch.bool).scatter(1, ids, False)  # [N, V]
    has_tail = keep_outside.any(dim=-1)  # [N]
    very_negative = torch.finfo(log_q_full.dtype).min
    log_q_outside = log_q_full.masked_fill(~keep_outside, very_negative)  # [N, V]
    log_q_tail = torch.logsumexp(log_q_outside, dim=-1)  # [N]
    log_q_tail = torch.where(has_tail, log_q_tail, torch.zeros_like(log_q_tail))  # [N]

    log_q = torch.cat([log_q_top, log_q_tail[:, None]], dim=-1)  # [N, K+1]
    keep_named = torch.ones_like(ids, dtype=torch.bool)  # [N, K]
    keep_bin = torch.cat([keep_named, has_tail[:, None]], dim=-1)  # [N, K+1]
    q = torch.where(keep_bin, log_q.exp(), torch.zeros_like(log_q))  # [N, K+1]

    probs = target.probs.to(device=logits.device, dtype=logits.dtype)  # [N, K]
    tail = target.tail.to(device=logits.device, dtype=logits.dtype).clamp_min(0.0)  # [N]
    tail = torch.where(has_tail, tail, torch.zeros_like(tail))  # [N]
    p = torch.cat([probs.clamp_min(0.0), tail[:, None]], dim=-1)  # [N, K+1]
    return _Bins(p=p, q=q, log_q=log_q)


def _kl_p_q(bins: _Bins) -> torch.Tensor:
    """KL(p || q) per row: sum p log p - p log q (0 log 0 = 0). Returns [N]."""
    return (torch.xlogy(bins.p, bins.p) - bins.p * bins.log_q).sum(dim=-1)


def _kl_q_p(bins: _Bins, min_target_prob: float) -> torch.Tensor:
    """KL(q || p) per row with p floored at ``min_target_prob`` in the log. Returns [N]."""
    if not min_target_prob > 0:
        raise ValueError(f"min_target_prob must be > 0, got {min_target_prob}")
    log_p_floored = bins.p.clamp_min(min_target_prob).log()  # [N, K+1]
    return (bins.q * (bins.log_q - log_p_floored)).sum(dim=-1)


# ---------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------


def forward_kl(
    student_logits: torch.Tensor,  # [N, V]
    target: SparseDist,
    temperature: float = 1.0,
) -> torch.Tensor:
    """KL(p_target || q_student) on the K+1 bins. Returns [N]."""
    return _kl_p_q(_coarsen(student_logits, target, temperature))


def reverse_kl(
    student_logits: torch.Tensor,  # [N, V]
    target: SparseDist,
    temperature: float = 1.0,
    min_target_prob: float = DEFAULT_MIN_TARGET_PROB,
) -> torch.Tensor:
    """KL(q_student || p_target) on the K+1 bins. Returns [N].

    The target is floored at ``min_target_prob`` inside the log (see module docstring).
    """
    return _kl_q_p(_coarsen(student_logits, target, temperature), min_target_prob)


def draft_opd(
    student_logits: torch.Tensor,  # [N, V]
    target: SparseDist,
    wrong: torch.Tensor | None = None,  # [N] bool
    reverse_weight: float = 1.0,
    temperature: float = 1.0,
    min_target_prob: float = DEFAULT_MIN_TARGET_PROB,
) -> torch.Tensor:
    """What verification says, per row (the "Draft-OPD" recipe of vLLM's speculators): forward KL
    where the served draft proposed the target's token (cover the target's distribution there),
    ``reverse_weight`` x reverse KL where it was wrong (mode-seeking: move its top choice onto the
    target's). ``wrong`` None: every row forward KL. Returns [N]."""
    forward = forward_kl(student_logits, target, temperature)
    if wrong is None:
        return forward
    reverse = reverse_kl(student_logits, target, temperature, min_target_prob)
    return torch.where(wrong.to(forward.device), float(reverse_weight) * reverse, forward)


def jsd(
    student_logits: torch.Tensor,  # [N, V]
    target: SparseDist,
    beta: float = 0.5,
    temperature: float = 1.0,
    min_target_prob: float = DEFAULT_MIN_TARGET_PROB,
) -> torch.Tensor:
    """Generalised JSD of GKD on the K+1 bins. Returns [N].

    ``beta * KL(p || M) + (1 - beta) * KL(q || M)`` with ``M = beta p + (1 - beta) q``
    for beta in (0, 1); ``beta = 0`` is forward KL and ``beta = 1`` reverse KL
    (the limits of the scaled divergence; ``min_target_prob`` is only used there).
    """
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    bins = _coarsen(student_logits, target, temperature)
    if beta == 0.0:
        return _kl_p_q(bins)
    if beta == 1.0:
        return _kl_q_p(bins, min_target_prob)
    # log M = logaddexp(log beta + log p, log(1 - beta) + log q); log p = -inf where
    # p = 0 is fine because log q is finite, and p carries no gradient.
    log_p = bins.p.log()  # [N, K+1]
    log_m = torch.logaddexp(log_p + math.log(beta), bins.log_q + math.log1p(-beta))  # [N, K+1]
    kl_p_m = (torch.xlogy(bins.p, bins.p) - bins.p * log_m).sum(dim=-1)  # [N]
    kl_q_m = (bins.q * (bins.log_q - log_m)).sum(dim=-1)  # [N]
    return beta * kl_p_m + (1.0 - beta) * kl_q_m


def tvd(
    student_logits: torch.Tensor,  # [N, V]
    target: SparseDist,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Total variation distance 0.5 * sum |p - q| on the K+1 bins, in [0, 1]. Returns [N]."""
    bins = _coarsen(student_logits, target, temperature)
    return 0.5 * (bins.p - bins.q).abs().sum(dim=-1)


def top1_agreement(student_logits: torch.Tensor, target: SparseDist) -> torch.Tensor:
    """Whether the student's argmax equals the target's most probable named id. Returns [N] bool.

    student_logits: [N, V]. The target's top-1 is taken among its K ids (the tail
    bin aggregates many tokens and is not a token).
    """
    student_top1 = student_logits.argmax(dim=-1)  # [N]
    best_bin = target.probs.argmax(dim=-1, keepdim=True)  # [N, 1]
    target_top1 = target.ids.gather(1, best_bin).squeeze(1).to(student_top1.device)  # [N]
    return student_top1 == target_top1


LossFn = Callable[..., torch.Tensor]


def feature_regression(predicted: torch.Tensor, target: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """EAGLE's feature loss: smooth L1 between a feature draft's predicted next features and the
    target's (constants), averaged over the feature's H dimensions.

    predicted: [..., N, H] (one slice per training pass), target: [N, H]. Per element
    ``0.5 d^2 / beta`` where ``|d| < beta``, else ``|d| - 0.5 beta`` (``torch.nn.functional.smooth_l1_loss``).
    Returns [..., N]: one value per position, as the distribution losses do.
    """
    if predicted.shape[-2:] != target.shape:
        raise ValueError(f"feature_regression: predicted {tuple(predicted.shape)} does not end in target's {tuple(target.shape)}")
    if beta <= 0:
        raise ValueError(f"feature_regression: beta must be > 0, got {beta}")
    pred = _as_float(predicted)
    tgt = _as_float(target).detach().to(pred.dtype).expand_as(pred)
    return torch.nn.functional.smooth_l1_loss(pred, tgt, reduction="none", beta=beta).mean(dim=-1)


#: by name: the names are ``config.learner.LOSS_NAMES`` (what configs are checked against)
LOSSES: Dict[str, LossFn] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": jsd,
    "tvd": tvd,
    "draft_opd": draft_opd,  # the trainer binds each batch's ``wrong`` rows
}


def get_loss(name: str, **kw) -> LossFn:
    """Loss ``name`` with keyword arguments bound: ``fn(student_logits, target) -> [N]``.

    Raises ValueError on an unknown name or a keyword the loss does not accept.
    """
    try:
        fn = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}") from None
    if not kw:
        return fn
    params = inspect.signature(fn).parameters
    unknown = sorted(set(kw) - (set(params) - {"student_logits", "target"}))
    if unknown:
        accepted = [p for p in params if p not in ("student_logits", "target")]
        raise ValueError(f"loss {name!r} got unexpected options {unknown}; accepts {accepted}")
    return functools.partial(fn, **kw)
