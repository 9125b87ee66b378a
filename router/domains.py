"""Domains: named by a classifier trained on labelled examples, or discovered by online clustering.

``DomainClassifier`` is a multinomial logistic regression over the 384-d embeddings; its top
probability is the confidence the router compares with its threshold. A probability says which
named domain a query is *closest to*, not whether it belongs to any: a logistic regression
extrapolates, and traffic of a domain no label names gets a confident label all the same (mostly
the broadest class, "chat"). So the classifier also keeps its training embeddings and scores a
query's **typicality** for a label: the mean cosine similarity to the label's ``typical_k``
nearest training examples. Each label's threshold is calibrated on held-out examples (``folds``
-fold: an example is scored against the other folds' examples of its label) as the
``typical_quantile`` quantile of those held-out scores: with 0.1, about 10% of unseen in-domain
queries of the training sources are called atypical. The router applies it to the domains it is
told are open-ended (``RouterConfig.open_domains``); see ``docs/routing.md`` for the measurements
behind that choice.

``OnlineClusters`` is leader clustering (online k-means without a fixed k) on unit vectors, with
language as a hard split: a query joins the nearest centroid of its language when the cosine
distance is below ``cluster_threshold`` (the centroid moves towards it), otherwise it starts a new
cluster. A cluster that does not reach ``min_cluster_size`` within ``noise_ttl`` records is noise
and is dropped; a cluster unseen for ``idle_retire_records`` records (or ``idle_retire_s``
seconds) expires. Each cluster counts its recent traffic and the (decayed) acceptance of the
drafts that served it; ``maintain`` reports clusters that are busy at poor acceptance (they
deserve a draft of their own) and clusters that expired (their draft can go).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import joblib
import numpy as np
from sklearn.linear_model import LogisticRegression

from config import RouterConfig

_CENTROID_MEMORY = 100  # a centroid is the mean of its first 100 members, then an EMA with rate 1/100


class DomainClassifier:
    """Domain label + probability from an embedding, and the label's typicality."""

    def __init__(self, C: float = 10.0, seed: int = 0, typical_k: int = 1, typical_quantile: float = 0.1,
                 folds: int = 5):
        self.C, self.seed = C, seed
        self.typical_k, self.typical_quantile, self.folds = typical_k, typical_quantile, folds
        self.model: LogisticRegression | None = None
        self.examples: dict[str, np.ndarray] = {}  # label -> [n_label, d] training embeddings
        self.thresholds: dict[str, float] = {}  # label -> typicality threshold (held-out quantile)

    @property
    def fitted(self) -> bool:
        return self.model is not None

    @property
    def classes(self) -> list[str]:
        return [] if self.model is None else [str(c) for c in self.model.classes_]

    def fit(self, X: np.ndarray, labels: Sequence[str]) -> "DomainClassifier":
        """X: [n, d] embeddings; labels: [n] domain names (at least two distinct)."""
        if len(set(labels)) < 2:
            raise ValueError(f"a classifier needs at least two domains, got {sorted(set(labels))}")
        X, y = np.asarray(X, dtype=np.float32), np.asarray(labels)
        self.model = LogisticRegression(C=self.C, max_iter=2000, class_weight="balanced", random_state=self.seed)
        self.model.fit(X, y)
        self.examples = {str(c): X[y == c] for c in self.model.classes_}
        self.thresholds = {c: self._calibrate(ex) for c, ex in self.examples.items()}
        return self

    def _calibrate(self, ex: np.ndarray) -> float:
        """The ``typical_quantile`` quantile of held-out typicality scores of a label's examples
        [n, d]: each fold scored against the label's other folds. -1 (everything typical) for a
        label with fewer than two examples."""
        n = len(ex)
        if n < 2:
            return -1.0
        order = np.random.default_rng(self.seed).permutation(n)
        scores = []
        for fold in np.array_split(order, min(self.folds, n)):
            rest = np.setdiff1d(order, fold)
            scores.append(self._knn(ex[rest], ex[fold]))
        return float(np.quantile(np.concatenate(scores), self.typical_quantile))

    def _knn(self, examples: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Mean cosine similarity of each row of X [m, d] to its ``typical_k`` nearest rows of
        ``examples`` [n, d] (unit vectors) -> [m]."""
        sims = X @ examples.T  # [m, n]
        k = min(self.typical_k, sims.shape[1])
        return np.partition(sims, sims.shape[1] - k, axis=1)[:, -k:].mean(axis=1)

    def typicality(self, X: np.ndarray, labels: Sequence[str]) -> np.ndarray:
        """Typicality of each embedding X [n, d] for its label -> [n]."""
        X = np.asarray(X, dtype=np.float32)
        out = np.empty(len(X), dtype=np.float32)
        for c in set(labels):
            rows = [i for i, lb in enumerate(labels) if lb == c]
            out[rows] = self._knn(self.examples[c], X[rows])
        return out

    def typical(self, label: str, score: float) -> bool:
        return score >= self.thresholds.get(label, -1.0)

    def predict(self, X: np.ndarray) -> tuple[list[str], np.ndarray]:
        """Labels [n] and their probabilities [n] for embeddings X [n, d]."""
        if self.model is None:
            raise RuntimeError("DomainClassifier.predict before fit")
        proba = self.model.predict_proba(np.asarray(X, dtype=np.float32))  # [n, n_classes]
        best = proba.argmax(axis=1)
        return [str(self.model.classes_[i]) for i in best], proba[np.arange(len(best)), best]

    def save(self, path: str | Path) -> None:
        joblib.dump({"C": self.C, "seed": self.seed, "model": self.model, "typical_k": self.typical_k,
                     "typical_quantile": self.typical_quantile, "folds": self.folds,
                     "examples": self.examples, "thresholds": self.thresholds}, path)

    @classmethod
    def load(cls, path: str | Path) -> "DomainClassifier":
        state = joblib.load(path)
        clf = cls(state["C"], state["seed"], state["typical_k"], state["typical_quantile"], state["folds"])
        clf.model, clf.examples, clf.thresholds = state["model"], state["examples"], state["thresholds"]
        return clf


@dataclass
class Cluster:
    id: int
    lang: str
    centroid: np.ndarray  # [384] unit norm
    born: int  # router clock (records) at creation
    count: int = 0
    last_seen: int = 0
    last_seen_s: float = 0.0
    recent: deque = field(default_factory=deque)  # clocks of the latest members (maxlen spawn_min_records)
    accepted: float = 0.0  # decayed accepted / proposed tokens of the drafts that served it
    proposed: float = 0.0
    draft: str | None = None  # its own draft, once spawned

    @property
    def key(self) -> str:
        """The routing domain of this cluster."""
        return f"c{self.id}/{self.lang}"

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.proposed if self.proposed > 0 else None

    def meta(self) -> dict:
        return {"id": self.id, "lang": self.lang, "born": self.born, "count": self.count,
                "last_seen": self.last_seen, "last_seen_s": self.last_seen_s, "recent": list(self.recent),
                "accepted": self.accepted, "proposed": self.proposed, "draft": self.draft}


@dataclass(frozen=True)
class ClusterEvent:
    kind: Literal["spawn", "expire"]  # spawn: deserves a draft; expire: removed (noise, idle, evicted)
    cluster: Cluster
    reason: str


class OnlineClusters:
    """Leader clustering of unit embeddings, one set of clusters per language."""

    def __init__(self, cfg: RouterConfig = RouterConfig()):
        self.cfg = cfg
        self.clusters: dict[int, Cluster] = {}
        self.next_id = 0
        self._evicted: list[ClusterEvent] = []

    def __len__(self) -> int:
        return len(self.clusters)

    def nearest(self, emb: np.ndarray, lang: str) -> tuple[Cluster | None, float]:
        """The closest cluster of language ``lang`` to ``emb`` [d] and its cosine similarity."""
        same = [c for c in self.clusters.values() if c.lang == lang]
        if not same:
            return None, -1.0
        sims = np.stack([c.centroid for c in same]) @ emb  # [m]
        i = int(sims.argmax())
        return same[i], float(sims[i])

    def assign(self, emb: np.ndarray, lang: str, t: int, now_s: float | None = None) -> tuple[Cluster, float]:
        """Put ``emb`` [d] (unit norm) into a cluster at router clock ``t``; returns the cluster and
        the similarity to its centroid before the update (0 for a new cluster)."""
        now_s = time.time() if now_s is None else now_s
        c, sim = self.nearest(emb, lang)
        if c is None or 1.0 - sim > self.cfg.cluster_threshold:
            if len(self.clusters) >= self.cfg.max_clusters:
                self._evict_one()
            c = Cluster(self.next_id, lang, emb.astype(np.float32).copy(), born=t,
                        recent=deque(maxlen=self.cfg.spawn_min_records))
            sim = 0.0
            self.clusters[c.id] = c
            self.next_id += 1
        c.count += 1
        if c.count > 1:
            centroid = c.centroid + (emb - c.centroid) / min(c.count, _CENTROID_MEMORY)
            c.centroid = (centroid / max(np.linalg.norm(centroid), 1e-12)).astype(np.float32)
        c.last_seen, c.last_seen_s = t, now_s
        c.recent.append(t)
        return c, sim

    def observe(self, cluster_id: int, accepted: int, proposed: int) -> None:
        """Acceptance of a step served for a query of this cluster (ignored if it expired)."""
        c = self.clusters.get(cluster_id)
        if c is not None and proposed > 0:
            c.accepted = c.accepted * self.cfg.decay + accepted
            c.proposed = c.proposed * self.cfg.decay + proposed

    def maintain(self, t: int, now_s: float | None = None) -> list[ClusterEvent]:
        """Expire noise and idle clusters; report busy clusters with poor acceptance and no draft."""
        cfg, now_s = self.cfg, time.time() if now_s is None else now_s
        events, self._evicted = self._evicted, []
        for c in list(self.clusters.values()):
            if c.count < cfg.min_cluster_size and t - c.born >= cfg.noise_ttl:
                events.append(self._remove(c, "noise"))
            elif t - c.last_seen >= cfg.idle_retire_records or (
                    cfg.idle_retire_s is not None and now_s - c.last_seen_s >= cfg.idle_retire_s):
                events.append(self._remove(c, "idle"))
            elif (c.draft is None and c.count >= cfg.min_cluster_size and len(c.recent) >= cfg.spawn_min_records
                  and t - c.recent[0] < cfg.spawn_window and c.proposed >= cfg.spawn_min_tokens
                  and c.alpha < cfg.spawn_alpha):
                events.append(ClusterEvent("spawn", c, f"{len(c.recent)} records in {t - c.recent[0] + 1}, "
                                                      f"alpha {c.alpha:.2f} < {cfg.spawn_alpha}"))
        return events

    def _remove(self, c: Cluster, reason: str) -> ClusterEvent:
        del self.clusters[c.id]
        return ClusterEvent("expire", c, reason)

    def _evict_one(self) -> None:
        """Make room: drop the longest-unseen cluster, preferring those without a draft."""
        victim = min(self.clusters.values(), key=lambda c: (c.draft is not None, c.last_seen))
        self._evicted.append(self._remove(victim, "evicted (max_clusters)"))

    # ------------------------------------------------------------------ state

    def state(self) -> tuple[dict, np.ndarray]:
        """JSON-able metadata and the centroids [m, d] in the same order."""
        cs = list(self.clusters.values())
        centroids = np.stack([c.centroid for c in cs]) if cs else np.zeros((0, 0), np.float32)
        return {"next_id": self.next_id, "clusters": [c.meta() for c in cs]}, centroids

    @classmethod
    def from_state(cls, cfg: RouterConfig, meta: dict, centroids: np.ndarray) -> "OnlineClusters":
        self = cls(cfg)
        self.next_id = int(meta["next_id"])
        for m, centroid in zip(meta["clusters"], centroids):
            recent = deque(m["recent"], maxlen=cfg.spawn_min_records)
            c = Cluster(centroid=np.asarray(centroid, np.float32), **{**m, "recent": recent})
            self.clusters[c.id] = c
        return self
