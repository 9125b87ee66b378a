"""Router deployment: ``router.Router`` behind a batching queue (one embedding pass for the queries
that arrive together), one torch thread. The router is single-threaded state: every call runs on
the replica's event loop, one at a time."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch
from ray import serve

from config import MetricsConfig, RouterConfig
from router.router import Route, Router, fit_examples, load_state, save_state

from .loopback import bind_replica_grpc, replica_meter

log = logging.getLogger("osd.router")


class RouterServer:
    """``state_dir``: where the router's state (clusters, bandit, drafts) is saved and, at start,
    reloaded from (a save that does not load is skipped, logged and moved aside); None: kept in
    memory only. Without a saved state, ``cfg.examples`` (if set) trains the domain classifier."""

    def __init__(self, cfg: RouterConfig, max_batch: int = 16, batch_wait_s: float = 0.002,
                 metrics: MetricsConfig | None = None, state_dir: str | None = None, on_retire=None):
        torch.set_num_threads(cfg.embedder.threads)
        self.on_retire = on_retire  # the drafts the router retired, handed on (to the learner, which parks them)
        self.meter = replica_meter("Router", metrics or MetricsConfig())
        self.router = Router(cfg)
        self.state_dir = state_dir
        loaded = load_state(state_dir, cfg, self.router.extractor) if state_dir is not None else None
        if loaded is not None:
            self.router = loaded
        elif cfg.examples:  # named domains from labelled examples (mode clusters: they name clusters only)
            fit_examples(self.router, cfg.examples)
        self.saved_at = self.router.t
        # load the embedder and language id now, at the longest input the embedder takes (its
        # first input of a new length costs a second or two), not on the first requests; features
        # only: the routing state (clusters, counts) is not touched
        self.router.extractor.extract(["warm up " * cfg.embedder.max_tokens])
        self.route = serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=batch_wait_s)(self._route_batch)

    def save(self) -> bool:
        """Save the state if it changed since the last save (True when it did)."""
        if self.state_dir is None or self.router.t == self.saved_at:
            return False
        save_state(self.router, self.state_dir)
        self.saved_at = self.router.t
        return True

    async def _route_batch(self, texts: list[str]) -> list[Route]:
        routes = self.router.route_batch(texts)
        self._events()  # handed on as they happen, whether or not anyone pulls telemetry
        return routes

    def route_private(self, text: str) -> Route:
        """An isolated tenant's route: named domains only, nothing learned from traffic, no state
        changed (``Router.route_private``)."""
        return self.router.route_private(text)

    def observe(self, route: Route, accepted: int, proposed: int) -> None:
        self.router.observe(route, accepted, proposed)

    def summary(self) -> dict:
        return self.router.summary()

    def _events(self) -> None:
        """The router's spawn / retire events since the last look become counts and dashboard events
        (in the meter, until the next telemetry pull); the retired drafts' ids go to ``on_retire``.
        Called after every routing batch, so the learner hears of a retired draft at once and the
        router keeps no backlog of events when metrics are off (nobody pulls)."""
        retired = []
        for ev in self.router.events():
            self.meter.inc("osd_router_draft_events_total", kind=ev.kind)
            self.meter.event(ev.kind, draft=ev.draft_id, domain=ev.domain, reason=ev.reason)
            if ev.kind == "retire":
                retired.append(ev.draft_id)
        if retired and self.on_retire is not None:
            self.on_retire(retired)

    def telemetry(self) -> dict:
        """The meter's snapshot, with the events since the last pull and the router's gauges."""
        self._events()
        self.meter.set("osd_router_clusters", len(self.router.clusters.clusters))
        self.meter.set("osd_router_drafts", len(self.router.drafts))
        self.router.refresh_names()
        self.meter.replace("osd_domain_info", {(c.key, c.name): 1 for c in self.router.clusters.clusters.values() if c.name})
        return self.meter.snapshot()


@serve.deployment(name="Router", max_ongoing_requests=64)
class RouterDeployment(RouterServer):
    def __init__(self, cfg: RouterConfig, grpc_host: str | None = "127.0.0.1", metrics: MetricsConfig | None = None,
                 state_dir: str | None = None, save_every_s: float = 30.0, learner=None):
        bind_replica_grpc(grpc_host)
        if state_dir is not None:  # one folder per application (two apps may share a state folder)
            state_dir = str(Path(state_dir) / serve.get_replica_context().app_name)
        on_retire = (lambda ids: learner.retire.remote(ids)) if learner is not None else None  # fire and forget
        super().__init__(cfg, metrics=metrics, state_dir=state_dir if save_every_s > 0 else None, on_retire=on_retire)
        if self.state_dir is not None:
            self._saver = asyncio.get_running_loop().create_task(self._save_every(save_every_s))

    async def _save_every(self, seconds: float) -> None:
        """On the event loop, between two routing calls: the state saved is one consistent moment."""
        while True:
            await asyncio.sleep(seconds)
            try:
                self.save()
            except Exception:  # noqa: BLE001 - a full disk must not stop routing
                log.exception("router state: save failed")
