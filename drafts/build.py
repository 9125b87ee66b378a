"""Drafts: (a) truncated target, (b) fresh small model sharing the target's embeddings,
(c) any model by path, (d) any of these with a head restricted to frequent tokens,
(e) prompt lookup (no model), alone or ahead of a learned draft, (f) suffix trees over past
traffic (no model, ``speculative.suffix``); several of them in a fixed order or chosen per step by
a controller.

A small draft's cost is dominated by its output head (49152 x 576 for SmolLM2): a head over the
target's N most frequent tokens cuts that cost roughly by 49152 / N while still covering most of
what the target emits. Proposed ids are mapped back to the target's through ``keep_ids``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from config import DraftConfig, EngineConfig, ModelConfig
from speculative.adapters import adapter_rank, adapter_state, add_adapters, load_state
from speculative.engine import SpeculativeEngine
from speculative.publish import publish_folder
from speculative.models import ModelLoadError, check_same_vocab, load_model, load_tokenizer, load_weights
from speculative.proposers import ChainedProposer, ControllerProposer, DraftModelProposer, NgramProposer
from speculative.runtime import make_runner

DRAFT_META = "osd_draft.json"
#: ``DraftConfig.checkpoint = "default"`` names the general starting draft that ``osd distill`` writes.
DEFAULT_CHECKPOINT = "default"


def default_draft_path(kind: str = "truncated") -> Path:
    """Where ``osd distill`` caches the general starting draft: one for token drafts, one for
    feature drafts (``--kind feature``)."""
    from config import cache_dir

    return cache_dir() / "drafts" / ("default-feature" if kind == "feature" else "default")


def prompt_digest(text: str) -> str:
    """Short stable id of a prompt text (what a saved draft lists as its training prompts)."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def read_meta(path: str | Path) -> dict:
    """The ``meta`` a saved draft or adapter folder carries ({} when it has none or is neither);
    ``"shipped"`` is the package's starting adapter."""
    folder = adapter_folder(str(path))
    for name in (DRAFT_META, ADAPTER_META):
        if (folder / name).exists():
            return json.loads((folder / name).read_text()).get("meta", {})
    return {}


def trained_prompts(path: str | Path) -> set[str]:
    """Digests (:func:`prompt_digest`) of the prompts a saved draft was distilled on; empty when
    its meta does not list them (``osd train-draft`` / ``osd distill`` write ``trained_prompts``)."""
    return set(read_meta(path).get("trained_prompts", []))


def resolve_checkpoint(name: str, kind: str = "truncated") -> Path:
    """A checkpoint folder, or the general starting draft of ``kind`` for ``"default"`` (refused if
    not built yet)."""
    if name != DEFAULT_CHECKPOINT:
        return Path(name)
    path = default_draft_path(kind)
    if not (path / DRAFT_META).exists():
        how = "osd distill --kind feature" if kind == "feature" else "osd distill"
        raise ModelLoadError(f"no default starting draft at {path}: build it once with `{how}`")
    return path
DRAFT_WEIGHTS = "weights.safetensors"


def _draft_config(target: PreTrainedModel, num_layers: int, tie: bool):
    cfg = copy.deepcopy(target.config)
    if num_layers > cfg.num_hidden_layers:
        raise ValueError(f"draft num_layers {num_layers} > target layers {cfg.num_hidden_layers}")
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    cfg.tie_word_embeddings = tie
    return cfg


def truncated_draft(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The target's embeddings, first ``num_layers`` decoder layers, final norm and head, copied.

    A fresh model is built from a config with fewer layers (so each layer carries its own
    ``layer_idx`` for the cache) and the matching weights are copied in: training it never
    touches the target.
    """
    draft = AutoModelForCausalLM.from_config(
        _draft_config(target, num_layers, target.config.tie_word_embeddings), dtype=target.dtype
    )
    own = draft.state_dict()
    missing = draft.load_state_dict({k: v.clone() for k, v in target.state_dict().items() if k in own}, strict=False)
    if missing.missing_keys:
        raise RuntimeError(f"truncated draft: weights not found in the target: {missing.missing_keys[:5]}")
    return draft.eval()


def fresh_draft(target: PreTrainedModel, num_layers: int, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised ``num_layers``-layer model of the target's architecture; embeddings,
    final norm and head are copies of the target's (the vocabulary geometry is kept)."""
    with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG
        torch.manual_seed(seed)
        draft = AutoModelForCausalLM.from_config(
            _draft_config(target, num_layers, target.config.tie_word_embeddings), dtype=target.dtype
        )
    t = target.state_dict()
    shared = {k: t[k].clone() for k in draft.state_dict() if not k.startswith("model.layers.") and k in t}
    draft.load_state_dict(shared, strict=False)
    return draft.eval()


def restrict_head(draft: PreTrainedModel, keep_ids: torch.Tensor) -> PreTrainedModel:
    """Replace the draft's output head by one over ``keep_ids`` ([N] target ids) only (untied, trainable)."""
    head = draft.get_output_embeddings()
    new = torch.nn.Linear(head.in_features, len(keep_ids), bias=False, dtype=head.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(head.weight[keep_ids])
    draft.config.tie_word_embeddings = False
    draft.set_output_embeddings(new)
    return draft


def frequent_token_ids(
    tokenizer: PreTrainedTokenizerBase, n: int, texts: Iterable[str] = (), always: Iterable[int] = ()
) -> torch.Tensor:
    """The n ids to keep in a restricted head: special tokens, then the most frequent ids in
    ``texts``, then the lowest ids (byte-level BPE numbers frequent merges first). Sorted."""
    vocab = len(tokenizer)
    n = min(n, vocab)
    chosen: dict[int, None] = dict.fromkeys(i for i in list(always) + list(tokenizer.all_special_ids) if i < vocab)
    counts: Counter[int] = Counter()
    for t in texts:
        counts.update(tokenizer(t)["input_ids"])
    for i, _ in counts.most_common():
        if len(chosen) >= n:
            break
        chosen.setdefault(i, None)
    i = 0
    while len(chosen) < n:
        chosen.setdefault(i, None)
        i += 1
    return torch.tensor(sorted(list(chosen)[:n]), dtype=torch.long)


# -- checkpoints -----------------------------------------------------------------------------------
def save_draft(draft: PreTrainedModel, path: str | Path, keep_ids: torch.Tensor | None = None, meta: dict | None = None):
    """Write a draft atomically: config + weights + keep_ids + meta in one folder, by the rule of
    ``speculative.publish`` (one writer under the parent's lock, fsynced, renamed into place; a
    draft saved again over ``path`` is swapped in whole, so ``path`` always names a whole draft)."""
    feature = getattr(draft, "uses_features", False)  # a FeatureDraft keeps its own head
    state = {k: v.detach().contiguous().clone() for k, v in draft.state_dict().items()}
    if draft.config.tie_word_embeddings and not feature:
        state.pop("lm_head.weight", None)
    info = {
        "arch": "feature" if feature else "causal_lm",
        "config": draft.config.to_dict(),
        "keep_ids": keep_ids.tolist() if keep_ids is not None else None,
        "meta": meta or {},
        "adapter_rank": adapter_rank(draft),  # 0: none (a draft with adapters loads with them)
    }

    def write(tmp: Path) -> None:
        save_file(state, tmp / DRAFT_WEIGHTS)
        (tmp / DRAFT_META).write_text(json.dumps(info))

    publish_folder(path, write, complete=lambda p: (p / DRAFT_META).is_file(), replace=True)


def load_draft(path: str | Path) -> tuple[PreTrainedModel, torch.Tensor | None, dict]:
    path = Path(path)
    if not (path / DRAFT_META).exists():
        raise ModelLoadError(f"not a saved draft (no {DRAFT_META}): {path}")
    info = json.loads((path / DRAFT_META).read_text())
    cfg_dict = dict(info["config"])
    cfg = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    keep = torch.tensor(info["keep_ids"], dtype=torch.long) if info["keep_ids"] is not None else None
    if info.get("arch") == "feature":
        from speculative.feature_draft import FeatureDraft

        draft = FeatureDraft(cfg, len(keep) if keep is not None else cfg.vocab_size)
        _load_exactly(draft, path)
        return draft.eval(), keep, info["meta"]
    draft = AutoModelForCausalLM.from_config(cfg)
    if keep is not None:
        draft = restrict_head(draft, keep)
    if info.get("adapter_rank"):
        add_adapters(draft, int(info["adapter_rank"]))
    # a tied head is not saved (save_draft): it is the embedding, tied again below
    _load_exactly(draft, path, may_lack={"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if cfg.tie_word_embeddings:
        draft.tie_weights()
    return draft.eval(), keep, info["meta"]


def _load_exactly(draft: torch.nn.Module, path: Path, may_lack: set[str] = frozenset()) -> None:
    """The saved weights into ``draft``, refused unless they are every tensor it has (``may_lack``
    aside) and nothing else: a cut or edited file must not leave layers at their random start."""
    missing, unexpected = draft.load_state_dict(load_file(path / DRAFT_WEIGHTS), strict=False)
    missing = sorted(set(missing) - set(may_lack))
    if missing or unexpected:
        raise ModelLoadError(f"saved draft {path} does not match its config: missing {missing[:4]}, "
                             f"unexpected {sorted(unexpected)[:4]}")


# -- adapters -----------------------------------------------------------------------------------------
ADAPTER_META = "osd_adapter.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
#: the general starting adapter shipped with the package (``draft.adapter: shipped``)
SHIPPED_ADAPTER = "shipped"


def shipped_adapter_path() -> Path:
    return Path(__file__).resolve().parent / "starting"


def adapter_folder(name: str) -> Path:
    """The folder ``name`` names: the package's starting adapter for ``"shipped"``, else itself."""
    return shipped_adapter_path() if name == SHIPPED_ADAPTER else Path(name)


def save_adapter(draft: PreTrainedModel, path: str | Path, base: dict, meta: dict | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> int:
    """Write ``draft``'s adapters alone (not its base weights) as a folder, in ``dtype`` (bfloat16
    halves the file; what is served is what was saved). ``base`` names the draft they sit on
    (kind, num_layers, head_vocab, the target's vocabulary size), checked when they are loaded.
    Returns the file's size in bytes."""
    state = {k: v.detach().to(dtype).contiguous() for k, v in adapter_state(draft).items()}
    if not state:
        raise ValueError("save_adapter: the draft has no adapters")
    info = {"rank": adapter_rank(draft), "head": any(k.startswith("lm_head.") for k in state), "base": base,
            "dtype": str(dtype).removeprefix("torch."), "meta": meta or {}}

    def write(tmp: Path) -> None:
        save_file(state, tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_META).write_text(json.dumps(info, indent=1))

    publish_folder(path, write, complete=lambda p: (p / ADAPTER_META).is_file(), replace=True)
    return (Path(path) / ADAPTER_WEIGHTS).stat().st_size


def read_adapter(name: str | Path, base: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapters saved at ``name`` (a folder, or ``"shipped"``) in float32, and their meta, after
    checking they were trained on the same ``base``."""
    path = adapter_folder(str(name))
    if not (path / ADAPTER_META).is_file():
        raise ModelLoadError(f"not a saved adapter (no {ADAPTER_META}): {path}")
    info = json.loads((path / ADAPTER_META).read_text())
    if info["base"] != base:
        raise ModelLoadError(f"adapter {name} was trained on the draft {info['base']}, this draft is {base}")
    return {k: v.float() for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()}, info["meta"]


def load_adapter(draft: PreTrainedModel, name: str, base: dict) -> dict:
    """Put the adapters saved at ``name`` on ``draft``, in place (:func:`read_adapter`); returns their meta."""
    state, meta = read_adapter(name, base)
    load_state(draft, state)
    return meta


def adapter_base(cfg: DraftConfig, target: PreTrainedModel) -> dict:
    """What a draft's adapters depend on: its kind, depth, head and the target's vocabulary."""
    return {"kind": cfg.kind, "num_layers": cfg.num_layers, "head_vocab": cfg.head_vocab,
            "target_vocab": int(target.config.vocab_size), "hidden": int(target.config.hidden_size)}


# -- from config -------------------------------------------------------------------------------------
def build_draft_model(
    cfg: DraftConfig, target: PreTrainedModel, target_tok: PreTrainedTokenizerBase, texts: Iterable[str] = ()
) -> tuple[PreTrainedModel, torch.Tensor | None]:
    """The learned draft a config asks for (not for kind ngram/none)."""
    if cfg.checkpoint:
        draft, keep, _ = load_draft(resolve_checkpoint(cfg.checkpoint, cfg.kind))
        if getattr(draft, "uses_features", False) != (cfg.kind == "feature"):
            raise ValueError(f"draft checkpoint {cfg.checkpoint} is {'a' if cfg.kind != 'feature' else 'not a'} "
                             f"feature draft, but draft.kind is {cfg.kind!r}")
        if cfg.feature_layers and list(draft.feature_layers) != list(cfg.feature_layers):
            raise ValueError(f"draft checkpoint {cfg.checkpoint} reads the target's layers {list(draft.feature_layers)}, "
                             f"draft.feature_layers asks for {list(cfg.feature_layers)}")
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft checkpoint {cfg.checkpoint} has vocab {draft.config.vocab_size}, target "
                f"{target_tok.name_or_path!r} has {target.config.vocab_size}"
            )
        return draft.to(target.device), keep
    if cfg.kind == "truncated":
        draft = truncated_draft(target, cfg.num_layers)
    elif cfg.kind == "fresh":
        draft = fresh_draft(target, cfg.num_layers)
    elif cfg.kind == "feature":
        from speculative.feature_draft import feature_draft

        keep = frequent_token_ids(target_tok, cfg.head_vocab, texts) if cfg.head_vocab else None
        return feature_draft(target, keep, cfg.feature_layers).to(target.device), keep
    else:  # path
        assert cfg.path is not None  # DraftConfig checks it
        check_same_vocab(target_tok, load_tokenizer(cfg.path))  # refused before any weights load
        draft = load_weights(ModelConfig(name=cfg.path, dtype=str(target.dtype).removeprefix("torch.")))
    keep = None
    if cfg.head_vocab:
        keep = frequent_token_ids(target_tok, cfg.head_vocab, texts)
        draft = restrict_head(draft, keep)
    if cfg.adapter:
        load_adapter(draft, cfg.adapter, adapter_base(cfg, target))
    return draft.to(target.device).eval(), keep


def build_proposer(
    cfg: DraftConfig, target: PreTrainedModel, target_tok: PreTrainedTokenizerBase, texts: Iterable[str] = (),
    quantize: str = "none",
):
    """The proposer for ``cfg``: None (no proposer: target only), one proposer, or the listed ones
    tried in their order or chosen per step by the controller (``cfg.select``). The learned draft
    runs on the runtime ``quantize`` names (as the target's; ``ModelConfig.quantize``)."""
    parts = []
    for name in cfg.proposers:
        if name == "suffix":
            from speculative.suffix import SuffixProposer  # needs arctic-inference: only when asked for

            parts.append(SuffixProposer(cfg.suffix))
        elif name == "ngram":
            parts.append(NgramProposer(cfg.ngram))
        elif cfg.kind == "feature":
            from speculative.feature import FeatureDraftProposer, FeatureRunner
            from speculative.runtime import resolve_quantize

            draft, keep = build_draft_model(cfg, target, target_tok, texts)
            mode = resolve_quantize(quantize, target)  # the draft's head in the runtime's bits
            runner = FeatureRunner(draft, keep, head_bits={"int4": 4, "int8": 8}.get(mode))
            parts.append(FeatureDraftProposer(runner, target.config.vocab_size))
        else:
            draft, keep = build_draft_model(cfg, target, target_tok, texts)
            parts.append(DraftModelProposer(make_runner(draft, quantize, keep, name="draft", draft=True), target.config.vocab_size,
                                            cfg.context_tokens))
    if not parts:
        return None
    if cfg.select == "controller":
        return ControllerProposer(*parts, probe_every=cfg.controller.probe_every)
    return parts[0] if len(parts) == 1 else ChainedProposer(*parts)


def domain_proposers(cfg: DraftConfig, target: PreTrainedModel, target_tok: PreTrainedTokenizerBase,
                     texts: Iterable[str] = (), quantize: str = "none") -> dict:
    """{domain: the proposer ``cfg`` builds from that domain's starting draft} for
    ``cfg.domain_checkpoints`` (the same composition: suffix tree, prompt lookup, controller)."""
    return {d: build_proposer(cfg.model_copy(update={"checkpoint": path, "domain_checkpoints": {}}), target, target_tok,
                              texts, quantize=quantize)
            for d, path in cfg.domain_checkpoints.items()}


def controller_over(learned=None, cfg: DraftConfig = DraftConfig()):
    """The controller over a fresh suffix tree, prompt lookup and ``learned`` (an existing learned
    draft's proposer, when given): what the experiments and the bench compare, with ``cfg``'s
    settings of each."""
    from speculative.suffix import SuffixProposer

    parts = [SuffixProposer(cfg.suffix), NgramProposer(cfg.ngram)] + ([learned] if learned is not None else [])
    return ControllerProposer(*parts, probe_every=cfg.controller.probe_every)


def build_engine(cfg: EngineConfig = EngineConfig(), texts: Iterable[str] = (), calibrate: bool = True) -> SpeculativeEngine:
    """Load the target, build the proposer the config names, return the engine (the one place that
    wires an in-process engine from an :class:`config.EngineConfig`).

    ``texts`` (e.g. workload prompts) choose the tokens a restricted draft head keeps.
    """
    if cfg.model.num_threads:
        torch.set_num_threads(cfg.model.num_threads)
    target, tok = load_model(cfg.model)
    proposer = build_proposer(cfg.draft, target, tok, texts, quantize=cfg.model.quantize)
    engine = SpeculativeEngine(make_runner(target, cfg.model.quantize, name="target", compile=cfg.model.compile),
                               tok, proposer, cfg)
    engine.target.warmup()  # CUDA graphs of one sequence's steps, before the first request is timed
    if calibrate:
        engine.calibrate()
    return engine
