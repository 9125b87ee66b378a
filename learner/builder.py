"""Building replay records from a request's speculative steps (``RecordBuilder``); what the rows
of a step mean and which become records: learner.record."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from learner.record import LEARNED_SOURCES, ReplayRecord, _as_tensor


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
