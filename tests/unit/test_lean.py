"""The lean GPU path (speculative.lean), checked on the CPU: the padded bucket layout a CUDA graph
replays computes what Hugging Face's forward computes, a row does not depend on the bucket it is
padded into, greedy speculative output equals this runtime's target-only output, the number of
buckets stays bounded across requests of new lengths, and a missing CUDA device falls back to the
eager forward with a message. The CUDA-graph capture itself runs only on a GPU
(``bench/gpu_check.sh lean``)."""

from __future__ import annotations

import logging

import pytest
import torch

from config import EngineConfig, KPolicyConfig, SamplingParams
from conftest import _char_tokenizer, tiny_llama
from speculative import ForwardCall, ModelRunner, SpeculativeEngine, VerifyCall
from speculative.runtime import FastPathError, make_runner, resolve_quantize, runtime_of
from speculative.lean import GRAPH_TOKENS, MIN_CONTEXT, LeanRunner, bucket
from speculative.proposers import DraftModelProposer

TOL = dict(rtol=1e-4, atol=2e-4)


def _exact(model, **kw) -> LeanRunner:
    """The lean forward in float32 weights and keys/values: comparable to float32 Hugging Face."""
    return LeanRunner(model, dtype="float32", kv_dtype="float32", **kw)


def _ids(n, seed=1):
    return torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("buckets", [False, True])
def test_the_lean_forward_computes_what_hugging_face_computes(buckets):
    """Prefill, then decode and verify steps (padded into buckets, or not), equal the float32
    reference model's logits at every position."""
    model = tiny_llama(3, seed=0)
    ref, lean = ModelRunner(model), _exact(model, buckets=buckets)
    ids = _ids(60)
    torch.testing.assert_close(lean.forward("a", 0, ids[:20], 20), ref.forward("a", 0, ids[:20], 20), **TOL)
    pos = 20
    for n in (1, 3, 5, 1, 9, 2):  # decode and verify steps, each a new bucket or a seen one
        torch.testing.assert_close(lean.forward("a", pos, ids[pos : pos + n], n), ref.forward("a", pos, ids[pos : pos + n], n), **TOL)
        pos += n
    if buckets:
        assert lean.seen and all(T <= GRAPH_TOKENS and L >= MIN_CONTEXT for _, T, L in lean.seen)
    else:
        assert not lean.seen


def test_a_padded_batch_with_cropping_equals_each_sequence_alone():
    """Several sequences in one padded forward, some cropping back rejected positions, give each
    what it gets alone, unpadded; the padding writes nowhere a sequence reads."""
    model = tiny_llama(3, seed=0)
    alone, batched = _exact(model), _exact(model, buckets=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(5):
        prompt = torch.randint(2, 128, (3 + 9 * i,), generator=gen).tolist()
        alone.forward(f"s{i}", 0, prompt)
        batched.forward(f"s{i}", 0, prompt)
    for step in range(6):
        calls = []
        for i in range(5):
            have = alone.cached_length(f"s{i}")
            n_new, back = 1 + (i + step) % 4, (i + step) % 3
            calls.append(ForwardCall(f"s{i}", have - back, torch.randint(2, 128, (n_new,), generator=gen).tolist(), n_new))
        want = [alone.forward(c.seq_id, c.start, c.tokens, c.keep_last) for c in calls]
        got = batched.forward_batch(calls)
        for c, w, g in zip(calls, want, got):
            assert g.shape == (c.keep_last, 128)
            torch.testing.assert_close(g, w, **TOL)
            assert batched.cached_length(c.seq_id) == c.start + len(c.tokens)
    assert any(B == 8 for B, _, _ in batched.seen)  # 5 sequences padded to a bucket of 8


def test_verify_compacts_on_the_device_what_acceptance_needs():
    model = tiny_llama(2, seed=3)
    ref, lean = ModelRunner(model), _exact(model, buckets=True)
    calls = [VerifyCall("a", 0, _ids(7), 3, full_rows=True), VerifyCall("b", 0, _ids(4, 2), 2)]
    want, got = ref.verify(calls), lean.verify(calls)
    for w, g in zip(want, got):
        assert torch.equal(g.argmax, w.argmax) and g.batch == 2
        torch.testing.assert_close(g.top_probs, w.top_probs, **TOL)
        assert g.argmax.device.type == "cpu" and g.top_ids.device.type == "cpu"
    assert got[0].logits is not None and got[1].logits is None


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_speculative_equals_the_lean_targets_own_output(k):
    target, draft = tiny_llama(3, seed=0), tiny_llama(1, seed=7)
    tok = _char_tokenizer()
    runner = _exact(target, buckets=True, name="target")
    cfg = EngineConfig(chat_template=False, k=KPolicyConfig(k_max=k, fixed_k=k))
    alone = SpeculativeEngine(runner, tok, None, cfg)
    spec = SpeculativeEngine(runner, tok, DraftModelProposer(_exact(draft, buckets=True, name="draft"), 128), cfg)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    proposed = 0
    for prompt in ([5, 6, 7, 8], list(range(20, 45)), [9] * 12):
        want = alone.generate(prompt, params).token_ids
        g = spec.generate(prompt, params)
        assert g.token_ids == want
        proposed += g.stats.proposed
    assert proposed > 0


def test_buckets_stay_bounded_across_requests_of_new_lengths():
    """Forty requests of forty prompt lengths meet a handful of buckets (a captured graph each on a
    GPU), not one per length: nothing is captured again per request."""
    lean = LeanRunner(tiny_llama(2, seed=1), buckets=True, graph_context=512)
    for i in range(40):
        ids = _ids(3 + 6 * i, seed=i)  # up to 237 tokens (the tiny model holds 256 positions)
        lean.forward(f"r{i}", 0, ids[:GRAPH_TOKENS])  # a prompt chunk of up to GRAPH_TOKENS: a bucket
        pos = GRAPH_TOKENS if len(ids) > GRAPH_TOKENS else len(ids)
        if len(ids) > pos:
            lean.forward(f"r{i}", pos, ids[pos:])  # the rest at once: eager past GRAPH_TOKENS
        lean.forward(f"r{i}", len(ids), [5])  # a decode step
        lean.release(f"r{i}")
    Ts = {T for _, T, _ in lean.seen}
    Ls = {L for _, _, L in lean.seen}
    assert Ts <= {1, 2, 4, 8, 16, 32} and Ls <= {128, 256, 512}
    assert len(lean.seen) <= len(Ts) * len(Ls) < 40
    assert lean.stats["eager"] >= 40 and lean.pool.free_blocks == lean.pool.num_blocks - 1  # all freed but the trash block


def test_bucket_rounds_up_to_powers_of_two_and_declines_what_runs_eagerly():
    assert bucket([1], [5], 4096, 16) == (1, 1, 128)
    assert bucket([5, 1, 2], [300, 40, 2], 4096, 16) == (4, 8, 512)
    assert bucket([33], [33], 4096, 16) is None  # a prompt chunk
    assert bucket([1], [5000], 4096, 16) is None  # a context past the graphs'
    assert bucket([1] * 17, [5] * 17, 4096, 16) is None  # wider than the widest graph


def test_a_cpu_falls_back_to_the_eager_forward_with_a_message(caplog):
    model = tiny_llama(2, seed=0)
    with caplog.at_level(logging.WARNING, logger="speculative.lean"):
        lean = LeanRunner(model, graphs=True)
    assert not lean.graphs and "CUDA graphs need a CUDA device" in caplog.text
    assert lean.warmup() == 0
    assert runtime_of(lean) == "lean-bf16"
    lean.forward("a", 0, [4, 5, 6])
    assert lean.stats["eager"] == 1 and lean.stats["captured"] == 0


def test_choice_of_the_lean_runtime():
    model = tiny_llama(2, seed=0)
    assert resolve_quantize("auto", model) == "int4"  # a CPU keeps the int4 path
    assert runtime_of(make_runner(model, "lean")) == "lean-bf16"  # asked for: eager on a CPU

    class NotLlama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)
    with pytest.raises(FastPathError, match="lean"):
        resolve_quantize("lean", NotLlama())


def test_swapped_weights_are_packed_again():
    base, other = tiny_llama(1, seed=1), tiny_llama(1, seed=2)
    lean = LeanRunner(base)
    before = lean.forward("s", 0, [4, 5, 6])
    lean.load_state_dict({k: v.clone() for k, v in other.state_dict().items()})
    after = lean.forward("s", 1, [5, 6])
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, LeanRunner(other).forward("s", 0, [4, 5, 6]))


def test_features_come_back_for_a_feature_draft():
    model = tiny_llama(3, seed=0)
    ref, lean = ModelRunner(model), _exact(model, buckets=True)
    calls = [ForwardCall("a", 0, _ids(6), 1), ForwardCall("b", 0, _ids(4, 2), 1)]
    (wl, wf), (gl, gf) = ref.forward_batch_features(calls, (0,)), lean.forward_batch_features(calls, (0,))
    for w, g in zip(wf + wl, gf + gl):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, **TOL)


def test_a_copy_captures_its_own_graphs_and_computes_the_same():
    import copy

    lean = LeanRunner(tiny_llama(2, seed=0), buckets=True)
    a = lean.forward("s", 0, [4, 5, 6])
    twin = copy.deepcopy(lean)
    assert twin._graphs == {} and twin.pool.kv.data_ptr() != lean.pool.kv.data_ptr()
    torch.testing.assert_close(twin.forward("t", 0, [4, 5, 6]), a)
