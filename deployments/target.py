"""Target deployment: the target model, per-request KV caches, verification batched across requests.

Transport only: the runner's ``verify`` does the batched forward; this class collects the verify
calls of concurrent requests (``@serve.batch``), bounds the KV caches it holds (LRU + idle TTL) and
answers ``None`` for a call whose cache is gone, so that the caller re-sends the sequence whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time

import torch
from ray import serve

from config import MetricsConfig, ModelConfig, TargetServeConfig
from speculative import TargetRows, VerifyCall
from speculative.runtime import make_runner, own_threads
from speculative.engine import time_verify
from speculative.models import load_weights

from .loopback import NodeInfo, bind_replica_grpc, replica_meter


class BatchedTarget:
    """A ModelRunner behind a batching queue; usable inside any replica (split or co-located)."""

    def __init__(self, model: ModelConfig, cfg: TargetServeConfig, weights=None, meter=None):
        threads = cfg.num_threads or model.num_threads
        # every forward on one thread, the only one here on several torch threads (own_threads says why)
        self.worker = cf.ThreadPoolExecutor(1, thread_name_prefix="target", initializer=own_threads if threads else None,
                                            initargs=(threads,) if threads else ())
        self.worker.submit(lambda: None).result()  # its count set before this thread goes back to one
        if threads:
            torch.set_num_threads(1)
        self.cfg = cfg
        self.runner = make_runner(weights if weights is not None else load_weights(model), model.quantize, name="target",
                                  compile=model.compile)
        self.run(self.runner.warmup, tuple(1 << i for i in range(cfg.max_batch.bit_length())))  # CUDA graphs: before the first request
        self.last_used: dict[str, float] = {}  # seq -> monotonic time of its last call
        self.batches = 0
        self.calls = 0
        self.evicted = 0
        self.pending = 0  # verify calls waiting for or in a batched forward
        self.meter = meter  # a telemetry.Meter (None: not counted)
        self._batched = serve.batch(max_batch_size=cfg.max_batch, batch_wait_timeout_s=cfg.batch_wait_s)(self._verify_batch)

    def run(self, fn, *args):
        """``fn(*args)`` on the target's thread, waited for."""
        return self.worker.submit(fn, *args).result()

    async def verify(self, call: VerifyCall) -> TargetRows | None:
        self.pending += 1
        try:
            return await self._batched(call)
        finally:
            self.pending -= 1

    async def _verify_batch(self, calls: list[VerifyCall]) -> list[TargetRows | None]:
        # a call whose cache was evicted (TTL, LRU, a restarted replica) is answered None
        ok = [c for c in calls if c.start <= self.runner.cached_length(c.seq_id)]
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        rows = await loop.run_in_executor(self.worker, self.runner.verify, ok, self.cfg.max_batch_tokens) if ok else []
        if self.meter is not None and ok:
            m = self.meter
            m.inc("osd_target_batches_total")
            m.inc("osd_target_verify_calls_total", len(ok))
            m.inc("osd_target_verified_tokens_total", sum(len(c.tokens) for c in ok))
            m.observe("osd_target_batch_size", len(ok))
            m.observe("osd_target_forward_seconds", time.perf_counter() - t0)
        now = time.monotonic()
        for c in ok:
            self.last_used[c.seq_id] = now
        self.batches += 1
        self.calls += len(ok)
        self._evict(now, keep={c.seq_id for c in ok})
        answer = dict(zip((id(c) for c in ok), rows))
        return [answer.get(id(c)) for c in calls]

    def _evict(self, now: float, keep: set[str]) -> None:
        idle = [s for s, t in self.last_used.items() if now - t > self.cfg.cache_ttl_s and s not in keep]
        over = len(self.last_used) - len(idle) - self.cfg.max_sequences
        if over > 0:  # least recently used first
            lru = sorted((t, s) for s, t in self.last_used.items() if s not in keep and s not in idle)
            idle += [s for _, s in lru[:over]]
        for s in idle:
            self.release(s)
            self.evicted += 1
        if idle and self.meter is not None:
            self.meter.inc("osd_target_cache_evictions_total", len(idle))

    def gauges(self) -> None:
        """Queue depth and live KV caches, into the meter (before each snapshot)."""
        self.meter.set("osd_target_queue_depth", self.pending)
        self.meter.set("osd_target_kv_caches", len(self.runner))

    def release(self, seq_id: str) -> None:
        self.runner.release(seq_id)
        self.last_used.pop(seq_id, None)

    def stats(self) -> dict:
        return {"batches": self.batches, "calls": self.calls, "sequences": len(self.runner), "evicted": self.evicted,
                "mean_batch": self.calls / self.batches if self.batches else None}


@serve.deployment(name="Target", max_ongoing_requests=64)
class Target(NodeInfo):
    """The split placement's target: draft replicas call ``verify`` once per speculative step."""

    def __init__(self, model: ModelConfig, cfg: TargetServeConfig, k_max: int = 6, grpc_host: str | None = "127.0.0.1",
                 metrics: MetricsConfig | None = None):
        bind_replica_grpc(grpc_host)
        self.target = BatchedTarget(model, cfg, meter=replica_meter("Target", metrics or MetricsConfig()))
        self.costs = self.target.run(time_verify, self.target.runner, k_max)  # before any traffic: clean timings

    def verify_costs(self) -> dict[int, float]:
        """Seconds to verify j = 1..k_max+1 tokens, measured at start: the draft replicas' k policy."""
        return self.costs

    async def verify(self, call: VerifyCall) -> TargetRows | None:
        return await self.target.verify(call)

    def release(self, seq_id: str) -> None:
        self.target.release(seq_id)

    def stats(self) -> dict:
        return self.target.stats()

    def telemetry(self) -> dict:
        self.target.gauges()
        return self.target.meter.snapshot()
