"""The router: query -> (domain, language, draft), and the drafts' life cycle.

One ``route`` reads top to bottom:

1. **features**: MiniLM embedding + language (``FeatureExtractor``), and the cleaned text, whose
   character n-grams the classifier reads beside the embedding. A query whose n-grams alone name a
   topical domain with probability >= ``lexical_gate`` is not embedded: it goes to that domain
   (reason ``classifier: n-grams``), letters or not (``$54-30=$`` is math); any other text without
   letters (empty, emoji, digits) goes to the general draft.
2. **domain**: the classifier's label when it is confident, is not the background class of
   general traffic (``BACKGROUND``) and, for an open-ended domain
   (``open_domains``), the query is typical of the label's examples (``supervised`` / ``both``);
   else the query's online cluster (``clusters`` / ``both``); in ``supervised`` mode an unsure
   label falls back to the general draft. Named domains listed in ``lang_split_domains`` are split by
   language ("chat/fr"), since each language is its own mode; clusters are split by language
   anyway ("c3/fr").
3. **draft**: among the general draft, the drafts bound to that domain and the unbound drafts,
   the ``AcceptanceBandit`` picks the best observed acceptance (Thompson sampling, a little
   exploration); a domain seen for the first time gets its own draft if it has one, else the
   general draft. A named domain gets a draft of its own the first time it is named
   (``named_drafts``: a ``spawn`` event, ``d-<domain>``). A query sent to a cluster keeps the
   draft of the named domain the classifier found likeliest among its candidates (the label
   itself, or, for a query labelled general traffic, the likeliest named label): a discovered
   domain starts from the best named draft.

``observe(route, accepted, proposed)`` feeds the engine's step results back. ``maintenance``
(run after every routed query) expires noise and idle clusters and gives a draft to a busy
cluster with poor acceptance, within ``max_drafts`` (the least used draft makes room); the
serving side collects the resulting ``DraftEvent``s with ``events()``: ``spawn`` (fork
``draft_id`` from ``parent``) and ``retire`` (unload ``draft_id``).

A router is plain single-threaded state: one per process (or Ray replica), calls serialised.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from config import RouterConfig
from config.draft_ids import GENERAL, NAMED, fork_parent, named_draft_id, start_domain  # noqa: F401 - re-exported
from router.bandit import AcceptanceBandit
from router.domains import BACKGROUND, DomainClassifier, OnlineClusters
from router.features import UND, FeatureExtractor, QueryFeatures, clean_text
from router.route import Route

#: RouterConfig fields that change how fast the router runs, not where it routes: a save made
#: under other values of these loads (load_state)
RUNTIME_FIELDS = {"embedder": {"threads", "embed_cache", "batch_size"}}
UNKNOWN = "unknown"  # domain of queries routed by a fallback
ON_NGRAMS = "classifier: n-grams"  # reason of a query the n-gram gate routed (not embedded)
_FORMAT = 5  # 2: the classifier keeps its examples and typicality thresholds; 3: lexical features, background;
# 4: long texts embedded by their first and last pieces (saved embeddings of older formats differ);
# 5: the classifier as JSON + npz, not joblib (a pickle: loading one could run code); older saves are not loaded
log = logging.getLogger(__name__)


def _saved_config(d: Path) -> RouterConfig:
    """The config a router was saved with. Saves made before the settings had sections wrote them
    flat: each setting is put in the section that now holds it."""
    saved = json.loads((d / "config.json").read_text())
    for key in list(saved):
        home = RouterConfig.section_of(key)
        if home is not None:
            saved.setdefault(home, {})[key] = saved.pop(key)
    return RouterConfig.model_validate(saved)


@dataclass(frozen=True)
class DraftEvent:
    """A change of the drafts in memory, for the serving side to carry out."""

    kind: Literal["spawn", "retire"]
    draft_id: str
    domain: str | None  # the domain the draft serves
    parent: str | None  # spawn: the draft whose weights the new one starts from
    reason: str


class Router:
    def __init__(self, cfg: RouterConfig = RouterConfig(), extractor: FeatureExtractor | None = None):
        self.cfg = cfg
        self.extractor = extractor if extractor is not None else FeatureExtractor(cfg)
        self.classifier = DomainClassifier(cfg.classifier.classifier_c, cfg.bandit.seed, cfg.classifier.typical_k, cfg.classifier.typical_quantile,
                                           lexical=cfg.classifier.lexical, background_filter=cfg.classifier.background_filter,
                                           background_relabel=cfg.classifier.background_relabel)
        self.clusters = OnlineClusters(cfg)
        self.bandit = AcceptanceBandit(cfg)
        self.drafts: dict[str, str | None] = {GENERAL: None}  # draft -> domain it serves (None: any)
        self.usage: dict[str, tuple[float, int]] = {}  # draft -> (decayed routed queries, clock then)
        self.t = 0  # clock: queries routed so far
        self._events: list[DraftEvent] = []

    # ------------------------------------------------------------------ training

    def fit(self, texts: Sequence[str], domains: Sequence[str], langs: Sequence[str] | None = None) -> "Router":
        """Train the domain classifier on labelled examples (``BACKGROUND`` for general traffic);
        with ``langs``, also the language prior (on the named examples)."""
        return self.fit_embeddings(self.extractor.embed(texts), domains, langs,
                                   [clean_text(t, self.cfg.embedder.max_chars) for t in texts])

    def fit_embeddings(self, X: np.ndarray, domains: Sequence[str], langs: Sequence[str] | None = None,
                       texts: Sequence[str] | None = None) -> "Router":
        """``fit`` on embeddings X [n, 384] already computed (and the cleaned texts, for the lexical
        features; without them the classifier reads embeddings only)."""
        topical = sorted({d for d in domains if d != BACKGROUND and not self._open(d)})
        self.classifier.fit(X, domains, texts, topical)
        if langs is not None:
            self.extractor.fit_lang_prior([lang for lang, d in zip(langs, domains) if d != BACKGROUND])
        return self

    # ------------------------------------------------------------------ routing

    def route(self, text: str) -> Route:
        return self.route_batch([text])[0]

    def route_batch(self, texts: Sequence[str]) -> list[Route]:
        """Route several queries with one batched embedding pass; in order, as ``route`` would."""
        start = time.perf_counter()
        sure = self._sure([self.extractor.clean(t) for t in texts])
        feats = self.extractor.extract(texts, embed=[s is None for s in sure[0]])  # the gated ones are not embedded
        routes = self._route_all(feats, sure)
        per_query_ms = (time.perf_counter() - start) * 1e3 / max(len(texts), 1)
        return [replace(r, latency_ms=per_query_ms) for r in routes]

    def route_features(self, feats: Sequence[QueryFeatures]) -> list[Route]:
        """``route_batch`` on features already extracted (evaluations embed a corpus once): the
        same routes, the gated queries' embeddings unused."""
        feats = list(feats)
        return self._route_all(feats, self._sure([f.text for f in feats]))

    def _sure(self, texts: Sequence[str]) -> tuple[list[str | None], np.ndarray]:
        """The n-gram gate: for each cleaned text [n], the topical (not open) label the n-grams
        alone give it with probability >= ``lexical_gate`` (and >= ``confidence_threshold``: a gated
        query is always routed by its label, never needs its embedding), else None; and that
        probability [n]."""
        cfg = self.cfg
        if cfg.classifier.lexical_gate is None or cfg.mode == "clusters" or not self.classifier.fitted:
            return [None] * len(texts), np.zeros(len(texts))
        topical = [c for c in self.classifier.classes if not self._open(c)]
        return self.classifier.sure(texts, max(cfg.classifier.lexical_gate, cfg.classifier.confidence_threshold), topical)

    def route_private(self, text: str) -> Route:
        """The route of an isolated tenant's query, from what the router was configured with only
        (the classifier fitted on labelled examples, the language identifier) and never from what
        traffic taught it: no cluster (a query the classifier does not name confidently is
        ``unknown``), no bandit (a named domain goes to its own draft, ``named_draft_id``, when
        ``named_drafts``, else to the general draft), no embedding cache. Nothing of the router
        changes either: the query joins no cluster, counts in no draft's use, so it shows in
        nobody else's routes. The caller adds the tenant to the draft id."""
        start = time.perf_counter()
        cfg, cleaned = self.cfg, self.extractor.clean(text)
        lang, lang_conf = self.extractor._language(cleaned)
        topic, prob, typ, reason = None, 0.0, None, "private: no named domain"
        if cfg.mode != "clusters" and self.classifier.fitted and cleaned:
            gated, top = self._sure([cleaned])
            if gated[0] is not None:
                topic, prob, reason = gated[0], float(top[0]), "private: " + ON_NGRAMS
            elif lang != UND:
                X = self.extractor._encode([cleaned])  # [1, 384], not through the shared cache
                labels, probs, _ = self.classifier.classify(X, [cleaned])
                topic, prob, reason = labels[0], float(probs[0]), "private: classifier"
                if topic != BACKGROUND and self._open(topic):
                    typ = float(self.classifier.typicality(X, [topic])[0])
        ms = (time.perf_counter() - start) * 1e3
        named = (topic is not None and topic != BACKGROUND and prob >= cfg.classifier.confidence_threshold
                 and (typ is None or self.classifier.typical(topic, typ)))
        if not named:
            return Route(UNKNOWN, lang, GENERAL, prob, reason if topic is None else "private: " + (
                "general traffic" if topic == BACKGROUND else "not a confident named domain"), topic, None, lang_conf,
                ms, typ)
        domain = self.domain_key(topic, lang)
        draft = named_draft_id(domain) if cfg.drafts.named_drafts else GENERAL
        return Route(domain, lang, draft, prob, reason, topic, None, lang_conf, ms, typ)

    def _route_all(self, feats: list[QueryFeatures], sure: tuple[list[str | None], np.ndarray]) -> list[Route]:
        labels, probs, typ, named = self._classify(feats, sure)
        routes = []
        for f, topic, prob, t, nearest, g in zip(feats, labels, probs, typ, named, sure[0]):
            routes.append(self._route_one(f, topic, prob, t, nearest, gated=g is not None))
            self.maintenance()
        return routes

    def _classify(self, feats: list[QueryFeatures], sure: tuple[list[str | None], np.ndarray]
                  ) -> tuple[list, list[float], list[float | None], list]:
        """Label, probability, typicality (None where not needed) and most probable named label
        of each query: the n-gram gate's (``sure``) where it named one, else the classifier's."""
        n = len(feats)
        if self.cfg.mode == "clusters" or not self.classifier.fitted or not feats:
            return [None] * n, [0.0] * n, [None] * n, [None] * n
        gated, gated_p = sure
        labels, named = list(gated), list(gated)
        probs = [float(p) if g is not None else 0.0 for g, p in zip(gated, gated_p)]
        typ: list[float | None] = [None] * n
        rest = [i for i in range(n) if gated[i] is None]
        if rest:
            X = np.stack([feats[i].embedding for i in rest])  # [len(rest), 384]
            lab, prob, near = self.classifier.classify(X, [feats[i].text for i in rest])
            for j, i in enumerate(rest):
                labels[i], probs[i], named[i] = lab[j], float(prob[j]), near[j]
            rows = [j for j, lb in enumerate(lab) if lb != BACKGROUND and self._open(lb)]
            if rows:
                for j, v in zip(rows, self.classifier.typicality(X[rows], [lab[j] for j in rows])):
                    typ[rest[j]] = float(v)
        return labels, probs, typ, named

    def _open(self, topic: str) -> bool:
        return "*" in self.cfg.classifier.open_domains or topic in self.cfg.classifier.open_domains

    def _route_one(self, f: QueryFeatures, topic: str | None, prob: float, typ: float | None = None,
                   named: str | None = None, gated: bool = False) -> Route:
        self.t += 1
        cfg = self.cfg
        if f.lang == UND and not gated:  # a gated one is routed by its n-grams, which it has
            return self._fallback(f, "fallback: empty text" if f.empty else "fallback: no letters")
        cluster, hint = None, None
        confident = topic is not None and topic != BACKGROUND and prob >= cfg.classifier.confidence_threshold
        if confident and (typ is None or self.classifier.typical(topic, typ)):
            domain, confidence, source = self.domain_key(topic, f.lang), prob, ON_NGRAMS if gated else "classifier"
            if cfg.drafts.named_drafts and domain not in self.drafts.values():
                self._spawn_named(domain)
        elif cfg.mode == "supervised":
            if topic is None:
                why = "no classifier"
            elif topic == BACKGROUND:
                why = "general traffic"
            elif not confident:
                why = f"confidence {prob:.2f} < {cfg.classifier.confidence_threshold}"
            else:
                why = f"atypical of {topic} ({typ:.2f} < {self.classifier.thresholds[topic]:.2f})"
            return self._fallback(f, f"fallback: {why}", topic, prob, typ)
        else:
            c, confidence = self.clusters.assign(f.embedding, f.lang, self.t, text=f.text)
            domain, cluster, source = c.key, c.id, "cluster"
            if named is not None:  # the classifier's label, or its likeliest named one for general traffic
                hint = self.own_draft(self.domain_key(named, f.lang))
        candidates = self.candidates(domain)
        if hint is not None and hint not in candidates:
            candidates.append(hint)
        default = self.own_draft(domain) or hint or GENERAL
        draft, explored = self.bandit.choose(domain, candidates, default=default)
        self._use(draft)
        return Route(domain, f.lang, draft, confidence, "bandit-explore" if explored else source,
                     topic, cluster, f.lang_conf, typicality=typ)

    def _fallback(self, f: QueryFeatures, reason: str, topic: str | None = None, prob: float = 0.0,
                  typ: float | None = None) -> Route:
        self._use(GENERAL)
        return Route(UNKNOWN, f.lang, GENERAL, prob, reason, topic, None, f.lang_conf, typicality=typ)

    def domain_key(self, topic: str, lang: str) -> str:
        """A named domain's routing key: one mode per language for ``lang_split_domains``."""
        split = "*" in self.cfg.language.lang_split_domains or topic in self.cfg.language.lang_split_domains
        return f"{topic}/{lang}" if split and lang not in (self.cfg.language.base_lang, UND) else topic

    @staticmethod
    def _serves(draft_domain: str | None, domain: str) -> bool:
        return draft_domain is None or domain == draft_domain or domain.startswith(draft_domain + "/")

    def candidates(self, domain: str) -> list[str]:
        """Drafts that may serve ``domain``: the general one, its own (also of a parent domain:
        a "chat" draft serves "chat/fr") and the unbound ones."""
        return [d for d, dom in self.drafts.items() if d == GENERAL or self._serves(dom, domain)]

    def own_draft(self, domain: str) -> str | None:
        """The most specific draft bound to ``domain`` (or to its parent domain), if any."""
        bound = [(len(dom), d) for d, dom in self.drafts.items() if dom is not None and self._serves(dom, domain)]
        return max(bound)[1] if bound else None

    # ------------------------------------------------------------------ feedback

    def observe(self, route: Route, accepted: int, proposed: int) -> None:
        """Acceptance of one speculative step (or one request's totals) served on ``route``.
        Ignored for fallback routes and for drafts or clusters that are gone since."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got accepted={accepted} proposed={proposed}")
        if route.domain == UNKNOWN or route.draft_id not in self.drafts:
            return
        if route.cluster is not None:
            if route.cluster not in self.clusters.clusters:
                return
            self.clusters.observe(route.cluster, accepted, proposed)
        self.bandit.observe(route.domain, route.draft_id, accepted, proposed)

    # ------------------------------------------------------------------ drafts

    def register_draft(self, draft_id: str, domain: str | None = None) -> None:
        """A draft the serving side holds, bound to ``domain`` (None: may serve any domain). When
        ``max_drafts`` are in memory the least used one is retired (a ``retire`` event)."""
        if draft_id != GENERAL and draft_id not in self.drafts:
            self._make_room(need=float("inf"), reason=f"room for {draft_id}")
        if draft_id != GENERAL:
            self.drafts[draft_id] = domain

    def _spawn_named(self, domain: str) -> None:
        """A draft of its own for a named domain seen for the first time (none when every draft in
        memory is the general one and ``max_drafts`` leaves no room)."""
        draft_id = named_draft_id(domain)
        if self._make_room(need=float("inf"), reason=f"room for {draft_id}"):
            self.drafts[draft_id] = domain
            self._events.append(DraftEvent("spawn", draft_id, domain, GENERAL, f"named domain {domain}"))

    def retire_draft(self, draft_id: str) -> None:
        """The serving side unloaded ``draft_id``; its statistics are dropped (no event)."""
        if draft_id == GENERAL:
            raise ValueError("the general draft cannot be retired")
        self._drop(draft_id)

    def value(self, draft_id: str) -> float:
        """Queries routed to the draft, decayed with a half-life of ``spawn_window`` queries."""
        v, t = self.usage.get(draft_id, (0.0, self.t))
        return v * 0.5 ** ((self.t - t) / self.cfg.drafts.spawn_window)

    def _use(self, draft_id: str) -> None:
        self.usage[draft_id] = (self.value(draft_id) + 1.0, self.t)

    def _make_room(self, need: float, reason: str) -> bool:
        """Retire the least used draft if the drafts are full and it is used less than ``need``."""
        if len(self.drafts) < self.cfg.drafts.max_drafts:
            return True
        victims = [d for d in self.drafts if d != GENERAL]
        if not victims:
            return False
        victim = min(victims, key=self.value)
        if self.value(victim) >= need:
            return False
        self._retire(victim, f"least used ({self.value(victim):.1f}), {reason}")
        return True

    def _drop(self, draft_id: str) -> str | None:
        domain = self.drafts.pop(draft_id)
        self.usage.pop(draft_id, None)
        self.bandit.forget(draft_id=draft_id)
        for c in self.clusters.clusters.values():
            if c.draft == draft_id:
                c.draft = None
        return domain

    def _retire(self, draft_id: str, reason: str) -> None:
        domain = self._drop(draft_id)
        self._events.append(DraftEvent("retire", draft_id, domain, None, reason))

    def maintenance(self, now_s: float | None = None) -> None:
        """Expire noise / idle clusters (retiring their drafts) and spawn drafts for busy clusters
        with poor acceptance. Runs after every routed query; call it on a timer when
        ``idle_retire_s`` is set and traffic may stop."""
        for ev in self.clusters.maintain(self.t, now_s):
            c = ev.cluster
            if ev.kind == "expire":
                self.bandit.forget(domain=c.key)
                if c.draft in self.drafts:
                    self._retire(c.draft, f"cluster {c.key} expired: {ev.reason}")
            elif self._make_room(need=len(c.recent), reason=f"spawn for {c.key}"):
                c.draft = f"c{c.id}-{c.lang}"
                self.drafts[c.draft] = c.key
                self._events.append(DraftEvent("spawn", c.draft, c.key, GENERAL, f"cluster {c.key}: {ev.reason}"))

    def events(self) -> list[DraftEvent]:
        """Spawn / retire events since the last call (drained)."""
        out, self._events = self._events, []
        return out

    def refresh_names(self) -> None:
        """The discovered domains' names (:meth:`OnlineClusters.refresh_names`), each with the
        named domain it is close to when the classifier knows named domains."""
        self.clusters.refresh_names(self.classifier.nearest_typical if self.classifier.fitted else None)

    def summary(self) -> dict:
        """Drafts, clusters and per-domain acceptance estimates, for logs and dashboards."""
        self.refresh_names()
        return {
            "t": self.t, "mode": self.cfg.mode, "classes": self.classifier.classes,
            "drafts": {d: {"domain": dom, "value": round(self.value(d), 2)} for d, dom in self.drafts.items()},
            "clusters": {c.key: {"name": c.name, "count": c.count, "draft": c.draft, "alpha": c.alpha}
                         for c in self.clusters.clusters.values()},
            "acceptance": {f"{dom}|{d}": round(self.bandit.mean(dom, d), 4) for dom, d in self.bandit.counts},
        }

    # ------------------------------------------------------------------ state

    def save(self, directory: str | os.PathLike) -> None:
        """Config, classifier (JSON + npz), clusters (JSON + npz centroids), bandit, drafts, clock:
        no pickle anywhere, so loading a save runs no code from it."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(self.cfg.model_dump_json(indent=1))
        clf = d / "classifier"
        if self.classifier.fitted:
            self.classifier.save(clf)
        else:
            for f in DomainClassifier._files(clf):
                f.unlink(missing_ok=True)
        meta, centroids = self.clusters.state()
        np.save(d / "centroids.npy", centroids)
        state = {"format": _FORMAT, "t": self.t, "drafts": self.drafts, "usage": self.usage,
                 "clusters": meta, "bandit": self.bandit.state(), "events": [asdict(e) for e in self._events],
                 "lang_prior": getattr(self.extractor, "lang_prior", None)}
        tmp = d / "state.json.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, d / "state.json")  # the state file is the last written: present = complete

    @classmethod
    def load(cls, directory: str | os.PathLike, extractor: FeatureExtractor | None = None) -> "Router":
        d = Path(directory)
        state = json.loads((d / "state.json").read_text())
        if state.get("format") != _FORMAT:
            raise ValueError(f"{d}: router state format {state.get('format')}, expected {_FORMAT}")
        cfg = _saved_config(d)
        self = cls(cfg, extractor)
        if (d / "classifier.json").exists():
            self.classifier = DomainClassifier.load(d / "classifier")
        centroids = np.load(d / "centroids.npy", allow_pickle=False)
        if len(state["clusters"]["clusters"]) != len(centroids):
            raise ValueError(f"{d}: {len(state['clusters']['clusters'])} clusters but {len(centroids)} centroids")
        self.clusters = OnlineClusters.from_state(cfg, state["clusters"], centroids)
        self.bandit = AcceptanceBandit.from_state(cfg, state["bandit"])
        self.drafts, self.t = state["drafts"], state["t"]
        self.usage = {k: (v, t) for k, (v, t) in state["usage"].items()}
        self._events = [DraftEvent(**e) for e in state["events"]]
        if state.get("lang_prior"):
            self.extractor.lang_prior = state["lang_prior"]
        return self


def training_label(record, keep_general: bool = False) -> str:
    """The classifier's label of a labelled record: its domain, or ``BACKGROUND`` for a record of
    a general source (``workloads.GENERAL_SOURCES``; with ``keep_general``, its domain, as routers
    were trained before the background class)."""
    from workloads import is_general

    return BACKGROUND if is_general(record) and not keep_general else record.domain


def fit_examples(router: Router, path: str | os.PathLike) -> Router:
    """Fit ``router``'s classifier (and language prior) on the named-domain records of a workload
    file; its records of general sources (``workloads.GENERAL_SOURCES``) are the background class
    when ``RouterConfig.classifier.background``, else left out."""
    from workloads import load_workload, named_for_routing

    recs = named_for_routing(load_workload(path), keep_general=router.cfg.classifier.background)
    return router.fit([r.text for r in recs], [training_label(r) for r in recs], [r.lang for r in recs])


# ---------------------------------------------------------------------- state across restarts


def save_state(router: Router, directory: str | os.PathLike) -> Path:
    """Save ``router`` as ``<directory>/current``, keeping the save before it as ``previous``.

    The new state is written in a folder of its own and renamed into place, so ``current`` is
    always a whole save (or absent) even when the process dies mid-write."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    router.save(tmp)
    cur, prev = root / "current", root / "previous"
    if cur.exists():
        shutil.rmtree(prev, ignore_errors=True)
        os.replace(cur, prev)
    os.replace(tmp, cur)
    return cur


def load_state(directory: str | os.PathLike, cfg: RouterConfig, extractor: FeatureExtractor | None = None) -> Router | None:
    """The newest save under ``directory`` that loads whole and was made under ``cfg`` (``current``,
    else ``previous``); None when there is none. A save that does not load (truncated, corrupt,
    another format) or that another router config made is skipped with the reason logged, and a
    corrupt one is moved aside (``corrupt-<name>-<time>``) so that it is never tried again."""
    root = Path(directory)
    for name in ("current", "previous"):
        d = root / name
        if not (d / "state.json").exists() and not d.exists():
            continue
        try:
            saved_cfg = _saved_config(d)
            if saved_cfg.model_dump(exclude=RUNTIME_FIELDS) != cfg.model_dump(exclude=RUNTIME_FIELDS):
                log.warning("router state %s was saved under another router config; not loaded (starting afresh)", d)
                continue
            router = Router.load(d, extractor)
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is not used
            aside = root / f"corrupt-{name}-{int(time.time())}"
            log.error("router state %s is unreadable (%s: %s); skipped, moved to %s", d, type(e).__name__, e, aside.name)
            os.replace(d, aside)
            continue
        log.info("router state loaded from %s (%d queries routed, %d drafts)", d, router.t, len(router.drafts))
        return router
    return None
