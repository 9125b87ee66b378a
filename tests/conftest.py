"""Shared fixtures: a tiny randomly initialised Llama target and a char-level tokenizer, built in code.

Nothing here downloads anything. The tiny target (3 layers, hidden 32, vocab 128) runs a forward in
about a millisecond, so the speculative engine can be exercised end to end in unit tests.
"""

from __future__ import annotations

import os
import string

import pytest
import torch

# The test machine has 2 shared cores: with 2 OpenMP threads, small matmuls stall (1000x slower)
# whenever the other core is busy. One thread is also the fastest setting for these tiny models.
torch.set_num_threads(1)

# Under pytest-xdist (`make test`: `-n 2`) the Ray tests share the cores with the other worker's
# in-process tests: Ray starts its workers (the app's replicas) at nice 15 by default, which would
# starve the live app behind them; the same priority for both.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("RAY_worker_niceness", "0")

#: 2 specials + 95 printable ASCII + 31 Greek letters = 128 tokens, one character each, so that
#: character offsets in decoded text equal token offsets (stop-string tests rely on this).
SPECIALS = ["<eos>", "<unk>"]
CHARS = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"] + list("αβγδεζηθικλμνξοπρστυφχψωΓΔΘΛΞΠΣΦ")[:31]
VOCAB_SIZE = len(SPECIALS) + len(CHARS)
assert VOCAB_SIZE == 128

PROMPT_TEXTS = [
    "Hello world!",
    "The quick brown fox",
    "abcabcabc abc",
    "def f(x): return x + 1",
]


def _char_tokenizer(name: str = "tiny-char", eos: str = "<eos>", chars: list[str] | None = None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for c in chars if chars is not None else CHARS:
        vocab.setdefault(c, len(vocab))
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    raw.decoder = decoders.Fuse()  # decode by concatenation
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=eos,
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        name_or_path=name,
    )


def tiny_llama(num_layers: int = 3, seed: int = 0, **overrides):
    """A tiny random Llama; ``overrides`` change LlamaConfig fields (vocab_size, eos_token_id, ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        # a large init gives peaked next-token distributions: few near-ties in greedy decoding and
        # low-variance empirical distributions in the statistical tests
        initializer_range=1.0,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=0,
    )
    cfg = LlamaConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.generation_config.bos_token_id = cfg.bos_token_id
    return model


_tiny_llama = tiny_llama


def int4_engines():
    """One int4 target (a tiny random Llama, character tokenizer) under three engines: target-only,
    a 1-layer draft model and prompt lookup, k fixed at 3. Returns (target, tokenizer, engines)."""
    from config import EngineConfig, KPolicyConfig
    from speculative import SpeculativeEngine
    from speculative.fast import FastRunner
    from speculative.proposers import DraftModelProposer, NgramProposer

    target = FastRunner(tiny_llama(2, seed=0), name="target", bits=4, kv_tokens=4096, block_tokens=8)
    tok = _char_tokenizer()
    cfg = EngineConfig(chat_template=False, k=KPolicyConfig(k_max=3, fixed_k=3))
    draft = DraftModelProposer(FastRunner(tiny_llama(1, seed=7), name="draft", bits=4), 128)
    engines = tuple(SpeculativeEngine(target, tok, proposer, cfg) for proposer in (None, draft, NgramProposer()))
    return target, tok, engines


@pytest.fixture(scope="session")
def make_tokenizer():
    """Factory: ``make_tokenizer(name=..., eos=..., chars=...)`` -> a char-level PreTrainedTokenizerFast."""
    return _char_tokenizer


@pytest.fixture(scope="session")
def tok():
    return _char_tokenizer()


@pytest.fixture(scope="session")
def make_llama():
    """Factory: ``make_llama(num_layers, seed)`` -> a fresh tiny random Llama (same config as ``target``)."""
    return _tiny_llama


@pytest.fixture(scope="session")
def target():
    """The shared tiny target. Tests must not modify it (build their own with ``make_llama``)."""
    return _tiny_llama(3, seed=0)


@pytest.fixture(scope="session")
def V(target) -> int:
    return target.config.vocab_size


@pytest.fixture(scope="session")
def prompts(tok) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in PROMPT_TEXTS]


@pytest.fixture(scope="session")
def prompt_texts() -> list[str]:
    return list(PROMPT_TEXTS)


@pytest.fixture(scope="session")
def make_engine(target, tok):
    """Factory: ``make_engine(proposer, tokenizer=None, model=None, **engine_config_fields)``.

    ``k`` may be an int (fixed k) or a KPolicyConfig; ``chat_template`` defaults to False.
    """
    from config import EngineConfig, KPolicyConfig
    from speculative import ModelRunner, SpeculativeEngine

    def make(proposer=None, tokenizer=None, model=None, **cfg):
        if isinstance(cfg.get("k"), int):
            cfg["k"] = KPolicyConfig(fixed_k=cfg["k"])
        cfg.setdefault("chat_template", False)
        return SpeculativeEngine(
            ModelRunner(model if model is not None else target, name="target"),
            tokenizer if tokenizer is not None else tok,
            proposer,
            EngineConfig(**cfg),
        )

    return make


@pytest.fixture(scope="session")
def draft_proposer(V):
    """Factory: ``draft_proposer(model, vocab_map=None)`` -> DraftModelProposer over the target vocab."""
    from speculative import DraftModelProposer, ModelRunner

    def make(model, vocab_map=None):
        return DraftModelProposer(ModelRunner(model, vocab_map, name="draft"), V)

    return make


@pytest.fixture(scope="session")
def greedy_reference(make_engine):
    """``greedy_reference(prompt_ids, n)`` -> target-only greedy output of the engine (proposer None),
    ending before EOS. Cached per (prompt, n)."""
    from config import SamplingParams

    engine = make_engine(None)
    cache: dict = {}

    def ref(prompt: list[int], n: int, ignore_eos: bool = False) -> list[int]:
        key = (tuple(prompt), n, ignore_eos)
        if key not in cache:
            cache[key] = engine.generate(list(prompt), SamplingParams(max_tokens=n, ignore_eos=ignore_eos)).token_ids
        return cache[key]

    return ref


@pytest.fixture(scope="session")
def hf_greedy(target):
    """``hf_greedy(prompt_ids, n)`` -> HF ``generate(do_sample=False)`` new tokens, cut before the first EOS."""
    from bench.bench import hf_greedy_generate

    cache: dict = {}

    def gen(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy_generate(target, list(prompt), n, {0}, eos_token_id=0, pad_token_id=0)[0]
        return cache[key]

    return gen


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts and ends on one torch thread: code under test that sets its own (the CLIs'
    ``--threads 2``, a built engine's ``num_threads``) must not leave two threads spinning in this
    process while the other core runs the other xdist worker (both would stall)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Ray tests last: the unit tests run first (fast feedback), then the modules that start Ray."""
    items.sort(key=lambda item: item.get_closest_marker("serve") is not None)


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``make test`` runs ``-n 2``): every Ray test goes to one worker, in order
    (they share the package's live app and start one Ray at a time), and the real SmolLM2 tests to
    one worker (their module loads the model once); each other test is a unit of its own. The
    largest unit, the Ray tests, is handed out first; the other worker takes the in-process tests
    meanwhile, on one thread each, while the live app spends much of its time waiting on replicas
    and learner rounds. (xdist's own ``loadgroup`` renames node ids, which pytest 9 ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(("tests/serve/", "tests/cluster/")):
                return "ray"
            if nodeid.startswith("tests/slow/"):
                return "smollm2"
            return nodeid

    return Groups(config, log)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, make_llama, make_tokenizer):
    """The tiny Llama and its tokenizer saved as a model folder (``tests/inprocess.py``)."""
    from inprocess import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), make_llama, make_tokenizer)


@pytest.fixture
def tiny_app(tiny_folder, loop):
    """The composed application in this process on the tiny model (``inprocess.App``), run on the
    test's loop (``app.run``)."""
    from inprocess import App, app_config

    a = App(app_config(tiny_folder))
    a.run = loop.run
    return a


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (servers under test bind loopback only), drawn from 20000-32767:
    below the kernel's ephemeral range (32768 up, where Ray's gRPC servers and every outgoing
    connection take theirs, so a port the kernel handed out could be taken again before the server
    under test binds it) and above Ray's worker ports (10002-19999)."""
    import random
    import socket

    for port in random.Random().sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767 on 127.0.0.1")


@pytest.fixture(scope="session")
def extractor():
    """The router's feature extractor with the default config (onnx int8 MiniLM, py3langid), warm;
    loaded on first use by a test that asks for it."""
    from config import RouterConfig
    from router.features import FeatureExtractor

    fx = FeatureExtractor(RouterConfig())
    fx.embed(["warm up"])
    return fx


@pytest.fixture
def loop():
    """An event loop for one test of the deployments in one process (``tests/inprocess.py``): the
    batching queues of the servers a test builds stay bound to it, as in a replica."""
    from inprocess import Loop, outside_serve

    outside_serve()
    lp = Loop()
    yield lp
    lp.close()


def assert_speculation_equals_target_only(target, draft, k: int, prompts=([5, 6, 7, 8], list(range(20, 45)), [9] * 12)):
    """Greedy speculative decoding with ``draft`` (a runner) at k equals ``target``'s own
    target-only output on each prompt, and the draft did propose."""
    from config import EngineConfig, KPolicyConfig, SamplingParams
    from speculative import SpeculativeEngine
    from speculative.proposers import DraftModelProposer

    tok = _char_tokenizer()
    cfg = EngineConfig(chat_template=False, k=KPolicyConfig(k_max=k, fixed_k=k))
    alone = SpeculativeEngine(target, tok, None, cfg)
    spec = SpeculativeEngine(target, tok, DraftModelProposer(draft, 128), cfg)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    proposed = 0
    for prompt in prompts:
        want = alone.generate(prompt, params).token_ids
        g = spec.generate(prompt, params)
        assert g.token_ids == want
        proposed += g.stats.proposed
    assert proposed > 0
