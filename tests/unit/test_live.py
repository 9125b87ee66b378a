"""Rollback on live acceptance (learner.live): hand-made tallies under a hand-driven clock, then the
learner carrying a verdict out, end to end, on a real trainer with checkpoints."""

from __future__ import annotations

import numpy as np
import torch
from conftest import tiny_llama
from test_trainer import _cfg, _record

from learner.live import LiveWatch, LiveWatchConfig, worse
from learner.replay import ShardConfig
from learner.trainer import DraftTrainer, OnlineLearner


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


CFG = LiveWatchConfig(min_proposed=100, margin=0.02, z=2.0, watch_s=600, baseline_records=10)


def _feed(w: LiveWatch, draft: str, version: int, records: int, proposed: int, accepted: int) -> None:
    for _ in range(records):
        w.observe(draft, version, proposed, accepted)


def test_worse_asks_for_the_margin_and_the_standard_errors():
    assert worse((400, 120), (400, 200), 0.02, 2.0)  # 0.30 against 0.50: far past margin + 2 SE (~0.07)
    assert not worse((400, 190), (400, 200), 0.02, 2.0)  # 0.475 against 0.50: within
    assert not worse((20, 6), (20, 10), 0.02, 2.0)  # the same drop on 20 tokens: not significant
    assert not worse((400, 240), (400, 200), 0.02, 2.0)  # better


def test_a_version_serving_worse_than_the_one_it_replaced_is_rolled_back():
    """The old side holds the old version's last records before the publish and those still
    arriving after it; the verdict waits for min_proposed on both sides."""
    clock = Clock()
    w = LiveWatch(CFG, clock)
    _feed(w, "sql", 1, 30, 10, 5)  # v1 at 0.5; only the last 10 records (100 tokens) make its side
    w.published("sql", 2, 1)
    assert w.watching()["sql"] == {"version": 2, "previous": 1, "proposed": 0, "baseline_proposed": 100}
    _feed(w, "sql", 2, 9, 10, 2)  # 90 tokens of v2 at 0.2: not enough yet
    assert w.verdicts() == [] and "sql" in w.watching()
    _feed(w, "sql", 2, 3, 10, 2)
    (v,) = w.verdicts()
    assert (v.draft_id, v.version, v.previous) == ("sql", 2, 1) and (v.acceptance, v.baseline) == (0.2, 0.5)
    assert w.watching() == {}  # decided: closed


def test_a_version_no_worse_is_kept_and_an_undecided_watch_closes_in_time():
    clock = Clock()
    w = LiveWatch(CFG, clock)
    _feed(w, "code", 4, 10, 10, 4)
    w.published("code", 5, 4)
    _feed(w, "code", 5, 10, 10, 4)  # the same acceptance
    assert w.verdicts() == [] and w.kept[-1]["version"] == 5 and w.watching() == {}
    w.published("code", 6, 5)  # the old side: v5's records (v4's are dropped)
    _feed(w, "code", 6, 5, 10, 0)  # terrible, but 50 tokens only
    clock.t += 601
    assert w.verdicts() == [] and w.watching() == {} and "undecided" in w.kept[-1]["reason"]
    _feed(w, "code", 6, 20, 10, 0)
    assert w.verdicts() == []  # no watch any more: nothing to decide


def test_late_records_of_the_old_version_count_on_its_side_and_others_on_neither():
    w = LiveWatch(CFG, Clock())
    w.published("chat", 3, 2)  # nothing of v2 seen before the publish
    _feed(w, "chat", 2, 10, 10, 6)  # replicas still serving v2
    _feed(w, "chat", 1, 10, 10, 0)  # an older version: neither side
    _feed(w, "chat", 3, 10, 10, 1)
    (v,) = w.verdicts()
    assert (v.acceptance, v.baseline) == (0.1, 0.6)


def test_the_learner_rolls_back_what_serves_worse_and_publishes_the_old_weights(tmp_path):
    """A real trainer with checkpoints: a round publishes v1 over v0; records served by v1 accept
    less than v0's did; the learner republishes v0's weights as v2 to its subscribers."""
    cfg = _cfg(tmp_path, train_every=4, batch_records=4, steps_per_round=2, gate_margin=1.0,
               live_rollback=LiveWatchConfig(min_proposed=40, margin=0.0, z=1.0, baseline_records=20))
    draft = tiny_llama(1, seed=7)
    trainer = DraftTrainer("d", draft, cfg)
    v0 = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    learner = OnlineLearner(cfg, ShardConfig(), [trainer])
    got = []
    for i in range(8):  # served by v0: 4 of 5 proposed tokens accepted
        learner.observe(_record(9, 4, [False, False, False, False, True], draft_id="d", draft_version=0))
    rep = learner.maybe_train([lambda s, v: got.append(v)], force=True)
    assert rep.version == 1 and got == [1]
    assert learner.check_live([lambda s, v: got.append(v)]) == []  # nothing served by v1 yet
    for i in range(8):  # served by v1: 1 of 5
        learner.observe(_record(9, 4, [True, True, True, True, False], draft_id="d", draft_version=1))
    states = []
    (verdict,) = learner.check_live([lambda s, v: states.append((s, v))])
    assert (verdict.version, verdict.previous) == (1, 0) and trainer.version == 2
    (state, version), = states
    assert version == 2 and all(np.array_equal(state[k], v0[k].numpy()) for k in v0)
    assert learner.live.rolled_back[-1]["republished_as"] == 2
    assert learner.check_live([lambda s, v: states.append((s, v))]) == [] and len(states) == 1  # not watched again
    assert all(torch.equal(t, v0[k]) for k, t in trainer.model.state_dict().items())
