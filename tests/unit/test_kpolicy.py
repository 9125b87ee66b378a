"""Choosing k: closed forms, the cost model, the acceptance estimate and the adaptive policy."""

from __future__ import annotations

import random

import pytest

from config import KPolicyConfig, SamplingParams
from speculative import CostModel, KPolicy, expected_speedup, expected_tokens
from speculative.kpolicy import AcceptanceEstimate, ProbeSchedule


# -- closed forms ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_expected_tokens_extremes(k):
    assert expected_tokens(0.0, k) == 1.0  # useless draft: only the target's own token
    assert expected_tokens(1.0, k) == k + 1  # perfect draft: all k + the bonus


def test_expected_tokens_hand_values():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)  # 1.875
    assert expected_tokens(0.8, 2) == pytest.approx(1 + 0.8 + 0.64)
    assert expected_tokens(0.999999, 4) == pytest.approx(5.0, abs=1e-4)  # continuous at a -> 1


def test_expected_speedup_hand_values():
    assert expected_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    assert expected_speedup(0.5, 3, 0.1, v=1.5) == pytest.approx(1.875 / 1.8)
    assert expected_speedup(0.9, 0, 0.3) == 1.0  # k = 0 is plain decoding
    assert expected_speedup(1.0, 4, 0.0) == 5.0


# -- best k --------------------------------------------------------------------------------------
def test_best_k_zero_for_useless_draft():
    policy = KPolicy(KPolicyConfig(k_max=8), CostModel())
    assert policy.best_k(0.02, 0.2) == 0
    assert policy.best_k(0.0, 0.0) == 0  # ties go to the smaller k


@pytest.mark.parametrize("k_max, want", [(6, 6), (12, 8), (2, 2)])
def test_best_k_for_good_cheap_draft(k_max, want):
    # S(k) = (1 - 0.8^(k+1)) / 0.2 / (0.05 k + 1): 1.71 2.22 2.57 2.80 2.95 3.04 3.08 3.092 3.078 ...
    policy = KPolicy(KPolicyConfig(k_max=k_max), CostModel())
    assert policy.best_k(0.8, 0.05) == want


def test_best_k_zero_when_verification_is_not_parallel():
    """If verifying j tokens costs j target steps, drafting never pays."""
    costs = CostModel(verify_s={j: 0.01 * j for j in range(1, 8)})
    assert KPolicy(KPolicyConfig(k_max=6), costs).best_k(0.6, 0.05) == 0
    assert KPolicy(KPolicyConfig(k_max=6), CostModel(verify_s={1: 0.01})).best_k(0.6, 0.05) > 0


def test_fixed_k():
    assert KPolicy(KPolicyConfig(fixed_k=3), CostModel()).choose("draft") == 3
    assert KPolicy(KPolicyConfig(fixed_k=0), CostModel()).choose("draft") == 0


def test_probing_backs_off_exponentially():
    policy = KPolicy(KPolicyConfig(prior_alpha=0.0, probe_every=4, k_max=4), CostModel())
    picks = [policy.choose("draft") for _ in range(40)]
    probes = [i + 1 for i, k in enumerate(picks) if k]
    assert set(picks) <= {0, 1}
    assert probes == [4, 12, 28]  # gaps 4, 8, 16


# -- cost model -----------------------------------------------------------------------------------
def test_cost_model_relative_verify():
    costs = CostModel()
    assert costs.relative_verify(5) == 1.0  # nothing measured: optimistic
    costs.verify_s.update({1: 0.010, 4: 0.020})
    assert costs.relative_verify(1) == 1.0
    assert costs.relative_verify(2) == 1.0  # nearest measured smaller size is 1
    assert costs.relative_verify(4) == pytest.approx(2.0)
    assert costs.relative_verify(7) == pytest.approx(2.0)  # borrows 4
    costs.verify_s[3] = 0.005  # faster than one token (noise): never below 1
    assert costs.relative_verify(3) == 1.0


def test_cost_model_ema_and_c():
    costs = CostModel(ema=0.5)
    assert costs.c("draft") == 0.0
    costs.observe_verify(1, 1.0)
    costs.observe_verify(1, 2.0)
    assert costs.verify_s[1] == pytest.approx(1.5)
    costs.observe_draft("draft", 4, 0.6)  # 0.15 s per proposed token
    costs.observe_draft("draft", 0, 9.0)  # nothing proposed: ignored
    assert costs.draft_s["draft"] == pytest.approx(0.15)
    assert costs.c("draft") == pytest.approx(0.1)
    assert costs.c("ngram") == 0.0


# -- acceptance estimate ----------------------------------------------------------------------------
def _observe_bernoulli(est: AcceptanceEstimate, a: float, steps: int, k: int, rng: random.Random) -> list[float]:
    values = []
    for _ in range(steps):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        est.observe(k, n)
        values.append(est.value)
    return values


@pytest.mark.parametrize("a", [0.1, 0.5, 0.9])
def test_acceptance_estimate_converges_without_decay(a):
    est = AcceptanceEstimate(prior=0.6, decay=1.0)
    _observe_bernoulli(est, a, 4000, k=4, rng=random.Random(0))
    assert est.value == pytest.approx(a, abs=0.02)


@pytest.mark.parametrize("a", [0.3, 0.7])
def test_acceptance_estimate_tracks_rate_with_default_decay(a):
    est = AcceptanceEstimate(prior=0.5)
    values = _observe_bernoulli(est, a, 3000, k=4, rng=random.Random(1))
    mean = sum(values[100:]) / len(values[100:])
    assert mean == pytest.approx(a, abs=0.05)


def test_acceptance_estimate_follows_a_change():
    est = AcceptanceEstimate(prior=0.6)
    rng = random.Random(2)
    _observe_bernoulli(est, 0.9, 200, k=4, rng=rng)
    assert est.value > 0.8
    _observe_bernoulli(est, 0.0, 50, k=4, rng=rng)
    assert est.value < 0.2
    before = (est.accepted, est.trials, est.value)
    est.observe(0, 0)  # nothing proposed: no information, and no decay of what is known
    assert (est.accepted, est.trials, est.value) == before


# -- through the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_draft(make_llama):
    return make_llama(1, seed=123)  # untrained: shares nothing with the target


def _ks_of_request(engine, prompt, n=120) -> list[int]:
    ks: list[int] = []
    engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True), on_step=lambda r: ks.append(r.proposed))
    return ks


def test_adaptive_k_stops_drafting_with_a_useless_draft(random_draft, draft_proposer, make_engine, prompts):
    # an optimistic prior: the policy starts out drafting and must learn that the draft is useless
    engine = make_engine(draft_proposer(random_draft),
                         k=KPolicyConfig(k_max=4, probe_every=4, prior_alpha=0.95, ema=1e-12))
    # calibrated costs, as build_engine measures them, but fixed (ema ~ 0): the tiny models'
    # sub-millisecond timings on a shared CPU made the first choice a coin toss. c = 0.2 and
    # v(j) = 1 + 0.3 (j - 1), this CPU's shape: drafting pays at the prior, not at a useless draft's alpha
    engine.costs.verify_s.update({j: 0.010 * (1 + 0.3 * (j - 1)) for j in range(1, 6)})
    engine.costs.draft_s["draft"] = 0.002
    ks = _ks_of_request(engine, prompts[0])
    assert ks[0] > 0, ks
    later = ks[10:]
    assert sum(k == 0 for k in later) >= 0.8 * len(later), ks
    assert 1 in later, "the policy must keep probing the draft now and then"
    assert max(later) <= 1


def test_adaptive_k_stops_drafting_without_calibration(random_draft, draft_proposer, make_engine, prompts):
    # costs measured live on sub-millisecond models: under a loaded CPU a noisy draft cost flips a
    # few steps back to k = 1 (0.78 of steps at k = 0 seen once with another test run beside it)
    engine = make_engine(draft_proposer(random_draft), k=KPolicyConfig(k_max=4, probe_every=4, prior_alpha=0.95))
    later = _ks_of_request(engine, prompts[0])[10:]
    assert sum(k == 0 for k in later) >= 0.7 * len(later), later


def test_calibrate_default_context_small_vocab(make_engine):
    engine = make_engine(None)
    engine.calibrate(repeats=1)
    assert 1 in engine.costs.verify_s


def test_cost_model_moving_average_by_hand():
    costs = CostModel(ema=0.5)
    costs.observe_verify(1, 1.0)
    costs.observe_verify(1, 3.0)
    assert costs.verify_s[1] == pytest.approx(2.0)
    costs.observe_draft("draft", 1, 0.2)  # one token: 0.2 s per token
    costs.observe_draft("draft", 0, 9.0)  # nothing proposed: nothing to learn
    costs.observe_draft("draft", 2, 1.0)  # 0.5 s per token
    assert costs.draft_s["draft"] == pytest.approx(0.5 * 0.2 + 0.5 * 0.5)


def test_relative_verify_by_hand():
    costs = CostModel()
    assert costs.relative_verify(3) == 1.0  # nothing measured
    costs.verify_s.update({1: 1.0, 2: 1.5})
    assert costs.relative_verify(1) == 1.0
    assert costs.relative_verify(2) == pytest.approx(1.5)
    assert costs.relative_verify(5) == pytest.approx(1.5)  # the nearest measured smaller size
    costs.verify_s[3] = 0.5  # a faster larger forward (noise) never counts as cheaper than one token
    assert costs.relative_verify(3) == 1.0
    only_large = CostModel(verify_s={3: 2.0})  # no size at or below 2 measured yet: optimistic 1
    assert only_large.relative_verify(2) == 1.0


def test_acceptance_estimate_prior_strength_and_empty_observations():
    est = AcceptanceEstimate(prior=0.6, strength=2.0)
    assert est.value == pytest.approx(0.6)
    est.observe(0, 0)  # nothing proposed: nothing learned, nothing forgotten
    assert (est.accepted, est.trials) == (0.0, 0.0)
    est.observe(4, 1)
    assert est.value == pytest.approx((0.6 * 2 + 1) / (2 + 2))


def _two_state_policy(probe_every: int = 3) -> KPolicy:
    """k_max = 1 and costs under which k = 1 pays iff a > 0.8: S(1) = (1 + a) / (0.3 + 1.5)."""
    costs = CostModel()
    costs.verify_s.update({1: 1.0, 2: 1.5})
    costs.draft_s["d"] = 0.3
    return KPolicy(KPolicyConfig(k_max=1, probe_every=probe_every), costs, prior={"d": 0.95})


def test_choose_one_when_one_pays_and_probe_after_exactly_probe_every_idle_steps():
    policy = _two_state_policy(probe_every=3)
    assert [policy.choose("d") for _ in range(3)] == [1, 1, 1]
    est = policy.estimate("d")
    est.prior, est.accepted, est.trials = 0.1, 0.0, 0.0  # the draft turned bad
    assert [policy.choose("d") for _ in range(6)] == [0, 0, 1, 0, 0, 0]  # a probe after 3, then the gap doubles
    assert [policy.choose("d") for _ in range(3)] == [0, 0, 1]


def test_probe_gap_backs_off_to_256():
    policy = _two_state_policy(probe_every=1)
    est = policy.estimate("d")
    est.prior = 0.1
    for _ in range(2000):
        policy.choose("d")
    assert policy.probes.gap["d"] == 256


def test_probe_schedule_by_hand():
    sched = ProbeSchedule(probe_every=2)
    assert [sched.due("d") for _ in range(8)] == [False, True, False, False, False, True, False, False]
    assert sched.gap["d"] == 8 and sched.idle["d"] == 2
    sched.drafted("d")  # a real draft starts the gap over
    assert (sched.idle["d"], sched.gap["d"]) == (0, 2)
    assert [sched.due("d") for _ in range(2)] == [False, True]
    assert [sched.due("d") for _ in range(6)] == [False, False, False, True, False, False]  # gap 4, then 8
    assert [sched.due("x") for _ in range(2)] == [False, True] and sched.gap["x"] == 4
    sched.sooner(["d", "y"])  # new weights: the gap of the sources named halves; idle steps are kept
    assert (sched.gap["d"], sched.idle["d"], sched.gap["x"]) == (4, 2, 4) and "y" not in sched.gap
    assert [sched.due("d") for _ in range(2)] == [False, True]
    sched.gap["d"] = 3
    sched.sooner(["d"])  # never below probe_every
    assert sched.gap["d"] == 2


def test_upper_acceptance_by_hand():
    est = AcceptanceEstimate(prior=0.5)
    assert est.upper(0.5) == pytest.approx(0.5 + 0.5 * (0.25 / 2) ** 0.5)  # the prior alone: weight 1
    assert est.upper(2.0) == 1.0  # capped
    est.observe(4, 1)  # 1 accepted, 1 failure: (0.5 + 1) / (1 + 2) = 0.5, weight 3
    assert est.upper(2.0) == pytest.approx(0.5 + 2 * (0.25 / 4) ** 0.5)
    est.observe(4, 0)  # decayed: accepted 0.9, trials 0.9 * 2 + 1 = 2.8: a = 1.4 / 3.8, weight 3.8
    assert est.upper(1.0) == pytest.approx(1.4 / 3.8 + ((1.4 / 3.8) * (2.4 / 3.8) / 4.8) ** 0.5)
    assert est.upper(0.0) == est.value
    assert AcceptanceEstimate(prior=0.0).upper(2.0) == 0.0


def test_within_reach_is_break_even_at_the_optimistic_acceptance():
    """v(j) = 1 + 0.5 (j - 1), c = 0.2: one token pays from a > 0.7 (1 + a > 1.7), more never earlier."""
    costs = CostModel(verify_s={j: 0.01 * (1 + 0.5 * (j - 1)) for j in range(1, 8)}, draft_s={"d": 0.002})
    policy = KPolicy(KPolicyConfig(k_max=6), costs, prior={"d": 0.1})
    est = policy.estimate("d")
    for _ in range(30):  # probes that fail: a -> ~0.01 with weight ~11, upper ~0.07
        est.observe(1, 0)
    assert est.upper(2.0) < 0.7 and not policy.within_reach("d")
    est.accepted, est.trials = 6.0, 7.0  # a = 0.76 after lucky steps
    assert policy.within_reach("d")
    est.accepted, est.trials = 4.0, 7.0  # a = 0.51, upper = 0.51 + 2 * sqrt(0.25 / 9) = 0.84: optimistic, within
    assert est.value < 0.7 < est.upper(2.0) and policy.within_reach("d")
    assert KPolicy(KPolicyConfig(k_max=6), CostModel(), prior={"d": 0.01}).within_reach("d")  # costs unknown: free


def test_policies_sharing_a_schedule_back_off_together():
    shared = ProbeSchedule(probe_every=3)
    first, second = (KPolicy(KPolicyConfig(k_max=1, probe_every=3), _two_state_policy().costs, prior={"d": 0.1},
                             probes=shared) for _ in range(2))
    assert [first.choose("d") for _ in range(3)] == [0, 0, 1]
    assert [second.choose("d") for _ in range(6)] == [0, 0, 0, 0, 0, 1]  # not again after 3: the gap doubled
    alone = KPolicy(KPolicyConfig(k_max=1, probe_every=3), _two_state_policy().costs, prior={"d": 0.1})
    assert alone.probes is not shared and [alone.choose("d") for _ in range(3)] == [0, 0, 1]


def test_a_scope_s_requests_share_one_probe_schedule_and_new_weights_shorten_it(random_draft, draft_proposer,
                                                                                 make_engine, prompts):
    """A useless draft in one scope: later requests of the scope do not re-probe it from the short
    gap, as every request did with a schedule of its own; a request of another scope does; new
    draft weights halve the gap of every schedule where the draft is within reach of paying."""
    engine = make_engine(draft_proposer(random_draft), k=KPolicyConfig(k_max=4, probe_every=4, prior_alpha=0.95, ema=1e-12))
    engine.costs.verify_s.update({j: 0.010 * (1 + 0.3 * (j - 1)) for j in range(1, 6)})
    engine.costs.draft_s["draft"] = 0.002
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def ks(scope):
        out: list[int] = []
        engine.generate(prompts[0], params, on_step=lambda r: out.append(r.proposed), scope=scope)
        return out

    first = ks("code")
    assert first[0] > 0 and 1 in first[10:], first  # learns the draft is useless, probes it
    later = [ks("code") for _ in range(4)]
    probes = sum(k > 0 for run in later for k in run[1:])  # after each request's first step (its prefill)
    assert probes <= 3, later  # 4 x 24 steps: a schedule per request would probe at least twice in each
    rids = [engine.add_request(prompts[0], params, scope=s) for s in ("code", "code", "sql", None)]
    pols = [engine.requests[r].policy for r in rids]
    assert pols[0].probes is pols[1].probes is engine.scope_policy["code"].probes
    assert pols[2].probes is engine.scope_policy["sql"].probes is not pols[0].probes
    assert pols[3].probes is engine.global_policy.probes
    gaps = {s: engine.scope_policy[s].probes.gap.get("draft") for s in ("code", "sql")}
    assert gaps["code"] > 4 and engine.global_policy.probes.gap.get("draft") is None
    engine.scope_policy["sql"].probes.gap["draft"] = 64
    weights = engine.learned_draft.runner.model.state_dict()
    # verification dearer (v(2) = 1.5: one token pays from a > 0.7): in code the draft is out of reach
    # (its optimistic a, ~0.5 after the failed probes, is below break-even), so its gap stands; sql
    # never tried it (the prior, 0.95): its gap halves
    engine.costs.verify_s.update({j: 0.010 * (1 + 0.5 * (j - 1)) for j in range(1, 6)})
    assert not engine.scope_policy["code"].within_reach("draft") and engine.scope_policy["sql"].within_reach("draft")
    engine.swap_draft(weights, engine.draft_version + 1)
    assert engine.scope_policy["code"].probes.gap["draft"] == gaps["code"]
    assert engine.scope_policy["sql"].probes.gap["draft"] == 32
    engine.stage_draft(weights, engine.draft_version + 1)
    engine.install_staged()  # weights installed between steps: the same
    assert engine.scope_policy["sql"].probes.gap["draft"] == 16
    engine.costs.verify_s.update({j: 0.010 for j in range(1, 6)})  # verification free, the draft nearly so:
    engine.costs.draft_s["draft"] = 1e-5  # now within reach in code too, and new weights halve its gap
    assert engine.scope_policy["code"].within_reach("draft")
    engine.swap_draft(weights, engine.draft_version + 1)
    assert engine.scope_policy["code"].probes.gap["draft"] == max(4, gaps["code"] // 2)
    for r in rids:
        engine.release(r)


def test_a_request_starts_from_its_scope_s_acceptance_and_its_scope_moves_last(random_draft, draft_proposer, make_engine,
                                                                               prompts):
    engine = make_engine(draft_proposer(random_draft), k=KPolicyConfig(k_max=4))
    engine.global_policy.observe("draft", 4, 4)  # engine-wide the draft was right ...
    for s in ("code", "sql"):
        engine._scope_policy(s)
    engine.scope_policy["code"].observe("draft", 4, 0)  # ... in code wrong at once
    params = SamplingParams(max_tokens=4)
    code, other = engine.add_request(prompts[0], params, scope="code"), engine.add_request(prompts[0], params)
    assert engine.requests[code].policy.prior["draft"] == pytest.approx(engine.scope_policy["code"].estimate("draft").value)
    assert engine.requests[other].policy.prior["draft"] == pytest.approx(engine.global_policy.estimate("draft").value)
    assert engine.scope_policy["code"].estimate("draft").value < 0.5 < engine.global_policy.estimate("draft").value
    assert list(engine.scope_policy) == ["sql", "code"]  # most recently seen last: the oldest is evicted first
    for r in (code, other):
        engine.release(r)
