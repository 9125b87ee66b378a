"""Online learner core: records from a real SpeculativeEngine -> rounds, gate, publish, checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np
import pytest
import torch

from config import SamplingParams
from drafts.build import truncated_draft
from learner.replay import RecordBuilder, ReplayRecord, ShardConfig, ShardSet
from learner.trainer import DraftTrainer, LearnerConfig, OnlineLearner, records_to_batch

torch.set_num_threads(1)

BASE = ["Hello world", "The quick brown fox", "abcabcabc abc", "def f(x): return x", "lorem ipsum dolor", "0123456789"]
# records 0..11 train (suffix 1, 2), 12..17 held out (suffix 3): same traffic, different requests
TEXTS = [b + " 1" for b in BASE] + [b + " 2" for b in BASE] + [b + " 3" for b in BASE]
N_TOK = 24


def _records(engine, tok, texts, draft_id="d"):
    out = []
    for i, text in enumerate(texts):
        prompt = tok(text)["input_ids"]
        b = RecordBuilder(probs_dtype=torch.float32)
        gen = engine.generate(list(prompt), SamplingParams(max_tokens=N_TOK, ignore_eos=True), on_step=b.add)
        out.append(b.finish(list(prompt) + gen.token_ids, len(prompt), draft_id=draft_id))
    return out


@pytest.fixture(scope="module")
def setup(target, tok, make_engine, draft_proposer):
    draft = truncated_draft(target, 1)
    engine = make_engine(draft_proposer(draft), k=4)
    recs = _records(engine, tok, TEXTS)
    return draft, recs


def _cfg(tmp_path=None, **kw):
    base = dict(train_every=4, batch_records=8, steps_per_round=6, lr=3e-2, grad_clip=1.0, positions="all",
                holdout_fraction=0.0, gate_margin=0.0, checkpoint_dir=tmp_path, keep_versions=10)
    return LearnerConfig(**{**base, **kw})


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def test_records_and_masks(setup):
    _, recs = setup
    assert all(r.n_rows > 0 for r in recs)
    samples, mask_all = records_to_batch(recs, "all")
    _, mask_wrong = records_to_batch(recs, "wrong")
    assert len(samples) == len(recs) and bool(mask_all.all())
    assert mask_wrong.shape == mask_all.shape and 0 < int(mask_wrong.sum()) < mask_all.numel()


def _record(length: int, first: int, wrong: list[bool], **fields) -> ReplayRecord:
    """A hand-made record: rows at positions first.. (one per entry of ``wrong``) over ``length`` tokens;
    ``fields``: any other of its fields (draft_id, tenant, ...)."""
    rows = len(wrong)
    probs = torch.full((rows, 2), 0.4)
    return ReplayRecord(tokens=torch.arange(length, dtype=torch.int32), prompt_len=first,
                        positions=torch.arange(first, first + rows, dtype=torch.int32),
                        top_ids=torch.tensor([[1, 2]] * rows, dtype=torch.int32), top_probs=probs, tail=1 - probs.sum(-1),
                        draft_wrong=torch.tensor(wrong), **fields)


def test_a_batch_takes_the_rows_inside_each_sequence_and_their_mask_only():
    """A row that predicts past a record's end is not trained on and has no place in the mask; a record
    with one row inside its sequence still counts; one with none is skipped."""
    three = _record(8, 5, [True, False, True, False])  # rows 5, 6, 7 inside; row 8 past the end
    one = _record(8, 7, [False, True])  # row 7 inside, row 8 past the end
    none = _record(8, 8, [True])  # only a row past the end
    samples, wrong = records_to_batch([three, none, one], "wrong")
    assert [s.n_out for s in samples] == [3, 1]
    assert wrong.tolist() == [True, False, True, False]
    samples, everything = records_to_batch([three, none, one], "all")
    assert [s.n_out for s in samples] == [3, 1] and everything.tolist() == [True] * 4
    assert records_to_batch([none], "all")[1].shape == (0,)


def test_a_record_trains_in_the_window_the_served_draft_reads():
    """context_tokens (engine.draft.context_tokens as served): a record keeps its last N prompt
    tokens and its whole output, rows and mask unchanged; a prompt within the window, or no
    window, leaves it whole."""
    from learner.trainer import in_window

    rec = _record(40, 30, [True] * 10)  # 30 prompt tokens, 10 output rows
    (whole,), _ = records_to_batch([rec], "all")
    (cut,), mask = records_to_batch([rec], "all", context_tokens=16)
    assert whole.prompt_len == 30 and whole.tokens.tolist() == list(range(40))
    assert cut.prompt_len == 16 and cut.tokens.tolist() == list(range(14, 40))
    assert cut.output == whole.output and torch.equal(cut.ids, whole.ids) and torch.equal(cut.probs, whole.probs)
    assert mask.tolist() == [True] * 10
    assert in_window(whole, 30) is whole and in_window(whole, None) is whole and in_window(whole, 64) is whole
    assert in_window(dataclasses.replace(whole, features=torch.zeros(40, 4)), 16).prompt_len == 30  # features: whole


def test_the_learner_deployment_trains_in_the_engines_draft_window(tmp_path):
    """The learner deployment takes engine.draft.context_tokens as its trainer's window unless the
    trainer names its own."""
    from inprocess import app_config

    from deployments.learner import LearnerServer

    def window(trainer: dict) -> int | None:
        cfg = app_config("x", engine={"model": {"name": "x"}, "draft": {"kind": "truncated", "num_layers": 2,
                                                                      "context_tokens": 32}},
                         learner={"enabled": True, "state_dir": str(tmp_path), "trainer": trainer})
        return LearnerServer.window(cfg)

    assert window({}) == 32 and window({"context_tokens": 64}) == 64


def test_a_draft_whose_shard_is_empty_is_not_picked(setup):
    """Lost acceptance counts only where there are records to learn from: a draft whose records were
    all deleted (a tenant's deletion) waits, however much it lost, and one without a shard too."""
    draft, _ = setup
    cfg = _cfg()
    ol = OnlineLearner(cfg, ShardConfig(), [DraftTrainer(d, draft, cfg) for d in ("lost", "fine", "new")])
    lost = _record(20, 10, [True] * 10, draft_id="lost", tenant="gone")
    fine = _record(20, 17, [True, False, False], draft_id="fine", tenant="kept")
    for rec in (lost, fine):
        ol.observe(rec)
    assert ol.pick_draft() == "lost"  # 10 rows all lost against 1 of 3
    ol.delete_tenant("gone")
    assert len(ol.shards["lost"]) == 0 and ol.pick_draft() == "fine"
    assert "new" not in ol.shards  # a trainer that never saw a record has no shard and is not picked


def test_time_spent_paused_is_not_training_time(setup):
    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg(steps_per_round=1, micro_batch_records=1))
    rep = tr.train_round(recs[:4], pause=lambda: time.sleep(0.2))  # before each of the 4 pieces
    assert rep.seconds > 0.8 and rep.train_seconds < 0.6, rep


def test_a_trainer_added_without_held_out_records_makes_no_holdout_shard(setup, tmp_path):
    """Only a restart's held-out records on disk are read back into a trainer; a new draft's trainer
    creates no held-out shard (nor file) until a record is held out for it."""
    draft, _ = setup
    ol = OnlineLearner(_cfg(), ShardConfig(dir=tmp_path), [DraftTrainer("d", draft, _cfg())])
    assert "d" not in ol.holdouts and not list((tmp_path / "holdout").glob("*"))
    ol.close()


def test_a_trained_draft_waits_for_new_traffic(setup):
    """After its round a draft's lost acceptance counts from zero again: another draft with any loss
    goes next, even one that lost far less."""
    draft, _ = setup
    cfg = _cfg(train_every=100)
    ol = OnlineLearner(cfg, ShardConfig(), [DraftTrainer(d, draft, cfg) for d in ("a", "b")])
    ol.observe(_record(20, 10, [True] * 10, draft_id="a"))  # 10 rows lost
    ol.observe(_record(20, 17, [True, False, False], draft_id="b"))  # 1 of 3
    rep = ol.maybe_train(force=True)
    assert rep is not None and rep.draft_id == "a"
    assert ol.pick_draft() == "b"


def test_rounds_raise_heldout_agreement_and_publish(setup, target, tok, make_engine, draft_proposer, greedy_reference):
    draft, recs = setup
    serving = truncated_draft(target, 1)
    engine = make_engine(draft_proposer(serving), k=4)
    tr = DraftTrainer("d", draft, _cfg(lr=1e-2, batch_records=12, gate_margin=0.02))
    train, held = recs[:12], recs[12:]
    for r in held:
        tr.add_holdout(r)
    before = tr.agreement()
    got = []
    for _ in range(3):
        rep = tr.train_round(train)
        assert rep.steps == 6 and rep.accepted, rep.reason
        assert rep.loss_after < rep.loss_before
        v, state = tr.publish()
        got.append(v)
        engine.swap_draft(state, v)
    assert got == [1, 2, 3]
    assert all(isinstance(a, np.ndarray) for a in state.values())
    after = tr.agreement()
    assert after > before, (before, after)
    assert _same(serving.state_dict(), state)  # the subscriber got the weights
    assert not _same(_weights(draft), state)  # the original draft object was never trained
    for text in TEXTS[:3]:
        p = tok(text)["input_ids"]
        out = engine.generate(list(p), SamplingParams(max_tokens=16)).token_ids
        assert out == greedy_reference(p, 16)


def test_gate_rejects_nan_and_restores(setup):
    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg())
    for r in recs[12:]:
        tr.add_holdout(r)
    w0 = _weights(tr.model)
    step = tr.opt.step

    def poisoned(*a, **k):
        out = step(*a, **k)
        with torch.no_grad():
            next(tr.model.parameters()).view(-1)[0] = float("nan")
        return out

    tr.opt.step = poisoned
    rep = tr.train_round(recs[:12])
    assert not rep.accepted and "non-finite" in rep.reason
    assert _same(_weights(tr.model), w0)
    assert tr.opt.state_dict()["state"] == {}  # pre-round optimiser state restored
    # a state-dict candidate with a NaN
    bad = {k: v.clone() for k, v in w0.items()}
    bad["model.norm.weight"][0] = float("nan")
    assert tr.gate(bad)[0] is False


def test_gate_rejects_regression_and_restores(setup):
    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg(lr=30.0, grad_clip=0.0))
    for r in recs[12:]:
        tr.add_holdout(r)
    w0 = _weights(tr.model)
    ok, _ = tr.gate()
    assert ok
    # corrupted weights as a candidate
    g = torch.Generator().manual_seed(1)
    noisy = {k: v + 5.0 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    ok, reason = tr.gate(noisy)
    assert not ok and "agreement" in reason
    # a huge learning rate: the round's candidate regresses and is discarded
    assert (tr.rounds, tr.rejected) == (0, 0)
    rep = tr.train_round(recs[:12])
    assert rep.steps > 0 and not rep.accepted, rep
    assert _same(_weights(tr.model), w0)
    assert tr.version == 0 and (tr.rounds, tr.rejected) == (1, 1) and list(tr.history) == [rep]


def test_checkpoints_latest_and_rollback(setup, tmp_path):
    draft, recs = setup
    cfg = _cfg(tmp_path)
    tr = DraftTrainer("d", draft, cfg)
    assert tr.versions() == [0] and tr.latest_version() == 0
    snaps = {0: _weights(tr.model)}
    for _ in range(2):
        assert tr.train_round(recs[:12]).accepted
        v, _ = tr.publish()
        snaps[v] = _weights(tr.model)
    assert tr.versions() == [0, 1, 2] and (tmp_path / "d" / "LATEST").read_text().strip() == "v2"
    # restart: a new trainer from the untrained draft reloads v2
    tr2 = DraftTrainer("d", draft, cfg)
    assert tr2.version == 2 and _same(_weights(tr2.model), snaps[2])
    v, state = tr2.rollback(1)
    assert v == 3 and _same(_weights(tr2.model), snaps[1]) and _same(state, snaps[1])
    assert tr2.latest_version() == 3
    tr3 = DraftTrainer("d", draft, cfg)
    assert tr3.version == 3 and _same(_weights(tr3.model), snaps[1])


def test_keep_versions(setup, tmp_path):
    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg(tmp_path, keep_versions=2, steps_per_round=1))
    for _ in range(3):
        tr.publish()
    assert tr.versions() == [2, 3]


def test_should_yield_stops_round(setup):
    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg())
    w0 = _weights(tr.model)
    rep = tr.train_round(recs[:12], should_yield=lambda: True)
    assert rep.steps == 0 and rep.stopped_early and _same(_weights(tr.model), w0)
    calls = iter([False, False, True])
    rep = tr.train_round(recs[:12], should_yield=lambda: next(calls, True))
    assert rep.steps == 2 and rep.stopped_early  # checks: before the round, before steps 2 and 3


def test_a_round_ends_after_its_minimum_once_the_next_is_due_and_never_before(setup):
    """steps_per_round is a cap: past min_steps_per_round a round ends when ``next_due`` says the next
    round's records are in; it still goes to the gate. Without the minimum set, ``next_due`` is ignored."""
    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg(min_steps_per_round=2))
    rep = tr.train_round(recs[:8], next_due=lambda: True)
    assert (rep.steps, rep.cut_short, rep.stopped_early) == (2, True, False) and rep.accepted
    asked = []
    rep = tr.train_round(recs[:8], next_due=lambda: asked.append(1) or len(asked) >= 3)
    assert (rep.steps, rep.cut_short, len(asked)) == (4, True, 3)  # asked before steps 3, 4 and 5
    rep = tr.train_round(recs[:8], next_due=lambda: False)
    assert (rep.steps, rep.cut_short) == (6, False)
    rep = DraftTrainer("d", copy.deepcopy(draft), _cfg()).train_round(recs[:8], next_due=lambda: True)
    assert (rep.steps, rep.cut_short) == (6, False)


def test_a_round_trains_on_a_single_wrong_row_and_times_a_round_that_did_not_start(setup):
    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg(positions="wrong"))
    one = dataclasses.replace(recs[0], draft_wrong=torch.arange(recs[0].n_rows) == recs[0].n_rows - 2)
    rep = tr.train_round([one])
    assert rep.positions == 1 and rep.steps == 6 and rep.accepted
    none = dataclasses.replace(recs[0], draft_wrong=torch.zeros(recs[0].n_rows, dtype=torch.bool))
    rep = tr.train_round([none])
    assert (rep.positions, rep.steps, rep.reason) == (0, 0, "no trainable rows") and 0 <= rep.seconds < 5
    rep = tr.train_round([one], should_yield=lambda: True)
    assert rep.steps == 0 and rep.stopped_early and 0 <= rep.seconds < 5


def test_max_cpu_share_sleeps(setup, monkeypatch):
    """Share 0.25: after each step but the last, a pause of 3x that step's training time, and the
    pauses pass on the round's clock. The trainer reads a fake clock that only the optimiser's steps
    (0.1 s, 0.2 s, 0.3 s) and the pauses' sleeps advance, so the figures are exact whatever else
    the machine is doing; that the real pause sleeps and frees the CPU is the next test's."""
    import types

    import learner.trainer as trainer_mod

    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg(steps_per_round=3, max_cpu_share=0.25))
    clock = types.SimpleNamespace(now=100.0)

    def sleep(seconds):
        clock.now += seconds

    monkeypatch.setattr(trainer_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock.now, sleep=sleep))
    step_costs = iter([0.1, 0.2, 0.3])
    real_step = tr.opt.step

    def costly_step(*a, **kw):
        clock.now += next(step_costs)
        return real_step(*a, **kw)

    monkeypatch.setattr(tr.opt, "step", costly_step)
    asked = []
    real_pause = DraftTrainer._pause

    def spy(seconds, should_yield):
        asked.append(seconds)
        real_pause(seconds, should_yield)

    monkeypatch.setattr(DraftTrainer, "_pause", staticmethod(spy))
    rep = tr.train_round(recs[:2])
    assert rep.steps == 3
    assert asked == pytest.approx([0.3, 0.6])  # 3x the 1st and 2nd steps; none after the last
    assert rep.train_seconds == pytest.approx(0.6)
    assert rep.seconds == pytest.approx(0.6 + 0.9)  # the pauses pass on the round's clock


def test_pause_sleeps_and_yields():
    import time

    t0, cpu0 = time.perf_counter(), time.thread_time()
    DraftTrainer._pause(0.1, None)
    assert time.perf_counter() - t0 >= 0.1
    assert time.thread_time() - cpu0 < 0.05  # it sleeps: the CPU is free for serving, not spun on
    t0 = time.perf_counter()
    DraftTrainer._pause(5.0, lambda: True)  # a request arrived: stop pausing at once
    assert time.perf_counter() - t0 < 0.5


def _with_draft(rec, draft_id, wrong=None):
    r = dataclasses.replace(rec, draft_id=draft_id)
    if wrong is not None:
        r.draft_wrong = torch.full_like(r.draft_wrong, wrong)
    return r


def test_pick_draft_prefers_lost_acceptance(setup):
    draft, recs = setup
    cfg = _cfg(holdout_fraction=0.0)
    ol = OnlineLearner(cfg, ShardSet(ShardConfig()), [DraftTrainer("a", draft, cfg), DraftTrainer("b", draft, cfg)])
    for r in recs[:6]:
        ol.observe(_with_draft(r, "a", wrong=False))  # more traffic, always right
    for r in recs[6:8]:
        ol.observe(_with_draft(r, "b", wrong=True))  # less traffic, always wrong
    assert ol.traffic("a")["acceptance"] == 1.0 and ol.traffic("b")["acceptance"] == 0.0
    assert ol.pick_draft() == "b"
    for r in recs[8:12]:
        ol.observe(_with_draft(r, "a", wrong=True))  # a now has more traffic x lost acceptance
    assert ol.pick_draft() == "a"


def test_the_learner_keeps_only_its_newest_round_reports(setup):
    """The learner's and each draft's: a learner running for weeks does not keep one per round."""
    draft, recs = setup
    cfg = _cfg(train_every=4, steps_per_round=1, keep_reports=2)
    ol = OnlineLearner(cfg, ShardConfig(), [DraftTrainer("d", draft, cfg)])
    reports = []
    for r in recs:
        ol.observe(r)
        rep = ol.maybe_train([])
        if rep is not None:
            reports.append(rep)
    assert len(reports) == 4 and list(ol.reports) == reports[-2:] and list(ol.trainers["d"].history) == reports[-2:]


def test_online_learner_end_to_end(setup, target, make_engine, draft_proposer):
    draft, recs = setup
    serving = truncated_draft(target, 1)
    engine = make_engine(draft_proposer(serving), k=4)
    # plumbing test: 2-4 held-out records are too few for a meaningful agreement gate here
    cfg = _cfg(train_every=4, holdout_fraction=0.25, positions="wrong", gate_margin=1.0, lr=1e-2)
    ol = OnlineLearner(cfg, ShardConfig(), [DraftTrainer("d", draft, cfg)])
    got = []
    reports, at = [], []
    for i, r in enumerate(recs, start=1):
        ol.observe(r)
        rep = ol.maybe_train([lambda s, v: got.append(v), engine.swap_draft])
        if rep is not None:
            reports.append(rep)
            at.append(i)
    assert at == [4, 8, 12, 16] and ol.observed == len(recs) and list(ol.reports) == reports  # every train_every records
    assert len(ol.trainers["d"].holdout) + len(ol.shards["d"]) == len(recs)
    assert got, [(r.steps, r.reason) for r in reports]
    assert got == [r.version for r in reports if r.accepted]
    assert engine.proposer.version == got[-1]
    # yielding learner: no round runs
    ol.should_yield = lambda: True
    assert ol.maybe_train([], force=True) is None


def test_remove_trainer_forgets_draft_and_deletes_its_shard(setup, tmp_path):
    draft, recs = setup
    cfg = _cfg()
    ol = OnlineLearner(cfg, ShardConfig(dir=tmp_path), [DraftTrainer("a", draft, cfg), DraftTrainer("b", draft, cfg)])
    for r in recs[:4]:
        ol.observe(_with_draft(r, "a"))
        ol.observe(_with_draft(r, "b"))
    log_b = ol.shards["b"].path
    assert log_b.exists() and ol.pick_draft() in {"a", "b"}
    ol.remove_trainer("b")
    assert "b" not in ol.trainers and "b" not in ol.shards and not log_b.exists()
    assert ol.pick_draft() == "a" and ol.traffic("b")["rows"] == 0
    ol.close()


def test_operator_rollback_from_the_command_line(setup, tmp_path, capsys):
    from learner.ops import main as draft_main, versions

    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg(tmp_path))
    snaps = {0: _weights(tr.model)}
    assert tr.train_round(recs[:12]).accepted
    v, _ = tr.publish()
    snaps[v] = _weights(tr.model)
    assert versions(tmp_path)["d"]["latest"] == "v1"
    assert draft_main(["rollback", "--checkpoint-dir", str(tmp_path), "--draft", "d", "--version", "0"]) == 0
    info = versions(tmp_path, "d")["d"]
    assert info["latest"] == "v2" and info["versions"][2]["rolled_back_from"] == 0 and set(info["versions"]) == {0, 1, 2}
    restarted = DraftTrainer("d", draft, _cfg(tmp_path))  # what a serving process loads at start
    assert restarted.version == 2 and _same(_weights(restarted.model), snaps[0])
    assert draft_main(["versions", "--checkpoint-dir", str(tmp_path)]) == 0 and "LATEST = v2" in capsys.readouterr().out
    with pytest.raises(Exception):
        draft_main(["rollback", "--checkpoint-dir", str(tmp_path), "--draft", "d", "--version", "9"])


def test_operators_name_a_draft_by_its_id_whatever_its_folder(setup, tmp_path, capsys):
    """`osd draft` takes and prints draft ids; a per-language draft's folder is its quoted id."""
    from learner.ops import main as draft_main, versions

    draft, recs = setup
    tr = DraftTrainer("d:chat/es", draft, _cfg(tmp_path))
    assert tr.train_round(recs[:12]).accepted
    tr.publish()
    DraftTrainer("other", draft, _cfg(tmp_path))
    assert sorted(versions(tmp_path)) == ["d:chat/es", "other"]
    assert list(versions(tmp_path, "d:chat/es")) == ["d:chat/es"]
    assert draft_main(["rollback", "--checkpoint-dir", str(tmp_path), "--draft", "d:chat/es", "--version", "0"]) == 0
    assert versions(tmp_path, "d:chat/es")["d:chat/es"]["latest"] == "v2"
    assert "d:chat/es: the weights of v0 are published as v2 (LATEST)" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no checkpoints of draft 'd:chat'"):
        versions(tmp_path, "d:chat")


def test_an_operators_rollback_keeps_every_checkpoint_and_the_cli_needs_its_arguments(setup, tmp_path):
    """Serving prunes old checkpoints (keep_versions); an operator's rollback from the command line
    keeps all of them, however many there are (here 62 before it)."""
    import shutil

    from learner.ops import main as draft_main

    draft, recs = setup
    DraftTrainer("d", draft, _cfg(tmp_path))  # v0
    for v in range(1, 62):
        shutil.copytree(tmp_path / "d" / "v0", tmp_path / "d" / f"v{v}")
    (tmp_path / "d" / "LATEST").write_text("v61\n")
    assert draft_main(["rollback", "--checkpoint-dir", str(tmp_path), "--draft", "d", "--version", "3"]) == 0
    assert DraftTrainer("d", draft, _cfg(tmp_path, keep_versions=10**6)).versions() == list(range(63))
    for args in ([], ["versions"], ["rollback", "--draft", "d", "--version", "1"],
                 ["rollback", "--checkpoint-dir", str(tmp_path), "--version", "1"],
                 ["rollback", "--checkpoint-dir", str(tmp_path), "--draft", "d"]):
        with pytest.raises(SystemExit):  # each of these arguments is required
            draft_main(args)


def test_micro_batched_step_equals_whole_batch_step(setup):
    draft, recs = setup
    whole = DraftTrainer("d", draft, _cfg(steps_per_round=1, lr=1e-2))
    pieces = DraftTrainer("d", draft, _cfg(steps_per_round=1, lr=1e-2, micro_batch_records=3))
    calls = []
    whole.train_round(recs[:8])
    pieces.train_round(recs[:8], pause=lambda: calls.append(1))
    # ceil(8 / 3) pieces, pause before each: in the step and in the losses before and after it (no held-back records)
    assert len(calls) == 3 * 3
    a, b = _weights(whole.model), _weights(pieces.model)
    assert all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in a)
    assert not all(torch.equal(a[k], _weights(draft)[k]) for k in a)  # the step did change the weights


def _step_grads(trainer, records, **kw):
    """The gradient the round's single optimiser step applies (recorded at the step)."""
    grads = []
    real = trainer.opt.step

    def step(*a, **k):
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return real(*a, **k)

    trainer.opt.step = step
    rep = trainer.train_round(records, **kw)
    assert rep.steps == 1 and len(grads) == 1
    return grads[0]


def test_micro_batched_gradients_are_the_whole_batch_mean_even_with_pieces_of_one_row(setup):
    """Pieces are weighted by their share of the rows, so the accumulated gradient is the gradient
    of the mean over every row (Adam hides a wrong scale in the weights; the gradient shows it); a
    piece with a single trainable row counts, and one with none is skipped."""
    draft, recs = setup
    n = recs[2].n_rows
    one_wrong = dataclasses.replace(recs[2], draft_wrong=torch.arange(n) == 1)
    none_wrong = dataclasses.replace(recs[3], draft_wrong=torch.zeros(n, dtype=torch.bool))
    batch = [recs[0], recs[1], one_wrong, none_wrong, recs[4]]
    cfg = dict(steps_per_round=1, lr=1e-2, grad_clip=0.0, positions="wrong", gate_margin=1.0)
    whole = _step_grads(DraftTrainer("d", draft, _cfg(**cfg)), batch)
    calls = []
    pieces = _step_grads(DraftTrainer("d", draft, _cfg(**cfg, micro_batch_records=1)), batch, pause=lambda: calls.append(1))
    # one piece a record; the record without a trainable row is skipped: in the step and the losses before and after
    assert len(calls) == 4 * 3
    assert whole.keys() == pieces.keys() and whole
    assert all(torch.allclose(whole[k], pieces[k], atol=1e-6, rtol=1e-4) for k in whole)
    without = _step_grads(DraftTrainer("d", draft, _cfg(**cfg)), [recs[0], recs[1], recs[4]])
    assert not all(torch.allclose(whole[k], without[k], atol=1e-6, rtol=1e-4) for k in whole)  # the one row counted


def test_gradients_are_clipped_to_grad_clip_and_not_without_it(setup):
    draft, recs = setup
    norm = {}
    for clip in (0.0, 1.0, 0.5):
        g = _step_grads(DraftTrainer("d", draft, _cfg(steps_per_round=1, grad_clip=clip, gate_margin=1.0)), recs[:8])
        norm[clip] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for v in g.values()])))
    assert norm[0.0] > 2.0  # the unclipped gradient of this batch is larger than either bound
    assert norm[1.0] == pytest.approx(1.0, rel=1e-3) and norm[0.5] == pytest.approx(0.5, rel=1e-3)


def test_a_round_says_when_a_yield_stopped_it(setup):
    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg())
    rep = tr.train_round(recs[:8])
    assert rep.accepted and not rep.stopped_early and "stopped early" not in rep.reason
    calls = iter([False, True])
    rep = tr.train_round(recs[:8], should_yield=lambda: next(calls, True))
    assert rep.stopped_early and rep.steps == 1 and rep.reason.endswith("; stopped early (yield)")


def test_busiest_draft_does_not_take_every_round(setup):
    draft, recs = setup
    cfg = _cfg(holdout_fraction=0.0, train_every=2, steps_per_round=1)
    ol = OnlineLearner(cfg, ShardSet(ShardConfig()), [DraftTrainer("big", draft, cfg), DraftTrainer("small", draft, cfg)])
    picked = []
    for i, r in enumerate(recs[:12]):  # "big" serves 3 of every 4 records, both always wrong
        ol.observe(_with_draft(r, "small" if i % 4 == 3 else "big", wrong=True))
        rep = ol.maybe_train()
        if rep is not None:
            picked.append(rep.draft_id)
    assert len(picked) == 6 and "small" in picked and picked.count("big") > picked.count("small")


def test_resampled_steps_train_on_fresh_batches(setup):
    draft, recs = setup
    drawn = []

    def next_batch():
        drawn.append(1)
        return recs[4:8]

    # one step on recs[:4] then one on recs[4:8] == a trainer that saw those two batches in turn
    tr = DraftTrainer("d", draft, _cfg(steps_per_round=2, lr=1e-2))
    rep = tr.train_round(recs[:4], next_batch=next_batch)
    assert rep.steps == 2 and len(drawn) == 1
    ref = DraftTrainer("d", draft, _cfg(steps_per_round=1, lr=1e-2))
    ref.train_round(recs[:4])
    ref.train_round(recs[4:8])  # a second round: a fresh step count, same optimiser state
    a, b = _weights(tr.model), _weights(ref.model)
    assert all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in a)
    repeat = DraftTrainer("d", draft, _cfg(steps_per_round=2, lr=1e-2))
    repeat.train_round(recs[:4])  # without next_batch both steps fit recs[:4]
    c = _weights(repeat.model)
    assert not all(torch.allclose(a[k], c[k], atol=1e-5, rtol=1e-4) for k in a)


def test_online_learner_resamples_the_shard_every_step(setup, monkeypatch):
    draft, recs = setup
    for resample, calls in ((True, 3), (False, 1)):
        cfg = _cfg(train_every=12, steps_per_round=3, resample=resample)
        ol = OnlineLearner(cfg, ShardSet(ShardConfig()), [DraftTrainer("d", draft, cfg)])
        for r in recs[:12]:
            ol.observe(r)
        shard = ol.shards["d"]
        n = []
        orig = shard.sample
        monkeypatch.setattr(shard, "sample", lambda k, rng=None: n.append(k) or orig(k, rng))
        rep = ol.maybe_train()
        assert rep is not None and rep.steps == 3 and n == [cfg.batch_records] * calls


def test_frozen_embeddings_stay_put(setup):
    draft, recs = setup
    tr = DraftTrainer("d", draft, _cfg(train_embeddings=False))
    emb = tr.model.get_input_embeddings().weight.detach().clone()
    w0 = _weights(tr.model)
    assert tr.train_round(recs[:8]).steps == 6
    assert torch.equal(tr.model.get_input_embeddings().weight, emb)
    w1 = _weights(tr.model)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0 if "layers" in k)
    assert all(p.requires_grad == (p is not tr.model.get_input_embeddings().weight) for p in tr.model.parameters())


def test_paired_gate_allows_a_drop_within_its_noise_and_rejects_a_clear_one(setup, monkeypatch):
    draft, _ = setup
    base = torch.zeros(100, dtype=torch.bool)
    base[:60] = True  # current weights: 0.60

    def candidate(gains, losses):
        h = base.clone()
        h[60:60 + gains] = True
        h[:losses] = False
        return h

    small = candidate(5, 9)  # 0.56: b = 5, c = 9, bound = 0.02 + sqrt(14) / 100 = 0.057
    clear = candidate(0, 30)  # 0.30
    for z, hits, ok in ((0.0, small, False), (1.0, small, True), (1.0, clear, False), (0.0, base, True)):
        tr = DraftTrainer("d", draft, _cfg(gate_margin=0.02, gate_z=z))
        monkeypatch.setattr(tr, "holdout_hits", lambda model=None, h=hits, **_: h)
        got, reason = tr.gate(baseline=0.6, baseline_hits=base)
        assert got is ok, (z, reason)
    tr = DraftTrainer("d", draft, _cfg(gate_margin=0.02, gate_z=1.0))
    monkeypatch.setattr(tr, "holdout_hits", lambda model=None, **_: clear)
    ok, reason = tr.gate(baseline=0.6, baseline_hits=base)
    assert not ok and "paired drop 0.3000 > 0.0748" in reason


def _hits(n: int, right: int) -> torch.Tensor:
    h = torch.zeros(n, dtype=torch.bool)
    h[:right] = True
    return h


def test_gate_boundaries_by_hand(setup, monkeypatch):
    """Exactly at the margin passes (a drop must exceed it), for the fixed margin and the paired test;
    with gate_z = 0 the fixed margin decides even when per-position hits are given."""
    draft, _ = setup

    def gate(cfg, hits, **kw):
        tr = DraftTrainer("d", draft, cfg)
        monkeypatch.setattr(tr, "holdout_hits", lambda model=None, **_: hits)
        return tr.gate(**kw)[0]

    # fixed margin: 0.5 = 0.75 - 0.25 exactly
    assert gate(_cfg(gate_margin=0.25), _hits(8, 4), baseline=0.75) is True
    assert gate(_cfg(gate_margin=0.25), _hits(8, 3), baseline=0.75) is False
    # paired: c = 4 positions lost, b = 0 of n = 8; bound = 0.25 + 1 * sqrt(4) / 8 = 0.5 = c / n
    base = _hits(8, 8)
    assert gate(_cfg(gate_margin=0.25, gate_z=1.0), _hits(8, 4), baseline=1.0, baseline_hits=base) is True
    assert gate(_cfg(gate_margin=0.25, gate_z=1.0), _hits(8, 3), baseline=1.0, baseline_hits=base) is False
    # gate_z = 0: margin only, against the given baseline (0.9), not the hits' own rate (0.5)
    assert gate(_cfg(gate_margin=0.0), _hits(10, 6), baseline=0.9, baseline_hits=_hits(10, 5)) is False


def test_gate_keeps_a_given_baseline_for_a_separate_candidate(setup, monkeypatch):
    draft, _ = setup
    tr = DraftTrainer("d", draft, _cfg(gate_margin=0.0))
    monkeypatch.setattr(tr, "holdout_hits", lambda model=None, **_: _hits(10, 5))  # everyone scores 0.5
    other = copy.deepcopy(draft)
    assert tr.gate(other, baseline=0.9)[0] is False  # not replaced by the current weights' 0.5
    assert tr.gate(other)[0] is True  # no baseline given: the current weights' agreement


def test_gate_refuses_non_finite_loss_and_mismatched_state(setup):
    draft, _ = setup
    tr = DraftTrainer("d", draft, _cfg())
    assert tr.gate(loss=float("nan")) == (False, "non-finite loss")
    assert tr.gate(loss=float("inf"))[0] is False
    state = {k: v.numpy() for k, v in draft.state_dict().items()}
    state.pop(next(iter(state)))
    with pytest.raises(RuntimeError, match="Missing key"):
        tr.gate(state)  # a state dict that does not fit the draft is an error, never a partial load


# -- crashes and corrupt state at start ----------------------------------------------------------


def test_a_checkpoint_that_does_not_load_is_skipped_and_the_previous_good_weights_served_above_it(setup, tmp_path, caplog):
    """Truncated weights of the newest version: moved aside with the reason logged; the weights of
    the version before are checkpointed again under a version above the skipped one (a replica
    that got the skipped version must still take them); a NaN checkpoint is skipped the same way."""
    draft, recs = setup
    cfg = _cfg(tmp_path)
    tr = DraftTrainer("d", draft, cfg)
    snaps = {0: _weights(tr.model)}
    for _ in range(2):
        assert tr.train_round(recs[:12]).accepted
        v, _ = tr.publish()
        snaps[v] = _weights(tr.model)
    weights = tmp_path / "d" / "v2" / "weights.safetensors"
    assert weights.exists(), sorted(p.name for p in (tmp_path / "d" / "v2").iterdir())
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut short
    with caplog.at_level("ERROR", logger="learner.trainer"):
        tr2 = DraftTrainer("d", draft, cfg)
    assert tr2.skipped == [2] and tr2.version == 3 and _same(_weights(tr2.model), snaps[1])
    assert "checkpoint v2 is unreadable" in caplog.text
    assert tr2.versions() == [0, 1, 3] and any(p.name.startswith("corrupt-v2-") for p in (tmp_path / "d").iterdir())
    assert tr2.latest_version() == 3
    # NaN weights that load as a file are not served either
    from drafts.build import save_draft

    bad = copy.deepcopy(tr2.model)
    with torch.no_grad():
        next(bad.parameters()).fill_(float("nan"))
    save_draft(bad, tmp_path / "d" / "v4", tr2.keep_ids)
    tr3 = DraftTrainer("d", draft, cfg)
    assert tr3.skipped == [4] and tr3.version == 5 and _same(_weights(tr3.model), snaps[1])


def test_when_no_checkpoint_loads_the_initial_weights_are_saved_above_every_skipped_version(setup, tmp_path):
    """Every version on disk is unreadable: the trainer starts from the draft it was given, checkpointed
    as the initial weights under a version above each skipped one (never one a replica may hold)."""
    from drafts.build import read_meta

    draft, _ = setup
    cfg = _cfg(tmp_path)
    DraftTrainer("d", draft, cfg)  # v0, the initial weights
    (tmp_path / "d" / "v0").rename(tmp_path / "d" / "v3")
    (tmp_path / "d" / "v3" / "weights.safetensors").write_bytes(b"not weights")
    tr = DraftTrainer("d", draft, cfg)
    assert tr.skipped == [3] and tr.version == 4 and tr.versions() == [4] and tr.latest_version() == 4
    assert read_meta(tmp_path / "d" / "v4")["initial"] is True and _same(_weights(tr.model), _weights(draft))
    assert (tr.rounds, tr.rejected) == (0, 0)


def test_a_draft_id_with_a_slash_checkpoints_into_one_folder_made_for_it(setup, tmp_path):
    """A per-language draft ("d:chat/es") under a checkpoint folder that does not exist yet: one
    folder, not d:chat/es nested (which a restarted learner would read back as a draft "d:chat")."""
    draft, recs = setup
    tr = DraftTrainer("d:chat/es", draft, _cfg(tmp_path / "new" / "ckpt"))
    root = tmp_path / "new" / "ckpt" / "d:chat%2Fes"
    assert tr.ckpt_root == root and tr.versions() == [0] and (root / "LATEST").read_text() == "v0\n"
    assert [p.name for p in (tmp_path / "new" / "ckpt").iterdir()] == ["d:chat%2Fes"]
    assert DraftTrainer("d:chat/es", draft, _cfg(tmp_path / "new" / "ckpt")).version == 0  # found again


def test_a_restricted_head_checkpoint_reloads_with_its_ids(setup, tmp_path):
    draft, recs = setup
    keep = torch.arange(0, draft.get_output_embeddings().weight.shape[0], 2)  # every other id of the vocabulary
    small = copy.deepcopy(draft)
    head = draft.get_output_embeddings()
    small.lm_head = torch.nn.Linear(head.weight.shape[1], len(keep), bias=False)
    small.lm_head.weight.data = head.weight.data[keep].clone()
    small.config.tie_word_embeddings = False
    tr = DraftTrainer("d", small, _cfg(tmp_path), keep_ids=keep)
    assert tr.train_round(recs[:8]).accepted
    v, _ = tr.publish()
    again = DraftTrainer("d", small, _cfg(tmp_path), keep_ids=keep)
    assert again.skipped == [] and again.version == v and torch.equal(again.keep_ids, keep)
    assert _same(_weights(again.model), _weights(tr.model))


def test_a_checkpoint_of_another_architecture_is_skipped_not_loaded_in_part(setup, target, tmp_path):
    """A one-layer draft's checkpoint found by a two-layer draft's trainer: every tensor it has fits,
    but one layer is missing; it is moved aside, never loaded over half the model."""
    from drafts.build import save_draft

    draft, _ = setup
    two = truncated_draft(target, 2)
    tr = DraftTrainer("d", two, _cfg(tmp_path))
    save_draft(draft, tmp_path / "d" / "v5", None)  # one layer
    again = DraftTrainer("d", two, _cfg(tmp_path))
    assert again.skipped == [5] and again.version == 6 and _same(_weights(again.model), _weights(tr.model))


def test_checkpoint_lookups_of_a_missing_folder_or_latest_file(setup):
    from learner.checkpoints import checkpoint_versions, latest_checkpoint

    assert checkpoint_versions(None) == [] and latest_checkpoint(None) is None
    tr = DraftTrainer("d", setup[0], _cfg())  # no checkpoint_dir
    assert tr.load_latest() is None and tr.versions() == [] and tr.latest_version() is None


def test_checkpoint_lookups_on_disk(tmp_path):
    from learner.checkpoints import checkpoint_versions, latest_checkpoint

    assert checkpoint_versions(tmp_path / "missing") == [] and latest_checkpoint(tmp_path / "missing") is None
    for name in ("v2", "v10", "v1x", "corrupt-v3-1", ".tmp-v4"):
        (tmp_path / name).mkdir()
    (tmp_path / "v7").write_text("a file, not a folder")
    assert checkpoint_versions(tmp_path) == [2, 10] and latest_checkpoint(tmp_path) is None
    (tmp_path / "LATEST").write_text("v10\n")
    assert latest_checkpoint(tmp_path) == 10
    (tmp_path / "LATEST").write_text("garbage")
    assert latest_checkpoint(tmp_path) is None


def test_a_checkpoint_newer_than_latest_is_the_one_loaded_and_leftovers_are_removed(setup, tmp_path):
    """A crash after the checkpoint folder was renamed into place but before LATEST moved: the
    folder is whole, so it is the newest version (and the learner re-announces it); a save cut
    short leaves a temporary folder, removed at start."""
    draft, recs = setup
    cfg = _cfg(tmp_path)
    tr = DraftTrainer("d", draft, cfg)
    assert tr.train_round(recs[:12]).accepted
    tr.publish()
    (tmp_path / "d" / "LATEST").write_text("v0\n")  # as if the crash came before LATEST was replaced
    (tmp_path / "d" / ".tmp-cut").mkdir()
    tr2 = DraftTrainer("d", draft, cfg)
    assert tr2.version == 1 and tr2.skipped == [] and _same(_weights(tr2.model), _weights(tr.model))
    assert tr2.latest_version() == 1 and not (tmp_path / "d" / ".tmp-cut").exists()


def test_stored_records_and_held_back_records_survive_a_restart(setup, tmp_path):
    """Every record ``store`` returned for is on disk: a learner opened afresh on the same folder
    (a killed process: nothing closed) finds each one in a shard or among the held-back records,
    the held-back ones bounded by ``holdout_max``; deleting a tenant removes its held-back records
    from disk too."""
    draft, recs = setup
    cfg = _cfg(holdout_fraction=0.5, holdout_max=4)
    ol = OnlineLearner(cfg, ShardConfig(dir=tmp_path / "shards"), [DraftTrainer("d", draft, cfg)])
    tagged = [dataclasses.replace(r, request_id=f"r{i}", tenant="t1" if i % 2 else "t2") for i, r in enumerate(recs[:12])]
    where = [ol.store(r) for r in tagged]
    assert "holdout" in where and "shard" in where
    kept = {r.request_id for r in ol.trainers["d"].holdout}
    assert len(kept) == min(4, where.count("holdout"))
    ol2 = OnlineLearner(cfg, ShardSet.open(ShardConfig(dir=tmp_path / "shards")), [DraftTrainer("d", draft, cfg)])
    shard_ids = {r.request_id for r in ol2.shards["d"].records()}
    held = {r.request_id for r in ol2.trainers["d"].holdout}
    assert held == kept
    assert shard_ids == {r.request_id for r, w in zip(tagged, where) if w == "shard"}
    by_id = {r.request_id: r for r in tagged}
    assert all(h.same_as(dataclasses.replace(by_id[h.request_id], seq=h.seq)) for h in ol2.trainers["d"].holdout)
    ol2.delete_tenant("t1")
    ol3 = OnlineLearner(cfg, ShardSet.open(ShardConfig(dir=tmp_path / "shards")), [DraftTrainer("d", draft, cfg)])
    assert all(r.tenant == "t2" for r in [*ol3.trainers["d"].holdout, *ol3.shards["d"].records()])
    # opened from the config alone (as the learner deployment does): every shard on disk is there
    # at once, to train on and to delete from, before any new record arrives
    ol4 = OnlineLearner(cfg, ShardConfig(dir=tmp_path / "shards"), [DraftTrainer("d", draft, cfg)])
    assert "d" in ol4.shards and len(ol4.shards["d"]) > 0 and ol4.pick_draft() == "d"  # trainable at once
    assert ol4.delete_tenant("t2")["shards"] > 0
    ol5 = OnlineLearner(cfg, ShardConfig(dir=tmp_path / "shards"), [DraftTrainer("d", draft, cfg)])
    assert len(ol5.shards["d"]) == 0 and not ol5.trainers["d"].holdout
    for o in (ol, ol2, ol3, ol4, ol5):
        o.close()


@pytest.mark.parametrize("restricted", [False, True])
def test_records_of_different_top_k_train_together_and_padding_changes_no_loss(setup, restricted):
    """Records written with another top-K (a probe, a config change) in the same shard: a batch
    mixing them trains; the narrow record's padded rows give exactly its unpadded loss, with a
    full head and with a restricted one."""
    draft, recs = setup
    wide = recs[0]
    for k in (wide.top_ids.shape[1] - 1, 2):  # one placeholder column (id PAD_ID itself), then several
        _narrow_record_trains_with_a_wide_one(draft, recs, wide, k, restricted)


def _narrow_record_trains_with_a_wide_one(draft, recs, wide, k, restricted):
    from learner.trainer import _same_width

    narrow = dataclasses.replace(recs[1], top_ids=recs[1].top_ids[:, :k].clone(), top_probs=recs[1].top_probs[:, :k].clone(),
                                 tail=recs[1].tail + recs[1].top_probs[:, k:].sum(-1))
    assert wide.top_ids.shape[1] > k
    keep = None
    if restricted:  # a head over the ids these records name, plus some others
        keep = torch.unique(torch.cat([wide.top_ids.flatten(), narrow.top_ids.flatten(), torch.arange(50)])).long()
        head = draft.get_output_embeddings()
        draft = copy.deepcopy(draft)
        draft.lm_head = torch.nn.Linear(head.weight.shape[1], len(keep), bias=False)
        draft.lm_head.weight.data = head.weight.data[keep].clone()
        draft.config.tie_word_embeddings = False
    tr = DraftTrainer("d", draft, _cfg(), keep_ids=keep)
    alone, mask = records_to_batch([narrow])
    padded = _same_width([*alone, *records_to_batch([wide])[0]])[:1]
    assert padded[0].ids.shape[1] == wide.top_ids.shape[1] and alone[0].ids.shape[1] == k
    with torch.no_grad():
        assert torch.allclose(tr._loss(alone, mask), tr._loss(padded, mask), atol=1e-6)
    rep = tr.train_round([wide, narrow, *recs[2:6]])
    assert rep.steps > 0 and rep.loss_after is not None and np.isfinite(rep.loss_after)


def test_a_draft_ids_checkpoint_folder_is_one_name_that_reads_back():
    """Ids of isolated tenants' drafts carry the tenant's name, which may hold a ``/`` or be ``..``:
    the folder must be one name inside the checkpoint folder, and unquote gives the id back."""
    from urllib.parse import unquote

    from learner.checkpoints import draft_folder

    assert draft_folder("general") == "general" and draft_folder("c3-en") == "c3-en"
    assert draft_folder("general@iso") == "general@iso"  # the names checkpoints were written under before
    assert draft_folder("d:chat") == "d:chat"
    for draft_id in ("general@team/a", "c0/en", "..", ".", "a b%c", "../../etc"):
        name = draft_folder(draft_id)
        assert "/" not in name and name not in (".", "..") and unquote(name) == draft_id, draft_id


def test_a_parked_draft_leaves_memory_and_comes_back_whole(setup, tmp_path):
    """``park``: the draft's trainer, shard and held-back records leave memory (their files stay);
    a trainer reloaded from its checkpoints gets its held-back records back, the next record
    reopens its shard with the records it had; its tenant's records can still be deleted while it
    is parked; the other draft is untouched. Without shards on disk, parking is refused."""
    draft, recs = setup
    cfg = _cfg(tmp_path / "ckpt", holdout_fraction=0.5, holdout_max=8)
    ol = OnlineLearner(cfg, ShardConfig(dir=tmp_path / "shards"), [DraftTrainer("a", draft, cfg), DraftTrainer("b", draft, cfg)])
    tagged = [dataclasses.replace(r, request_id=f"r{i}", tenant="t1" if i % 2 else "t2") for i, r in enumerate(recs[:12])]
    for r in tagged:
        ol.observe(_with_draft(r, "a"))
        ol.observe(_with_draft(r, "b"))
    shard_a = {r.request_id for r in ol.shards["a"].records()}
    held_a = {r.request_id for r in ol.trainers["a"].holdout}
    assert shard_a and held_a
    ol.park("a")
    assert "a" not in ol.trainers and "a" not in ol.shards and "a" not in ol.holdouts
    assert "b" in ol.trainers and "b" in ol.shards and ol.pick_draft() == "b"
    assert ol.shards["a"] is not None and {r.request_id for r in ol.shards["a"].records()} == shard_a  # reopens
    ol.shards.drop("a", delete=False)
    ol.delete_tenant("t1")  # while parked
    back = ol.add_trainer(DraftTrainer("a", draft, cfg))
    assert {r.request_id for r in back.holdout} == {i for i in held_a if int(i[1:]) % 2 == 0}
    assert ol.store(_with_draft(dataclasses.replace(tagged[0], request_id="new", context="student"), "a")) == "shard"
    assert {r.request_id for r in ol.shards["a"].records()} == {i for i in shard_a if int(i[1:]) % 2 == 0} | {"new"}
    ol.close()
    mem = OnlineLearner(cfg, ShardConfig(), [DraftTrainer("m", draft, _cfg())])
    with pytest.raises(ValueError, match="needs its shards on disk"):
        mem.park("m")
    assert "m" in mem.trainers


def test_closing_a_shard_waits_for_a_record_being_stored(setup, tmp_path):
    """Parking or removing a draft closes its shard files: neither does so while a record is being
    stored (``store`` holds the same lock), so no record is written to a closed file."""
    import threading

    draft, recs = setup
    cfg = _cfg()
    ol = OnlineLearner(cfg, ShardConfig(dir=tmp_path), [DraftTrainer("a", draft, cfg), DraftTrainer("b", draft, cfg)])
    for d in ("a", "b"):
        ol.observe(_with_draft(recs[0], d))
    with ol._store_lock:  # a record being stored
        park = threading.Thread(target=ol.park, args=("a",))
        remove = threading.Thread(target=ol.remove_trainer, args=("b",))
        for t in (park, remove):
            t.start()
            t.join(0.3)
            assert t.is_alive()
        assert {"a", "b"} <= set(ol.trainers) and "a" in ol.shards and "b" in ol.shards
    park.join(10)
    remove.join(10)
    assert not ol.trainers and "a" not in ol.shards and "b" not in ol.shards
    ol.close()


def test_an_adapter_learner_publishes_only_adapters_and_the_served_draft_follows(setup, target, tok, make_engine,
                                                                              draft_proposer, greedy_reference, tmp_path):
    """adapter_rank > 0: the base stays frozen, a version is the adapters alone (a small share of
    the draft), a serving draft without adapters takes them on its first version, held-out
    agreement rises, output stays the target's, and a checkpoint reloads with its adapters."""
    from speculative.adapters import has_adapters

    draft, recs = setup
    serving = truncated_draft(target, 1)
    engine = make_engine(draft_proposer(serving), k=4)
    tr = DraftTrainer("d", draft, _cfg(tmp_path, lr=3e-3, batch_records=12, adapter_rank=2, gate_margin=0.02))
    base = {k: v.clone() for k, v in tr.model.state_dict().items() if "lora_" not in k}
    for r in recs[12:]:
        tr.add_holdout(r)
    before = tr.agreement()
    for _ in range(3):
        rep = tr.train_round(recs[:12])
        assert rep.accepted, rep.reason
        v, state = tr.publish()
        engine.swap_draft(state, v)
    assert tr.agreement() > before
    assert state and all(k.endswith((".lora_A", ".lora_B")) for k in state)
    assert sum(a.size for a in state.values()) < 0.15 * sum(p.numel() for p in draft.parameters())  # 3% on SmolLM2's draft
    assert all(torch.equal(tr.model.state_dict()[k], w) for k, w in base.items())  # the base never moved
    assert has_adapters(serving) and _same({k: v for k, v in serving.state_dict().items() if "lora_" in k}, state)
    for text in TEXTS[:3]:
        p = tok(text)["input_ids"]
        assert engine.generate(list(p), SamplingParams(max_tokens=16)).token_ids == greedy_reference(p, 16)
    again = DraftTrainer("d", draft, _cfg(tmp_path, adapter_rank=2))  # reloads the latest checkpoint
    assert again.version == v and _same(again.state(), state)


def test_an_adapter_drafts_checkpoints_hold_its_adapters_alone_and_load_only_on_the_same_base(setup, target, tmp_path):
    """A version of an adapter draft is saved as its adapters (float32, a small share of the whole
    draft's bytes), reloads exactly after a restart, rolls back from the command line, and is
    refused (moved aside, the initial weights served above it) on a base of other values."""
    from learner.ops import main as draft_main, versions

    draft, recs = setup
    cfg = _cfg(tmp_path, lr=3e-3, batch_records=12, adapter_rank=2)
    tr = DraftTrainer("d", draft, cfg)
    v0 = tr.state()
    assert tr.train_round(recs[:12]).accepted
    v, state = tr.publish()
    folder = tmp_path / "d" / f"v{v}"
    saved = sum(f.stat().st_size for f in folder.iterdir())
    whole = sum(p.numel() * p.element_size() for p in draft.parameters())
    assert (folder / "osd_adapter.json").is_file() and not (folder / "osd_draft.json").exists()
    assert saved < 0.2 * whole, (saved, whole)
    again = DraftTrainer("d", draft, cfg)  # a restart
    assert again.version == v and _same(again.state(), state) and not again.skipped
    assert draft_main(["rollback", "--checkpoint-dir", str(tmp_path), "--draft", "d", "--version", "0"]) == 0
    assert versions(tmp_path, "d")["d"]["versions"][v + 1]["rolled_back_from"] == 0
    back = DraftTrainer("d", draft, cfg)
    assert back.version == v + 1 and _same(back.state(), v0)
    other = truncated_draft(target, 1)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1.01)  # same shapes, other values
    elsewhere = DraftTrainer("d", other, cfg)
    assert elsewhere.skipped == [v + 1, v, 0] and elsewhere.version == v + 2  # none loads: above every skipped one
    assert _same(elsewhere.state(), DraftTrainer("fresh", other, _cfg(adapter_rank=2)).state())


def test_draft_opd_takes_the_rows_the_served_draft_got_wrong_from_the_records(setup):
    """loss draft_opd: the trainer's loss over a batch is forward KL on the rows where the served
    draft was right and reverse KL on those where it was wrong, read from each record's
    ``draft_wrong`` (rows past a record's end left out); a round trains on it."""
    from learner.losses import SparseDist, forward_kl, reverse_kl
    from learner.offline import student_logits_for

    draft, recs = setup
    tr = DraftTrainer("d", copy.deepcopy(draft), _cfg(loss="draft_opd", loss_options={"reverse_weight": 0.5}))
    samples, mask = records_to_batch(recs[:4], "all")
    wrong = torch.cat([r.draft_wrong[r.positions < r.tokens.shape[0]] for r in recs[:4]])
    assert wrong.shape == mask.shape and 0 < int(wrong.sum()) < wrong.numel()
    with torch.no_grad():
        got = float(tr._loss(samples, mask))
        logits = student_logits_for(tr.model, samples)
        target = SparseDist(ids=torch.cat([s.ids for s in samples]).long(), probs=torch.cat([s.probs for s in samples]),
                            tail=torch.cat([s.tail for s in samples]))
        want = torch.where(wrong, 0.5 * reverse_kl(logits, target), forward_kl(logits, target)).mean()
        assert got == pytest.approx(float(want), rel=1e-5)
        assert got != pytest.approx(float(forward_kl(logits, target).mean()), rel=1e-3)
    rep = tr.train_round(recs[:8])
    assert rep.steps > 0 and rep.loss_after < rep.loss_before


def test_round_evaluations_run_in_pieces_that_agree_with_the_padded_batch(setup):
    """The gate's held-back hits and the round's losses are computed a record at a time (no padding,
    ``pause`` before each piece) and equal what the whole padded batch gives."""
    draft, recs = setup
    one = DraftTrainer("d", draft, _cfg(micro_batch_records=1))
    whole = DraftTrainer("d", draft, _cfg(micro_batch_records=None))
    for tr in (one, whole):
        for r in recs[:5]:
            tr.add_holdout(r)
    calls = []
    hits = one.holdout_hits(pause=lambda: calls.append(1))
    assert len(calls) == sum(1 for r in recs[:5] if r.tokens.shape[0] > r.prompt_len)  # one piece a record
    assert torch.equal(hits, whole.holdout_hits())
    samples, mask = records_to_batch(recs[:6], "all")
    calls.clear()
    a = one._eval_loss(samples, mask, pause=lambda: calls.append(1))
    assert len(calls) == 6 and a == pytest.approx(whole._eval_loss(samples, mask), rel=1e-5)
