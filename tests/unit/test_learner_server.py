"""The learner deployment's own logic in one process: records in, rounds counted by outcome,
updates published and rolled back under new versions, operators' calls, a restart that reloads its
drafts and announces them. The real `LearnerServer` on the tiny Llama, fed by a real `DraftPool`'s
records (tests/inprocess.py); tests/serve/ runs it under Ray Serve."""

from __future__ import annotations

import math
import time

import pytest
import torch

from deployments.learner import LearnerServer
from inprocess import Handle, LocalPool, Loop, app_config, counter, save_tiny_model
from learner.lifecycle import known_drafts
from learner.trainer import RoundReport
from router.router import GENERAL

# the whole-draft learner (adapter_rank 0, an option in config): these tests read its checkpoints as
# whole drafts; the adapter learner (the server's default) has tests of its own (adapter_rank=4)
TRAINER = {"train_every": 2, "batch_records": 2, "steps_per_round": 1, "gate_margin": 1.0, "holdout_fraction": 0.0,
           "adapter_rank": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, make_llama, make_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), make_llama, make_tokenizer)


def learner_cfg(folder, state_dir, learner=None, **trainer):
    return app_config(folder, learner={"enabled": True, "state_dir": str(state_dir), "trainer": {**TRAINER, **trainer},
                                       "background": {"nice": 0, "threads": 1}, **(learner or {})})


class Published:
    def __init__(self):
        self.got = []

    def __call__(self, draft_id, state, version):
        self.got.append((draft_id, version, state))


@pytest.fixture
def served(folder, tmp_path):
    """(learner, what it published, a draft replica sending it records, its loop)."""
    cfg = learner_cfg(folder, tmp_path / "learner")
    published = Published()
    server = LearnerServer(cfg, publish=published)
    pool = LocalPool(cfg, learner=Handle(server))
    loop = Loop()
    yield server, published, pool, loop
    server.background.stop()
    loop.close()


def serve_requests(pool, loop, n: int, draft_id: str = GENERAL, tenant: str = "alice", domain: str = "code"):
    for i in range(n):
        loop.run(pool.serve(f"Hello {i}", 10, draft_id, request_id=f"q{i}-{time.monotonic_ns()}", domain=domain,
                            tenant=tenant))


def wait_for(pred, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pred()


def test_records_become_published_versions_counted_and_shown(served):
    server, published, pool, loop = served
    serve_requests(pool, loop, 4)
    wait_for(lambda: len(published.got) >= 2)
    assert [v for _, v, _ in published.got][:2] == [1, 2] and all(d == GENERAL for d, _, _ in published.got)
    m = server.meter
    assert counter(m, "osd_learner_records_total", draft=GENERAL) == 4
    wait_for(lambda: counter(m, "osd_learner_rounds_total", draft=GENERAL, result="published") == len(published.got))
    assert counter(m, "osd_learner_steps_total", draft=GENERAL) >= 2
    assert counter(m, "osd_learner_train_seconds_total", draft=GENERAL) > 0
    assert [(e["kind"], e["draft"], e["version"]) for e in m._events][:2] == [("publish", GENERAL, 1), ("publish", GENERAL, 2)]
    snap = server.telemetry()
    version = server.learner.trainers[GENERAL].version
    assert snap["gauges"][("osd_draft_version", (GENERAL,))] == version >= 2
    assert snap["gauges"][("osd_learner_shard_records", (GENERAL,))] == 4
    assert snap["gauges"][("osd_learner_shard_bytes", (GENERAL,))] > 0
    assert snap["gauges"][("osd_learner_paused", ())] == 0.0
    assert math.isfinite(snap["gauges"][("osd_learner_loss", (GENERAL,))])
    stats = server.stats()
    assert stats["drafts"][GENERAL]["version"] == version and stats["drafts"][GENERAL]["versions"][-1] == version
    trainer = server.learner.trainers[GENERAL]  # per draft: its rounds, rejections and last report
    assert stats["drafts"][GENERAL]["rounds"] == trainer.rounds >= 2 and stats["drafts"][GENERAL]["rejected"] == trainer.rejected
    assert stats["drafts"][GENERAL]["last_round"] == trainer.history[-1].to_dict()
    assert stats["drafts"][GENERAL]["last_round"]["draft_id"] == GENERAL
    assert stats["settings"] == {k: getattr(server.trainer_cfg, k) for k in LearnerServer.TUNABLE}
    state, v = server.latest(GENERAL)
    assert v == version and set(state) == set(published.got[-1][2])
    assert server.latest("nobody@iso") is None  # a tenant's own scope, where nothing was published


def test_a_rollback_publishes_old_weights_under_a_new_version(served):
    server, published, pool, loop = served
    serve_requests(pool, loop, 4)
    wait_for(lambda: len(published.got) >= 2)
    server.pause()  # no round in between
    now = server.learner.trainers[GENERAL].version
    out = server.rollback(GENERAL, 1)
    assert out == {"draft_id": GENERAL, "version": now + 1, "weights_of": 1}
    d, v, state = published.got[-1]
    assert (d, v) == (GENERAL, now + 1)
    first = published.got[0][2]
    assert all((state[k] == first[k]).all() for k in first)
    assert m_events(server)[-1] == ("rollback", GENERAL, now + 1)
    with pytest.raises(ValueError, match=f"draft {GENERAL!r} has no checkpoint v99"):
        server.rollback(GENERAL, 99)
    with pytest.raises(ValueError, match="draft 'nobody' has no checkpoint v1"):
        server.rollback("nobody", 1)


def m_events(server):
    return [(e["kind"], e["draft"], e["version"]) for e in server.meter._events if "version" in e]


def test_pause_and_resume_are_seen_in_stats_and_gauges(served):
    server = served[0]
    assert server.pause()["paused"] is True
    assert server.telemetry()["gauges"][("osd_learner_paused", ())] == 1.0
    assert server.resume()["paused"] is False
    assert server.telemetry()["gauges"][("osd_learner_paused", ())] == 0.0


def test_a_record_is_stored_before_record_returns(served):
    server, published, pool, loop = served
    server.background.stop()  # no thread to store it later: what is on disk is what record() stored
    serve_requests(pool, loop, 1)
    shard = server.learner.shards[GENERAL]
    assert shard.stats()["records"] == 1 and shard.stats()["log_bytes"] > 0  # and queued for the thread


def test_the_learner_trains_on_one_thread(served):
    import torch

    assert torch.get_num_threads() == 1


def test_a_tenants_records_are_deleted(served):
    server, published, pool, loop = served
    server.pause()
    serve_requests(pool, loop, 2, tenant="bob")
    serve_requests(pool, loop, 1, tenant="carol")
    out = server.delete_tenant("bob")
    assert out["tenant"] == "bob" and sum(v for k, v in out["deleted"].items()) == 2
    assert server.delete_tenant("bob")["deleted"] == {k: 0 for k in out["deleted"]}


def test_configure_changes_the_settings_of_every_trainer(served):
    server, published, pool, loop = served
    serve_requests(pool, loop, 1)
    assert server.configure({"lr": 0.0123, "train_every": 5, "min_steps_per_round": 3})["lr"] == 0.0123
    t = server.learner.trainers[GENERAL]
    assert t.cfg.lr == 0.0123 and t.cfg.train_every == 5 and server.learner.cfg.train_every == 5
    assert t.cfg.min_steps_per_round == server.learner.cfg.min_steps_per_round == 3
    assert all(g["lr"] == 0.0123 for g in t.opt.param_groups)
    with pytest.raises(ValueError, match="not tunable: bogus, zz \\(tunable: lr, "):
        server.configure({"zz": 1, "bogus": 2, "lr": 0.1})
    with pytest.raises(ValueError, match="^lr: Input should be greater than 0$"):
        server.configure({"lr": 0})
    with pytest.raises(ValueError, match="^steps_per_round: Input should be less than or equal to 4096$"):
        server.configure({"steps_per_round": 10**9})  # a round that would hold the learner for good
    assert t.cfg.lr == 0.0123 and t.cfg.steps_per_round < 4096


def test_a_restarted_learner_reloads_its_drafts_and_announces_them(served, folder, tmp_path):
    first, published, pool, loop = served
    serve_requests(pool, loop, 2, draft_id="c0/en")
    serve_requests(pool, loop, 2, draft_id=f"{GENERAL}@team/a")  # an isolated tenant named team/a
    serve_requests(pool, loop, 2, draft_id="..")
    wait_for(lambda: {d for d, _, _ in published.got} == {"c0/en", f"{GENERAL}@team/a", ".."})
    serve_requests(pool, loop, 1, draft_id="quiet")  # one record: no round, only its initial v0
    first.background.stop()
    versions = {d: t.version for d, t in first.learner.trainers.items()}
    again = LearnerServer(learner_cfg(folder, tmp_path / "learner"), publish=Published())
    try:
        assert sorted(again.learner.trainers) == sorted(versions)  # names with / and @ survive the folders
        assert sorted(p.name for p in (tmp_path / "learner" / "checkpoints").iterdir()) == ["%2E%2E", "c0%2Fen",
                                                                                           "general@team%2Fa", "quiet"]
        assert versions.pop("quiet") == 0  # nothing published: not announced (the replicas have its base)
        assert {d: v for d, _, v in again.announce} == versions and all(v > 0 for v in versions.values())
        assert {d: t.version for d, t in again.learner.trainers.items()} == {**versions, "quiet": 0}
    finally:
        again.background.stop()
    assert known_drafts(tmp_path / "nowhere") == []


def test_rounds_are_counted_by_their_outcome(served):
    server = served[0]
    m = server.meter
    cases = [
        (RoundReport("d", steps=2, accepted=True, version=3, loss_after=0.5, train_seconds=0.25, cut_short=True), "published"),
        (RoundReport("d", steps=2, accepted=False, reason="non-finite loss", loss_after=float("nan")), "rejected"),
        (RoundReport("d", steps=1, accepted=False, reason="held-out agreement fell 0.2 -> 0.1", loss_after=0.7), "rejected"),
        (RoundReport("d", steps=1, accepted=False, reason="something else"), "rejected"),
        (RoundReport("d", steps=0, stopped_early=True), "yielded"),
        (RoundReport("d", steps=0), "empty"),
        (RoundReport("d", steps=0, accepted=False, reason="no records"), "empty"),
    ]
    for rep, _ in cases:
        before = {r: counter(m, "osd_learner_rejected_total", draft="d", reason=r) for r in ("non_finite", "agreement_drop", "other")}
        server._count_round(rep)
        grew = [r for r, n in before.items() if counter(m, "osd_learner_rejected_total", draft="d", reason=r) > n]
        expect = {"non-finite loss": ["non_finite"], "held-out agreement fell 0.2 -> 0.1": ["agreement_drop"],
                  "something else": ["other"]}.get(rep.reason, []) if rep.steps > 0 else []
        assert grew == expect, rep.reason
    for result in ("published", "rejected", "yielded", "empty"):
        assert counter(m, "osd_learner_rounds_total", draft="d", result=result) == sum(r == result for _, r in cases), result
    assert counter(m, "osd_learner_steps_total", draft="d") == 6
    assert counter(m, "osd_learner_rounds_cut_total", draft="d") == 1
    assert counter(m, "osd_learner_train_seconds_total", draft="d") == 0.25
    for reason in ("non_finite", "agreement_drop", "other"):
        assert counter(m, "osd_learner_rejected_total", draft="d", reason=reason) == 1
    assert m._gauges[("osd_learner_loss", ("d",))] == 0.7  # the NaN round kept the loss before it
    rejects = [e["reason"] for e in m._events if e["kind"] == "reject"]
    assert rejects == ["non-finite loss", "held-out agreement fell 0.2 -> 0.1", "something else"]


def test_a_learner_needs_a_learned_draft(folder, tmp_path):
    cfg = learner_cfg(folder, tmp_path / "l")
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"draft": cfg.engine.draft.model_copy(
        update={"proposers": ["ngram"], "adapter": None})})})
    with pytest.raises(ValueError, match=r"the learner needs a learned draft; draft.proposers \['ngram'\] has none"):
        LearnerServer(cfg)


def test_latest_is_the_first_published_version_on_and_nothing_before(served):
    server, published, pool, loop = served
    serve_requests(pool, loop, 2, draft_id="one")  # two records: a round (every 2 records), v1
    wait_for(lambda: [v for d, v, _ in published.got if d == "one"] == [1])
    serve_requests(pool, loop, 1, draft_id="zero")  # a third: no round, a trainer at its initial v0
    assert server.latest("zero") is None
    state, version = server.latest("one")
    assert version == 1 and set(state) == set(published.got[-1][2])


def test_dropped_records_are_counted_once_each(served):
    """What the learner thread reports dropped (its hand-over queue full) becomes a counter that
    grows by the new drops at each telemetry pull, never by the total again."""
    server = served[0]
    stats = server.background._stats
    for dropped, total in ((0, 0), (3, 3), (3, 3), (5, 5)):
        stats.dropped = dropped
        server.telemetry()
        assert counter(server.meter, "osd_learner_records_dropped_total") == total


def test_a_named_domains_draft_starts_from_its_own_checkpoint_in_the_pool_and_the_learner(folder, tmp_path, make_llama):
    """``draft.domain_checkpoints``: the pool serves d-sql (and a tenant's copy, d-sql@iso) from
    sql's saved draft, its own head and token ids; the general draft and a domain without one
    from the configured draft. The learner trains d-sql from the same start, so its updates load
    into the pool's d-sql and are served from the next request on."""
    import torch

    from inprocess import domain_engine, save_domain_draft

    keep = save_domain_draft(tmp_path / "sql", make_llama)
    cfg = app_config(folder, engine=domain_engine(folder, {"sql": str(tmp_path / "sql")}),
                     learner={"enabled": True, "state_dir": str(tmp_path / "learner"), "trainer": TRAINER,
                              "background": {"nice": 0, "threads": 1}})
    box = []
    server = LearnerServer(cfg, publish=lambda d, state, v: box[0].load_weights(d, [state], v))
    pool = LocalPool(cfg, learner=Handle(server))
    box.append(pool)
    loop = Loop()
    try:
        def head(draft_id):
            runner = loop.run(pool.loaded(draft_id)).learned_draft.runner
            return len(runner.model.model.layers), runner.vocab_map

        for d in ("d-sql", "d-sql@iso"):
            layers, ids = head(d)
            assert layers == 1 and torch.equal(ids, keep), d
        assert head(GENERAL) == (2, None) and head("d-code") == (2, None)
        serve_requests(pool, loop, 4, draft_id="d-sql", domain="sql")
        trainer = server.learner.trainers["d-sql"]
        assert len(trainer.model.model.layers) == 1 and torch.equal(trainer.keep_ids, keep)
        wait_for(lambda: pool.published.version("d-sql") >= 1)
        items = loop.run(pool.serve("Hello again", 6, "d-sql", domain="sql", tenant="alice"))
        assert items[-1].usage["speculative"]["draft_version"] >= 1
    finally:
        server.background.stop()
        loop.close()


def test_a_new_draft_forks_what_its_tenants_general_draft_has_published(served, folder, tmp_path):
    """A cluster's draft first loaded after the general draft has learned starts from the general
    draft's published weights (as v1, checkpointed with where it came from), in the learner and in
    the pool from its first request; an isolated tenant's copy forks its own general draft, which
    learned nothing, so it starts from the configured draft; a restart reloads the fork's own
    checkpoints instead of forking again."""
    import numpy as np

    from drafts.build import load_draft

    server, published, pool, loop = served
    serve_requests(pool, loop, 2)  # a round on the general draft: v1
    wait_for(lambda: server.latest(GENERAL) is not None)
    with server.background.exclusive:  # no round between the two reads
        state, version = server.latest(GENERAL)
        assert version >= 1
        changed = [n for n, v in state.items() if not np.array_equal(v, server.book.base.state_dict()[n].numpy())]
        assert changed  # it learned: a fork differs from the configured draft
        runner = loop.run(pool.loaded("c0/en")).learned_draft.runner
    assert loop.run(pool.loaded("c0/en")).draft_version == 1
    for n, t in runner.model.state_dict().items():
        assert np.array_equal(t.numpy(), state[n]), n
    trainer = server.learner.trainers["c0/en"]
    assert trainer.version == 1 and all(np.array_equal(t.numpy(), state[n]) for n, t in trainer.model.state_dict().items())
    _, _, meta = load_draft(trainer.ckpt_root / "v1")
    assert meta["forked_from"] == GENERAL and meta["parent_version"] == version and meta["initial"]
    assert server.stats()["drafts"]["c0/en"]["forked_from"] == {"parent": GENERAL, "parent_version": version}
    assert server.stats()["drafts"][GENERAL]["forked_from"] is None
    assert [(e["draft"], e["parent"], e["version"]) for e in server.meter._events if e["kind"] == "fork"] == [
        ("c0/en", GENERAL, 1)]

    iso = loop.run(pool.loaded("c0/en@iso"))  # general@iso has published nothing
    assert iso.draft_version == 0 and server.latest("c0/en@iso") is None
    for n, t in iso.learned_draft.runner.model.state_dict().items():
        assert torch.equal(t, server.book.base.state_dict()[n]), n
    items = loop.run(pool.serve("Hello fork", 6, "c0/en", tenant="alice"))
    assert items[-1].usage["speculative"]["draft_version"] == 1

    serve_requests(pool, loop, 2)  # the general draft learns on: the fork keeps what it started from
    wait_for(lambda: server.latest(GENERAL)[1] > version)
    server.background.stop()
    again = LearnerServer(learner_cfg(folder, tmp_path / "learner"), publish=Published())
    try:
        assert again.learner.trainers["c0/en"].version == 1 and not again.book.forks
        assert {d: v for d, _, v in again.announce}["c0/en"] == 1
        for n, t in again.learner.trainers["c0/en"].model.state_dict().items():
            assert np.array_equal(t.numpy(), state[n]), n
    finally:
        again.background.stop()


def test_latest_answers_the_published_weights_not_a_round_in_progress(served):
    """A replica loading a draft during a round gets the weights published last, never the training
    copy the round is changing (and may yet reject)."""
    import numpy as np

    server, published, pool, loop = served
    serve_requests(pool, loop, 2)
    wait_for(lambda: server.latest(GENERAL) is not None)
    with server.background.exclusive:
        state, version = server.latest(GENERAL)
        trainer = server.learner.trainers[GENERAL]
        snap = trainer.snapshot()
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1.0)  # what a round in progress does to the training copy
        got, v = server.latest(GENERAL)
        assert v == version and all(np.array_equal(got[n], state[n]) for n in state)
        trainer.restore(snap)


def test_idle_drafts_are_parked_on_disk_and_come_back_when_used(folder, tmp_path):
    """``learner.max_drafts``: beyond it the least recently used draft (never the general one) leaves
    the learner's memory between rounds, counted and listed as parked; asked for again (a replica
    loading it, or its next record) it comes back at the version it had, its weights and replay
    records with it; deleting a tenant reaches its records while it is parked; a restart loads the
    general draft and the most recently checkpointed others up to the bound, the rest stay parked."""
    import numpy as np

    from drafts.build import load_draft

    cfg = learner_cfg(folder, tmp_path / "learner", learner={"max_drafts": 2})
    server = LearnerServer(cfg, publish=Published())
    pool, loop = LocalPool(cfg, learner=Handle(server)), Loop()
    try:
        for d in (GENERAL, "a", "b"):
            serve_requests(pool, loop, 2, draft_id=d, tenant="alice")
            wait_for(lambda: server.latest(d) is not None)
        wait_for(lambda: "a" not in server.learner.trainers)  # a, b and general: a was used least recently
        assert sorted(server.learner.trainers) == sorted([GENERAL, "b"]) and server.stats()["parked"] == ["a"]
        assert "a" not in server.learner.shards and "a" not in server.book.served and list(server.book.used) == [GENERAL, "b"]
        assert counter(server.meter, "osd_learner_parked_total") == 1
        assert server.telemetry()["gauges"][("osd_learner_drafts_in_memory", ())] == 2
        state, version = server.latest("a")  # a replica loads it: back from its checkpoint
        assert version >= 1 and "a" in server.learner.trainers
        _, _, meta = load_draft(server.learner.trainers["a"].ckpt_root / f"v{version}")
        saved = server.learner.trainers["a"].state()
        assert all(np.array_equal(state[n], saved[n]) for n in saved) and meta["version"] == version
        wait_for(lambda: "b" not in server.learner.trainers)  # now b is the idle one
        assert len(server.learner.shards["a"]) == 2  # its records came back with it
        assert server.delete_tenant("alice")["deleted"]["shards"] == 6  # general's, a's and b's (parked) two each
        serve_requests(pool, loop, 1, draft_id="b", tenant="bob")  # its next record brings b back
        assert "b" in server.learner.trainers and [r.tenant for r in server.learner.shards["b"].records()] == ["bob"]
    finally:
        server.background.stop()
        loop.close()
    again = LearnerServer(cfg, publish=Published())
    try:
        assert sorted(again.learner.trainers) == sorted([GENERAL, "b"]) and again.stats()["parked"] == ["a"]
        assert "a" not in again.learner.shards and {d for d, _, _ in again.announce} <= {GENERAL, "b"}
    finally:
        again.background.stop()


def test_a_new_draft_of_a_parked_tenant_general_draft_forks_it_from_disk(folder, tmp_path):
    """An isolated tenant's general draft that was parked comes back from its checkpoints when a
    new draft of that tenant forks it: the fork starts from its published weights, not the
    configured draft."""
    import numpy as np

    cfg = learner_cfg(folder, tmp_path / "learner", learner={"max_drafts": 2})
    server = LearnerServer(cfg, publish=Published())
    pool, loop = LocalPool(cfg, learner=Handle(server)), Loop()
    try:
        iso = f"{GENERAL}@iso"
        for d in (GENERAL, iso):
            serve_requests(pool, loop, 2, draft_id=d, tenant="iso")
            wait_for(lambda: server.latest(d) is not None)
        state, version = server.latest(iso)
        server.latest("other")  # a third draft: the tenant's general draft is the idle one
        wait_for(lambda: iso not in server.learner.trainers)
        forked, v = server.latest("c1@iso")
        assert v == 1 and server.book.forks["c1@iso"] == {"parent": iso, "parent_version": version}
        assert all(np.array_equal(forked[n], state[n]) for n in state)
    finally:
        server.background.stop()
        loop.close()


def test_beyond_max_parked_the_longest_parked_draft_is_forgotten(folder, tmp_path):
    """``learner.max_parked``: parked drafts beyond it, the least recently checkpointed first, are
    deleted from disk (checkpoints, replay log), counted; the general draft never is. Used again,
    a forgotten draft starts anew, as a fork of the general draft."""
    from learner.replay import shard_path

    root = tmp_path / "learner"
    cfg = learner_cfg(folder, root, learner={"max_drafts": 2, "max_parked": 1})
    server = LearnerServer(cfg, publish=Published())
    pool, loop = LocalPool(cfg, learner=Handle(server)), Loop()
    try:
        for d in (GENERAL, "a", "b", "c"):
            serve_requests(pool, loop, 2, draft_id=d)
            wait_for(lambda: server.latest(d) is not None)
            # every record of this draft taken before the next draft's come (a record of a draft
            # uses it: taken late, it would make "a" more recently used than "b")
            wait_for(lambda: server.background.stats().queue_depth == 0)
        wait_for(lambda: not (root / "checkpoints" / "a").exists())  # parked: a, then b; a forgotten
        assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["b", "c", GENERAL]
        assert not shard_path(root / "shards", "a").exists() and shard_path(root / "shards", "b").exists()
        assert server.stats()["parked"] == ["b"] and sorted(server.learner.trainers) == ["c", GENERAL]
        assert counter(server.meter, "osd_learner_forgotten_total") == 1
        assert [e["draft"] for e in server.meter._events if e["kind"] == "forget"] == ["a"]
        _, version = server.latest("a")  # anew: a fork of the general draft's latest
        assert version == 1 and server.book.forks["a"]["parent"] == GENERAL and len(server.learner.shards["a"]) == 0
    finally:
        server.background.stop()
        loop.close()
    assert len(list((root / "checkpoints").iterdir())) > 2  # parked drafts on disk beside the two in memory
    again = LearnerServer(learner_cfg(folder, root, learner={"max_drafts": 2, "max_parked": 0}), publish=Published())
    try:  # a lower bound at the next start: the drafts it does not load go at once
        assert not again.stats()["parked"] and len(again.learner.trainers) == 2
        assert sorted(p.name for p in (root / "checkpoints").iterdir()) == sorted(again.learner.trainers)
    finally:
        again.background.stop()


def test_a_draft_the_router_retires_is_parked_with_every_tenants_copy(served):
    """``retire``: the router's retired drafts (and isolated tenants' copies of them) leave memory
    at the learner thread's next look, parked, not deleted; the general draft is never parked, and
    a retired draft used again comes back at its version."""
    server, published, pool, loop = served
    for d in (GENERAL, "c1/en", "c1/en@iso", "c2/en"):
        serve_requests(pool, loop, 2, draft_id=d)
        wait_for(lambda: server.latest(d) is not None)
    assert server.retire(["c1/en", GENERAL, "never-seen"]) == 3
    wait_for(lambda: "c1/en" not in server.learner.trainers and "c1/en@iso" not in server.learner.trainers)
    assert sorted(server.learner.trainers) == ["c2/en", GENERAL] and server.stats()["parked"] == ["c1/en", "c1/en@iso"]
    assert counter(server.meter, "osd_learner_parked_total") == 2
    from pathlib import Path

    from learner.checkpoints import draft_folder, latest_checkpoint

    version = latest_checkpoint(Path(server.trainer_cfg.checkpoint_dir) / draft_folder("c1/en"))
    assert version >= 1 and server.latest("c1/en")[1] == version and "c1/en" in server.learner.trainers


def test_a_retired_draft_beyond_max_parked_is_forgotten_at_once(folder, tmp_path):
    """Parking a retired draft counts towards ``max_parked`` as parking an idle one does: with no
    room for parked drafts, the router's retired draft is deleted from disk right away."""
    root = tmp_path / "learner"
    server = LearnerServer(learner_cfg(folder, root, learner={"max_parked": 0}), publish=Published())
    pool, loop = LocalPool(server.cfg, learner=Handle(server)), Loop()
    try:
        for d in (GENERAL, "x"):
            serve_requests(pool, loop, 2, draft_id=d)
            wait_for(lambda: server.latest(d) is not None)
        server.retire(["x"])
        wait_for(lambda: not (root / "checkpoints" / "x").exists())
        assert counter(server.meter, "osd_learner_forgotten_total") == 1 and GENERAL in server.learner.trainers
    finally:
        server.background.stop()
        loop.close()


def test_with_quiet_s_the_learner_trains_only_in_the_gaps_of_traffic(folder, tmp_path):
    """learner.background.quiet_s: while records keep arriving (traffic is flowing) no round runs;
    once none arrived for quiet_s, the learner trains what it has."""
    cfg = learner_cfg(folder, tmp_path / "learner", learner={"background": {"nice": 0, "threads": 1, "quiet_s": 1.5}})
    published = Published()
    server = LearnerServer(cfg, publish=published)
    pool, loop = LocalPool(cfg, learner=Handle(server)), Loop()
    try:
        serve_requests(pool, loop, 4)
        last = time.monotonic()
        time.sleep(0.5)
        assert published.got == [] and server.background._stats.rounds == 0  # within quiet_s of the last record
        wait_for(lambda: len(published.got) >= 1, seconds=30)
        assert time.monotonic() - last >= 1.5
    finally:
        server.background.stop()
        loop.close()


def test_with_min_share_the_learner_publishes_while_traffic_never_pauses(folder, tmp_path):
    """learner.background.min_share: records keep arriving (never quiet_s apart), and the learner
    still trains and publishes, within its share; its stats count that CPU."""
    import threading

    cfg = learner_cfg(folder, tmp_path / "learner", learner={"background": {
        "nice": 0, "threads": 1, "quiet_s": 1.5, "min_share": 0.5, "share_burst_s": 0.5}})
    published = Published()
    server = LearnerServer(cfg, publish=published)
    pool, loop = LocalPool(cfg, learner=Handle(server)), Loop()
    stop = threading.Event()

    def steady_traffic():  # a request every 50 ms: never quiet_s without one
        while not stop.wait(0.05):
            server.touch()

    traffic = threading.Thread(target=steady_traffic)
    try:
        traffic.start()
        serve_requests(pool, loop, 4)
        wait_for(lambda: len(published.got) >= 1, seconds=60)
        used = server.stats()["against_traffic_s"]
        assert traffic.is_alive() and used > 0
        snap = server.telemetry()  # the CPU it took against traffic reaches the meter once
        assert snap["counters"][("osd_learner_against_traffic_seconds_total", ())] >= used
    finally:
        stop.set()
        traffic.join()
        server.background.stop()
        loop.close()


def test_an_adapter_fork_starts_from_its_parents_adapters_on_the_one_shared_base(folder, tmp_path):
    """With adapter learners, the general draft publishes adapters alone; a cluster's draft forked
    from it starts from those adapters (v1), served by the pool, and every trainer's base is the
    learner's one base draft (its storage, not a copy)."""
    import numpy as np

    from speculative.adapters import adapter_state, is_adapter_key

    cfg = learner_cfg(folder, tmp_path / "learner", adapter_rank=4, lr=1e-2)
    server = LearnerServer(cfg, publish=Published())
    pool, loop = LocalPool(cfg, learner=Handle(server)), Loop()
    try:
        serve_requests(pool, loop, 2)
        wait_for(lambda: server.latest(GENERAL) is not None)
        with server.background.exclusive:
            state, version = server.latest(GENERAL)
            assert state and all(is_adapter_key(k) for k in state)
            assert any(np.abs(v).max() > 0 for k, v in state.items() if k.endswith("lora_B"))  # it learned
            served = loop.run(pool.loaded("c0/en"))
            fork = server.learner.trainers["c0/en"]
        assert fork.version == 1 and served.draft_version == 1
        for k, v in adapter_state(fork.model).items():
            assert np.array_equal(v.numpy(), state[k]), k
        for k, v in adapter_state(served.learned_draft.runner.model).items():
            assert np.array_equal(v.numpy(), state[k]), k
        base = {n: p.data_ptr() for n, p in server.book.base.named_parameters()}
        for t in (fork, server.learner.trainers[GENERAL]):
            shared = [n for n, p in t.model.named_parameters() if n in base and p.data_ptr() == base[n]]
            assert len(shared) == len(base)
    finally:
        server.background.stop()
        loop.close()
