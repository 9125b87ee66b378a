"""Router deployment: ``router.Router`` behind a batching queue (one embedding pass for the queries
that arrive together), one torch thread. The router is single-threaded state: every call runs on
the replica's event loop, one at a time."""

from __future__ import annotations

import torch
from ray import serve

from config import MetricsConfig, RouterConfig
from router.router import Route, Router

from .loopback import bind_replica_grpc, replica_meter


class RouterServer:
    def __init__(self, cfg: RouterConfig, max_batch: int = 16, batch_wait_s: float = 0.002,
                 metrics: MetricsConfig | None = None):
        torch.set_num_threads(cfg.threads)
        self.meter = replica_meter("Router", metrics or MetricsConfig())
        self.router = Router(cfg)
        self.router.extractor.embed(["warm up"])  # load MiniLM now, not on the first request
        self.route = serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=batch_wait_s)(self._route_batch)

    async def _route_batch(self, texts: list[str]) -> list[Route]:
        return self.router.route_batch(texts)

    def observe(self, route: Route, accepted: int, proposed: int) -> None:
        self.router.observe(route, accepted, proposed)

    def summary(self) -> dict:
        return self.router.summary()

    def telemetry(self) -> dict:
        """Spawn / retire events since the last call become counts and dashboard events."""
        for ev in self.router.events():
            self.meter.inc("osd_router_draft_events_total", kind=ev.kind)
            self.meter.event(ev.kind, draft=ev.draft_id, domain=ev.domain, reason=ev.reason)
        self.meter.set("osd_router_clusters", len(self.router.clusters.clusters))
        self.meter.set("osd_router_drafts", len(self.router.drafts))
        return self.meter.snapshot()


@serve.deployment(name="Router", max_ongoing_requests=64)
class RouterDeployment(RouterServer):
    def __init__(self, cfg: RouterConfig, grpc_host: str | None = "127.0.0.1", metrics: MetricsConfig | None = None):
        bind_replica_grpc(grpc_host)
        super().__init__(cfg, metrics=metrics)
