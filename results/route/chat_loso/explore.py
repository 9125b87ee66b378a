"""Exploration: can a new *source* of chat be named chat without naming the unnamed kinds chat?

Not part of the router: each variant is a patch of ``router.domains.DomainClassifier`` applied in
this process, on the pool ``osd route --open`` evaluates (leave-one-source-out for chat's three
sources, leave-one-domain-out for all four domains, the five unnamed kinds and the workload's
general traffic), with the router's defaults otherwise. Features are computed once and cached
in ``--cache``. Variants:

* ``base``: the router as it is (typicality threshold: the 0.2 quantile of held-out scores, each
  fifth of chat's examples against the other four fifths);
* ``src``: the threshold from held-out *sources* (each chat source against the others);
* ``margin``: typicality = nearest chat example - nearest background example, fifths;
* ``margin_src``: that margin, calibrated by source;
* ``--chatfilter``: background examples that a classifier of the named examples gives to chat
  with probability >= 0.5 are dropped too (as the topical ones are);
* ``--bgw W``: the background's examples weighted W (on top of balanced class weights).

Run from the repository root: ``python results/route/chat_loso/explore.py --variant src``. The
features are those before ``RouterConfig.embedder.tail_embedding`` (the first word pieces only), as when
the outputs beside it were written.
"""
import argparse
import os
import pickle
import sys
from collections import Counter

import numpy as np

sys.path.insert(0, os.getcwd())
from config import RouterConfig  # noqa: E402
from router import domains as D  # noqa: E402
from router.cli import _outcome  # noqa: E402
from router.router import Router  # noqa: E402
ap = argparse.ArgumentParser()
ap.add_argument("--variant", default="base", choices=["base", "src", "margin", "margin_src"])
ap.add_argument("--q", type=float, default=0.2)
ap.add_argument("--only-chat", action="store_true", help="leave out only chat's sources (the others do not change)")
ap.add_argument("--bgw", type=float, default=1.0)
ap.add_argument("--chatfilter", action="store_true")
ap.add_argument("--k", type=int, default=1)
ap.add_argument("--cache", default="/tmp/osd_chat_loso_feats.pkl")
a = ap.parse_args()

if not os.path.exists(a.cache):
    from config import RouterConfig
    from router.router import Router
    from workloads import load_workload, named_for_routing, is_general, WorkloadRecord
    from router.domains import BACKGROUND
    train = load_workload("bench/data/router_train.jsonl")
    workload = load_workload("bench/data/workload.jsonl")
    open_records = load_workload("bench/data/open.jsonl")
    cfg = RouterConfig(embedder={"tail_embedding": False})  # the features when this was run: first word pieces only
    router = Router(cfg)
    named = sorted({r.domain for r in named_for_routing(train)})
    pool, seen = [], set()
    for r in named_for_routing([*train, *workload, *open_records]):
        if r.domain in named and r.text not in seen:
            seen.add(r.text); pool.append(r)
    background = [r for r in train if is_general(r)]
    trained = {r.text for r in background}
    general = {r.text: WorkloadRecord(r.text, "general", r.lang, r.source) for r in [*train, *workload] if is_general(r) and r.text not in trained}
    unnamed = [r for r in open_records if r.domain not in named and r.domain != "unknown"] + list(general.values())
    feats = router.extractor.extract([r.text for r in pool + unnamed + background])
    pickle.dump(dict(pool=pool, unnamed=unnamed, background=background, feats=feats, named=named), open(a.cache, "wb"))
    print(len(pool), len(unnamed), len(background))
d = pickle.load(open(a.cache, "rb"))
pool, unnamed, background, feats, named = d["pool"], d["unnamed"], d["background"], d["feats"], d["named"]
pf, uf, bf = feats[:len(pool)], feats[len(pool):len(pool)+len(unnamed)], feats[len(pool)+len(unnamed):]
X = np.stack([f.embedding for f in pf + bf]); src = np.array([r.source.split(":")[0] for r in pool] + ["background"] * len(bf))
dom = np.array([r.domain for r in pool] + [D.BACKGROUND] * len(bf)); texts = [f.text for f in pf + bf]; langs = [r.lang for r in pool + background]
cfg = RouterConfig(classifier={"typical_quantile": a.q, "typical_k": a.k}, embedder={"tail_embedding": False})
CUR = {}
orig_fit = D.DomainClassifier.fit
def fit(self, Xf, labels, texts=None, topical=()):
    if a.chatfilter: topical = tuple(topical) + ('chat',)
    out = orig_fit(self, Xf, labels, texts, topical)
    y = np.asarray(labels)
    self.bg = np.asarray(Xf, np.float32)[y == D.BACKGROUND]
    if a.variant in ("margin", "margin_src"):
        self.thresholds = {c: self._cal2(c, ex) for c, ex in self.examples.items()}
    if a.variant == "src":
        self.thresholds = {c: self._calsrc(c, ex) for c, ex in self.examples.items()}
    return out
def _cal2(self, c, ex):
    n = len(ex); order = np.random.default_rng(0).permutation(n); scores = []
    groups = np.array_split(order, 5)
    if a.variant == "margin_src":
        s = CUR["src"][c]; groups = [np.flatnonzero(s == g) for g in sorted(set(s))] if len(set(s)) > 1 else groups
    for fold in groups:
        rest = np.setdiff1d(order, fold)
        scores.append(self._knn(ex[rest], ex[fold]) - self._knn(self.bg, ex[fold]))
    return float(np.quantile(np.concatenate(scores), a.q))
def _calsrc(self, c, ex):
    s = CUR["src"][c]
    if len(set(s)) < 2: return self._calibrate(ex)
    scores = [self._knn(ex[s != g], ex[s == g]) for g in sorted(set(s))]
    return float(np.quantile(np.concatenate(scores), a.q))
orig_typ = D.DomainClassifier.typicality
def typicality(self, Xq, labels):
    t = orig_typ(self, Xq, labels)
    if a.variant.startswith("margin"):
        t = t - self._knn(self.bg, np.asarray(Xq, np.float32))
    return t
from sklearn.linear_model import LogisticRegression
class W(LogisticRegression):
    def fit(self, Xx, y, sample_weight=None):
        y = np.asarray(y); sw = np.where(y == D.BACKGROUND, a.bgw, 1.0) if D.BACKGROUND in set(y) else None
        return super().fit(Xx, y, sample_weight=sw)
D.DomainClassifier._logreg = lambda self: W(C=self.C, max_iter=2000, class_weight="balanced", random_state=self.seed)
D.DomainClassifier.fit = fit; D.DomainClassifier._cal2 = _cal2; D.DomainClassifier._calsrc = _calsrc; D.DomainClassifier.typicality = typicality
def routes_of(m, test):
    CUR["src"] = {c: src[m & (dom == c)] for c in named}
    r = Router(cfg)
    r.fit_embeddings(X[m], dom[m], [lg for lg, k in zip(langs, m) if k], [t for t, k in zip(texts, m) if k])
    rs = r.route_features(test)
    if a.only_chat: print('  topics', dict(Counter((x.topic, x.topic is not None and x.topic != '~general' and x.confidence >= 0.5, x.typicality is None or r.classifier.typical(x.topic, x.typicality)) for x in rs)))
    return [_outcome(x) for x in rs]
share = lambda o, w: sum(x == w for x in o) / max(len(o), 1)
res = {}
for dd in named:
    if a.only_chat and dd != "chat": continue
    for s in sorted(set(src[dom == dd])):
        o = routes_of(src != s, [f for f, k in zip(pf, src == s) if k]); res[f"loso {dd}:{s}"] = (round(share(o, dd), 3), dict(Counter(o)))
for dd in named:
    o = routes_of(dom != dd, [f for f, k in zip(pf, dom == dd) if k]); res[f"lodo {dd}"] = (round(share(o, "cluster"), 3), dict(Counter(o)))
o = routes_of(np.ones(len(dom), bool), uf)
kinds = Counter(); 
for x, r in zip(o, unnamed): kinds[(r.domain, x)] += 1
res["unnamed"] = round(share([x for x, r in zip(o, unnamed) if r.domain != "general"], "cluster"), 3)
res["general"] = round(share([x for x, r in zip(o, unnamed) if r.domain == "general"], "cluster"), 3)
res["kinds"] = {f"{k[0]}>{k[1]}": v for k, v in sorted(kinds.items())}
print(a); [print(k, v) for k, v in res.items()]
