"""Acceptance statistics: accepted / proposed (vLLM's rate) and per-token acceptance (the alpha of
E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha)), by hand and on simulated i.i.d. acceptance."""

from __future__ import annotations

import random

import pytest

from speculative.stats import SpecStats


def test_by_hand():
    s = SpecStats()
    for proposed, accepted in [(4, 4), (4, 1), (4, 0), (0, 0), (2, 2)]:
        s.observe(proposed, accepted, accepted + 1, 0.0, 0.0)
    assert (s.proposed, s.accepted, s.rejected) == (14, 7, 2)
    assert s.alpha == pytest.approx(7 / 14)
    assert s.token_acceptance == pytest.approx(7 / 9)  # 7 accepted of the 9 tokens the target checked
    other = SpecStats()
    other.observe(3, 0, 1, 0.0, 0.0)
    s.merge(other)
    assert s.rejected == 3 and s.token_acceptance == pytest.approx(7 / 10)
    assert s.summary()["token_acceptance"] == s.token_acceptance
    assert SpecStats().token_acceptance is None


@pytest.mark.parametrize("a,k", [(0.3, 4), (0.8, 4), (0.6, 1)])
def test_per_token_acceptance_recovers_an_iid_rate(a, k):
    """Each drafted token is accepted with probability a until the first rejection: per-token
    acceptance estimates a; accepted / proposed is E[accepted] / k, lower for k > 1."""
    rng, s = random.Random(0), SpecStats()
    for _ in range(20_000):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        s.observe(k, n, n + 1, 0.0, 0.0)
    assert s.token_acceptance == pytest.approx(a, abs=0.01)
    assert s.alpha == pytest.approx(sum(a ** i for i in range(1, k + 1)) / k, abs=0.01)
