"""Replay shards: the target distributions recorded during verification, kept for online distillation.

Every speculative step (:class:`speculative.engine.StepResult`) reports the target's sparse
distribution (top-K ids, probs, tail mass) for k + 1 positions. Nothing is ever recomputed with a
model here: a :class:`RecordBuilder` collects the steps of one request and turns them into one
:class:`ReplayRecord` (prompt + output tokens and the distribution rows that are conditioned on
those final tokens); a :class:`ReplayShard` (one per draft) keeps records under a byte bound with
a chosen eviction policy and, optionally, persists them to an append-only, crash-safe log.

Rows of a step (row i predicts the token at ``start + i`` given ``tokens[:start] + d_1..d_i``):

* *teacher rows* - ``i = 0..min(accepted, len(emitted))``: every conditioning token is in the final
  output, so the row is a plain teacher-forced target for the final sequence. Normally that is rows
  ``0..accepted`` (``len(emitted) = accepted + 1``); when the request ended inside the step (EOS, a
  stop string, ``max_tokens``) only the drafts that were actually emitted count, and the last kept
  row may predict position ``len(tokens)`` (e.g. the EOS that ends the output, which the engine does
  not append). These go into the request's record (``context="teacher"``).
* *student rows* - the later rows ``i = min(accepted, len(emitted)) + 1..k`` are conditioned on
  draft tokens that were rejected (or cut off). They are left out of the teacher record. With
  ``RecordBuilder(keep_student_rows=True)`` each step that has some becomes one extra record
  (``context="student"``) whose tokens are ``final_tokens[:start] + draft_tokens`` - the draft's
  own branch - so the same teacher-forcing code trains on them (on-policy signal, as in GKD).

``draft_wrong[p]`` (per row) is True unless the *learned* draft proposed, at that row, exactly the
target's argmax (``StepResult.draft_matches_target``): so it is True where the draft proposed a
different token, and also where the learned draft proposed nothing - the bonus row ``i = k``, every
row of a ``k = 0`` step, and all rows of steps drafted by another proposer (``source != "draft"``,
e.g. n-gram lookup). ``proposed[p]`` tells those two cases apart (True: the learned draft proposed
a token for this row, so ``draft_wrong`` is a measured miss; False: not proposed, unknown). The
comparison is with the target's argmax even under sampling, where an accepted draft token can
differ from it.

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
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Sequence
from urllib.parse import quote, unquote

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from learner.losses import SparseDist

__all__ = [
    "ReplayRecord",
    "RecordBuilder",
    "ShardConfig",
    "ReplayShard",
    "ShardSet",
    "encode_record",
    "decode_record",
    "shard_path",
]

log = logging.getLogger(__name__)

MAGIC = b"OSDR"
_HEADER = struct.Struct("<4sII")  # magic, payload length, crc32(payload)
_U32 = struct.Struct("<I")
_LOSS = struct.Struct("<qd")  # seq, loss
_MAX_FRAME = 1 << 30  # a larger length field is corruption, not a record
#: fixed per-record cost added to the array bytes by ``ReplayRecord.nbytes`` (framing + metadata)
RECORD_OVERHEAD = 256

_ARRAYS = ("tokens", "positions", "top_ids", "top_probs", "tail", "draft_wrong", "proposed")
#: arrays a record may lack (None): the target's features, kept for feature-conditioned drafts
_OPTIONAL = ("features",)
#: proposer sources whose steps are a learned draft's (their rows count as proposed by it)
LEARNED_SOURCES = ("draft", "feature")
_NP_DTYPES = {
    torch.int32: "<i4",
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.bool: "|b1",
}
_TORCH_DTYPES = {v: k for k, v in _NP_DTYPES.items()}


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


def _as_tensor(x: Any, dtype: torch.dtype) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return t.detach().to(device="cpu", dtype=dtype).contiguous()


@dataclass
class ReplayRecord:
    """One request's tokens and the target's sparse distributions at some of its positions.

    Row p predicts the token at absolute position ``positions[p]`` given ``tokens[:positions[p]]``
    (``prompt_len <= positions[p] <= len(tokens)``; ``== len(tokens)`` for a row that predicts past
    the end, e.g. the EOS that ended the request). ``top_probs``/``tail`` are float16 or float32
    (both the same dtype); ``draft_wrong``/``proposed`` are described in the module docstring.
    ``seq`` is assigned by the shard (its append counter; -1 outside a shard) and identifies the
    record for :meth:`ReplayShard.update_loss`. ``loss``: the latest training loss, None = unscored.
    """

    tokens: torch.Tensor  # [L] int32, prompt + output (student records: the draft's branch)
    prompt_len: int
    positions: torch.Tensor  # [P] int32
    top_ids: torch.Tensor  # [P, K] int32
    top_probs: torch.Tensor  # [P, K] float16 | float32
    tail: torch.Tensor  # [P] same dtype as top_probs
    draft_wrong: torch.Tensor  # [P] bool
    proposed: torch.Tensor | None = None  # [P] bool; None -> all True (draft_wrong taken as measured)
    domain: str | None = None
    tenant: str | None = None
    draft_id: str = ""
    draft_version: int = 0
    created: float = field(default_factory=time.time)
    loss: float | None = None
    request_id: str = ""
    context: Literal["teacher", "student"] = "teacher"
    seq: int = -1
    #: [F, H] float16: the target's features (after its final norm) at positions 0..F-1, the final
    #: tokens it was fed (F < len(tokens)); None unless the request ran a feature-conditioned draft
    features: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = _as_tensor(self.tokens, torch.int32).reshape(-1)
        self.positions = _as_tensor(self.positions, torch.int32).reshape(-1)
        self.top_ids = _as_tensor(self.top_ids, torch.int32)
        pdt = self.top_probs.dtype if isinstance(self.top_probs, torch.Tensor) else torch.float32
        pdt = pdt if pdt in (torch.float16, torch.float32) else torch.float32
        self.top_probs = _as_tensor(self.top_probs, pdt)
        self.tail = _as_tensor(self.tail, pdt).reshape(-1)
        self.draft_wrong = _as_tensor(self.draft_wrong, torch.bool).reshape(-1)
        n = self.positions.shape[0]
        if self.top_ids.dim() == 1 and self.top_ids.numel() == 0:  # empty record
            self.top_ids = self.top_ids.reshape(0, 0)
            self.top_probs = self.top_probs.reshape(0, 0)
        self.proposed = (
            torch.ones(n, dtype=torch.bool) if self.proposed is None else _as_tensor(self.proposed, torch.bool).reshape(-1)
        )
        self.prompt_len = int(self.prompt_len)
        self.draft_version = int(self.draft_version)
        self.created = float(self.created)
        self.draft_id = str(self.draft_id)
        self.request_id = str(self.request_id)
        self.seq = int(self.seq)
        self.loss = _clean_loss(self.loss)
        if self.features is not None:
            self.features = _as_tensor(self.features, torch.float16)
            if self.features.dim() != 2 or self.features.shape[0] >= max(self.tokens.shape[0], 1):
                raise ValueError(f"ReplayRecord: features must be [F, H] with F < len(tokens), got {tuple(self.features.shape)}")
        if self.context not in ("teacher", "student"):
            raise ValueError(f"ReplayRecord: context must be 'teacher' or 'student', got {self.context!r}")
        if self.top_ids.dim() != 2 or self.top_ids.shape[0] != n or self.top_probs.shape != self.top_ids.shape:
            raise ValueError(
                f"ReplayRecord: top_ids/top_probs must be [P, K] with P={n}, got "
                f"{tuple(self.top_ids.shape)} and {tuple(self.top_probs.shape)}"
            )
        for name in ("tail", "draft_wrong", "proposed"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"ReplayRecord: {name} must be [P] with P={n}, got {tuple(getattr(self, name).shape)}")
        length = self.tokens.shape[0]
        if not 0 <= self.prompt_len <= length:
            raise ValueError(f"ReplayRecord: prompt_len={self.prompt_len} outside [0, {length}]")
        if n and (int(self.positions.min()) < max(self.prompt_len, 1) or int(self.positions.max()) > length):
            raise ValueError(
                f"ReplayRecord: positions must lie in [max(prompt_len, 1), len(tokens)] = "
                f"[{max(self.prompt_len, 1)}, {length}], got {self.positions.tolist()[:8]}..."
            )

    # -- sizes and views --------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def k(self) -> int:
        return int(self.top_ids.shape[1])

    @property
    def nbytes(self) -> int:
        """Approximate size in memory and on disk: array bytes + strings + a fixed overhead."""
        arrays = sum(t.numel() * t.element_size() for a in _ARRAYS + _OPTIONAL if (t := getattr(self, a)) is not None)
        strings = sum(len((s or "").encode()) for s in (self.domain, self.tenant, self.draft_id, self.request_id))
        return arrays + strings + RECORD_OVERHEAD

    def to_sparse(self) -> SparseDist:
        """The rows as a :class:`SparseDist` (ids long, probs/tail float32), row order kept."""
        return SparseDist(ids=self.top_ids.long(), probs=self.top_probs.float(), tail=self.tail.float())

    def to_sample(self):
        """As an offline :class:`learner.offline.Sample` (the offline trainer's format).

        Needs the rows with ``position < len(tokens)`` to cover ``p0..len(tokens)-1`` contiguously
        (true for teacher records of fully recorded requests, and for student records); a row that
        predicts past the end is dropped. The Sample's ``prompt_len`` is ``p0``.
        """
        from learner.offline import Sample

        length = self.tokens.shape[0]
        keep = self.positions < length
        pos = self.positions[keep]
        if pos.numel() == 0:
            raise ValueError("ReplayRecord.to_sample: no row predicts a token inside the sequence")
        p0 = int(pos[0])
        if not torch.equal(pos, torch.arange(p0, length, dtype=pos.dtype)):
            raise ValueError("ReplayRecord.to_sample: rows do not cover the positions up to the end contiguously")
        return Sample(
            tokens=self.tokens[:length].long(),
            prompt_len=p0,
            ids=self.top_ids[keep].to(torch.int32),
            probs=self.top_probs[keep].float(),
            tail=self.tail[keep].float(),
            features=self.features,
            wrong=self.draft_wrong[keep].bool(),
        )

    def same_as(self, other: "ReplayRecord") -> bool:
        """Field-by-field equality (tensors compared exactly, dtypes included)."""
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, torch.Tensor):
                if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                    return False
            elif a != b:
                return False
        return True


def _clean_loss(loss: Any) -> float | None:
    if loss is None:
        return None
    loss = float(loss)
    return None if math.isnan(loss) else loss


def encode_record(rec: ReplayRecord) -> bytes:
    """Compact, pickle-free bytes: ``meta_len u32 | JSON meta | raw little-endian arrays``."""
    arrays, blobs = [], []
    for name in _ARRAYS + _OPTIONAL:
        t: torch.Tensor | None = getattr(rec, name)
        if t is None:
            continue
        dt = _NP_DTYPES[t.dtype]
        arrays.append([name, dt, list(t.shape)])
        blobs.append(t.numpy().astype(dt, copy=False).tobytes())
    meta = {
        "v": 1,
        "prompt_len": rec.prompt_len,
        "domain": rec.domain,
        "tenant": rec.tenant,
        "draft_id": rec.draft_id,
        "draft_version": rec.draft_version,
        "created": rec.created,
        "loss": rec.loss,
        "request_id": rec.request_id,
        "context": rec.context,
        "seq": rec.seq,
        "arrays": arrays,
    }
    m = json.dumps(meta, separators=(",", ":")).encode()
    return b"".join([_U32.pack(len(m)), m, *blobs])


def decode_record(buf: bytes | memoryview) -> ReplayRecord:
    """Inverse of :func:`encode_record`; raises ValueError on malformed input."""
    buf = memoryview(buf)
    try:
        (mlen,) = _U32.unpack_from(buf, 0)
        meta = json.loads(bytes(buf[4 : 4 + mlen]))
        off = 4 + mlen
        tensors = {}
        for name, dt, shape in meta.pop("arrays"):
            if name not in _ARRAYS + _OPTIONAL or dt not in _TORCH_DTYPES:
                raise ValueError(f"unknown array {name!r} of dtype {dt!r}")
            count = int(np.prod(shape, dtype=np.int64))
            arr = np.frombuffer(buf, dtype=np.dtype(dt), count=count, offset=off).reshape(shape)
            off += arr.nbytes
            tensors[name] = torch.from_numpy(arr.copy())
        if off != len(buf):
            raise ValueError(f"{len(buf) - off} trailing bytes")
        if meta.pop("v") != 1:
            raise ValueError("unknown record version")
        return ReplayRecord(**tensors, **meta)
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"malformed record: {e}") from e


# ---------------------------------------------------------------------------------------------
# Building records from steps
# ---------------------------------------------------------------------------------------------


@dataclass
class _StepRows:
    start: int
    emitted: list[int]
    draft_tokens: list[int]
    n_teacher: int  # rows 0..n_teacher-1 are teacher rows
    ids: torch.Tensor  # [k+1, K]
    probs: torch.Tensor  # [k+1, K]
    tail: torch.Tensor  # [k+1]
    wrong: torch.Tensor  # [k+1] bool
    proposed: torch.Tensor  # [k+1] bool
    draft_version: int
    features_start: int = 0
    features: torch.Tensor | None = None  # [n, H] float16: target features of this step's final fed tokens


class RecordBuilder:
    """Collects the :class:`StepResult` s of one request; :meth:`finish` makes its ReplayRecord.

    Only what the steps reported is used (no model calls). ``probs_dtype``: storage dtype of the
    probabilities and tail mass (float16 halves their size; the losses upcast). See the module
    docstring for which rows are kept and for ``keep_student_rows``. After :meth:`finish` the
    builder is empty and can be reused for another request.
    """

    def __init__(self, probs_dtype: torch.dtype = torch.float16, keep_student_rows: bool = False):
        if probs_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"probs_dtype must be torch.float16 or torch.float32, got {probs_dtype}")
        self.probs_dtype = probs_dtype
        self.keep_student_rows = keep_student_rows
        self.student_records: list[ReplayRecord] = []  # filled by finish() when keep_student_rows
        self._steps: list[_StepRows] = []
        self._request_id: str | None = None

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step) -> None:
        """Record one step (a :class:`speculative.engine.StepResult` of this builder's request)."""
        if self._request_id is None:
            self._request_id = step.request_id
        elif step.request_id != self._request_id:
            raise ValueError(f"RecordBuilder: step of request {step.request_id!r} added to {self._request_id!r}")
        k = len(step.draft_tokens)
        ids, probs, tail = step.target_top_ids, step.target_top_probs, step.target_tail
        if ids.dim() != 2 or ids.shape[0] != k + 1 or probs.shape != ids.shape or tail.shape != (k + 1,):
            raise ValueError(
                f"RecordBuilder: a step with k={k} needs [k+1, K] target rows, got ids {tuple(ids.shape)}, "
                f"probs {tuple(probs.shape)}, tail {tuple(tail.shape)}"
            )
        if not 0 <= step.accepted <= k or len(step.draft_matches_target) != k:
            raise ValueError(f"RecordBuilder: inconsistent step (k={k}, accepted={step.accepted})")
        by_draft = step.source in LEARNED_SOURCES
        proposed = torch.tensor([by_draft and i < k for i in range(k + 1)], dtype=torch.bool)
        matches = torch.tensor(list(step.draft_matches_target) + [False], dtype=torch.bool)
        n_teacher = min(step.accepted, len(step.emitted)) + 1
        self._steps.append(
            _StepRows(
                start=int(step.start),
                emitted=[int(t) for t in step.emitted],
                draft_tokens=[int(t) for t in step.draft_tokens],
                n_teacher=n_teacher,
                ids=ids.detach().cpu().to(torch.int32),
                probs=probs.detach().cpu().to(self.probs_dtype),
                tail=tail.detach().cpu().to(self.probs_dtype),
                wrong=~(proposed & matches),
                proposed=proposed,
                draft_version=int(step.draft_version),
                features_start=int(getattr(step, "features_start", 0)),
                features=getattr(step, "features", None),
            )
        )

    def finish(
        self,
        tokens: Sequence[int] | torch.Tensor,
        prompt_len: int,
        domain: str | None = None,
        tenant: str | None = None,
        draft_id: str = "",
        created: float | None = None,
    ) -> ReplayRecord:
        """The request's teacher record over its final ``tokens`` (prompt + output).

        Raises ValueError when the steps do not describe ``tokens`` (a step's emitted tokens are not
        at its ``start`` in ``tokens``, a step starts inside the prompt, or two steps overlap).
        ``draft_version`` is the newest version seen among the steps.
        """
        toks = _as_tensor(tokens, torch.int32).reshape(-1)
        length = toks.shape[0]
        steps = sorted(self._steps, key=lambda s: s.start)
        created = time.time() if created is None else created
        if not 0 < prompt_len <= length:
            raise ValueError(f"RecordBuilder.finish: prompt_len={prompt_len} outside [1, {length}]")
        end = prompt_len  # first position not yet covered
        for s in steps:
            if s.start < end:
                raise ValueError(f"RecordBuilder.finish: step at start={s.start} overlaps the prompt or an earlier step")
            got = toks[s.start : s.start + len(s.emitted)].tolist()
            if got != s.emitted or s.start + s.n_teacher - 1 > length:
                raise ValueError(f"RecordBuilder.finish: step at start={s.start} does not match the final tokens")
            end = s.start + s.n_teacher
        k_top = {s.ids.shape[1] for s in steps}
        if len(k_top) > 1:
            raise ValueError(f"RecordBuilder.finish: steps recorded different top-K sizes {sorted(k_top)}")
        kk = k_top.pop() if k_top else 0
        version = max((s.draft_version for s in steps), default=0)

        def cat(parts: list[torch.Tensor], shape_tail: tuple, dtype: torch.dtype) -> torch.Tensor:
            return torch.cat(parts) if parts else torch.zeros((0, *shape_tail), dtype=dtype)

        n = [s.n_teacher for s in steps]
        rec = ReplayRecord(
            tokens=toks,
            prompt_len=prompt_len,
            positions=cat([torch.arange(s.start, s.start + m, dtype=torch.int32) for s, m in zip(steps, n)], (), torch.int32),
            top_ids=cat([s.ids[:m] for s, m in zip(steps, n)], (kk,), torch.int32),
            top_probs=cat([s.probs[:m] for s, m in zip(steps, n)], (kk,), self.probs_dtype),
            tail=cat([s.tail[:m] for s, m in zip(steps, n)], (), self.probs_dtype),
            draft_wrong=cat([s.wrong[:m] for s, m in zip(steps, n)], (), torch.bool),
            proposed=cat([s.proposed[:m] for s, m in zip(steps, n)], (), torch.bool),
            domain=domain,
            tenant=tenant,
            draft_id=draft_id,
            draft_version=version,
            created=created,
            request_id=self._request_id or "",
            features=_features_of(steps, length - 1),
        )
        self.student_records = []
        if self.keep_student_rows:
            for s in steps:
                k = len(s.draft_tokens)
                if s.n_teacher > k:
                    continue
                a = s.n_teacher  # rows a..k are conditioned on a rejected / cut-off draft token
                self.student_records.append(
                    ReplayRecord(
                        tokens=torch.cat([toks[: s.start], torch.tensor(s.draft_tokens, dtype=torch.int32)]),
                        prompt_len=prompt_len,
                        positions=torch.arange(s.start + a, s.start + k + 1, dtype=torch.int32),
                        top_ids=s.ids[a:],
                        top_probs=s.probs[a:],
                        tail=s.tail[a:],
                        draft_wrong=s.wrong[a:],
                        proposed=s.proposed[a:],
                        domain=domain,
                        tenant=tenant,
                        draft_id=draft_id,
                        draft_version=s.draft_version,
                        created=created,
                        request_id=self._request_id or "",
                        context="student",
                    )
                )
        self._steps, self._request_id = [], None
        return rec


def _features_of(steps: list[_StepRows], limit: int) -> torch.Tensor | None:
    """The steps' target features as one [F, H] array over positions 0..F-1, F <= ``limit`` (a
    step's accepted drafts past an EOS or max_tokens were verified but are not in the record);
    None when a step has none or they leave a gap: a feature draft needs every position's."""
    if not steps or any(s.features is None for s in steps):
        return None
    parts, end = [], 0
    for s in steps:
        if s.features_start > end:
            return None
        parts.append(s.features[end - s.features_start :])
        end = max(end, s.features_start + s.features.shape[0])
    return torch.cat(parts)[:limit].to(torch.float16)


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------


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
