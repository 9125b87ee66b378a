"""The router and metrics deployments' own logic in one process: the router's saves and the events
it reports, the metrics replica's pulls from every source (replicas gone, sources failing). The
real `RouterServer` and `MetricsServer` with real `Meter`s, joined by in-process handles
(tests/inprocess.py); tests/serve/ runs them under Ray Serve."""

from __future__ import annotations


from config import MetricsConfig, RouterConfig
from deployments.metrics import MetricsServer
from deployments.router import RouterServer
from inprocess import Handle, counter
from router.router import GENERAL
from telemetry import Meter


def test_the_router_saves_only_what_changed(tmp_path, loop):
    server = RouterServer(RouterConfig(mode="clusters"), state_dir=str(tmp_path / "state"))
    assert server.save() is False and not (tmp_path / "state").exists()  # nothing routed yet
    route = loop.run(server.route("def f(x): return x"))
    assert route.draft_id == GENERAL
    assert server.save() is True and (tmp_path / "state").is_dir()
    assert server.save() is False
    loop.run(server.route("SELECT 1"))  # routed since: saved again
    assert server.save() is True
    assert RouterServer(RouterConfig(mode="clusters")).save() is False  # no folder: kept in memory only


def test_the_router_reports_its_draft_events_once_with_its_gauges(loop):
    cfg = RouterConfig(mode="clusters", clusters={"min_cluster_size": 2}, drafts={"spawn_min_records": 2, "spawn_min_tokens": 1, "spawn_alpha": 1.0})
    server = RouterServer(cfg)
    for _ in range(12):
        route = loop.run(server.route("SELECT name FROM users WHERE id = 3"))
        server.observe(route, 0, 8)
    snap = server.telemetry()
    spawned = [e for e in snap["events"] if e["kind"] == "spawn"]
    assert spawned and spawned[0]["draft"] in server.router.drafts and spawned[0]["reason"]
    assert counter(server.meter, "osd_router_draft_events_total", kind="spawn") == len(spawned)
    assert snap["gauges"][("osd_router_clusters", ())] == len(server.router.clusters.clusters) >= 1
    assert snap["gauges"][("osd_router_drafts", ())] == len(server.router.drafts) >= 2
    again = server.telemetry()  # events are taken once
    assert counter(server.meter, "osd_router_draft_events_total", kind="spawn") == len(spawned)
    assert len(again["events"]) == len(snap["events"])


class Replica:
    """A source replica: its own meter, counting what it is told to."""

    def __init__(self, source: str):
        self.meter = Meter(source)

    def telemetry(self):
        return self.meter.snapshot()


class Broken:
    def telemetry(self):
        raise RuntimeError("replica restarting")


def test_the_metrics_replica_adds_up_every_replica_of_every_source(loop):
    a, b = Replica("Ingress"), Replica("Ingress")
    pool = Replica("DraftPool")
    server = MetricsServer(MetricsConfig(), {"Ingress": Handle(a, b), "DraftPool": Handle(pool)})
    a.meter.inc("osd_requests_total", tenant="t", status="200")
    b.meter.inc("osd_requests_total", 2, tenant="t", status="200")
    a.meter.set("osd_requests_running", 1)
    b.meter.set("osd_requests_running", 2)
    text = loop.run(server.scrape()).decode()
    assert 'osd_requests_total{status="200",tenant="t"} 3.0' in text
    assert "osd_requests_running 3.0" in text
    b.meter.inc("osd_requests_total", tenant="t", status="200")
    stats = loop.run(server.stats(None, True))  # a stats call pulls first too
    assert stats["totals"]["requests"] == 4 and stats["running"]["ingress"] == 3
    server.handles["Ingress"] = Handle(a)  # b is gone: its gauge goes, its counts stay
    text = loop.run(server.scrape()).decode()
    assert "osd_requests_running 1.0" in text and 'osd_requests_total{status="200",tenant="t"} 4.0' in text
    server.handles["DraftPool"] = Handle(Broken())  # a failing source: the others are still pulled
    a.meter.inc("osd_requests_total", tenant="t", status="200")
    assert 'osd_requests_total{status="200",tenant="t"} 5.0' in loop.run(server.scrape()).decode()
    n = len(server.hub.points)
    loop.run(server.tick())
    assert len(server.hub.points) == n + 1


def test_a_source_that_fails_is_said_once_and_one_still_starting_not_at_all(loop, caplog):
    a = Replica("Ingress")
    server = MetricsServer(MetricsConfig(), {"Ingress": Handle(a), "DraftPool": Handle(Broken())})
    with caplog.at_level("WARNING", logger="deployments.metrics"):
        for _ in range(5):  # DraftPool never answered yet: starting, not failing
            loop.run(server.pull())
        assert not caplog.records
        server.handles["Ingress"] = Handle(Broken())  # Ingress answered before: it fails now
        for _ in range(5):
            loop.run(server.pull())
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "telemetry of Ingress: unreachable (RuntimeError: replica restarting)" in said[0]
        server.handles["Ingress"] = Handle(a)
        loop.run(server.pull())
        loop.run(server.pull())
        assert [r.getMessage() for r in caplog.records][1:] == ["telemetry of Ingress: reachable again"]


def test_only_snapshots_are_merged(loop):
    a = Replica("Ingress")
    server = MetricsServer(MetricsConfig(), {"Ingress": Handle(a)})
    a.meter.set("osd_requests_running", 2)
    loop.run(server.pull())
    server._merge("Ingress", [None, {"not": "a snapshot"}, a.telemetry()])
    assert server.hub.replicas_of("Ingress") == {a.meter.replica} and a.meter.replica in server.hub.gauges
    server._merge("Ingress", [{"not": "a snapshot"}])  # no replica of the source answered: its gauges go
    assert a.meter.replica not in server.hub.gauges


def test_the_router_fits_its_examples_when_given_and_in_mode_clusters_routes_by_cluster_still(tmp_path):
    from workloads import WorkloadRecord, save_workload

    recs = [WorkloadRecord(f"SELECT col{i} FROM table{i} WHERE id = {i}", "sql", "en", "spider") for i in range(8)]
    recs += [WorkloadRecord(f"What is {i} plus {i + 3}? Show the steps.", "math", "en", "gsm8k") for i in range(8)]
    save_workload(recs, tmp_path / "ex.jsonl")
    examples = str(tmp_path / "ex.jsonl")
    assert RouterServer(RouterConfig(mode="both", examples=examples, classifier={"background": False})).router.classifier.fitted
    clusters = RouterServer(RouterConfig(mode="clusters", examples=examples, classifier={"background": False})).router
    assert clusters.classifier.fitted  # to name the clusters close to a named domain
    assert clusters.route("SELECT col3 FROM table3 WHERE id = 3").domain not in ("sql", "math")
    assert not RouterServer(RouterConfig(mode="both")).router.classifier.fitted  # no examples: nothing named


def test_a_draft_the_router_retires_while_routing_is_handed_on_with_no_telemetry_pull(loop):
    """With metrics off nobody pulls telemetry: a cluster's draft retired while routing still
    reaches ``on_retire`` (the learner) after that routing call, and the router keeps no backlog
    of events."""
    cfg = RouterConfig(mode="clusters", clusters={"min_cluster_size": 2}, drafts={"spawn_min_records": 2, "spawn_min_tokens": 1, "spawn_alpha": 1.0, "idle_retire_records": 6}, bandit={"explore_rate": 0.0})
    handed = []
    server = RouterServer(cfg, metrics=MetricsConfig(enabled=False), on_retire=handed.extend)
    for _ in range(6):
        route = loop.run(server.route("SELECT name FROM users WHERE id = 3"))
        server.observe(route, 0, 8)
    spawned = [d for d in server.router.drafts if d != GENERAL]
    assert len(spawned) == 1 and handed == []
    for _ in range(8):  # other traffic only: the SQL cluster goes idle and its draft is retired
        loop.run(server.route("Bonjour, comment allez-vous aujourd'hui ?"))
    assert spawned[0] not in server.router.drafts
    assert handed == spawned  # handed on by routing itself, once
    assert server.router._events == []


def test_the_routers_meter_follows_the_metrics_config():
    assert RouterServer(RouterConfig(mode="clusters")).meter.enabled
    assert not RouterServer(RouterConfig(mode="clusters"), metrics=MetricsConfig(enabled=False)).meter.enabled


def test_the_drafts_the_router_retires_are_handed_on_once(loop):
    """The retire events a telemetry pull collects go to ``on_retire`` (the learner, in the app) as
    one list of draft ids; spawns do not, and nothing is handed on twice."""
    from router.router import DraftEvent

    handed = []
    server = RouterServer(RouterConfig(mode="clusters"), on_retire=handed.append)
    server.router._events += [DraftEvent("spawn", "c1-en", "c1/en", GENERAL, "busy"),
                              DraftEvent("retire", "c0-en", "c0/en", None, "idle"),
                              DraftEvent("retire", "d-sql", "sql", None, "room")]
    server.telemetry()
    server.telemetry()
    assert handed == [["c0-en", "d-sql"]]
    assert counter(server.meter, "osd_router_draft_events_total", kind="retire") == 2
    RouterServer(RouterConfig(mode="clusters")).telemetry()  # no one to hand them to: fine
