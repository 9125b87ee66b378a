"""The native attention kernel over the paged KV pool (speculative/attend.py, csrc/attend.c):
against a float64 reference, row by row whatever shares the call, in 16-bit pools of both kinds,
through the fast runner, and the torch attention where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import tiny_llama
from speculative import native
from speculative.attend import PagedAttention, load_kernel
from speculative.fast import FastRunner
from speculative.kvcache import BlockPool
from speculative.qmatmul import load_q4, load_q8, load_rms

Hq, Hkv, D = 6, 2, 16


class _Cache:  # what PagedAttention reads of a sequence's cache: its slot table
    def __init__(self, slots):
        self.slots = slots


class _Call:
    def __init__(self, start, n):
        self.start, self.tokens = start, [0] * n


def _reference(q, kv, slots, start, n):
    """Causal attention of n queries at positions start.. over the pool slots, in float64."""
    k, v = kv[0][:, slots[: start + n]].double(), kv[1][:, slots[: start + n]].double()  # [Hkv, L, D]
    out = []
    for t in range(n):
        qt = q[t].double().view(Hkv, Hq // Hkv, D)  # [Hkv, g, D]
        s = qt @ k[:, : start + t + 1].transpose(1, 2) * D**-0.5  # [Hkv, g, L_t]
        out.append((torch.softmax(s, -1) @ v[:, : start + t + 1]).reshape(Hq * D))
    return torch.stack(out)


def _setup(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = BlockPool(1, Hkv, D, 512, block_tokens=8, dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(pool.kv.dtype))
    shapes = [(0, 20), (37, 1), (12, 5), (60, 3), (5, 1)]  # (cached, new) per call: prefill, decode, verify
    blocks = torch.randperm(pool.num_blocks, generator=g)
    caches, used = [], 0
    for start, n in shapes:
        nb = -(-(start + n) // 8)
        b = blocks[used : used + nb]
        used += nb
        caches.append(_Cache((b[:, None] * 8 + torch.arange(8)).reshape(-1)))
    q = torch.randn(sum(n for _, n in shapes), Hq + Hkv, D, generator=g)[:, :Hq]  # strided rows, as the runner's
    return pool, shapes, caches, q


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kernel_equals_a_float64_reference_and_each_row_is_the_same_alone(dtype):
    kernel = load_kernel()
    assert kernel is not None
    pool, shapes, caches, q = _setup(dtype)
    calls = [_Call(s, n) for s, n in shapes]
    plan = PagedAttention(kernel, calls, caches, [n for _, n in shapes], Hq, Hkv, D)
    out = plan.attend(q, pool.kv[0])  # [R, Hq*D]
    row = 0
    for (start, n), cache in zip(shapes, caches):
        ref = _reference(q[row : row + n], pool.kv[0], cache.slots, start, n)
        torch.testing.assert_close(out[row : row + n].double(), ref, rtol=1e-6, atol=1e-6)
        alone = PagedAttention(kernel, [_Call(start, n)], [cache], [n], Hq, Hkv, D).attend(q[row : row + n], pool.kv[0])
        assert torch.equal(alone, out[row : row + n])  # bitwise: nothing else in the call changes a row
        for t in range(n):  # and a verify's row is the decode step's row at that position
            one = PagedAttention(kernel, [_Call(start + t, 1)], [cache], [1], Hq, Hkv, D).attend(q[row + t : row + t + 1], pool.kv[0])
            assert torch.equal(one, out[row + t : row + t + 1])
        row += n


def test_kernel_rows_do_not_depend_on_the_thread_count():
    kernel = load_kernel()
    pool, shapes, caches, q = _setup("float16", seed=3)
    calls, lens = [_Call(s, n) for s, n in shapes], [n for _, n in shapes]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = PagedAttention(kernel, calls, caches, lens, Hq, Hkv, D).attend(q, pool.kv[0])
        torch.set_num_threads(2)
        two = PagedAttention(kernel, calls, caches, lens, Hq, Hkv, D).attend(q, pool.kv[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_fast_runner_attends_through_the_kernel(monkeypatch):
    r = FastRunner(tiny_llama(2, seed=0), bits=4)
    assert r.attention_kernel is load_kernel() is not None
    r._table = None  # the layer-by-layer path, whose calls can be counted (the one call runs the same kernel from C)
    used = []
    real = PagedAttention.attend
    monkeypatch.setattr(PagedAttention, "attend", lambda self, *a, **k: used.append(self.R) or real(self, *a, **k))
    r.forward("a", 0, list(range(3, 23)), 1)
    assert used == [20, 20]  # one call a layer, every prompt row


def test_without_a_compiler_the_torch_attention_serves(monkeypatch, tmp_path, caplog):
    load_q4(), load_q8(), load_rms()  # the other kernels loaded before: only the attention goes without
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert load_kernel() is None
        assert "attention kernel unavailable" in caplog.text
        r = FastRunner(tiny_llama(2, seed=0), bits=4)
        assert r.attention_kernel is None
        ids = list(range(3, 23))
        whole = r.forward("a", 0, ids, len(ids))
    finally:
        monkeypatch.undo()  # the compiler and cache dir back, and the next caller builds (or finds) the kernel
        load_kernel.cache_clear()
    k = FastRunner(tiny_llama(2, seed=0), bits=4)  # the kernel again: the same logits to float32 rounding
    assert k.attention_kernel is not None
    torch.testing.assert_close(k.forward("a", 0, ids, len(ids)), whole, rtol=1e-5, atol=1e-5)


def test_a_copied_or_pickled_runner_keeps_the_one_loaded_kernel():
    import copy
    import pickle

    r = FastRunner(tiny_llama(2, seed=0), bits=4)
    assert copy.deepcopy(r).attention_kernel is r.attention_kernel is load_kernel()  # engines deep-copy their drafts
    assert pickle.loads(pickle.dumps(r.attention_kernel)) is load_kernel()
