"""Quantised weights x 8-bit activations with integer dot products (``csrc/qmm.c``).

torch's ``_weight_int4pack_mm_for_cpu`` widens the 4-bit weights to float for every block of a few
rows, so its cost grows almost linearly with the rows of a call. A verify step of 8 sequences is
16-40 rows and a prompt chunk hundreds, so that was the engine loop's largest cost under
concurrency. The kernels here do what llama.cpp does for Q4_1 and Q8_0 weights (the embedded
GGUF's types): each row of the input is rounded to 8 bits per group of 32 (one scale per group, and
the rounded group's sum for the weights' minimum, in float32 where llama.cpp's Q8_1 blocks keep
them in float16), and each group's product is an exact integer dot product (AVX-512 VNNI, or AVX2's
``maddubs``), scaled in float32. Measurements (time per rows of a call, agreement with
the float model): docs/fast.md, "The native matrix kernels".

Exactness: an output is computed from its own input row and weight row alone, in one fixed order
(see the C file), by one thread: a row's result is bitwise the same whatever other rows share the
call, on any thread count, and on the AVX2 path as on AVX-512. The served model is this one (8-bit
activations, like llama.cpp's); where the kernel cannot be built the layers keep torch's kernel.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from .native import Kernel, load

GROUP = 32  # inputs per 4-bit group of the weights and per 8-bit group of the activations
TILE = 16  # outputs per tile (the rows of N are padded to it)


@lru_cache(maxsize=1)
def load_q4() -> Kernel | None:
    """The compiled 4-bit kernel (:mod:`speculative.native`), or None where it cannot be built."""
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    return load("qmm.c", "osd_q4_mm", [P, P, I64, I64, P, I64, I64, P, P, ctypes.c_int], "int4 matmul kernel", load_q4)


@lru_cache(maxsize=1)
def load_q8() -> Kernel | None:
    """The compiled 8-bit kernel, or None where it cannot be built."""
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    return load("qmm.c", "osd_q8_mm", [P, P, P, I64, I64, P, I64, I64, P, P, ctypes.c_int], "int8 matmul kernel", load_q8)


@lru_cache(maxsize=1)
def load_rms() -> Kernel | None:
    """The compiled RMSNorm (one call instead of torch's dozen ops a norm), or None."""
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    return load("qmm.c", "osd_rms_norm", [P, I64, P, I64, I64, ctypes.c_double, P, ctypes.c_int], "RMSNorm kernel", load_rms)


def rms_norm(kernel: Kernel, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [R, K] float32 (rows may be strided) -> x / sqrt(mean(x^2) + eps) * weight, [R, K] float32."""
    if x.dtype != torch.float32 or x.stride(-1) != 1 or x.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError("rms_norm takes float32 rows of contiguous values and a float32 weight")
    y = torch.empty(x.shape)
    kernel(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], x.shape[1], eps, y.data_ptr(), torch.get_num_threads())
    return y


def pack_q4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of weights w = scale * q + lo: q [N, K] in 0..15, scale and lo [N, K/32]
    (N a multiple of 16). Returns (wq [N/16, K/32, 4, 16, 4] uint8, two 4-bit values a byte;
    dm [N/16, K/32, 2, 16] float16, each group's scale then minimum)."""
    N, K = q.shape
    T, G = N // TILE, K // GROUP
    q5 = q.to(torch.uint8).view(T, TILE, G, 8, 4).permute(0, 2, 3, 1, 4)  # [T, G, quad, lane, 4]
    wq = (q5[:, :, :4] | (q5[:, :, 4:] << 4)).contiguous()  # quads 0-3 low nibbles, 4-7 high
    per_tile = lambda v: v.view(T, TILE, G).permute(0, 2, 1)  # [T, G, lane]
    dm = torch.stack([per_tile(scale), per_tile(lo)], 2).to(torch.float16).contiguous()
    return wq, dm


def unpack_q4(wq: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The float weights [N, K] the packed ones hold (for tests and checks)."""
    T, G = wq.shape[:2]
    q = torch.cat([wq & 15, wq >> 4], 2).permute(0, 3, 1, 2, 4).reshape(T * TILE, G, GROUP).float()  # [N, G, 32]
    d, m = (dm[:, :, i].float().permute(0, 2, 1).reshape(T * TILE, G, 1) for i in (0, 1))
    return (q * d + m).view(T * TILE, G * GROUP)


def pack_q8(w: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout of weights w * d per group of 32 (Q8_0): w [N, K] int8 (N a multiple of
    16), d [N, K/32] (rounded to float16). Returns (w8 [N/16, K/32, 8, 16, 4] int8, wsum [N/16, K/32,
    16] int32, d8 [N/16, K/32, 16] float16)."""
    N, K = w.shape
    T, G = N // TILE, K // GROUP
    tiles = w.view(T, TILE, G, 8, 4)
    w8 = tiles.permute(0, 2, 3, 1, 4).contiguous()  # [T, G, quad, lane, 4]
    wsum = tiles.to(torch.int32).sum((3, 4)).permute(0, 2, 1).to(torch.int32).contiguous()  # [T, G, lane] (sum widens)
    d8 = d.to(torch.float16).view(T, TILE, G).permute(0, 2, 1).contiguous()  # [T, G, lane]
    return w8, wsum, d8


def unpack_q8(w8: torch.Tensor, d8: torch.Tensor) -> torch.Tensor:
    """The float weights [N, K] the packed 8-bit ones hold (for tests and checks)."""
    T, G = w8.shape[:2]
    w = w8.permute(0, 3, 1, 2, 4).reshape(T * TILE, G, GROUP).float()  # [N, G, 32]
    return (w * d8.float().permute(0, 2, 1).reshape(T * TILE, G, 1)).view(T * TILE, G * GROUP)


def _rows(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"the kernel takes rows of {K} inputs, got {tuple(x.shape)}")
    return x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()


def _work(M: int, K: int) -> torch.Tensor:  # the rows in 8 bits, their scales and sums
    return torch.empty(M * K + 8 * M * (K // GROUP), dtype=torch.uint8)


def q4_mm(kernel: Kernel, wq: torch.Tensor, dm: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float -> x W^T [M, N] float32 through the 4-bit kernel."""
    N, K = wq.shape[0] * TILE, wq.shape[1] * GROUP
    x = _rows(x, K)
    y, work = torch.empty(x.shape[0], N), _work(x.shape[0], K)  # (held while the kernel runs)
    rc = kernel(wq.data_ptr(), dm.data_ptr(), N, K, x.data_ptr(), x.stride(0), x.shape[0], y.data_ptr(),
                work.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"int4 kernel refused the shapes (N {N}, K {K})")
    return y


def q8_mm(kernel: Kernel, w8: torch.Tensor, wsum: torch.Tensor, d8: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float -> x W^T [M, N] float32 through the 8-bit kernel (W = w8 * d8 per group)."""
    N, K = w8.shape[0] * TILE, w8.shape[1] * GROUP
    x = _rows(x, K)
    y, work = torch.empty(x.shape[0], N), _work(x.shape[0], K)  # (held while the kernel runs)
    rc = kernel(w8.data_ptr(), wsum.data_ptr(), d8.data_ptr(), N, K, x.data_ptr(), x.stride(0), x.shape[0],
                y.data_ptr(), work.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"int8 kernel refused the shapes (N {N}, K {K})")
    return y
