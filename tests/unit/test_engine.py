"""The speculative engine on a tiny random Llama: greedy equality with target-only decoding for every
proposer, EOS / max_tokens / stop handling, sampling, cache cropping, StepResult, swap_draft, ids."""

from __future__ import annotations

import math

import time

import pytest
import torch

from config import KPolicyConfig, NgramConfig, SamplingParams
from drafts.build import fresh_draft, frequent_token_ids, restrict_head, truncated_draft
from speculative import ChainedProposer, ModelRunner, NgramProposer, RequestError, StepResult

GREEDY = SamplingParams(max_tokens=24)


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding: probabilities within 1e-5; logits (|logit| up to ~20 with this
    model's large init) within 1e-4. A wrong cache (missing or stale positions) is off by O(1)."""
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def trunc1(target):
    return truncated_draft(target, 1)


@pytest.fixture(scope="module")
def trunc2(target):
    return truncated_draft(target, 2)


@pytest.fixture(scope="module")
def restricted(target, tok, prompt_texts):
    keep = frequent_token_ids(tok, 48, prompt_texts)
    return restrict_head(truncated_draft(target, 2), keep), keep


def frozen_costs(engine, c: float = 0.25, v_step: float = 0.1):
    """``engine`` with its k policy's costs set, not measured: a draft token costs ``c`` target
    steps and verifying j tokens 1 + ``v_step`` (j - 1). Measured times move with the machine's
    load, and with them the adaptive k and so which tokens get drafted at all."""
    costs = engine.costs
    costs.verify_s.update({j: 1.0 + v_step * (j - 1) for j in range(1, engine.cfg.k.k_max + 2)})
    costs.draft_s.update({"draft": c})
    costs.observe_verify = lambda n_tokens, seconds: None
    costs.observe_draft = lambda source, k, seconds: None
    return engine


@pytest.fixture
def build(target, trunc1, trunc2, restricted, draft_proposer, make_engine):
    """name -> a fresh engine (fresh proposer state) for that proposer configuration."""

    def make(name: str, **cfg):
        if name == "none":
            return make_engine(None, **cfg)
        if name.startswith("trunc1-k"):
            return make_engine(draft_proposer(trunc1), k=int(name.removeprefix("trunc1-k")), **cfg)
        if name.startswith("trunc2-k"):
            return make_engine(draft_proposer(trunc2), k=int(name.removeprefix("trunc2-k")), **cfg)
        if name == "fresh":
            return make_engine(draft_proposer(fresh_draft(target, 1, seed=3)), k=3, **cfg)
        if name == "restricted":
            model, keep = restricted
            return make_engine(draft_proposer(model, keep), k=3, **cfg)
        if name == "ngram":
            return make_engine(NgramProposer(NgramConfig(max_n=3, min_n=1)), k=3, **cfg)
        if name == "chained":
            return make_engine(ChainedProposer(NgramProposer(NgramConfig(max_n=3, min_n=2)), draft_proposer(trunc2)), k=3, **cfg)
        if name == "adaptive":  # k from the acceptance estimate, against costs fixed so that every machine takes the same steps
            return frozen_costs(make_engine(draft_proposer(trunc2), k=KPolicyConfig(), **cfg))
        if name.startswith("perfect-k"):  # the draft is the target itself
            return make_engine(draft_proposer(target), k=int(name.removeprefix("perfect-k")), **cfg)
        raise KeyError(name)

    return make


# -- greedy equality ---------------------------------------------------------------------------
def test_target_only_engine_matches_hf_generate(prompts, greedy_reference, hf_greedy):
    for p in prompts:
        ref = greedy_reference(p, 24)
        assert len(ref) >= 8  # the comparison is not vacuous
        assert ref == hf_greedy(p, 24)


CONFIGS = ["trunc1-k1", "trunc1-k3", "trunc1-k5", "trunc2-k3", "fresh", "restricted", "ngram", "chained", "adaptive", "perfect-k4"]
WITH_REJECTIONS = {"trunc1-k1", "trunc1-k3", "trunc1-k5", "trunc2-k3", "fresh", "restricted", "adaptive"}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_speculative_equals_target_only(name, build, prompts, greedy_reference, hf_greedy):
    engine = build(name)
    proposed = accepted = 0
    sources = set()
    for p in prompts:
        steps: list[StepResult] = []
        gen = engine.generate(p, GREEDY, on_step=steps.append)
        assert gen.token_ids == greedy_reference(p, 24), f"{name}: prompt {p}"
        assert gen.token_ids == hf_greedy(p, 24)
        assert [t for s in steps for t in s.emitted] == gen.token_ids
        proposed += gen.stats.proposed
        accepted += gen.stats.accepted
        sources |= {s.source for s in steps}
    assert proposed > 0, f"{name}: the proposer never proposed, so equality proves nothing"
    if name in WITH_REJECTIONS:
        assert 0 < accepted < proposed, f"{name}: want both accepted and rejected draft tokens, got {accepted}/{proposed}"
    if name == "chained":
        assert {"ngram", "draft"} <= sources
    if name.startswith("perfect"):
        assert accepted == proposed  # alpha == 1


@pytest.mark.parametrize("k", [1, 3, 6])
def test_perfect_draft_accepts_everything(k, build, prompts):
    engine = build(f"perfect-k{k}")
    for p in prompts:
        gen = engine.generate(p, SamplingParams(max_tokens=20, ignore_eos=True))
        assert gen.stats.alpha == 1.0
        # every step emits k + 1 tokens (the last step is clipped by the budget)
        assert gen.stats.steps == math.ceil(20 / (k + 1))


def test_a_steps_cost_is_the_k_policys_denominator_at_the_costs_known_before_it(build, prompts):
    """StepResult.cost = v(k + 1) + k c(source), in target-only steps, from the cost model as it
    stood before the step (hand-set here: verifying 4 tokens costs 1.5 steps, a draft token 0.1),
    and exactly 1 for a step with nothing drafted."""
    engine = build("perfect-k3")
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))
    costs = []
    while not engine.requests[rid].finished:
        engine.costs.verify_s, engine.costs.draft_s = {1: 0.010, 4: 0.015}, {"draft": 0.001}
        res = engine.step(rid)
        costs.append((res.proposed, res.cost))
    engine.release(rid)
    assert {k for k, _ in costs} == {3}  # the target as its own draft: k = 3 every step
    assert all(c == pytest.approx(1.5 + 3 * 0.1) for _, c in costs)
    plain = build("none")
    gen = plain.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True), on_step=lambda r: costs.append((0, r.cost)))
    assert gen.stats.steps == 4 and costs[-4:] == [(0, 1.0)] * 4


# -- ending a request --------------------------------------------------------------------------
def _eos_case(prompts, greedy_reference):
    """A prompt and greedy output whose token at index 3 does not occur before it."""
    for p in prompts:
        g = greedy_reference(p, 12, ignore_eos=True)
        if g[3] not in g[:3] and 0 not in g[:4]:
            return p, g
    pytest.fail("no prompt has a fresh token at step 3")


def test_eos_inside_proposal_ends_request(make_tokenizer, tok, target, make_engine, draft_proposer, prompts, greedy_reference):
    p, g = _eos_case(prompts, greedy_reference)
    eos_tok = make_tokenizer(eos=tok.convert_ids_to_tokens(g[3]))
    assert eos_tok.eos_token_id == g[3]
    engine = make_engine(draft_proposer(target), tokenizer=eos_tok, k=5)
    steps: list[StepResult] = []
    gen = engine.generate(p, SamplingParams(max_tokens=12), on_step=steps.append)
    assert gen.token_ids == g[:3]
    assert gen.finish_reason == "stop"
    assert len(steps) == 1
    assert steps[0].draft_tokens[:5] == g[:5]  # the draft proposed past the EOS ...
    assert steps[0].emitted == g[:3] and steps[0].finished  # ... and the output stops before it


def test_ignore_eos(make_tokenizer, tok, target, make_engine, draft_proposer, prompts, greedy_reference):
    p, g = _eos_case(prompts, greedy_reference)
    engine = make_engine(draft_proposer(target), tokenizer=make_tokenizer(eos=tok.convert_ids_to_tokens(g[3])), k=5)
    gen = engine.generate(p, SamplingParams(max_tokens=12, ignore_eos=True))
    assert gen.token_ids == g
    assert gen.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [1, 2, 4, 7, 13])
def test_max_tokens_exact(max_tokens, build, prompts, greedy_reference):
    engine = build("perfect-k5")  # every proposal is accepted: the bonus token would overshoot
    p = prompts[1]
    steps: list[StepResult] = []
    gen = engine.generate(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), on_step=steps.append)
    assert len(gen.token_ids) == max_tokens
    assert gen.token_ids == greedy_reference(p, max_tokens, ignore_eos=True)
    assert gen.finish_reason == "length"
    done = 0
    for s in steps:
        assert s.proposed <= max(0, max_tokens - done - 1)  # never drafts past the budget
        done += len(s.emitted)


def test_stop_string_truncates_text(build, prompts, tok, greedy_reference):
    p = prompts[3]
    g = greedy_reference(p, 24, ignore_eos=True)
    assert min(g) >= 2  # no special tokens: one token per character
    text = tok.decode(g)
    stop = text[6:8]
    cut = text.find(stop)
    engine = build("trunc1-k3")
    gen = engine.generate(p, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
    assert gen.finish_reason == "stop"
    assert gen.text == text[:cut]
    assert gen.token_ids == g[: cut + len(stop)]  # generation ended at the token completing the stop
    # a stop string that never occurs changes nothing
    gen = engine.generate(p, SamplingParams(max_tokens=24, ignore_eos=True, stop=["~~~~"]))
    assert "~~~~" not in text
    assert (gen.text, gen.finish_reason) == (text, "length")


def _state_with_output(engine, tokenizer, text: str, stop: list[str], extra: list[int] = ()):
    from speculative.engine import RequestState

    out = tokenizer(text, add_special_tokens=False)["input_ids"] + list(extra)
    return RequestState("r", SamplingParams(stop=stop), [5] + out, 1, None, None)


def test_stop_detection_window_covers_multibyte_stops(make_engine):
    """A stop string of 4 emoji is 16 single-byte tokens of a byte-level tokenizer: more tokens than
    characters + 8, so a window counted in characters would miss its start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    bytes_tok = PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False)
    engine = make_engine(None, tokenizer=bytes_tok)
    stop = "🧱🏯🗼🚀"
    st = _state_with_output(engine, bytes_tok, "so: " + stop, [stop])
    assert len(st.output) == 4 + 16
    assert engine._hit_stop(st)
    assert not engine._hit_stop(_state_with_output(engine, bytes_tok, "so: " + stop[:-1], [stop]))


def test_stop_detection_at_the_start_and_across_special_tokens(make_engine, tok):
    engine = make_engine(None)
    assert engine._hit_stop(_state_with_output(engine, tok, "###", ["###"]))  # the whole output is the stop
    eos = tok.eos_token_id  # decodes to nothing, as in the final text
    st = _state_with_output(engine, tok, "ab", ["bc"], extra=[eos] + tok("c")["input_ids"])
    assert engine._hit_stop(st) and engine.text_of(st) == "a"


def test_the_stop_check_decodes_only_the_new_tokens_however_long_the_output(make_engine, make_tokenizer):
    """Four stop strings of 256 characters that never occur (a character outside the vocabulary),
    240 tokens: the stop check after each token decodes a few tokens, not the longest stop's worth
    nor the whole output, so the whole generation decodes a small multiple of its length (the
    final text once included); a stop is still found where it completes."""
    tok = make_tokenizer()
    calls: list[int] = []
    real = tok.decode
    tok.decode = lambda ids, *a, **kw: calls.append(len(ids)) or real(ids, *a, **kw)
    engine = make_engine(None, tokenizer=tok)
    stops = ["\u03a9" * 256, "\u03a9a" * 128, "b\u03a9" * 128, "\u03a9" * 200]
    gen = engine.generate(tok("Hello")["input_ids"], SamplingParams(max_tokens=240, ignore_eos=True, stop=stops))
    assert len(gen.token_ids) == 240 and gen.finish_reason == "length"
    assert sum(calls) <= 20 * 240, sum(calls)
    text = gen.text
    stop = text[200:203]
    calls.clear()
    gen2 = engine.generate(tok("Hello")["input_ids"], SamplingParams(max_tokens=240, ignore_eos=True, stop=[stop, *stops[:3]]))
    assert gen2.finish_reason == "stop" and gen2.text == text[: text.find(stop)]


# -- sampling ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["trunc1-k3", "restricted", "ngram", "chained"])
def test_seeded_sampling_determinism(name, build, prompts):
    engine = build(name)

    def run(seed):
        return engine.generate(prompts[2], SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)).token_ids

    first = run(7)
    assert len(first) == 16 and all(0 <= t < 128 for t in first)
    assert run(7) == first
    assert len({tuple(run(s)) for s in (1, 2, 3, 4)}) > 1


def test_top_k_sampling_emits_only_target_top_k(build, prompts, target):
    """Draft tokens outside the target's top-k must be rejected, recovered tokens come from warped p."""
    engine = build("trunc1-k3")
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=3, seed=0, ignore_eos=True)
    for p in prompts[:2]:
        gen = engine.generate(p, params)
        seq = torch.tensor([p + gen.token_ids])
        with torch.inference_mode():
            logits = target(seq).logits[0, len(p) - 1 : -1]  # [24, V] rows predicting each output token
        top3 = logits.topk(3, -1).indices
        assert all(t in top3[i].tolist() for i, t in enumerate(gen.token_ids))
        assert gen.stats.proposed > gen.stats.accepted  # rejections happened


def test_first_token_distribution_through_engine(target, trunc2, tok, make_engine, draft_proposer):
    """Temperature 1: the first generated token of speculative decoding is distributed as the target's
    softmax at the prompt's last position, although the draft's distribution is far from it."""
    prompt = tok("x =")["input_ids"]
    x = torch.tensor([prompt])
    with torch.inference_mode():
        p = target(x).logits[0, -1].softmax(-1)
        q = trunc2(x).logits[0, -1].softmax(-1)
    n_draws = 1000
    # E[TV] <= 0.5 * sum sqrt(p (1 - p) / N); TV moves by <= 1/N per draw (McDiarmid: +0.05 at p ~ 0.7%)
    threshold = 0.5 * float((p * (1 - p) / n_draws).sqrt().sum()) + 0.05
    tv_q = 0.5 * float((p - q).abs().sum())
    assert tv_q > threshold + 0.1, "the draft must differ from the target for this test to have power"

    engine = make_engine(draft_proposer(trunc2), k=1)
    counts = torch.zeros(p.shape[0])
    accepted = 0
    for seed in range(n_draws):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=seed, ignore_eos=True))
        res = engine.step(rid)
        engine.release(rid)
        assert res.proposed == 1
        counts[res.emitted[0]] += 1
        accepted += res.accepted
    assert 0.2 * n_draws < accepted < 0.95 * n_draws  # both acceptance and recovery were exercised
    tv = 0.5 * float((counts / n_draws - p).abs().sum())
    assert tv < threshold, f"TV(empirical, p) = {tv:.3f} >= {threshold:.3f} (TV(q, p) = {tv_q:.3f})"


# -- caches ------------------------------------------------------------------------------------------
def test_cache_cropping_after_rejections(build, prompts, target, greedy_reference):
    engine = build("trunc1-k3")
    p = prompts[0]
    rid = engine.add_request(p, SamplingParams(max_tokens=24))
    st = engine.requests[rid]
    rejected_steps = 0
    checked_recompute = False
    while not st.finished:
        res = engine.step(rid)
        if st.finished:
            break
        # the pending token is not cached; rejected draft positions are dropped lazily, on the next call
        assert st.target_len == len(st.tokens) - 1
        assert engine.target.cached_length(rid) == st.target_len + (res.proposed - res.accepted)
        if res.accepted < res.proposed:
            rejected_steps += 1
            if not checked_recompute:
                # the trusted prefix in the cache is right: extend it and compare with a full recompute
                got = engine.target.forward(rid, st.target_len, st.tokens[st.target_len :])[-1]
                assert engine.target.cached_length(rid) == len(st.tokens)
                with torch.inference_mode():
                    want = target(torch.tensor([st.tokens])).logits[0, -1]
                assert_same_logits(got, want)
                checked_recompute = True
    assert rejected_steps >= 2
    assert st.output == greedy_reference(p, 24)  # continuing after crops == a fresh run
    engine.release(rid)


def test_runner_forward_crops_and_refuses_gaps(target, prompts):
    runner = ModelRunner(target, name="t")
    ids = prompts[3]
    runner.forward("s", 0, ids[:10])
    runner.forward("s", 10, ids[10:14], keep_last=4)
    assert runner.cached_length("s") == 14
    new = [40, 41, 42]
    got = runner.forward("s", 11, new, keep_last=3)  # drop positions 11..13, extend with `new`
    assert runner.cached_length("s") == 14
    with torch.inference_mode():
        want = target(torch.tensor([ids[:11] + new])).logits[0, -3:]
    assert got.shape == (3, 128)
    assert_same_logits(got, want)
    # start == 0 restarts the sequence
    got0 = runner.forward("s", 0, ids[:5])
    assert runner.cached_length("s") == 5
    with torch.inference_mode():
        assert_same_logits(got0[-1], target(torch.tensor([ids[:5]])).logits[0, -1])
    with pytest.raises(ValueError, match="cannot start at 9"):
        runner.forward("s", 9, [1, 2])
    with pytest.raises(ValueError):
        runner.forward("other", 3, [1])
    with pytest.raises(ValueError):
        runner.forward("s", 5, [])
    assert len(runner) == 1  # the failed calls created no cache
    runner.release("s")
    assert len(runner) == 0 and runner.cached_length("s") == 0


# -- StepResult ----------------------------------------------------------------------------------
def test_step_result_fields(build, prompts, target):
    engine = build("trunc1-k3", record_top_k=5)
    p = prompts[0]
    rid = engine.add_request(p, SamplingParams(max_tokens=20))
    res = engine.step(rid)
    k, n = res.proposed, res.accepted
    assert k == 3 and res.source == "draft" and res.draft_version == 0 and res.start == len(p)
    assert res.target_top_ids.shape == (k + 1, 5) and res.target_top_ids.dtype == torch.long
    assert res.target_top_probs.shape == (k + 1, 5)
    assert res.target_tail.shape == (k + 1,)
    assert ((res.target_tail >= 0) & (res.target_tail <= 1)).all()
    torch.testing.assert_close(res.target_top_probs.sum(-1) + res.target_tail, torch.ones(k + 1))
    # row i = the target's distribution after prompt + d_1..d_i
    with torch.inference_mode():
        full = target(torch.tensor([p + res.draft_tokens])).logits[0, len(p) - 1 :].softmax(-1)  # [k+1, V]
    top = full.topk(5, -1)
    assert torch.equal(res.target_top_ids, top.indices)
    torch.testing.assert_close(res.target_top_probs, top.values, atol=1e-5, rtol=1e-4)
    argmax = full.argmax(-1)
    assert res.draft_matches_target == [res.draft_tokens[i] == int(argmax[i]) for i in range(k)]
    assert len(res.draft_matches_target) == k
    assert res.accepted_mask == [True] * n + [False] * (k - n)
    assert res.emitted == res.draft_tokens[:n] + [int(argmax[n])]
    engine.release(rid)


def test_step_result_without_proposal(build, prompts):
    engine = build("trunc1-k3", record_top_k=4)
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=1))  # no budget to draft
    res = engine.step(rid)
    assert res.proposed == 0 and res.source == "none" and res.accepted_mask == [] and res.draft_matches_target == []
    assert res.target_top_ids.shape == (1, 4)
    assert res.finished and res.finish_reason == "length" and len(res.emitted) == 1


def test_ngram_step_source(build, tok):
    engine = build("ngram")
    rid = engine.add_request(tok("abcabcab")["input_ids"], SamplingParams(max_tokens=8))
    res = engine.step(rid)
    assert res.source == "ngram" and res.draft_tokens == tok("cab")["input_ids"]


@pytest.mark.parametrize("name", ["trunc1-k3", "ngram"])
def test_k_zero_is_no_proposal(name, build, tok, make_engine, trunc1, draft_proposer):
    proposer = NgramProposer(NgramConfig(max_n=3, min_n=1)) if name == "ngram" else draft_proposer(trunc1)
    engine = make_engine(proposer, k=0)
    rid = engine.add_request(tok("abcabcab")["input_ids"], SamplingParams(max_tokens=4))
    res = engine.step(rid)
    assert (res.proposed, res.source) == (0, "none")


@pytest.mark.parametrize("name", ["trunc1-k3", "ngram"])
def test_proposal_seconds_are_within_the_step(name, build, tok):
    engine = build(name)
    rid = engine.add_request(tok("abcabcab")["input_ids"], SamplingParams(max_tokens=8))
    proposed = 0
    for _ in range(3):
        t0 = time.perf_counter()
        res = engine.step(rid)
        assert 0 <= res.draft_s <= time.perf_counter() - t0
        proposed += res.proposed
    assert proposed > 0


def test_a_repeated_proposal_without_feedback_feeds_one_token(trunc1, draft_proposer, prompts):
    """Proposing again for the same tokens (no feedback in between) reuses the cache up to the
    pending token and proposes the same greedy tokens."""
    prop = draft_proposer(trunc1)
    params = SamplingParams()
    first = prop.propose("s", list(prompts[0]), lambda s: 3, params, None)
    again = prop.propose("s", list(prompts[0]), lambda s: 3, params, None)
    assert again.tokens == first.tokens and first.input_tokens == len(prompts[0]) + 2
    assert again.input_tokens == 1 + 2  # the pending token, then k - 1 draft tokens


def test_prompt_lookup_takes_the_most_recent_match():
    look = NgramProposer(NgramConfig(max_n=1, min_n=1)).lookup
    assert look([7, 4, 5, 7, 7], 3) == [7]  # the match right before the tail
    assert look([7, 4, 5, 7, 9, 7], 3) == [9, 7]
    assert look([7, 4, 5, 7], 1) == [4]


def test_draft_version_without_a_learned_draft_is_zero(build, tok):
    for name in ("ngram", "none"):
        engine = build(name)
        rid = engine.add_request(tok("abcabcab")["input_ids"], SamplingParams(max_tokens=4))
        assert engine.step(rid).draft_version == 0
        engine.release(rid)


def test_draft_catches_up_at_most_two_tokens_per_step(build, prompts):
    """feedback() keeps the draft's cache of accepted tokens: in steady state a proposal feeds the
    draft the pending token (plus the last draft token after a fully accepted step), never the
    accepted tokens again."""
    for name in ("perfect-k3", "trunc1-k3"):
        engine = build(name)
        fed = []
        real = engine.proposer.propose_steps  # what the engine drives

        def spy(*a, **kw):
            prop = yield from real(*a, **kw)
            fed.append(prop.input_tokens - max(prop.k - 1, 0))  # tokens fed before the k - 1 draft tokens
            return prop

        engine.proposer.propose_steps = spy
        gen = engine.generate(prompts[1], SamplingParams(max_tokens=24, ignore_eos=True))
        assert gen.stats.accepted > 0
        assert max(fed[1:]) <= 2, (name, fed)


def test_first_token_time_is_set_once_at_the_first_token(build, prompts):
    engine = build("trunc1-k3")
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))
    st = engine.requests[rid]
    engine.step(rid)
    first = st.first_token_s
    assert first is not None and 0 < first < time.perf_counter() - st.started
    while not st.finished:
        engine.step(rid)
    assert st.first_token_s == first
    engine.release(rid)


def test_generation_seconds_is_the_wall_time_of_the_request(build, prompts):
    engine = build("trunc1-k3")
    t0 = time.perf_counter()
    gen = engine.generate(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))
    assert 0 < gen.first_token_s <= gen.seconds <= time.perf_counter() - t0


def test_calibrate_times_exactly_j_tokens_for_each_j(make_engine, draft_proposer, trunc1):
    engine = make_engine(draft_proposer(trunc1), k=KPolicyConfig(k_max=4))
    fed = []
    real = engine.target.forward

    def spy(seq_id, start, tokens, keep_last=1):
        fed.append((start, len(tokens)))
        return real(seq_id, start, tokens, keep_last)

    engine.target.forward = spy
    draft_fed = []
    real_draft = engine.learned_draft.runner.forward

    def draft_spy(seq_id, start, tokens, keep_last=1):
        draft_fed.append((start, len(tokens)))
        return real_draft(seq_id, start, tokens, keep_last)

    engine.learned_draft.runner.forward = draft_spy
    out = engine.calibrate(context=16, repeats=2)
    assert draft_fed == [(0, 16), (16, 1), (16, 1)]  # the context, then one token per repeat
    assert fed[0] == (0, 16)  # the context, once
    assert sorted(fed[1:]) == sorted((16, j) for j in range(1, 6) for _ in range(2))
    assert sorted(out["verify_s"]) == [1, 2, 3, 4, 5] and out["draft_s"]["draft"] > 0
    assert len(engine.target) == 0 and engine.cfg.k.k_max == 4  # the calibration sequence is released


def test_observe_counts_a_clean_draft_cost_only_without_catch_up(build):
    """A proposal that fed the draft at most k + 1 tokens measures its per-token cost; a longer
    catch-up (prompt prefill, lag after prompt lookup) does not."""
    from speculative.engine import RequestState
    from speculative.proposers import Proposal

    engine = build("trunc1-k3")
    st = RequestState("r", SamplingParams(), [1, 2, 3], 3, engine.global_policy, None)
    engine._observe(st, Proposal([5, 6, 7], None, "draft", seconds=0.3, input_tokens=4), 1, 2, 4, 0.1)
    assert engine.costs.draft_s["draft"] == pytest.approx(0.1)
    engine._observe(st, Proposal([5, 6, 7], None, "draft", seconds=3.0, input_tokens=5), 1, 2, 4, 0.1)
    assert engine.costs.draft_s["draft"] == pytest.approx(0.1)  # unchanged by the catch-up call
    assert engine.costs.verify_s[4] == pytest.approx(0.1)
    engine._observe(st, Proposal([5, 6, 7], None, "draft", seconds=0.3, input_tokens=3), 1, 2, 9, 5.0)
    assert engine.costs.verify_s[4] == pytest.approx(0.1) and 9 not in engine.costs.verify_s  # prefill inside


# -- swapping draft weights ----------------------------------------------------------------------------
def test_swap_draft(target, trunc1, draft_proposer, make_engine, prompts, greedy_reference):
    p = prompts[1]
    engine = make_engine(draft_proposer(fresh_draft(target, 1, seed=5)), k=3)
    rid = engine.add_request(p, GREEDY)
    st = engine.requests[rid]
    for _ in range(2):
        engine.step(rid)
    context = list(st.tokens)

    def first_proposal(model):
        other = make_engine(draft_proposer(model), k=3)
        r = other.add_request(context, GREEDY)
        tokens = other.step(r).draft_tokens
        other.release(r)
        return tokens

    before = first_proposal(fresh_draft(target, 1, seed=5))  # what the old weights would propose now
    after = first_proposal(trunc1)
    assert before != after
    engine.swap_draft(trunc1.state_dict(), version=7)
    res = engine.step(rid)
    assert res.draft_version == 7
    assert res.draft_tokens == after
    while not st.finished:
        engine.step(rid)
    assert st.output == greedy_reference(p, 24)
    engine.release(rid)


def test_swap_draft_without_learned_draft_refused(build):
    with pytest.raises(RuntimeError):
        build("ngram").swap_draft({}, 1)


def _shifted_state(model, delta: float) -> dict:
    return {k: (v + delta).numpy().copy() for k, v in model.state_dict().items()}


def _weights_equal(engine, state) -> bool:
    got = engine.learned_draft.runner.model.state_dict()
    return all(torch.equal(got[k], torch.as_tensor(state[k])) for k in state)


def test_staged_weights_install_only_when_newer(target, draft_proposer, make_engine, prompts):
    """Staging keeps the first of equal versions; the step installs a staged version only when it is
    newer than the one served (a stale or repeated version changes nothing)."""
    engine = make_engine(draft_proposer(truncated_draft(target, 1)), k=2)
    base = engine.learned_draft.runner.model
    v3, v3_again, v2 = _shifted_state(base, 0.01), _shifted_state(base, 0.02), _shifted_state(base, -0.01)

    def one_step():
        rid = engine.add_request(prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step(rid)
        engine.release(rid)

    engine.stage_draft(v3, 3)
    engine.stage_draft(v3_again, 3)  # the same version again: the first one stays staged
    one_step()
    assert engine.learned_draft.version == 3 and _weights_equal(engine, v3)
    for state, version in ((v2, 2), (v3_again, 3)):  # older, then equal to the served version
        engine.stage_draft(state, version)
        one_step()
        assert engine.learned_draft.version == 3 and _weights_equal(engine, v3), version


def test_calibrate_prices_prompt_lookup_at_zero(build):
    assert build("ngram").calibrate(context=8, repeats=1)["draft_s"] == {"ngram": 0.0}
    assert "ngram" not in build("trunc1-k3").calibrate(context=8, repeats=1)["draft_s"]


# -- request ids -----------------------------------------------------------------------------------------
def test_request_ids_and_release(build, prompts):
    engine = build("trunc1-k3")
    draft_runner = engine.proposer.runner
    with pytest.raises(RequestError, match="unknown"):
        engine.step("nope")
    a = engine.add_request(prompts[0], GREEDY, request_id="a")
    assert a == "a"
    with pytest.raises(RequestError, match="already active"):
        engine.add_request(prompts[1], GREEDY, request_id="a")
    b = engine.add_request(prompts[1], GREEDY)
    assert b != a
    engine.step(a)
    engine.step(b)
    assert len(engine.target) == 2 and len(draft_runner) == 2
    engine.release(a)
    assert len(engine.target) == 1 and len(draft_runner) == 1
    with pytest.raises(RequestError):
        engine.step(a)
    engine.release(b)
    engine.release("never-existed")  # idempotent
    assert len(engine.target) == 0 and len(draft_runner) == 0 and not engine.requests
    engine.generate(prompts[2], GREEDY)  # generate releases its request
    assert len(engine.target) == 0 and len(draft_runner) == 0


def test_step_after_finish_refused(build, prompts):
    engine = build("trunc1-k3")
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=1))
    assert engine.step(rid).finished
    with pytest.raises(RequestError, match="finished"):
        engine.step(rid)


def test_unseeded_request_leaves_global_rng_alone(build, prompts):
    engine = build("none")
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    rid = engine.add_request(prompts[0], SamplingParams(temperature=1.0, max_tokens=2))
    engine.release(rid)
    assert torch.equal(torch.rand(3), want)


def test_install_staged_now_returns_the_running_version(target, draft_proposer, make_engine):
    """Between steps (a replica asked for its version): staged weights go in at once."""
    engine = make_engine(draft_proposer(truncated_draft(target, 1)), k=2)
    v3 = _shifted_state(engine.learned_draft.runner.model, 0.01)
    assert engine.install_staged() == 0  # nothing staged
    engine.stage_draft(v3, 3)
    assert engine.draft_version == 0
    assert engine.install_staged() == 3 and engine.draft_version == 3 and _weights_equal(engine, v3)


@pytest.mark.parametrize("name", ["trunc2-k3", "adaptive"])
def test_a_resumed_request_continues_exactly_where_the_first_one_stopped(build, prompt_texts, name):
    """resume(): the output produced elsewhere becomes this request's output so far; greedy and
    seeded continuations equal the uninterrupted run, and max_tokens counts the resumed tokens."""
    engine = build(name)
    for params in (SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.9, seed=7)):
        whole = engine.generate(prompt_texts[0], params)
        assert len(whole.token_ids) == 12
        for cut in (1, 5, 11, 12):
            rid = engine.add_request(prompt_texts[0], params)
            engine.resume(rid, whole.token_ids[:cut])
            st = engine.requests[rid]
            while not st.finished:
                engine.step(rid)
            assert st.output == whole.token_ids, (params, cut)
            engine.release(rid)


def test_a_draft_context_window_reads_the_last_tokens_as_a_sequence_of_its_own(trunc1, draft_proposer, prompts):
    """DraftModelProposer(context_tokens=N): the first proposal feeds the draft the last N tokens at
    its position 0, so it proposes what the draft proposes for those N tokens alone (RoPE scores
    depend on distances only); later proposals feed the lag as before, at shifted positions. A
    window as long as the prompt proposes exactly as no window."""
    from speculative import DraftModelProposer

    long = list(prompts[3]) * 3  # [66] tokens
    n, params = 16, SamplingParams()

    def make(window=None):
        return DraftModelProposer(draft_proposer(trunc1).runner, trunc1.config.vocab_size, window)

    whole, same = make(), make(len(long))
    a, b = same.propose("s", long, lambda s: 3, params, None), whole.propose("s", long, lambda s: 3, params, None)
    assert a.tokens == b.tokens and a.input_tokens == b.input_tokens == len(long) + 2  # every token, from the first
    windowed, alone = make(n), make()
    first = windowed.propose("s", long, lambda s: 3, params, None)
    assert first.input_tokens == n + 2  # the window, then k - 1 draft tokens
    assert first.tokens == alone.propose("t", long[-n:], lambda s: 3, params, None).tokens
    # the target kept the first draft token and chose 5: the next proposal feeds the pending token alone
    windowed.feedback("s", len(long) + 1)
    alone.feedback("t", n + 1)
    nxt = windowed.propose("s", long + first.tokens[:1] + [5], lambda s: 3, params, None)
    assert nxt.input_tokens == 1 + 2
    assert nxt.tokens == alone.propose("t", long[-n:] + first.tokens[:1] + [5], lambda s: 3, params, None).tokens
    windowed.release("s")
    assert "s" not in windowed._offset


@pytest.mark.parametrize("window", [16, 24])
def test_a_windowed_draft_stays_lossless(window, trunc2, make_engine, draft_proposer, prompts, greedy_reference):
    """Greedy output equals target-only, and a seeded sample equals the seed's target-only sample,
    with the draft reading only the last tokens of each (long) prompt."""
    from speculative import DraftModelProposer

    plain = make_engine(None)
    for p in prompts:
        long = list(p) * 3
        engine = make_engine(DraftModelProposer(draft_proposer(trunc2).runner, trunc2.config.vocab_size, window), k=3)
        gen = engine.generate(long, SamplingParams(max_tokens=24, ignore_eos=True))
        assert gen.token_ids == greedy_reference(long, 24, ignore_eos=True) and gen.stats.proposed > 0
        seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
        assert engine.generate(long, seeded).token_ids == plain.generate(long, seeded).token_ids


def test_the_draft_config_sets_the_window(target, tok):
    from config import DraftConfig
    from drafts.build import build_proposer

    assert build_proposer(DraftConfig(context_tokens=32), target, tok).context_tokens == 32
    assert build_proposer(DraftConfig(), target, tok).context_tokens is None


def test_a_draft_equal_to_the_target_samples_what_the_target_samples(target, make_engine, draft_proposer, prompts):
    """Seeded sampling draws the draft's i-th token with the noise of the position it stands at
    (len(tokens) + i): a draft that is the target then proposes the target's own sample at every
    position, and (up to float rounding between one-token and k-token forwards) all are accepted."""
    engine = make_engine(draft_proposer(target), k=4)
    accepted = proposed = 0
    for p in prompts:
        g = engine.generate(p, SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True))
        accepted, proposed = accepted + g.stats.accepted, proposed + g.stats.proposed
    assert proposed > 40 and accepted / proposed > 0.95, (accepted, proposed)
