"""The onnx backend of the router's MiniLM and the embedding cache: agreement with torch, batch
independence, empty texts, cache hits, and the export cache folder (reused; a partial file is
exported again). The export goes to a temporary OSD_CACHE_DIR, once for the module (about 5 s)."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest

from config import RouterConfig
from router.features import EMBED_DIM, FeatureExtractor
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
        FeatureExtractor(RouterConfig(embedder={"backend": "onnx", "quantize": False, "embed_cache": 0})).embed(["warm up"])
        FeatureExtractor(RouterConfig(embedder={"backend": "onnx", "quantize": True, "embed_cache": 0})).embed(["warm up"])
        yield path


@pytest.fixture
def cache_root(root, monkeypatch):
    monkeypatch.setenv("OSD_CACHE_DIR", str(root))
    return root


def onnx_fx(**kw) -> FeatureExtractor:
    """float32 onnx without a cache unless told"""
    return FeatureExtractor(RouterConfig(embedder={"backend": "onnx", "quantize": False, "embed_cache": 0, **kw}))


@pytest.fixture(scope="module")
def torch_emb() -> np.ndarray:
    return FeatureExtractor(RouterConfig(embedder={"backend": "torch", "quantize": False, "embed_cache": 0})).embed(TEXTS)


def test_onnx_is_the_default_backend():
    assert RouterConfig().embedder.backend == "onnx" and RouterConfig().embedder.embed_cache > 0


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


CODE_AFTER_TASK = ("Read the statement, then the code. " * 30
                   + "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)")


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_a_long_text_is_the_mean_of_its_first_and_its_last_pieces(cache_root, backend):
    """Past ``max_tokens`` word pieces a text's feature is the normalised mean of the embeddings of
    its first and its last ``max_tokens`` pieces (the cut moved to the start of a word); a text
    that fits is embedded once, as without the tail."""
    def fx(**kw):
        return FeatureExtractor(RouterConfig(embedder={"backend": backend, "quantize": False, "embed_cache": 0, **kw}))

    with_tail, head_only = fx(), fx(tail_embedding=False)
    tok = with_tail.model.tokenizer
    pieces = tok(CODE_AFTER_TASK, add_special_tokens=False)["input_ids"]
    assert len(pieces) > 128
    last = tok.decode(pieces[-126:])  # 126 pieces + [CLS] + [SEP]: the last word whole here
    head, tail = head_only.embed([CODE_AFTER_TASK, last])
    want = (head + tail) / np.linalg.norm(head + tail)
    got = with_tail.embed([CODE_AFTER_TASK, TEXTS[1], TEXTS[5]])
    np.testing.assert_allclose(got[0], want, atol=1e-5)
    assert float(got[0] @ head) < 0.95  # the tail moved it
    np.testing.assert_allclose(got[1], head_only.embed([TEXTS[1]])[0], atol=1e-6)  # fits: as before
    # a repeated sentence: its tail reads like its head, the feature nearly the head's
    assert float(got[2] @ head_only.embed([TEXTS[5]])[0]) > 0.98


def test_the_tail_starts_at_a_word_and_holds_max_tokens_pieces(cache_root):
    fx = FeatureExtractor(RouterConfig(embedder={"max_tokens": 8, "embed_cache": 0}))
    tok = fx.model.tokenizer
    text = "short words then unbelievably extraordinarily long ones"
    # short words then un ##bel ##ie ##va ##bly extra ##ord ##ina ##rily long ones: 14 pieces
    tails = fx._tails_of(fx._pieces([text, text + " too", "two words", "one two three four five six"]))
    assert list(tails) == [0, 1]  # six pieces fit in eight with [CLS] and [SEP]
    assert all(ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id for ids in tails.values())
    assert tok.convert_ids_to_tokens(tails[0][1:-1]) == ["extra", "##ord", "##ina", "##rily", "long", "ones"]
    # the last six would start inside "extraordinarily": from the next word on
    assert tok.convert_ids_to_tokens(tails[1][1:-1]) == ["long", "ones", "too"]
    # a word start is looked for among the next eight pieces only; none there: the cut stays
    word = "xqzvbnmkltrwpqzx"  # x ##q ##z ##vb ##n ##m ##k ##lt ##r ##w ##p ##q ##z ##x
    ten = " one two three four five six seven eight nine ten"
    assert len(tok.tokenize(word)) == 14 and len(tok.tokenize(ten)) == 10

    def tail(max_tokens, text):
        fx_ = FeatureExtractor(RouterConfig(embedder={"max_tokens": max_tokens, "embed_cache": 0}))
        return tok.convert_ids_to_tokens(fx_._tails_of(fx_._pieces([text]))[0][1:-1])

    assert tail(8, "hello " + word) == ["##r", "##w", "##p", "##q", "##z", "##x"]  # no word start: mid-word
    assert tail(19, "hello " + word + ten) == ten.split()  # the next word 7 pieces on: found
    assert tail(20, "hello " + word + ten)[:2] == ["##k", "##lt"]  # 8 pieces on: past the look, mid-word


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
    qsize, quantized = (folder / ONNX_INT8_FILE).stat().st_size, onnx_stats["quantized"]
    with open(folder / ONNX_INT8_FILE, "r+b") as f:  # the int8 file too: quantized again, once
        f.truncate(qsize // 2)
    onnx_fx(quantize=True).embed(["again"])
    onnx_fx(quantize=True).embed(["and again"])
    assert onnx_stats["quantized"] == quantized + 1 and (folder / ONNX_INT8_FILE).stat().st_size == qsize


def test_a_corrupt_file_is_not_taken_for_whole(tmp_path):
    path = tmp_path / ONNX_FILE
    assert not features._is_whole(path)  # missing
    features._publish(path, lambda t: t.write_bytes(b"x" * 100))
    assert features._is_whole(path)
    path.write_bytes(b"y" * 100)  # same size, other bytes
    assert not features._is_whole(path)
    path.with_suffix(".json").write_text("{not json")
    assert not features._is_whole(path)


class _Recorder:
    """The real onnxruntime session, with the shapes and masks of the batches it was given."""

    def __init__(self, session):
        self.session, self.batches = session, []

    def run(self, names, feeds):
        self.batches.append(feeds["attention_mask"].copy())
        return self.session.run(names, feeds)


def _recorded(batch_tokens: int) -> tuple[features.OnnxEmbedder, _Recorder]:
    model = onnx_fx().model
    rec = _Recorder(model.session)
    emb = features.OnnxEmbedder(rec, model.tokenizer, 128, one_at_a_time=False)
    emb.batch_tokens = batch_tokens
    return emb, rec


def test_batches_hold_texts_by_length_within_their_bounds(cache_root):
    emb, rec = _recorded(batch_tokens=200)
    got = emb.encode(TEXTS, batch_size=3)
    lens = [len(x) for x in emb.tokenizer(TEXTS, truncation=True, max_length=128)["input_ids"]]
    assert sum(len(m) for m in rec.batches) == len(TEXTS) and len(rec.batches) > 2
    for m in rec.batches:
        assert len(m) <= 3 and m.size <= 200 or len(m) == 1, m.shape  # one text alone may be longer
        assert (m.sum(1) == sorted(m.sum(1))).all() and m.sum(1).max() == m.shape[1]  # no wider than its longest
    assert sorted(int(n) for m in rec.batches for n in m.sum(1)) == sorted(lens)
    widths = [m.shape[1] for m in rec.batches]
    assert widths == sorted(widths)  # shortest texts first
    one = features.OnnxEmbedder(emb.session.session, emb.tokenizer, 128, one_at_a_time=True).encode(TEXTS)
    np.testing.assert_allclose(got, one, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch_size, bound, want", [(32, "2L", [2, 2]), (2, "many", [2, 2]), (32, "L-1", [1, 1, 1, 1])])
def test_a_batch_fills_to_exactly_its_bounds(cache_root, batch_size, bound, want):
    """Four texts of one length L: a word-piece bound of exactly 2 L or a size of 2 makes batches
    of two; a bound below one text still runs each text, alone."""
    text = "the same words again"
    emb, rec = _recorded(batch_tokens=1)
    n = len(emb.tokenizer([text])["input_ids"][0])
    emb.batch_tokens = {"2L": 2 * n, "many": 10_000, "L-1": n - 1}[bound]
    got = emb.encode([text] * 4, batch_size=batch_size)
    assert [len(m) for m in rec.batches] == want
    np.testing.assert_allclose(got, np.repeat(got[:1], 4, axis=0), atol=1e-5, rtol=0)


def test_an_export_refuses_a_model_it_cannot_reproduce(tmp_path):
    """Only Transformer + mean pooling + Normalize is exported: a model folder whose pipeline
    differs is refused before anything is written."""
    src = features._model_path()
    for change in ("modules", "pooling"):
        model = tmp_path / change
        shutil.copytree(src, model)
        if change == "modules":
            mods = [m for m in json.loads((model / "modules.json").read_text()) if not m["type"].endswith("Normalize")]
            (model / "modules.json").write_text(json.dumps(mods))
        else:
            cfg = json.loads((model / "1_Pooling" / "config.json").read_text())
            (model / "1_Pooling" / "config.json").write_text(json.dumps({**cfg, "pooling_mode_mean_tokens": False,
                                                                          "pooling_mode_cls_token": True}))
        with pytest.raises(ValueError, match="can be exported"):
            features._export_onnx(model, tmp_path / f"{change}.onnx", 1)
        assert not (tmp_path / f"{change}.onnx").exists()


def test_published_files_are_readable_by_all_and_sessions_single_threaded_and_quiet(cache_root):
    path = features.ensure_onnx(quantize=False)
    for p in (path, path.with_suffix(".json")):
        assert p.stat().st_mode & 0o777 == 0o644
    opts = features._session(path, 1).get_session_options()
    assert (opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level) == (1, 1, 3)


def test_clearing_the_cache_zeroes_its_counts(cache_root):
    fx = onnx_fx(embed_cache=8)
    fx.embed(["one", "one", "two"])
    fx.embed(["one"])
    assert (fx.cache_info()["hits"], fx.cache_info()["misses"]) == (1, 2)
    fx.clear_cache()
    assert fx.cache_info() == {"size": 0, "max": 8, "hits": 0, "misses": 0}


def test_a_cached_export_that_is_whole_but_does_not_load_is_exported_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    path = features.ensure_onnx(quantize=False)
    path.write_bytes(b"not an onnx graph")  # e.g. written by another onnxruntime: its record says whole
    path.with_suffix(".json").write_text(json.dumps({"size": path.stat().st_size, "sha256": features.file_sha256(path),
                                                     "format": features.ONNX_FORMAT}))
    emb = features._load_onnx(str(tmp_path), 128, 1, False)
    assert "exporting it again" in caplog.text
    assert emb.encode(["hello there"]).shape == (1, EMBED_DIM)


def test_the_int8_torch_backend_is_quantized_and_batch_independent():
    fx = FeatureExtractor(RouterConfig(embedder={"backend": "torch", "quantize": True, "embed_cache": 0, "batch_size": 4}))
    batch = fx.embed(TEXTS)
    single = np.stack([fx.embed([t])[0] for t in TEXTS])
    np.testing.assert_allclose(batch, single, atol=0, rtol=0)  # one text at a time: activations scaled per text
    exact = FeatureExtractor(RouterConfig(embedder={"backend": "torch", "quantize": False, "embed_cache": 0})).embed(TEXTS[:1])
    assert 0.8 < float(batch[0] @ exact[0]) < 0.99999  # near float32 (0.90 on this text), but int8


def test_an_export_that_disagrees_with_torch_is_not_published(tmp_path, monkeypatch):
    """The exported graph is checked against torch before it is kept: a graph that pools the
    [CLS] vector instead of the mean is refused and leaves nothing behind."""
    import torch

    real_export = torch.onnx.export

    class ClsPooled(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return torch.nn.functional.normalize(h[:, 0], p=2.0, dim=-1)

    monkeypatch.setattr(torch.onnx, "export", lambda net, *a, **kw: real_export(ClsPooled(net.bert), *a, **kw))
    dest = tmp_path / "model.onnx"
    with pytest.raises(RuntimeError, match="disagrees with torch"):
        features._export_onnx(features._model_path(), dest, 1)
    assert list(tmp_path.iterdir()) == []
