"""The target's batching replica in one process: concurrent verify calls in one forward, a call
whose cache is gone answered None, KV caches bounded by idle time and by count (least recently used
first), and what it counts. The real `BatchedTarget` (with `serve.batch`) on the tiny Llama; the
split placement's `Target` deployment wraps it under Ray Serve (tests/serve/)."""

from __future__ import annotations

import asyncio
import time

import torch

from config import ModelConfig, TargetServeConfig
from deployments.target import BatchedTarget
from inprocess import counter, hist
from speculative import ModelRunner, VerifyCall
from telemetry import Meter


def batched(target, meter=True, **cfg) -> BatchedTarget:
    return BatchedTarget(ModelConfig(name="unused", quantize="none"), TargetServeConfig(**cfg), weights=target,
                         meter=Meter("Target") if meter else None)


def test_concurrent_calls_share_one_forward_and_answer_as_alone(target, prompts, loop):
    bt = batched(target, max_batch=8, batch_wait_s=0.05)
    calls = [VerifyCall(f"s{i}", 0, list(p), rows=2) for i, p in enumerate(prompts)]

    async def all_at_once():
        return await asyncio.gather(*(bt.verify(c) for c in calls))
    t0 = time.perf_counter()
    rows = loop.run(all_at_once())
    elapsed = time.perf_counter() - t0
    alone = ModelRunner(target, name="alone").verify([VerifyCall("x", 0, list(prompts[2]), rows=2)])[0]
    assert torch.equal(rows[2].argmax, alone.argmax) and torch.allclose(rows[2].top_probs, alone.top_probs, atol=1e-5)
    assert all(r.batch == len(calls) for r in rows)
    assert bt.stats() == {"batches": 1, "calls": len(calls), "sequences": len(calls), "evicted": 0, "mean_batch": len(calls)}
    m = bt.meter
    assert counter(m, "osd_target_batches_total") == 1 and counter(m, "osd_target_verify_calls_total") == len(calls)
    assert counter(m, "osd_target_verified_tokens_total") == sum(len(p) for p in prompts)
    assert hist(m, "osd_target_batch_size") == (1, len(calls)) and hist(m, "osd_target_forward_seconds")[0] == 1
    assert 0 < hist(m, "osd_target_forward_seconds")[1] < elapsed
    assert bt.pending == 0
    bt.gauges()
    assert m._gauges[("osd_target_kv_caches", ())] == len(calls) and m._gauges[("osd_target_queue_depth", ())] == 0


def test_a_call_past_its_cache_is_answered_none_and_counted_nowhere(target, prompts, loop):
    bt = batched(target)
    p = list(prompts[0])
    assert loop.run(bt.verify(VerifyCall("s", 0, p, rows=1))) is not None
    assert loop.run(bt.verify(VerifyCall("s", len(p), [5], rows=1))) is not None  # extends its cache
    assert loop.run(bt.verify(VerifyCall("s", len(p) + 5, [5], rows=1))) is None  # starts past it
    assert loop.run(bt.verify(VerifyCall("never", 3, [5], rows=1))) is None
    assert bt.stats()["calls"] == 2 and counter(bt.meter, "osd_target_verify_calls_total") == 2
    assert counter(bt.meter, "osd_target_batches_total") == 2  # the batches of only refused calls ran nothing
    assert bt.stats()["batches"] == 4 and bt.stats()["mean_batch"] == 0.5
    bt.release("s")
    assert bt.runner.cached_length("s") == 0 and "s" not in bt.last_used
    assert loop.run(bt.verify(VerifyCall("s", len(p), [5], rows=1))) is None  # released: sent whole next


def test_idle_caches_are_evicted_but_not_those_in_the_batch(target, prompts, loop):
    bt = batched(target, cache_ttl_s=0.2)
    loop.run(bt.verify(VerifyCall("old", 0, list(prompts[0]), rows=1)))
    loop.run(bt.verify(VerifyCall("busy", 0, list(prompts[1]), rows=1)))
    time.sleep(0.25)
    loop.run(bt.verify(VerifyCall("busy", len(prompts[1]), [7], rows=1)))  # idle too, but in this batch
    assert set(bt.last_used) == {"busy"} and bt.runner.cached_length("old") == 0 and len(bt.runner) == 1
    assert bt.stats()["evicted"] == 1 and counter(bt.meter, "osd_target_cache_evictions_total") == 1


def test_past_max_sequences_the_least_recently_used_go(target, prompts, loop):
    bt = batched(target, max_sequences=2)
    for name, p in zip("abc", prompts):
        loop.run(bt.verify(VerifyCall(name, 0, list(p), rows=1)))
        time.sleep(0.01)
    assert set(bt.last_used) == {"b", "c"}  # three held, two allowed: a, the oldest, went
    loop.run(bt.verify(VerifyCall("b", len(prompts[1]), [4], rows=1)))  # b used again: c is now the oldest
    loop.run(bt.verify(VerifyCall("d", 0, list(prompts[3]), rows=1)))
    assert set(bt.last_used) == {"b", "d"} and bt.stats()["evicted"] == 2
    assert counter(bt.meter, "osd_target_cache_evictions_total") == 2


def test_without_a_meter_nothing_is_counted(target, prompts, loop):
    bt = batched(target, meter=False, cache_ttl_s=0.01)
    loop.run(bt.verify(VerifyCall("a", 0, list(prompts[0]), rows=1)))
    time.sleep(0.02)
    loop.run(bt.verify(VerifyCall("b", 0, list(prompts[1]), rows=1)))
    assert bt.stats()["evicted"] == 1 and bt.stats()["batches"] == 2


def test_idle_caches_count_against_the_bound_once_and_only_recent_ones_are_evicted_for_room(target, prompts, loop):
    """Idle caches go first; the bound then counts the caches left, and evicts for room only among
    those neither idle nor in the batch, least recently used first."""
    bt = batched(target, max_sequences=2, cache_ttl_s=0.5)
    loop.run(bt.verify(VerifyCall("a", 0, list(prompts[0]), rows=1)))
    time.sleep(0.3)
    loop.run(bt.verify(VerifyCall("c", 0, list(prompts[1]), rows=1)))
    time.sleep(0.3)  # a is idle now, c is not
    loop.run(bt.verify(VerifyCall("b", 0, list(prompts[2]), rows=1)))
    assert set(bt.last_used) == {"c", "b"} and bt.stats()["evicted"] == 1  # a for idling; c and b fit


def test_a_batch_over_the_bound_evicts_the_oldest_recent_cache_once(target, prompts, loop):
    bt = batched(target, max_sequences=2, cache_ttl_s=0.5, max_batch=8, batch_wait_s=0.05)
    loop.run(bt.verify(VerifyCall("a", 0, list(prompts[0]), rows=1)))
    time.sleep(0.3)
    loop.run(bt.verify(VerifyCall("c", 0, list(prompts[1]), rows=1)))
    time.sleep(0.3)  # a idle; then b and d in one batch: 4 held, a idle, one over the bound

    async def both():
        return await asyncio.gather(bt.verify(VerifyCall("b", 0, list(prompts[2]), rows=1)),
                                    bt.verify(VerifyCall("d", 0, list(prompts[3]), rows=1)))
    loop.run(both())
    assert bt.stats()["batches"] == 3
    assert set(bt.last_used) == {"b", "d"} and bt.stats()["evicted"] == 2  # a (idle), then c (room)
    assert counter(bt.meter, "osd_target_cache_evictions_total") == 2


def test_the_targets_threads_come_from_its_config_or_else_the_models_on_its_own_thread(target):
    """The target's forwards run on one thread of its own with the configured count; the replica's
    other threads run torch on one (a second OpenMP team would slow every step)."""
    before = torch.get_num_threads()
    try:
        bt = BatchedTarget(ModelConfig(name="unused", quantize="none", num_threads=2), TargetServeConfig(), weights=target)
        assert bt.run(torch.get_num_threads) == 2 and torch.get_num_threads() == 1
        bt = BatchedTarget(ModelConfig(name="unused", quantize="none", num_threads=2), TargetServeConfig(num_threads=1),
                           weights=target)
        assert bt.run(torch.get_num_threads) == 1
    finally:
        torch.set_num_threads(before)
