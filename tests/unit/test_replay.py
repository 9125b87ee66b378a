"""Unit tests for learner.replay: records from hand-made StepResults, bounded shards, crash-safe logs.

No model anywhere: steps and records are built from small tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import struct

import numpy as np
import pytest
import torch

from learner.losses import SparseDist
from learner.replay import (
    MAGIC,
    RecordBuilder,
    ReplayRecord,
    ReplayShard,
    ShardConfig,
    ShardSet,
    decode_record,
    encode_record,
    shard_path,
)
from speculative.engine import StepResult

K = 4


def make_step(start, draft, accepted, emitted, matches=None, source="draft", version=3, rid="r1", seed=0) -> StepResult:
    k = len(draft)
    g = torch.Generator().manual_seed(seed + start)
    probs = torch.rand(k + 1, K, generator=g).softmax(-1) * 0.9  # [k+1, K]
    probs, order = probs.sort(-1, descending=True)
    ids = (torch.arange(K) * 7 + start)[order]  # [k+1, K] distinct per row, row-dependent
    ids = ids + torch.arange(k + 1)[:, None] * 100
    return StepResult(
        request_id=rid,
        source=source,
        draft_version=version,
        start=start,
        draft_tokens=list(draft),
        accepted=accepted,
        draft_matches_target=list(matches) if matches is not None else [i < accepted for i in range(k)],
        emitted=list(emitted),
        target_top_ids=ids.long(),
        target_top_probs=probs,
        target_tail=1.0 - probs.sum(-1),
        draft_s=0.0,
        target_s=0.0,
        finished=False,
        finish_reason=None,
    )


# ---------------------------------------------------------------------------------------------
# RecordBuilder
# ---------------------------------------------------------------------------------------------


def test_builder_keeps_rows_up_to_first_rejection():
    prompt = [5, 6, 7]
    step = make_step(3, draft=[10, 11], accepted=1, emitted=[10, 20], matches=[True, False])
    b = RecordBuilder(probs_dtype=torch.float32)
    b.add(step)
    rec = b.finish(prompt + [10, 20], prompt_len=3, domain="code", tenant="t", draft_id="d")
    assert rec.positions.tolist() == [3, 4]
    assert torch.equal(rec.top_ids, step.target_top_ids[:2].int())
    assert torch.equal(rec.top_probs, step.target_top_probs[:2])
    assert torch.allclose(rec.tail.float(), step.target_tail[:2])
    # row 0: draft proposed 10 = target argmax; row 1: proposed 11 != argmax
    assert rec.draft_wrong.tolist() == [False, True]
    assert rec.proposed.tolist() == [True, True]
    assert (rec.domain, rec.tenant, rec.draft_id, rec.draft_version, rec.request_id) == ("code", "t", "d", 3, "r1")
    assert rec.context == "teacher" and rec.loss is None and len(b) == 0
    sd = rec.to_sparse()
    assert isinstance(sd, SparseDist) and sd.ids.dtype == torch.long and sd.ids.shape == (2, K)


def test_builder_k0_step_has_one_unproposed_row():
    b = RecordBuilder()
    b.add(make_step(2, draft=[], accepted=0, emitted=[9], source="none"))
    rec = b.finish([1, 2, 9], prompt_len=2, draft_id="d")
    assert rec.positions.tolist() == [2]
    assert rec.top_ids.shape == (1, K) and rec.top_probs.dtype == torch.float16
    assert rec.draft_wrong.tolist() == [True] and rec.proposed.tolist() == [False]


def test_builder_multi_step_contiguous_and_bonus_rows():
    prompt = [1, 2, 3, 4]
    steps = [
        make_step(4, draft=[7, 8, 9], accepted=3, emitted=[7, 8, 9, 30]),  # all accepted + bonus token
        make_step(8, draft=[], accepted=0, emitted=[31], source="none"),
        make_step(9, draft=[40, 41], accepted=0, emitted=[32], matches=[False, True]),
        make_step(10, draft=[50], accepted=1, emitted=[50, 33], source="ngram"),
    ]
    tokens = prompt + [7, 8, 9, 30, 31, 32, 50, 33]
    b = RecordBuilder(probs_dtype=torch.float32)
    for s in reversed(steps):  # order of arrival does not matter
        b.add(s)
    rec = b.finish(tokens, prompt_len=4, draft_id="d")
    assert rec.positions.tolist() == list(range(4, 12))
    assert rec.draft_wrong.tolist() == [False, False, False, True, True, True, True, True]
    assert rec.proposed.tolist() == [True, True, True, False, False, True, False, False]
    assert torch.equal(rec.top_ids[3], steps[0].target_top_ids[3].int())  # the bonus row
    sample = rec.to_sample()
    assert sample.prompt_len == 4 and sample.n_out == 8 and sample.ids.shape == (8, K)


def test_builder_request_ending_inside_a_step():
    # 3 drafts accepted but the 2nd was EOS: emitted = [d1]; rows 0..1 kept, row 1 predicts EOS past the end
    step = make_step(2, draft=[5, 2, 6], accepted=3, emitted=[5])
    b = RecordBuilder()
    b.add(step)
    rec = b.finish([1, 1, 5], prompt_len=2, draft_id="d")
    assert rec.positions.tolist() == [2, 3]
    assert rec.to_sample().n_out == 1  # the row past the end is dropped there
    # EOS as the very first output token: nothing emitted, one row (predicting the EOS)
    b.add(make_step(2, draft=[], accepted=0, emitted=[]))
    rec = b.finish([1, 1], prompt_len=2)
    assert rec.positions.tolist() == [2]
    with pytest.raises(ValueError):
        rec.to_sample()


def test_builder_student_rows_optional():
    step = make_step(3, draft=[10, 11, 12], accepted=1, emitted=[10, 20], matches=[True, False, True])
    tokens = [5, 6, 7, 10, 20]
    b = RecordBuilder(keep_student_rows=False)
    b.add(step)
    assert b.finish(tokens, 3, draft_id="d").n_rows == 2 and b.student_records == []
    b = RecordBuilder(keep_student_rows=True, probs_dtype=torch.float32)
    b.add(step)
    rec = b.finish(tokens, 3, draft_id="d")
    assert rec.n_rows == 2
    (stu,) = b.student_records
    assert stu.context == "student"
    assert stu.tokens.tolist() == [5, 6, 7, 10, 11, 12]  # the draft's own branch
    assert stu.positions.tolist() == [5, 6]  # rows 2..3, conditioned on the rejected d_2
    assert torch.equal(stu.top_ids, step.target_top_ids[2:].int())
    assert stu.draft_wrong.tolist() == [False, True] and stu.proposed.tolist() == [True, False]


def test_builder_rejects_mismatched_tokens():
    b = RecordBuilder()
    b.add(make_step(3, draft=[10], accepted=1, emitted=[10, 20]))
    with pytest.raises(ValueError, match="does not match"):
        b.finish([5, 6, 7, 10, 21], prompt_len=3)
    b = RecordBuilder()
    b.add(make_step(3, draft=[], accepted=0, emitted=[9], rid="a"))
    with pytest.raises(ValueError, match="request"):
        b.add(make_step(4, draft=[], accepted=0, emitted=[9], rid="b"))


def test_builder_finish_refuses_an_empty_prompt_overlaps_and_mixed_top_k():
    b = RecordBuilder()
    with pytest.raises(ValueError, match="prompt_len"):
        b.finish([5, 6], prompt_len=0)
    assert b.finish([5], prompt_len=1).n_rows == 0  # a one-token prompt is a prompt
    rec = b.finish([5, 6], prompt_len=2)  # no step: a record without rows
    assert rec.positions.shape == (0,) and rec.top_ids.shape == (0, 0) and rec.k == 0
    assert rec.draft_version == 0 and rec.features is None
    b.add(make_step(3, draft=[10, 11], accepted=2, emitted=[10, 11, 12]))  # rows 3, 4, 5
    b.add(make_step(5, draft=[], accepted=0, emitted=[12], version=4))  # starts on row 5: overlaps
    with pytest.raises(ValueError, match="overlaps"):
        b.finish([5, 6, 7, 10, 11, 12], prompt_len=3)
    b = RecordBuilder()
    b.add(make_step(3, draft=[10], accepted=1, emitted=[10, 20]))
    narrow = make_step(5, draft=[], accepted=0, emitted=[30])
    b.add(dataclasses.replace(narrow, target_top_ids=narrow.target_top_ids[:, :3],
                              target_top_probs=narrow.target_top_probs[:, :3]))
    with pytest.raises(ValueError, match="top-K"):
        b.finish([5, 6, 7, 10, 20, 30], prompt_len=3)


def _with_features(step, start: int, rows: torch.Tensor):
    return dataclasses.replace(step, features=rows, features_start=start)


def test_builder_features_join_steps_without_repeats_or_gaps_up_to_the_last_predicting_position():
    """A record's features cover positions 0..len - 2 (the last token predicts nothing), each once:
    a step's rows that an earlier step already gave are skipped, a step starting right after the
    covered ones is joined, and one leaving a gap voids them (a feature draft needs every position)."""
    H = 8
    tokens = [5, 6, 7, 10, 20, 30, 40]
    f1 = torch.arange(4 * H, dtype=torch.float32).reshape(4, H)  # positions 0..3
    f2 = 100 + torch.arange(4 * H, dtype=torch.float32).reshape(4, H)  # positions 3..6
    s1 = make_step(3, draft=[10], accepted=1, emitted=[10, 20])
    s2 = make_step(5, draft=[30], accepted=1, emitted=[30, 40])

    def rec_of(*steps):
        b = RecordBuilder()
        for s in steps:
            b.add(s)
        return b.finish(tokens, prompt_len=3)

    rec = rec_of(_with_features(s1, 0, f1), _with_features(s2, 3, f2))
    want = torch.cat([f1, f2[1:]])[:6].to(torch.float16)  # positions 0..5: row 3 once, position 6 cut
    assert rec.features.dtype == torch.float16 and torch.equal(rec.features, want)
    rec = rec_of(_with_features(s1, 0, f1), _with_features(s2, 4, f2[1:3]))  # right after: joined
    assert torch.equal(rec.features, torch.cat([f1, f2[1:3]]).to(torch.float16))
    assert rec_of(_with_features(s1, 0, f1), _with_features(s2, 5, f2[2:])).features is None  # a gap
    assert rec_of(_with_features(s1, 0, f1), s2).features is None  # a step without features


def test_builder_student_rows_of_a_step_cut_at_its_last_draft_token():
    """k = 2, one accepted: the teacher rows are 0..1 and the student record holds row 2 (after the
    rejected second draft token); it carries the request's id."""
    step = make_step(3, draft=[10, 11], accepted=1, emitted=[10, 20], matches=[True, False])
    b = RecordBuilder(keep_student_rows=True)
    b.add(step)
    b.finish([5, 6, 7, 10, 20], 3, draft_id="d")
    (stu,) = b.student_records
    assert stu.positions.tolist() == [5] and stu.request_id == "r1"


def test_encode_decode_round_trip():
    rec = make_record(3, loss=1.5, probs_dtype=torch.float16)
    rec.seq = 17
    back = decode_record(encode_record(rec))
    assert back.same_as(rec)
    assert abs(len(encode_record(rec)) - rec.nbytes) < 256  # nbytes approximates the on-disk size


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------


def make_record(i: int, loss=None, draft_id="d", rows=8, length=24, probs_dtype=torch.float32) -> ReplayRecord:
    g = torch.Generator().manual_seed(i)
    probs = torch.rand(rows, K, generator=g).softmax(-1).sort(-1, descending=True).values * 0.9
    return ReplayRecord(
        tokens=torch.randint(0, 100, (length,), generator=g),
        prompt_len=length - rows,
        positions=torch.arange(length - rows, length),
        top_ids=torch.randint(0, 100, (rows, K), generator=g),
        top_probs=probs.to(probs_dtype),
        tail=(1 - probs.sum(-1)).to(probs_dtype),
        draft_wrong=torch.rand(rows, generator=g) < 0.5,
        domain="code",
        tenant=f"t{i % 3}",
        draft_id=draft_id,
        draft_version=i,
        created=1000.0 + i,
        loss=loss,
        request_id=f"req{i:05d}",
    )


REC_BYTES = make_record(0).nbytes


@pytest.mark.parametrize("policy", ["fifo", "reservoir", "high_loss"])
def test_byte_bound_holds(policy):
    cfg = ShardConfig(max_bytes=10 * REC_BYTES + 5, eviction=policy)
    shard = ReplayShard(cfg, "d")
    for i in range(300):
        shard.append(make_record(i, loss=float(i % 17) if i % 2 else None))
        if policy == "high_loss" and i % 5 == 0 and len(shard):
            shard.update_loss(shard.records()[0].seq, 0.5)
        assert shard.nbytes <= cfg.max_bytes
        assert shard.appended == len(shard) + shard.evicted
    assert len(shard) == 10 and shard.nbytes == sum(r.nbytes for r in shard.records())
    assert shard.stats()["appended"] == 300 and shard.stats()["evicted"] == 290


def test_fifo_evicts_oldest():
    shard = ReplayShard(ShardConfig(max_bytes=5 * REC_BYTES, eviction="fifo"), "d")
    for i in range(20):
        shard.append(make_record(i))
    assert [r.seq for r in shard.records()] == list(range(15, 20))
    assert [r.request_id for r in shard.records()] == [f"req{i:05d}" for i in range(15, 20)]


def test_reservoir_is_roughly_uniform():
    n, cap = 2000, 100
    shard = ReplayShard(ShardConfig(max_bytes=cap * REC_BYTES, eviction="reservoir", seed=1), "d")
    rec = make_record(0)
    for _ in range(n):
        shard.append(rec)  # same content: only the seq differs
    kept = [r.seq for r in shard.records()]
    assert len(kept) == cap and len(set(kept)) == cap
    assert abs(statistics.mean(kept) - (n - 1) / 2) < 0.12 * n  # ~4 standard errors
    quarters = np.histogram(kept, bins=4, range=(0, n))[0]
    assert quarters.min() >= cap // 4 - 12, quarters  # every quarter of the stream is represented


def test_high_loss_keeps_high_losses_and_unscored():
    shard = ReplayShard(ShardConfig(max_bytes=10 * REC_BYTES, eviction="high_loss"), "d")
    losses = list(range(50))
    random.Random(0).shuffle(losses)
    for i, l in enumerate(losses):
        shard.append(make_record(i, loss=float(l)))
    assert sorted(r.loss for r in shard.records()) == [float(x) for x in range(40, 50)]
    # an unscored newcomer stays (+inf) and pushes out the lowest loss
    seq = shard.append(make_record(99))
    assert seq in shard and sorted(r.loss for r in shard.records() if r.loss is not None)[0] == 41.0
    # once scored low, it is the next one out
    shard.update_loss(seq, 0.1)
    shard.append(make_record(100, loss=45.5))
    assert seq not in shard
    # a newcomer scored below everything is evicted at once
    assert shard.append(make_record(101, loss=-1.0)) is not None and len(shard) == 10
    assert min(r.loss for r in shard.records()) > 0


def test_oversize_record_refused():
    shard = ReplayShard(ShardConfig(max_bytes=REC_BYTES - 1), "d")
    assert shard.append(make_record(0)) is None
    assert len(shard) == 0 and shard.evicted == 1 and shard.appended == 1


def test_sample():
    shard = ReplayShard(ShardConfig(max_bytes=100 * REC_BYTES), "d")
    for i in range(30):
        shard.append(make_record(i))
    a = shard.sample(10, random.Random(3))
    assert len(a) == 10 and len({r.seq for r in a}) == 10
    assert [r.seq for r in a] == [r.seq for r in shard.sample(10, random.Random(3))]
    assert len(shard.sample(100, np.random.default_rng(0))) == 30
    assert shard.sample(0) == []


def test_draft_id_mismatch_rejected():
    with pytest.raises(ValueError):
        ReplayShard(ShardConfig(), "d").append(make_record(0, draft_id="other"))


# ---------------------------------------------------------------------------------------------
# Persistence
# ---------------------------------------------------------------------------------------------


def assert_same(a: list[ReplayRecord], b: list[ReplayRecord]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.same_as(y), (x.seq, y.seq)


@pytest.mark.parametrize("policy", ["fifo", "reservoir", "high_loss"])
def test_persistence_round_trip(tmp_path, policy):
    cfg = ShardConfig(max_bytes=8 * REC_BYTES, eviction=policy, dir=tmp_path, fsync=True, seed=2)
    shard = ReplayShard.open(cfg, "draft/A")
    for i in range(40):
        shard.append(make_record(i, draft_id="draft/A", loss=float((i * 7) % 13)))
        if i % 4 == 0 and len(shard):
            shard.update_loss(shard.records()[-1].seq, 20.0 + i)
    before, stats = shard.records(), shard.stats()
    shard.close()
    assert shard_path(tmp_path, "draft/A").exists()
    again = ReplayShard.open(cfg, "draft/A")
    assert_same(again.records(), before)
    for k in ("records", "bytes", "appended", "evicted"):
        assert again.stats()[k] == stats[k]
    # the reloaded shard keeps going under the same bound
    for i in range(40, 60):
        again.append(make_record(i, draft_id="draft/A"))
        assert again.nbytes <= cfg.max_bytes
    assert again.appended == 60
    again.close()


def test_reopen_with_smaller_bound_evicts(tmp_path):
    cfg = ShardConfig(max_bytes=10 * REC_BYTES, dir=tmp_path)
    with ReplayShard.open(cfg, "d") as shard:
        for i in range(10):
            shard.append(make_record(i))
    small = ReplayShard.open(cfg.model_copy(update={"max_bytes": 4 * REC_BYTES}), "d")
    assert [r.seq for r in small.records()] == [6, 7, 8, 9] and small.evicted == 6
    small.close()


def fill(tmp_path, n=5, **kw) -> tuple[ShardConfig, list[ReplayRecord], list[int]]:
    """n records in a fresh log; returns the config, the records and the byte offset after each frame."""
    cfg = ShardConfig(max_bytes=100 * REC_BYTES, dir=tmp_path, **kw)
    ends = []
    with ReplayShard.open(cfg, "d") as shard:
        for i in range(n):
            shard.append(make_record(i))
            ends.append(shard_path(tmp_path, "d").stat().st_size)
        recs = shard.records()
    return cfg, recs, ends


def test_one_stray_byte_between_frames_loses_no_record(tmp_path):
    """Replay resynchronises on the very next byte after a damaged one: a single stray byte before
    a frame costs that byte, not the frame."""
    cfg, recs, ends = fill(tmp_path, n=3)
    path = shard_path(tmp_path, "d")
    data = path.read_bytes()
    path.write_bytes(data[: ends[0]] + b"\x00" + data[ends[0]:])
    shard = ReplayShard.open(cfg, "d")
    assert_same(shard.records(), recs)
    shard.close()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header_only"])
def test_torn_final_record(tmp_path, caplog, damage):
    cfg, recs, ends = fill(tmp_path)
    path = shard_path(tmp_path, "d")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-7])  # the last record loses its last bytes
        expect = recs[:-1]
    elif damage == "garbage":
        path.write_bytes(data + b"\x00\xff" * 10)  # bad magic
        expect = recs
    else:
        path.write_bytes(data + MAGIC + struct.pack("<II", 1000, 0) + b"xyz")  # payload cut short
        expect = recs
    with caplog.at_level(logging.WARNING, logger="learner.replay"):
        shard = ReplayShard.open(cfg, "d")
    assert any("skipped 1 damaged byte range" in r.getMessage() for r in caplog.records)
    assert_same(shard.records(), expect)
    assert path.stat().st_size == ends[len(expect) - 1]  # truncated to the last good frame
    assert list(tmp_path.glob("shard-d.log.corrupt-*"))  # the dropped bytes were set aside
    seq = shard.append(make_record(50))
    assert seq == len(expect)
    shard.close()
    again = ReplayShard.open(cfg, "d")
    assert [r.seq for r in again.records()] == [r.seq for r in expect] + [seq]
    again.close()


@pytest.mark.parametrize("damage", ["payload", "magic", "length", "inserted"])
def test_damage_in_the_middle_loses_that_frame_only(tmp_path, caplog, damage):
    """The replay resynchronises on the next valid frame: every intact record after the damage is kept."""
    cfg, recs, ends = fill(tmp_path)
    path = shard_path(tmp_path, "d")
    data = bytearray(path.read_bytes())
    expect = recs[:2] + recs[3:]
    if damage == "payload":
        data[(ends[1] + ends[2]) // 2] ^= 0xFF  # a payload byte of the 3rd record: crc mismatch
    elif damage == "magic":
        data[ends[1]] ^= 0xFF  # the 3rd frame's magic
    elif damage == "length":
        data[ends[1] + 4: ends[1] + 8] = struct.pack("<I", 7)  # the 3rd frame's length: a wrong boundary
    else:
        data[ends[1]:ends[1]] = b"OSDR\x00\x01garbage" * 3  # bytes between two frames, with false magics
        expect = recs
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="learner.replay"):
        shard = ReplayShard.open(cfg, "d")
    assert any("skipped 1 damaged byte range" in r.getMessage() for r in caplog.records)
    assert_same(shard.records(), expect)
    side = list(tmp_path.glob("shard-d.log.corrupt-*"))
    assert len(side) == 1 and 0 < side[0].stat().st_size < ends[2] - ends[1] + 64
    assert shard.appended == len(recs)  # sequence numbers continue after the last one kept
    seq = shard.append(make_record(9))
    assert seq == len(recs)
    shard.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="learner.replay"):
        again = ReplayShard.open(cfg, "d")  # the log was rewritten: it reads clean now
    assert not caplog.records
    assert [r.seq for r in again.records()] == [r.seq for r in expect] + [seq]
    again.close()


def test_damage_in_two_places_and_a_torn_tail(tmp_path):
    cfg, recs, ends = fill(tmp_path)
    path = shard_path(tmp_path, "d")
    data = bytearray(path.read_bytes())
    data[(ends[0] + ends[1]) // 2] ^= 0xFF  # 2nd record
    data[(ends[2] + ends[3]) // 2] ^= 0xFF  # 4th record
    path.write_bytes(bytes(data[:-5]))  # and the last record torn
    shard = ReplayShard.open(cfg, "d")
    assert_same(shard.records(), [recs[0], recs[2]] + recs[4:-1])
    shard.close()


def test_compaction_preserves_live_records(tmp_path):
    cfg = ShardConfig(max_bytes=6 * REC_BYTES, dir=tmp_path, eviction="high_loss")
    shard = ReplayShard.open(cfg, "d")
    path = shard_path(tmp_path, "d")
    for i in range(12):
        shard.append(make_record(i, loss=float(i % 5)))
    shard.update_loss(shard.records()[0].seq, 99.0)
    live, size = shard.records(), path.stat().st_size
    shard.compact()
    assert path.stat().st_size < size and not list(tmp_path.glob("*.tmp"))
    assert_same(shard.records(), live)
    shard.append(make_record(100, loss=50.0))  # appends go to the new file
    live, stats = shard.records(), shard.stats()
    shard.close()
    again = ReplayShard.open(cfg, "d")
    assert_same(again.records(), live)
    assert (again.appended, again.evicted) == (stats["appended"], stats["evicted"])
    assert 99.0 in [r.loss for r in again.records()]
    again.close()


def test_automatic_compaction_bounds_the_log(tmp_path):
    cfg = ShardConfig(max_bytes=5 * REC_BYTES, dir=tmp_path, compact_factor=2.0)
    shard = ReplayShard.open(cfg, "d")
    for i in range(200):
        shard.append(make_record(i))
        assert shard.log_bytes == shard_path(tmp_path, "d").stat().st_size
        assert shard.log_bytes <= 3 * cfg.max_bytes + REC_BYTES
    assert shard.compactions > 5
    live = shard.records()
    shard.close()
    again = ReplayShard.open(cfg, "d")
    assert_same(again.records(), live)
    assert again.appended == 200 and again.evicted == 195
    again.close()


def test_shard_set(tmp_path):
    cfg = ShardConfig(max_bytes=3 * REC_BYTES, dir=tmp_path)
    with ShardSet(cfg) as ss:
        for i in range(5):
            ss.append(make_record(i, draft_id="a"))
        ss.append(make_record(9, draft_id="b/c"))
        stats = ss.stats()
    assert stats["a"]["records"] == 3 and stats["a"]["appended"] == 5 and stats["a"]["evicted"] == 2
    assert stats["b/c"]["records"] == 1 and stats["b/c"]["bytes"] == make_record(9, draft_id="b/c").nbytes
    with ShardSet.open(cfg) as again:
        assert set(again) == {"a", "b/c"}
        for d in ("a", "b/c"):
            assert {k: again.stats()[d][k] for k in ("records", "bytes", "appended", "evicted")} == {
                k: stats[d][k] for k in ("records", "bytes", "appended", "evicted")
            }


@pytest.mark.parametrize("eviction", ["fifo", "high_loss"])
def test_deleting_a_tenant_removes_its_records_from_memory_and_disk(tmp_path, eviction):
    cfg = ShardConfig(max_bytes=100 * REC_BYTES, dir=tmp_path, eviction=eviction)
    shards = ShardSet.open(cfg)
    for i in range(12):  # tenants t0, t1, t2 in turn, over two drafts
        shards.append(make_record(i, loss=float(i), draft_id="a" if i % 2 else "b"))
    assert shards.delete_tenant("t1") == 4
    assert shards.delete_tenant("nobody") == 0
    for d in ("a", "b"):
        s = shards[d]
        assert all(r.tenant != "t1" for r in s.records()) and s.appended == len(s) + s.evicted
        assert b'"t1"' not in shard_path(tmp_path, d).read_bytes()  # the bytes left the file
        assert b'"t0"' in shard_path(tmp_path, d).read_bytes()
    kept = {d: [r.seq for r in shards[d].records()] for d in ("a", "b")}
    new = shards.append(make_record(12, draft_id="a"))
    assert new == 6  # sequence numbers go on after the deleted ones
    shards.close()
    again = ShardSet.open(cfg)
    assert [r.seq for r in again["b"].records()] == kept["b"]
    assert [r.seq for r in again["a"].records()] == kept["a"] + [new]
    assert len(again["a"].sample(3, rng=0)) == 3
    again.close()


# ---------------------------------------------------------------------------------------------
# Edges the mutation run of learner/replay.py found untested
# ---------------------------------------------------------------------------------------------
def test_a_record_without_rows_and_one_with_features():
    """A request that produced no rows may be given as plain empty lists: it is a [0, 0] record that
    survives encoding; one given [0, K] keeps its K. Features are [F, H] with F < len(tokens), any H;
    another rank, or F reaching len(tokens), is refused."""
    empty = ReplayRecord(tokens=[1, 2, 3], prompt_len=3, positions=[], top_ids=[], top_probs=[], tail=[],
                         draft_wrong=[], draft_id="d")
    assert empty.n_rows == 0 and empty.k == 0 and empty.top_ids.shape == empty.top_probs.shape == (0, 0)
    assert decode_record(encode_record(empty)).same_as(empty)
    wide = ReplayRecord(tokens=[1, 2, 3], prompt_len=3, positions=[], top_ids=torch.zeros(0, K), top_probs=torch.zeros(0, K),
                        tail=[], draft_wrong=[], draft_id="d")
    assert wide.k == K and wide.top_ids.shape == (0, K)

    base = make_record(0)  # 24 tokens
    L = base.tokens.shape[0]
    for F, H in ((L - 1, 16), (L - 1, 64), (1, 3)):  # any width, also wider than the record is long
        rec = dataclasses.replace(base, features=torch.randn(F, H))
        assert rec.features.shape == (F, H) and rec.features.dtype == torch.float16
        assert decode_record(encode_record(rec)).same_as(rec)
    for bad in (torch.randn(L), torch.randn(2, L - 1, 8), torch.randn(L, 8), torch.randn(L + 1, 8)):
        with pytest.raises(ValueError, match="features must be"):
            dataclasses.replace(base, features=bad)


def test_a_fresh_shard_counts_from_zero_and_keeps_a_record_of_exactly_max_bytes(tmp_path):
    mem = ReplayShard(ShardConfig(max_bytes=REC_BYTES), "d")
    assert mem.stats() == {"records": 0, "bytes": 0, "appended": 0, "evicted": 0, "log_bytes": 0, "compactions": 0}
    assert mem.append(make_record(0)) == 0 and len(mem) == 1  # nbytes == max_bytes: it fits
    assert mem.append(make_record(1)) == 1 and [r.seq for r in mem.records()] == [1]
    assert mem.appended == len(mem) + mem.evicted == 2
    nested = tmp_path / "a" / "b"  # folders made as needed
    with ReplayShard.open(ShardConfig(max_bytes=4 * REC_BYTES, dir=nested), "d") as disk:
        for i in range(3):
            disk.append(make_record(i))
        assert disk.compactions == 0  # a log under compact_factor x max_bytes is not rewritten
    size = shard_path(nested, "d").stat().st_size
    with ReplayShard.open(ShardConfig(max_bytes=4 * REC_BYTES, dir=nested), "d") as again:  # a clean log
        assert again.compactions == 0 and again.log_bytes == size and len(again) == 3
    assert shard_path(nested, "d").stat().st_size == size  # reopened, not rewritten
    assert again._fh is None  # closed on leaving the block (its file handle released)
    again.close()  # closing twice is harmless


@pytest.mark.parametrize("bound", ["bytes", "records"])
def test_a_reservoir_of_one_keeps_either_of_two_records_half_the_time(bound):
    """Algorithm R from its first overflow on, whichever bound is reached (bytes, or max_records):
    of records 0 and 1, a reservoir of one keeps each with probability 1/2 (over 400 seeds:
    200 +- 3 standard deviations of 10)."""
    cfg = dict(max_bytes=REC_BYTES) if bound == "bytes" else dict(max_bytes=100 * REC_BYTES, max_records=1)
    kept_first = 0
    for seed in range(400):
        shard = ReplayShard(ShardConfig(eviction="reservoir", seed=seed, **cfg), "d")
        shard.append(make_record(0))
        shard.append(make_record(1))
        assert len(shard) == 1 and shard.evicted == 1
        kept_first += shard.records()[0].seq == 0
    assert 170 <= kept_first <= 230, kept_first


def test_sampling_with_a_numpy_generator_draws_distinct_records():
    shard = ReplayShard(ShardConfig(max_bytes=100 * REC_BYTES), "d")
    for i in range(30):
        shard.append(make_record(i))
    for seed in range(5):
        picked = [r.seq for r in shard.sample(20, np.random.default_rng(seed))]
        assert len(picked) == len(set(picked)) == 20


def test_a_reservoir_newcomer_it_kept_is_not_evicted_to_make_room_for_itself():
    """When algorithm R keeps a newcomer larger than the record it replaces, the further evictions
    that restore the byte bound take other records, never the newcomer whose seq was returned."""
    small, big = make_record(0, rows=4), make_record(1, rows=14)
    assert 2 * small.nbytes > big.nbytes > small.nbytes
    kept = 0
    for seed in range(100):
        shard = ReplayShard(ShardConfig(max_bytes=2 * small.nbytes, eviction="reservoir", seed=seed), "d")
        shard.append(small)
        shard.append(small)
        seq = shard.append(big)
        if seq is not None:
            kept += 1
            assert [r.seq for r in shard.records()] == [seq], seed
        assert shard.nbytes <= 2 * small.nbytes and shard.appended == len(shard) + shard.evicted
    assert 40 <= kept <= 95  # kept with probability 2/3


def test_loss_updates_say_whether_the_record_was_live_and_compaction_is_counted(tmp_path):
    shard = ReplayShard.open(ShardConfig(max_bytes=2 * REC_BYTES, dir=tmp_path, eviction="high_loss"), "d")
    first = shard.append(make_record(0, loss=1.0))
    for i in range(1, 4):
        shard.append(make_record(i, loss=5.0 + i))
    assert first not in shard and shard.update_loss(first, 9.0) is False  # evicted: nothing to update
    assert shard.update_loss(99, 9.0) is False
    live = shard.records()[0].seq
    assert shard.update_loss(live, 0.5) is True and shard.get(live).loss == 0.5
    handle, before = shard._fh, shard.compactions
    shard.compact()
    assert shard.compactions == before + 1 and handle.closed  # the old file's handle is not leaked
    shard.close()


def test_records_are_validated_field_by_field():
    """Every malformed shape or range is refused (each check on its own); prompt_len 0 with rows from
    position 1, and a row predicting past the last token, are valid; k is the stored top-K."""
    base = make_record(0)  # 24 tokens, prompt 16, rows at 16..23, K = 4
    assert base.k == K
    ok = [dict(prompt_len=0, positions=torch.arange(1, 9)), dict(positions=torch.arange(17, 25))]
    for change in ok:
        dataclasses.replace(base, **change)
    bad = [
        dict(top_ids=torch.zeros(8 * K, dtype=torch.int32)),  # rows not [P, K]
        dict(top_ids=torch.zeros(7, K, dtype=torch.int32)),  # P rows of positions, 7 of ids
        dict(top_probs=torch.full((8, K + 1), 0.1)),  # probs not the ids' shape
        dict(prompt_len=-1), dict(prompt_len=25),
        dict(prompt_len=0, positions=torch.arange(0, 8)),  # no row predicts position 0
        dict(positions=torch.arange(15, 23)),  # a row inside the prompt
        dict(positions=torch.arange(18, 26)),  # a row past len(tokens)
    ]
    for change in bad:
        with pytest.raises(ValueError):
            dataclasses.replace(base, **change)


def test_same_as_tells_records_apart_by_any_field_and_any_tensor_difference():
    a = make_record(0)
    assert a.same_as(make_record(0))
    for change in (dict(tokens=a.tokens.clone().index_fill_(0, torch.tensor([3]), 99)),  # a value
                   dict(top_probs=a.top_probs.half(), tail=a.tail.half()),  # a dtype
                   dict(request_id="other"), dict(loss=0.5),  # a plain field
                   dict(features=torch.zeros(3, 8))):  # a tensor against None
        b = dataclasses.replace(a, **change)
        assert not a.same_as(b) and not b.same_as(a), change


def test_decoding_refuses_an_unknown_array_name_or_dtype():
    import json as _json

    def frame(arrays, payload: bytes) -> bytes:
        meta = _json.dumps({"v": 1, "prompt_len": 0, "arrays": arrays}).encode()
        return struct.pack("<I", len(meta)) + meta + payload

    with pytest.raises(ValueError, match="unknown array 'bogus'"):
        decode_record(frame([["bogus", "<i4", [1]]], b"\0" * 4))
    with pytest.raises(ValueError, match="unknown array 'tokens' of dtype '<c8'"):
        decode_record(frame([["tokens", "<c8", [1]]], b"\0" * 8))


def test_a_reservoir_with_room_keeps_what_comes():
    """Algorithm R decides only when the shard is full: a reservoir that refused an oversize record,
    or lost records to a tenant's deletion, fills again (it used to decide on every append after any
    eviction, and an empty one then refused everything)."""
    shard = ReplayShard(ShardConfig(max_bytes=3 * REC_BYTES, eviction="reservoir"), "d")
    assert shard.append(make_record(0, rows=40, length=60)) is None  # larger than the whole shard
    assert [shard.append(make_record(i)) for i in range(1, 4)] == [1, 2, 3] and len(shard) == 3
    assert shard.delete_where(lambda r: r.seq in (1, 2)) == 2
    assert shard.append(make_record(4)) == 4 and shard.append(make_record(5)) == 5 and len(shard) == 3
    assert shard.appended == len(shard) + shard.evicted


def test_builder_refuses_inconsistent_steps():
    """Target rows of another shape than [k + 1, K], or an accepted count or match list that does
    not fit k, are refused, each on its own."""
    good = make_step(3, draft=[10, 11], accepted=1, emitted=[10, 20])
    RecordBuilder().add(good)
    bad = [
        dict(target_top_ids=good.target_top_ids[:2]),  # k rows, not k + 1
        dict(target_top_ids=good.target_top_ids.reshape(-1)),  # not 2-D
        dict(target_top_probs=good.target_top_probs[:, :2]),  # probs not the ids' shape
        dict(target_tail=good.target_tail[:2]),  # tail not [k + 1]
        dict(accepted=3), dict(accepted=-1),  # more than k, or negative
        dict(draft_matches_target=[True]),  # one match for two draft tokens
    ]
    for change in bad:
        with pytest.raises(ValueError):
            RecordBuilder().add(dataclasses.replace(good, **change))


def test_the_side_file_holds_exactly_the_damaged_bytes(tmp_path):
    """What replay skips is set aside byte for byte (an operator reads it to see what was lost):
    bytes inserted between two frames, then a torn tail, in one side file, nothing else."""
    cfg, recs, ends = fill(tmp_path, n=4)
    path = shard_path(tmp_path, "d")
    data = path.read_bytes()
    inserted, torn = b"not a frame: OSDR\x00\x01 in between", data[ends[2]: ends[3] - 9]
    path.write_bytes(data[: ends[1]] + inserted + data[ends[1]: ends[3] - 9])
    shard = ReplayShard.open(cfg, "d")
    assert_same(shard.records(), recs[:3])
    side = list(tmp_path.glob("shard-d.log.corrupt-*"))
    assert len(side) == 1 and side[0].read_bytes() == inserted + torn
    shard.close()


@pytest.mark.parametrize("length, reason", [
    (0, "bad magic or length"),  # an empty payload (crc32 of nothing is 0) is no frame
    (1 << 30, "torn frame payload"),  # the largest length a frame may have: cut short here
    ((1 << 30) + 1, "bad magic or length"),  # beyond it: corruption, not a record
])
def test_a_damaged_header_is_named_for_what_is_wrong_with_it(tmp_path, caplog, length, reason):
    cfg, recs, _ = fill(tmp_path, n=2)
    path = shard_path(tmp_path, "d")
    path.write_bytes(path.read_bytes() + MAGIC + struct.pack("<II", length, 0) + b"tail")
    with caplog.at_level(logging.WARNING, logger="learner.replay"):
        shard = ReplayShard.open(cfg, "d")
    assert_same(shard.records(), recs)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and f": {reason})" in messages[0], messages
    shard.close()


def test_replay_refuses_records_of_another_draft_and_repeated_frames(tmp_path, caplog):
    """A log holds one draft's records, each once: another draft's log copied in its place, or a frame
    written twice, is skipped as damage, not taken in."""
    cfg, recs, ends = fill(tmp_path, n=3)
    path = shard_path(tmp_path, "d")
    data = path.read_bytes()
    shard_path(tmp_path, "other").write_bytes(data)  # draft d's records under another draft's name
    with caplog.at_level(logging.WARNING, logger="learner.replay"):
        other = ReplayShard.open(cfg, "other")
    assert len(other) == 0 and other.nbytes == 0 and any("does not belong here" in r.getMessage() for r in caplog.records)
    other.close()
    path.write_bytes(data + data[ends[0]: ends[1]])  # the second record's frame again at the end
    shard = ReplayShard.open(cfg, "d")
    assert_same(shard.records(), recs)
    assert shard.nbytes == sum(r.nbytes for r in recs) and shard.appended == 3
    shard.close()


def test_losses_set_before_a_restart_still_order_high_loss_eviction(tmp_path):
    """A loss update written to the log ranks its record after a restart as before it: a record made
    cheapest by its update is the next one evicted."""
    cfg = ShardConfig(max_bytes=4 * REC_BYTES, dir=tmp_path, eviction="high_loss")
    with ReplayShard.open(cfg, "d") as shard:
        for i in range(4):
            shard.append(make_record(i, loss=10.0 + i))
        assert shard.update_loss(2, 0.5) and shard.update_loss(0, 50.0)
    again = ReplayShard.open(cfg, "d")
    assert {r.seq: r.loss for r in again.records()} == {0: 50.0, 1: 11.0, 2: 0.5, 3: 13.0}
    again.append(make_record(4, loss=30.0))
    assert [r.seq for r in again.records()] == [0, 1, 3, 4]
    again.append(make_record(5, loss=30.0))
    assert [r.seq for r in again.records()] == [0, 3, 4, 5]
    again.close()


def test_dropping_a_shard_deletes_its_log_only_when_asked(tmp_path):
    cfg = ShardConfig(max_bytes=3 * REC_BYTES, dir=tmp_path)
    ss = ShardSet(cfg)
    for d in ("keep", "gone", "already"):
        ss.append(make_record(0, draft_id=d))
    ss.drop("keep", delete=False)
    ss.drop("gone")
    shard_path(tmp_path, "already").unlink()  # removed by hand before the drop: no error
    ss.drop("already")
    ss.drop("never-there")
    assert len(ss) == 0
    assert shard_path(tmp_path, "keep").exists() and not shard_path(tmp_path, "gone").exists()
    assert set(ShardSet.open(cfg)) == {"keep"}


def test_a_set_opens_only_the_logs_asked_for_and_the_others_on_first_use(tmp_path):
    """``ShardSet.open(cfg, drafts)``: those drafts' logs reloaded now, the others stay on disk
    (listed by ``logged``) until their draft asks for its shard; a closed log (``drop(delete=False)``)
    reopens with its records."""
    cfg = ShardConfig(max_bytes=10 * REC_BYTES, dir=tmp_path)
    with ShardSet(cfg) as ss:
        for i, d in enumerate(["a", "b/c", "a", "z"]):
            ss.append(make_record(i, draft_id=d))
    some = ShardSet.open(cfg, ["a", "not-on-disk"])
    assert set(some) == {"a"} and len(some["a"]) == 2
    assert sorted(some.logged()) == ["a", "b/c", "z"]
    assert len(some["b/c"]) == 1 and set(some) == {"a", "b/c"}  # opened when asked for
    some.drop("a", delete=False)
    assert "a" not in some and "a" in some.logged()
    assert [r.seq for r in some["a"].records()] == [0, 1]
    some.close()
    assert set(ShardSet.open(cfg, [])) == set() and set(ShardSet.open(cfg)) == {"a", "b/c", "z"}
    assert ShardSet(ShardConfig()).logged() == [] and ShardSet(ShardConfig(dir=tmp_path / "none")).logged() == []


def test_deleting_a_tenant_reaches_the_logs_of_closed_shards(tmp_path):
    """A draft's shard closed on disk (its draft parked) still loses the tenant's records: opened,
    cleaned and closed again; an open one as before."""
    cfg = ShardConfig(max_bytes=100 * REC_BYTES, dir=tmp_path)
    ss = ShardSet(cfg)
    for i in range(9):  # tenants t0, t1, t2 in turn
        ss.append(make_record(i, draft_id="open" if i % 2 else "closed"))
    ss.drop("closed", delete=False)
    assert ss.delete_tenant("t1") == 3  # t1: records 1, 4, 7 (4 in closed, 1 and 7 in open)
    assert "closed" not in ss  # closed again
    assert b'"t1"' not in shard_path(tmp_path, "closed").read_bytes()
    assert b'"t1"' not in shard_path(tmp_path, "open").read_bytes()
    assert sorted(r.tenant for r in ss["closed"].records()) == ["t0", "t0", "t2", "t2"]
    ss.close()


def test_deleting_a_tenant_also_removes_set_aside_copies_and_leftover_temporary_logs(tmp_path):
    """Damaged ranges set aside (``.corrupt-*``) and a crashed compaction's ``.log.tmp`` may hold the
    tenant's records: deletion removes them too; the logs stay."""
    cfg = ShardConfig(max_bytes=100 * REC_BYTES, dir=tmp_path)
    ss = ShardSet(cfg)
    for i in range(6):
        ss.append(make_record(i, draft_id="a" if i % 2 else "b"))
    log_a = shard_path(tmp_path, "a")
    (tmp_path / f"{log_a.name}.corrupt-1700000000000").write_bytes(log_a.read_bytes())  # as replay sets aside
    (tmp_path / f"{shard_path(tmp_path, 'b').name}.tmp").write_bytes(log_a.read_bytes())  # a compaction cut off
    (tmp_path / f"{shard_path(tmp_path, 'gone').name}.tmp").write_bytes(log_a.read_bytes())  # of a shard not open
    assert ss.delete_tenant("t1") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([log_a.name, shard_path(tmp_path, "b").name])
    assert not any(b'"t1"' in p.read_bytes() for p in tmp_path.iterdir())
    ss.close()


def test_shard_logs_are_private_to_their_owner(tmp_path):
    """Records hold prompts and outputs: logs (and what compaction and replay write) are 0600 in a
    0700 folder, whatever the umask; a folder or log made wider before is narrowed at open."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        d = tmp_path / "shards"
        ss = ShardSet(ShardConfig(max_bytes=100 * REC_BYTES, dir=d))
        for i in range(4):
            ss.append(make_record(i, draft_id="a"))
        ss["a"].compact()
        ss.close()
        mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
        assert mode(d) == 0o700 and mode(shard_path(d, "a")) == 0o600
        d.chmod(0o755)
        shard_path(d, "a").chmod(0o644)
        with open(shard_path(d, "a"), "ab") as f:
            f.write(b"torn")  # a damaged tail: set aside on replay
        ss = ShardSet.open(ShardConfig(max_bytes=100 * REC_BYTES, dir=d), ["a"])
        ss.close()
        assert mode(d) == 0o700 and {p.name.split(".log")[-1][:8]: mode(p) for p in d.iterdir()} == {"": 0o600, ".corrupt": 0o600}
    finally:
        os.umask(old)
