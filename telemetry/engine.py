"""How an engine replica's loop and KV pool are shown: gauges of its queue and budget, counters of
its prefix cache. The draft pool calls :class:`LoopGauges` at each telemetry read; it holds only
the prefix cache's counts at the previous read (counters grow by the difference)."""

from __future__ import annotations

from .meter import Meter


class LoopGauges:
    """The engine loop's state into a meter: ``update(m, loop, kv_bytes_per_token)`` at each read."""

    def __init__(self):
        self._seen: dict[str, int] = {}  # the prefix cache's counts at the last read

    def update(self, m: Meter, loop, kv_bytes_per_token: int) -> None:
        """``loop``: a :class:`speculative.scheduler.EngineLoop` (its ``prefix_cache_stats()``)."""
        m.set("osd_engine_requests_waiting", loop.queued)
        m.set("osd_engine_kv_reserved_tokens", loop.reserved)
        m.set("osd_engine_kv_capacity_tokens", loop.budget_tokens)
        m.set("osd_engine_kv_bytes_per_token", kv_bytes_per_token)
        m.set("osd_target_kv_caches", len(loop.running))
        m.set("osd_target_queue_depth", loop.queued)
        stats = loop.prefix_cache_stats()
        if stats is not None:
            seen = self._seen
            m.inc("osd_engine_prefix_cache_queried_tokens_total", stats["looked_up"] - seen.get("looked_up", 0))
            m.inc("osd_engine_prefix_cache_hit_tokens_total", stats["hit"] - seen.get("hit", 0))
            m.set("osd_engine_prefix_cache_blocks", stats["blocks"])
            self._seen = stats
