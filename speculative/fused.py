"""The fast path's decoder layers in one native call a step (``csrc/layer.c``), and the gated
activation both of its paths use.

A decode step of SmolLM2-135M on the layer-by-layer path spends about as long in the ~20 Python
and torch calls a layer around the native kernels as in the kernels' own work (docs/fast.md,
"Where a step's time goes now"). :func:`run_layers` calls the same kernels in the same order on
the same buffers from C, so a step's rows are bitwise those of the layer-by-layer path (tested),
which still serves whatever the one call does not cover: adapters, biases, features asked of
the target, rows of several drafts in one forward.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from .native import Kernel, load


@lru_cache(maxsize=1)
def load_silu() -> Kernel | None:
    """The native gated activation (``osd_silu_mul``), or None where it cannot be built."""
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    return load("layer.c", "osd_silu_mul", [P, I64, I64, I64, P], "activation kernel", load_silu, libs=("-lmvec",))


@lru_cache(maxsize=1)
def load_layers() -> Kernel | None:
    """The native decoder layers (``osd_layers``), or None where they cannot be built."""
    P, I64, INT, DBL = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    return load("layer.c", "osd_layers",
                [P, INT, P, I64, I64, INT, INT, INT, I64, DBL, P, P, P, I64, INT, P, P, P, DBL, P, P, P, I64, INT],
                "layer kernel", load_layers, libs=("-lmvec",))


def silu_mul(kernel: Kernel, gu: torch.Tensor, inter: int) -> torch.Tensor:
    """gu [R, 2 I] float32 (gate, then up; rows may be strided) -> silu(gate) * up, [R, I] float32."""
    if gu.dtype != torch.float32 or gu.stride(-1) != 1 or gu.shape[1] != 2 * inter:
        raise ValueError("silu_mul takes float32 rows of the gate and the up projection side by side")
    act = torch.empty(gu.shape[0], inter)
    kernel(gu.data_ptr(), gu.stride(0), gu.shape[0], inter, act.data_ptr())
    return act


#: addresses a layer takes in the table (csrc/layer.c)
TABLE_WIDTH = 11


def run_layers(kernel: Kernel, table: torch.Tensor, h: torch.Tensor, heads: tuple[int, int, int], inter: int,
               eps: float, cos: torch.Tensor, sin: torch.Tensor, new_slots: torch.Tensor, pool: torch.Tensor, plan) -> None:
    """Every decoder layer of the table over ``h`` [R, H] float32 (updated in place): ``heads`` (Hq,
    Hkv, D); ``cos``, ``sin`` [R, D]; ``new_slots`` [R] the rows' pool slots; ``pool`` [layers, 2, Hkv,
    S, D] in 16 bits; ``plan`` the step's :class:`speculative.attend.PagedAttention`."""
    Hq, Hkv, D = heads
    R, H = h.shape
    if not (h.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and new_slots.is_contiguous()):
        raise ValueError("run_layers takes contiguous rows")
    n_qkv, width = (Hq + 2 * Hkv) * D, max(H, Hq * D, inter)
    scratch = torch.empty(R * (H + n_qkv + Hq * D + 2 * H + 3 * inter))
    qwork = torch.empty(R * width + 8 * R * (width // 32), dtype=torch.uint8)
    rc = kernel(table.data_ptr(), table.numel() // TABLE_WIDTH, h.data_ptr(), R, H, Hq, Hkv, D, inter, eps,
                cos.data_ptr(), sin.data_ptr(), new_slots.data_ptr(), pool.shape[3], int(pool.dtype == torch.bfloat16),
                plan.slots.data_ptr(), plan.off.data_ptr(), plan.pos.data_ptr(), D**-0.5, scratch.data_ptr(),
                qwork.data_ptr(), plan.work.data_ptr(), plan.work_stride, plan.threads)
    if rc != 0:
        raise ValueError(f"layer kernel refused layer {rc - 100} (shapes Hq {Hq}, Hkv {Hkv}, D {D}, I {inter})")
