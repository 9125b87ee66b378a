"""The proposers' settings (n-gram lookup, suffix trees, the controller, the learned draft) and the k policy's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import _Strict


class NgramConfig(_Strict):
    """Prompt-lookup proposer: match the last n tokens in the context, propose what followed."""

    max_n: int = Field(default=3, ge=1)
    min_n: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _order(self) -> "NgramConfig":
        if self.min_n > self.max_n:
            raise ValueError(f"ngram.min_n ({self.min_n}) must be <= ngram.max_n ({self.max_n})")
        return self


class SuffixConfig(_Strict):
    """Suffix-tree proposer over past traffic (SuffixDecoding, arXiv 2411.04975; the tree is
    ``arctic_inference.suffix_decoding``). Each scope (a domain, and a tenant when its training is
    isolated) keeps one tree over the outputs of the requests it served, fed as they are generated;
    every request also matches its own prompt and output. A step proposes the most frequent
    continuation of the longest-matching suffix of the context, at most ``spec_factor`` x the match
    length + ``spec_offset`` tokens (and the k policy's cap), stopping where a token's estimated
    probability falls below ``min_token_prob``. Bounds: ``max_requests`` and ``max_tokens`` of
    cached outputs per scope (oldest evicted first), ``max_scopes`` trees (least recently used
    evicted first); memory is at most ``max_tokens`` x ``max_depth`` tree nodes a scope."""

    max_depth: int = Field(default=64, ge=2, le=1024)  # longest context suffix matched (tree depth)
    max_requests: int = Field(default=1024, ge=1)  # cached outputs per scope
    max_tokens: int = Field(default=131_072, ge=16)  # cached output tokens per scope
    max_scopes: int = Field(default=64, ge=1)
    spec_factor: float = Field(default=1.0, gt=0.0, le=64.0)
    spec_offset: float = Field(default=0.0, ge=0.0, le=64.0)
    min_token_prob: float = Field(default=0.1, ge=0.0, le=1.0)


class ControllerConfig(_Strict):
    """Per-step choice among the proposers (suffix tree, prompt lookup, learned draft, none) by
    expected tokens per unit of cost, S(k) maximised over k, from each proposer's live acceptance
    in this request (a new request starts from its domain's) and its measured cost. The best
    proposer that has something to propose drafts the step; a proposer not tried for
    ``probe_every`` steps of a request drafts the next step it can, so a proposer that got
    better (a draft that learned, a tree that filled) is noticed."""

    probe_every: int = Field(default=8, ge=1)


def layer_list(text: str) -> list[int]:
    """``"2,15"`` -> ``[2, 15]``: the command-line form of ``DraftConfig.feature_layers``."""
    return [int(x) for x in text.split(",") if x.strip()]


#: the proposers a config can list: the suffix tree over past traffic, prompt lookup, the learned draft
ProposerName = Literal["suffix", "ngram", "draft"]


class DraftConfig(_Strict):
    """The proposers: which ones a request's steps may use, and how a step picks among them.

    ``proposers``, in order (empty: target-only decoding):
      - ``suffix``: the suffix tree over past traffic (settings: ``suffix``)
      - ``ngram``: prompt lookup in the request's own tokens (settings: ``ngram``)
      - ``draft``: the learned draft model (``kind`` and the fields after it)
    ``select``: ``order`` tries them in the list's order and the first with something to propose
    drafts the step; ``controller`` picks per step the one with the best expected tokens per unit
    of cost (settings: ``controller``, :class:`ControllerConfig`).

    The learned draft, ``kind``:
      - ``truncated``: the target's first ``num_layers`` decoder layers + final norm + head (copied, trainable)
      - ``fresh``: a randomly initialised ``num_layers``-layer model of the target's architecture
        sharing (a copy of) the target's embeddings
      - ``path``: any causal LM at ``path`` (must share the target's vocabulary)
      - ``feature``: one decoder layer over the target's own features (EAGLE-style,
        ``speculative.feature_draft``), initialised from the target's last layer, learned online
    ``head_vocab``: keep only the N most frequent target tokens in the draft's output head
    (the 49152-row head dominates a small draft's cost); ids are mapped back to the target's.
    ``checkpoint``: a saved draft (``osd train-draft`` output) to load instead of building one;
    ``"default"`` is the general starting draft that ``osd distill`` builds and caches.
    ``feature_layers`` (kind ``feature``): target decoder layers (0-based, before the last) whose
    outputs the draft fuses with the final feature (EAGLE-3 takes a low, a middle and a high one);
    empty: the final feature alone. A checkpoint keeps the layers it was trained with.
    ``adapter``: low-rank adapters to start the built draft (kind ``truncated``) from: a folder that
    ``osd train-draft --adapter-rank R`` wrote, or ``"shipped"``, the general adapter that comes with
    the package for the embedded target's 2-layer draft (``drafts/starting``). Online learning then
    trains these adapters per domain.
    """

    proposers: list[ProposerName] = ["draft"]
    select: Literal["order", "controller"] = "order"
    ngram: NgramConfig = NgramConfig()
    suffix: SuffixConfig = SuffixConfig()
    controller: ControllerConfig = ControllerConfig()
    kind: Literal["truncated", "fresh", "path", "feature"] = "truncated"
    num_layers: int = Field(default=2, ge=1)
    path: str | None = None
    head_vocab: int | None = Field(default=None, ge=16)
    checkpoint: str | None = None
    feature_layers: list[int] = []
    adapter: str | None = None
    #: the learned token draft reads at most the last N tokens of a sequence when it first proposes
    #: for it (None: the whole prompt). Its own prefill of a long prompt otherwise costs about what
    #: a short answer's drafting saves (docs/proposers.md, "What a better draft would buy")
    context_tokens: int | None = Field(default=None, ge=16)
    #: named domain -> a saved draft of this kind (``osd distill --domain D --out DIR``) that the
    #: domain's own draft starts from instead of the one above; a language variant without one
    #: takes its domain's (d-chat-es: "chat/es", else "chat"); tenants' copies their draft's
    domain_checkpoints: dict[str, str] = {}

    @property
    def learned(self) -> bool:
        """Whether a learned draft model is among the proposers."""
        return "draft" in self.proposers

    @model_validator(mode="before")
    @classmethod
    def _one_way(cls, data):
        """Settings of the earlier form, refused with the way to write them now."""
        if not isinstance(data, dict):
            return data
        old = [k for k in ("ngram_first", "use_suffix") if k in data]
        if old or data.get("kind") in ("ngram", "suffix", "none"):
            raise ValueError(
                f"draft.{old[0] if old else 'kind: ' + str(data['kind'])} is gone: list the proposers in draft.proposers "
                "(suffix, ngram, draft, in the order tried), e.g. proposers: [suffix, ngram, draft]; [ngram] for prompt "
                "lookup alone; [] for target-only decoding")
        if "controller" in data and "select" not in data:
            raise ValueError("draft.controller holds the controller's settings; choose it with draft.select: controller "
                             "(or select: order to keep a fixed order)")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "DraftConfig":
        if len(set(self.proposers)) != len(self.proposers):
            raise ValueError(f"draft.proposers lists a proposer twice: {self.proposers}")
        if self.select == "controller" and not self.proposers:
            raise ValueError("draft.select: controller needs at least one proposer in draft.proposers")
        if self.kind == "path" and not self.path:
            raise ValueError("draft.kind='path' needs draft.path (a model folder or HF id)")
        if self.domain_checkpoints and not self.learned:
            raise ValueError(f"draft.domain_checkpoints needs a learned draft ('draft' in draft.proposers), not {self.proposers}")
        if self.adapter and (self.kind != "truncated" or self.checkpoint or not self.learned):
            raise ValueError(f"draft.adapter starts a built truncated draft, not kind={self.kind!r}"
                             f"{' with a checkpoint' if self.checkpoint else ''}"
                             f"{'' if self.learned else ' without a draft in draft.proposers'}")
        if self.feature_layers and self.kind != "feature":
            raise ValueError(f"draft.feature_layers is for draft.kind='feature', not {self.kind!r}")
        if len(set(self.feature_layers)) != len(self.feature_layers) or any(i < 0 for i in self.feature_layers):
            raise ValueError(f"draft.feature_layers must be distinct layer indices >= 0, got {self.feature_layers}")
        return self


class KPolicyConfig(_Strict):
    """How many tokens to propose per step.

    With ``fixed_k`` set, always that many. Otherwise adaptive: from a running acceptance
    estimate a and the measured costs (draft seconds per token, target seconds to verify j
    tokens) pick the k in 0..k_max that maximises expected tokens per second,
    (1 - a^(k+1)) / (1 - a) / (k * t_draft + t_verify(k + 1)). k = 0 is plain target decoding.
    """

    k_max: int = Field(default=6, ge=0, le=32)
    fixed_k: int | None = Field(default=None, ge=0, le=32)
    prior_alpha: float = Field(default=0.6, ge=0.0, le=1.0)
    ema: float = Field(default=0.15, gt=0.0, le=1.0)
    probe_every: int = Field(default=8, ge=1)

    @model_validator(mode="after")
    def _fixed_within_max(self) -> "KPolicyConfig":
        if self.fixed_k is not None and self.fixed_k > self.k_max:
            raise ValueError(f"k.fixed_k ({self.fixed_k}) must be <= k.k_max ({self.k_max})")
        return self
