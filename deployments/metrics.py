"""Metrics deployment: one replica that pulls every replica's meter, adds the counts up
(``telemetry.Hub``) and answers ``/metrics``, ``/v1/stats`` and the dashboard through the ingress.

Transport only: a task on the replica's loop pulls the sources (``DeploymentHandle.broadcast("telemetry")``, every
replica of each) every ``sample_s`` and samples the dashboard's series; a scrape or a stats call
pulls first, so it sees everything served before it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

from config import MetricsConfig
from telemetry import Hub

from .loopback import bind_replica_grpc

log = logging.getLogger("osd.metrics")


class MetricsServer:
    """Undecorated: ``handles`` maps a source name to a handle with ``broadcast("telemetry")``."""

    def __init__(self, cfg: MetricsConfig, handles: dict | None = None):
        self.cfg = cfg
        self.hub = Hub(cfg)
        self.handles = handles or {}
        self._pull_lock = asyncio.Lock()
        self._seen: set[str] = set()  # sources that have answered once
        self._failing: set[str] = set()  # sources failing now (said once)

    def _merge(self, source: str, snaps: list) -> None:
        live = set()
        for s in snaps:
            if isinstance(s, dict) and "replica" in s:
                self.hub.merge(s)
                live.add(s["replica"])
        self.hub.retain(live, source_replicas=self.hub.replicas_of(source))

    async def pull(self) -> None:
        """Every replica of every source, now (one pull at a time: snapshots merge in order)."""
        async with self._pull_lock:
            for source, handle in self.handles.items():
                try:
                    snaps = await handle.broadcast("telemetry").results_async()
                except Exception as e:  # noqa: BLE001 - a deployment restarting: its gauges wait
                    self._unreachable(source, e)
                    continue
                if source in self._failing:
                    self._failing.discard(source)
                    log.warning("telemetry of %s: reachable again", source)
                self._seen.add(source)
                self._merge(source, snaps)

    def _unreachable(self, source: str, e: Exception) -> None:
        """Said once while it lasts, not at every pull; a deployment still starting (never reached
        yet) is not a failure."""
        if source in self._failing:
            return
        self._failing.add(source)
        if source in self._seen:
            log.warning("telemetry of %s: unreachable (%s: %s); its gauges wait until it answers", source,
                        type(e).__name__, e)

    async def scrape(self) -> bytes:
        await self.pull()  # a few ms: what was served before the scrape is in it
        return self.hub.exposition()

    async def stats(self, tenant: str | None = None, admin: bool = True) -> dict:
        await self.pull()
        return self.hub.stats(tenant, admin)

    async def tick(self) -> None:
        await self.pull()
        self.hub.sample()


@serve.deployment(name="Metrics", num_replicas=1, max_ongoing_requests=64, ray_actor_options={"num_cpus": 0})
class MetricsDeployment(MetricsServer):
    """Sources are looked up by name in this application (the ingress reads through this
    deployment, so binding the ingress here would be a cycle)."""

    def __init__(self, cfg: MetricsConfig, sources: list[str], grpc_host: str | None = "127.0.0.1"):
        bind_replica_grpc(grpc_host)
        app = serve.get_replica_context().app_name
        super().__init__(cfg, {name: serve.get_deployment_handle(name, app) for name in sources})
        # Serve runs the constructor on the replica's event loop: the sampling task lives there
        self._task = asyncio.get_running_loop().create_task(self._every_period())

    async def _every_period(self) -> None:
        next_t = time.monotonic()
        while True:
            next_t += self.cfg.sample_s
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - keep sampling
                log.exception("metrics pull failed")
