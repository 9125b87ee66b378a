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

The kernel is compiled once per machine with the system's C compiler (``cc -O3 -march=native
-fopenmp``, about a second) into ``<cache_dir>/ext``. Where that fails (no compiler, not x86-64
with AVX2 and F16C), :func:`load_kernel` logs why once and returns None, and the runner keeps the
torch attention.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "attend.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(out_dir: Path) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "f16c"} <= set(_cpu_flags().split()):
        raise RuntimeError(f"needs x86-64 with AVX2 and F16C ({platform.machine()})")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()[:16]
    lib = out_dir / f"attend-{key}.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # built aside, then moved: processes may race
            part = Path(tmp) / lib.name
            res = subprocess.run([cc, *FLAGS, "-o", str(part), str(SOURCE), "-lm"], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
            os.replace(part, lib)
    return lib


class Kernel:
    """The loaded kernel: called as the C function. Copied or pickled with a runner, it stays (or
    becomes, in another process) this process's one loaded kernel."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args) -> int:
        return self.fn(*args)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return load_kernel, ()


@lru_cache(maxsize=1)
def load_kernel() -> Kernel | None:
    """The compiled kernel, or None where it cannot be built. Loaded after torch, so that its
    OpenMP calls run on torch's own libgomp threads."""
    from config import cache_dir

    try:
        lib = ctypes.CDLL(str(_build(cache_dir() / "ext")))
    except Exception as e:  # noqa: BLE001 - any failure: the torch attention serves
        log.warning("attention kernel unavailable (%s); using torch attention", e)
        return None
    fn = lib.osd_attend
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [P, INT, I64, INT, INT, P, I64, INT, P, P, P, P, I64, ctypes.c_double, P, I64, INT]
    fn.restype = INT
    return Kernel(fn)


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
        self.work_stride = (Hq // Hkv) * max(ends)
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
