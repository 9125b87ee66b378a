"""Loading models and tokenizers by name, prompts and chats as token ids, the ids that end a
generation, devices and vocabularies: by hand, on the tiny Llama and its character tokenizer saved
as folders (no download, no dequantisation)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import ModelConfig
from speculative.locate import TextVocab, embedded_gguf_path, light_vocab
from speculative.locate import gguf_cache_folder as _gguf_cache_folder
from speculative.models import (ModelLoadError, VocabMismatchError, check_device, check_same_vocab, encode_messages,
                                encode_prompt, eos_token_ids, load_config, load_model, load_tokenizer, load_weights, resolve_model_folder)

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, make_llama, make_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_llama(3, seed=0).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def test_a_model_folder_loads_as_itself_in_the_asked_dtype(folder):
    assert resolve_model_folder(str(folder)) == (str(folder), {})
    model = load_weights(ModelConfig(name=str(folder), dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    model, tok = load_model(ModelConfig(name=str(folder)))
    assert next(model.parameters()).dtype == torch.float32 and len(tok) == 128
    assert load_config(str(folder)).num_hidden_layers == 3 and len(load_tokenizer(str(folder))) == 128


def test_token_ids_read_as_the_transformers_tokenizer_reads_them_without_torch(folder):
    import random

    vocab, full = light_vocab(str(folder)), load_tokenizer(str(folder))
    assert isinstance(vocab, TextVocab) and len(vocab) == len(full) == 128
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(len(full)) for _ in range(rng.randrange(1, 30))]
        assert vocab.decode(ids) == full.decode(ids)
    # the light path, in a fresh process: neither torch nor transformers is imported
    code = ("import sys; from speculative.locate import light_vocab; "
            f"v = light_vocab({str(folder)!r}); v.decode([1, 2, 3]); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_names_that_are_paths_must_exist_and_others_are_hub_ids(tmp_path):
    for name in ("./no-model", "/no/such/model", "~/no-model", "a/b/c"):
        with pytest.raises(ModelLoadError, match=f"model path not found or not a model folder: {name}"):
            resolve_model_folder(name)
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not found or not a model folder"):
        resolve_model_folder(str(tmp_path / "file.bin"))
    for hub_id in ("HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"):
        assert resolve_model_folder(hub_id) == (hub_id, {})  # resolved by transformers from its cache
    with pytest.raises(ModelLoadError, match="model file not found: .*missing.gguf"):
        resolve_model_folder(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has neither config.json nor a .gguf file"):
        resolve_model_folder(str(tmp_path / "empty"))


def test_a_folder_of_gguf_files_resolves_to_the_first_ones_dequantised_cache(tmp_path, monkeypatch, folder):
    """The first .gguf by name is the model; its float32 copy is made once, keyed by its content:
    a cache already there is used as it is."""
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path / "cache"))
    ggufs = tmp_path / "ggufs"
    ggufs.mkdir()
    (ggufs / "b.gguf").write_bytes(b"second")
    (ggufs / "a.gguf").write_bytes(b"first")
    cached = _gguf_cache_folder(ggufs / "a.gguf")
    assert cached.parent == tmp_path / "cache" / "models" and cached.name.startswith("a-")
    cached.mkdir(parents=True)
    for f in folder.iterdir():
        (cached / f.name).write_bytes(f.read_bytes())
    assert resolve_model_folder(str(ggufs)) == (str(cached), {})
    assert resolve_model_folder(str(ggufs / "a.gguf")) == (str(cached), {})
    assert _gguf_cache_folder(ggufs / "b.gguf") != cached


def test_the_embedded_target_is_the_packaged_gguf():
    path = embedded_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()


def test_prompts_and_chats_as_ids(make_tokenizer):
    tok = make_tokenizer()
    ids = lambda text: tok(text)["input_ids"]  # noqa: E731
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert encode_prompt(tok, "Hi") == ids("Hi")  # no template: the text as it is
    assert encode_messages(tok, chat) == ids("system: Be brief.\nuser: Hi\nassistant:")
    tok.chat_template = TEMPLATE
    assert encode_messages(tok, chat) == ids("<system>Be brief.<user>Hi<assistant>")
    assert encode_prompt(tok, "Hi") == ids("<user>Hi<assistant>")
    assert encode_prompt(tok, "Hi", chat_template=False) == ids("Hi")


def test_every_id_that_ends_a_generation(make_tokenizer, make_llama):
    tok = make_tokenizer()  # EOS <eos> = 0
    model = make_llama(1, seed=0)
    model.generation_config.eos_token_id = [0, 7, 9]
    assert eos_token_ids(tok, model) == {0, 7, 9}
    model.generation_config.eos_token_id = 5
    assert eos_token_ids(tok, model) == {0, 5}
    assert eos_token_ids(None, model) == {5} and eos_token_ids(tok, None) == {0} and eos_token_ids(None, None) == set()
    model.generation_config.eos_token_id = None
    assert eos_token_ids(tok, model) == {0}


def test_devices_this_machine_does_not_have_are_refused(monkeypatch):
    check_device("cpu")
    check_device("cpu:0")
    check_device("meta")  # a kind the check does not know: left to torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="device 'cuda' is not available on this machine"):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda")
    check_device("cuda:0")
    with pytest.raises(ModelLoadError, match="device 'cuda:1': this machine has 1 CUDA device"):
        check_device("cuda:1")


def test_a_draft_with_another_vocabulary_is_refused_with_what_differs(make_tokenizer):
    target = make_tokenizer(name="t", chars=list("abc"))  # <eos> 0, <unk> 1, a 2, b 3, c 4
    draft = make_tokenizer(name="d", chars=list("acbd"))  # a 2, c 3, b 4, d 5
    with pytest.raises(VocabMismatchError, match="draft tokenizer 'd' \\(vocab 6\\) does not match target tokenizer 't' "
                                                 "\\(vocab 5\\): 0 tokens only in the target, 1 only in the draft, "
                                                 "2 with different ids"):
        check_same_vocab(target, draft)
    check_same_vocab(target, make_tokenizer(name="t2", chars=list("abc")))


# -- the dequantised cache, filled by several processes at once -------------------------------------
class _FakeGGUF:
    """Stands in for transformers' GGUF loading in a child process: "dequantising" any .gguf gives
    the tiny Llama and its tokenizer saved in ``TINY`` (after a pause, so that every process is
    converting at once); everything else goes to transformers."""

    TINY = ""

    def __init__(self, real):
        self.real = real

    def from_pretrained(self, path, *args, gguf_file=None, **kw):
        if gguf_file:
            import time

            time.sleep(1.0)
            return self.real.from_pretrained(self.TINY)
        return self.real.from_pretrained(path, *args, **kw)

    def from_config(self, *args, **kw):
        return self.real.from_config(*args, **kw)


def _start_on_the_cache(cache: str, gguf: str, tiny: str, barrier, results) -> None:
    import os
    import traceback

    os.environ["OSD_CACHE_DIR"] = cache
    import speculative.models as m

    _FakeGGUF.TINY = tiny
    m.AutoTokenizer, m.AutoModelForCausalLM = _FakeGGUF(m.AutoTokenizer), _FakeGGUF(m.AutoModelForCausalLM)
    barrier.wait()
    try:
        model, tok = m.load_model(ModelConfig(name=gguf))
        results.put(("ok", len(tok), model.config.num_hidden_layers))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))


def test_processes_starting_together_on_an_empty_cache_all_load_the_one_conversion(tmp_path, folder):
    """Four processes find no converted model and start converting at once: one converts under the
    lock, the others wait, find the folder complete and load it; none fails, nothing is left
    behind but the folder (and the lock file); a temporary folder of a killed converter found at
    start is removed."""
    import multiprocessing as mp

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really a gguf")
    cache = tmp_path / "cache"
    (cache / "models" / ".tmp-m-crashed").mkdir(parents=True)  # a converter killed half way
    (cache / "models" / ".tmp-m-crashed" / "model.safetensors").write_bytes(b"cut")
    ctx = mp.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_start_on_the_cache, args=(str(cache), str(gguf), str(folder), barrier, results))
             for _ in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    failed = [g for g in got if g[0] != "ok"]
    assert not failed, failed[0][2]
    assert got == [("ok", 128, 3)] * n
    assert sorted(p.name for p in (cache / "models").iterdir()) == [".publish.lock", _gguf_cache_folder(gguf).name]
