"""Replay records: the target distributions recorded during verification, one record per request,
and their byte codec (no pickle anywhere: decoding never executes code). Builders: learner.builder;
shards: learner.shards.

Every speculative step (:class:`speculative.engine.StepResult`) reports the target's sparse
distribution (top-K ids, probs, tail mass) for k + 1 positions. Nothing is ever recomputed with a
model here: a :class:`RecordBuilder` collects the steps of one request and turns them into one
:class:`ReplayRecord` (prompt + output tokens and the distribution rows that are conditioned on
those final tokens); a :class:`learner.shards.ReplayShard` (one per draft) keeps records under a
byte bound with a chosen eviction policy and, optionally, persists them to an append-only,
crash-safe log.

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
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from learner.losses import SparseDist

_U32 = struct.Struct("<I")
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
