"""Attention over the paged KV pool in one native call per layer (``csrc/attend.c``).

The fast path's torch attention gathers every sequence's keys and values out of the pool, widens
them to float64 (two copies), pads the batch to its longest context and runs batched products:
at 8 sequences that was half of the engine loop's time (``py-spy`` on ``python -m
bench.loop_concurrency``). The kernel reads the 16-bit pool in place through each sequence's slot
table and computes each (query row, key-value head) wholly, in double precision, in one fixed
order, on torch's own OpenMP threads. Each row reads exactly its own keys (no padding), so a row's
output is bitwise the same whether it is decoded alone, verified with k others, prefilled in a
chunk or batched with other sequences: the exactness the fast path rests on holds by
construction, not only to the last bit of a float64 sum.

The kernel is compiled once per machine (:mod:`speculative.native`). Where that fails,
:func:`load_kernel` logs why once and returns None, and the runner keeps the torch attention.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from .native import Kernel, load


@lru_cache(maxsize=1)
def load_kernel() -> Kernel | None:
    """The compiled kernel (:mod:`speculative.native`), or None where it cannot be built."""
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return load("attend.c", "osd_attend", [P, INT, I64, INT, INT, P, I64, INT, P, P, P, P, I64, ctypes.c_double, P, I64, INT],
                "attention kernel", load_kernel, libs=("-lmvec",))


SUB = 8  # rows of one sequence the kernel takes together (csrc/attend.c)


class PagedAttention:
    """One forward's attention through the kernel: each call's slot table, and each query row's
    position and table, computed once for all layers."""

    def __init__(self, kernel, calls, caches, lens, Hq: int, Hkv: int, D: int):
        self.kernel, self.Hq, self.Hkv, self.D = kernel, Hq, Hkv, D
        ends = [c.start + n for c, n in zip(calls, lens)]  # cached positions after each call
        self.slots = torch.cat([cache.slots[:end] for cache, end in zip(caches, ends)]).contiguous()  # [sum ends]
        table = torch.tensor([0] + ends[:-1]).cumsum(0)  # [B] where each call's table starts
        self.off = torch.repeat_interleave(table, torch.tensor(lens))  # [R]
        self.pos = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(calls, lens)])  # [R]
        self.R = int(self.pos.numel())
        self.work_stride = SUB * (Hq // Hkv) * (max(ends) + 2 * D)  # scores, queries, sums (csrc/attend.c)
        self.threads = torch.get_num_threads()
        self.work = torch.empty(self.threads * self.work_stride, dtype=torch.float64)

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, read=None) -> torch.Tensor:
        """q: [R, Hq, D] float32 (rows may be strided, heads contiguous); kv_layer: the pool's
        [2, Hkv, slots, D] in 16 bits (this layer's new rows written) -> [R, Hq*D] float32.
        ``read``: unused (the torch plan's way to a call's keys and values)."""
        Hq, Hkv, D = self.Hq, self.Hkv, self.D
        if q.stride(2) != 1 or q.stride(1) != D or not kv_layer.is_contiguous():
            raise ValueError("attention kernel: q must have contiguous heads and the pool layer must be contiguous")
        out = torch.empty(self.R, Hq * D)
        rc = self.kernel(kv_layer.data_ptr(), int(kv_layer.dtype == torch.bfloat16), kv_layer.shape[2], Hkv, D,
                         q.data_ptr(), q.stride(0), Hq, out.data_ptr(), self.slots.data_ptr(), self.off.data_ptr(),
                         self.pos.data_ptr(), self.R, D**-0.5, self.work.data_ptr(), self.work_stride, self.threads)
        if rc != 0:
            raise ValueError(f"attention kernel refused the shapes (Hq {Hq}, Hkv {Hkv}, D {D})")
        return out


@lru_cache(maxsize=1)
def load_rope() -> Kernel | None:
    """The compiled rotary embedding and pool write (``csrc/rope.c``), or None where it cannot be built."""
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return load("rope.c", "osd_rope_kv", [P, I64, I64, INT, INT, INT, P, P, P, INT, I64, P], "rotary kernel", load_rope)


def rope_kv(kernel: Kernel, heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
            slots: torch.Tensor) -> None:
    """Rotate the query and key heads of ``heads`` [R, Hq + 2 Hkv, D] float32 (rows may be strided,
    heads contiguous) in place by ``cos``, ``sin`` [R, D] float32, and write each row's key and
    value heads to ``slots`` [R] (int64) of the pool layer ``kv_layer`` [2, Hkv, S, D] (16 bits):
    bitwise what :func:`speculative.fast._rope` and the pool's indexed write give."""
    Hkv, S, D = kv_layer.shape[1], kv_layer.shape[2], kv_layer.shape[3]
    R, H = heads.shape[0], heads.shape[1]
    if (heads.dtype != torch.float32 or heads.stride(2) != 1 or heads.stride(1) != D or not kv_layer.is_contiguous()
            or kv_layer.element_size() != 2 or not (cos.is_contiguous() and sin.is_contiguous())
            or cos.shape != (R, D) or slots.dtype != torch.long or slots.numel() != R):
        raise ValueError("rotary kernel: float32 heads of contiguous values, [R, D] cos and sin, a 16-bit pool layer")
    slots = slots.contiguous()
    rc = kernel(heads.data_ptr(), heads.stride(0), R, H - 2 * Hkv, Hkv, D, cos.data_ptr(), sin.data_ptr(),
                kv_layer.data_ptr(), int(kv_layer.dtype == torch.bfloat16), S, slots.data_ptr())
    if rc != 0:
        raise ValueError(f"rotary kernel refused the head size {D}")
