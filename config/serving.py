"""The Ray Serve deployments' settings: the target, the engine loop, the draft pool, the ingress and metrics."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import _Strict


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
    #: with ``batch_k_cap``: shared steps of each batch size draft only while such steps measured
    #: more output tokens per second drafting than decoding plainly (every 8th step tries the other)
    measured_drafting: bool = True
    #: a prompt starts after the longest prefix cached for an earlier request of the same tenant
    #: (a system prompt, a conversation re-sent), in whole blocks plus the matching head of one
    #: more; cached blocks no request holds are reused for new requests least recently used first
    prefix_cache: bool = True
    #: bytes of cached prefixes that no running request holds, kept at most (least recently used
    #: leave first): without a bound they fill the whole budget's pages in time, however little
    #: runs. None: bounded by the budget alone
    prefix_cache_bytes: int | None = Field(default=512 << 20, ge=0)
    #: with ``prefix_cache``: a request that has not started waits while an earlier one of the same
    #: tenant computes at least this many prompt positions it shares (the choices of one request, a
    #: burst of one system prompt), then starts from the cache instead of computing them again. 0: never
    share_prompt_min: int = Field(default=64, ge=0)
    #: Python's GIL switch interval in a process that runs an engine loop (``sys.setswitchinterval``,
    #: process-wide). The loop's thread lets the GIL go in every native kernel call; at Python's
    #: default, 5 ms, the replica's event loop or Ray's threads, taking it meanwhile, could keep it
    #: that long (measured: docs/serving.md, "The GIL's switch interval"). None: Python's default
    gil_switch_s: float | None = Field(default=0.0005, gt=0.0)


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
    #: choices one request may ask for (``n`` times its prompts): each runs as a sequence of its own,
    #: and counts as a request in flight for ``max_in_flight`` and the tenant's ``max_concurrent``
    max_choices: int = Field(default=16, ge=1)


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
