"""The suffix-tree proposer (hand-made cases: matching, frequency, bounds, scopes) and the
controller that picks among proposers per step. Their lossless statistics are in
tests/lossless.py (the ``suffix`` and ``controller`` cases)."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest

from config import ControllerConfig, DraftConfig, KPolicyConfig, NgramConfig, SamplingParams, SuffixConfig
from speculative.kpolicy import CostModel, KPolicy, StepChoice
from speculative.proposers import ControllerProposer, NgramProposer
from speculative.suffix import SuffixProposer, SuffixUnavailable

GREEDY = SamplingParams()


def k_of(n):
    return lambda source: n


def serve(p: SuffixProposer, seq: str, prompt: list[int], output: list[int], scope=None) -> None:
    """One finished request through the proposer: begin, one propose mid-way, release."""
    p.begin(seq, prompt, scope)
    p.propose(seq, prompt + output[:1], k_of(4), GREEDY, None)
    p.release(seq, prompt + output)


def proposal(p: SuffixProposer, seq: str, tokens: list[int], k: int = 8, scope=None) -> list[int]:
    if seq not in p.active:
        p.begin(seq, tokens, scope)
    return p.propose(seq, tokens, k_of(k), GREEDY, None).tokens


def test_a_served_output_is_proposed_to_a_later_request_of_its_scope():
    p = SuffixProposer(SuffixConfig(spec_factor=1.0))
    serve(p, "a", [1, 2], [10, 11, 12, 13, 14, 15], scope="sql")
    # context ending in the 2-token match [10, 11]: at most 1.0 x 2 tokens follow
    assert proposal(p, "b", [7, 10, 11], scope="sql") == [12, 13]
    p2 = SuffixProposer(SuffixConfig(spec_factor=2.0))
    serve(p2, "a", [1, 2], [10, 11, 12, 13, 14, 15], scope="sql")
    assert proposal(p2, "b", [7, 10, 11], scope="sql") == [12, 13, 14, 15]
    assert proposal(p2, "c", [7, 10, 11], scope="chat") == []  # another domain's tree is empty
    assert proposal(p2, "d", [7, 10, 11], k=1, scope="sql") == [12]  # the k policy's cap holds


def test_the_request_matches_its_own_prompt_and_output():
    p = SuffixProposer(SuffixConfig(spec_factor=1.0))
    p.begin("a", [5, 6, 7, 8, 9], "x")
    assert p.propose("a", [5, 6, 7, 8, 9, 5, 6], k_of(4), GREEDY, None).tokens == [7, 8]
    p.release("a")
    assert proposal(p, "b", [1, 5, 6], scope="x") == []  # prompts are private: only outputs are shared


def test_the_most_frequent_continuation_wins_and_rare_ones_stop_the_proposal():
    p = SuffixProposer(SuffixConfig(spec_factor=4.0, min_token_prob=0.3))
    for i in range(3):
        serve(p, f"a{i}", [0], [1, 2, 3, 4], scope="s")
    serve(p, "b", [0], [1, 2, 9, 9], scope="s")
    assert proposal(p, "q", [1, 2], scope="s") == [3, 4]  # 3 of 4 went on with 3
    even = SuffixProposer(SuffixConfig(spec_factor=4.0, min_token_prob=0.6))
    serve(even, "a", [0], [1, 2, 3, 4], scope="s")
    serve(even, "b", [0], [1, 2, 9, 9], scope="s")
    assert proposal(even, "q", [1, 2], scope="s") == []  # a 50/50 split is below 0.6


def test_tokens_generated_after_the_last_proposal_join_the_tree_at_release():
    p = SuffixProposer(SuffixConfig(spec_factor=2.0))
    p.begin("a", [1], "s")
    p.release("a", [1, 30, 31, 32, 33])  # never proposed: all of it arrives with the release
    assert proposal(p, "b", [30, 31], scope="s") == [32, 33]


def test_eviction_keeps_at_most_max_requests_outputs_oldest_out_first():
    """A request takes its slot when it starts (its output joins the tree as it is generated)."""
    p = SuffixProposer(SuffixConfig(spec_factor=2.0, max_requests=3))
    for i in range(4):
        serve(p, f"r{i}", [0], [20 + 20 * i + j for j in range(4)], scope="s")
        assert p.stats()["s"]["requests"] == min(i + 1, 3)
    assert p.stats()["s"]["tokens"] == 12
    assert proposal(p, "q1", [80, 81], scope="s") == [82, 83]  # the newest (r3) is there
    p.release("q1")
    assert proposal(p, "q2", [20, 21], scope="s") == []  # the oldest (r0) went first


def test_eviction_keeps_at_most_max_tokens_but_never_the_newest_output():
    p = SuffixProposer(SuffixConfig(spec_factor=2.0, max_tokens=16))
    for i in range(5):
        serve(p, f"r{i}", [0], [100 + 10 * i + j for j in range(6)], scope="s")  # 6 output tokens each
        assert p.stats()["s"]["tokens"] <= 16
    assert p.stats()["s"]["requests"] == 2
    assert proposal(p, "q", [140, 141], scope="s") == [142, 143]
    assert proposal(p, "q2", [100, 101], scope="s") == []
    big = SuffixProposer(SuffixConfig(spec_factor=2.0, max_tokens=16))
    serve(big, "huge", [0], list(range(200, 240)), scope="s")  # alone over the bound: kept while newest
    assert big.stats()["s"] == {"requests": 1, "tokens": 40, "active": 0}
    serve(big, "next", [0], [1, 2, 3], scope="s")
    assert big.stats()["s"] == {"requests": 1, "tokens": 3, "active": 0}


def test_scopes_are_bounded_least_recently_used_out_active_ones_kept():
    p = SuffixProposer(SuffixConfig(spec_factor=2.0, max_scopes=2))
    p.begin("busy", [1], "a")  # scope a stays active throughout
    serve(p, "b1", [0], [5, 6, 7, 8], scope="b")
    serve(p, "c1", [0], [5, 6, 7, 8], scope="c")  # over the bound: b (idle, least recent) goes
    assert set(p.stats()) == {"a", "c"}
    assert proposal(p, "qb", [5, 6], scope="b") == []


def test_a_copy_starts_empty_so_each_engine_learns_its_own_traffic():
    """The draft pool deep-copies its base proposer per draft id (an isolated tenant has its own):
    one tenant's outputs never reach another's proposals."""
    p = SuffixProposer(SuffixConfig(spec_factor=2.0))
    serve(p, "a", [0], [70, 71, 72, 73], scope="sql")
    other = copy.deepcopy(p)
    assert other.stats() == {} and proposal(other, "q", [70, 71], scope="sql") == []
    assert proposal(p, "q", [70, 71], scope="sql") == [72, 73]


def test_an_output_served_elsewhere_is_proposed_here_in_its_scope_and_bounds():
    """Another replica's finished output (ids only, as the draft pool shares them) joins this
    proposer's tree of its scope: proposed here, not in another scope, evicted like a local one;
    an id active here is left alone."""
    here = SuffixProposer(SuffixConfig(spec_factor=2.0, max_requests=3))
    shipped = np.array([40, 41, 42, 43], dtype=np.int32)
    shipped.setflags(write=False)  # as Ray's object store hands it to the receiving replica
    here.add_served("a", shipped, scope="sql")
    assert here.stats()["sql"] == {"requests": 1, "tokens": 4, "active": 0}
    assert proposal(here, "q1", [40, 41], scope="sql") == [42, 43]
    here.release("q1")
    assert proposal(here, "q2", [40, 41], scope="chat") == []
    here.add_served("b", [50, 51, 52, 53], scope="sql")
    here.add_served("c", [60, 61, 62, 63], scope="sql")  # max_requests 3: "a", the oldest, goes
    assert here.stats()["sql"]["requests"] == 3
    assert {"b", "c"} <= here.cached_ids() and "a" not in here.cached_ids()
    assert proposal(here, "q3", [50, 51], scope="sql") == [52, 53]
    assert proposal(here, "q4", [40, 41], scope="sql") == []
    here.begin("live", [1], "sql")
    here.add_served("live", [70, 71, 72, 73], scope="sql")  # the same id active here: ignored
    assert proposal(here, "q5", [70, 71], scope="sql") == []


def test_an_engine_takes_outputs_served_elsewhere_into_its_suffix_tree(make_engine, draft_proposer, trunc_draft,
                                                                      prompts, greedy_reference):
    """Two engines (two replicas of one draft): outputs the first served, handed to the second with
    add_served, are drafted there in full on the same prompts; an engine without a suffix tree
    learns nothing from traffic."""
    def controller():
        return ControllerProposer(SuffixProposer(SuffixConfig(spec_factor=4.0)), NgramProposer(NgramConfig(max_n=2)),
                                  draft_proposer(trunc_draft), probe_every=4)

    a, b = make_engine(controller(), k=KPolicyConfig(k_max=6)), make_engine(controller(), k=KPolicyConfig(k_max=6))
    assert a.learns_from_traffic and not make_engine(draft_proposer(trunc_draft)).learns_from_traffic
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        b.add_served(f"a{i}", a.generate(list(p), params, scope="s").token_ids, scope="s")
    assert b.served_ids() == {"a0", "a1", "a2"}
    steps = []
    for p in prompts[:3]:
        assert b.generate(list(p), params, scope="s", on_step=steps.append).token_ids == greedy_reference(p, 24, ignore_eos=True)
    by_suffix = [s for s in steps if s.source == "suffix"]
    assert sum(s.accepted for s in by_suffix) >= 0.5 * 3 * 24  # most of it drafted from the other engine's outputs


def test_a_missing_backend_is_a_clear_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(SuffixUnavailable, match="pip install --no-build-isolation --no-deps arctic-inference"):
        SuffixProposer()


# -- in the engine ---------------------------------------------------------------------------------------
def test_suffix_and_controller_are_lossless_and_learn_repeated_outputs(make_engine, draft_proposer, trunc_draft,
                                                                       prompts, greedy_reference):
    """Greedy outputs equal target-only; served twice, a prompt's second run is drafted from the
    first one's output and (greedy outputs repeat) accepted in full."""
    for name in ("suffix", "controller"):
        suffix = SuffixProposer(SuffixConfig(spec_factor=4.0))
        proposer = suffix if name == "suffix" else ControllerProposer(
            suffix, NgramProposer(NgramConfig(max_n=2)), draft_proposer(trunc_draft), probe_every=4)
        # a fixed k: the adaptive policy reads measured costs, and on a loaded machine may choose
        # plain decoding (k = 0) for most steps, which says nothing about the suffix tree
        engine = make_engine(proposer, k=KPolicyConfig(k_max=6, fixed_k=6))
        for p in prompts[:3]:
            first = engine.generate(list(p), SamplingParams(max_tokens=24, ignore_eos=True), scope="s")
            assert first.token_ids == greedy_reference(p, 24, ignore_eos=True), name
        steps = []
        for p in prompts[:3]:
            again = engine.generate(list(p), SamplingParams(max_tokens=24, ignore_eos=True), scope="s", on_step=steps.append)
            assert again.token_ids == greedy_reference(p, 24, ignore_eos=True), name
        by_suffix = [s for s in steps if s.source == "suffix"]
        acc, prop = sum(s.accepted for s in by_suffix), sum(s.proposed for s in by_suffix)
        assert acc >= 0.6 * prop > 0, name
        assert acc >= 0.5 * 3 * 24, name  # most of the repeat was drafted from the first run


@pytest.fixture(scope="module")
def trunc_draft(target):
    from drafts.build import truncated_draft

    return truncated_draft(target, 1)


def policy_with(acceptance: dict[str, float], c: dict[str, float] | None = None) -> KPolicy:
    """A k policy whose estimates hold ``acceptance`` per source (as after 100 proposed tokens),
    on a GPU-like cost model (v(j) = 1 + 0.02 (j - 1)) with draft costs ``c`` per token."""
    costs = CostModel()
    costs.verify_s.update({j: 1.0 + 0.02 * (j - 1) for j in range(1, 8)})
    costs.draft_s.update(c or {})
    pol = KPolicy(KPolicyConfig(k_max=6), costs)
    for source, a in acceptance.items():
        est = pol.estimate(source)
        est.accepted, est.trials = 100 * a, 100.0
    return pol


def test_the_controller_ranks_proposers_by_expected_speedup(trunc_draft, draft_proposer):
    suffix, ngram, draft = SuffixProposer(), NgramProposer(), draft_proposer(trunc_draft)
    ctl = ControllerProposer(suffix, ngram, draft, probe_every=100)
    good_suffix = StepChoice(policy_with({"suffix": 0.9, "ngram": 0.3, "draft": 0.5}, {"draft": 0.05}), 8)
    assert ctl.ordered("a", good_suffix) == [suffix, draft, ngram]
    good_draft = StepChoice(policy_with({"suffix": 0.2, "ngram": 0.3, "draft": 0.8}, {"draft": 0.05}), 8)
    assert ctl.ordered("b", good_draft) == [draft, ngram, suffix]
    # cost counts, not just acceptance: the same acceptance with a draft 2x a target step loses
    costly = StepChoice(policy_with({"suffix": 0.5, "ngram": 0.5, "draft": 0.6}, {"draft": 2.0}), 8)
    assert ctl.ordered("c", costly)[-1] is draft


def test_the_controller_drafts_with_the_best_and_still_probes_the_others(trunc_draft, draft_proposer):
    """Prompt lookup always has a match here but the draft's expected speedup is higher: the draft
    drafts every step except one in every ``probe_every``, when lookup is probed."""
    ngram, draft = NgramProposer(NgramConfig(max_n=2)), draft_proposer(trunc_draft)
    ctl = ControllerProposer(ngram, draft, probe_every=4)
    choice = StepChoice(policy_with({"ngram": 0.2, "draft": 0.8}, {"draft": 0.05}), 8)
    tokens = [3, 4, 5, 3, 4, 5, 3, 4]
    sources = []
    for i in range(16):
        prop = ctl.propose("s", tokens + [3, 4, 5][: i % 3], choice, GREEDY, None)
        sources.append(prop.source)
    assert sources.count("ngram") == 3 and sources.count("draft") == 13
    assert [i for i, s in enumerate(sources) if s == "ngram"] == [4, 9, 14]  # after 4 steps without it
    assert ctl.picks == {"draft": 13, "ngram": 3}


def test_a_controller_falls_through_a_proposer_with_nothing_to_propose(trunc_draft, draft_proposer):
    suffix, draft = SuffixProposer(), draft_proposer(trunc_draft)
    ctl = ControllerProposer(suffix, draft, probe_every=100)
    choice = StepChoice(policy_with({"suffix": 0.95, "draft": 0.3}, {"draft": 0.05}), 8)
    suffix.begin("s", [1, 2, 3])
    prop = ctl.propose("s", [1, 2, 3], choice, GREEDY, None)  # the tree has no match: the draft drafts
    assert prop.source == "draft" and prop.k > 0


def test_a_new_request_starts_from_its_domains_acceptance(make_engine, trunc_draft, draft_proposer, prompts):
    engine = make_engine(draft_proposer(trunc_draft), k=KPolicyConfig(k_max=4))
    engine.scope_policy.clear()
    engine._scope_policy("code").estimate("draft")
    for _ in range(30):
        engine._scope_policy("code").observe("draft", 4, 0)
    rid = engine.add_request(list(prompts[0]), SamplingParams(max_tokens=4), scope="code")
    other = engine.add_request(list(prompts[0]), SamplingParams(max_tokens=4), scope="math")
    assert engine.requests[rid].policy.estimate("draft").prior < 0.1
    assert engine.requests[other].policy.estimate("draft").prior == engine.cfg.k.prior_alpha


def test_build_proposer_composes_suffix_lookup_and_draft(target, tok):
    from drafts.build import build_proposer
    from speculative.proposers import ChainedProposer, DraftModelProposer

    chain = build_proposer(DraftConfig(proposers=["suffix", "ngram", "draft"], num_layers=1), target, tok)
    assert isinstance(chain, ChainedProposer) and chain.sources == ("suffix", "ngram", "draft")
    ctl = build_proposer(DraftConfig(proposers=["suffix", "draft"], select="controller", num_layers=1,
                                     controller=ControllerConfig(probe_every=5)), target, tok)
    assert isinstance(ctl, ControllerProposer) and ctl.sources == ("suffix", "draft") and ctl.probe_every == 5
    assert isinstance(ctl.draft, DraftModelProposer)
    assert isinstance(build_proposer(DraftConfig(proposers=["suffix"]), target, tok), SuffixProposer)


def test_bounds_are_inclusive_exactly_max_tokens_and_max_scopes_are_kept():
    """The bounds are maxima: outputs adding up to exactly max_tokens all stay, and exactly
    max_scopes scopes all stay (one more is what evicts)."""
    p = SuffixProposer(SuffixConfig(spec_factor=2.0, max_tokens=16))
    for i in range(4):
        serve(p, f"r{i}", [0], [100 + 10 * i + j for j in range(4)], scope="s")  # 4 tokens each: 16 in all
    assert p.stats()["s"] == {"requests": 4, "tokens": 16, "active": 0}
    assert proposal(p, "q", [100, 101], scope="s") == [102, 103]  # the oldest is still there
    s = SuffixProposer(SuffixConfig(spec_factor=2.0, max_scopes=2))
    serve(s, "a1", [0], [5, 6, 7, 8], scope="a")
    serve(s, "b1", [0], [5, 6, 7, 8], scope="b")
    assert set(s.stats()) == {"a", "b"}


def test_a_request_nobody_announced_is_begun_from_its_tokens():
    """propose() for an id without begin() (a resumed request): its tokens so far are its prompt,
    matched like any request's own context."""
    p = SuffixProposer(SuffixConfig(spec_factor=2.0))
    assert p.propose("x", [7, 8, 9, 1, 7, 8], k_of(4), GREEDY, None).tokens == [9, 1, 7, 8]
    assert "x" in p.active


def test_an_id_begun_again_ends_its_earlier_request_first():
    """A request id reused while still active (a client retrying with the same id): the earlier
    request is ended and, the trees keeping outputs by id, its output gives way to the new one's."""
    p = SuffixProposer(SuffixConfig(spec_factor=2.0))
    p.begin("a", [1, 2], "s")
    p.propose("a", [1, 2, 30, 31, 32, 33], k_of(4), GREEDY, None)
    p.begin("a", [5, 6], "s")
    assert p.stats()["s"] == {"requests": 1, "tokens": 0, "active": 1}
    assert p.propose("a", [5, 6], k_of(4), GREEDY, None).tokens == []
    p.release("a", [5, 6, 40, 41, 42])
    assert p.stats()["s"] == {"requests": 1, "tokens": 3, "active": 0}
    assert proposal(p, "q", [40, 41], scope="s") == [42] and proposal(p, "q2", [30, 31], scope="s") == []


def test_a_one_token_output_served_elsewhere_is_kept():
    p = SuffixProposer(SuffixConfig(spec_factor=2.0))
    p.add_served("one", [42], scope="s")
    p.add_served("none", [], scope="s")
    assert p.cached_ids() == {"one"} and p.stats()["s"]["tokens"] == 1


def test_a_chain_answers_for_the_proposers_it_holds():
    """Capabilities are declared, not probed: a chain learns from traffic when a member does, and
    what is handed to it (served outputs, forgetting) reaches that member, through any nesting;
    a chain of model-free proposers declares nothing and takes nothing."""
    from speculative.proposers import ChainedProposer

    tree = SuffixProposer(SuffixConfig(spec_factor=1.0))
    chain = ControllerProposer(NgramProposer(NgramConfig(max_n=3, min_n=2)), ChainedProposer(tree))
    assert chain.learns_from_traffic and not chain.wants_features and chain.draft is None
    assert tree in chain.parts and chain.sources == ("ngram", "suffix")
    chain.add_served("a", [10, 11, 12, 13, 14, 15], scope="sql")
    assert chain.cached_ids() == {"a"} == tree.cached_ids()
    assert proposal(tree, "b", [7, 10, 11, 12], scope="sql")[:3] == [13, 14, 15]
    assert chain.forget({"a"}) == 1 and "a" not in chain.cached_ids()
    plain = ChainedProposer(NgramProposer())
    plain.add_served("a", [10, 11, 12], scope="sql")
    assert not plain.learns_from_traffic and plain.cached_ids() == set() and plain.forget({"a"}) == 0
