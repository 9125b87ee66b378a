"""Draft construction (truncated, fresh, restricted head), checkpoints, and prompt lookup."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config import NgramConfig, SamplingParams
from drafts.build import DRAFT_WEIGHTS, fresh_draft, frequent_token_ids, load_draft, restrict_head, save_draft, truncated_draft
from speculative import ModelLoadError, NgramProposer


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


# -- truncated -------------------------------------------------------------------------------------
def test_truncated_draft_copies_first_layers(target):
    draft = truncated_draft(target, 2)
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    assert target.config.num_hidden_layers == 3 and len(target.model.layers) == 3
    t = target.state_dict()
    d = draft.state_dict()
    assert any(k.startswith("model.layers.1.") for k in d) and not any(k.startswith("model.layers.2.") for k in d)
    for name, value in d.items():
        assert torch.equal(value, t[name]), name


def test_truncated_draft_computes_target_prefix(target, prompts):
    """Hidden states after layer 1 are the target's (same weights, same positions)."""
    draft = truncated_draft(target, 2)
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        hd = draft(ids, output_hidden_states=True).hidden_states
        ht = target(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(hd[1], ht[1])
    assert not torch.allclose(_logits(draft, prompts[0]), _logits(target, prompts[0]))


def test_truncated_draft_is_independent(target):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    draft = truncated_draft(target, 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(1.0)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"training the draft changed the target's {k}"


def test_truncated_draft_too_many_layers(target):
    with pytest.raises(ValueError, match="num_layers"):
        truncated_draft(target, 4)


# -- fresh -----------------------------------------------------------------------------------------
def test_fresh_draft_shares_embedding_values(target):
    draft = fresh_draft(target, 1, seed=0)
    emb_t, emb_d = target.model.embed_tokens.weight, draft.model.embed_tokens.weight
    assert torch.equal(emb_d, emb_t)
    assert emb_d.data_ptr() != emb_t.data_ptr()  # a copy, not the target's tensor
    assert torch.equal(draft.model.norm.weight, target.model.norm.weight)
    # the decoder layer is new, not the target's
    assert not torch.equal(draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    # seeded
    again = fresh_draft(target, 1, seed=0)
    other = fresh_draft(target, 1, seed=1)
    w = lambda m: m.model.layers[0].self_attn.q_proj.weight  # noqa: E731
    assert torch.equal(w(draft), w(again)) and not torch.equal(w(draft), w(other))


# -- restricted head -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keep(tok, prompt_texts):
    return frequent_token_ids(tok, 40, prompt_texts)


def test_frequent_token_ids(tok):
    ids = lambda s: tok(s)["input_ids"]  # noqa: E731
    z, y, sp = ids("z")[0], ids("y")[0], ids(" ")[0]
    got = frequent_token_ids(tok, 5, ["zzzz yy", "zz"])
    assert got.tolist() == sorted([0, 1, z, y, sp])  # specials first, then the most frequent
    got = frequent_token_ids(tok, 4, ["zzzz yy", "zz"])
    assert got.tolist() == sorted([0, 1, z, y])  # ' ' occurs once: dropped first
    got = frequent_token_ids(tok, 7, ["zzzz yy"])
    assert got.tolist() == sorted([0, 1, 2, 3, z, y, sp])  # filled with the lowest ids
    tilde, a = ids("~")[0], ids("a")[0]
    assert tilde > a
    assert frequent_token_ids(tok, 3, ["~~~ a"]).tolist() == [0, 1, tilde]  # by count, not by id
    assert frequent_token_ids(tok, 1000).tolist() == list(range(len(tok)))


def test_restrict_head(target, keep, prompts):
    full = truncated_draft(target, 2)
    draft = restrict_head(truncated_draft(target, 2), keep)
    out = _logits(draft, prompts[0])
    assert out.shape[-1] == len(keep) == 40
    assert draft.get_output_embeddings().weight.shape == (40, 32)
    torch.testing.assert_close(out, _logits(full, prompts[0])[:, keep])  # the same scores, fewer rows
    # untied: the embeddings are unchanged and independent of the new head
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    with torch.no_grad():
        draft.get_output_embeddings().weight.add_(1.0)
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_restricted_proposals_map_back_to_target_ids(target, keep, prompts, draft_proposer, V, temperature):
    model = restrict_head(truncated_draft(target, 2), keep)
    proposer = draft_proposer(model, keep)
    gen = torch.Generator().manual_seed(0)
    keep_set = set(keep.tolist())
    params = SamplingParams(temperature=temperature, seed=0)
    for i, p in enumerate(prompts):
        prop = proposer.propose(f"s{i}", p, lambda source: 5, params, gen)
        assert prop.k == 5 and prop.source == "draft"
        assert set(prop.tokens) <= keep_set
        if temperature == 0.0:
            # d_1 = the restricted head's argmax, as a target id
            assert prop.tokens[0] == int(keep[_logits(model, p)[-1].argmax()])
        else:  # sampling needs q over the target vocabulary, zero outside keep_ids
            assert prop.probs.shape == (5, V)
            torch.testing.assert_close(prop.probs.sum(-1), torch.ones(5))
            outside = torch.ones(V, dtype=torch.bool)
            outside[keep] = False
            assert (prop.probs[:, outside] == 0).all()
            assert all(prop.probs[j, t] > 0 for j, t in enumerate(prop.tokens))
            # row 0 is the restricted head's softmax, placed at the right target ids
            torch.testing.assert_close(prop.probs[0, keep], _logits(model, p)[-1].softmax(-1), atol=1e-5, rtol=1e-4)
        proposer.release(f"s{i}")
    assert len(proposer.runner) == 0


# -- the draft proposer's own cache -------------------------------------------------------------------------
def test_draft_proposer_rolls_back_rejected_tokens(target, draft_proposer, prompts):
    """After a rejection and later tokens from elsewhere (e.g. prompt lookup), the draft must not
    keep its rejected proposals in its cache: it proposes exactly what a fresh proposer would."""
    draft = truncated_draft(target, 2)
    greedy = SamplingParams()
    for p in prompts:
        proposer = draft_proposer(draft)
        first = proposer.propose("s", p, lambda source: 4, greedy, None)
        assert proposer.runner.cached_length("s") == len(p) + 3  # prompt + d_1..d_3
        # the verifier kept none of them; then 5 tokens arrived that the draft did not propose
        proposer.feedback("s", len(p))
        extra = [t + 1 if t < 120 else 2 for t in first.tokens] + [7]
        tokens = p + extra
        again = proposer.propose("s", tokens, lambda source: 3, greedy, None)
        fresh = draft_proposer(draft).propose("s", tokens, lambda source: 3, greedy, None)
        assert again.tokens == fresh.tokens
        assert again.input_tokens == len(extra) + 2  # caught up on the lag, then 2 draft steps
        assert proposer.runner.cached_length("s") == len(tokens) + 2


def test_draft_proposer_swap_resets_caches(target, draft_proposer, prompts):
    a, b = truncated_draft(target, 1), fresh_draft(target, 1, seed=9)
    proposer = draft_proposer(truncated_draft(target, 1))
    proposer.propose("s", prompts[0], lambda source: 3, SamplingParams(), None)
    proposer.load_state_dict(b.state_dict(), version=2)
    assert proposer.version == 2
    got = proposer.propose("s", prompts[0] + [5], lambda source: 3, SamplingParams(), None).tokens
    want = draft_proposer(b).propose("s", prompts[0] + [5], lambda source: 3, SamplingParams(), None).tokens
    old = draft_proposer(a).propose("s", prompts[0] + [5], lambda source: 3, SamplingParams(), None).tokens
    assert got == want and got != old


# -- checkpoints -----------------------------------------------------------------------------------------
def test_save_load_round_trip(target, prompts, tmp_path):
    draft = truncated_draft(target, 2)
    with torch.no_grad():
        draft.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # "trained": differs from the target
    save_draft(draft, tmp_path / "d", meta={"step": 12})
    loaded, keep, meta = load_draft(tmp_path / "d")
    assert keep is None and meta == {"step": 12}
    assert loaded.config.num_hidden_layers == 2
    torch.testing.assert_close(_logits(loaded, prompts[1]), _logits(draft, prompts[1]), rtol=0, atol=0)
    # saving again over the same path replaces it
    save_draft(truncated_draft(target, 1), tmp_path / "d")
    assert load_draft(tmp_path / "d")[0].config.num_hidden_layers == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".publish.lock", "d"]  # no temporary folders left behind


def test_a_draft_saved_again_is_always_whole_to_a_reader_and_a_killed_saves_leftovers_go(target, tmp_path):
    """While one thread saves a draft over the same path again and again, another loads it without
    ever finding the path missing or half-written; a temporary folder left by a save that was
    killed is removed by the next save."""
    import threading

    draft = truncated_draft(target, 1)
    save_draft(draft, tmp_path / "d")
    (tmp_path / ".tmp-d-killed").mkdir()
    (tmp_path / ".tmp-d-killed" / DRAFT_WEIGHTS).write_bytes(b"cut")
    done, errors, loads = threading.Event(), [], [0]

    def read():
        while not done.is_set():
            try:
                load_draft(tmp_path / "d")
                loads[0] += 1
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(f"{type(e).__name__}: {e}")

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(40):
            save_draft(draft, tmp_path / "d")
    finally:
        done.set()
        reader.join()
    assert not errors, errors[:3]
    assert loads[0] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".publish.lock", "d"]


def test_save_load_round_trip_restricted_head(target, keep, prompts, tmp_path):
    draft = restrict_head(truncated_draft(target, 2), keep)
    with torch.no_grad():
        draft.get_output_embeddings().weight.mul_(0.5)  # head trained apart from the embeddings
    save_draft(draft, tmp_path / "r", keep_ids=keep)
    loaded, keep2, _ = load_draft(tmp_path / "r")
    assert torch.equal(keep2, keep)
    out = _logits(loaded, prompts[2])
    assert out.shape[-1] == len(keep)
    torch.testing.assert_close(out, _logits(draft, prompts[2]), rtol=0, atol=0)
    assert torch.equal(loaded.model.embed_tokens.weight, target.model.embed_tokens.weight)


def test_default_checkpoint_resolves_to_the_distilled_draft(target, tok, prompts, tmp_path, monkeypatch):
    from config import DraftConfig
    from drafts.build import build_draft_model, default_draft_path

    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    cfg = DraftConfig(checkpoint="default")
    with pytest.raises(ModelLoadError, match="osd distill"):
        build_draft_model(cfg, target, tok)
    draft = truncated_draft(target, 1)
    save_draft(draft, default_draft_path())
    assert default_draft_path().is_relative_to(tmp_path)
    loaded, keep = build_draft_model(cfg, target, tok)
    assert keep is None and loaded.config.num_hidden_layers == 1
    torch.testing.assert_close(_logits(loaded, prompts[0]), _logits(draft, prompts[0]), rtol=0, atol=0)


def test_the_default_feature_draft_is_its_own(target, tok, tmp_path, monkeypatch):
    """``osd distill --kind feature`` writes where ``checkpoint: default`` of a feature draft looks,
    apart from the token draft's default; each kind refuses the other's checkpoint."""
    from config import DraftConfig
    from drafts.build import build_draft_model, default_draft_path
    from osd.cli import distill_args
    from speculative.feature_draft import FeatureDraft

    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    args = distill_args(["--kind", "feature", "--seconds", "5"])
    out = args[args.index("--out") + 1]
    assert out == str(default_draft_path("feature")) != str(default_draft_path())
    assert args[-4:] == ["--kind", "feature", "--seconds", "5"]  # later options override the defaults
    token_args = distill_args([])
    assert token_args[token_args.index("--out") + 1] == str(default_draft_path())
    from learner.offline import parser

    assert parser().parse_args(token_args).prompt_positions  # the starting drafts learn the prompts too ...
    assert not parser().parse_args(distill_args(["--no-prompt-positions"])).prompt_positions  # ... unless told
    assert not parser().parse_args(["--out", "x"]).prompt_positions  # osd train-draft: outputs only
    with pytest.raises(ModelLoadError, match="osd distill --kind feature"):
        build_draft_model(DraftConfig(kind="feature", checkpoint="default"), target, tok)
    feature, _ = build_draft_model(DraftConfig(kind="feature"), target, tok)
    save_draft(feature, out)
    loaded, _ = build_draft_model(DraftConfig(kind="feature", checkpoint="default"), target, tok)
    assert isinstance(loaded, FeatureDraft)
    save_draft(truncated_draft(target, 1), default_draft_path())
    assert not isinstance(build_draft_model(DraftConfig(checkpoint="default"), target, tok)[0], FeatureDraft)


def test_load_draft_refuses_other_folders(tmp_path):
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        load_draft(tmp_path)


# -- prompt lookup -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens, k, want",
    [
        ([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, [7, 5]),  # the most recent earlier match
        ([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 1, [7]),  # respects k
        ([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 10, [7, 5, 1, 2, 3]),  # up to the end of the context
        ([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 2, [4, 9]),  # a longer match wins over a more recent shorter one
        ([1, 2, 9, 3, 4, 2], 2, [9, 3]),  # falls back to n = 1
        ([1, 2, 3, 4], 3, []),  # no match
        ([5], 3, []),
        ([], 3, []),
    ],
)
def test_ngram_lookup(tokens, k, want):
    assert NgramProposer(NgramConfig(max_n=3, min_n=1)).lookup(tokens, k) == want


def test_ngram_min_n():
    assert NgramProposer(NgramConfig(max_n=3, min_n=2)).lookup([1, 2, 9, 3, 4, 2], 2) == []
    assert NgramProposer(NgramConfig(max_n=3, min_n=2)).lookup([1, 2, 9, 3, 1, 2], 2) == [9, 3]


def test_ngram_propose():
    ng = NgramProposer()
    prop = ng.propose("s", [4, 5, 6, 4, 5], lambda source: 2, SamplingParams(), None)
    assert (prop.tokens, prop.probs, prop.source) == ([6, 4], None, "ngram")
    assert ng.propose("s", [4, 5, 6, 4, 5], lambda source: 0, SamplingParams(), None).k == 0
    assert ng.propose("s", [1, 2, 3], lambda source: 2, SamplingParams(), None).source == "none"


def test_draft_folders_names_and_metadata(target, tmp_path, monkeypatch):
    """The starting drafts' folders by kind, a draft saved where no folder exists yet (readable by
    all), a draft of every target layer, prompt digests and the meta a folder carries."""
    import hashlib

    from drafts.build import default_draft_path, prompt_digest, read_meta, resolve_checkpoint, trained_prompts

    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path))
    assert default_draft_path() == tmp_path / "drafts" / "default"
    assert default_draft_path("feature") == tmp_path / "drafts" / "default-feature"
    assert resolve_checkpoint(str(tmp_path / "mine")) == tmp_path / "mine"
    assert prompt_digest("héllo") == hashlib.sha1("héllo".encode()).hexdigest()[:16] and len(prompt_digest("")) == 16
    whole = truncated_draft(target, target.config.num_hidden_layers)  # as many layers as the target: allowed
    path = tmp_path / "a" / "b" / "draft"
    save_draft(whole, path, meta={"trained_prompts": [prompt_digest("x")], "note": 1})
    assert path.stat().st_mode & 0o777 == 0o755
    assert read_meta(path) == {"trained_prompts": [prompt_digest("x")], "note": 1}
    assert trained_prompts(path) == {prompt_digest("x")} and trained_prompts(tmp_path) == set() and read_meta(tmp_path) == {}
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_frequent_token_ids_keep_only_ids_of_the_vocabulary(tok):
    vocab = len(tok)
    got = frequent_token_ids(tok, 6, always=[vocab, vocab + 5, 7])
    assert vocab not in got.tolist() and 7 in got.tolist() and len(got) == 6


def test_build_proposer_composes_what_the_config_asks_for(target, tok):
    """Each kind alone, the fixed order suffix tree -> prompt lookup -> draft, the controller over
    the same parts, the feature draft's head in the runtime's bits, and the experiments' controller."""
    from config import ControllerConfig, DraftConfig
    from drafts.build import build_proposer, controller_over
    from speculative.feature import FeatureDraftProposer
    from speculative.proposers import ChainedProposer, ControllerProposer, DraftModelProposer
    from speculative.suffix import SuffixProposer

    def kinds(p) -> list[str]:
        return [type(x).__name__ for x in p.proposers]

    assert build_proposer(DraftConfig(proposers=[]), target, tok) is None
    assert type(build_proposer(DraftConfig(proposers=["ngram"]), target, tok)) is NgramProposer
    assert type(build_proposer(DraftConfig(proposers=["suffix"]), target, tok)) is SuffixProposer
    assert type(build_proposer(DraftConfig(kind="truncated", num_layers=1), target, tok)) is DraftModelProposer
    chain = build_proposer(DraftConfig(proposers=["suffix", "ngram", "draft"], num_layers=1), target, tok)
    assert type(chain) is ChainedProposer and kinds(chain) == ["SuffixProposer", "NgramProposer", "DraftModelProposer"]
    # in the list's order, whatever it is
    again = build_proposer(DraftConfig(proposers=["draft", "suffix"], num_layers=1), target, tok)
    assert type(again) is ChainedProposer and kinds(again) == ["DraftModelProposer", "SuffixProposer"]
    ctl = build_proposer(DraftConfig(proposers=["suffix", "ngram"], select="controller",
                                     controller=ControllerConfig(probe_every=5)), target, tok)
    assert type(ctl) is ControllerProposer and kinds(ctl) == ["SuffixProposer", "NgramProposer"] and ctl.probe_every == 5
    one = build_proposer(DraftConfig(proposers=["ngram"], select="controller"), target, tok)
    assert type(one) is ControllerProposer and kinds(one) == ["NgramProposer"]
    int4 = build_proposer(DraftConfig(kind="truncated", num_layers=1), target, tok, quantize="int4")
    assert int4.runner.head_bits == 4  # a small draft's head (most of its weights) in the layers' bits
    for quantize, bits in (("none", None), ("int8", 8), ("int4", 4)):
        feature = build_proposer(DraftConfig(kind="feature"), target, tok, quantize=quantize)
        assert type(feature) is FeatureDraftProposer and feature.runner.head_bits == bits
    learned = NgramProposer(NgramConfig(max_n=2))
    over = controller_over(learned, DraftConfig())
    assert kinds(over) == ["SuffixProposer", "NgramProposer", "NgramProposer"] and over.proposers[-1] is learned
    assert over.probe_every == ControllerConfig().probe_every
    assert kinds(controller_over()) == ["SuffixProposer", "NgramProposer"]


def test_the_lowest_ids_fill_a_head_from_id_zero():
    """With fewer frequent ids than rows, the head is filled from id 0 up (here 0 is no special token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "<eos>": 3, "<unk>": 4}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    assert sorted(tok.all_special_ids) == [3, 4]
    assert frequent_token_ids(tok, 3).tolist() == [0, 3, 4]
    assert frequent_token_ids(tok, 4, ["c c"]).tolist() == [0, 2, 3, 4]


def test_a_truncated_draft_keeps_the_layer_types_of_its_layers(target):
    """A config that lists each layer's attention type (sliding / full) is cut to the draft's layers."""
    import copy
    from types import SimpleNamespace

    from drafts.build import _draft_config

    t = SimpleNamespace(config=copy.deepcopy(target.config))  # the shared target's config stays as it is
    t.config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert _draft_config(t, 2, tie=False).layer_types == ["sliding_attention", "full_attention"]
    assert _draft_config(t, 3, tie=False).layer_types == t.config.layer_types


def test_a_saved_draft_missing_a_tensor_or_with_another_is_refused(target, keep, tmp_path):
    """Weights that do not cover the model (a cut or edited file), or hold a tensor it does not
    have, are an error, not a draft with random layers: a token draft (tied head or not, whose tied
    head is not saved) and a feature draft alike."""
    import copy

    from safetensors.torch import load_file, save_file

    from drafts.build import DRAFT_WEIGHTS
    from speculative.feature_draft import feature_draft

    untied = truncated_draft(target, 1)
    untied.config = copy.deepcopy(untied.config)
    untied.config.tie_word_embeddings = False
    drafts = {"token": truncated_draft(target, 1), "untied": untied, "feature": feature_draft(target, keep, [])}
    assert drafts["token"].config.tie_word_embeddings
    for name, draft in drafts.items():
        folder = tmp_path / name
        save_draft(draft, folder, keep if name == "feature" else None)
        load_draft(folder)  # whole: loads
        weights = load_file(folder / DRAFT_WEIGHTS)
        cut = [k for k in weights if k.endswith("up_proj.weight")][0]
        save_file({k: v for k, v in weights.items() if k != cut}, folder / DRAFT_WEIGHTS)
        with pytest.raises(ModelLoadError, match="missing.*up_proj"):
            load_draft(folder)
        save_file({**weights, "extra.weight": torch.zeros(2)}, folder / DRAFT_WEIGHTS)
        with pytest.raises(ModelLoadError, match="unexpected.*extra.weight"):
            load_draft(folder)


def test_a_draft_by_path_is_that_model(make_llama, make_tokenizer, tok, tmp_path):
    """``kind: path``: the model folder named, whole (its own layers), on the target's vocabulary."""
    from config import DraftConfig
    from drafts.build import build_draft_model
    from inprocess import save_tiny_model

    folder = save_tiny_model(tmp_path / "m", make_llama, make_tokenizer)
    draft, keep = build_draft_model(DraftConfig(kind="path", path=folder), make_llama(3, seed=0), tok)
    assert keep is None and len(draft.model.layers) == 3
    want = make_llama(3, seed=0).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in draft.state_dict().items())


def test_a_saved_adapter_starts_a_built_draft_where_training_left_it(target, tok, prompts, tmp_path):
    """``osd train-draft --adapter-rank R`` saves the adapters alone; ``draft.adapter`` puts them
    on the built draft, which then proposes as the trained one (to the saved precision), and is
    refused on a draft of another shape."""
    from config import DraftConfig
    from drafts.build import ADAPTER_WEIGHTS, adapter_base, build_draft_model, save_adapter
    from speculative.adapters import adapter_state, add_adapters

    cfg = DraftConfig(kind="truncated", num_layers=2)
    trained, _ = build_draft_model(cfg, target, tok)
    add_adapters(trained, 4)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k, v in adapter_state(trained).items():
            v.copy_(torch.randn(v.shape, generator=gen) * 0.2)
    size = save_adapter(trained, tmp_path / "a", adapter_base(cfg, target), meta={"steps": 3}, dtype=torch.float32)
    assert size == (tmp_path / "a" / ADAPTER_WEIGHTS).stat().st_size
    assert size < 0.5 * sum(v.numel() * 4 for v in trained.state_dict().values())  # the adapters alone
    served, _ = build_draft_model(cfg.model_copy(update={"adapter": str(tmp_path / "a")}), target, tok)
    plain, _ = build_draft_model(cfg, target, tok)
    torch.testing.assert_close(_logits(served, prompts[0]), _logits(trained, prompts[0]))
    assert not torch.allclose(_logits(plain, prompts[0]), _logits(trained, prompts[0]), atol=1e-3)
    save_adapter(trained, tmp_path / "b", adapter_base(cfg, target))  # bfloat16: what is served is what was saved
    halved, _ = build_draft_model(cfg.model_copy(update={"adapter": str(tmp_path / "b")}), target, tok)
    assert (tmp_path / "b" / ADAPTER_WEIGHTS).stat().st_size < 0.6 * size
    with torch.no_grad():
        for v in adapter_state(trained).values():
            v.copy_(v.bfloat16().float())
    torch.testing.assert_close(_logits(halved, prompts[0]), _logits(trained, prompts[0]))
    with pytest.raises(ModelLoadError, match="trained on the draft"):
        build_draft_model(DraftConfig(kind="truncated", num_layers=1, adapter=str(tmp_path / "a")), target, tok)
    with pytest.raises(ModelLoadError, match="not a saved adapter"):
        build_draft_model(cfg.model_copy(update={"adapter": str(tmp_path)}), target, tok)
    with pytest.raises(ValueError, match="draft.adapter"):
        DraftConfig(proposers=["ngram"], adapter=str(tmp_path / "a"))


def test_training_prompts_drawn_one_domain_at_a_time_keep_each_domain_s_order():
    from types import SimpleNamespace as R

    from learner.offline import by_domain_in_turn, parser

    recs = [R(domain=d, i=i) for i, d in enumerate("aaaabac")]  # a: 0 1 2 3 5, b: 4, c: 6
    assert [r.i for r in by_domain_in_turn(recs)] == [0, 4, 6, 1, 2, 3, 5]
    assert by_domain_in_turn([]) == []
    assert parser().parse_args(["--out", "x", "--balance-domains"]).balance_domains
    assert not parser().parse_args(["--out", "x"]).balance_domains
    assert parser().parse_args(["--out", "x", "--exclude-sources", "a", "b"]).exclude_sources == ["a", "b"]


def test_osd_distill_with_an_adapter_rank_writes_the_shipped_adapter_on_the_full_head():
    from drafts.build import shipped_adapter_path
    from learner.offline import parser
    from osd.cli import distill_args

    a = parser().parse_args(distill_args(["--adapter-rank", "16"]))
    assert a.out == str(shipped_adapter_path()) and a.head_vocab is None and a.adapter_rank == 16
    # the package's recipe: never a benchmark's prompt, nor a source the shift experiment streams
    assert a.workload.endswith("router_train.jsonl") and a.balance_domains and (a.n_prompts, a.seconds) == (720, 1200)
    assert {Path(f).name for f in a.exclude} == {"workload.jsonl", "open.jsonl", "mixture.jsonl"}
    assert set(a.exclude_sources) == {"dbgpt-example", "humaneval"} and a.prompt_positions and a.max_tokens == 48
    a = parser().parse_args(distill_args(["--seconds", "60"]))  # the whole draft: train.jsonl, an 8,192-row head
    assert a.workload.endswith("/train.jsonl") and a.head_vocab == 8192 and a.seconds == 60 and not a.balance_domains
