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


def test_every_figure_of_the_summary_by_hand():
    """What the dashboards read (steps, drafts, emitted tokens, times, acceptance per draft position,
    mean acceptance length, tokens per step), worked out by hand, then merged with a longer step."""
    s = SpecStats()
    for proposed, accepted in [(4, 4), (4, 1), (4, 0), (0, 0), (2, 2)]:
        s.observe(proposed, accepted, accepted + 1, 0.1, 0.2)
    assert (s.steps, s.drafts, s.emitted) == (5, 4, 12)  # the k = 0 step drafted nothing
    assert (s.draft_s, s.target_s) == (pytest.approx(0.5), pytest.approx(1.0))
    assert (s.proposed_at, s.accepted_at) == ([4, 4, 3, 3], [3, 2, 1, 1])
    summary = s.summary()
    assert summary == {
        "steps": 5, "proposed": 14, "accepted": 7, "emitted": 12, "alpha": 0.5, "token_acceptance": 7 / 9,
        "mean_acceptance_length": 1 + 7 / 4, "tokens_per_step": 12 / 5,
        "per_position_acceptance": [3 / 4, 2 / 4, 1 / 3, 1 / 3], "draft_s": pytest.approx(0.5), "target_s": pytest.approx(1.0)}
    longer = SpecStats()
    longer.observe(6, 5, 6, 0.05, 0.1)
    s.merge(longer)  # a longer step's positions extend the counts
    assert (s.proposed_at, s.accepted_at) == ([5, 5, 4, 4, 1, 1], [4, 3, 2, 2, 1, 0])
    assert (s.steps, s.drafts, s.proposed, s.accepted, s.rejected, s.emitted) == (6, 5, 20, 12, 3, 18)
    assert (s.draft_s, s.target_s) == (pytest.approx(0.55), pytest.approx(1.1))
    shorter = SpecStats()
    shorter.observe(1, 1, 2, 0.0, 0.0)
    longer.merge(shorter)  # a shorter one adds to the first positions only
    assert (longer.proposed_at, longer.accepted_at) == ([2, 1, 1, 1, 1, 1], [2, 1, 1, 1, 1, 0])
    one = SpecStats()
    one.observe(1, 0, 1, 0.0, 0.0)  # a step that drafted a single token, rejected
    assert (one.drafts, one.rejected, one.mean_acceptance_length, one.per_position) == (1, 1, 1.0, [0.0])
    empty = SpecStats()
    assert (empty.alpha, empty.mean_acceptance_length, empty.per_position, empty.summary()["tokens_per_step"]) == (
        None, None, [], None)


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
