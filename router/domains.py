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
told are open-ended (``RouterConfig.classifier.open_domains``); see ``docs/routing.md`` for the measurements
behind that choice.

Two more things make the classifier hold up on sources it was not trained on (both measured by
``osd route --open``, docs/routing.md):

* **lexical features** (``lexical``): beside the embedding of the first word pieces, a TF-IDF of
  the character n-grams (2-4, within words) of the whole text. Code, SQL and math are written in
  their own symbols, often past the embedding's window (a task statement before the code, a story
  before the sum), and a new format of a domain keeps them.
* **a background class** (``BACKGROUND``): examples of general traffic (requests of every kind,
  ShareGPT's first turns) labelled as "none of the named domains", so that the logistic
  regression has somewhere to put a query that is not one of them, instead of extrapolating to
  the nearest label (outlier exposure). General traffic also holds code, SQL and math requests:
  examples a classifier trained on the named domains alone gives to one of the ``topical``
  labels with probability >= ``background_filter`` are dropped first, so that the background
  does not take those domains' new sources.

With lexical features the classifier also fits a second logistic regression on the n-grams
alone (``lexical_model``, same examples and labels). ``sure`` names the queries it gives to one
of a set of labels with a high probability: the router sends those on without embedding them
(``RouterConfig.classifier.lexical_gate``), which saves the embedding, nine tenths of a query's time.

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

import json
import math
import os
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np
from scipy import sparse
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from config import RouterConfig

_CENTROID_MEMORY = 100  # a centroid is the mean of its first 100 members, then an EMA with rate 1/100
#: the classifier's label for examples of general traffic: a query given it is none of the named domains
BACKGROUND = "~general"


class DomainClassifier:
    """Domain label + probability from an embedding (and the text), and the label's typicality."""

    def __init__(self, C: float = 10.0, seed: int = 0, typical_k: int = 1, typical_quantile: float = 0.1,
                 folds: int = 5, lexical: bool = False, background_filter: float = 0.5,
                 max_lexical_features: int = 20_000, background_relabel: float | None = None):
        self.C, self.seed = C, seed
        self.background_relabel = background_relabel
        self.typical_k, self.typical_quantile, self.folds = typical_k, typical_quantile, folds
        self.lexical, self.background_filter, self.max_lexical_features = lexical, background_filter, max_lexical_features
        self.model: LogisticRegression | None = None
        self.vectorizer: TfidfVectorizer | None = None  # fitted when lexical and texts were given
        self.lexical_model: LogisticRegression | None = None  # on the n-grams alone, beside the vectorizer
        self.examples: dict[str, np.ndarray] = {}  # named label -> [n_label, d] training embeddings
        self.thresholds: dict[str, float] = {}  # named label -> typicality threshold (held-out quantile)
        self.background_dropped = 0  # background examples dropped at fit as topical

    @property
    def fitted(self) -> bool:
        return self.model is not None

    @property
    def classes(self) -> list[str]:
        """The named labels (the background is not a domain)."""
        return [] if self.model is None else [str(c) for c in self.model.classes_ if c != BACKGROUND]

    def _logreg(self) -> LogisticRegression:
        return LogisticRegression(C=self.C, max_iter=2000, class_weight="balanced", random_state=self.seed)

    @staticmethod
    def _check_texts(X: np.ndarray, texts: Sequence[str] | None) -> None:
        if texts is None or len(texts) != len(X):
            raise ValueError("this classifier reads the texts too (lexical): pass one text per embedding")

    def _features(self, X: np.ndarray, texts: Sequence[str] | None):
        """[n, d] embeddings, with the TF-IDF of ``texts`` beside them when fitted lexical."""
        if self.vectorizer is None:
            return X
        self._check_texts(X, texts)
        return sparse.hstack([sparse.csr_matrix(X), self.vectorizer.transform(texts)]).tocsr()

    def _proba(self, X: np.ndarray, texts: Sequence[str] | None) -> np.ndarray:
        """``model.predict_proba`` of the features, [n, n_classes]. With lexical features the
        logits are summed from the two blocks of weights (the embedding's dense, the n-grams'
        sparse) rather than by stacking a sparse matrix per query: the same numbers, in a third
        of the time on one query."""
        if self.vectorizer is None:
            return self.model.predict_proba(X)
        self._check_texts(X, texts)
        d, W = X.shape[1], self.model.coef_  # [n_classes or 1, d + vocabulary]
        z = X @ W[:, :d].T + np.asarray(self.vectorizer.transform(texts) @ W[:, d:].T) + self.model.intercept_
        if W.shape[0] == 1:  # two classes: one logit, for classes_[1]
            p = 1.0 / (1.0 + np.exp(-z))
            return np.hstack([1.0 - p, p])
        z = np.exp(z - z.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)

    def fit(self, X: np.ndarray, labels: Sequence[str], texts: Sequence[str] | None = None,
            topical: Sequence[str] = ()) -> "DomainClassifier":
        """X: [n, d] embeddings; labels: [n] domain names (at least two distinct), ``BACKGROUND`` for
        examples of general traffic; texts: [n] (used when ``lexical``). Background examples that an
        embedding classifier of the named examples alone gives to a ``topical`` label with
        probability >= ``background_filter`` are dropped (those given it with probability >=
        ``background_relabel``, when set, become examples of that label instead)."""
        X, y = np.asarray(X, dtype=np.float32), np.asarray(labels)
        named = y != BACKGROUND
        if len(set(y[named])) < 2:
            raise ValueError(f"a classifier needs at least two domains, got {sorted(set(y[named]))}")
        keep = np.ones(len(y), bool)
        self.background_dropped = 0
        if (~named).any() and topical:
            first = self._logreg().fit(X[named], y[named])
            proba = first.predict_proba(X[~named])  # [n_background, n_named]
            best = first.classes_[proba.argmax(axis=1)]
            drop = np.isin(best, list(topical)) & (proba.max(axis=1) >= self.background_filter)
            relabel = drop & (proba.max(axis=1) >= (self.background_relabel or np.inf))  # None: none
            y = y.copy()
            y[np.flatnonzero(~named)[relabel]] = best[relabel]
            keep[np.flatnonzero(~named)[drop & ~relabel]] = False
            self.background_dropped = int(drop.sum())
        X, y = X[keep], y[keep]
        self.vectorizer = None
        if self.lexical and texts is not None:
            texts = [t for t, k in zip(texts, keep) if k]
            self.vectorizer = self._vectorizer()
            try:
                self.vectorizer.fit(texts)
            except ValueError:  # no n-gram in two examples (a handful of tiny texts): embeddings only
                self.vectorizer = None
        self.model = self._logreg().fit(self._features(X, texts), y)
        self.lexical_model = None if self.vectorizer is None else self._logreg().fit(self.vectorizer.transform(texts), y)
        self.examples = {str(c): X[y == c] for c in self.model.classes_ if c != BACKGROUND}
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

    def nearest_typical(self, X: np.ndarray) -> list[str | None]:
        """For each embedding X [n, d], the named label it is most typical of, where it is typical
        of one (its typicality at or above the label's calibrated threshold, as a routed query must
        be), else None: what a discovered domain is close to."""
        X = np.asarray(X, dtype=np.float32)
        if not self.examples or not len(X):
            return [None] * len(X)
        labels = sorted(self.examples)
        scores = np.stack([self._knn(self.examples[c], X) for c in labels], axis=1)  # [n, labels]
        margin = scores - np.array([self.thresholds.get(c, -1.0) for c in labels])  # [n, labels]
        best = margin.argmax(axis=1)
        return [labels[j] if margin[i, j] >= 0 else None for i, j in enumerate(best)]

    def predict(self, X: np.ndarray, texts: Sequence[str] | None = None) -> tuple[list[str], np.ndarray]:
        """Labels [n] (``BACKGROUND`` among them, if it was trained) and their probabilities [n] for
        embeddings X [n, d] and their texts (needed when fitted lexical)."""
        return self.classify(X, texts)[:2]

    def classify(self, X: np.ndarray, texts: Sequence[str] | None = None) -> tuple[list[str], np.ndarray, list[str]]:
        """``predict``'s labels and probabilities, and the most probable *named* label of each
        query [n] (the label itself where it is not the background)."""
        if self.model is None:
            raise RuntimeError("DomainClassifier.predict before fit")
        proba = self._proba(np.asarray(X, dtype=np.float32), texts)  # [n, n_classes]
        classes = [str(c) for c in self.model.classes_]
        best = proba.argmax(axis=1)
        named_proba = proba.copy()
        if BACKGROUND in classes:
            named_proba[:, classes.index(BACKGROUND)] = -1.0
        return ([classes[i] for i in best], proba[np.arange(len(best)), best],
                [classes[i] for i in named_proba.argmax(axis=1)])

    def sure(self, texts: Sequence[str], threshold: float, labels: Sequence[str]) -> tuple[list[str | None], np.ndarray]:
        """For each text [n]: the label of ``labels`` that the n-gram model gives it with
        probability >= ``threshold``, else None; and that model's top probability [n]. All None
        without an n-gram model."""
        if self.lexical_model is None or not len(texts):
            return [None] * len(texts), np.zeros(len(texts))
        proba = self.lexical_model.predict_proba(self.vectorizer.transform(texts))  # [n, n_classes]
        best, top = self.lexical_model.classes_[proba.argmax(axis=1)], proba.max(axis=1)
        wanted = set(labels)
        return [str(b) if p >= threshold and b in wanted else None for b, p in zip(best, top)], top

    # -- state on disk: JSON + npz, no pickle ----------------------------------------------------
    #: the TF-IDF vectorizer's settings (``fit``); a saved vocabulary and IDF are read back into them
    def _vectorizer(self) -> TfidfVectorizer:
        return TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), min_df=2, sublinear_tf=True,
                               max_features=self.max_lexical_features, dtype=np.float32)

    @staticmethod
    def _files(path: str | Path) -> tuple[Path, Path]:
        """The two files of a saved classifier: ``<path>.json`` (settings, labels, vocabulary,
        thresholds) and ``<path>.npz`` (the arrays)."""
        p = Path(path)
        return p.with_suffix(".json"), p.with_suffix(".npz")

    def save(self, path: str | Path) -> None:
        """As ``<path>.json`` + ``<path>.npz``: plain numbers, strings and arrays (no pickle, so
        loading a save runs no code; ``np.load`` with ``allow_pickle=False``). The npz is written
        first, each file renamed into place whole; ``load`` rebuilds the scikit-learn models from
        their fitted arrays (``coef_``, ``intercept_``, ``classes_``; the vectorizer's
        ``vocabulary_`` and ``idf_``)."""
        if self.model is None:
            raise RuntimeError("DomainClassifier.save before fit")
        meta_path, npz_path = self._files(path)
        arrays: dict[str, np.ndarray] = {}
        for name, m in (("model", self.model), ("lexical_model", self.lexical_model)):
            if m is not None:
                arrays[f"{name}.coef"], arrays[f"{name}.intercept"] = m.coef_, m.intercept_
                arrays[f"{name}.classes"] = np.asarray(m.classes_).astype(str)
        labels = list(self.examples)
        for i, label in enumerate(labels):
            arrays[f"examples.{i}"] = self.examples[label]
        if self.vectorizer is not None:
            arrays["vectorizer.idf"] = self.vectorizer.idf_
        meta = {"C": self.C, "seed": self.seed, "typical_k": self.typical_k, "typical_quantile": self.typical_quantile,
                "folds": self.folds, "lexical": self.lexical, "background_filter": self.background_filter,
                "max_lexical_features": self.max_lexical_features, "background_dropped": self.background_dropped,
                "background_relabel": self.background_relabel, "examples": labels,
                "thresholds": {k: float(v) for k, v in self.thresholds.items()},
                "lexical_model": self.lexical_model is not None,
                "vocabulary": None if self.vectorizer is None else {t: int(i) for t, i in self.vectorizer.vocabulary_.items()}}
        tmp = npz_path.with_name(npz_path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, npz_path)
        tmp = meta_path.with_name(meta_path.name + ".tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, meta_path)

    @classmethod
    def load(cls, path: str | Path) -> "DomainClassifier":
        """A classifier ``save`` wrote (``<path>.json`` + ``<path>.npz``); no pickle is read."""
        meta_path, npz_path = cls._files(path)
        meta = json.loads(meta_path.read_text())
        clf = cls(meta["C"], meta["seed"], meta["typical_k"], meta["typical_quantile"], meta["folds"],
                  meta["lexical"], meta["background_filter"], meta["max_lexical_features"], meta["background_relabel"])
        with np.load(npz_path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}

        def logreg(name: str) -> LogisticRegression:
            m = clf._logreg()
            m.coef_, m.intercept_ = arrays[f"{name}.coef"], arrays[f"{name}.intercept"]
            m.classes_ = arrays[f"{name}.classes"]
            m.n_features_in_ = m.coef_.shape[1]
            m.n_iter_ = np.zeros(1, dtype=np.int32)
            return m

        clf.model = logreg("model")
        clf.lexical_model = logreg("lexical_model") if meta["lexical_model"] else None
        clf.examples = {label: arrays[f"examples.{i}"] for i, label in enumerate(meta["examples"])}
        clf.thresholds = {k: float(v) for k, v in meta["thresholds"].items()}
        clf.background_dropped = meta["background_dropped"]
        if meta["vocabulary"] is not None:
            v = clf._vectorizer()
            v.vocabulary_ = dict(meta["vocabulary"])
            v.idf_ = arrays["vectorizer.idf"]
            clf.vectorizer = v
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
    #: word -> how many of its queries hold it (bounded, :data:`_TERMS_KEPT`): what its name is read from
    terms: Counter = field(default_factory=Counter)
    name: str | None = None  # a few characteristic words (:func:`name_clusters`), once it has them

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
                "accepted": self.accepted, "proposed": self.proposed, "draft": self.draft,
                "terms": dict(self.terms), "name": self.name}

    def add_terms(self, text: str) -> None:
        """Count each word of one query once; keep the most frequent when there are too many."""
        self.terms.update(set(_WORD.findall(text.lower())) - _STOP)
        if len(self.terms) > 2 * _TERMS_KEPT:
            self.terms = Counter(dict(self.terms.most_common(_TERMS_KEPT)))


#: words of a query a cluster's name may use: letters (any script) and digits, 3-24 long, starting with a letter
_WORD = re.compile(r"\b[^\W\d_][\w]{2,23}\b")
_STOP = frozenset(ENGLISH_STOP_WORDS) | {"please", "like", "want", "need", "using", "use", "make", "write", "does"}
_TERMS_KEPT = 200


def name_clusters(clusters: Sequence[Cluster], words: int = 3, min_queries: int = 2) -> dict[int, str | None]:
    """A short name for each cluster: its ``words`` most characteristic words by class-based TF-IDF
    (BERTopic's c-TF-IDF: a word's share of the cluster's words, times log(1 + A / f), with A the
    mean number of words a cluster holds and f the word's count over all clusters), in order.
    A word counts only when ``min_queries`` of the cluster's queries hold it, so a name never
    repeats one query; a cluster with no such word has none (None)."""
    counts = [{w: n for w, n in c.terms.items() if n >= min_queries} for c in clusters]
    total: Counter = Counter()
    for terms in counts:
        total.update(terms)
    sizes = [sum(terms.values()) for terms in counts]
    mean = sum(sizes) / max(1, sum(1 for n in sizes if n))
    names = {}
    for c, terms, size in zip(clusters, counts, sizes):
        if not terms:
            names[c.id] = None
            continue
        score = {w: n / size * math.log(1 + mean / total[w]) for w, n in terms.items()}
        names[c.id] = " ".join(sorted(score, key=lambda w: (-score[w], w))[:words])
    return names


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
        self._renamed = True  # no words counted since the names were last read

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

    def assign(self, emb: np.ndarray, lang: str, t: int, now_s: float | None = None,
               text: str | None = None) -> tuple[Cluster, float]:
        """Put ``emb`` [d] (unit norm) into a cluster at router clock ``t``; returns the cluster and
        the similarity to its centroid before the update (0 for a new cluster). ``text``: the
        query, whose words the cluster counts for its name."""
        now_s = time.time() if now_s is None else now_s
        c, sim = self.nearest(emb, lang)
        if c is None or 1.0 - sim > self.cfg.clusters.cluster_threshold:
            if len(self.clusters) >= self.cfg.clusters.max_clusters:
                self._evict_one()
            c = Cluster(self.next_id, lang, emb.astype(np.float32).copy(), born=t,
                        recent=deque(maxlen=self.cfg.drafts.spawn_min_records))
            sim = 0.0
            self.clusters[c.id] = c
            self.next_id += 1
        c.count += 1
        if c.count > 1:
            centroid = c.centroid + (emb - c.centroid) / min(c.count, _CENTROID_MEMORY)
            c.centroid = (centroid / max(np.linalg.norm(centroid), 1e-12)).astype(np.float32)
        c.last_seen, c.last_seen_s = t, now_s
        c.recent.append(t)
        if text:
            c.add_terms(text)
            self._renamed = False
        return c, sim

    def observe(self, cluster_id: int, accepted: int, proposed: int) -> None:
        """Acceptance of a step served for a query of this cluster (ignored if it expired)."""
        c = self.clusters.get(cluster_id)
        if c is not None and proposed > 0:
            c.accepted = c.accepted * self.cfg.bandit.decay + accepted
            c.proposed = c.proposed * self.cfg.bandit.decay + proposed

    def maintain(self, t: int, now_s: float | None = None) -> list[ClusterEvent]:
        """Expire noise and idle clusters; report busy clusters with poor acceptance and no draft."""
        cfg, now_s = self.cfg, time.time() if now_s is None else now_s
        events, self._evicted = self._evicted, []
        for c in list(self.clusters.values()):
            if c.count < cfg.clusters.min_cluster_size and t - c.born >= cfg.clusters.noise_ttl:
                events.append(self._remove(c, "noise"))
            elif t - c.last_seen >= cfg.drafts.idle_retire_records or (
                    cfg.drafts.idle_retire_s is not None and now_s - c.last_seen_s >= cfg.drafts.idle_retire_s):
                events.append(self._remove(c, "idle"))
            elif (c.draft is None and c.count >= cfg.clusters.min_cluster_size and len(c.recent) >= cfg.drafts.spawn_min_records
                  and t - c.recent[0] < cfg.drafts.spawn_window and c.proposed >= cfg.drafts.spawn_min_tokens
                  and c.alpha < cfg.drafts.spawn_alpha):
                events.append(ClusterEvent("spawn", c, f"{len(c.recent)} records in {t - c.recent[0] + 1}, "
                                                      f"alpha {c.alpha:.2f} < {cfg.drafts.spawn_alpha}"))
        return events

    def refresh_names(self, near: Callable[[np.ndarray], list[str | None]] | None = None) -> None:
        """Name every cluster from the words counted so far (:func:`name_clusters`), when some were
        counted since the last time: done where names are read (the operator's views, every few
        seconds at most), not on every routed query, since it scores every cluster's words.
        ``near``: centroids [m, d] -> the named domain each is close to, or None; a close one is
        added to the name (``select table customers (near sql)``)."""
        if self._renamed:
            return
        clusters = list(self.clusters.values())
        close = near(np.stack([c.centroid for c in clusters])) if near is not None and clusters else [None] * len(clusters)
        names = name_clusters(clusters)
        for c, domain in zip(clusters, close):
            name = names[c.id]
            c.name = name if domain is None else f"{name} (near {domain})" if name else f"near {domain}"
        self._renamed = True

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
            recent = deque(m["recent"], maxlen=cfg.drafts.spawn_min_records)
            terms = Counter(m.get("terms", {}))  # saves of older versions have none
            c = Cluster(centroid=np.asarray(centroid, np.float32), **{**m, "recent": recent, "terms": terms})
            self.clusters[c.id] = c
        self._renamed = False  # named again from the loaded words when first read
        return self
