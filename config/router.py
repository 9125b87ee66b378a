"""The query router's settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import _Strict


#: Languages py3langid may answer by default: widely used languages plus every language of the
#: chatterbot-corpus (restricting the label set avoids labels such as "la" or "an" on short
#: English requests, and lifts accuracy on short texts; see ``osd route``).
ROUTER_LANGUAGES: tuple[str, ...] = (
    "ar", "bn", "cs", "da", "de", "el", "en", "es", "fa", "fi", "fr", "he", "hi", "hu", "id",
    "it", "ja", "ko", "mr", "nl", "no", "or", "pl", "pt", "ro", "ru", "sv", "ta", "te", "th",
    "tr", "uk", "ur", "vi", "yo", "zh",
)


class EmbedderConfig(_Strict):
    """The sentence embedder (MiniLM) that routing reads: input length, runtime, cache, threads."""

    max_chars: int = Field(default=2000, ge=16)  # text cut before language id and embedding
    #: MiniLM input length in word pieces: a new source of a known domain often names its topic
    #: late (a schema before the question, a story before the sum); why 128: docs/routing.md
    max_tokens: int = Field(default=128, ge=8, le=512)
    #: A text longer than ``max_tokens`` word pieces is embedded twice, its first and its last
    #: ``max_tokens`` pieces, and its feature is the normalised mean: the code after a long task
    #: statement, the question after a schema; a long text costs a second embedding (docs/routing.md)
    tail_embedding: bool = True
    #: MiniLM runtime. "onnx": onnxruntime on a graph exported once from the torch model (cached
    #: under cache_dir()/router; the same embeddings to ~1e-7); "torch": sentence-transformers
    #: (their latencies: docs/routing.md)
    backend: Literal["torch", "onnx"] = "onnx"
    #: int8 weights with dynamically quantized activations (faster, the same routes: docs/routing.md).
    #: Activations are then scaled per batch, so texts are embedded one at a time (a query's
    #: embedding must not depend on its neighbours in a batch).
    quantize: bool = True
    #: embeddings of this many distinct recent texts are kept (LRU by cleaned text): multi-turn
    #: conversations re-send their history; 0 = off. 384 float32 each (4096: 6 MiB).
    embed_cache: int = Field(default=4096, ge=0)
    batch_size: int = Field(default=32, ge=1)
    threads: int = Field(default=1, ge=1)  # torch / onnxruntime threads for the embedder


class LanguageConfig(_Strict):
    """Language identification (py3langid) and how languages split domains."""

    languages: tuple[str, ...] | None = ROUTER_LANGUAGES  # None: all 97 py3langid languages
    #: language prior from labelled traffic (Router.fit with langs): languages never seen there
    #: weigh this much against the seen ones (1 = no prior)
    lang_prior_unseen: float = Field(default=0.1, gt=0.0, le=1.0)
    #: Domains whose queries form one mode per language ("chat" -> "chat/fr"); "*" for all.
    lang_split_domains: tuple[str, ...] = ("chat",)
    base_lang: str = "en"  # queries in this language keep the bare domain name


class ClassifierConfig(_Strict):
    """The classifier of named domains, fitted on labelled examples (``RouterConfig.examples``)."""

    confidence_threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    classifier_c: float = Field(default=10.0, gt=0.0)  # inverse L2 strength of the logistic regression
    #: Named domains that stand for open-ended traffic: the classifier's label is taken only when
    #: the query is also typical of the label's examples (else: online clusters). A logistic
    #: regression sends traffic of domains no label names to its broadest class ("chat"), and a
    #: new source of a topical domain (code, SQL, math) is best recognised by the classifier's
    #: direction, not by distance: measured by ``osd route --open`` (docs/routing.md). "*": all.
    open_domains: tuple[str, ...] = ("chat",)
    #: the classifier also reads a TF-IDF of the character n-grams of the whole text beside the
    #: embedding (a domain's symbols hold across its sources: docs/routing.md)
    lexical: bool = True
    #: records of general sources in the examples (``workloads.GENERAL_SOURCES``: ShareGPT's first
    #: turns) train a background class, "none of the named domains", routed to clusters; False: left out
    background: bool = True
    #: background examples that a classifier of the named examples gives to a topical (not open)
    #: domain with at least this probability are dropped (general traffic holds code, SQL, math)
    background_filter: float = Field(default=0.5, gt=0.0, le=1.0)
    #: of those, the ones given to their domain with at least this probability become examples of
    #: it instead of being dropped (general traffic's code, SQL and math requests widen those
    #: domains' examples); None: all are dropped
    background_relabel: float | None = Field(default=None, gt=0.0, le=1.0)
    #: n-grams first: a second logistic regression reads the character n-grams alone (about 1 ms),
    #: and a query it gives to a topical (not open) domain with at least this probability is routed
    #: there without being embedded (the embedding is most of a query's time); None: every query is
    #: embedded (what it saves and changes: docs/routing.md)
    lexical_gate: float | None = Field(default=0.9, gt=0.5, le=1.0)
    typical_k: int = Field(default=1, ge=1)  # typicality: mean similarity to this many nearest examples
    #: held-out in-domain queries called atypical (the threshold is this quantile of held-out scores)
    typical_quantile: float = Field(default=0.2, ge=0.0, lt=1.0)


class ClusterConfig(_Strict):
    """Discovered domains: online clusters of embeddings, one set per language."""

    cluster_threshold: float = Field(default=0.6, gt=0.0, lt=2.0)  # cosine distance to join a cluster
    min_cluster_size: int = Field(default=5, ge=1)
    noise_ttl: int = Field(default=200, ge=1)  # records a cluster has to reach min_cluster_size
    max_clusters: int = Field(default=256, ge=1)


class DraftLifecycleConfig(_Strict):
    """Which domains get a draft of their own, and when a draft is retired."""

    spawn_min_records: int = Field(default=20, ge=1)  # a cluster this busy ...
    spawn_window: int = Field(default=200, ge=1)  # ... within this many records ...
    spawn_alpha: float = Field(default=0.5, ge=0.0, le=1.0)  # ... at acceptance below this gets a draft
    spawn_min_tokens: int = Field(default=64, ge=1)  # proposed tokens needed to judge acceptance
    idle_retire_records: int = Field(default=2000, ge=1)  # a cluster unseen this long is retired
    idle_retire_s: float | None = Field(default=None, gt=0.0)  # ... or unseen this many seconds
    max_drafts: int = Field(default=8, ge=1)  # drafts in memory, the general draft included
    #: a named domain (a language variant too: "chat/es") gets a draft of its own, ``d-<domain>``
    #: ("d-chat-es"), the first time the classifier names it (a spawn event; the least used draft
    #: makes room at ``max_drafts``), which then trains on that domain's traffic alone; False: named
    #: domains share the general draft and only busy clusters get drafts
    named_drafts: bool = True


class BanditConfig(_Strict):
    """The choice of draft per domain by observed acceptance (Thompson sampling)."""

    explore_rate: float = Field(default=0.05, ge=0.0, le=1.0)  # uniform pick on top of Thompson sampling
    prior: tuple[float, float] = (1.0, 1.0)  # Beta prior of a draft's acceptance (accepted, rejected)
    decay: float = Field(default=0.995, gt=0.0, le=1.0)  # forgetting per observation (drifting drafts)
    seed: int = 0

    @field_validator("prior")
    @classmethod
    def _positive_prior(cls, v: tuple[float, float]) -> tuple[float, float]:
        if min(v) <= 0:
            raise ValueError("prior pseudo-counts must be > 0")
        return v


class RouterConfig(_Strict):
    """The query router: features, domains (named by a classifier or discovered by clustering)
    and the choice of draft by observed acceptance.

    mode: ``supervised`` routes by the classifier's label (below ``classifier.confidence_threshold``
    to the general draft); ``clusters`` by online clusters of embeddings, split by language; ``both``
    by the label when the classifier is confident and by cluster otherwise. Counts marked "records"
    are routed queries (the router's clock), so behaviour does not depend on wall time. The
    settings of each part are a section of their own: ``embedder``, ``language``, ``classifier``,
    ``clusters``, ``drafts`` (which domains get drafts) and ``bandit`` (the choice among them).
    """

    mode: Literal["supervised", "clusters", "both"] = "both"
    #: labelled examples (a workload JSONL, e.g. bench/data/router_train.jsonl) the classifier is
    #: fitted on when a router deployment starts without a saved state: in modes supervised / both
    #: it routes by them; in mode clusters they only name the discovered domains close to one
    #: (``... (near sql)``); None: no classifier unless a saved router brings one
    examples: str | None = None
    embedder: EmbedderConfig = EmbedderConfig()
    language: LanguageConfig = LanguageConfig()
    classifier: ClassifierConfig = ClassifierConfig()
    clusters: ClusterConfig = ClusterConfig()
    drafts: DraftLifecycleConfig = DraftLifecycleConfig()
    bandit: BanditConfig = BanditConfig()

    @classmethod
    def section_of(cls, key: str) -> str | None:
        """The section that holds setting ``key`` (``threads`` -> ``embedder``); None for a top-level
        setting or an unknown name."""
        return next((name for name, info in cls.model_fields.items()
                     if key in getattr(info.annotation, "model_fields", {})), None)

    @model_validator(mode="before")
    @classmethod
    def _in_sections(cls, data):
        """A setting given at the top that a section holds is refused with where it goes now."""
        if isinstance(data, dict):
            for key in data:
                home = cls.section_of(key)
                if home is not None:
                    raise ValueError(f"router.{key} is now router.{home}.{key} (the router's settings are in sections)")
        return data
