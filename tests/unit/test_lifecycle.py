"""The learner's draft book (``learner.lifecycle.DraftBook``), without the learner server or Ray:
drafts made from their checkpoints or forked from their tenant's general draft, parked beyond the
bound least recently used first (never the general draft), parked when the router retires them,
forgotten beyond the parked bound, and what the pool serves of each."""

from __future__ import annotations

import numpy as np
import torch

from config.draft_ids import GENERAL
from drafts.build import truncated_draft
from learner.lifecycle import DraftBook, known_drafts
from learner.replay import ShardConfig
from learner.checkpoints import draft_folder
from learner.trainer import LearnerConfig, OnlineLearner
from telemetry.meter import Meter


def _book(target, tmp_path, max_drafts=3, max_parked=2, published=None):
    cfg = LearnerConfig(checkpoint_dir=tmp_path / "ckpt", adapter_rank=2, keep_versions=3)
    learner = OnlineLearner(cfg, ShardConfig(dir=tmp_path / "shards"))
    meter = Meter("Learner")
    publish = (lambda d, state, v: published.append((d, v))) if published is not None else None
    book = DraftBook(learner, cfg, truncated_draft(target, 1), None, {}, max_drafts, max_parked, meter, publish)
    return book, meter


def _events(meter, kind):
    return [e for e in meter.snapshot()["events"] if e["kind"] == kind]


def test_a_new_draft_forks_its_tenants_general_draft_as_published_and_is_served_as_v1(target, tmp_path):
    published = []
    book, meter = _book(target, tmp_path, published=published)
    assert book.latest(GENERAL) is None  # nothing published: the pool serves the configured draft
    t = book.trainer(GENERAL)
    with torch.no_grad():
        for p in t.params:
            p.add_(0.01)
    v, state = t.publish()
    book.publish(GENERAL, state, v)
    assert published == [(GENERAL, 1)] and book.latest(GENERAL)[1] == 1
    fork_state, fork_v = book.latest("c1/en")
    assert fork_v == 1 and all(np.array_equal(fork_state[k], state[k]) for k in state)
    assert book.forks["c1/en"] == {"parent": GENERAL, "parent_version": 1}
    assert _events(meter, "fork")[0]["draft"] == "c1/en"
    assert book.latest("c1/en@alice") is None and "c1/en@alice" not in book.forks  # alice's general draft published nothing


def test_beyond_the_bound_the_least_recently_used_draft_is_parked_never_the_general_one(target, tmp_path):
    book, meter = _book(target, tmp_path, max_drafts=3, max_parked=10)
    for d in (GENERAL, "a", "b", "c"):
        book.trainer(d)
    book.trainer("a")  # used again: b is now the least recently used
    book.park_idle()
    assert set(book.learner.trainers) == {GENERAL, "a", "c"} and book.parked() == ["b"]
    assert meter.snapshot()["counters"][("osd_learner_parked_total", ())] == 1
    book.retire(["c", GENERAL])  # the router retired c (and cannot retire the general draft)
    assert set(book.learner.trainers) == {GENERAL, "a", "c"}  # parked between rounds, not at once
    book.park_idle()
    assert set(book.learner.trainers) == {GENERAL, "a"} and set(book.parked()) == {"b", "c"}
    assert meter.snapshot()["counters"][("osd_learner_parked_total", ())] == 2
    again = book.trainer("b")  # a parked draft comes back from its checkpoint
    assert again.version == 0 and "b" in book.learner.trainers


def test_beyond_the_parked_bound_the_least_recently_checkpointed_draft_is_forgotten(target, tmp_path):
    book, meter = _book(target, tmp_path, max_drafts=1, max_parked=2)
    for d in (GENERAL, "a", "b", "c"):
        book.trainer(d)
        book.park_idle()
    assert known_drafts(book.ckpt_dir) == [GENERAL, "b", "c"]  # a, parked first, went
    assert not (book.ckpt_dir / draft_folder("a")).exists() and [e["draft"] for e in _events(meter, "forget")] == ["a"]
    assert known_drafts(book.ckpt_dir, most=2) == [GENERAL, "c"]  # a restart loads the general draft and the newest
