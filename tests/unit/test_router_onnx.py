"""The onnx backend of the router's MiniLM and the embedding cache: agreement with torch, batch
independence, empty texts, cache hits, and the export cache folder (reused; a partial file is
exported again). The export goes to a temporary OSD_CACHE_DIR, once for the module (about 5 s)."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest

from config import RouterConfig
from router import EMBED_DIM, FeatureExtractor
from router import features
from router.features import ONNX_FILE, ONNX_INT8_FILE, onnx_dir, onnx_stats

TEXTS = [
    "hi",
    "Write a Python function that reverses a linked list.",
    "Le temps est magnifique aujourd'hui et nous allons nous promener dans le parc.",
    "Сегодня прекрасная погода, и мы идём гулять в парк.",
    "今天天气很好，我们去公园散步。",
    "SELECT name, age FROM singer WHERE age > 30 ORDER BY age DESC; " * 10,  # beyond max_tokens
    "Prove that the square root of 2 is irrational.",
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A fresh cache directory holding one float and one int8 export."""
    path = tmp_path_factory.mktemp("osd-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OSD_CACHE_DIR", str(path))
        FeatureExtractor(RouterConfig(backend="onnx", quantize=False, embed_cache=0)).embed(["warm up"])
        FeatureExtractor(RouterConfig(backend="onnx", quantize=True, embed_cache=0)).embed(["warm up"])
        yield path


@pytest.fixture
def cache_root(root, monkeypatch):
    monkeypatch.setenv("OSD_CACHE_DIR", str(root))
    return root


def onnx_fx(**kw) -> FeatureExtractor:
    """float32 onnx without a cache unless told"""
    return FeatureExtractor(RouterConfig(backend="onnx", **{"quantize": False, "embed_cache": 0, **kw}))


@pytest.fixture(scope="module")
def torch_emb() -> np.ndarray:
    return FeatureExtractor(RouterConfig(backend="torch", quantize=False, embed_cache=0)).embed(TEXTS)


def test_onnx_is_the_default_backend():
    assert RouterConfig().backend == "onnx" and RouterConfig().embed_cache > 0


@pytest.mark.parametrize("quantize, floor", [(False, 0.999), (True, 0.97)])
def test_onnx_agrees_with_torch(cache_root, torch_emb, quantize, floor):
    got = onnx_fx(quantize=quantize).embed(TEXTS)  # [n, 384]
    assert got.shape == (len(TEXTS), EMBED_DIM) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = (got * torch_emb).sum(1)
    assert cos.min() >= floor, cos
    # wrong pooling (the [CLS] vector) or a broken graph is far from torch's: the floor catches it
    assert (got @ torch_emb.T)[np.arange(len(TEXTS)), np.roll(np.arange(len(TEXTS)), 1)].max() < 0.9


@pytest.mark.parametrize("quantize", [False, True])
def test_a_texts_embedding_does_not_depend_on_its_batch(cache_root, quantize):
    fx = onnx_fx(quantize=quantize, batch_size=4)
    batch = fx.embed(TEXTS)
    single = np.stack([fx.embed([t])[0] for t in TEXTS])
    other = fx.embed(["a different neighbour with many more words than the first text here", TEXTS[0]])[1]
    atol = 0.0 if quantize else 1e-5  # int8 runs one text at a time: bit for bit
    np.testing.assert_allclose(batch, single, atol=atol, rtol=0)
    np.testing.assert_allclose(other, single[0], atol=atol, rtol=0)


def test_empty_texts_are_zeros(cache_root):
    got = onnx_fx().embed(["", "  \n\t", "\x00\x01", "hello", ""])
    assert not got[[0, 1, 2, 4]].any()
    assert abs(np.linalg.norm(got[3]) - 1) < 1e-5
    assert onnx_fx().embed([]).shape == (0, EMBED_DIM)


def test_cache_hit_is_the_same_vector_and_costs_no_forward(cache_root, monkeypatch):
    fx = onnx_fx(embed_cache=2)
    calls: list[list[str]] = []
    encode = fx._encode
    monkeypatch.setattr(fx, "_encode", lambda texts: calls.append(list(texts)) or encode(texts))
    a = fx.embed(["What is 2 + 2?"])
    a[0] *= 0  # the caller's array is its own: the cached vector is untouched
    b = fx.embed(["  What is 2 + 2?  "])  # the same cleaned text
    c = fx.embed(["What is 2 + 2?", "What is 2 + 2?", "Tell me a joke."])  # repeats computed once
    assert calls == [["What is 2 + 2?"], ["Tell me a joke."]]
    np.testing.assert_array_equal(b[0], c[0])
    np.testing.assert_array_equal(c[0], c[1])
    assert abs(np.linalg.norm(b[0]) - 1) < 1e-5
    assert fx.cache_info() == {"size": 2, "max": 2, "hits": 3, "misses": 2}
    fx.embed(["third"])  # evicts the least recently used text ("What is 2 + 2?")
    fx.embed(["Tell me a joke."])
    fx.embed(["What is 2 + 2?"])
    assert calls[2:] == [["third"], ["What is 2 + 2?"]]


def test_extractor_pickles_without_its_cache(cache_root):
    fx = onnx_fx(embed_cache=8)
    fx.embed(["cached"])
    copy = pickle.loads(pickle.dumps(fx))  # Ray ships objects by pickle
    assert copy.cache_info()["size"] == 0 and copy.cfg == fx.cfg
    np.testing.assert_allclose(copy.embed(["cached"]), fx.embed(["cached"]), atol=1e-6)


def test_cache_off_recomputes(cache_root, monkeypatch):
    fx = onnx_fx(embed_cache=0)
    calls = []
    encode = fx._encode
    monkeypatch.setattr(fx, "_encode", lambda texts: calls.append(list(texts)) or encode(texts))
    fx.embed(["same"])
    fx.embed(["same"])
    assert len(calls) == 2 and fx.cache_info()["size"] == 0


def test_export_is_reused_from_the_cache_folder(cache_root):
    folder = onnx_dir()
    assert folder.parent == cache_root / "router"
    mtimes = {n: (folder / n).stat().st_mtime_ns for n in (ONNX_FILE, ONNX_INT8_FILE)}
    before = dict(onnx_stats)
    features._load_onnx.cache_clear()  # as a new process would: find the files again
    onnx_fx().embed(["again"])
    onnx_fx(quantize=True).embed(["again"])
    assert onnx_stats == before
    assert {n: (folder / n).stat().st_mtime_ns for n in mtimes} == mtimes


def test_a_partial_cached_file_is_exported_again(root, tmp_path, monkeypatch, torch_emb):
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    folder = onnx_dir()
    shutil.copytree(root / "router", tmp_path / "router")
    size = (folder / ONNX_FILE).stat().st_size
    with open(folder / ONNX_FILE, "r+b") as f:  # cut short, as by a crash without the atomic rename
        f.truncate(size // 2)
    before = onnx_stats["exported"]
    got = onnx_fx().embed(TEXTS)
    assert onnx_stats["exported"] == before + 1
    assert (folder / ONNX_FILE).stat().st_size == size
    assert (got * torch_emb).sum(1).min() >= 0.999
    assert not [p for p in os.listdir(folder) if p.endswith(".tmp")]


def test_a_corrupt_file_is_not_taken_for_whole(tmp_path):
    path = tmp_path / ONNX_FILE
    assert not features._is_whole(path)  # missing
    features._publish(path, lambda t: t.write_bytes(b"x" * 100))
    assert features._is_whole(path)
    path.write_bytes(b"y" * 100)  # same size, other bytes
    assert not features._is_whole(path)
    path.with_suffix(".json").write_text("{not json")
    assert not features._is_whole(path)
