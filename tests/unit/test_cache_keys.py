"""Cache entries are named by content: the same weights installed at another path (a fresh
checkout's virtual environment) reuse the entry; different weights get their own."""

from __future__ import annotations

import os
import shutil

from config import content_key
from router.features import onnx_dir
from speculative.locate import gguf_cache_folder as _gguf_cache_folder


def _model(folder, weights: bytes):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text('{"hidden_size": 384}')
    return folder


def test_the_key_follows_content_not_path_or_mtime(tmp_path):
    a, b, c = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
    a.write_bytes(b"x" * 5000)
    shutil.copy(a, b)
    os.utime(b, (1, 1))
    c.write_bytes(b"x" * 4999 + b"y")
    assert content_key(a) == content_key(b)
    assert content_key(a) != content_key(c)
    assert content_key(a, c) != content_key(c, a)


def test_a_rewritten_file_gets_a_new_key(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"one")
    first = content_key(f)
    f.write_bytes(b"two")
    os.utime(f, ns=(10**18, 10**18))  # a new mtime: the memo must not serve the old digest
    assert content_key(f) != first


def test_gguf_and_onnx_entries_are_shared_across_installs(tmp_path, monkeypatch):
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path / "cache"))
    g1, g2 = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for g in (g1, g2):
        g.parent.mkdir()
        g.write_bytes(b"GGUF" + b"\0" * 100)
    assert _gguf_cache_folder(g1) == _gguf_cache_folder(g2)
    g2.write_bytes(b"GGUF" + b"\1" * 100)
    assert _gguf_cache_folder(g1) != _gguf_cache_folder(g2)

    m1 = _model(tmp_path / "venv1" / "minilm", b"weights")
    m2 = _model(tmp_path / "venv2" / "minilm", b"weights")
    m3 = _model(tmp_path / "venv3" / "minilm", b"other weights")
    assert onnx_dir(m1) == onnx_dir(m2) != onnx_dir(m3)
    assert onnx_dir(m1).parent == tmp_path / "cache" / "router"
