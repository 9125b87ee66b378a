"""The learner thread beside serving: it trains only while no request is live, stops a round when
one arrives, hands weights over between steps, and never blocks the serving side."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from config import SamplingParams
from drafts.build import truncated_draft
from learner.background import BackgroundConfig, BackgroundLearner, LearnerBusy, ShareBudget
from learner.replay import RecordBuilder
from learner.trainer import DraftTrainer, LearnerConfig, OnlineLearner

torch.set_num_threads(1)

TEXTS = ["Hello world 1", "The quick brown fox 1", "abcabcabc abc 1", "def f(x): return x 1",
         "Hello world 2", "The quick brown fox 2", "abcabcabc abc 2", "def f(x): return x 2"]


def _serve(engine, tok, text, sink=None):
    prompt = tok(text)["input_ids"]
    b = RecordBuilder(probs_dtype=torch.float32)
    gen = engine.generate(list(prompt), SamplingParams(max_tokens=16, ignore_eos=True), on_step=b.add)
    rec = b.finish(list(prompt) + gen.token_ids, len(prompt), draft_id="d")
    if sink is not None:
        sink(rec)
    return rec


@pytest.fixture(scope="module")
def records(target, tok, make_engine, draft_proposer):
    engine = make_engine(draft_proposer(truncated_draft(target, 1)), k=4)
    return [_serve(engine, tok, t) for t in TEXTS]


def _learner(target, **kw):
    cfg = LearnerConfig(**{**dict(train_every=4, batch_records=4, steps_per_round=3, lr=1e-2, positions="all",
                                  holdout_fraction=0.0), **kw})
    return OnlineLearner(cfg, trainers=[DraftTrainer("d", truncated_draft(target, 1), cfg)])


def _wait(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def test_trains_when_idle_and_engine_installs_between_steps(target, tok, make_engine, draft_proposer, records):
    engine = make_engine(draft_proposer(truncated_draft(target, 1)), k=4)
    with BackgroundLearner(_learner(target), [engine.stage_draft], busy=lambda: engine.busy) as bg:
        for r in records[:4]:
            assert bg.submit(r)
        assert _wait(lambda: bg.stats().published >= 1), bg.stats()
        s = bg.stats()
        assert s.observed == 4 and s.steps == 3 and s.seconds_per_step > 0 and bg.error is None
        # staged, not installed: the serving thread installs it at its next step
        assert engine.learned_draft.version == 0
        prompt = tok("Hello world 3")["input_ids"]
        rid = engine.add_request(list(prompt), SamplingParams(max_tokens=4, ignore_eos=True))
        res = engine.step(rid)
        engine.release(rid)
        assert res.draft_version == s.versions["d"] == engine.learned_draft.version >= 1


def test_no_training_while_requests_are_live(target, records):
    busy = threading.Event()
    busy.set()
    bg = BackgroundLearner(_learner(target), busy=busy.is_set).start()
    try:
        for r in records:
            bg.submit(r)
        assert _wait(lambda: bg.stats().observed == len(records))
        time.sleep(0.3)
        assert bg.stats().steps == 0 and bg.stats().rounds == 0
        busy.clear()  # the queue empties: the pending rounds run now
        assert _wait(lambda: bg.stats().steps > 0)
    finally:
        bg.stop()


def test_step_holds_still_while_a_request_is_live(target, records):
    busy = threading.Event()
    lrn = _learner(target, steps_per_round=2, train_every=1, batch_records=4, micro_batch_records=1)
    trainer = lrn.trainers["d"]
    pieces = []
    real_loss = trainer._loss

    def loss_then_request(*a, **kw):  # a request arrives during the first piece of the first step
        pieces.append(time.monotonic())
        if len(pieces) == 1:
            busy.set()
        return real_loss(*a, **kw)

    trainer._loss = loss_then_request
    with BackgroundLearner(lrn, busy=busy.is_set) as bg:
        for r in records[:4]:
            bg.submit(r)
        assert _wait(lambda: len(pieces) >= 1)
        time.sleep(0.4)
        n_busy = len(pieces)
        busy.clear()  # the request is done: the same round goes on where it stopped
        assert _wait(lambda: bg.stats().rounds >= 1)
        s = bg.stats()
    assert n_busy == 1  # nothing ran while the request was live
    assert s.steps == 2 and s.yielded_rounds == 0
    # 4 records x 2 steps pieces, plus the gate's evaluations (which call _loss once per round)
    assert len(pieces) >= 8


def test_no_round_starts_while_a_request_is_live(target, records):
    """Busy from the start: records are observed, but no round begins (no snapshot, no held-out
    pass, no loss), not only no step."""
    lrn = _learner(target)
    calls = []
    trainer = lrn.trainers["d"]
    real_loss = trainer._loss
    trainer._loss = lambda *a, **kw: calls.append(1) or real_loss(*a, **kw)
    with BackgroundLearner(lrn, busy=lambda: True) as bg:
        for r in records[:4]:
            bg.submit(r)
        assert _wait(lambda: bg.stats().observed == 4)
        time.sleep(0.3)
        assert bg.stats().training is None and bg.stats().rounds == 0 and not calls


class _Clocks:
    """Hand-driven wall and CPU clocks for ShareBudget."""

    def __init__(self):
        self.wall = self.cpu = 0.0


def _share_run(share, busy_for, seconds, tick=0.1, burst_s=1.0):
    """Tick ``seconds`` of wall time; the learner burns its whole tick of CPU whenever it is let run."""
    c = _Clocks()
    b = ShareBudget(share, burst_s, wall=lambda: c.wall, cpu=lambda: c.cpu)
    ran_busy = ran_idle = 0.0
    for i in range(round(seconds / tick)):
        busy = busy_for(c.wall)
        held = b.hold(busy)
        c.wall += tick
        if not held:
            c.cpu += tick
            ran_busy, ran_idle = ran_busy + tick * busy, ran_idle + tick * (not busy)
    b.hold(busy_for(c.wall))
    return b, ran_busy, ran_idle


def test_share_budget_by_hand():
    c = _Clocks()
    b = ShareBudget(0.25, burst_s=2.0, wall=lambda: c.wall, cpu=lambda: c.cpu)
    assert b.hold(True)  # serving busy, nothing earned yet: held back
    c.wall = 4.0
    assert not b.hold(True) and b.credit == 1.0  # 4 busy seconds earned 1 CPU second: let run
    c.wall, c.cpu = 4.6, 0.6  # it ran 0.6 s of CPU against traffic and earned 0.15
    assert not b.hold(True) and b.credit == pytest.approx(0.55) and b.used_s == pytest.approx(0.6)
    c.wall, c.cpu = 5.4, 1.4  # 0.8 more spent, 0.2 earned: overdrawn
    assert b.hold(True) and b.credit == pytest.approx(-0.05)
    c.wall = 5.8  # held back (no CPU charged), 0.1 earned
    assert not b.hold(True) and b.credit == pytest.approx(0.05)
    c.wall, c.cpu = 6.0, 1.6  # it ran 0.2 s, charged; serving is idle now: let run, nothing earned
    assert not b.hold(False) and b.used_s == pytest.approx(1.6) and b.credit == pytest.approx(-0.15)
    c.wall, c.cpu = 15.0, 5.0  # idle since: its 3.4 s of CPU are not charged
    assert not b.hold(False) and b.used_s == pytest.approx(1.6) and b.credit == pytest.approx(-0.15)
    c.wall = 1000.0
    b.hold(True)
    assert b.credit == 2.0  # a long busy stretch banks at most burst_s


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_under_traffic_that_never_pauses_the_learner_gets_its_share_and_no_more(share):
    b, ran_busy, ran_idle = _share_run(share, lambda t: True, seconds=600)
    assert ran_busy / 600 == pytest.approx(share, abs=0.01) and ran_idle == 0
    assert b.used_s == pytest.approx(ran_busy)


def test_without_a_share_steady_traffic_starves_the_learner_and_idle_time_is_free():
    b, ran_busy, ran_idle = _share_run(0.0, lambda t: True, seconds=100)
    assert ran_busy == 0 and b.used_s == 0
    # busy half the time (5 s on, 5 s off): it runs all of the idle half, and share x the busy half
    b, ran_busy, ran_idle = _share_run(0.2, lambda t: int(t) % 10 < 5, seconds=600)
    assert ran_idle == pytest.approx(300, abs=1) and ran_busy == pytest.approx(0.2 * 300, abs=3)


def test_with_min_share_the_learner_trains_under_traffic_that_never_pauses(target, records):
    """Serving always busy: no round without a floor (above); with min_share one runs, and the
    stats count the CPU it trained against traffic."""
    cfg = BackgroundConfig(min_share=0.5, share_burst_s=0.5, poll_s=0.001)
    with BackgroundLearner(_learner(target), busy=lambda: True, cfg=cfg) as bg:
        for r in records[:4]:
            bg.submit(r)
        assert _wait(lambda: bg.stats().rounds >= 1, timeout=60), bg.stats()
        s = bg.stats()
    assert s.steps > 0 and s.against_traffic_s > 0


def test_records_arriving_during_a_long_round_end_it_after_its_minimum(target, records):
    """A round of up to 400 steps ends once the next round's records wait in the queue (after at
    least min_steps_per_round), is gated and published like any other, and the next round starts
    on them (and, with nothing arriving after it, is not cut)."""
    with BackgroundLearner(_learner(target, steps_per_round=400, min_steps_per_round=2)) as bg:
        for r in records[:4]:
            bg.submit(r)
        assert _wait(lambda: bg.stats().training == "d"), bg.stats()
        for r in records[4:8]:
            bg.submit(r)
        assert _wait(lambda: bg.stats().rounds == 1 and bg.stats().training == "d", timeout=60), bg.stats()
        s = bg.stats()
    first = bg.learner.reports[0]
    assert first.cut_short and 2 <= first.steps < 400 and not first.stopped_early and first.version == 1
    assert s.cut_rounds == 1 and s.observed == 8 and bg.error is None
    second = bg.learner.reports[1]  # stopped by the learner's stop, not cut
    assert second.stopped_early and not second.cut_short


def test_an_operators_call_interrupts_a_long_round_instead_of_waiting_it_out(target, records):
    """interrupt() takes the round lock within a step or so of a 400-step round: the round stops
    early (gated as usual), no round starts while the caller holds the lock, and learning goes on after."""
    with BackgroundLearner(_learner(target, steps_per_round=400)) as bg:
        for r in records[:4]:
            bg.submit(r)
        assert _wait(lambda: bg.stats().training == "d" and bg.stats().steps == 0), bg.stats()
        t0 = time.monotonic()
        with bg.interrupt():
            waited = time.monotonic() - t0
            assert len(bg.learner.reports) == 1 and bg.learner.training is None  # the round ended, reported
            for r in records[4:8]:
                bg.submit(r)
            time.sleep(0.3)
            assert bg.learner.training is None and len(bg.learner.reports) == 1  # none starts meanwhile
        first = bg.learner.reports[0]
        assert first.stopped_early and first.steps < 400 and waited < 15
        assert _wait(lambda: bg.stats().training == "d"), bg.stats()  # the next round, on the new records


def test_an_operators_call_waits_a_bounded_time_for_a_round_stuck_in_its_publish(target, records, caplog):
    """A publish that does not return (a draft replica that never answers) keeps the round lock. An
    operator's call with a bound gets LearnerBusy after it, naming what the thread is doing, instead
    of hanging; learning is not left yielding to the caller that gave up; once the publish returns,
    the next call gets the lock."""
    release, entered = threading.Event(), threading.Event()

    def stuck(state, version):
        entered.set()
        release.wait(60)

    with BackgroundLearner(_learner(target, gate_margin=1.0), subscribers=[stuck]) as bg:
        for r in records[:4]:
            bg.submit(r)
        assert entered.wait(60)
        time.sleep(0.05)
        stuck_for = bg.stats()  # what operators see in /admin/learner
        assert stuck_for.holding == "a round, its gate and its publish" and stuck_for.holding_s >= 0.05
        t0 = time.monotonic()
        with pytest.raises(LearnerBusy, match=r"busy for \d+ s \(a round, its gate and its publish\); waited 0.3 s"):
            with bg.interrupt(0.3):
                pass
        assert 0.3 <= time.monotonic() - t0 < 5
        # the log says where the thread is stuck: in the publish, inside the round
        assert "in stuck" in caplog.text and "in maybe_train" in caplog.text, caplog.text
        release.set()
        with bg.interrupt(30):
            assert bg.learner.training is None and bg.stats().holding is None and bg.stats().holding_s is None
        assert _wait(lambda: bg.stats().published == 1), bg.stats()
        for r in records[4:8]:  # the caller that gave up no longer holds rounds back
            bg.submit(r)
        assert _wait(lambda: bg.stats().published == 2), bg.stats()


def test_an_operators_call_on_a_learner_not_started_yet_waits_its_bound_too(target, caplog):
    """Before the learner thread starts (a replica still setting up), an operator's call that finds
    the lock taken gives up after its bound as well, and the log says there is no thread to show."""
    bg = BackgroundLearner(_learner(target), cfg=BackgroundConfig(nice=19))
    held, done = threading.Event(), threading.Event()

    def other():
        with bg.exclusive:
            held.set()
            done.wait(30)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert held.wait(10)
        with pytest.raises(LearnerBusy, match="waited 0.2 s"):
            with bg.interrupt(0.2):
                pass
        assert "(not running)" in caplog.text
    finally:
        done.set()
        t.join()
    with bg.interrupt(5):  # free again
        pass


@pytest.mark.skipif(not hasattr(os, "setpriority") or os.geteuid() != 0, reason="lowering a niceness needs CAP_SYS_NICE")
def test_while_an_operator_waits_the_learner_thread_runs_at_normal_priority(target, records):
    """A learner thread at nice 19 on a busy machine gets almost no CPU, so its step in hand could
    outlast any operator's wait: while an operator's call waits for it, it runs at nice 0; the
    configured niceness comes back once no call waits, whether the call got the lock or gave up."""
    release, entered = threading.Event(), threading.Event()

    def stuck(state, version):
        entered.set()
        release.wait(60)

    bg = BackgroundLearner(_learner(target, gate_margin=1.0), subscribers=[stuck], cfg=BackgroundConfig(nice=19))
    with bg:
        for r in records[:4]:
            bg.submit(r)
        assert entered.wait(60)
        tid = bg._thread.native_id
        assert os.getpriority(os.PRIO_PROCESS, tid) == 19
        gave_up = threading.Event()

        def operator():
            try:
                with bg.interrupt(1.0):
                    pass
            except LearnerBusy:
                gave_up.set()

        waiter = threading.Thread(target=operator)
        waiter.start()
        time.sleep(0.3)
        during = os.getpriority(os.PRIO_PROCESS, tid)
        waiter.join()
        assert gave_up.is_set() and during == 0 and os.getpriority(os.PRIO_PROCESS, tid) == 19  # gave up: back to 19
        release.set()
        with bg.interrupt(30):
            assert os.getpriority(os.PRIO_PROCESS, tid) == 0
        assert os.getpriority(os.PRIO_PROCESS, tid) == 19  # got the lock, let go: back to 19


def test_paused_learner_observes_but_does_not_train(target, records):
    bg = BackgroundLearner(_learner(target))
    bg.pause()
    with bg:
        for r in records:
            bg.submit(r)
        assert _wait(lambda: bg.stats().observed == len(records))
        for _ in range(30):  # 0.3 s in which no round starts, not only none that finished (a round takes longer)
            s = bg.stats()
            assert s.training is None and s.rounds == 0 and s.steps == 0 and s.paused
            time.sleep(0.01)
        bg.resume()
        assert _wait(lambda: bg.stats().steps > 0)


def test_stop_joins_the_thread_and_a_learner_never_started_stops_too(target, records):
    bg = BackgroundLearner(_learner(target)).start()
    bg.stop()
    assert not bg.stats().running
    idle = BackgroundLearner(_learner(target))
    idle.submit(records[0])
    idle.stop()  # nothing to join; what was queued is still observed
    assert idle.stats().observed == 1 and idle.learner.observed == 1


def test_submit_never_blocks_and_counts_drops(target, records):
    bg = BackgroundLearner(_learner(target), cfg=BackgroundConfig(queue_max=2))  # not started: nobody drains
    t0 = time.perf_counter()
    got = [bg.submit(r) for r in records]
    assert time.perf_counter() - t0 < 0.5
    assert got == [True, True] + [False] * (len(records) - 2) and bg.stats().dropped == len(records) - 2


def test_stage_draft_keeps_newest_and_ignores_stale(target, tok, make_engine, draft_proposer):
    engine = make_engine(draft_proposer(truncated_draft(target, 1)), k=4)
    new = truncated_draft(target, 1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.01)
    state = {k: v.numpy().copy() for k, v in new.state_dict().items()}
    engine.stage_draft(state, 3)
    engine.stage_draft({k: v * 0 for k, v in state.items()}, 2)  # older than the staged one: ignored
    rid = engine.add_request(list(tok("abc")["input_ids"]), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step(rid)
    engine.release(rid)
    assert engine.learned_draft.version == 3
    got = engine.learned_draft.runner.model.state_dict()
    assert all(torch.equal(got[k], torch.as_tensor(state[k])) for k in state)


def test_overhead_harness_serves_identical_work_per_mode(target, tok, make_engine, draft_proposer):
    from bench.overhead import format_overhead, run_overhead

    engine = make_engine(draft_proposer(truncated_draft(target, 1)), k=3)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    cfg = LearnerConfig(train_every=1, batch_records=2, steps_per_round=2, lr=1e-3, positions="all", holdout_fraction=0.0)
    res = run_overhead(engine, prompts, cfg, blocks=2, gap_s=0.05, max_tokens=8, warmup=2, log=None)
    m = res["modes"]
    assert set(m) == {"paused", "background", "no-yield"}
    assert {e["requests"] for e in m.values()} == {6} and {e["tokens"] for e in m.values()} == {6 * 8}
    assert m["paused"]["train_steps"] == 0 and m["paused"]["throughput_vs_paused"] == pytest.approx(1.0)
    assert m["no-yield"]["train_steps"] > 0 and m["no-yield"]["seconds_per_step"] > 0
    assert engine.learned_draft.version == 0  # install=False: the measurement keeps the weights fixed
    assert "no-yield" in format_overhead(res)
    with pytest.raises(ValueError):
        run_overhead(engine, prompts, cfg, modes=["bogus"], log=None)


def test_a_tenants_records_are_forgotten_in_the_queue_the_shards_and_the_holdout(target, records):
    import dataclasses

    mine = [dataclasses.replace(r, tenant="gone" if i % 2 else "stays") for i, r in enumerate(records)]
    bg = BackgroundLearner(_learner(target, holdout_fraction=0.5), cfg=BackgroundConfig())  # not started
    for r in mine[:4]:
        bg.submit(r)
    assert bg.forget_queued(lambda r: r.tenant == "gone") == 2
    assert bg._queue.qsize() == 2
    ol = bg.learner
    for r in mine:
        ol.observe(r)
    trainer = ol.trainers["d"]
    stored = len(ol.shards["d"]) + len(trainer.holdout)
    assert stored == len(mine) and any(r.tenant == "gone" for r in trainer.holdout)
    out = ol.delete_tenant("gone")
    assert out["shards"] + out["holdout"] == 4 and out["holdout"] >= 1
    assert all(r.tenant == "stays" for r in ol.shards["d"].records())
    assert all(r.tenant == "stays" for r in trainer.holdout)


def test_a_failing_round_does_not_end_learning_and_rounds_hold_the_exclusive_lock(target, records):
    """A round that raises (as one did when an operator's rollback changed the weights under it)
    is logged and counted; the thread goes on training. While a round runs, another thread cannot
    take ``exclusive`` (the rollback waits for the round instead of corrupting it)."""
    import threading

    ol = _learner(target)
    bg = BackgroundLearner(ol, cfg=BackgroundConfig(poll_s=0.001))
    real, calls, held = ol.maybe_train, [], []

    def flaky(subscribers=(), force=False):
        calls.append(1)
        got = []
        t = threading.Thread(target=lambda: got.append(bg.exclusive.acquire(blocking=False)))
        t.start()
        t.join()
        held.append(not got[0])
        if got[0]:
            bg.exclusive.release()
        if len(calls) == 1:
            raise RuntimeError("weights changed under the round")
        return real(subscribers, force)

    ol.maybe_train = flaky
    with bg:
        for r in records:
            bg.submit(r)
        assert _wait(lambda: bg.stats().rounds >= 1)
        assert bg.stats().running
    assert bg.stats().errors == 1 and isinstance(bg.error, RuntimeError)
    assert held and all(held)


def test_store_on_submit_writes_the_record_before_submit_returns(target, records, tmp_path):
    """The serving side's hand-over is durable: with the learner thread not even started, every
    record submit accepted is already in the shard log on disk (a fresh set reads it back), and
    the thread, once started, only counts it (it is not stored twice)."""
    from learner.replay import ShardConfig, ShardSet

    cfg = LearnerConfig(train_every=100, holdout_fraction=0.0)
    ol = OnlineLearner(cfg, ShardConfig(dir=tmp_path), [DraftTrainer("d", truncated_draft(target, 1), cfg)])
    bg = BackgroundLearner(ol, store_on_submit=True)
    for r in records[:3]:
        assert bg.submit(r)
    assert len(ShardSet.open(ShardConfig(dir=tmp_path))["d"]) == 3
    with bg:
        assert _wait(lambda: bg.stats().observed == 3)
    assert len(ol.shards["d"]) == 3 and ol.traffic("d")["rows"] == sum(r.n_rows for r in records[:3])
    ol.close()


def test_a_full_queue_loses_only_the_traffic_count_of_a_stored_record(target, records, tmp_path):
    """With store_on_submit the record is in its shard before the queue is tried: a full queue drops
    its traffic count, not the record, so submit says it was kept and counts no drop."""
    from learner.replay import ShardConfig

    cfg = LearnerConfig(train_every=100, holdout_fraction=0.0)
    ol = OnlineLearner(cfg, ShardConfig(dir=tmp_path), [DraftTrainer("d", truncated_draft(target, 1), cfg)])
    bg = BackgroundLearner(ol, cfg=BackgroundConfig(queue_max=1), store_on_submit=True)  # not started
    assert [bg.submit(r) for r in records[:3]] == [True, True, True]
    assert len(ol.shards["d"]) == 3 and bg.stats().dropped == 0 and bg.stats().queue_depth == 1
    ol.close()


def test_the_stats_snapshot_reports_seconds_per_step():
    from learner.background import LearnerStats

    s = LearnerStats(steps=4, train_seconds=2.0)
    assert s.seconds_per_step == 0.5 and s.to_dict()["seconds_per_step"] == 0.5 and s.to_dict()["steps"] == 4
    assert LearnerStats().seconds_per_step is None and LearnerStats().to_dict()["seconds_per_step"] is None


def test_the_learner_thread_never_keeps_the_process_alive(target):
    """A daemon thread: a server that exits without stopping its learner is not held open by it."""
    bg = BackgroundLearner(_learner(target)).start()
    try:
        mine = [t for t in threading.enumerate() if t.name == "osd-learner"]
        assert mine and all(t.daemon for t in mine)
        assert bg.start() is bg and len([t for t in threading.enumerate() if t.name == "osd-learner"]) == len(mine)
    finally:
        bg.stop()


def test_round_reports_add_up_in_the_stats_by_hand(target):
    """What the metrics read, from hand-made reports: a published round, a rejected one, one the
    operator's pause stopped early (published), and one with no step (neither)."""
    from learner.trainer import RoundReport

    seen = []
    bg = BackgroundLearner(_learner(target), on_round=seen.append)
    reports = [RoundReport("d", steps=3, train_seconds=0.3, accepted=True, version=1),
               RoundReport("d", steps=1, train_seconds=0.2, accepted=False),
               RoundReport("d", steps=1, train_seconds=0.1, accepted=True, stopped_early=True, version=2),
               RoundReport("d", steps=0, reason="no trainable rows")]
    for rep in reports:
        bg._count(rep)
    s = bg.stats()
    assert (s.rounds, s.steps, s.published, s.rejected, s.yielded_rounds) == (4, 5, 2, 1, 1)
    assert s.train_seconds == pytest.approx(0.6) and s.last_round == reports[-1].to_dict() and seen == reports


def test_housekeeping_runs_between_rounds_holding_the_lock_even_while_paused_or_busy(target):
    """``between_rounds`` is called from the learner thread with ``exclusive`` held (never in the
    middle of a round), after each look for a round, and also while the learner is paused or
    requests are live, when no round runs."""
    import threading

    calls, busy = [], threading.Event()
    bg = None

    def housekeeping():
        got = []
        t = threading.Thread(target=lambda: got.append(bg.exclusive.acquire(blocking=False)))
        t.start()
        t.join()
        calls.append((threading.current_thread().name, not got[0], bg._paused.is_set(), busy.is_set()))

    bg = BackgroundLearner(_learner(target), busy=busy.is_set, cfg=BackgroundConfig(poll_s=0.001),
                           between_rounds=housekeeping)
    with bg:
        assert _wait(lambda: len(calls) >= 2)
        bg.pause()
        n = len(calls)
        assert _wait(lambda: any(paused for *_, paused, _ in calls[n:]))
        bg.resume()
        busy.set()
        n = len(calls)
        assert _wait(lambda: any(b for *_, b in calls[n:]))
    assert all(name == "osd-learner" and held for name, held, _, _ in calls)
