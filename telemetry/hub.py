"""The one place where the replicas' counts are added up: Prometheus exposition, the dashboard's
time series and ``/v1/stats``.

Each replica's :class:`telemetry.Meter` is cumulative since its process started; the hub keeps
the last snapshot it merged from every (replica, epoch) and adds only the difference. So

  - a replica that restarts comes back under a new epoch and is counted from zero: what the hub
    already merged stays, nothing is counted twice;
  - what a replica counted after the hub's last pull and before it died is lost (at most
    ``sample_s``; the hub also pulls before answering a scrape);
  - a hub that restarts reads every live replica's cumulative counts again: the totals it exports
    restart from those (Prometheus sees a counter reset, which ``rate()`` handles).

Gauges are summed over the replicas that answered the latest pull.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from config import MetricsConfig

from .catalog import CATALOG, OTHER
from .meter import Key, LabelCaps

#: forget the last snapshot of a replica epoch not seen for this long (bounds memory over restarts)
FORGET_EPOCH_S = 3600.0
#: the dashboard's acceptance and rates: over the trailing window (seconds)
WINDOW_S = 30.0
_PER_DOMAIN = frozenset({"osd_spec_decode_num_steps_total", "osd_spec_decode_emitted_tokens_total",
                         "osd_spec_decode_step_cost_total", "osd_spec_decode_proposer_draft_tokens_total", "osd_spec_decode_proposer_accepted_tokens_total"})
#: the acceptance chart's line for every domain past the busiest ``MetricsConfig.chart_domains`` (and
#: the domains past the label cap, ``other``)
OTHER_DOMAINS = "(other domains)"


def _diff(cur: float, prev: float) -> float:
    return cur - prev if cur >= prev else cur  # a decrease within an epoch: treat as a reset


def quantile(q: float, buckets: tuple[float, ...], counts: list[float]) -> float | None:
    """``histogram_quantile`` on non-cumulative bucket counts (last: +Inf), linear inside a bucket."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for i, c in enumerate(counts):
        if seen + c >= rank and c > 0:
            if i >= len(buckets):  # +Inf: the highest finite bound, as Prometheus does
                return buckets[-1]
            lo = buckets[i - 1] if i > 0 else 0.0
            return lo + (buckets[i] - lo) * (rank - seen) / c
        seen += c
    return buckets[-1]


def json_safe(obj):
    """``obj`` with every NaN or infinite float replaced by None (JSON has no NaN: a learner round
    on bad data must not break ``/v1/stats``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


class Hub:
    def __init__(self, cfg: MetricsConfig | None = None):
        self.cfg = cfg or MetricsConfig()
        self.caps = LabelCaps(self.cfg)
        self.counters: dict[Key, float] = {}
        self.hists: dict[Key, list[float]] = {}
        self.gauges: dict[str, dict[Key, float]] = {}  # replica -> its latest gauges
        self.sources: dict[str, str] = {}  # replica -> its deployment
        self.last: dict[tuple[str, str], dict] = {}  # (replica, epoch) -> last merged snapshot
        self.seen_at: dict[tuple[str, str], float] = {}
        self.events: deque[dict] = deque(maxlen=self.cfg.events)
        self.points: deque[dict] = deque(maxlen=self.cfg.history)
        self.versions: dict[str, list[int]] = {}  # draft -> newest versions kept as label values
        self.started = time.time()
        self.lock = threading.RLock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- merging -----------------------------------------------------------------------------------
    def merge(self, snap: dict) -> None:
        """Add what one replica counted since its previous snapshot."""
        with self.lock:
            rid = (snap["replica"], snap["epoch"])
            prev = self.last.get(rid, {"counters": {}, "hists": {}, "events": [], "n": 0})
            if snap["n"] <= prev["n"]:
                return  # already merged (or older than what was)
            last_seq = max((e["seq"] for e in prev["events"]), default=0)
            for k, v in snap["counters"].items():
                d = _diff(v, prev["counters"].get(k, 0.0))
                if d or k not in prev["counters"]:  # a new series is exported even at 0
                    key = self._key(k)
                    self.counters[key] = self.counters.get(key, 0.0) + d
            for k, h in snap["hists"].items():
                p = prev["hists"].get(k)
                d = h if p is None or len(p) != len(h) or any(a < b for a, b in zip(h, p)) else [a - b for a, b in zip(h, p)]
                if any(d) or p is None:
                    key = self._key(k)
                    acc = self.hists.setdefault(key, [0.0] * len(h))
                    for i, x in enumerate(d):
                        acc[i] += x
            self.gauges[snap["replica"]] = {self._key(k): v for k, v in snap["gauges"].items()}
            for e in snap["events"]:
                if e["seq"] > last_seq or rid not in self.last:
                    self.events.append({k: v for k, v in e.items() if k != "seq"} | {"source": snap["source"]})
            self.last[rid] = {"counters": snap["counters"], "hists": snap["hists"], "events": snap["events"][-1:],
                              "n": snap["n"]}
            self.sources[snap["replica"]] = snap["source"]
            self.seen_at[rid] = time.time()

    def replicas_of(self, source: str) -> set[str]:
        with self.lock:
            return {r for r, src in self.sources.items() if src == source}

    def retain(self, live: set[str], source_replicas: set[str] | None = None) -> None:
        """After a pull: drop the gauges of replicas that did not answer (of the pulled sources,
        ``source_replicas``), and snapshots of epochs unseen for an hour."""
        with self.lock:
            for r in list(self.gauges):
                if r not in live and (source_replicas is None or r in source_replicas):
                    del self.gauges[r]
                    self.sources.pop(r, None)
            now = time.time()
            for rid, t in list(self.seen_at.items()):
                if now - t > FORGET_EPOCH_S:
                    self.seen_at.pop(rid)
                    self.last.pop(rid, None)

    def _key(self, k: Key) -> Key:
        name, values = k
        fam = CATALOG[name]
        if name == "osd_domain_info":  # replaced whole at every pull, bounded by the router's clusters: no caps
            return name, tuple(values)
        if "draft_version" in fam.labels:
            values = self._version_label(fam.labels, values)
        return self.caps.key(name, tuple(values))

    def _version_label(self, labels: tuple[str, ...], values: tuple[str, ...]) -> tuple[str, ...]:
        """Keep the newest ``keep_versions`` of each draft as label values; older ones read ``old``
        (their series are dropped from the export when they fall out)."""
        d, v = labels.index("draft"), labels.index("draft_version")
        draft, ver = values[d], values[v]
        if not ver.isdigit():
            return values
        kept = self.versions.setdefault(draft, [])
        n = int(ver)
        if n not in kept:
            if len(kept) >= self.cfg.keep_versions and n < min(kept):
                return values[:v] + ("old",) + values[v + 1:]
            kept.append(n)
            kept.sort()
            while len(kept) > self.cfg.keep_versions:
                self._fold_version(draft, str(kept.pop(0)))
        return values

    def _fold_version(self, draft: str, ver: str) -> None:
        """Move a retired version's counts to ``old`` (the retired series stops; ``old`` jumps)."""
        for name, values in list(self.counters):
            fam = CATALOG[name]
            if "draft_version" not in fam.labels:
                continue
            d, v = fam.labels.index("draft"), fam.labels.index("draft_version")
            if values[d] == draft and values[v] == ver:
                old = values[:v] + ("old",) + values[v + 1:]
                self.counters[(name, old)] = self.counters.get((name, old), 0.0) + self.counters.pop((name, values))

    # -- Prometheus --------------------------------------------------------------------------------
    def collect(self):
        """The prometheus_client Collector protocol: every family of the catalogue."""
        with self.lock:
            counters, hists = dict(self.counters), {k: list(v) for k, v in self.hists.items()}
            gauges: dict[Key, float] = {}
            for g in self.gauges.values():
                for k, v in g.items():
                    gauges[k] = gauges.get(k, 0.0) + v
        for fam in CATALOG.values():
            if fam.kind == "counter":
                m = CounterMetricFamily(fam.name.removesuffix("_total"), fam.help, labels=fam.labels)
                for (name, values), v in sorted(counters.items()):
                    if name == fam.name:
                        m.add_metric(values, v)
            elif fam.kind == "gauge":
                m = GaugeMetricFamily(fam.name, fam.help, labels=fam.labels)
                series = {values: v for (name, values), v in gauges.items() if name == fam.name}
                if not fam.labels and not series:
                    series = {(): 0.0}
                for values, v in sorted(series.items()):
                    m.add_metric(values, v)
            else:
                m = HistogramMetricFamily(fam.name, fam.help, labels=fam.labels)
                for (name, values), h in sorted(hists.items()):
                    if name != fam.name:
                        continue
                    cum, acc = [], 0.0
                    for bound, c in zip([*fam.buckets, math.inf], h[:-1]):
                        acc += c
                        cum.append(("+Inf" if bound == math.inf else repr(float(bound)), acc))
                    m.add_metric(values, cum, h[-1])
            yield m

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # -- dashboard time series ---------------------------------------------------------------------
    def sample(self, now: float | None = None) -> dict:
        """Append one point to the dashboard's series."""
        with self.lock:
            point = self._point(now)
            self.points.append(point)
            return point

    def _point(self, now: float | None = None) -> dict:
        """Cumulative figures per tenant and domain, now."""
        with self.lock:
            point = {"t": now or time.time(), "spec": {}, "req": {}, "lat": {}, "ttft": {}}
            for (name, values), v in self.counters.items():
                if name in ("osd_spec_decode_num_draft_tokens_total", "osd_spec_decode_num_accepted_tokens_total"):
                    tenant, domain = values[0], values[1]
                    slot = point["spec"].setdefault(tenant, {}).setdefault(domain, [0.0, 0.0])
                    slot[name == "osd_spec_decode_num_accepted_tokens_total"] += v
                elif name in ("osd_requests_total", "osd_generation_tokens_total"):
                    tenant, status = values
                    slot = point["req"].setdefault(tenant, [0.0, 0.0, 0.0])  # requests, errors, output tokens
                    if name == "osd_requests_total":
                        slot[0] += v
                        slot[1] += v if status != "200" else 0.0
                    else:
                        slot[2] += v
            for (name, values), h in self.hists.items():
                if name == "osd_e2e_request_latency_seconds":
                    point["lat"][values[0]] = list(h[:-1])
                elif name == "osd_time_to_first_token_seconds":
                    point["ttft"][values[0]] = list(h[:-1])
            return point

    def stats(self, tenant: str | None = None, admin: bool = True) -> dict:
        """The dashboard's data: totals, per-domain acceptance (overall and over time), request and
        token rates, latency quantiles; with ``admin``, also drafts, events and the learner.
        ``tenant``: only that tenant's requests and acceptance."""
        with self.lock:
            points = list(self.points)
            current = self._point()
            counters = dict(self.counters)
            gauges: dict[Key, float] = {}
            for g in self.gauges.values():
                for k, v in g.items():
                    gauges[k] = gauges.get(k, 0.0) + v
            events = list(self.events)

        def mine(t: str) -> bool:
            return tenant is None or t == tenant

        def spec(p: dict) -> dict[str, list[float]]:
            out: dict[str, list[float]] = {}
            for t, doms in p["spec"].items():
                if mine(t):
                    for d, (drafted, accepted) in doms.items():
                        s = out.setdefault(d, [0.0, 0.0])
                        s[0] += drafted
                        s[1] += accepted
            return out

        def req(p: dict) -> list[float]:
            return [sum(v[i] for t, v in p["req"].items() if mine(t)) for i in range(3)]

        def hist(p: dict, field: str) -> list[float]:
            rows = [v for t, v in p[field].items() if mine(t)]
            return [sum(col) for col in zip(*rows)] if rows else []

        lag = max(1, round(WINDOW_S / self.cfg.sample_s))
        lag_acc = max(1, round(self.cfg.acceptance_window_s / self.cfg.sample_s))
        series = {"t": [], "acceptance": {}, "drafted": {}, "requests_per_s": [], "tokens_per_s": [], "errors_per_s": [],
                  "latency_p50_s": [], "latency_p95_s": [], "ttft_p50_s": []}
        domains = sorted({d for p in points for d in spec(p)})
        # the chart's lines: the busiest domains by draft tokens, the others added up as one
        busy = spec(current)
        # (the label caps' "other" is never a line of its own: it joins the rest)
        top = sorted((d for d in domains if d != OTHER), key=lambda d: (-busy.get(d, [0.0])[0], d))[: self.cfg.chart_domains]
        lines = {d: [d] for d in sorted(top)}
        if len(domains) > len(top):
            lines[OTHER_DOMAINS] = [d for d in domains if d not in lines]
        for d in lines:
            series["acceptance"][d], series["drafted"][d] = [], []
        buckets = CATALOG["osd_e2e_request_latency_seconds"].buckets
        for i, p in enumerate(points):
            base = points[max(0, i - lag)]
            dt = p["t"] - base["t"]
            series["t"].append(round(p["t"], 3))
            now_s, then_s = spec(p), spec(points[max(0, i - lag_acc)])
            for d, members in lines.items():
                drafted = sum(now_s.get(m, [0.0, 0.0])[0] - then_s.get(m, [0.0, 0.0])[0] for m in members)
                accepted = sum(now_s.get(m, [0.0, 0.0])[1] - then_s.get(m, [0.0, 0.0])[1] for m in members)
                series["acceptance"][d].append(round(accepted / drafted, 4) if drafted > 0 else None)
                series["drafted"][d].append(drafted)  # what each point stands on
            r, rb = req(p), req(base)
            for j, name in enumerate(("requests_per_s", "errors_per_s", "tokens_per_s")):
                series[name].append(round((r[j] - rb[j]) / dt, 4) if dt > 0 else None)
            for field, out, q in (("lat", "latency_p50_s", 0.5), ("lat", "latency_p95_s", 0.95), ("ttft", "ttft_p50_s", 0.5)):
                h, hb = hist(p, field), hist(base, field)
                if hb and len(hb) == len(h):
                    h = [x - y for x, y in zip(h, hb)]
                series[out].append(quantile(q, buckets, h) if h and i > 0 else None)

        names = {values[0]: values[1] for (n, values) in gauges if n == "osd_domain_info"}
        acceptance = {d: {"drafted": v[0], "accepted": v[1], "alpha": v[1] / v[0] if v[0] else None,
                          "name": names.get(d)}
                      for d, v in sorted(spec(current).items())}
        requests, errors, tokens = req(current)
        per_domain = self._per_domain(counters, mine)
        out = {
            "t": time.time(), "scope": tenant or "all", "sample_s": self.cfg.sample_s, "window_s": WINDOW_S,
            "acceptance_window_s": self.cfg.acceptance_window_s,
            "totals": {"requests": requests, "errors": errors, "generation_tokens": tokens},
            "acceptance": acceptance, "series": series,
            # readable names of the domains in this scope (a tenant sees its own domains' only)
            "domain_names": {d: names[d] for d in sorted(set(domains) | set(acceptance) | set(per_domain)) if d in names},
            # per domain: output tokens per target step and what each proposer drafted and got accepted
            "domains": per_domain,
        }
        if admin:
            out["running"] = {"ingress": gauges.get(("osd_requests_running", ()), 0.0),
                              "draft_pool": gauges.get(("osd_draft_pool_requests_running", ()), 0.0),
                              "target_queue": gauges.get(("osd_target_queue_depth", ()), 0.0),
                              "kv_caches": gauges.get(("osd_target_kv_caches", ()), 0.0)}
            out["drafts"] = {values[0]: {"version": int(v)} for (name, values), v in sorted(gauges.items())
                             if name == "osd_draft_version"}
            out["learner"] = self._learner(counters, gauges)
            out["events"] = events[-100:]
        return json_safe(out)

    @staticmethod
    def _per_domain(counters: dict[Key, float], mine) -> dict:
        """domain -> {steps, emitted, tokens_per_step, cost, speedup, proposers: {name: {drafted,
        accepted, share}}} (``share``: of the domain's draft tokens; ``speedup``: output tokens over
        the steps' cost in target-only steps, the estimated speed-up over target-only decoding),
        for the tenants ``mine`` keeps."""
        out: dict[str, dict] = {}

        def slot(domain: str) -> dict:
            return out.setdefault(domain, {"steps": 0.0, "emitted": 0.0, "cost": 0.0, "proposers": {}})

        for (name, values), v in counters.items():
            if name not in _PER_DOMAIN or not mine(values[0]):  # each of them is labelled by tenant first
                continue
            if name == "osd_spec_decode_num_steps_total":
                slot(values[1])["steps"] += v
            elif name == "osd_spec_decode_emitted_tokens_total":
                slot(values[1])["emitted"] += v
            elif name == "osd_spec_decode_step_cost_total":
                slot(values[1])["cost"] += v
            elif name in ("osd_spec_decode_proposer_draft_tokens_total", "osd_spec_decode_proposer_accepted_tokens_total"):
                p = slot(values[1])["proposers"].setdefault(values[2], {"drafted": 0.0, "accepted": 0.0})
                p["drafted" if name == "osd_spec_decode_proposer_draft_tokens_total" else "accepted"] += v
        for d in out.values():
            d["tokens_per_step"] = d["emitted"] / d["steps"] if d["steps"] else None
            d["speedup"] = d["emitted"] / d["cost"] if d["cost"] else None
            drafted = sum(p["drafted"] for p in d["proposers"].values())
            for p in d["proposers"].values():
                p["share"] = p["drafted"] / drafted if drafted else None
                p["alpha"] = p["accepted"] / p["drafted"] if p["drafted"] else None
        return dict(sorted(out.items()))

    @staticmethod
    def _learner(counters: dict[Key, float], gauges: dict[Key, float]) -> dict:
        def total(name: str, **where) -> float:
            fam = CATALOG[name]
            return sum(v for (n, values), v in counters.items() if n == name
                       and all(values[fam.labels.index(k)] == w for k, w in where.items()))

        steps = total("osd_learner_steps_total")
        return {
            "records": total("osd_learner_records_total"),
            "published": total("osd_learner_rounds_total", result="published"),
            "rejected": total("osd_learner_rounds_total", result="rejected"),
            "rounds": total("osd_learner_rounds_total"),
            "steps": steps,
            "cut_rounds": total("osd_learner_rounds_cut_total"),
            "step_seconds": total("osd_learner_train_seconds_total") / steps if steps else None,
            "against_traffic_s": total("osd_learner_against_traffic_seconds_total"),
            "paused": bool(gauges.get(("osd_learner_paused", ()), 0.0)),
            "loss": {values[0]: v for (n, values), v in gauges.items() if n == "osd_learner_loss"},
        }


__all__ = ["Hub", "quantile", "json_safe", "OTHER", "OTHER_DOMAINS"]
