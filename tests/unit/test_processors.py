"""Penalties, logit biases, min_tokens, stop_token_ids and min-p (``speculative.processors``,
``SamplingParams``): each verified row is processed with the history it would have had decoded
alone, so greedy outputs equal a plain decoding loop's that processes the logits itself, whatever
proposed. (Their laws under sampling: ``tests/unit/test_lossless.py``.)"""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch

from config import EngineConfig, KPolicyConfig, SamplingParams, SuffixConfig
import lossless as L
from conftest import int4_engines
from speculative import RequestError, SpeculativeEngine
from speculative.processors import process_rows
from speculative.runner import ForwardCall
from speculative.sampling import warp_logits
from speculative.suffix import SuffixProposer


# -- by hand -----------------------------------------------------------------------------------------------
def test_each_row_is_penalised_with_the_drafts_tokens_before_it():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]] * 3)  # [k+1 = 3, V = 4]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # prompt [3], output so far [0, 0]; the draft proposes [2, 0]
    got = process_rows(logits, params, [3, 0, 0], 1, [2, 0], set())
    assert got[0].tolist() == [2.0 - 2 * 0.5 - 0.25, -1.0, 0.5, 1.0]  # the prompt's 3 is not penalised
    assert got[1].tolist() == [2.0 - 2 * 0.5 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 1.0]  # after d_1 = 2
    assert got[2].tolist() == [2.0 - 3 * 0.5 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 1.0]  # after d_2 = 0
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 1.0]  # the input is left as it was


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0], [2.0, -1.0, 0.5, 1.0]])
    got = process_rows(logits, SamplingParams(repetition_penalty=2.0), [1, 0], 1, [3], set())
    assert got[0].tolist() == [1.0, -2.0, 0.5, 1.0]  # 1 (prompt) and 0 (output) seen
    assert got[1].tolist() == [1.0, -2.0, 0.5, 0.5]  # and then the draft's 3


def test_llama_cpps_penalties_count_the_last_n_tokens_of_prompt_and_output_as_each_row_stands():
    """llama.cpp's penalties (``penalty_last_n``): every penalty counts a token's occurrences in the
    last n tokens, the prompt's among them; each row's window slides over the draft's tokens."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]] * 3)  # [k+1 = 3, V = 4]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, penalty_last_n=3)
    # prompt [3, 1], output so far [0, 1]; the draft proposes [1, 2]
    got = process_rows(logits, params, [3, 1, 0, 1], 2, [1, 2], set())
    # row 0: window [1, 0, 1] -> 1 twice, 0 once (the prompt's 3 has left it)
    assert got[0].tolist() == [2.0 / 2 - 0.5 - 0.25, -1.0 * 2 - 2 * 0.5 - 0.25, 0.5, 1.0]
    # row 1: window [0, 1, 1] (d_1 = 1 in, the prompt's 1 out)
    assert got[1].tolist() == [2.0 / 2 - 0.5 - 0.25, -1.0 * 2 - 2 * 0.5 - 0.25, 0.5, 1.0]
    # row 2: window [1, 1, 2] (d_2 = 2 in, 0 out)
    assert got[2].tolist() == [2.0, -1.0 * 2 - 2 * 0.5 - 0.25, 0.5 / 2 - 0.5 - 0.25, 1.0]
    every = process_rows(logits[:1], params.model_copy(update={"penalty_last_n": -1}), [3, 1, 0, 1], 2, [], set())
    assert every[0].tolist() == [2.0 / 2 - 0.5 - 0.25, -1.0 * 2 - 2 * 0.5 - 0.25, 0.5, 1.0 / 2 - 0.5 - 0.25]  # -1: all
    off = params.model_copy(update={"penalty_last_n": 0})
    assert not off.processes_logits and process_rows(logits, off, [3, 1, 0, 1], 2, [1, 2], set()).equal(logits)
    assert params.processes_logits


@pytest.mark.parametrize("window", [None, 2])
def test_ids_past_the_rows_width_count_without_touching_a_row(window):
    """A tokenizer's added tokens can lie past the logits' width: counted, never an index error."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]] * 2)  # V = 4
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, penalty_last_n=window)
    got = process_rows(logits, params, [9, 0, 5], 1, [7], set())  # the prompt's 9, the output's 5, d_1 = 7
    assert got[0].tolist() == [1.0 - 0.5, -1.0, 0.5, 1.0]
    # row 1: vLLM's counts the output's 0 still; llama.cpp's window of 2 holds only 5 and 7 then
    assert got[1].tolist() == ([1.0 - 0.5, -1.0, 0.5, 1.0] if window is None else [2.0, -1.0, 0.5, 1.0])


def test_logit_bias_is_added_and_min_tokens_bans_the_stops_only_while_the_output_is_short():
    logits = torch.zeros(3, 5)
    params = SamplingParams(logit_bias={1: 3.0, 4: -100.0}, min_tokens=3, max_tokens=8)
    got = process_rows(logits, params, [0, 2], 1, [1, 1], {2, 3})  # 1 token out: rows 0 and 1 are before 3
    assert got[0].tolist() == [0.0, 3.0, -math.inf, -math.inf, -100.0]
    assert got[1].tolist() == [0.0, 3.0, -math.inf, -math.inf, -100.0]
    assert got[2].tolist() == [0.0, 3.0, 0.0, 0.0, -100.0]  # 3 tokens before row 2: the stops are allowed
    # an end-of-sequence id past the head (a tokenizer's, that the model cannot emit) is skipped
    assert process_rows(logits, params, [0], 1, [1, 1], {5, 2})[0, 2] == -math.inf


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = warp_logits(logits, SamplingParams(temperature=1.0, min_p=0.3)) > 0
    assert kept.tolist() == [[True, True, True, False]]  # 0.15 >= 0.3 * 0.5; 0.05 is not
    kept = warp_logits(logits, SamplingParams(temperature=1.0, min_p=0.7)) > 0
    assert kept.tolist() == [[True, False, False, False]]
    edge = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))  # exactly min_p of the most likely: kept
    assert (warp_logits(edge, SamplingParams(temperature=1.0, min_p=0.5)) > 0).tolist() == [[True, True, True]]
    hot = warp_logits(logits, SamplingParams(temperature=2.0, min_p=0.3))  # after the temperature: flatter
    assert (hot > 0).tolist() == [[True, True, True, True]] and hot.sum() == pytest.approx(1.0)


# -- through the engine --------------------------------------------------------------------------------------
def _engines():
    return int4_engines()  # (target, tokenizer, (target-only, draft model, prompt lookup))


def _plain_greedy(target, prompt_ids, params, eos, n):
    """A decoding loop with no speculation: the whole sequence forward each token, its last row
    processed as written out here (vLLM's order), then the argmax."""
    seq = list(prompt_ids)
    for _ in range(n):
        z = target.forward_batch([ForwardCall("ref", 0, seq, 1)])[0][0].float().clone()  # [V]
        target.release("ref")
        out = seq[len(prompt_ids):]
        if len(out) < params.min_tokens:
            for t in eos | set(params.stop_token_ids):
                z[t] = -math.inf
        for t, b in params.logit_bias.items():
            z[t] += b
        n = params.penalty_last_n
        if n is None:  # vLLM's: repetition over prompt and output, frequency and presence over the output
            for t in set(seq):
                z[t] = z[t] / params.repetition_penalty if z[t] > 0 else z[t] * params.repetition_penalty
            for t in set(out):
                z[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
        elif n:  # llama.cpp's: every penalty over the last n tokens (-1: all), the prompt's too
            window = seq if n < 0 else seq[-n:]
            for t in set(window):
                z[t] = z[t] / params.repetition_penalty if z[t] > 0 else z[t] * params.repetition_penalty
                z[t] -= params.frequency_penalty * window.count(t) + params.presence_penalty
        nxt = int(z.argmax())
        seq.append(nxt)
        if nxt in params.stop_token_ids:
            break
    return seq[len(prompt_ids):]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.8, logit_bias={98: 2.0, 99: -100.0}),
    SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=-1.0, logit_bias={97: 0.7}),
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=0.4, penalty_last_n=5),
    SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1.5, penalty_last_n=-1)])
def test_greedy_with_penalties_is_the_plain_loops_output_whatever_drafted(params):
    target, tok, engines = _engines()
    prompt = "abcabcabcab"
    want = _plain_greedy(target, tok(prompt)["input_ids"], params, set(), 24)
    plain = engines[0].generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
    assert want != plain  # the processing changes this output
    # a suffix tree that has seen the answer proposes it whole: every row after the first is
    # processed with drafted tokens in its history, so a row processed without them shows
    oracle = SuffixProposer(SuffixConfig(max_depth=32, spec_factor=4.0, min_token_prob=0.0))
    oracle.add_served("seen", tok(prompt)["input_ids"] + want)
    knows = SpeculativeEngine(target, tok, oracle, EngineConfig(chat_template=False, k=KPolicyConfig(k_max=4, fixed_k=4)))
    for engine in (*engines, knows):
        steps = []
        gen = engine.generate(prompt, params, on_step=steps.append)
        assert gen.token_ids == want, type(engine.proposer).__name__
    assert sum(s.accepted for s in steps) >= 12  # the oracle's drafts were taken


def test_a_stop_token_id_ends_the_output_and_is_kept_and_min_tokens_holds_it_off():
    target, tok, (alone, drafted, lookup) = _engines()
    prompt = "abcabcabcab"
    free = alone.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
    stop = free[3]  # the 4th token of the unprocessed output
    first = free.index(stop)
    for engine in (alone, drafted, lookup):
        gen = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop]))
        assert gen.token_ids == free[: first + 1] and gen.finish_reason == "stop"
        held = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop], min_tokens=first + 2)
        gen = engine.generate(prompt, held)
        assert stop not in gen.token_ids[: first + 2]  # banned until min_tokens tokens are out
        assert gen.token_ids == _plain_greedy(target, tok(prompt)["input_ids"], held, set(), 24)


def test_token_ids_a_request_names_must_be_in_the_vocabulary():
    _, _, (alone, *_) = _engines()
    vocab = alone.vocab_size
    for params in (SamplingParams(logit_bias={vocab: 1.0}), SamplingParams(stop_token_ids=[vocab])):
        with pytest.raises(RequestError, match="out of range"):
            alone.add_request("abc", params)
    assert not alone.requests
    alone.add_request("abc", SamplingParams(logit_bias={vocab - 1: 1.0}, stop_token_ids=[vocab - 1]))  # the last id is in


# -- llama.cpp's samplers ---------------------------------------------------------------------------------------
LLAMA = ("top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


def _row(*probs):
    return torch.log(torch.tensor([probs], dtype=torch.float64)).float()  # [1, V]


def test_typical_p_keeps_the_tokens_nearest_the_entropy_and_can_drop_the_most_likely():
    # entropy 1.2206; |surprise - entropy|: 0.527, 0.389, 0.389, 1.082: tokens 1 and 2 first (0.4 > 0.3)
    z = _row(0.5, 0.2, 0.2, 0.1)
    p = warp_logits(z, SamplingParams(temperature=1.0, typical_p=0.3))
    assert torch.allclose(p, torch.tensor([[0.0, 0.5, 0.5, 0.0]]))
    p = warp_logits(z, SamplingParams(temperature=1.0, typical_p=0.5))  # then token 0: 0.9 > 0.5
    assert torch.allclose(p, torch.tensor([[5 / 9, 2 / 9, 2 / 9, 0.0]]))
    p = warp_logits(z, SamplingParams(temperature=1.0, typical_p=0.3, min_keep=3))  # at least three kept
    assert torch.allclose(p, torch.tensor([[5 / 9, 2 / 9, 2 / 9, 0.0]]))
    p = warp_logits(z, SamplingParams(temperature=1.0, typical_p=0.3, min_keep=9))  # more than there are: all
    assert torch.allclose(p, torch.tensor([[0.5, 0.2, 0.2, 0.1]]))
    even = torch.zeros(1, 4)  # 0.25 each: the mass reaches 0.5 at the second, passes it at the third (llama.cpp's >)
    assert int((warp_logits(even, SamplingParams(temperature=1.0, typical_p=0.5)) > 0).sum()) == 3
    # greedy in llama.cpp's order: the cut comes before the temperature, so the argmax is gone
    for order in (LLAMA, ("typ_p", "temperature")):
        greedy = SamplingParams(temperature=0.0, typical_p=0.3, samplers=order)
        assert greedy.greedy_rows and warp_logits(z, greedy).argmax().item() in (1, 2), order
    assert not SamplingParams(temperature=0.0, typical_p=0.3).greedy_rows  # the default: the temperature first
    assert warp_logits(z, SamplingParams(temperature=0.0, typical_p=0.3)).argmax().item() == 0


def test_min_keep_is_a_floor_under_min_p_and_top_p():
    z = _row(0.6, 0.25, 0.1, 0.05)
    for keep, kept in ((0, 1), (1, 1), (3, 3), (9, 4)):
        p = warp_logits(z, SamplingParams(temperature=1.0, min_p=0.9, min_keep=keep))
        assert int((p > 0).sum()) == kept and p[0, 0] > p[0, kept - 1] if kept > 1 else p[0, 0] == 1.0, keep
    p = warp_logits(z, SamplingParams(temperature=1.0, top_p=0.5, min_keep=2))
    assert (p > 0).tolist() == [[True, True, False, False]]
    assert (warp_logits(z, SamplingParams(temperature=1.0, top_p=0.5)) > 0).tolist() == [[True, False, False, False]]


def test_xtc_is_the_mixture_of_its_coins_two_outcomes():
    z = _row(0.5, 0.3, 0.15, 0.05)  # above 0.1: tokens 0-2; when it fires, all but the least of them (2) go
    p = warp_logits(z, SamplingParams(temperature=1.0, xtc_probability=0.4, xtc_threshold=0.1))
    assert torch.allclose(p, 0.6 * torch.tensor([[0.5, 0.3, 0.15, 0.05]]) + 0.4 * torch.tensor([[0.0, 0.0, 0.75, 0.25]]))
    for off in (dict(xtc_threshold=0.6), dict(xtc_threshold=0.4), dict(min_keep=3), dict(samplers=("temperature",))):
        # a threshold above 0.5 (off); one token above it (nothing to exclude); fewer than min_keep left; not in the order
        p = warp_logits(z, SamplingParams(temperature=1.0, xtc_probability=0.4, **{"xtc_threshold": 0.1, **off}))
        assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.05]]), atol=1e-6), off
    with pytest.raises(ValueError, match="temperature above 0"):
        SamplingParams(temperature=0.0, xtc_probability=0.4)
    even = torch.zeros(1, 4)  # each exactly 0.25: at the threshold counts as above it (llama.cpp's >=)
    p = warp_logits(even, SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.25))
    assert int((p > 0).sum()) == 1 and float(p.max()) == 1.0


def test_top_n_sigma_and_the_dynamic_temperature_by_hand():
    z = torch.tensor([[4.0, 2.0, 0.0, -2.0]])  # mean 1, std sqrt(5) = 2.236: max - 1 std = 1.76
    p = warp_logits(z, SamplingParams(temperature=1.0, top_n_sigma=1.0))
    assert (p > 0).tolist() == [[True, True, False, False]]
    for off in (0.0, -1.0):  # n <= 0 is off (0 would keep the most likely alone)
        assert torch.allclose(warp_logits(z, SamplingParams(temperature=1.0, top_n_sigma=off)), z.softmax(-1))
    flat = torch.zeros(1, 4)  # normalised entropy 1: the temperature at the top of its range
    sharp = torch.tensor([[30.0, 0.0, 0.0, 0.0]])  # entropy ~0: at the bottom (0: the argmax alone)
    params = SamplingParams(temperature=1.0, dynatemp_range=1.0)
    assert torch.allclose(warp_logits(flat, params), torch.full((1, 4), 0.25))
    assert warp_logits(sharp, params).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    mid = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    q = mid.softmax(-1)
    t = 0.5 + 1.0 * float(-(q * q.log()).sum() / math.log(4))  # range 0.5..1.5 at temperature 1, range 0.5
    assert torch.allclose(warp_logits(mid, SamplingParams(temperature=1.0, dynatemp_range=0.5)), (mid / t).softmax(-1), atol=1e-6)


@pytest.mark.parametrize("settings", [
    dict(samplers=LLAMA, typical_p=0.6, top_n_sigma=1.0, top_k=20, top_p=0.9, min_p=0.05, temperature=0.7),
    dict(samplers=LLAMA, xtc_probability=0.3, xtc_threshold=0.05, dynatemp_range=0.4, dynatemp_exponent=1.5, temperature=1.1),
    dict(typical_p=0.8, min_keep=4, xtc_probability=0.5, xtc_threshold=0.08, temperature=0.9, top_p=0.95),
    dict(samplers=("typ_p", "temperature", "top_n_sigma", "min_p"), typical_p=0.5, top_n_sigma=2.0, min_p=0.1, min_keep=2,
         temperature=1.3),
])
def test_the_warp_is_llama_cpps_chain_as_transcribed(settings):
    """Against ``tests/lossless.py``'s transcription of llama.cpp's samplers (candidate lists, one
    sampler after another, XTC's two outcomes summed) on rows of a real model's spread."""
    params = SamplingParams(**settings)
    process = {k: v for k, v in settings.items() if k not in ("temperature", "top_p", "top_k")}
    z = torch.randn(64, 40, generator=torch.Generator().manual_seed(5)) * 2.5  # [64, 40]
    got = warp_logits(z, params).double().numpy()
    want = np.stack([L.reference_chain(row, params.temperature, params.top_p, params.top_k, process)
                     for row in z.double().numpy()])
    assert np.abs(got - want).max() < 1e-5
    plain = (z / params.temperature).softmax(-1).double().numpy()
    assert np.median(np.abs(want - plain).sum(-1)) > 0.1  # the samplers change the rows' law


def test_greedy_with_typical_p_in_llama_cpps_order_is_the_plain_loops_output_whatever_drafted():
    target, tok, engines = _engines()
    prompt = "abcabcabcab"
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0, typical_p=0.5, samplers=LLAMA)
    seq = list(tok(prompt)["input_ids"])
    for _ in range(16):  # the plain loop: llama.cpp's typical cut on each whole row, then its argmax
        z = target.forward_batch([ForwardCall("ref", 0, seq, 1)])[0][0].double().numpy()
        target.release("ref")
        kept = L.reference_chain(z, 1.0, 1.0, 0, {"typical_p": 0.5, "samplers": ("typ_p",)}) > 0
        seq.append(int(np.where(kept, z, -np.inf).argmax()))
    want = seq[len(tok(prompt)["input_ids"]):]
    assert want != engines[0].generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True)).token_ids
    for engine in engines:
        assert engine.generate(prompt, params).token_ids == want, type(engine.proposer).__name__
