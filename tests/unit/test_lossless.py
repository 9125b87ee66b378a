"""Lossless: speculative sampling emits exactly the target's law under temperature, top_p and top_k.

Each case draws N sequences of the first k_max + 2 tokens through the real engine and compares them
with the exact joint law, enumerated from the target's logits with an independently written warp
(see ``tests/lossless.py`` for the views, the significance ALPHA = 1e-4 per case and the power
calculation: N gives power >= 0.95 against any deviation of total variation >= 0.125 in a view).
The grid is a pairwise covering array over temperature {0.3, 0.7, 1, 1.5} x top_p {1, 0.8, 0.5} x
top_k {0, 3} x k {1, 2, 4} x fixed / adaptive k x a close / far draft x full / restricted head,
plus prompt lookup, lookup chained with a draft, the transformer path, and target-only decoding
over every warp. Positive controls break the engine the ways a review did and must be caught.
Every case is seeded: a rerun draws the same samples.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import lossless as L
from speculative import engine as engine_module
from speculative import proposers as proposers_module
from speculative.sampling import rejection_accept, warp_logits


@pytest.fixture(scope="module")
def markov() -> L.Models:
    return L.build_models("markov")


# -- the harness itself ---------------------------------------------------------------------------------
def test_covering_array_covers_every_pair_of_levels():
    cases = L.pairwise_cases()
    names = list(L.FACTORS)
    for a, b in itertools.combinations(names, 2):
        seen = {(getattr(c, a), getattr(c, b)) for c in cases}
        assert seen == set(itertools.product(L.FACTORS[a], L.FACTORS[b])), (a, b)
    assert len(cases) < 20


def test_reference_warp_by_hand():
    probs = np.array([[0.05, 0.5, 0.15, 0.2, 0.1]])
    logits = np.log(probs)
    p, amb = L.reference_warp(logits, 1.0, 0.8, 0)  # sorted .5 .2 .15 | .1 .05: mass before .15 is .7 < .8
    np.testing.assert_allclose(p[0], [0, 0.5 / 0.85, 0.15 / 0.85, 0.2 / 0.85, 0])
    assert amb == 0.0
    p, _ = L.reference_warp(logits, 1.0, 1.0, 2)
    np.testing.assert_allclose(p[0], [0, 0.5 / 0.7, 0, 0.2 / 0.7, 0])
    p, _ = L.reference_warp(logits, 1.0, 0.75, 3)  # top 3 renormalised: .588 .235 .176 -> keep 2
    np.testing.assert_allclose(p[0], [0, 0.5 / 0.7, 0, 0.2 / 0.7, 0])
    p, _ = L.reference_warp(logits, 0.5, 1.0, 0)
    np.testing.assert_allclose(p[0], probs[0] ** 2 / (probs[0] ** 2).sum())
    # a tie at the k-th logit keeps both tied tokens (Hugging Face / vLLM top-k, and warp_logits)
    tied = np.log(np.array([[0.4, 0.2, 0.1, 0.2, 0.1]]))
    p, _ = L.reference_warp(tied, 1.0, 1.0, 2)
    np.testing.assert_allclose(p[0], [0.5, 0.25, 0, 0.25, 0])
    p, _ = L.reference_warp(tied, 1.0, 1.0, 4)
    np.testing.assert_allclose(p[0], [0.4, 0.2, 0.1, 0.2, 0.1])


def test_exact_law_sums_to_one_and_matches_the_model(markov):
    law = L.exact_law(markov.target, L.PROMPT, 3, 1.0, 1.0, 0)
    assert len(law) == L.V**3
    assert abs(sum(law.values()) - 1.0) < 1e-9
    ids = torch.tensor([L.PROMPT + [4, 5]])
    p = torch.softmax(markov.target.context_logits(ids)[0, -3:].double(), -1)  # rows for x0, x1, x2
    assert law[(4, 5, 6)] == pytest.approx(float(p[0, 4] * p[1, 5] * p[2, 6]), rel=1e-5)


def test_marginals_add_up_the_sequences_that_share_the_positions():
    law = {(0, 1, 2): 0.1, (0, 1, 3): 0.2, (1, 1, 2): 0.3, (2, 0, 2): 0.4}
    assert L._marginal(law, (0, 1)) == pytest.approx({(0, 1): 0.3, (1, 1): 0.3, (2, 0): 0.4})
    assert L._marginal(law, (1, 2)) == pytest.approx({(1, 2): 0.4, (1, 3): 0.2, (0, 2): 0.4})
    assert L._marginal(law, (0, 1, 2)) == law
    other = {(5, 5): 1.0}  # a second law is not answered from the first one's arrays
    assert L._marginal(other, (1,)) == {(5,): 1.0} and L._marginal(law, (2,)) == pytest.approx({(2,): 0.8, (3,): 0.2})


def test_power_calculation():
    n = L.required_n(10, 1e-4)
    assert L.power(n, 10, 1e-4) >= L.POWER > L.power(n - 20, 10, 1e-4)
    assert L.required_n(40, 1e-4) > n  # more cells need more samples


# -- the grid ----------------------------------------------------------------------------------------------
def _check(res: L.CaseResult) -> None:
    assert res.passed, res.summary()
    assert res.power >= L.POWER, res.summary()
    case = res.case
    if case.draft != "none":  # the draft path was exercised: rejections and, mostly, full acceptances
        assert res.rejected > 0, res.summary()
        assert res.full > 0 or case.draft in ("far", "ngram"), res.summary()
        used = {k for k in res.ks if k > 0}
        assert used, res.summary()
        if case.adaptive:
            assert len(res.ks) >= 2, f"adaptive k never changed: {res.summary()}"


@pytest.mark.parametrize("case", L.pairwise_cases(), ids=lambda c: c.name)
def test_speculative_sampling_is_the_target_law(case, markov):
    _check(L.run_case(case, markov))


@pytest.mark.parametrize("case", L.PROPOSER_CASES + L.LLAMA_CASES, ids=lambda c: c.name)
def test_prompt_lookup_chain_and_transformer_are_the_target_law(case, markov):
    _check(L.run_case(case, markov if case.model == "markov" else None))


@pytest.mark.parametrize("case", L.TARGET_ONLY_CASES, ids=lambda c: c.name)
def test_target_only_decoding_applies_the_requested_warp(case, markov):
    """A parameter ignored by both the speculative and the target-only path is caught here."""
    _check(L.run_case(case, markov))


@pytest.mark.parametrize("case", L.SEEDED_CASES, ids=lambda c: c.name)
def test_seeded_sampling_is_the_target_law(case, markov):
    """Requests with a seed sample by the exponential race (noise fixed by seed and position)."""
    _check(L.run_case(case, markov if case.model == "markov" else None))


@pytest.mark.parametrize("case", L.PROCESSED_CASES, ids=lambda c: c.name)
def test_penalties_bias_min_p_and_grammars_are_the_processed_target_law(case, markov):
    """Each verified row is processed with the draft's tokens before it in its history, so the
    output's law is the processed target's whatever was drafted (and target-only applies it too)."""
    _check(L.run_case(case, markov if case.model == "markov" else None))


def test_control_verification_ignoring_the_drafts_history_is_caught(markov, monkeypatch):
    """Processing every row with the history before the step (not with d_1..d_j) is caught."""
    assert L.PROCESSED_CASES[1].draft == "close" and L.PROCESSED_CASES[1].process == L.PROCESS
    import speculative.engine as E

    real = E.process_rows
    monkeypatch.setattr(E, "process_rows", lambda logits, params, tokens, plen, draft, *rest: real(
        logits, params, tokens, plen, [tokens[-1]] * len(draft), *rest))
    assert not L.run_case(L.PROCESSED_CASES[1], markov).passed


def test_control_grammar_masking_every_row_with_the_steps_state_is_caught(markov, monkeypatch):
    """Masking every row with the grammar's state before the step (not after d_1..d_j) is caught: it
    lets through tokens the grammar forbids, which committing them refuses."""
    from speculative.grammar import Constraint

    case = next(c for c in L.PROCESSED_CASES if c.process == (("grammar", L.ALTERNATING),) and not c.seeded)
    real = Constraint.masks
    monkeypatch.setattr(Constraint, "masks", lambda self, draft: real(self, [])[[0] * (len(draft) + 1)])
    with pytest.raises(RuntimeError, match="the grammar refused an emitted token"):
        L.run_case(case, markov)


def test_seeded_output_does_not_depend_on_draft_or_k(markov):
    """A seeded request's tokens are the target's race winners: the same with any draft, head, k
    policy or none at all (what makes seeded requests reproducible while drafts learn)."""
    base = L.Case(0.9, 0.8, 0, 4, False, "none", seeded=True)
    variants = [base] + [L.Case(0.9, 0.8, 0, k, adaptive, draft, restricted, seeded=True)
                         for k, adaptive, draft, restricted in
                         [(1, False, "close", False), (4, False, "far", True), (4, True, "close", True),
                          (2, False, "chain", False), (3, False, "ngram", False)]]
    outputs = []
    for case in variants:
        engine = L.build_engine(case, markov)
        outputs.append(L.sample(engine, L.Case(0.9, 0.8, 0, 4, False, "none", seeded=True), 40, seed=9)[0])
    assert all(o == outputs[0] for o in outputs[1:])
    assert len(set(outputs[0])) > 10  # and the seed matters


# -- positive controls: the breaks a review made, each must fail the grid ------------------------------------
CONTROL = L.Case(1.0, 0.8, 0, 2, False, "close")


def _bonus_from_wrong_row(draft_tokens, draft_probs, target_probs, generator=None):
    k = draft_tokens.shape[0]
    if k:
        target_probs = target_probs.clone()
        target_probs[k] = target_probs[k - 1]  # the bonus token drawn from row k - 1
    return rejection_accept(draft_tokens, draft_probs, target_probs, generator)


def test_control_bonus_token_from_the_wrong_row_is_caught(markov, monkeypatch):
    monkeypatch.setattr(engine_module, "rejection_accept", _bonus_from_wrong_row)
    assert not L.run_case(CONTROL, markov).passed


def test_control_verification_ignoring_top_p_is_caught(markov, monkeypatch):
    def no_top_p(logits, params):
        return warp_logits(logits, params.model_copy(update={"top_p": 1.0}))

    monkeypatch.setattr(engine_module, "warp_logits", no_top_p)  # the target side only
    assert not L.run_case(CONTROL, markov).passed


def test_control_draft_reporting_another_q_is_caught(markov, monkeypatch):
    real = proposers_module.DraftModelProposer.propose_steps  # what the engine drives

    def other_q(self, seq_id, tokens, choose_k, params, gen):
        prop = yield from real(self, seq_id, tokens, choose_k, params, gen)
        if prop.probs is not None:  # sampled from q at T, reported as q at T = 1: (e^(z/T))^T = e^z
            prop.probs = prop.probs.pow(params.temperature)
            prop.probs /= prop.probs.sum(-1, keepdim=True)
        return prop

    monkeypatch.setattr(proposers_module.DraftModelProposer, "propose_steps", other_q)
    hot = L.Case(0.5, 1.0, 0, 2, False, "close")
    assert not L.run_case(hot, markov).passed


def test_control_target_only_ignoring_temperature_is_caught(markov, monkeypatch):
    def fixed_temperature(logits, params):
        return warp_logits(logits, params.model_copy(update={"temperature": 1.0}))

    monkeypatch.setattr(engine_module, "warp_logits", fixed_temperature)
    assert not L.run_case(L.Case(0.7, 1.0, 0, 0, False, "none"), markov).passed


def test_control_race_noise_shared_by_positions_is_caught(markov, monkeypatch):
    """Seeded: noise that ignores the position (every row the same draw) correlates the tokens."""
    real = engine_module.race_noise
    monkeypatch.setattr(engine_module, "race_noise", lambda seed, positions, v: real(seed, [0] * len(positions), v))
    monkeypatch.setattr(proposers_module, "race_noise", lambda seed, positions, v: real(seed, [0] * len(positions), v))
    assert not L.run_case(L.Case(1.0, 1.0, 0, 2, False, "close", seeded=True), markov).passed


def test_control_draft_racing_other_noise_loses_nothing_but_acceptance(markov, monkeypatch):
    """The draft's noise only couples it to the target: other noise keeps the law (the case passes)
    but lowers acceptance, which shows the coupling is real."""
    case = L.Case(1.0, 1.0, 0, 2, False, "close", seeded=True)
    coupled = L.run_case(case, markov, n=400)
    real = proposers_module.race_noise
    monkeypatch.setattr(proposers_module, "race_noise", lambda seed, positions, v: real(seed + 1, positions, v))
    uncoupled = L.run_case(case, markov, n=400)
    assert uncoupled.passed
    assert uncoupled.rejected > 1.5 * coupled.rejected, (coupled.summary(), uncoupled.summary())


def test_seeded_cases_are_deterministic(markov):
    case = L.Case(1.0, 1.0, 0, 2, False, "close")
    engine = L.build_engine(case, markov)
    a = L.sample(engine, case, 50, seed=3)[0]
    b = L.sample(engine, case, 50, seed=3)[0]
    c = L.sample(engine, case, 50, seed=4)[0]
    assert a == b and a != c


@pytest.mark.parametrize("case", L.CHAIN_CASES, ids=lambda c: c.name)
def test_llama_cpps_samplers_are_the_target_law_in_the_order_asked(case, markov):
    """Each case's samplers change the law materially (else the check would pass on a server that
    ignored them), and speculative decoding samples exactly that law."""
    process = L.case_process(case)
    plain = {k: v for k, v in process.items() if k not in L.CHAIN_KEYS}
    chained = L.exact_law(markov.target, L.PROMPT, case.m, case.temperature, case.top_p, case.top_k, process)
    without = L.exact_law(markov.target, L.PROMPT, case.m, case.temperature, case.top_p, case.top_k, plain)
    assert 0.5 * sum(abs(chained.get(s, 0.0) - without.get(s, 0.0)) for s in chained.keys() | without.keys()) > 0.05
    _check(L.run_case(case, markov, law=chained))
