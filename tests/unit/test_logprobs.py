"""Log-probabilities of the output (``SamplingParams.logprobs``): each token's under the target, at
temperature 1, and the most likely tokens' at its position. Checked against the target's own
forward over prompt + output, and across drafts: speculation changes which forward scored a
position, never its numbers (the fast path's rows are batch-invariant)."""

from __future__ import annotations

import math

import pytest
import torch

from config import SamplingParams
from conftest import int4_engines
from speculative.runner import ForwardCall
from speculative.summary import prompt_logprobs, token_logprobs


def _engines():
    return int4_engines()  # (target, tokenizer, (target-only, draft model, prompt lookup))


def _run(engine, prompt, params):
    steps = []
    gen = engine.generate(prompt, params, on_step=steps.append)
    lps = [lp for s in steps for lp in s.logprobs]
    return gen, lps


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3),
                                    SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2, temperature=0.9, seed=5)])
def test_each_tokens_logprob_is_the_targets_own_and_the_same_whatever_drafted(params):
    target, tok, engines = _engines()
    prompt = "abcabcabcab"
    runs = [_run(e, prompt, params) for e in engines]
    ids, lps = runs[0][0].token_ids, runs[0][1]
    assert len(lps) == len(ids) == 24
    for gen, other in runs[1:]:  # the same tokens, the same numbers, bitwise
        assert gen.token_ids == ids and other == lps
    # the target's own forward over prompt + output: log_softmax of the row before each token
    full = tok(prompt)["input_ids"] + ids
    logits = target.forward_batch([ForwardCall("ref", 0, full, len(full))])[0]  # [len, V]
    target.release("ref")
    p0 = len(full) - len(ids)
    for j, (lp, top) in enumerate(lps):
        want = torch.log_softmax(logits[p0 - 1 + j].float(), -1)
        assert lp == pytest.approx(float(want[ids[j]]), abs=1e-4)
        assert len(top) == params.logprobs and [i for i, _ in top] == want.topk(params.logprobs).indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.topk(params.logprobs).values.tolist(), abs=1e-4)
        if params.greedy:
            assert top[0] == (ids[j], lp)  # greedy: the token is the most likely one


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, logprobs=2),
                                    SamplingParams(max_tokens=24, logprobs=2, temperature=0.9, seed=5)])
def test_the_end_of_sequence_that_ends_a_request_is_scored_but_not_emitted(params):
    """The step that meets the end of sequence reports its log-probability beside the emitted
    tokens' (llama-server's /completion lists it), and the request keeps which token ended it."""
    _, _, engines = _engines()
    gen, lps = _run(engines[0], "abcabcabcab", params.model_copy(update={"ignore_eos": True}))
    ids = gen.token_ids
    p = next(j for j in range(3, len(ids)) if ids[j] not in ids[:j])  # a token the output has not met before
    for engine in engines:  # each with that token as an end of sequence (fresh engines: nothing else sees it)
        engine.eos_ids = engine.eos_ids | {ids[p]}
        steps = []
        gen = engine.generate("abcabcabcab", params, on_step=steps.append)
        assert gen.token_ids == ids[:p] and gen.finish_reason == "stop"
        assert [lp for s in steps for lp in s.logprobs] == lps[:p]  # the emitted tokens' only
        assert steps[-1].eos_logprob == lps[p] and all(s.eos_logprob is None for s in steps[:-1])
        assert ids[p] not in steps[-1].emitted
        quiet = []
        engine.generate("abcabcabcab", params.model_copy(update={"logprobs": None}), on_step=quiet.append)
        assert all(s.eos_logprob is None and s.logprobs is None for s in quiet)


def test_no_logprobs_unless_asked():
    _, _, (alone, *_) = _engines()
    steps = []
    alone.generate("abc", SamplingParams(max_tokens=4), on_step=steps.append)
    assert all(s.logprobs is None for s in steps)


def test_token_logprobs_by_hand():
    ids = torch.tensor([[4, 2, 9], [1, 0, 3]])
    probs = torch.tensor([[0.5, 0.25, 0.125], [0.9, 0.05, 0.0]])
    got = token_logprobs(ids, probs, None, [4, 7], 2)
    assert got[0] == (math.log(0.5), [(4, math.log(0.5)), (2, math.log(0.25))])
    assert got[1][0] == float("-inf") and [i for i, _ in got[1][1]] == [1, 0]  # 7: past the top 3
    assert [v for _, v in got[1][1]] == pytest.approx([math.log(0.9), math.log(0.05)])
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    got = token_logprobs(ids, probs, logits, [3, 0], 0)  # full rows: any token, from the logits
    assert got[0] == (pytest.approx(math.log(0.25)), []) and got[1][0] == pytest.approx(float(torch.log_softmax(logits[1], -1)[0]))
    assert token_logprobs(ids, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), None, [4], 1)[0] == (float("-inf"), [(4, float("-inf"))])


@pytest.mark.parametrize("chunk", [3, 128])
def test_the_prompts_logprobs_are_the_targets_rows_before_each_token_in_chunks_or_whole(chunk):
    """``prompt_logprobs``: each prompt token after the first under the target given the tokens
    before it (and the most likely tokens there), as the output's are: scoring prompt + output
    gives the output's own log-probabilities. The forward's sequence is released; chunks of any
    size give the same numbers (int4 rows are batch-invariant)."""
    target, tok, (alone, *_) = _engines()
    prompt = "abcabcabcab"
    gen, lps = _run(alone, prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2))
    full = tok(prompt)["input_ids"] + gen.token_ids
    held = len(target)
    scored = prompt_logprobs(target, full, 2, chunk=chunk)
    assert len(scored) == len(full) - 1 and len(target) == held  # every token but the first; nothing left held
    p0 = len(full) - len(gen.token_ids)
    # the output's positions: the numbers generation reported (through its rows' summary: rounding apart)
    assert [lp for lp, _, _ in scored[p0 - 1:]] == pytest.approx([lp for lp, _ in lps], abs=1e-4)
    assert [[i for i, _ in top] for _, top, _ in scored[p0 - 1:]] == [[i for i, _ in top] for _, top in lps]
    logits = target.forward_batch([ForwardCall("ref", 0, full, len(full))])[0]
    target.release("ref")
    ranks = []
    for j, (lp, top, rank) in enumerate(scored):
        want = torch.log_softmax(logits[j].float(), -1)
        assert lp == pytest.approx(float(want[full[j + 1]]), abs=1e-4)
        assert [i for i, _ in top] == want.topk(2).indices.tolist()
        assert rank == 1 + int((want > want[full[j + 1]]).sum())  # vLLM's rank: 1 is the most likely
        ranks.append(rank)
    assert min(ranks) == 1 and max(ranks) > 2  # the prompt holds tokens the model expects and some it does not
    assert prompt_logprobs(target, full[:1], 2) == [] and prompt_logprobs(target, full, 0, chunk=chunk)[0][1] == []
    assert len(prompt_logprobs(target, full[:5], 2, chunk=3)) == 4  # a last chunk of one row is scored too
