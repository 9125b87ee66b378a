"""Acceptance rules (speculative.sampling): hand cases, warping, sparse top-k, and the statistical
guarantee of speculative sampling (the output is distributed exactly as the target p)."""

from __future__ import annotations

import math

import pytest
import torch

from config import SamplingParams
from speculative.sampling import greedy_accept, rejection_accept, sparse_top_k, warp_logits

V = 8


def _logits_with_argmax(argmaxes: list[int], v: int = V) -> torch.Tensor:
    """[len(argmaxes), v] logits whose row i has its (unique) maximum at argmaxes[i]."""
    g = torch.Generator().manual_seed(1)
    logits = torch.rand(len(argmaxes), v, generator=g)  # in [0, 1)
    for i, a in enumerate(argmaxes):
        logits[i, a] = 5.0
    return logits


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


# -- greedy_accept ---------------------------------------------------------------------------
def test_greedy_perfect_match_accepts_all_and_adds_bonus_from_row_k():
    logits = _logits_with_argmax([3, 1, 4, 6])  # k = 3
    n, nxt = greedy_accept(torch.tensor([3, 1, 4]), logits.argmax(-1))
    assert (n, nxt) == (3, 6)


def test_greedy_early_mismatch():
    logits = _logits_with_argmax([3, 1, 4, 6])
    n, nxt = greedy_accept(torch.tensor([3, 2, 4]), logits.argmax(-1))  # d_2 wrong; d_3 right but after a rejection
    assert (n, nxt) == (1, 1)  # the target's argmax at row 1


def test_greedy_all_rejected():
    logits = _logits_with_argmax([3, 1, 4, 6])
    n, nxt = greedy_accept(torch.tensor([0, 1, 4]), logits.argmax(-1))
    assert (n, nxt) == (0, 3)


def test_greedy_k_zero():
    logits = _logits_with_argmax([5])
    assert greedy_accept(torch.tensor([], dtype=torch.long), logits.argmax(-1)) == (0, 5)


# -- rejection_accept: hand cases ------------------------------------------------------------------
def _random_dists(rows: int, v: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, v, generator=g).add(0.05).softmax(-1)


def test_rejection_q_equals_p_accepts_everything():
    p = _random_dists(4)
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        d = torch.multinomial(p[:3], 1, generator=g).squeeze(1)
        n, nxt = rejection_accept(d, p[:3].clone(), p, g)
        assert n == 3, f"seed {seed}: q == p must accept all 3 draft tokens, accepted {n}"
        assert 0 <= nxt < V


def test_rejection_zero_target_prob_never_accepted():
    p = _random_dists(3)
    q = _random_dists(2, seed=1)
    p[0, 2] = 0.0  # the target never emits token 2 at row 0
    p[0] /= p[0].sum()
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        n, nxt = rejection_accept(torch.tensor([2, 5]), q, p, g)
        assert n == 0
        assert nxt != 2, "the recovered token comes from max(0, p - q), which is 0 where p is 0"


def test_rejection_one_hot_draft_acceptance_rate_is_p_of_d():
    """q one-hot at d (n-gram proposals): accept with probability p(d), never recover d itself."""
    p = torch.tensor([[0.3, 0.2, 0.5], [0.1, 0.1, 0.8]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    results = [rejection_accept(torch.tensor([0]), q, p, g) for _ in range(4000)]
    rate = sum(n for n, _ in results) / len(results)
    assert abs(rate - 0.3) < 0.03
    assert all(nxt != 0 for n, nxt in results if n == 0)


def test_rejection_k_zero_samples_from_p0():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    n, nxt = rejection_accept(torch.tensor([], dtype=torch.long), torch.zeros(0, 4), p, torch.Generator().manual_seed(0))
    assert (n, nxt) == (0, 2)


def test_rejection_seeded_determinism():
    p, q = _random_dists(4), _random_dists(3, seed=7)
    d = torch.tensor([1, 2, 3])

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [rejection_accept(d, q, p, g) for _ in range(50)]

    assert run(11) == run(11)
    assert run(11) != run(12)


# -- warp_logits -----------------------------------------------------------------------------------
def test_warp_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    out = warp_logits(logits, SamplingParams(temperature=2.0))
    torch.testing.assert_close(out, (logits / 2.0).softmax(-1))
    assert not torch.allclose(out, logits.softmax(-1))


def test_warp_top_k_keeps_exactly_k():
    logits = torch.tensor([[0.1, 2.0, -1.0, 3.0, 0.7, 1.5], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    out = warp_logits(logits, SamplingParams(temperature=1.0, top_k=3))
    assert ((out > 0).sum(-1) == 3).all()
    assert set(out[0].nonzero().flatten().tolist()) == {1, 3, 5}
    assert set(out[1].nonzero().flatten().tolist()) == {0, 1, 2}
    torch.testing.assert_close(out.sum(-1), torch.ones(2))
    torch.testing.assert_close(out[0, [1, 3, 5]], logits[0, [1, 3, 5]].softmax(-1))


def test_warp_top_k_keeps_every_logit_tied_with_the_kth():
    """Hugging Face's and vLLM's top-k is a threshold at the k-th largest logit: ties with it stay.
    The int4 runtime's logits are bfloat16-rounded (multiples of 1/8 near 20), where such ties occur."""
    logits = torch.tensor([[22.25, 21.625, 21.5, 21.5, 21.0], [3.0, 1.0, 1.0, 1.0, 0.0]])
    out = warp_logits(logits, SamplingParams(temperature=0.8, top_k=3))
    assert out[0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert out[1].nonzero().flatten().tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(out[0, :4], (logits[0, :4] / 0.8).softmax(-1))


@pytest.mark.parametrize("top_p, kept", [(0.4, 1), (0.6, 2), (0.8, 3), (0.9, 4), (0.99, 5), (1.0, 5)])
def test_warp_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    probs = torch.tensor([0.15, 0.5, 0.05, 0.2, 0.1])  # sorted: 0.5 .2 .15 .1 .05 -> cum .5 .7 .85 .95 1
    out = warp_logits(probs.log()[None], SamplingParams(temperature=1.0, top_p=top_p))[0]
    order = [1, 3, 0, 4, 2]
    assert set(out.nonzero().flatten().tolist()) == set(order[:kept])
    torch.testing.assert_close(out[order[:kept]], probs[order[:kept]] / probs[order[:kept]].sum())


@pytest.mark.parametrize("top_p, kept", [(0.5, {1}), (0.75, {1, 3}), (0.875, {1, 3, 0})])
def test_warp_top_p_exact_boundary(top_p, kept):
    """Dyadic probabilities are exact in float32: a prefix reaching exactly top_p is enough."""
    probs = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625])
    out = warp_logits(probs.log()[None], SamplingParams(temperature=1.0, top_p=top_p))[0]
    assert set(out.nonzero().flatten().tolist()) == kept


def test_warp_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 1.0]])
    out = warp_logits(logits, SamplingParams(temperature=0.0))
    assert torch.equal(out, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


# -- sparse_top_k -----------------------------------------------------------------------------------
def test_sparse_top_k_tail_is_remaining_mass():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(3))
    ids, probs, tail = sparse_top_k(logits, 5)
    full = logits.softmax(-1)
    assert ids.shape == (4, 5) and probs.shape == (4, 5) and tail.shape == (4,)
    assert torch.equal(ids, full.topk(5, -1).indices)
    torch.testing.assert_close(probs, full.gather(-1, ids))
    torch.testing.assert_close(tail, 1.0 - full.gather(-1, ids).sum(-1))
    assert (tail > 0.01).all() and (tail <= 1).all()


def test_sparse_top_k_larger_than_vocab():
    ids, probs, tail = sparse_top_k(torch.randn(2, 6), 16)
    assert ids.shape == (2, 6)
    assert (tail >= 0).all() and (tail < 1e-5).all()


# -- the statistical guarantee -----------------------------------------------------------------------
# V = 6, fixed target rows p and deliberately different draft rows q (q puts mass where p has none,
# and p puts mass where q has none).
P = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
        [0.10, 0.10, 0.40, 0.10, 0.10, 0.20],
        [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
    ]
)
Q = torch.tensor(
    [
        [0.05, 0.10, 0.45, 0.00, 0.15, 0.25],
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    ]
)


def _first_tokens(n_draws: int, seed: int, accept=rejection_accept) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft d_i ~ q_i, then the acceptance rule; returns the first output token and n of each draw."""
    g = torch.Generator().manual_seed(seed)
    k = Q.shape[0]
    d = torch.stack([torch.multinomial(Q[i], n_draws, replacement=True, generator=g) for i in range(k)], 1)
    first = torch.empty(n_draws, dtype=torch.long)
    accepted = torch.empty(n_draws, dtype=torch.long)
    for j in range(n_draws):
        n, nxt = accept(d[j], Q, P, g)
        first[j] = d[j, 0] if n > 0 else nxt
        accepted[j] = n
    return first, accepted


def _empirical(tokens: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=v).float() / len(tokens)


def test_speculative_sampling_output_is_distributed_as_target():
    assert _tv(Q[0], P[0]) > 0.5  # the draft alone would be far off
    first, accepted = _first_tokens(20_000, seed=0)
    # every case was exercised: all rejected, partly and fully accepted
    assert set(accepted.tolist()) == {0, 1, 2}
    tvs = {}
    for n in (500, 2_000, 8_000, 20_000):
        tvs[n] = _tv(_empirical(first[:n], 6), P[0])
        # sampling noise only: E[TV] <= 0.5 * sum sqrt(p (1 - p) / n) < sqrt(V / n) / 2
        assert tvs[n] < math.sqrt(6 / n), f"TV {tvs[n]:.4f} at n={n} exceeds the sampling-noise bound"
    assert tvs[20_000] < 0.02
    assert tvs[20_000] < tvs[500]  # it converges
    # acceptance rate of d_1 is sum_x min(p(x), q(x)) (Leviathan et al., theorem 3.5)
    beta = float(torch.minimum(P[0], Q[0]).sum())
    assert abs(float((accepted > 0).float().mean()) - beta) < 0.015


def test_statistical_harness_detects_a_wrong_recovery_distribution():
    """The same check catches a subtly wrong rule (on rejection, resample from p instead of
    norm(max(0, p - q))), so the test above has power."""

    def wrong(d, q, p, g):
        n, _ = rejection_accept(d, q, p, g)
        if n < len(d):
            return n, int(torch.multinomial(p[n], 1, generator=g))
        return n, int(torch.multinomial(p[len(d)], 1, generator=g))

    first, _ = _first_tokens(3_000, seed=1, accept=wrong)
    assert _tv(_empirical(first, 6), P[0]) > 0.1


# -- edge cases of the acceptance rule, forced through the uniform draw -------------------------------
def _fixed_uniform(monkeypatch, value: float):
    """torch.rand inside rejection_accept returns ``value`` everywhere (multinomial is untouched)."""
    real = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.full(a if a and isinstance(a[0], int) else a[0], value)
                        if "generator" in kw else real(*a, **kw))


def test_u_exactly_zero_never_accepts_a_token_the_target_cannot_emit(monkeypatch):
    """u is drawn from [0, 1): at u = 0 the test u * q < p must still refuse p(d) = 0."""
    _fixed_uniform(monkeypatch, 0.0)
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    n, nxt = rejection_accept(torch.tensor([0]), q, p, torch.Generator().manual_seed(0))
    assert n == 0 and nxt in (1, 2)


def test_rejection_where_p_is_below_q_everywhere_falls_back_to_p(monkeypatch):
    """Rounding can leave p <= q at every token (both sum to 1 only up to float error); a rejection
    there has an empty residual, and the recovered token comes from p itself, row n."""
    _fixed_uniform(monkeypatch, 0.9999999)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.5000001, 0.5, 0.0]])
    g = torch.Generator().manual_seed(0)
    outs = {rejection_accept(torch.tensor([0]), q, p, g) for _ in range(50)}
    assert outs <= {(0, 0), (0, 1)} and len(outs) == 2


def test_top_p_one_and_top_k_vocab_keep_every_token():
    """No filter means no filter, even for tokens below float32's resolution next to the top one
    (a nucleus step at top_p = 1 would drop them: their preceding mass rounds to 1.0)."""
    logits = torch.tensor([[20.0, 0.0, 0.0, -1.0]])
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=1.0, top_k=4)):
        probs = warp_logits(logits, params)
        assert (probs > 0).all(), params
        torch.testing.assert_close(probs, logits.softmax(-1))


@pytest.mark.parametrize("top_p", [5e-324, 1e-30, 1e-9])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    """A top_p below float32's resolution (fuzzing sent 5e-324) keeps the first token: a proper
    distribution, never NaN."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = warp_logits(logits, SamplingParams(temperature=0.7, top_p=top_p))
    assert torch.isfinite(out).all()
    assert torch.equal(out.argmax(-1), logits.argmax(-1)) and torch.allclose(out.max(-1).values, torch.ones(3))
