"""Batched verification: several requests' target calls in one padded forward.

The padded forward must give each sequence what its own forward gives (up to float rounding:
other GEMM shapes), leave every sequence's KV cache as its own forward would, and so keep greedy
speculative output identical to sequential decoding.
"""

from __future__ import annotations

import pytest
import torch

from config import DraftConfig, EngineConfig, KPolicyConfig, SamplingParams
from conftest import PROMPT_TEXTS, tiny_llama
from speculative import ForwardCall, ModelRunner, SpeculativeEngine, VerifyCall
from speculative.proposers import DraftModelProposer


def _random_calls(gen, runners, step):
    """Calls of ragged lengths over 6 sequences, some cropping back cached positions."""
    calls = []
    for i in range(6):
        sid = f"s{i}"
        have = runners[0].cached_length(sid)
        n_new = 1 + (i + step) % 4
        back = (i + step) % 3 if have > 3 else 0
        calls.append(ForwardCall(sid, have - back, torch.randint(2, 128, (n_new,), generator=gen).tolist(), n_new))
    return calls


def test_forward_batch_equals_one_forward_per_sequence():
    model = tiny_llama()
    single, batched = ModelRunner(model), ModelRunner(model)
    gen = torch.Generator().manual_seed(0)
    for i in range(6):  # prefixes of different lengths
        prompt = torch.randint(2, 128, (3 + 7 * i,), generator=gen).tolist()
        single.forward(f"s{i}", 0, prompt)
        batched.forward(f"s{i}", 0, prompt)
    for step in range(6):
        calls = _random_calls(gen, [single, batched], step)
        want = [single.forward(c.seq_id, c.start, c.tokens, c.keep_last) for c in calls]
        got = batched.forward_batch(calls)
        for c, w, g in zip(calls, want, got):
            assert g.shape == w.shape == (c.keep_last, 128)
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)
            assert batched.cached_length(c.seq_id) == single.cached_length(c.seq_id) == c.start + len(c.tokens)
    # the caches written back hold the same keys and values as the unbatched ones
    for i in range(6):
        a, b = single._caches[f"s{i}"], batched._caches[f"s{i}"]
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(lb.keys, la.keys, rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(lb.values, la.values, rtol=1e-3, atol=1e-3)


def test_padding_is_masked_out():
    """A sequence's rows do not depend on which (or how long) other sequences share its batch."""
    model = tiny_llama()
    r = ModelRunner(model)
    r.forward("short", 0, [5, 6, 7])
    r.forward("long", 0, list(range(10, 60)))
    alone = ModelRunner(model)
    alone.forward("short", 0, [5, 6, 7])
    (want,) = alone.forward_batch([ForwardCall("short", 3, [8, 9], 2)])
    got = r.forward_batch([ForwardCall("short", 3, [8, 9], 2), ForwardCall("long", 50, [11], 1)])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_a_prefill_shares_a_batch_with_cached_sequences():
    """A new sequence (start 0, nothing cached) and a sequence re-sent whole beside decode steps."""
    model = tiny_llama()
    single, batched = ModelRunner(model), ModelRunner(model)
    for r in (single, batched):
        r.forward("old", 0, list(range(10, 30)))
        r.forward("again", 0, [5, 6, 7, 8])
    calls = [ForwardCall("old", 20, [31, 32], 2), ForwardCall("new", 0, [40, 41, 42], 1),
             ForwardCall("again", 0, [5, 6, 7, 8, 9], 2)]
    want = [single.forward(c.seq_id, c.start, c.tokens, c.keep_last) for c in calls]
    for c, w, g in zip(calls, want, batched.forward_batch(calls)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)
        assert batched.cached_length(c.seq_id) == c.start + len(c.tokens)


def test_forward_batch_refuses_bad_calls():
    r = ModelRunner(tiny_llama())
    r.forward("a", 0, [5, 6])
    with pytest.raises(ValueError, match="two calls for one sequence"):
        r.forward_batch([ForwardCall("a", 2, [7]), ForwardCall("a", 2, [8])])
    with pytest.raises(ValueError, match="cannot start at"):
        r.forward_batch([ForwardCall("a", 5, [7]), ForwardCall("b", 0, [8])])
    with pytest.raises(ValueError, match="at least one token"):
        r.forward_batch([ForwardCall("a", 2, []), ForwardCall("b", 0, [8])])


def test_verify_sends_full_rows_only_when_sampling_and_batches_short_calls():
    r = ModelRunner(tiny_llama())
    r.forward("a", 0, [5, 6, 7])
    r.forward("b", 0, [8, 9])
    long_prompt = list(range(2, 100))
    out = r.verify([
        VerifyCall("a", 3, [10, 11], 2, full_rows=False, top_k=4),
        VerifyCall("b", 2, [12], 1, full_rows=True, top_k=4),
        VerifyCall("c", 0, long_prompt, 1),
    ], max_batch_tokens=16)
    assert out[0].logits is None and out[0].argmax.shape == (2,) and out[0].top_ids.shape == (2, 4)
    assert out[1].logits.shape == (1, 128) and int(out[1].argmax[0]) == int(out[1].logits[0].argmax())
    assert out[0].batch == out[1].batch == 2 and out[2].batch == 1  # the prefill ran alone
    torch.testing.assert_close(out[1].top_probs.sum(-1) + out[1].tail, torch.ones(1))


def test_verify_batches_calls_of_up_to_max_batch_tokens_and_times_them():
    """A call of exactly max_batch_tokens tokens still shares the forward, one token more runs
    alone; each row carries its forward's wall time (what the cost model learns from)."""
    import time

    r = ModelRunner(tiny_llama())
    r.forward("a", 0, [5, 6, 7])
    t0 = time.perf_counter()
    out = r.verify([VerifyCall("a", 3, [10], 1), VerifyCall("b", 0, list(range(2, 18)), 1)], max_batch_tokens=16)
    wall = time.perf_counter() - t0
    assert out[0].batch == out[1].batch == 2
    assert all(0 < row.seconds <= wall for row in out)
    out = r.verify([VerifyCall("a", 4, [11], 1), VerifyCall("c", 0, list(range(2, 19)), 1)], max_batch_tokens=16)
    assert out[0].batch == out[1].batch == 1


def test_a_sequence_cannot_start_past_its_cache_and_weights_must_match():
    r = ModelRunner(tiny_llama())
    with pytest.raises(ValueError, match="has 0 cached positions, cannot start at 1"):
        r.forward("new", 1, [5])
    state = {k: v.clone() for k, v in r.model.state_dict().items()}
    state.pop(next(iter(state)))
    with pytest.raises(RuntimeError, match="Missing key"):
        r.load_state_dict(state)


def _engine(draft_layers=1):
    target = tiny_llama(num_layers=3, seed=0)
    draft = tiny_llama(num_layers=draft_layers, seed=1)
    from conftest import _char_tokenizer

    cfg = EngineConfig(draft=DraftConfig(kind="truncated"), k=KPolicyConfig(fixed_k=3, k_max=3), chat_template=False)
    return SpeculativeEngine(ModelRunner(target, name="target"), _char_tokenizer(), DraftModelProposer(ModelRunner(draft), 128), cfg)


def test_step_many_greedy_equals_sequential():
    prompts = PROMPT_TEXTS * 2 + ["zz top", "a"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [_engine().generate(p, params).token_ids for p in prompts]
    engine = _engine()
    rids = [engine.add_request(p, params) for p in prompts]
    batches = 0
    while live := [r for r in rids if not engine.requests[r].finished]:
        engine.step_many(live)
        batches += 1
    got = [engine.requests[r].output for r in rids]
    assert got == want
    assert batches < sum(len(w) for w in want) / 2  # steps were shared, not run one by one
