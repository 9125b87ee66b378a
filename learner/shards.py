"""Replay shards: one per draft, records under a byte bound with a chosen eviction policy, optionally
persisted to an append-only, crash-safe log.

Log format (one file ``shard-<quoted draft id>.log`` per shard): a sequence of frames
``magic b"OSDR" | length u32 | crc32(payload) u32 | payload`` (little-endian). The first payload
byte is the frame type:

* ``R`` + record: ``meta_len u32 | meta (JSON, utf-8) | raw little-endian array bytes``; the JSON
  holds the scalar fields and, per array, its name, dtype and shape. No pickle anywhere: loading a
  log never executes code.
* ``E`` + JSON ``{"evict": [seq, ...], "appended": n}``: records evicted (or refused) by an append.
* ``L`` + ``<qd`` (seq, loss): a loss update (``update_loss``).

Reloading replays the frames, so the live set, the counters and the losses come back exactly. A
frame that is torn (short header or payload) or corrupt (bad magic, absurd length, CRC mismatch,
undecodable payload) is skipped and the replay **resynchronises** on the next valid frame: the
reader looks for the next ``OSDR`` from which a whole frame with a matching CRC32 decodes (a false
match inside damaged bytes would need the CRC of a random payload to agree), so one corrupt frame in
the middle loses that frame only and every intact record after it is kept. The skipped bytes are
saved next to the log (``<log>.corrupt-<ms>``, each range with its offset and reason in the warning),
and the log is rewritten from what was recovered (a torn tail is simply truncated); appends then
continue with fresh sequence numbers. Each append writes and flushes
its frames before it returns (an accepted record survives a process crash; with ``fsync=True``
also a power loss). The log is compacted (rewritten with the live records only, via a temporary
file and ``os.replace``) when it grows past ``compact_factor`` times ``max_bytes``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import struct
import threading
import time
import zlib
from collections import OrderedDict
from heapq import heapify, heappop, heappush
from pathlib import Path
from typing import Iterable, Iterator, Literal
from urllib.parse import quote, unquote

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from learner.record import ReplayRecord, _clean_loss, decode_record, encode_record

log = logging.getLogger("learner.replay")

MAGIC = b"OSDR"
_HEADER = struct.Struct("<4sII")  # magic, payload length, crc32(payload)
_LOSS = struct.Struct("<qd")  # seq, loss
_MAX_FRAME = 1 << 30  # a larger length field is corruption, not a record


class ShardConfig(BaseModel):
    """Bounds and persistence of one replay shard (a :class:`ShardSet` applies it to each draft).

    ``max_bytes``: bound on the live records' :attr:`ReplayRecord.nbytes`. ``eviction``: ``fifo``
    (oldest out), ``reservoir`` (a uniform sample of everything ever appended, Vitter's algorithm R
    over a seen-counter, deciding only when the shard is full: one with room, after a refused
    oversize record or a tenant's deletion, keeps what comes) or ``high_loss`` (lowest loss out
    first; unscored = +inf, ties: oldest out). ``dir``: where the shard logs live (None: in memory
    only). ``fsync``: fsync after each write (survives power loss, slower). ``seed``: the reservoir's
    random choices.
    ``compact_factor``: rewrite the log when it exceeds this many times ``max_bytes``.
    ``max_records``: an optional bound on the number of live records as well (the trainers'
    held-back records keep the newest ``holdout_max``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: int = Field(default=64 << 20, gt=0)
    eviction: Literal["fifo", "reservoir", "high_loss"] = "fifo"
    dir: Path | None = None
    fsync: bool = False
    seed: int = 0
    compact_factor: float = Field(default=2.0, gt=1.0)
    max_records: int | None = Field(default=None, ge=1)


def shard_path(directory: Path, draft_id: str) -> Path:
    """``<dir>/shard-<draft id, percent-encoded>.log``."""
    return Path(directory) / f"shard-{quote(draft_id, safe='')}.log"


def _private_dir(path: Path) -> None:
    """``path`` as a folder only its owner can enter (0700; made so if it was created wider)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)


def _open_private(path: Path, mode: str):
    """Open for ``"ab"`` or ``"wb"`` a file only its owner can read (created 0600; an older, wider
    one is narrowed): the records hold prompts and outputs."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "ab" else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode)


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


class ReplayShard:
    """Byte-bounded replay buffer of one draft, optionally persisted (see the module docstring).

    Counters: ``appended`` (records offered to :meth:`append`), ``evicted`` (records appended that
    are no longer live: evicted, or refused - a reservoir skip, or a record larger than
    ``max_bytes`` on its own); ``appended == len(shard) + evicted`` always. Thread-safe.
    """

    def __init__(self, cfg: ShardConfig, draft_id: str):
        self.cfg = cfg
        self.draft_id = draft_id
        self.appended = 0
        self.evicted = 0
        self.compactions = 0
        self._bytes = 0
        self._live: OrderedDict[int, ReplayRecord] = OrderedDict()  # seq -> record, append order
        self._keys: list[int] = []  # live seqs, any order: O(1) uniform picks
        self._slot: dict[int, int] = {}  # seq -> index in _keys
        self._heap: list[tuple[float, int]] = []  # (loss key, seq), lazy (high_loss)
        self._lock = threading.RLock()
        self._fh = None
        self.path: Path | None = shard_path(cfg.dir, draft_id) if cfg.dir is not None else None
        self._log_bytes = 0
        self._compact_at = 0.0
        self._rewrite_after_replay = False
        if self.path is not None:
            _private_dir(self.path.parent)
            self._replay()
        self._rng = random.Random(f"{cfg.seed}:{draft_id}:{self.appended}")  # eviction decisions
        self._sample_rng = random.Random(f"sample:{cfg.seed}:{draft_id}:{self.appended}")
        if self.path is not None:
            self._fh = _open_private(self.path, "ab")
            self._log_bytes = self.path.stat().st_size
            self._enforce_bound()
            self._set_compact_threshold()
            if self._log_bytes > self._compact_at or self._rewrite_after_replay:
                self.compact()

    @classmethod
    def open(cls, cfg: ShardConfig, draft_id: str) -> "ReplayShard":
        """The shard of ``draft_id``, reloaded from ``cfg.dir`` when its log exists."""
        return cls(cfg, draft_id)

    # -- views ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[ReplayRecord]:
        return iter(self.records())

    def __contains__(self, seq: int) -> bool:
        return seq in self._live

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def log_bytes(self) -> int:
        return self._log_bytes

    def records(self) -> list[ReplayRecord]:
        """Live records, oldest append first (the shard's own objects: do not mutate)."""
        with self._lock:
            return list(self._live.values())

    def get(self, seq: int) -> ReplayRecord | None:
        return self._live.get(seq)

    def stats(self) -> dict:
        return {
            "records": len(self._live),
            "bytes": self._bytes,
            "appended": self.appended,
            "evicted": self.evicted,
            "log_bytes": self._log_bytes,
            "compactions": self.compactions,
        }

    def sample(self, n: int, rng: random.Random | np.random.Generator | int | None = None) -> list[ReplayRecord]:
        """``min(n, len)`` distinct live records, uniformly at random.

        ``rng``: a ``random.Random``, a numpy ``Generator``, an int seed, or None (a shard-owned RNG).
        """
        if n < 0:
            raise ValueError(f"sample: n must be >= 0, got {n}")
        with self._lock:
            keys = list(self._keys)
            m = min(n, len(keys))
            if isinstance(rng, np.random.Generator):
                picked = [keys[i] for i in rng.choice(len(keys), size=m, replace=False)]
            else:
                r = random.Random(rng) if isinstance(rng, int) else (rng or self._sample_rng)
                picked = r.sample(keys, m)
            return [self._live[s] for s in picked]

    # -- mutation ------------------------------------------------------------------------------
    def append(self, record: ReplayRecord) -> int | None:
        """Add ``record`` (a shard-owned copy gets ``seq``); returns the seq, or None if refused.

        The record's frame is written and flushed before this returns. Then the byte bound is
        restored with the configured eviction (which may, for ``high_loss``, evict the newcomer
        itself when it carries the lowest loss).
        """
        if record.draft_id != self.draft_id:
            raise ValueError(f"record of draft {record.draft_id!r} appended to the shard of {self.draft_id!r}")
        with self._lock:
            seq = self.appended
            self.appended += 1
            size = record.nbytes
            refuse = size > self.cfg.max_bytes
            if refuse:
                log.warning("replay shard %r: record of %d bytes exceeds max_bytes=%d; dropped", self.draft_id, size, self.cfg.max_bytes)
            victims: list[int] = []
            full = self._bytes + size > self.cfg.max_bytes or (self.cfg.max_records is not None and len(self._live) >= self.cfg.max_records)
            if not refuse and self.cfg.eviction == "reservoir" and full:
                # algorithm R: the seq-th item (0-based) replaces a uniform slot with probability len/(seq+1)
                j = self._rng.randrange(seq + 1)
                if j >= len(self._keys):
                    refuse = True
                else:
                    victims.append(self._keys[j])
            if refuse:
                self.evicted += 1
                self._write(b"E" + json.dumps({"evict": [seq], "appended": self.appended}).encode())
                return None
            rec = dataclasses.replace(record, seq=seq)
            self._write(b"R" + encode_record(rec))  # durable before anything is evicted for it
            self._insert(rec)
            for v in victims:
                self._remove(v)
            victims += self._evict_to_bound(protect=seq if self.cfg.eviction == "reservoir" else None)
            if victims:
                self._write(b"E" + json.dumps({"evict": victims, "appended": self.appended}).encode())
            self._maybe_compact()
            return seq

    def update_loss(self, idx: int | ReplayRecord, loss: float | None) -> bool:
        """Set the loss of the live record with seq ``idx`` (or of that record); False if not live.

        Used by ``high_loss`` eviction (None / NaN = unscored = +inf). Persisted as a small log
        frame (flushed, not fsynced: a lost loss update only makes a record look unscored).
        """
        seq = idx.seq if isinstance(idx, ReplayRecord) else int(idx)
        loss = _clean_loss(loss)
        with self._lock:
            rec = self._live.get(seq)
            if rec is None:
                return False
            rec.loss = loss
            if self.cfg.eviction == "high_loss":
                heappush(self._heap, (_key(loss), seq))
                self._prune_heap()
            self._write(b"L" + _LOSS.pack(seq, math.nan if loss is None else loss), sync=False)
            self._maybe_compact()
            return True

    def delete_where(self, predicate) -> int:
        """Remove every live record for which ``predicate(record)`` is true, from memory and from
        disk (the log is rewritten without them); returns how many. They count as evicted."""
        with self._lock:
            gone = [seq for seq, rec in self._live.items() if predicate(rec)]
            for seq in gone:
                self._remove(seq)
            if gone:
                self._write(b"E" + json.dumps({"evict": gone, "appended": self.appended}).encode())
                self.compact()  # the deleted records' bytes leave the file, not only the index
            return len(gone)

    def compact(self) -> None:
        """Rewrite the log with the live records only (temp file + ``os.replace``: atomic)."""
        if self.path is None:
            return
        with self._lock:
            tmp = self.path.with_name(self.path.name + ".tmp")
            with _open_private(tmp, "wb") as f:
                f.write(_frame(b"E" + json.dumps({"evict": [], "appended": self.appended}).encode()))
                for rec in self._live.values():
                    f.write(_frame(b"R" + encode_record(rec)))
                f.flush()
                if self.cfg.fsync:
                    os.fsync(f.fileno())
            if self._fh is not None:
                self._fh.close()
            os.replace(tmp, self.path)
            if self.cfg.fsync:
                _fsync_dir(self.path.parent)
            self._fh = _open_private(self.path, "ab")
            self._log_bytes = self.path.stat().st_size
            self.compactions += 1
            self._set_compact_threshold()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> "ReplayShard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _insert(self, rec: ReplayRecord) -> None:
        self._live[rec.seq] = rec
        self._slot[rec.seq] = len(self._keys)
        self._keys.append(rec.seq)
        self._bytes += rec.nbytes
        if self.cfg.eviction == "high_loss":
            heappush(self._heap, (_key(rec.loss), rec.seq))

    def _remove(self, seq: int) -> None:
        rec = self._live.pop(seq)
        i = self._slot.pop(seq)
        last = self._keys.pop()
        if last != seq:
            self._keys[i] = last
            self._slot[last] = i
        self._bytes -= rec.nbytes
        self.evicted += 1

    def _victim(self, protect: int | None) -> int:
        policy = self.cfg.eviction
        if policy == "fifo":
            return next(iter(self._live))
        if policy == "reservoir":
            while True:
                s = self._keys[self._rng.randrange(len(self._keys))]
                if s != protect or len(self._keys) == 1:
                    return s
        while True:  # high_loss: lazy heap, skip stale entries
            key, s = heappop(self._heap)
            rec = self._live.get(s)
            if rec is not None and _key(rec.loss) == key:
                return s

    def _evict_to_bound(self, protect: int | None = None) -> list[int]:
        out = []
        cap = self.cfg.max_records
        while self._live and (self._bytes > self.cfg.max_bytes or (cap is not None and len(self._live) > cap)):
            v = self._victim(protect)
            self._remove(v)
            out.append(v)
        return out

    def _enforce_bound(self) -> None:
        victims = self._evict_to_bound()
        if victims:
            self._write(b"E" + json.dumps({"evict": victims, "appended": self.appended}).encode())

    def _prune_heap(self) -> None:
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(_key(r.loss), s) for s, r in self._live.items()]
            heapify(self._heap)

    def _write(self, payload: bytes, sync: bool = True) -> None:
        if self._fh is None:
            return
        frame = _frame(payload)
        self._fh.write(frame)
        self._fh.flush()
        if sync and self.cfg.fsync:
            os.fsync(self._fh.fileno())
        self._log_bytes += len(frame)

    def _set_compact_threshold(self) -> None:
        self._compact_at = max(self.cfg.compact_factor * self.cfg.max_bytes, 2.0 * self._log_bytes)

    def _maybe_compact(self) -> None:
        if self._fh is not None and self._log_bytes > self._compact_at:
            self.compact()

    def _replay(self) -> None:
        """Rebuild the state from the log, skipping damaged bytes up to the next valid frame."""
        assert self.path is not None
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        pos, skipped, bad_at, why = 0, [], None, ""  # skipped: (start, end, reason) of damaged ranges
        while pos < len(data):
            end, problem = self._frame_at(data, pos)
            if problem is None:
                if bad_at is not None:
                    skipped.append((bad_at, pos, why))
                    bad_at = None
                pos = end
                continue
            if bad_at is None:
                bad_at, why = pos, problem
            nxt = data.find(MAGIC, pos + 1)
            pos = nxt if nxt >= 0 else len(data)
        if bad_at is not None:
            skipped.append((bad_at, len(data), why))
        self.evicted = self.appended - len(self._live)
        if not skipped:
            return
        side = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time() * 1000)}")
        with _open_private(side, "wb") as f:
            f.write(b"".join(data[a:b] for a, b, _ in skipped))
        if len(skipped) == 1 and skipped[0][1] == len(data):  # a torn or damaged tail: cut it off
            os.truncate(self.path, skipped[0][0])
        else:
            self._rewrite_after_replay = True  # damage in the middle: rewrite from what was recovered
        log.warning(
            "replay shard %r: skipped %d damaged byte range(s) of %s (%s); saved to %s, kept %d records",
            self.draft_id, len(skipped), self.path,
            "; ".join(f"bytes {a}-{b}: {w}" for a, b, w in skipped), side.name, len(self._live),
        )

    def _frame_at(self, data: bytes, pos: int) -> tuple[int, str | None]:
        """Apply the frame at ``pos``: (its end, None), or (pos, the reason it is not a valid frame)."""
        head = data[pos: pos + _HEADER.size]
        if len(head) < _HEADER.size:
            return pos, "torn frame header"
        magic, length, crc = _HEADER.unpack(head)
        if magic != MAGIC or length == 0 or length > _MAX_FRAME:
            return pos, "bad magic or length"
        end = pos + _HEADER.size + length
        if end > len(data):
            return pos, "torn frame payload"
        payload = data[pos + _HEADER.size: end]
        if zlib.crc32(payload) != crc:
            return pos, "crc mismatch"
        try:
            self._apply(payload)
        except (ValueError, KeyError, struct.error) as e:
            return pos, f"undecodable frame ({e})"
        return end, None

    def _apply(self, payload: bytes) -> None:
        kind, body = payload[:1], memoryview(payload)[1:]
        if kind == b"R":
            rec = decode_record(body)
            if rec.seq < 0 or rec.seq in self._live or rec.draft_id != self.draft_id:
                raise ValueError(f"record seq={rec.seq} draft={rec.draft_id!r} does not belong here")
            self._insert(rec)
            self.appended = max(self.appended, rec.seq + 1)
        elif kind == b"E":
            meta = json.loads(bytes(body))
            for s in meta["evict"]:
                if s in self._live:
                    self._remove(s)
            # every eviction frame carries the counter, past each seq it names (append, _enforce_bound,
            # delete_where and compact all write self.appended)
            self.appended = max(self.appended, int(meta["appended"]))
        elif kind == b"L":
            seq, loss = _LOSS.unpack(body)
            rec = self._live.get(seq)
            if rec is not None:
                rec.loss = _clean_loss(loss)
                if self.cfg.eviction == "high_loss":
                    heappush(self._heap, (_key(rec.loss), seq))
        else:
            raise ValueError(f"unknown frame type {kind!r}")


def _key(loss: float | None) -> float:
    return math.inf if loss is None else loss


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ShardSet:
    """One :class:`ReplayShard` per draft id, created (or reloaded from ``cfg.dir``) on first use.

    ``cfg.max_bytes`` bounds each shard separately.
    """

    def __init__(self, cfg: ShardConfig):
        self.cfg = cfg
        self.shards: dict[str, ReplayShard] = {}
        self._lock = threading.RLock()  # two threads asking for a new draft's shard open one log; drop and delete_tenant hold it

    @classmethod
    def open(cls, cfg: ShardConfig, drafts: Iterable[str] | None = None) -> "ShardSet":
        """A set with the shard logs found in ``cfg.dir`` reloaded: every one, or only those of
        ``drafts`` (the others stay on disk until their draft asks for its shard)."""
        out = cls(cfg)
        wanted = None if drafts is None else set(drafts)
        for draft_id in out.logged():
            if wanted is None or draft_id in wanted:
                out.shard(draft_id)
        return out

    def logged(self) -> list[str]:
        """Draft ids with a shard log in ``cfg.dir``, open or not."""
        d = self.cfg.dir
        if d is None or not Path(d).is_dir():
            return []
        return [unquote(p.name[len("shard-") : -len(".log")]) for p in sorted(Path(d).glob("shard-*.log"))]

    def shard(self, draft_id: str) -> ReplayShard:
        s = self.shards.get(draft_id)
        if s is None:
            with self._lock:
                s = self.shards.get(draft_id)
                if s is None:
                    s = self.shards[draft_id] = ReplayShard.open(self.cfg, draft_id)
        return s

    __getitem__ = shard

    def __contains__(self, draft_id: str) -> bool:
        return draft_id in self.shards

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards)

    def __len__(self) -> int:
        return len(self.shards)

    def append(self, record: ReplayRecord) -> int | None:
        """Append to the shard of ``record.draft_id``."""
        return self.shard(record.draft_id).append(record)

    def delete_tenant(self, tenant: str) -> int:
        """Delete every record of ``tenant`` from every shard (memory and disk), those closed on
        disk too (each opened, cleaned and closed again); returns how many."""
        with self._lock:  # no shard is closed under it
            n = sum(s.delete_where(lambda r: r.tenant == tenant) for s in list(self.shards.values()))
            for draft_id in self.logged():
                if draft_id not in self.shards:
                    with ReplayShard.open(self.cfg, draft_id) as s:
                        n += s.delete_where(lambda r: r.tenant == tenant)
            self._remove_side_files()
        return n

    def _remove_side_files(self) -> None:
        """Copies of records outside the logs: damaged byte ranges set aside (``.corrupt-*``, which
        may hold any tenant's records and cannot be read apart) and a compaction's temporary file
        left by a crash (``.log.tmp``; an open shard's is removed under its lock, so never one
        being written)."""
        d = self.cfg.dir
        if d is None or not Path(d).is_dir():
            return
        for p in sorted(Path(d).glob("shard-*.log.corrupt-*")):
            p.unlink(missing_ok=True)
        for p in sorted(Path(d).glob("shard-*.log.tmp")):
            s = self.shards.get(unquote(p.name[len("shard-") : -len(".log.tmp")]))
            if s is None:
                p.unlink(missing_ok=True)
            else:
                with s._lock:
                    p.unlink(missing_ok=True)

    def drop(self, draft_id: str, delete: bool = True) -> None:
        """Forget a draft's shard: close it (if open) and (``delete``: a retired draft) remove its
        log from disk, open or not; kept, the log reopens when the draft next asks for its shard."""
        with self._lock:
            s = self.shards.pop(draft_id, None)
            if s is not None:
                s.close()
        path = shard_path(self.cfg.dir, draft_id) if self.cfg.dir is not None else None
        if delete and path is not None:  # closed before (a parked draft) or not: its log goes
            path.unlink(missing_ok=True)

    def stats(self) -> dict[str, dict]:
        """Per draft id: records, bytes, appended, evicted (and log_bytes, compactions)."""
        return {d: s.stats() for d, s in self.shards.items()}

    def close(self) -> None:
        for s in self.shards.values():
            s.close()

    def __enter__(self) -> "ShardSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
