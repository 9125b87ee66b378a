"""Rollback on live acceptance: a published version that serves worse than the one it replaced goes back.

The gate (:meth:`learner.trainer.DraftTrainer.gate`) judges a candidate on held-out records before it
is published. Live traffic can still disagree: users of RL co-training loops report acceptance
collapsing silently after a publish. So after each publish the learner watches served acceptance of
the new version against the version it replaced, both measured as accepted / proposed draft tokens
from the records the replicas send back (each record carries the version that served it):

- the old version's side holds its last ``baseline_records`` records before the publish, plus any of
  its records still arriving (replicas that had not installed the new version yet);
- the new version's side holds its records since the publish.

Once both sides have ``min_proposed`` proposed tokens, the new version is rolled back when its
acceptance is lower by more than ``margin`` plus ``z`` standard errors (a one-sided two-proportion
test, pooled), and kept otherwise; either way the watch closes. A watch that has not decided within
``watch_s`` closes too (the version stays). A rollback republishes the old weights under a new
version number (:meth:`learner.trainer.DraftTrainer.rollback`), which is not watched itself.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from config.learner import LiveWatchConfig


#: closed watches kept for operators (``kept``, ``rolled_back``)
HISTORY = 64


@dataclass
class Verdict:
    """A version to roll back: ``draft_id`` served ``version`` worse than ``previous``."""

    draft_id: str
    version: int
    previous: int
    acceptance: float  # the new version's
    baseline: float  # the old version's

    def to_dict(self) -> dict:
        return {"draft_id": self.draft_id, "version": self.version, "previous": self.previous,
                "acceptance": round(self.acceptance, 4), "baseline": round(self.baseline, 4)}


@dataclass
class _Watch:
    version: int
    previous: int
    opened: float
    new: list[int] = field(default_factory=lambda: [0, 0])  # proposed, accepted
    old: list[int] = field(default_factory=lambda: [0, 0])


def worse(new: tuple[int, int], old: tuple[int, int], margin: float, z: float) -> bool:
    """Whether acceptance ``new`` = (proposed, accepted) is below ``old`` by more than ``margin``
    plus ``z`` pooled standard errors."""
    (n1, a1), (n0, a0) = new, old
    p1, p0 = a1 / n1, a0 / n0
    pooled = (a1 + a0) / (n1 + n0)
    se = math.sqrt(max(pooled * (1 - pooled), 0.0) * (1 / n1 + 1 / n0))
    return p0 - p1 > margin + z * se


class LiveWatch:
    """The served acceptance of each draft's versions, and the watch over each newest publish."""

    def __init__(self, cfg: LiveWatchConfig = LiveWatchConfig(), clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self._recent: dict[tuple[str, int], deque[tuple[int, int]]] = {}  # (draft, version) -> records' (proposed, accepted)
        self._watches: dict[str, _Watch] = {}
        self.kept: list[dict] = []  # closed watches whose version stayed (the newest HISTORY, newest last)
        self.rolled_back: list[dict] = []  # verdicts carried out (the newest HISTORY)

    def observe(self, draft_id: str, version: int, proposed: int, accepted: int) -> None:
        """One served record's proposed and accepted draft tokens, under the version that served it."""
        if proposed <= 0:
            return
        self._recent.setdefault((draft_id, version), deque(maxlen=self.cfg.baseline_records)).append((proposed, accepted))
        w = self._watches.get(draft_id)
        if w is not None:
            side = w.new if version == w.version else w.old if version == w.previous else None
            if side is not None:
                side[0] += proposed
                side[1] += accepted

    def published(self, draft_id: str, version: int, previous: int) -> None:
        """``version`` replaced ``previous``: watch it (a watch still open on the draft is replaced)."""
        for key in [k for k in self._recent if k[0] == draft_id and k[1] not in (previous, version)]:
            del self._recent[key]  # versions no longer served: their counts are of no use
        if not self.cfg.enabled:
            return
        w = _Watch(version, previous, self.clock())
        for p, a in self._recent.get((draft_id, previous), ()):
            w.old[0] += p
            w.old[1] += a
        self._watches[draft_id] = w

    def carried_out(self, verdict: Verdict, republished_as: int) -> None:
        """A verdict's rollback happened: the old weights are served again as ``republished_as``."""
        self.rolled_back.append({**verdict.to_dict(), "republished_as": republished_as})
        del self.rolled_back[:-HISTORY]

    def forget(self, draft_id: str) -> None:
        """The draft left the learner (parked or removed)."""
        self._watches.pop(draft_id, None)
        for key in [k for k in self._recent if k[0] == draft_id]:
            del self._recent[key]

    def watching(self) -> dict[str, dict]:
        return {d: {"version": w.version, "previous": w.previous, "proposed": w.new[0], "baseline_proposed": w.old[0]}
                for d, w in self._watches.items()}

    def verdicts(self) -> list[Verdict]:
        """Close the watches that can decide (or have run out of time); return those to roll back."""
        out = []
        now = self.clock()
        for d, w in list(self._watches.items()):
            if min(w.new[0], w.old[0]) >= self.cfg.min_proposed:
                del self._watches[d]
                new, old = (w.new[0], w.new[1]), (w.old[0], w.old[1])
                if worse(new, old, self.cfg.margin, self.cfg.z):
                    out.append(Verdict(d, w.version, w.previous, new[1] / new[0], old[1] / old[0]))
                else:
                    self.kept.append({"draft_id": d, "version": w.version, "reason": "no worse than the version before"})
            elif now - w.opened > self.cfg.watch_s:
                del self._watches[d]
                self.kept.append({"draft_id": d, "version": w.version, "reason": f"undecided after {self.cfg.watch_s:.0f} s"})
        del self.kept[:-HISTORY]
        return out
