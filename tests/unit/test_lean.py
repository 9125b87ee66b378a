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

from conftest import assert_speculation_equals_target_only, tiny_llama
from speculative import ForwardCall, ModelRunner, VerifyCall
from speculative.runtime import FastPathError, make_runner, resolve_quantize, runtime_of
from speculative.lean import GRAPH_TOKENS, MIN_CONTEXT, LeanRunner, bucket

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
    assert_speculation_equals_target_only(_exact(target, buckets=True, name="target"), _exact(draft, buckets=True, name="draft"), k)


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


# -- the compiled layers (torch.compile, inductor's C++ backend here; Triton on a GPU) ---------------
@pytest.fixture(scope="module")
def compiled():
    """One runner whose layers are compiled (the four shape classes, at its start): about a minute here."""
    model = tiny_llama(3, seed=0)
    lean = _exact(model, buckets=True, compile=True, name="target")
    assert lean.compiled, "torch.compile failed on this machine"
    return model, lean


def test_the_compiled_layers_compute_what_hugging_face_computes(compiled):
    """Prefill, decode and verify steps of the compiled forward equal the float32 reference's logits,
    alone and with several sequences in one padded step."""
    model, lean = compiled
    ref = ModelRunner(model)
    assert runtime_of(lean) == "lean-bf16-compiled" and lean.stats["compile_s"] > 0
    for i in range(3):
        ids = _ids(9 + 7 * i, seed=i)
        torch.testing.assert_close(lean.forward(f"c{i}", 0, ids, len(ids)), ref.forward(f"c{i}", 0, ids, len(ids)), **TOL)
    for step in range(4):
        calls = [ForwardCall(f"c{i}", ref.cached_length(f"c{i}"), _ids(1 + (i + step) % 4, seed=10 * step + i), 1 + (i + step) % 4)
                 for i in range(3)]
        want = [ref.forward(c.seq_id, c.start, c.tokens, c.keep_last) for c in calls]
        for c, w, g in zip(calls, want, lean.forward_batch(calls)):
            torch.testing.assert_close(g, w, **TOL)
        for group in (calls[:1], calls[1:]):  # the same steps again, one sequence, then two: the cache is rewritten alike
            for c in group:
                ref.forward(c.seq_id, c.start, c.tokens, c.keep_last)
            lean.forward_batch(group)
    for i in range(3):
        lean.release(f"c{i}")


def test_greedy_speculative_equals_the_compiled_targets_own_output(compiled):
    _, runner = compiled
    assert_speculation_equals_target_only(runner, _exact(tiny_llama(1, seed=7), buckets=True, name="draft"), 4)


def test_requests_of_new_lengths_compile_nothing_new(compiled):
    """The layers were compiled at the runner's start for every shape class a step takes: forty
    requests of forty prompt lengths, decoded alone and in batches of up to three, compile no more."""
    import torch._dynamo.utils as dynamo_utils

    _, lean = compiled
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    for i in range(0, 40, 3):
        calls = [ForwardCall(f"n{j}", 0, _ids(2 + 5 * j, seed=j), 1) for j in range(i, min(i + 3, 40))]
        for c in calls:
            lean.forward(c.seq_id, 0, c.tokens)
        for n in (1, 3, 6):
            lean.forward_batch([ForwardCall(c.seq_id, lean.cached_length(c.seq_id), _ids(n, seed=n), n) for c in calls])
        lean.forward(calls[0].seq_id, lean.cached_length(calls[0].seq_id), [5])
        for c in calls:
            lean.release(c.seq_id)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == before


def test_a_rows_logits_do_not_depend_on_the_step_it_is_computed_in(compiled):
    """Bitwise: a position's logits are the same from a decode step of its sequence alone, from a
    verify step of several tokens and from a step shared with other sequences (what makes greedy
    speculation equal target-only decoding on the compiled runtime)."""
    _, lean = compiled
    for i in range(3):
        lean.forward(f"v{i}", 0, _ids(11 + 4 * i, seed=30 + i))
    ends = {f"v{i}": lean.cached_length(f"v{i}") for i in range(3)}
    draft = _ids(5, seed=40)
    alone = [lean.forward("v0", ends["v0"] + j, draft[j : j + 1])[0] for j in range(5)]  # five decode steps
    verify = lean.forward("v0", ends["v0"], draft, 5)  # the same positions in one verify step
    shared = lean.forward_batch([ForwardCall("v0", ends["v0"], draft, 5)]
                                + [ForwardCall(f"v{i}", ends[f"v{i}"], _ids(1 + 2 * i, seed=i), 1) for i in (1, 2)])[0]
    for j in range(5):
        assert torch.equal(verify[j], alone[j]) and torch.equal(shared[j], alone[j]), j
    for i in range(3):
        lean.release(f"v{i}")


def test_a_compiler_that_fails_leaves_the_eager_layers_with_a_message(caplog):
    """No working C++ compiler (or Triton on a GPU): the runner says why, once, and serves the same
    forward eagerly."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    model = tiny_llama(2, seed=5)
    torch._dynamo.reset()  # nothing compiled earlier is reused (so this test comes last)
    with inductor_config.patch({"fx_graph_cache": False, "cpp.cxx": ("/nonexistent/c++",)}):
        with caplog.at_level(logging.ERROR, logger="speculative.lean"):
            lean = LeanRunner(model, buckets=True, compile=True)
    torch._dynamo.reset()
    assert not lean.compiled and "torch.compile of the lean layers failed" in caplog.text
    assert runtime_of(lean) == "lean-bf16"
    torch.testing.assert_close(lean.forward("a", 0, [4, 5, 6]), LeanRunner(model).forward("a", 0, [4, 5, 6]))
