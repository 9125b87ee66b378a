"""Small native kernels (``csrc/*.c``), compiled once per machine and loaded with ctypes.

Each kernel is one C file built with the system's C compiler (``cc -O3 -march=native -fopenmp``,
about a second) into ``<cache_dir>/ext``, named by a hash of its source, the compiler, the flags
and the CPU, so a changed file or machine builds anew and processes racing to build it are safe.
Loaded after torch, its OpenMP calls run on torch's own libgomp threads. Where it cannot be built
(no compiler, not x86-64 with AVX2 and F16C), :func:`load` logs why once and returns None, and
the caller keeps its torch path.
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
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
#: -ffp-contract=off: the C's arithmetic as written (no fused multiply-adds the compiler picks per
#: loop), so that a row's operations do not depend on which loop computed them
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build(source: Path, out_dir: Path, libs: tuple[str, ...] = ()) -> Path:
    """The shared library of ``source`` under ``out_dir``, compiled if it is not there yet."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "f16c", "fma"} <= set(_cpu_flags().split()):
        raise RuntimeError(f"needs x86-64 with AVX2, FMA and F16C ({platform.machine()})")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    # every source of the folder: a kernel may include the others (csrc/layer.c does)
    sources = [source.read_text()] + [p.read_text() for p in sorted(source.parent.glob("*.c")) if p != source]
    key = hashlib.sha256("\0".join([*sources, version, " ".join(FLAGS + list(libs)), _cpu_flags()]).encode()).hexdigest()[:16]
    lib = out_dir / f"{source.stem}-{key}.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # built aside, then moved: processes may race
            part = Path(tmp) / lib.name
            res = subprocess.run([cc, *FLAGS, "-o", str(part), str(source), *libs, "-lm"], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
            os.replace(part, lib)
    return lib


class Kernel:
    """A loaded kernel, called as its C function. Copied or pickled with a runner, it stays (or
    becomes, in another process) this process's one loaded kernel: ``loader`` is the module-level
    function that loaded it."""

    def __init__(self, fn, loader):
        self.fn, self.loader = fn, loader

    def __call__(self, *args) -> int:
        return self.fn(*args)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return self.loader, ()


def load(source: str, symbol: str, argtypes: list, what: str, loader, libs: tuple[str, ...] = ()) -> Kernel | None:
    """``symbol`` of ``csrc/<source>`` (restype int; linked with ``libs`` too), or None (logged once
    by the caller's cache)."""
    from config import cache_dir

    try:
        lib = ctypes.CDLL(str(build(CSRC / source, cache_dir() / "ext", libs)))
    except Exception as e:  # noqa: BLE001 - any failure: the torch path serves
        log.warning("%s unavailable (%s); using torch", what, e)
        return None
    fn = getattr(lib, symbol)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return Kernel(fn, loader)
