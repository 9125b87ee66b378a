"""The int4 / int8 fast path (speculative.fast): a row's logits do not depend on how it is batched,
cropping the cache equals recomputing, greedy speculative output equals the fast target's own
target-only output, and the packed weights compute what they claim to.

The rejection-sampling distribution on this path is tested with the exact-law harness
(``tests/lossless.py``, cases ``llama-int4``)."""

from __future__ import annotations

import pytest
import torch

from config import ModelConfig
from conftest import assert_speculation_equals_target_only, tiny_llama
from speculative import ForwardCall, ModelRunner, VerifyCall
from speculative.kvcache import KVCacheFull
from speculative.fast import FastRunner, Int4Linear, Int8Linear
from speculative.runtime import FastPathError, make_runner, resolve_quantize, runtime_of

BITS = [4, 8]


def _model(seed=0, layers=3):
    return tiny_llama(layers, seed=seed)


def _on_int4_grid(model: torch.nn.Module) -> torch.nn.Module:
    """Round every decoder linear onto a 4-bit grid per group of 32 inputs whose step and minimum are
    powers of two (exact in bfloat16): the weights int4 can hold without loss, as a Q4_1 GGUF's are."""
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            w = lin.weight.data
            g = torch.Generator().manual_seed(w.numel())
            q = torch.randint(0, 16, w.shape, generator=g).float().view(w.shape[0], -1, 32)  # [N, K/32, 32]
            q[..., 0], q[..., 1] = 0, 15  # every group spans the grid, as a Q4_1 block's minimum and maximum do
            step = 2.0 ** torch.randint(-8, -5, (w.shape[0], w.shape[1] // 32, 1), generator=g).float()
            lo = -8 * step
            lin.weight.data = (q * step + lo).view_as(w)
    return model


#: the native attention kernel over the pool (the default where it builds), and the torch attention
ATTENTION = ["kernel", "torch"]


def _runner(model, attention: str, **kw) -> FastRunner:
    r = FastRunner(model, **kw)
    assert r.attention_kernel is not None  # built on this machine: both paths are tested here
    if attention == "torch":
        r.attention_kernel = None
    return r


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("bits", BITS)
def test_rows_do_not_depend_on_how_they_are_batched(bits, attention):
    """Prefill whole = in chunks = token by token; verify k+1 at once = one at a time; bitwise."""
    r = _runner(_model(), attention, bits=bits)
    ids = torch.randint(2, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = r.forward("a", 0, ids, len(ids))  # [40, V]
    r.forward("b", 0, ids[:17])
    chunked = torch.cat([r.forward("b", 17, ids[17:30], 13), r.forward("b", 30, ids[30:], 10)])
    one = [r.forward("c", 0, ids[:1])[0]] + [r.forward("c", i, [ids[i]])[0] for i in range(1, len(ids))]
    assert torch.equal(whole[17:], chunked)
    assert torch.equal(whole, torch.stack(one))
    assert r.cached_length("a") == r.cached_length("b") == r.cached_length("c") == 40


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("bits", BITS)
def test_ragged_batch_with_cropping_equals_each_sequence_alone(bits, attention):
    """Several sequences in one forward (some cropping back rejected positions) give each what it
    gets alone, and leave each cache as alone; bitwise."""
    model = _model()
    single, batched = _runner(model, attention, bits=bits), _runner(model, attention, bits=bits)
    gen = torch.Generator().manual_seed(0)
    for i in range(5):
        prompt = torch.randint(2, 128, (3 + 9 * i,), generator=gen).tolist()
        single.forward(f"s{i}", 0, prompt)
        batched.forward(f"s{i}", 0, prompt)
    for step in range(5):
        calls = []
        for i in range(5):
            have = single.cached_length(f"s{i}")
            n_new, back = 1 + (i + step) % 4, (i + step) % 3
            calls.append(ForwardCall(f"s{i}", have - back, torch.randint(2, 128, (n_new,), generator=gen).tolist(), n_new))
        want = [single.forward(c.seq_id, c.start, c.tokens, c.keep_last) for c in calls]
        got = batched.forward_batch(calls)
        for c, w, g in zip(calls, want, got):
            assert g.shape == (c.keep_last, 128) and torch.equal(g, w)
            assert batched.cached_length(c.seq_id) == c.start + len(c.tokens)
    for i in range(5):  # the caches hold the same keys and values
        a, b = single._caches[f"s{i}"], batched._caches[f"s{i}"]
        assert a.length == b.length
        for layer in range(3):
            assert torch.equal(a.read(layer, a.length), b.read(layer, b.length))


def test_cropping_equals_a_fresh_sequence_and_the_cache_grows():
    r = FastRunner(_model(), bits=4, block_tokens=8)
    ids = list(range(5, 45))
    r.forward("x", 0, ids[:30])
    r.forward("x", 30, [7, 8, 9, 10])  # rejected positions, overwritten next
    got = r.forward("x", 30, ids[30:], 10)
    assert torch.equal(got, r.forward("fresh", 0, ids, 10))
    assert len(r._caches["x"].blocks) == 5  # 40 positions in blocks of 8
    with pytest.raises(ValueError, match="cannot start at"):
        r.forward("x", 41, [1])
    r.release("x")
    assert r.cached_length("x") == 0 and len(r) == 1


@pytest.mark.parametrize("bits", BITS)
def test_verify_matches_forward_and_batches_across_sequences(bits):
    r = FastRunner(_model(), bits=bits)
    r.forward("p", 0, [3, 4, 5, 6])
    r.forward("q", 0, [9, 10])
    rows = r.verify([VerifyCall("p", 4, [7, 8, 9], 3, full_rows=True), VerifyCall("q", 2, [11], 1, full_rows=True)])
    assert rows[0].batch == rows[1].batch == 2  # one forward for both
    alone = FastRunner(_model(), bits=bits)
    assert torch.equal(rows[0].logits, alone.forward("p", 0, [3, 4, 5, 6, 7, 8, 9], 3))
    assert torch.equal(rows[1].argmax, alone.forward("q", 0, [9, 10, 11], 1).argmax(-1))


@pytest.mark.parametrize("shape", [{}, {"num_key_value_heads": 1}, {"num_key_value_heads": 4}, {"rms_norm_eps": 1e-2},
                                   {"head_dim": 16}], ids=["gqa-2", "mqa", "mha", "eps", "head-dim"])
def test_int8_is_close_to_the_float_model(shape):
    """Also with one or as many key/value heads as query heads (grouped-query attention's extremes),
    a norm epsilon that matters and heads wider than hidden / heads (the runtime's own attention and
    norms must follow the config, not the defaults)."""
    # initializer_range: the default 1.0 is chaotic (rounding errors grow per layer)
    model = tiny_llama(3, seed=0, initializer_range=0.1, **shape)
    fast, ref = FastRunner(model, bits=8), ModelRunner(model)
    ids = list(range(2, 40))
    a, b = fast.forward("a", 0, ids, len(ids)), ref.forward("a", 0, ids, len(ids))
    err = (a - b).abs().max() / b.abs().max()
    assert err < 0.05, err
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("native", [True, False])
def test_int4_holds_weights_on_its_grid_exactly(native):
    """Weights on a 4-bit grid (as the GGUF's Q4_1 layers): the int4 runner computes the float model
    up to its rounding of activations (8 bits per group natively, bfloat16 in torch's kernel), far
    closer than 4-bit rounding of arbitrary weights would."""
    model = _on_int4_grid(tiny_llama(3, seed=0, initializer_range=0.1))
    fast, ref = FastRunner(model, bits=4), ModelRunner(model)
    ids = list(range(2, 40))
    a, b = fast.forward("a", 0, ids, len(ids)), ref.forward("a", 0, ids, len(ids))
    assert (a - b).abs().max() / b.abs().max() < 0.02
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95
    lin = model.model.layers[0].mlp.down_proj
    # exact in bfloat16 and in 8 bits per group of 32 (each group's largest is 127 steps): only the
    # kernels' output rounding is left
    ints = torch.randint(-127, 128, (3, lin.in_features // 32, 32))
    ints[..., 0] = 127
    x = (ints.float() * 2**-7).view(3, -1)
    packed = Int4Linear(lin, native=native)
    assert (packed.kernel is not None) == native  # the native kernel builds on this machine
    y, want = packed(x), lin(x)
    assert (y - want).abs().max() <= 2**-8 * want.abs().max()
    off_grid = torch.nn.Linear(lin.in_features, lin.out_features, bias=False)
    off_grid.weight.data = lin.weight.data + 0.3 * (lin.weight.data.std() * torch.randn_like(lin.weight))
    err = (Int4Linear(off_grid, native=native)(x) - off_grid(x)).abs().max()
    assert err > 4 * 2**-8 * off_grid(x).abs().max()  # weights off the grid do lose to 4-bit rounding


def test_fused_linears_equal_separate_ones_and_pad_odd_widths():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(64, 24, bias=True), torch.nn.Linear(64, 40, bias=False)  # 24 + 40 rows: padded to 16s
    x = torch.randn(5, 64)
    for cls in (Int4Linear, Int8Linear):
        fused = cls(a, b)
        y = fused(x)
        assert y.shape == (5, 64)
        assert torch.equal(y[:, :24], cls(a)(x)) and torch.equal(y[:, 24:], cls(b)(x))
    torch.testing.assert_close(Int8Linear(a)(x), a(x), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_the_fast_targets_own_output(bits, k):
    target, draft = _model(0), tiny_llama(1, seed=7)
    assert_speculation_equals_target_only(FastRunner(target, name="target", bits=bits), FastRunner(draft, name="draft", bits=bits), k)


def test_a_swapped_draft_is_requantised():
    base, other = tiny_llama(1, seed=1), tiny_llama(1, seed=2)
    r = FastRunner(base, bits=4)
    before = r.forward("s", 0, [4, 5, 6])
    r.load_state_dict({k: v.clone() for k, v in other.state_dict().items()})
    after = r.forward("s", 0, [4, 5, 6])
    assert not torch.equal(before, after)
    assert torch.equal(after, FastRunner(other, bits=4).forward("s", 0, [4, 5, 6]))


def test_choice_of_runtime_and_clear_refusals():
    model = _model()
    assert runtime_of(make_runner(model, "auto")) == "int4"
    assert runtime_of(make_runner(model, "int8")) == "int8"
    assert runtime_of(make_runner(model, "none")) == "eager-float32"

    class NotLlama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)
    odd = NotLlama()
    assert resolve_quantize("auto", odd) == "none"  # auto falls back to the eager runtime
    assert resolve_quantize("none", odd) == "none"  # asked for: no refusal
    with pytest.raises(FastPathError, match="use quantize: none"):
        resolve_quantize("int4", odd)
    with pytest.raises(FastPathError, match="not a Llama-style decoder"):
        make_runner(odd, "int4")
    with pytest.raises(FastPathError, match="4 and int8"):
        FastRunner(model, bits=2)
    assert ModelConfig().quantize == "auto"
    with pytest.raises(ValueError):
        ModelConfig(quantize="int3")


def test_int8_holds_weights_on_its_grid_exactly():
    """Symmetric int8, a scale = max |w| / 127 per group of 32 (native kernel, Q8_0) or per row
    (torch's kernel): weights whose largest in each group is 127 steps of a power-of-two step
    (exact in float16 and bfloat16) are held without loss, the extremes +-127 included, so the
    columns come back exactly: one-hot inputs (of 127 / 128 for the native kernel, whose float16
    activation scale 1 / 128 is then exact too; torch's kernel answers in bfloat16, 8 bits)."""
    g = torch.Generator().manual_seed(0)
    steps = torch.randint(-127, 128, (32, 64), generator=g).float()
    steps[:, 0], steps[::2, 1], steps[:, 32] = 127, -127, -127  # every group reaches the grid's extremes
    lin = torch.nn.Linear(64, 32, bias=False)
    lin.weight.data = steps * 2.0**-7
    x = torch.eye(64) * (127 / 128)
    assert torch.equal(Int8Linear(lin)(x), lin.weight.data.t() * (127 / 128))
    assert torch.equal(Int8Linear(lin, native=False)(torch.eye(64)), lin.weight.data.t())
    lin.weight.data[:, 32:] *= 0.5  # a group of a smaller scale: still exact per group, not per row
    assert torch.equal(Int8Linear(lin)(x), lin.weight.data.t() * (127 / 128))
    assert not torch.equal(Int8Linear(lin, native=False)(torch.eye(64)), lin.weight.data.t())


def test_a_model_without_a_head_or_with_windowed_attention_is_refused():
    headless = _model()
    del headless.lm_head
    with pytest.raises(FastPathError, match="not a Llama-style decoder"):
        FastRunner(headless)
    windowed = _model()
    windowed.config.sliding_window = 16
    with pytest.raises(FastPathError, match="sliding-window"):
        FastRunner(windowed)


def test_the_cache_grows_in_fixed_blocks_and_frees_them():
    """A sequence takes one block of the pool at a time (never doubling); interleaved growth leaves
    sequences on scattered blocks, which read back exactly as a fresh sequence computes them; a
    released sequence returns its blocks, and a full pool refuses with KVCacheFull."""
    r = FastRunner(_model(), bits=4, kv_tokens=64, block_tokens=4)
    pool = r.pool
    assert pool.num_blocks == 16 and pool.free_blocks == 16
    r.forward("x", 0, [5, 6, 7, 8])
    assert len(r._caches["x"].blocks) == 1
    r.forward("y", 0, [1, 2])
    r.forward("x", 4, [9])  # x's second block comes after y's: x is no longer contiguous
    assert len(r._caches["x"].blocks) == 2 and not r._caches["x"].contiguous
    r.forward("x", 5, list(range(10, 30)))
    assert len(r._caches["x"].blocks) == 7  # 25 positions: ceil(25 / 4) blocks, not a doubling
    assert torch.equal(r.forward("x", 25, [3]), r.forward("fresh", 0, [5, 6, 7, 8, 9, *range(10, 30), 3]))
    assert pool.bytes_per_token == 3 * 2 * 2 * 8 * 2  # layers x (k, v) x kv heads x head dim x 2 bytes
    used = pool.num_blocks - pool.free_blocks
    r.release("fresh")
    assert pool.num_blocks - pool.free_blocks == used - 7
    with pytest.raises(KVCacheFull):
        r.forward("big", 0, list(range(2, 60)))
    for s in ("x", "y", "big"):
        r.release(s)
    assert pool.free_blocks == pool.num_blocks


def test_the_kv_cache_is_stored_in_16_bits():
    for dtype, torch_dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        r = FastRunner(_model(), bits=4, kv_dtype=dtype)
        assert r.pool.kv.dtype == torch_dtype and r.pool.kv.element_size() == 2
    with pytest.raises(ValueError, match="dtype"):
        FastRunner(_model(), bits=4, kv_dtype="float64")


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_the_native_rotary_write_equals_torchs_ops_bitwise(kv_dtype):
    """The rotary embedding and pool write in one native call a layer give bitwise the logits and
    the pooled keys and values of torch's ops, over a prompt, a verify step, a cropped step and a
    batch of sequences; values around the 16-bit roundings' ties included (large activations)."""
    model = _model()
    with torch.no_grad():  # activations of every size: the 16-bit casts round many of them
        model.model.embed_tokens.weight.mul_(torch.logspace(-3, 3, 128)[:, None])
    native, ops = (FastRunner(model, bits=4, kv_dtype=kv_dtype) for _ in range(2))
    assert native.rope_kernel is not None
    ops.rope_kernel = None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 128, (5 + 7 * i,), generator=gen).tolist() for i in range(4)]
    for r in (native, ops):
        for i, p in enumerate(prompts[:3]):
            r.forward(f"s{i}", 0, p, len(p))
    calls = [ForwardCall("s0", len(prompts[0]), [7, 8, 9, 10], 4), ForwardCall("s1", len(prompts[1]) - 2, [3, 4], 2),
             ForwardCall("s3", 0, prompts[3], len(prompts[3])), ForwardCall("s2", len(prompts[2]), [11], 1)]
    for got, want in zip(native.forward_batch(calls), ops.forward_batch(calls)):
        assert torch.equal(got, want)
    for i in range(4):
        a, b = native._caches[f"s{i}"], ops._caches[f"s{i}"]
        for layer in range(3):
            assert torch.equal(a.read(layer, a.length), b.read(layer, b.length))


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_the_layers_in_one_native_call_equal_the_layer_by_layer_path_bitwise(kv_dtype):
    """The step's decoder layers in one native call (the default where it builds) give bitwise the
    logits and pooled keys and values of the layer-by-layer path: prompts, verify steps, cropped
    steps and batches of sequences; after the float weights are dropped (the norms move) too."""
    model = _model()
    fused, layered = (FastRunner(model, bits=4, kv_dtype=kv_dtype) for _ in range(2))
    assert fused._table is not None
    layered._table = None
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 128, (4 + 9 * i,), generator=gen).tolist() for i in range(4)]
    for step in range(4):
        if step == 2:
            fused.drop_float_weights()
            assert fused._table is not None
        calls = [ForwardCall(f"s{i}", 0, prompts[i], 2) if fused.cached_length(f"s{i}") == 0 else
                 ForwardCall(f"s{i}", fused.cached_length(f"s{i}") - (i + step) % 3,  # some crop rejected rows
                             torch.randint(2, 128, (1 + (i + step) % 4,), generator=gen).tolist(), 2)
                 for i in range(3 if step == 0 else 4)]  # s3 joins at the second step
        for c, g, w in zip(calls, fused.forward_batch(calls), layered.forward_batch(calls)):
            assert torch.equal(g, w), c
    one = fused.forward("s0", fused.cached_length("s0"), [7], 1)  # a decode step alone
    assert torch.equal(one, layered.forward("s0", layered.cached_length("s0"), [7], 1))
    for i in range(4):
        a, b = fused._caches[f"s{i}"], layered._caches[f"s{i}"]
        for layer in range(3):
            assert torch.equal(a.read(layer, a.length), b.read(layer, b.length))


def test_the_native_activation_is_silu_times_up_and_the_same_at_any_width():
    """silu(gate) * up within a few ulps of torch's (another exp), each element the same whichever
    width and row it is computed in (the tail padded, not a scalar loop); rows it cannot read refused."""
    from speculative.fused import load_silu, silu_mul

    kernel = load_silu()
    assert kernel is not None
    g = torch.Generator().manual_seed(7)
    gu = torch.randn(3, 2 * 21, generator=g) * 6  # I = 21: two vectors of 8 and a tail of 5
    act = silu_mul(kernel, gu, 21)
    want = torch.nn.functional.silu(gu[:, :21]) * gu[:, 21:]
    assert torch.allclose(act, want, rtol=4e-7, atol=1e-7)
    wider = torch.cat([gu[:, :21], gu[:, :3], gu[:, 21:], gu[:, 21:24]], 1)  # the same elements at width 24
    assert torch.equal(silu_mul(kernel, wider, 24)[:, :21], act)
    strided = torch.cat([gu, gu], 1)[:, :42]  # rows 84 apart
    assert torch.equal(silu_mul(kernel, strided, 21), act)
    for bad in (gu.double(), gu[:, :40], gu.t().contiguous().t()):
        with pytest.raises(ValueError):
            silu_mul(kernel, bad, 21)


def test_a_copy_of_a_runner_runs_its_layers_on_its_own_pool():
    """The one call reads a table of addresses: a copy (an engine's draft, copied from its start with
    the packed base shared) builds its own, so it writes its own pool and leaves the original's."""
    import copy

    r = FastRunner(_model(), bits=4)
    ids = torch.randint(2, 128, (10,), generator=torch.Generator().manual_seed(6)).tolist()
    want = r.forward("a", 0, ids, 3)
    kv = r.pool.kv.clone()
    c = copy.deepcopy(r, r.share_memo())
    assert c._table is not None and not torch.equal(c._table, r._table)
    assert c.layers[0][1].weight.data_ptr() == r.layers[0][1].weight.data_ptr()  # the packed base shared
    # (bit patterns: slots never written hold whatever the allocator gave, NaN patterns included)
    assert torch.equal(c.forward("b", 0, ids, 3), want) and torch.equal(r.pool.kv.view(torch.int16), kv.view(torch.int16))
    assert torch.equal(c.forward("a", 0, ids, 3), want) and torch.equal(r.forward("a2", 0, ids, 3), want)


def test_the_one_call_path_steps_aside_for_what_it_does_not_cover():
    """Adapters, 8-bit projections and a missing kernel keep the layer-by-layer path (no table);
    features asked of the target are computed by it too, with the same logits as the one call."""
    from speculative.adapters import add_adapters

    assert FastRunner(add_adapters(_model(), 4), bits=4)._table is None
    assert FastRunner(_model(), bits=8)._table is None
    no_kernel = FastRunner(_model(), bits=4, native=False)
    assert no_kernel._table is None and no_kernel.silu_kernel is None
    for norm in ("input_layernorm", "post_attention_layernorm"):  # one norm of another epsilon: the call takes one for all
        odd = _model()
        getattr(odd.model.layers[1], norm).variance_epsilon = 1e-3
        assert FastRunner(odd, bits=4)._table is None
        wide = _model()  # a norm's weight the call would misread (float64)
        getattr(wide.model.layers[2], norm).weight.data = getattr(wide.model.layers[2], norm).weight.data.double()
        assert FastRunner(wide, bits=4)._table is None
    r = FastRunner(_model(), bits=4)
    ids = torch.randint(2, 128, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    logits, feats = r.forward_batch_features([ForwardCall("f", 0, ids, 3)], layers=(1,))
    assert torch.equal(logits[0], r.forward("g", 0, ids, 3)) and feats[0].shape == (12, 2 * 32)
    table = r._table
    with r.layer_by_layer():  # what the profiler times kernel by kernel
        assert r._table is None and torch.equal(r.forward("h", 0, ids, 3), logits[0])
    assert r._table is table


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_native_pool_write_rounds_ties_to_even_as_torchs_cast(dtype):
    """Keys and values exactly halfway between two 16-bit values (and NaN, infinities, tiny and
    huge numbers, signed zeros) are rotated and written bitwise as torch's ops and cast write them."""
    from speculative.attend import load_rope, rope_kv
    from speculative.fast import _rope

    kernel = load_rope()
    assert kernel is not None
    D, Hq, Hkv = 16, 1, 1
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)  # half a 16-bit step at 1.0
    vals = torch.tensor([1 + ulp, 1 + 3 * ulp, -(1 + ulp), 2 + 2 * ulp, 1e-30, -1e-30, 65504.0, 70000.0,
                         1 + 5 * ulp, -(1 + 7 * ulp), 3 + 6 * ulp, 0.0, -0.0, 3.0e38, 1 + ulp / 2, 1 + 1.5 * ulp])
    heads = torch.stack([torch.stack([vals, vals, vals]), torch.stack([vals, vals.flip(0), vals.roll(3)])])  # [2, 3, D]
    heads[1, 2, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])  # values only: no rotation spreads them
    g = torch.Generator().manual_seed(0)
    cos, sin = torch.ones(2, D), torch.zeros(2, D)
    cos[1], sin[1] = torch.rand(D, generator=g), torch.rand(D, generator=g)
    rotated = _rope(heads[:, : Hq + Hkv].clone(), cos[:, None], sin[:, None])  # torch's ops: the reference
    want = {"q": rotated[:, 0], "k": rotated[:, 1].to(dtype), "v": heads[:, 2].to(dtype)}
    kv = torch.zeros(2, Hkv, 4, D, dtype=dtype)
    rope_kv(kernel, heads, cos, sin, kv, torch.tensor([3, 1]))

    def same(a, b):  # bit for bit, NaN for NaN
        bits = torch.int16 if a.element_size() == 2 else torch.int32
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()].view(bits), b[~b.isnan()].view(bits))

    assert same(heads[:, 0], want["q"])
    for row, slot in ((0, 3), (1, 1)):
        assert same(kv[0, 0, slot], want["k"][row]) and same(kv[1, 0, slot], want["v"][row])


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
def test_a_bias_is_added_to_the_packed_product(cls):
    torch.manual_seed(0)
    a = torch.nn.Linear(64, 32, bias=True)
    plain = torch.nn.Linear(64, 32, bias=False)
    plain.weight.data = a.weight.data.clone()
    x = torch.randn(3, 64)
    assert torch.equal(cls(a)(x), cls(plain)(x) + a.bias.detach())


def test_a_draft_head_may_take_four_bits_and_nothing_else():
    model = _model()
    assert isinstance(FastRunner(model, head_bits=4).head, Int4Linear)
    assert isinstance(FastRunner(model).head, Int8Linear)  # a target's head stays in 8 bits
    for bad in (3, 5):
        with pytest.raises(FastPathError, match="4 and int8"):
            FastRunner(model, head_bits=bad)


def test_int4_packs_every_layer_whose_width_allows_groups_of_32():
    """bits=4: every decoder linear whose input width is a multiple of 32 in 4 bits, others in 8;
    bits=8: all in 8. tiny_llama's widths are 64 (hidden) and 128 (MLP): all int4."""
    kinds = lambda r: {type(m) for layer in r.layers for m in layer if isinstance(m, (Int4Linear, Int8Linear))}
    model = _model()
    assert kinds(FastRunner(model, bits=4)) == {Int4Linear}
    assert kinds(FastRunner(model, bits=8)) == {Int8Linear}
    odd = tiny_llama(1, seed=0, hidden_size=48, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1)
    packed = FastRunner(odd, bits=4).layers[0]
    # qkv, o_proj and gate/up read 48 inputs (8 bits), down_proj reads 96 (4 bits)
    assert [type(m) for m in packed if isinstance(m, (Int4Linear, Int8Linear))] == [Int8Linear] * 3 + [Int4Linear]


def test_bytes_per_cached_token_follow_the_runtime():
    """What `osd profile` and /metrics report: 16-bit keys and values on the fast path, the model's
    dtype on Hugging Face eager; SmolLM2-135M's shape (30 layers, 3 KV heads of 64) costs 23,040 bytes."""
    from transformers import LlamaConfig

    from speculative.kvcache import kv_bytes_per_token

    tiny = _model().config
    assert kv_bytes_per_token(tiny, "int4") == 3 * 2 * 2 * 8 * 2 == FastRunner(_model()).kv_bytes_per_token
    assert kv_bytes_per_token(tiny, "none") == 3 * 2 * 2 * 8 * 4
    smol = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert kv_bytes_per_token(smol, "int4", "bfloat16") == 23_040
    assert kv_bytes_per_token(smol, "none", eager_dtype="bfloat16") == 23_040


def test_a_long_call_attends_in_chunks_of_queries_and_equals_token_by_token(monkeypatch):
    """Torch attention: a prompt longer than ATTEND_ROWS attends a chunk of queries at a time (bounded memory): its
    rows equal decoding the same tokens one by one."""
    import speculative.fast as fast

    monkeypatch.setattr(fast, "ATTEND_ROWS", 8)
    r = FastRunner(_model(), bits=4)
    r.attention_kernel = None  # the torch attention (the native kernel reads the pool row by row)
    ids = torch.randint(2, 128, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    softmax, rows = torch.softmax, []
    monkeypatch.setattr(torch, "softmax", lambda x, dim: rows.append(x.shape[-2]) or softmax(x, dim=dim))
    whole = r.forward("a", 0, ids, len(ids))  # 4 chunks of queries
    monkeypatch.setattr(torch, "softmax", softmax)
    assert max(rows) == 2 * 8  # query heads per KV head x ATTEND_ROWS: never the whole prompt's 2 x 30
    one = [r.forward("c", 0, ids[:1])[0]] + [r.forward("c", i, [ids[i]])[0] for i in range(1, len(ids))]
    assert torch.equal(whole, torch.stack(one))


def test_a_target_that_drops_its_float_weights_computes_the_same_and_takes_no_new_ones():
    model = tiny_llama(2, seed=0)
    runner = FastRunner(model, bits=4)
    ids = torch.randint(2, 128, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    before = runner.forward("a", 0, ids, 20)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    assert runner.drop_float_weights() > 0
    assert model.model.layers[0].mlp.gate_proj.weight.numel() == 0
    assert torch.equal(runner.forward("b", 0, ids, 20), before)
    with pytest.raises(RuntimeError, match="dropped"):
        runner.load_state_dict(whole)


def test_dropping_the_float_weights_lets_go_of_the_loaders_file_mapping(tmp_path):
    """A model loaded from safetensors lives on a mapping of the file, every read page of which is
    resident while any tensor is on it: after the drop no tensor is, so the mapping is gone."""
    import gc

    from transformers import AutoModelForCausalLM

    _model().save_pretrained(tmp_path)
    weights = str(tmp_path / "model.safetensors")

    def mapped() -> bool:
        return weights in open("/proc/self/maps").read()

    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    runner = FastRunner(model, bits=4)
    gc.collect()
    assert mapped()  # the loader's mapping, held by the float weights
    ids = list(range(2, 22))
    before = runner.forward("a", 0, ids, 20)
    runner.drop_float_weights()
    gc.collect()
    assert not mapped()
    assert torch.equal(runner.forward("b", 0, ids, 20), before)  # embeddings and norms kept, copied


def test_small_calls_attend_in_groups_bounded_in_key_positions_with_the_same_rows(monkeypatch):
    """Torch attention: decode steps of sequences with long contexts attend in groups of at most ATTEND_POSITIONS
    key positions (the float64 keys and values gathered stay bounded, not sequences x context):
    each group's product holds at most that many, and every row equals the ungrouped step's."""
    import speculative.fast as fast
    from speculative.runner import ForwardCall

    assert fast._groups([0, 1, 2, 3], [10, 30, 20, 5], 60) == [[0, 1], [2, 3]]  # 2 x 30 fits; 3 x 30 does not
    assert fast._groups([4, 5], [100, 3], 60) == [[4], [5]]  # longer than the budget: a group of its own
    r = FastRunner(_model(), bits=4)
    r.attention_kernel = None  # the torch attention (the native kernel reads the pool row by row)
    gen = torch.Generator().manual_seed(7)
    contexts = {f"s{i}": torch.randint(2, 128, (n,), generator=gen).tolist() for i, n in enumerate((40, 25, 33, 12, 18))}
    for sid, ids in contexts.items():
        r.forward(sid, 0, ids)

    def step(budget: int) -> tuple[list[torch.Tensor], list[int]]:
        monkeypatch.setattr(fast, "ATTEND_POSITIONS", budget)
        softmax, widths = torch.softmax, []
        monkeypatch.setattr(torch, "softmax", lambda x, dim: widths.append(x.shape[0] * x.shape[-1]) or softmax(x, dim=dim))
        calls = [ForwardCall(sid, len(ids), [3, 4], 2) for sid, ids in contexts.items()]  # 2 new tokens each
        out = r.forward_batch(calls)
        monkeypatch.setattr(torch, "softmax", softmax)
        return out, widths  # (the step again writes the same positions over)

    whole, one_group = step(10_000)
    assert max(one_group) == 5 * 42  # one group a layer: 5 sequences x the longest context
    grouped, widths = step(84)
    assert max(widths) <= 84 and len(widths) >= 3 * len(one_group)  # 5 sequences in 3 groups or more
    for a, b in zip(whole, grouped):
        assert torch.equal(a, b)
