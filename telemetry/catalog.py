"""Every metric the application exports: name, kind, meaning, labels, buckets.

Names follow Prometheus' conventions (``osd_`` prefix, base units, counters end in ``_total``) and
vLLM's spec-decode counters where the meaning is the same, so dashboards and benchmarks that
difference ``vllm:spec_decode_num_*`` work on ``osd_spec_decode_num_*``:

    acceptance rate          = num_accepted_tokens / num_draft_tokens
    mean acceptance length   = 1 + num_accepted_tokens / num_drafts
    acceptance at position i = num_accepted_tokens_per_pos{position=i} / num_drafts
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: seconds; from 5 ms (a routing call) to 2 min (a long completion on 2 CPU cores)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
#: per step: draft tokens proposed (k) or accepted (0..k)
K_BUCKETS = tuple(float(i) for i in range(0, 11))
BATCH_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


@dataclass(frozen=True)
class Family:
    name: str  # as exported (counters with their ``_total``)
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms: upper bounds, +Inf implied


def _families(*fs: Family) -> dict[str, Family]:
    return {f.name: f for f in fs}


SPEC = ("tenant", "domain", "language", "draft")

CATALOG: dict[str, Family] = _families(
    # -- requests (ingress) -----------------------------------------------------------------------
    Family("osd_requests_total", "counter", "Requests answered, by tenant and HTTP status (a stream that fails after its "
           "first byte counts as 500, one the client left as 499)", ("tenant", "status")),
    Family("osd_prompt_tokens_total", "counter", "Prompt tokens of answered requests", ("tenant", "status")),
    Family("osd_generation_tokens_total", "counter", "Output tokens of answered requests", ("tenant", "status")),
    Family("osd_requests_running", "gauge", "Requests in flight at the ingress"),
    Family("osd_requests_resumed_total", "counter", "Requests continued on another draft replica after theirs died "
           "mid-stream", ("tenant",)),
    Family("osd_time_to_first_token_seconds", "histogram", "Arrival at the ingress to the first output text",
           ("tenant",), LATENCY_BUCKETS),
    Family("osd_inter_token_latency_seconds", "histogram", "Gap between consecutive output chunks of a request (one "
           "speculative step: 1 to k+1 tokens)", ("tenant",), LATENCY_BUCKETS),
    Family("osd_time_per_output_token_seconds", "histogram", "Per request: (latency - time to first token) / "
           "(output tokens - 1)", ("tenant",), LATENCY_BUCKETS),
    Family("osd_e2e_request_latency_seconds", "histogram", "Arrival at the ingress to the last byte", ("tenant",),
           LATENCY_BUCKETS),
    # -- routing (ingress side of the router call; draft events from the router) -------------------
    Family("osd_router_latency_seconds", "histogram", "Routing call as the ingress waits for it (hop + batching + "
           "embedding)", (), LATENCY_BUCKETS),
    Family("osd_routes_total", "counter", "Routed requests by reason (classifier, cluster, bandit-explore, fallback) "
           "and domain", ("reason", "domain")),
    Family("osd_router_draft_events_total", "counter", "Drafts spawned for busy clusters and retired", ("kind",)),
    Family("osd_router_clusters", "gauge", "Live online clusters in the router"),
    Family("osd_domain_info", "gauge", "1 for each discovered domain with its readable name (its most characteristic "
           "words, refreshed as it grows; the domain label stays the stable id)", ("domain", "name")),
    Family("osd_router_drafts", "gauge", "Drafts the router can route to"),
    # -- speculative decoding (draft pool) ---------------------------------------------------------
    Family("osd_spec_decode_num_drafts_total", "counter", "Steps that proposed at least one draft token", SPEC),
    Family("osd_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed", SPEC),
    Family("osd_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted by the target", SPEC),
    Family("osd_spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted draft tokens at each position of "
           "the draft (0 = first)", ("draft", "position")),
    Family("osd_spec_decode_num_draft_tokens_per_pos_total", "counter", "Draft tokens proposed at each position "
           "(with adaptive k, the denominator of the acceptance at that position)", ("draft", "position")),
    Family("osd_spec_decode_num_steps_total", "counter", "Target verifications (speculative steps, including k = 0)",
           SPEC),
    Family("osd_spec_decode_emitted_tokens_total", "counter", "Output tokens of the speculative steps (over "
           "osd_spec_decode_num_steps_total: tokens per target step)", SPEC),
    Family("osd_spec_decode_step_cost_total", "counter", "The speculative steps' cost in target-only steps, v(k + 1) + "
           "k c by the engine's cost model (output tokens over it: the estimated speed-up over target-only decoding)",
           SPEC),
    Family("osd_spec_decode_proposer_draft_tokens_total", "counter", "Draft tokens proposed, by the proposer that "
           "drafted the step (draft = the learned draft, suffix, ngram)", ("tenant", "domain", "proposer")),
    Family("osd_spec_decode_proposer_accepted_tokens_total", "counter", "Draft tokens accepted, by the proposer that "
           "drafted the step", ("tenant", "domain", "proposer")),
    Family("osd_spec_decode_draft_version_draft_tokens_total", "counter", "Draft tokens proposed, by draft version "
           "(the newest keep_versions of each draft; older versions are added up under draft_version=\"old\")", ("draft", "draft_version")),
    Family("osd_spec_decode_draft_version_accepted_tokens_total", "counter", "Draft tokens accepted, by draft version",
           ("draft", "draft_version")),
    Family("osd_spec_decode_k", "histogram", "Draft length chosen per step", ("draft",), K_BUCKETS),
    Family("osd_spec_decode_accepted_length", "histogram", "Draft tokens accepted per step", ("draft",), K_BUCKETS),
    Family("osd_spec_decode_draft_seconds_total", "counter", "Time spent proposing in the draft pool", ("draft",)),
    Family("osd_spec_decode_verify_wait_seconds_total", "counter", "Time draft replicas waited for verification "
           "(hop + batching + target compute)", ("draft",)),
    Family("osd_draft_pool_requests_running", "gauge", "Requests being decoded in the draft pool"),
    Family("osd_draft_pool_drafts_loaded", "gauge", "Drafts loaded across the draft pool's replicas"),
    Family("osd_draft_pool_outputs_shared_total", "counter", "Finished outputs a draft replica sent to the others' "
           "suffix trees, or received from them (what a starting replica takes in included)", ("direction",)),
    Family("osd_draft_pool_learner_unanswered_total", "counter",
           "Drafts loaded with their starting weights because the learner did not answer in time", ("draft",)),
    # -- the engine loop of a replica (co-located placement) ---------------------------------------
    Family("osd_engine_requests_waiting", "gauge", "Requests queued for admission (waiting for KV budget)"),
    Family("osd_engine_kv_reserved_tokens", "gauge", "KV cache positions reserved by running requests"),
    Family("osd_engine_kv_capacity_tokens", "gauge", "KV cache positions the replicas' budgets hold"),
    Family("osd_engine_kv_bytes_per_token", "gauge", "Bytes of keys and values one cached position costs"),
    Family("osd_engine_prefix_cache_queried_tokens_total", "counter", "Prompt positions looked up in the prefix cache"),
    Family("osd_engine_prefix_cache_hit_tokens_total", "counter",
           "Prompt positions found in the prefix cache (not prefilled again)"),
    Family("osd_engine_prefix_cache_blocks", "gauge", "KV blocks indexed by the prefix cache (held or idle)"),
    Family("osd_engine_requests_overloaded_total", "counter",
           "Requests answered 503 because they waited too long for KV budget or the queue was full"),
    Family("osd_engine_prompt_scored_tokens_total", "counter",
           "Prompt positions scored for their log-probabilities (echo with logprobs, prompt_logprobs): "
           "one forward between two steps of the loop"),
    Family("osd_engine_prompt_scoring_seconds_total", "counter",
           "Time the loop spent scoring prompts, which the other requests waited"),
    Family("osd_engine_shared_steps_total", "counter",
           "Steps several decoding requests shared, by decision: drafting (the cap allowed drafts), cap_zero "
           "(the cost model allowed none), plain_measured (such steps measured faster decoding plainly)",
           ("decision",)),
    # -- target ----------------------------------------------------------------------------------
    Family("osd_target_queue_depth", "gauge", "Verify calls waiting for or in the target's batched forward"),
    Family("osd_target_kv_caches", "gauge", "Sequences whose KV cache the target holds"),
    Family("osd_target_batches_total", "counter", "Batched target forwards"),
    Family("osd_target_verify_calls_total", "counter", "Verify calls answered"),
    Family("osd_target_verified_tokens_total", "counter", "Tokens fed to the target (new context + draft tokens)"),
    Family("osd_target_cache_evictions_total", "counter", "KV caches dropped by TTL or LRU (the caller re-sends)"),
    Family("osd_target_batch_size", "histogram", "Verify calls per batched forward", (), BATCH_BUCKETS),
    Family("osd_target_forward_seconds", "histogram", "One batched target forward", (), LATENCY_BUCKETS),
    # -- learner ---------------------------------------------------------------------------------
    Family("osd_learner_records_total", "counter", "Replay records received from the draft pool", ("draft",)),
    Family("osd_learner_records_dropped_total", "counter", "Replay records dropped (the hand-over queue was full)"),
    Family("osd_learner_rounds_total", "counter", "Training rounds by result (published, rejected, yielded, empty)",
           ("draft", "result")),
    Family("osd_learner_rejected_total", "counter", "Rejected candidates by reason (non_finite, agreement_drop, other)",
           ("draft", "reason")),
    Family("osd_learner_steps_total", "counter", "Optimiser steps", ("draft",)),
    Family("osd_learner_rounds_cut_total", "counter", "Rounds ended after learner.trainer.min_steps_per_round steps "
           "because the next was due (traffic outpaced training)", ("draft",)),
    Family("osd_learner_train_seconds_total", "counter", "Time in optimiser steps (step time = rate of this / rate of "
           "steps)", ("draft",)),
    Family("osd_learner_against_traffic_seconds_total", "counter", "CPU seconds the learner trained while serving "
           "was busy (its floor, learner.background.min_share; rate of this = the share it took)"),
    Family("osd_learner_loss", "gauge", "Loss after the last round, on its batch", ("draft",)),
    Family("osd_learner_shard_records", "gauge", "Records in the draft's replay shard", ("draft",)),
    Family("osd_learner_shard_bytes", "gauge", "Bytes of the draft's replay shard on disk", ("draft",)),
    Family("osd_learner_broadcast_seconds", "histogram", "Publishing new weights to every draft replica", (),
           LATENCY_BUCKETS),
    Family("osd_learner_paused", "gauge", "1 while an operator has paused training"),
    Family("osd_learner_drafts_in_memory", "gauge", "Drafts whose trainer, replay shard and held-back records the learner holds in memory"),
    Family("osd_learner_parked_total", "counter", "Idle drafts taken out of the learner's memory (back from disk when used again)"),
    Family("osd_learner_forgotten_total", "counter", "Parked drafts deleted from disk, the least recently checkpointed beyond max_parked"),
    Family("osd_draft_version", "gauge", "Latest published version of each draft", ("draft",)),
)

#: label name -> the ``MetricsConfig`` field that caps its distinct values
CAPPED = {"tenant": "max_tenants", "domain": "max_domains", "language": "max_languages", "draft": "max_drafts"}
OTHER = "other"


def series_names(family: Family) -> list[str]:
    """The sample names a family exports (a histogram has three)."""
    if family.kind == "histogram":
        return [f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"]
    return [family.name]


def exported_series() -> set[str]:
    return {s for f in CATALOG.values() for s in series_names(f)}
