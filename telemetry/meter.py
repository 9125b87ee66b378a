"""What one replica counts: cumulative counters, histograms, current gauges and recent events,
read as one snapshot by the Metrics deployment (which adds up the differences across replicas).

Thread-safe (the learner counts from its training thread). Label values are capped per label
(``MetricsConfig.max_*``) and per family (``max_series``): beyond the cap they read ``other``.
"""

from __future__ import annotations

import bisect
import threading
import time
import uuid
from collections import deque

from config import MetricsConfig

from .catalog import CAPPED, CATALOG, OTHER, Family

Key = tuple[str, tuple[str, ...]]  # (family name, label values in the family's order)


class LabelCaps:
    """First come, first kept: the first ``cap`` distinct values of a label keep their name."""

    def __init__(self, cfg: MetricsConfig, catalog: dict[str, Family] = CATALOG):
        self.cfg = cfg
        self.catalog = catalog
        self.seen: dict[str, set[str]] = {label: set() for label in CAPPED}
        self.series: dict[str, set[tuple[str, ...]]] = {}

    def key(self, name: str, labels: dict | tuple) -> Key:
        fam = self.catalog[name]
        if isinstance(labels, dict):
            if set(labels) != set(fam.labels):
                raise ValueError(f"{name} takes labels {fam.labels}, got {tuple(labels)}")
            values = tuple(str(labels[n]) for n in fam.labels)
        else:
            values = labels
        values = tuple(self._cap(n, v) for n, v in zip(fam.labels, values))
        known = self.series.setdefault(name, set())
        if values not in known:
            if len(known) >= self.cfg.max_series - 1:  # one slot stays for the "other" series
                values = tuple(OTHER for _ in values)
            known.add(values)
        return name, values

    def _cap(self, label: str, value: str) -> str:
        seen = self.seen.get(label)
        if seen is None or value in seen:
            return value
        if len(seen) >= getattr(self.cfg, CAPPED[label]):
            return OTHER
        seen.add(value)
        return value


class Meter:
    """One replica's counts. ``source`` names the deployment; ``epoch`` is new in every process, so a
    restarted replica is a new series of snapshots (counted from zero, never twice)."""

    def __init__(self, source: str, cfg: MetricsConfig | None = None, replica: str | None = None):
        self.cfg = cfg or MetricsConfig()
        self.source = source
        self.replica = replica or f"{source}-{uuid.uuid4().hex[:8]}"
        self.epoch = uuid.uuid4().hex
        self.enabled = self.cfg.enabled
        self.caps = LabelCaps(self.cfg)
        self._counters: dict[Key, float] = {}
        self._hists: dict[Key, list[float]] = {}  # [count per bucket (last: +Inf)..., sum]
        self._gauges: dict[Key, float] = {}
        self._events: deque[dict] = deque(maxlen=self.cfg.events)
        self._seq = 0
        self._snapshots = 0
        self._lock = threading.Lock()

    # -- counting ----------------------------------------------------------------------------------
    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        """Add ``value`` (0 creates the series: a ratio of two counters needs both to exist)."""
        if not self.enabled:
            return
        if value < 0:
            raise ValueError(f"{name}: a counter only goes up (got {value})")
        with self._lock:
            k = self.caps.key(name, labels)
            self._counters[k] = self._counters.get(k, 0.0) + value

    def observe(self, name: str, value: float, n: int = 1, **labels) -> None:
        """``n`` observations of ``value`` in histogram ``name``."""
        if not self.enabled or n <= 0:
            return
        fam = CATALOG[name]
        with self._lock:
            k = self.caps.key(name, labels)
            h = self._hists.get(k)
            if h is None:
                h = self._hists[k] = [0.0] * (len(fam.buckets) + 2)
            h[bisect.bisect_left(fam.buckets, value)] += n  # first bucket whose bound >= value
            h[-1] += value * n

    def set(self, name: str, value: float, **labels) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._gauges[self.caps.key(name, labels)] = float(value)

    def replace(self, name: str, series: dict[tuple[str, ...], float]) -> None:
        """Gauge ``name`` becomes exactly ``series`` (label values in the family's order -> value):
        series not in it go (an info gauge whose label values change, e.g. a domain's name)."""
        if not self.enabled:
            return
        with self._lock:
            for k in [k for k in self._gauges if k[0] == name]:
                del self._gauges[k]
            self.caps.series.pop(name, None)
            for values, v in series.items():
                self._gauges[self.caps.key(name, tuple(str(x) for x in values))] = float(v)

    def event(self, kind: str, **fields) -> None:
        """A discrete event for the dashboard and annotations (publish, rollback, reject, spawn...)."""
        if not self.enabled:
            return
        with self._lock:
            self._seq += 1
            self._events.append({"seq": self._seq, "t": time.time(), "kind": kind, **fields})

    # -- reading -----------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Cumulative since this process started (plain data: it travels through Ray)."""
        with self._lock:
            self._snapshots += 1
            return {
                "source": self.source, "replica": self.replica, "epoch": self.epoch, "n": self._snapshots,
                "t": time.time(),
                "counters": dict(self._counters), "hists": {k: list(v) for k, v in self._hists.items()},
                "gauges": dict(self._gauges), "events": list(self._events),
            }
