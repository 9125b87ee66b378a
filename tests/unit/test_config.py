"""Bad input is refused at the edge with a clear error (pydantic ValidationError, RequestError,
ModelLoadError, VocabMismatchError), not a deep traceback from inside a model."""

from __future__ import annotations

import hashlib

import pytest

from config import (GREEDY_BELOW, DraftConfig, EngineConfig, KPolicyConfig, LearnerServeConfig, ModelConfig, NgramConfig,
                    RouterConfig, SamplingParams, ValidationError, cache_dir, content_key, file_sha256)
from speculative import ModelLoadError, RequestError, VocabMismatchError
from speculative.models import check_same_vocab, load_model


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),  # the stop check keeps and searches this much text per request
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"max_token": 5}, "max_token"),  # typo: extra fields are refused, not ignored
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**kwargs)
    assert field in str(e.value)


def test_good_sampling_params():
    p = SamplingParams(max_tokens=1, temperature=0.7, top_p=1.0, top_k=0, stop=["\n"], seed=3)
    assert not p.greedy and SamplingParams().greedy


def test_draft_config_validation():
    with pytest.raises(ValidationError, match="draft.path"):
        DraftConfig(kind="path")
    assert DraftConfig(kind="path", path="/some/model").path == "/some/model"
    with pytest.raises(ValidationError):
        DraftConfig(kind="medusa")
    with pytest.raises(ValidationError):
        DraftConfig(head_vocab=4)
    with pytest.raises(ValidationError, match="min_n"):
        NgramConfig(min_n=3, max_n=2)
    for proposers in (["ngram"], ["suffix", "ngram"], []):  # a domain's own starting draft needs a learned draft
        with pytest.raises(ValidationError, match="domain_checkpoints needs a learned draft"):
            DraftConfig(proposers=proposers, domain_checkpoints={"sql": "/d"})
    for kind in ("truncated", "feature"):
        assert DraftConfig(kind=kind, domain_checkpoints={"sql": "/d"}).domain_checkpoints == {"sql": "/d"}


def test_the_proposers_are_one_list_and_a_selection_rule_and_the_earlier_form_is_refused_with_the_new_one():
    cfg = DraftConfig(proposers=["suffix", "ngram", "draft"], select="controller")
    assert cfg.learned and not DraftConfig(proposers=["suffix"]).learned and DraftConfig().proposers == ["draft"]
    for bad in ({"proposers": ["ngram", "ngram"]}, {"proposers": ["medusa"]}, {"proposers": [], "select": "controller"},
                {"select": "best"}):
        with pytest.raises(ValidationError):
            DraftConfig(**bad)
    for old in ({"use_suffix": True}, {"ngram_first": True}, {"kind": "ngram"}, {"kind": "suffix"}, {"kind": "none"}):
        with pytest.raises(ValidationError, match="is gone: list the proposers in draft.proposers"):
            DraftConfig(**old)
    # controller settings alone used to mean "choose by the controller": now the rule is said
    with pytest.raises(ValidationError, match="choose it with draft.select: controller"):
        DraftConfig(controller={"probe_every": 3})
    assert DraftConfig(select="order", controller={"probe_every": 3}).controller.probe_every == 3


def test_kpolicy_and_engine_config_validation():
    for kw in ({"fixed_k": -1}, {"k_max": 33}, {"prior_alpha": 1.5}, {"ema": 0}, {"probe_every": 0}):
        with pytest.raises(ValidationError):
            KPolicyConfig(**kw)
    with pytest.raises(ValidationError):
        EngineConfig(record_top_k=0)
    with pytest.raises(ValidationError):
        ModelConfig(dtype="float64")


def test_validators_accept_their_edges_and_refuse_one_past():
    assert NgramConfig(min_n=2, max_n=2).min_n == 2
    assert KPolicyConfig(k_max=3).fixed_k is None  # adaptive
    assert KPolicyConfig(k_max=3, fixed_k=3).fixed_k == 3
    with pytest.raises(ValidationError, match="fixed_k"):
        KPolicyConfig(k_max=3, fixed_k=4)
    assert DraftConfig(kind="feature", feature_layers=[0, 5]).feature_layers == [0, 5]
    for layers, why in (([2, 2], "distinct"), ([-1], "distinct"), ([3, -2], "distinct")):
        with pytest.raises(ValidationError, match=why):
            DraftConfig(kind="feature", feature_layers=layers)
    with pytest.raises(ValidationError, match="is for draft.kind='feature'"):
        DraftConfig(kind="truncated", feature_layers=[3])
    assert RouterConfig(bandit={"prior": (0.5, 0.5)}).bandit.prior == (0.5, 0.5)
    for prior in ((0.0, 1.0), (1.0, -1.0)):
        with pytest.raises(ValidationError, match="pseudo-counts"):
            RouterConfig(bandit={"prior": prior})
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy and SamplingParams(temperature=GREEDY_BELOW / 2).greedy


def test_the_cache_folder_and_the_learner_state_under_it(monkeypatch, tmp_path):
    monkeypatch.delenv("OSD_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "osd-serve"
    assert LearnerServeConfig().root() == tmp_path / ".cache" / "osd-serve" / "serve"
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    assert LearnerServeConfig(state_dir=str(tmp_path / "state")).root() == tmp_path / "state"


def test_content_keys_follow_the_bytes_not_the_path(tmp_path):
    data = bytes(range(256)) * 40_000  # 10 MB: more than two read chunks
    a, b, c = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
    a.write_bytes(data)
    b.write_bytes(data)
    c.write_bytes(data[:-1] + b"x")
    assert file_sha256(a) == hashlib.sha256(data).hexdigest()
    assert content_key(a) == content_key(b) != content_key(c)
    assert len(content_key(a)) == 16 and len(content_key(a, length=7)) == 7
    assert content_key(a, b) == hashlib.sha256((hashlib.sha256(data).hexdigest() * 2).encode()).hexdigest()[:16]


# -- requests -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(None)


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t "])
def test_empty_text_prompt(engine, prompt):
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(prompt)
    assert not engine.requests


def test_empty_token_prompt(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([])


def test_prompt_longer_than_context(engine):
    with pytest.raises(RequestError, match="256"):
        engine.add_request(list(range(2, 122)) * 2 + [5] * 10, SamplingParams(max_tokens=16))  # 250 + 16 > 256
    with pytest.raises(RequestError, match="context"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=300))
    rid = engine.add_request([5] * 240, SamplingParams(max_tokens=16))  # exactly fits
    engine.release(rid)
    assert not engine.requests


def test_text_prompt_is_encoded(engine, tok):
    rid = engine.add_request("Hello")
    assert engine.requests[rid].tokens == tok("Hello")["input_ids"]
    engine.release(rid)


def test_chat_template_falls_back_without_template(make_engine, tok):
    eng = make_engine(None, chat_template=True)  # the tiny tokenizer has no chat template
    assert eng.encode("Hi there") == tok("Hi there")["input_ids"]


# -- models and vocabularies --------------------------------------------------------------------------------
def test_missing_model_path():
    with pytest.raises(ModelLoadError, match="/no/such/model"):
        load_model(ModelConfig(name="/no/such/model"))


def test_missing_gguf_file(tmp_path):
    path = str(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        load_model(ModelConfig(name=path))


def test_folder_without_model(tmp_path):
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_model(ModelConfig(name=str(tmp_path)))


def test_vocab_mismatch_names_both_tokenizers(make_tokenizer):
    a = make_tokenizer(name="tok-alpha")
    chars = [t for t, i in sorted(a.get_vocab().items(), key=lambda kv: kv[1]) if i >= 2]
    b = make_tokenizer(name="tok-beta", chars=chars[::-1])  # same tokens, other ids
    with pytest.raises(VocabMismatchError) as e:
        check_same_vocab(a, b)
    msg = str(e.value)
    assert "tok-alpha" in msg and "tok-beta" in msg
    assert "different ids" in msg
    check_same_vocab(a, make_tokenizer(name="tok-gamma"))  # same vocabulary: accepted


@pytest.mark.parametrize("bad", [[5, 128], [-1, 5]])
def test_out_of_vocab_token_ids(engine, bad):
    try:
        with pytest.raises(RequestError):
            rid = engine.add_request(bad, SamplingParams(max_tokens=2))
            engine.step(rid)
    finally:
        for rid in list(engine.requests):
            engine.release(rid)


def test_the_learner_is_typed_in_the_application_config_and_its_loss_names_are_the_losses():
    from config import AppConfig, LearnerConfig
    from config.learner import LOSS_NAMES
    from learner.losses import LOSSES

    assert set(LOSSES) == set(LOSS_NAMES)
    cfg = AppConfig.model_validate({"learner": {"trainer": {"lr": 0.002, "adapter_rank": 8}, "background": {"nice": 5}}})
    assert isinstance(cfg.learner.trainer, LearnerConfig) and cfg.learner.trainer.lr == 0.002
    assert cfg.learner.trainer.adapter_rank == 8 and cfg.learner.background.nice == 5
    for bad in ({"trainer": {"lr": -1}}, {"trainer": {"no_such": 1}}, {"trainer": {"loss": "l2"}}, {"background": {"nice": 40}}):
        with pytest.raises(ValueError):  # refused with the config, not when the learner starts
            AppConfig.model_validate({"learner": bad})


def test_a_partial_learner_trainer_changes_only_its_keys_of_the_servers_defaults():
    """learner.trainer {lr: ...} keeps the rest of SERVE_TRAINER (rank-16 adapters), never the
    whole-draft defaults of LearnerConfig(); an unknown key is still refused."""
    from config.learner import SERVE_TRAINER

    t = LearnerServeConfig(trainer={"lr": 0.002}).trainer
    assert t.lr == 0.002 and t.adapter_rank == SERVE_TRAINER.adapter_rank == 16
    assert t.model_dump() == {**SERVE_TRAINER.model_dump(), "lr": 0.002}
    assert LearnerServeConfig(trainer={"adapter_rank": 0}).trainer.adapter_rank == 0  # whole draft: asked for
    with pytest.raises(ValueError):
        LearnerServeConfig(trainer={"bogus": 1})
