"""Publishing a folder (a dequantised model, a saved draft) so that concurrent processes never see
it half-written and never lose it while they read it.

Several replicas start at once on an empty cache and all need the same converted model; a learner
saves a draft while a replica loads it. The rule, for every writer of such a folder:

- one writer at a time per parent folder, under an exclusive ``fcntl.flock`` on ``.publish.lock``
  beside the folder; a writer that only fills a cache checks again once it holds the lock and
  leaves a complete folder as it is (it is never deleted to be written again);
- the folder is written under a temporary name (``.tmp-<name>-*``) in the same parent, every
  file and the folder are fsynced, then it is renamed into place; the parent is fsynced after;
- replacing a complete folder (``replace=True``: saving a draft again) swaps the two atomically
  (``renameat2(RENAME_EXCHANGE)`` where the kernel has it), so the name always names a complete
  folder; only the swapped-out copy is removed;
- temporary folders left by a writer that was killed are removed by the next writer, under the
  lock (no live writer can own one then).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

LOCK_NAME = ".publish.lock"
TMP_PREFIX = ".tmp-"


@contextmanager
def publish_lock(parent: Path) -> Iterator[None]:
    """Hold the exclusive publishing lock of ``parent`` (created if missing)."""
    parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(parent / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder (deepest first), ``root`` last."""
    dirs = []
    for here, _subdirs, files in os.walk(root):
        dirs.append(here)
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        fsync_dir(Path(d))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(parent: Path) -> list[str]:
    """Remove the temporary folders of writers that died; call only under :func:`publish_lock`
    (every live writer of ``parent`` holds it while its temporary folder exists)."""
    removed = []
    for p in parent.glob(TMP_PREFIX + "*"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    if removed:
        log.warning("removed %d unfinished folder(s) of an interrupted writer in %s: %s", len(removed), parent,
                    ", ".join(sorted(removed)))
    return removed


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False when the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def publish_folder(dest: str | Path, write: Callable[[Path], None], *, complete: Callable[[Path], bool] | None = None,
                   replace: bool = False, mode: int = 0o755) -> bool:
    """Make ``dest`` a complete folder written by ``write(tmp_folder)``, by the rule above.

    ``complete(path)``: whether a folder there is whole (default: it exists; a folder only
    appears at ``dest`` whole). Without ``replace`` a complete folder is kept as it is and
    ``write`` is not called (also when another process completed it while this one waited for
    the lock). Returns whether this call wrote the folder.
    """
    dest = Path(dest)
    complete = complete or Path.is_dir
    if not replace and complete(dest):
        return False
    with publish_lock(dest.parent):
        remove_stale(dest.parent)
        if not replace and complete(dest):
            return False
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f"{TMP_PREFIX}{dest.name}-"))
        leftovers = [tmp]
        try:
            write(tmp)
            tmp.chmod(mode)  # mkdtemp makes it 0700
            fsync_tree(tmp)
            if not (dest.exists() and complete(dest) and _exchange(tmp, dest)):  # swapped: tmp holds the old one
                if dest.exists():  # incomplete (never published whole), or no atomic swap here
                    aside = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f"{TMP_PREFIX}{dest.name}-old-"))
                    leftovers.append(aside)
                    os.replace(dest, aside / "old")
                os.replace(tmp, dest)
            fsync_dir(dest.parent)
        finally:
            for p in leftovers:
                if p.exists():
                    shutil.rmtree(p, ignore_errors=True)
    return True
