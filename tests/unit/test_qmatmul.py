"""The native int4 / int8 matmul kernels (speculative/qmatmul.py, csrc/qmm.c): the packed layout,
products against a float64 emulation of the same rounding, row by row whatever shares the call, on
any thread count and on the AVX2 path as on AVX-512, through the linear layers, and torch's kernels
where they cannot be built."""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch

from speculative import native, qmatmul
from speculative.fast import FastRunner, Int4Linear, Int8Linear
from speculative.qmatmul import (load_q4, load_q8, load_rms, pack_q4, pack_q8, q4_mm, q8_mm, rms_norm, unpack_q4,
                                 unpack_q8)

from conftest import tiny_llama


def _q4_weights(N: int, K: int, seed: int = 0):
    """q [N, K] in 0..15, scale and minimum [N, K/32] exact in float16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    scale = (torch.rand(N, K // 32, generator=g) * 0.01 + 0.001).half().float()
    lo = (-8 * scale + torch.randn(N, K // 32, generator=g) * 0.001).half().float()
    return q, scale, lo


def _q8_weights(N: int, K: int, seed: int = 0):
    """Q8_0 weights as the GGUF holds them: q [N, K] int8, each group's largest |q| 127, and the
    group scales d [N, K/32] exact in float16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-126, 127, (N, K // 32, 32), generator=g)
    q[..., 5] = torch.where(torch.rand(N, K // 32, generator=g) < 0.5, -127, 127)
    d = (torch.rand(N, K // 32, generator=g) * 0.02 + 0.001).half().float()
    return q.view(N, K).to(torch.int8), d


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] rounded as the kernels round it, like llama.cpp's Q8_1: (integers [M, K/32, 32],
    group scales [M, K/32] and scale times the integers' sum [M, K/32])."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    ints = torch.where(amax > 0, torch.round(g * (127 / amax)), torch.zeros_like(g))
    xs = (amax / 127)[..., 0]
    return ints, xs, xs * ints.sum(-1)


def _emulated(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' product in float64: per group, the exact integer dot product times d xs (plus
    the minimum times xsum for 4 bits)."""
    ints, xs, xsum = _rounded(x)
    qg = q.double().view(q.shape[0], -1, 32)  # [N, G, 32]
    dots = torch.einsum("mgi,ngi->mng", ints.double(), qg)  # [M, N, G], exact
    y = (dots * d.double()[None] * xs.double()[:, None]).sum(-1)
    if m is not None:
        y = y + (m.double()[None] * xsum.double()[:, None]).sum(-1)
    return y


def test_packing_keeps_every_weight():
    q, scale, lo = _q4_weights(32, 96)
    wq, dm = pack_q4(q, scale, lo)
    assert wq.dtype == torch.uint8 and wq.numel() == 32 * 96 // 2  # two weights a byte
    want = (q.float().view(32, 3, 32) * scale[..., None] + lo[..., None]).view(32, 96)
    assert torch.equal(unpack_q4(wq, dm), want)
    w, d = _q8_weights(16, 64)
    w8, wsum, d8 = pack_q8(w, d)
    assert wsum.dtype == torch.int32 and w8.dtype == torch.int8 and d8.dtype == torch.float16  # the kernel reads 32-bit sums
    assert torch.equal(unpack_q8(w8, d8), (w.float().view(16, 2, 32) * d[..., None]).view(16, 64))


@pytest.mark.parametrize("M", [1, 3, 4, 9])
def test_q4_equals_the_product_with_the_rounded_rows(M):
    """The kernel computes W x' for x' = x rounded to 8 bits a group: to float32 accumulation."""
    q, scale, lo = _q4_weights(48, 160, seed=M)
    wq, dm = pack_q4(q, scale, lo)
    x = torch.randn(M, 160) * torch.rand(M, 160) ** 3 * 4  # heavy tails, as activations have
    want = _emulated(x, q, scale, lo)
    got = q4_mm(load_q4(), wq, dm, x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert ((got - x.double() @ unpack_q4(wq, dm).double().t()).abs().max() / want.abs().max()).item() > 1e-4  # it does round


@pytest.mark.parametrize("M", [1, 5])
def test_q8_equals_the_product_with_the_rounded_rows(M):
    w, d = _q8_weights(48, 160, seed=M)
    x = torch.randn(M, 160) * torch.rand(M, 160) ** 3 * 4
    want = _emulated(x, w, d)
    got = q8_mm(load_q8(), *pack_q8(w, d), x)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    # each group's own scale is used: one scale a row (the largest) gives other numbers
    per_row = _emulated(x, w, d.amax(1, keepdim=True).expand_as(d))
    assert ((got - per_row).abs().max() / want.abs().max()).item() > 1e-2


def test_a_group_too_small_for_float16s_steps_is_clamped_never_wrapped():
    """A group whose scale amax / 127 is a float16 subnormal rounds that scale down (here 1.4 steps of
    2^-24 to 1), so amax / scale passes 127: its weights are clamped to +-127 steps, never wrapped
    around int8 (a 128 would come back as -128), and a group of zeros stays zeros."""
    tiny = 127 * 1.4 * 2.0**-24
    lin = torch.nn.Linear(64, 16, bias=False)
    w = torch.zeros(16, 64)
    w[:, :32] = torch.linspace(-tiny, tiny, 32)  # the second group all zeros
    lin.weight.data = w
    packed = Int8Linear(lin)
    got = unpack_q8(packed.weight, packed.scale)
    d = torch.tensor(2.0**-24)
    assert torch.equal(got[:, :32], (w[:, :32] / d).round().clamp(-127, 127) * d)
    assert got[0, 0] < 0 < got[0, 31] and torch.equal(got[:, 32:], torch.zeros(16, 32))


def test_q8_is_exact_on_its_grid():
    """Rows already on the 8-bit grid (each group's largest 127 steps of a power of two) and integer
    weights: every product is exact."""
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)
    ints = torch.randint(-127, 128, (5, 2, 32), generator=g)
    ints[..., 0] = -127
    x = (ints.float() * 2**-6).view(5, 64)
    got = q8_mm(load_q8(), *pack_q8(w, torch.full((32, 2), 0.5)), x)
    assert torch.equal(got, (x.double() @ w.double().t() * 0.5).float())


def test_the_head_holds_the_ggufs_q8_0_weights_exactly():
    """An 8-bit linear made from Q8_0 weights as transformers dequantises them (d q, float32) packs
    back the same integers and scales: the served head is the GGUF's, not a rounding of it."""
    w, d = _q8_weights(40, 96, seed=4)
    lin = torch.nn.Linear(96, 40, bias=False)
    lin.weight.data = (w.float().view(40, 3, 32) * d[..., None]).view(40, 96)
    packed = Int8Linear(lin)
    assert packed.kernel is not None
    assert torch.equal(unpack_q8(packed.weight, packed.scale)[:40], lin.weight.data)
    x = torch.randn(3, 96)
    assert torch.equal(packed(x), q8_mm(load_q8(), *pack_q8(torch.cat([w, w.new_zeros(8, 96)]),
                                                           torch.cat([d, d.new_ones(8, 3)])), x)[:, :40])


def test_a_row_is_the_same_whatever_shares_the_call_and_on_any_thread_count():
    q, scale, lo = _q4_weights(64, 128, seed=3)
    wq, dm = pack_q4(q, scale, lo)
    w8 = pack_q8(*_q8_weights(64, 128, seed=3))
    x = torch.randn(13, 128)
    for f in (lambda x: q4_mm(load_q4(), wq, dm, x), lambda x: q8_mm(load_q8(), *w8, x)):
        whole = f(x)
        for lo_, hi in ((0, 1), (3, 4), (5, 12), (12, 13)):
            assert torch.equal(f(x[lo_:hi]), whole[lo_:hi])
        assert torch.equal(f(x[::2]), whole[::2])  # strided rows
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(f(x), whole)
        finally:
            torch.set_num_threads(before)


def test_the_avx2_path_computes_the_same_numbers(tmp_path, monkeypatch):
    """The kernels built without AVX-512 (what an AVX2-only machine runs) give bitwise the same
    outputs: the served model does not depend on the instruction set."""
    if "avx512_vnni" not in native._cpu_flags().split():
        pytest.skip("this machine builds the AVX2 path already")
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ["-mno-avx512f"])
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    P, I64 = qmatmul.ctypes.c_void_p, qmatmul.ctypes.c_int64
    q4 = native.load("qmm.c", "osd_q4_mm", [P, P, I64, I64, P, I64, I64, P, P, qmatmul.ctypes.c_int], "avx2", None)
    q8 = native.load("qmm.c", "osd_q8_mm", [P, P, P, I64, I64, P, I64, I64, P, P, qmatmul.ctypes.c_int], "avx2", None)
    assert q4 is not None and q8 is not None
    q, scale, lo = _q4_weights(32, 256, seed=5)
    wq, dm = pack_q4(q, scale, lo)
    w8 = pack_q8(*_q8_weights(32, 256, seed=5))
    x = torch.randn(7, 256) * 3
    assert torch.equal(q4_mm(q4, wq, dm, x), q4_mm(load_q4(), wq, dm, x))
    assert torch.equal(q8_mm(q8, *w8, x), q8_mm(load_q8(), *w8, x))


def test_the_layers_use_the_kernels_and_keep_torch_a_flag_away():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 40, bias=True)
    x = torch.randn(4, 64)
    for cls in (Int4Linear, Int8Linear):
        fast, torch_kernel = cls(lin), cls(lin, native=False)
        assert fast.kernel is not None and torch_kernel.kernel is None
        a, b = fast(x), torch_kernel(x)
        assert a.shape == b.shape == (4, 40)
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)  # two roundings of the same layer
        assert not torch.equal(a, b)
    r = FastRunner(tiny_llama(2, seed=0), bits=4, native=False)
    assert all(m.kernel is None for layer in r.layers for m in layer if isinstance(m, (Int4Linear, Int8Linear)))
    assert r.head.kernel is None


def test_rows_of_the_wrong_width_are_refused():
    q, scale, lo = _q4_weights(16, 64)
    wq, dm = pack_q4(q, scale, lo)
    with pytest.raises(ValueError, match="64 inputs"):
        q4_mm(load_q4(), wq, dm, torch.randn(2, 32))
    with pytest.raises(ValueError, match="64 inputs"):
        q8_mm(load_q8(), *pack_q8(torch.ones(16, 64, dtype=torch.int8), torch.ones(16, 2)), torch.randn(2, 96))


def test_copies_and_pickles_keep_the_one_loaded_kernel():
    layer = Int4Linear(torch.nn.Linear(64, 32))
    assert copy.deepcopy(layer).kernel is layer.kernel is load_q4()
    assert pickle.loads(pickle.dumps(layer.kernel)) is load_q4()
    assert pickle.loads(pickle.dumps(Int8Linear(torch.nn.Linear(64, 32)).kernel)) is load_q8()


def test_without_a_compiler_torchs_kernels_serve(monkeypatch, tmp_path, caplog):
    from speculative.attend import load_kernel, load_rope
    from speculative.fused import load_layers, load_silu

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    # every loader the runner calls: one left holding None would leave later tests without its kernel
    loaders = (load_q4, load_q8, load_rms, load_kernel, load_rope, load_layers, load_silu)
    for f in loaders:
        f.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert load_q4() is None and load_q8() is None
        assert "int4 matmul kernel unavailable" in caplog.text
        r = FastRunner(tiny_llama(2, seed=0), bits=4)
        assert all(m.kernel is None for layer in r.layers for m in layer if isinstance(m, Int4Linear))
        assert r.rms_kernel is None
        logits = r.forward("a", 0, list(range(3, 23)), 20)
    finally:
        monkeypatch.undo()
        for f in loaders:
            f.cache_clear()
    assert torch.equal(logits, FastRunner(tiny_llama(2, seed=0), bits=4, native=False).forward("a", 0, list(range(3, 23)), 20))
    assert Int4Linear(torch.nn.Linear(64, 32)).kernel is not None  # and built again afterwards


def test_the_native_rms_norm_matches_torchs_row_by_row():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(11, 96, generator=g) * 3, torch.rand(96, generator=g) + 0.5
    got = rms_norm(load_rms(), x, w, 1e-5)
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (96,), w, 1e-5), rtol=1e-6, atol=1e-6)
    assert torch.equal(rms_norm(load_rms(), x[3:4], w, 1e-5), got[3:4])  # alone as in the batch
    wide = torch.randn(11, 200, generator=g)
    wide[:, :96] = x
    assert torch.equal(rms_norm(load_rms(), wide[:, :96], w, 1e-5), got)  # strided rows
    with pytest.raises(ValueError, match="float32"):
        rms_norm(load_rms(), x.double(), w, 1e-5)
