"""``osd route``: route every record of a workload; accuracy per label, confusion, latency.

The classifier is trained on ``--train`` minus every record whose text appears in the evaluated
workload (or in an ``--exclude`` file), so accuracy is measured on examples not used to train.
Topic accuracy compares the classifier's label with ``domain``; language accuracy compares the
language id with ``lang``, overall and on chatterbot-sourced records (their label is the corpus'
language folder: ground truth; ShareGPT labels were themselves made by py3langid). As the
workload holds few non-English chatterbot records, ``--lang-corpus chatterbot`` also scores the
language id on every first turn of the chatterbot-corpus wheel (about 4300 texts, 26 languages).
Latency is single-query ``Router.route`` after a warm-up, per query; the embedding cache
(``--embed-cache``) is emptied after the warm-up, so it only counts repeats within the workload.

With ``--open FILE`` (default bench/data/open.jsonl, built by ``osd workload open``: other
sources of the named domains, and five kinds of requests no label names) the report adds three
figures on traffic the classifier never saw, each from fresh routers trained on embeddings of the
pool (train + workload + the open file's named records, each text once):

* **leave-one-source-out**: for every source of a named domain with two or more sources, a
  router trained without that source; recall = the share of the source's records routed to
  their domain (or its language variants) rather than to a cluster, the general draft or
  another domain;
* **leave-one-domain-out**: a router trained without a whole domain; the share of that domain's
  records routed to clusters (a named domain is then wrong: the domain is not one of them);
* **unnamed domains**: a router trained on the whole pool; the share of each unnamed kind's
  records routed to clusters.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Sequence

import numpy as np
from sklearn.metrics import accuracy_score, classification_report, confusion_matrix

from config import RouterConfig

DATA = Path(__file__).resolve().parent.parent / "bench" / "data"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--workload", default=str(DATA / "workload.jsonl"), help="records to route (JSONL)")
    p.add_argument("--train", default=str(DATA / "router_train.jsonl"),
                   help="labelled records for the classifier (osd workload open --router-train)")
    p.add_argument("--exclude", nargs="*", default=[], help="more workload files whose texts are never trained on")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--mode", choices=["supervised", "clusters", "both"], default="both")
    p.add_argument("--confidence-threshold", type=float, default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="MiniLM input length (RouterConfig.embedder.max_tokens)")
    p.add_argument("--tail-embedding", action=argparse.BooleanOptionalAction, default=None,
                   help="embed a long text's last word pieces too (RouterConfig.embedder.tail_embedding; default: the config's, on)")
    p.add_argument("--quantize", action=argparse.BooleanOptionalAction, default=None,
                   help="int8 MiniLM (RouterConfig.embedder.quantize; default: the config's, int8)")
    p.add_argument("--backend", choices=["torch", "onnx"], default=None,
                   help="MiniLM runtime (RouterConfig.embedder.backend); default: the config's")
    p.add_argument("--embed-cache", type=int, default=None,
                   help="embeddings cached by text (RouterConfig.embedder.embed_cache; 0 = off); default: the config's. "
                        "The cache is emptied after the warm-up and before the batched timing either way")
    p.add_argument("--load", default=None, help="route with a router saved by --save instead of training one")
    p.add_argument("--save", default=None, help="save the trained router (after routing) to this folder")
    p.add_argument("--warmup", type=int, default=10, help="queries embedded before timing")
    p.add_argument("--lang-corpus", choices=["chatterbot", "none"], default="chatterbot",
                   help="also score language id on the whole chatterbot-corpus wheel (pip-downloaded once)")
    p.add_argument("--open", default=str(DATA / "open.jsonl"),
                   help="records of other sources and unnamed domains (osd workload open): leave-one-source-out, "
                        "leave-one-domain-out and unnamed-domain figures; 'none' to skip")
    p.add_argument("--open-domains", default=None,
                   help="comma-separated RouterConfig.classifier.open_domains ('*' all, '' none); default: the config's")
    p.add_argument("--typical-quantile", type=float, default=None, help="RouterConfig.classifier.typical_quantile")
    p.add_argument("--keep-general", action="store_true",
                   help="also train on the general sources (workloads.GENERAL_SOURCES: ShareGPT as 'chat'), as "
                        "routers did before; for comparison")
    p.add_argument("--typical-k", type=int, default=None, help="RouterConfig.classifier.typical_k")
    p.add_argument("--lexical", action=argparse.BooleanOptionalAction, default=None,
                   help="character n-gram features beside the embedding (RouterConfig.classifier.lexical)")
    p.add_argument("--background", action=argparse.BooleanOptionalAction, default=None,
                   help="the training file's general traffic as a background class (RouterConfig.classifier.background)")
    p.add_argument("--background-filter", type=float, default=None, help="RouterConfig.classifier.background_filter")
    p.add_argument("--background-relabel", type=float, default=None,
                   help="RouterConfig.classifier.background_relabel: filtered background examples given their domain with at least "
                        "this probability join it")
    p.add_argument("--lexical-gate", type=float, default=None,
                   help="RouterConfig.classifier.lexical_gate: route without embedding a query whose n-grams alone give a "
                        "topical domain this probability; 0: embed every query")
    p.add_argument("--no-lang-prior", dest="lang_prior", action="store_false",
                   help="language id without the prior learned from the training file's lang labels")
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``route`` on an ``argparse`` subparsers object (``osd route``)."""
    return add_arguments(subparsers.add_parser(
        "route", help="route a workload: topic and language accuracy, confusion table, latency",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


def _percentiles(ms: Sequence[float]) -> dict:
    p50, p90, p99 = np.percentile(ms, [50, 90, 99]) if len(ms) else (None,) * 3
    return {"n": len(ms), "p50": p50, "p90": p90, "p99": p99, "mean": float(np.mean(ms)) if len(ms) else None}


def _lang_scores(truth: Sequence[str], pred: Sequence[str]) -> dict:
    """Accuracy overall and per true label, and the most common confusions."""
    per: dict[str, list[int]] = {}
    for t, p in zip(truth, pred):
        per.setdefault(t, [0, 0])[0] += t == p
        per[t][1] += 1
    errors = Counter(f"{t}->{p}" for t, p in zip(truth, pred) if t != p)
    return {"n": len(truth), "accuracy": float(accuracy_score(truth, pred)) if truth else None,
            "per_label": {k: {"accuracy": c / n, "n": n} for k, (c, n) in sorted(per.items())},
            "errors": dict(errors.most_common(20))}


def _table(labels: list[str], matrix: np.ndarray) -> str:
    w = max(8, *(len(x) + 2 for x in labels))
    rows = ["true \\ pred".ljust(w) + "".join(x.rjust(w) for x in labels)]
    rows += [t.ljust(w) + "".join(str(v).rjust(w) for v in row) for t, row in zip(labels, matrix)]
    return "\n".join(rows)


def _chatterbot_corpus():
    """Every first turn of the pinned chatterbot-corpus wheel, labelled by language folder."""
    from workloads import default_cache_dir, fetch_wheel, parse_chatterbot

    return parse_chatterbot(fetch_wheel("chatterbot-corpus", default_cache_dir()))


def evaluate(args: argparse.Namespace) -> dict:
    from router.router import ON_NGRAMS, Router, training_label
    from workloads import is_general, load_workload, named_for_routing

    records = load_workload(args.workload)
    train_file = load_workload(args.train)
    report: dict = {"workload": args.workload, "n_records": len(records)}
    if args.load:
        router = Router.load(args.load)
    else:
        embedder: dict = {}
        classifier: dict = {}
        for key in ("quantize", "max_tokens", "backend", "embed_cache", "tail_embedding"):
            if getattr(args, key) is not None:
                embedder[key] = getattr(args, key)
        for key in ("confidence_threshold", "typical_quantile", "typical_k", "lexical", "background", "background_filter",
                    "background_relabel"):
            if getattr(args, key) is not None:
                classifier[key] = getattr(args, key)
        if args.open_domains is not None:
            classifier["open_domains"] = tuple(d for d in args.open_domains.split(",") if d)
        if args.keep_general:
            classifier["background"] = False
        if args.lexical_gate is not None:
            classifier["lexical_gate"] = args.lexical_gate or None
        router = Router(RouterConfig(mode=args.mode, embedder=embedder, classifier=classifier))
        banned = {r.text for f in [args.workload, *args.exclude] for r in load_workload(f)}
        pool = named_for_routing(train_file, keep_general=args.keep_general or router.cfg.classifier.background)
        train = [r for r in pool if r.text not in banned]
        t0 = time.perf_counter()
        router.fit([r.text for r in train], [training_label(r, args.keep_general) for r in train],
                   [r.lang for r in train] if args.lang_prior else None)
        report["train"] = {"file": args.train, "n": len(train), "excluded_as_in_workload": len(pool) - len(train),
                           "domains": dict(Counter(training_label(r, args.keep_general) for r in train)),
                           "background_dropped": router.classifier.background_dropped,
                           "fit_s": time.perf_counter() - t0}
    cfg = router.cfg
    report["config"] = cfg.model_dump(mode="json")

    # warm-up (features only: the routing state is not touched), then one query at a time; the
    # embedding cache starts empty, so only repeats within the workload hit it
    router.extractor.extract([r.text for r in records[: args.warmup]])
    router.extractor.clear_cache()
    routes, ms = [], []
    for r in records:
        t0 = time.perf_counter()
        routes.append(router.route(r.text))
        ms.append((time.perf_counter() - t0) * 1e3)
    report["embed_cache"] = router.extractor.cache_info()
    router.extractor.clear_cache()
    t0 = time.perf_counter()
    router.extractor.extract([r.text for r in records])
    gated = [x.reason == ON_NGRAMS for x in routes]  # routed on their n-grams, not embedded
    report["latency_ms"] = {**_percentiles(ms),
                            "batched_features_per_query": (time.perf_counter() - t0) * 1e3 / max(len(records), 1),
                            "not_embedded": sum(gated) / max(len(routes), 1),
                            "embedded": _percentiles([m for m, g in zip(ms, gated) if not g]),
                            "on_ngrams": _percentiles([m for m, g in zip(ms, gated) if g])}

    # topic: the classifier's label (also where it was unsure) against `domain`
    named = [(r, x) for r, x in zip(records, routes) if r.domain != "unknown" and not is_general(r)]
    labelled = [(r.domain, x.topic) for r, x in named if x.topic]
    if labelled:
        truth, pred = map(list, zip(*labelled))
        labels = sorted(set(truth) | set(pred))
        cm = confusion_matrix(truth, pred, labels=labels)
        report["topic"] = {
            "n": len(truth), "accuracy": float(accuracy_score(truth, pred)),
            "below_threshold": sum(x.confidence < cfg.classifier.confidence_threshold for x in routes if x.topic) / len(truth),
            "routed_to_domain": {d: sum(_outcome(x) == d for r, x in named if r.domain == d)
                                 / max(1, sum(r.domain == d for r, _ in named)) for d in sorted(set(truth))},
            "general_to_clusters": (sum(_outcome(x) == "cluster" for r, x in zip(records, routes) if is_general(r))
                                    / max(1, sum(map(is_general, records)))),
            "per_label": {k: v for k, v in classification_report(truth, pred, labels=labels, output_dict=True,
                                                                 zero_division=0).items() if k in labels},
            "confusion": {"labels": labels, "matrix": cm.tolist()},
            "errors": [{"text": r.text[:120], "domain": r.domain, "predicted": x.topic, "confidence": x.confidence,
                        "source": r.source} for r, x in named if x.topic and r.domain != x.topic][:20],
        }

    # language: overall, and on chatterbot records whose label is ground truth
    langs = [(r.lang, x.lang, r.source) for r, x in zip(records, routes) if r.lang != "und"]
    bot = [(t, p) for t, p, s in langs if s.startswith("chatterbot:")]
    report["language"] = {"overall": _lang_scores([t for t, _, _ in langs], [p for _, p, _ in langs]),
                          "chatterbot": _lang_scores([t for t, _ in bot], [p for _, p in bot])}
    if args.lang_corpus == "chatterbot":
        seen = {r.text for r in train_file}  # the language prior's training texts
        corpus = [r for r in _chatterbot_corpus() if r.text not in seen]
        pred = [router.extractor.language(r.text)[0] for r in corpus]
        scores = _lang_scores([r.lang for r in corpus], pred)
        lengths = np.array([len(r.text) for r in corpus])
        right = np.array([r.lang == p for r, p in zip(corpus, pred)])
        buckets = {"<20 chars": (0, 20), "20-49 chars": (20, 50), ">=50 chars": (50, np.inf)}
        scores["by_length"] = {name: {"accuracy": float(right[m].mean()), "n": int(m.sum())}
                               for name, (lo, hi) in buckets.items() if (m := (lengths >= lo) & (lengths < hi)).any()}
        report["language"]["chatterbot_corpus"] = scores

    if args.open not in (None, "none") and not args.load:
        report["open_set"] = open_set_report(cfg, router.extractor, train_file, records,
                                             load_workload(args.open), args.lang_prior, args.keep_general)
        report["open_set"]["file"] = args.open
    report["routes"] = {k: dict(Counter(getattr(x, k) for x in routes)) for k in ("draft_id", "domain", "reason")}
    report["router"] = router.summary()
    if args.save:
        router.save(args.save)
    return report


def _outcome(route) -> str:
    """Where a route went: "cluster", "fallback", or the named domain (language variant dropped)."""
    if route.cluster is not None:
        return "cluster"
    return "fallback" if route.domain == "unknown" else route.domain.split("/")[0]


def open_set_report(cfg: RouterConfig, extractor, train: Sequence, workload: Sequence, open_records: Sequence,
                    lang_prior: bool = True, keep_general: bool = False) -> dict:
    """Leave-one-source-out recall, leave-one-domain-out and unnamed-domain shares routed to clusters
    (see the module docstring). Records: ``workloads.WorkloadRecord``; the named domains are those of
    ``train``; a record's source is the part of ``source`` before ":"."""
    from router.router import Router

    from workloads import GENERAL_SOURCES, WorkloadRecord, is_general, named_for_routing

    from router.domains import BACKGROUND

    named = sorted({r.domain for r in named_for_routing(train)})
    pool, seen = [], set()
    for r in named_for_routing([*train, *workload, *open_records], keep_general=keep_general):
        if r.domain in named and r.text not in seen:
            seen.add(r.text)
            pool.append(r)
    # the background class (general traffic of the training file) is in every router's training;
    # the general traffic of the workload is never trained on and judged like an unnamed kind
    background = [] if keep_general or not cfg.classifier.background else [r for r in train if is_general(r)]
    trained = {r.text for r in background}
    general = {} if keep_general else {r.text: WorkloadRecord(r.text, "general", r.lang, r.source)
                                       for r in [*train, *workload] if is_general(r) and r.text not in trained}
    unnamed = [r for r in open_records if r.domain not in named and r.domain != "unknown"] + list(general.values())
    feats = iter(extractor.extract([r.text for r in pool + unnamed + background]))  # one pass, batched as one
    pf, uf, bf = (list(islice(feats, len(group))) for group in (pool, unnamed, background))
    X = np.stack([f.embedding for f in pf + bf])  # [pool + background, 384]
    src = np.array([r.source.split(":")[0] for r in pool] + ["background"] * len(bf))
    dom = np.array([r.domain for r in pool] + [BACKGROUND] * len(bf))
    texts = [f.text for f in pf + bf]
    langs = [r.lang for r in pool + background]

    def routes_of(train_mask: np.ndarray, test: Sequence):
        router = Router(cfg, extractor)
        router.fit_embeddings(X[train_mask], dom[train_mask],
                              [lg for lg, m in zip(langs, train_mask) if m] if lang_prior else None,
                              [t for t, m in zip(texts, train_mask) if m])
        return [_outcome(x) for x in router.route_features(test)]

    def share(outs: list[str], want: str) -> float:
        return sum(o == want for o in outs) / max(len(outs), 1)

    loso = {}
    for d in named:
        sources = sorted(set(src[dom == d]))
        for s in sources if len(sources) > 1 else []:
            test = [f for f, m in zip(pf, src == s) if m]
            outs = routes_of(src != s, test)
            loso[f"{d}:{s}"] = {"domain": d, "source": s, "n": len(outs), "recall": share(outs, d),
                                "went": dict(Counter(outs))}
    lodo = {}
    for d in named:
        outs = routes_of(dom != d, [f for f, m in zip(pf, dom == d) if m])
        lodo[d] = {"n": len(outs), "to_clusters": share(outs, "cluster"), "went": dict(Counter(outs))}
    outs = routes_of(np.ones(len(dom), bool), uf)
    went_by_kind: dict[str, list[str]] = {}
    for o, r in zip(outs, unnamed):
        went_by_kind.setdefault(r.domain, []).append(o)
    per_kind = {k: {"n": len(v), "to_clusters": share(v, "cluster"), "went": dict(Counter(v))}
                for k, v in sorted(went_by_kind.items())}
    return {
        "pool": {"n": len(pool), "sources": {d: sorted(set(src[dom == d])) for d in named},
                 "background": len(background)},
        "loso": loso,
        "loso_min_recall": {d: min((v["recall"] for v in loso.values() if v["domain"] == d), default=None) for d in named},
        "lodo": lodo,
        "unnamed": per_kind,
        "unnamed_to_clusters": share([o for o, r in zip(outs, unnamed) if r.domain != "general"], "cluster"),
        "general_sources": list(GENERAL_SOURCES),
    }


def _print(report: dict) -> None:
    from router.domains import BACKGROUND

    lat = report["latency_ms"]
    if "train" in report:
        tr = report["train"]
        n_bg = tr["domains"].get(BACKGROUND, 0)
        print(f"trained on {tr['n']} records of {tr['file']} ({tr['excluded_as_in_workload']} left out: "
              f"in the evaluated workload) in {tr['fit_s']:.1f} s"
              + (f"; {n_bg} of general traffic as the background, {tr['background_dropped']} of them dropped "
                 f"as code, SQL or math requests" if n_bg else ""))
    if "topic" in report:
        t = report["topic"]
        print(f"\ntopic accuracy {t['accuracy']:.3f} on {t['n']} records "
              f"({t['below_threshold']:.1%} below the confidence threshold)")
        print("routed to their domain (open-set decision): " + ", ".join(f"{d} {v:.3f}" for d, v in t["routed_to_domain"].items())
              + f"; general traffic to clusters: {t['general_to_clusters']:.3f}")
        print(_table(t["confusion"]["labels"], np.array(t["confusion"]["matrix"])))
    lang = report["language"]
    for name, s in lang.items():
        if s["accuracy"] is not None:
            print(f"\nlanguage accuracy, {name}: {s['accuracy']:.3f} on {s['n']} records"
                  + "".join(f"; {k}: {v['accuracy']:.3f} (n={v['n']})" for k, v in s.get("by_length", {}).items()))
            if s["errors"]:
                print("  most common errors: " + ", ".join(f"{k} x{v}" for k, v in list(s["errors"].items())[:8]))
    print(f"\nrouter latency per query: p50 {lat['p50']:.1f} ms, p90 {lat['p90']:.1f} ms, p99 {lat['p99']:.1f} ms "
          f"(n={lat['n']}); batched features {lat['batched_features_per_query']:.1f} ms per query")
    for name, part in (("embedded", lat.get("embedded")), ("routed on their n-grams, not embedded", lat.get("on_ngrams"))):
        if part and part["n"]:
            print(f"  {name}: {part['n']} queries, p50 {part['p50']:.1f} ms, p90 {part['p90']:.1f} ms")
    cfg, cache = report["config"]["embedder"], report["embed_cache"]
    print(f"embedder: backend {cfg['backend']}, quantize {cfg['quantize']}, {cfg['threads']} thread(s); embedding "
          f"cache {cache['max']} entries: {cache['hits']} hits, {cache['misses']} misses while routing")
    print(f"routes by draft: {report['routes']['draft_id']}; by reason: {report['routes']['reason']}")
    if "open_set" in report:
        o = report["open_set"]
        print(f"\nleave-one-source-out recall (pool of {o['pool']['n']} named records):")
        for key, v in o["loso"].items():
            print(f"  {key:<24} {v['recall']:.3f}  (n={v['n']}; went: {v['went']})")
        print("leave-one-domain-out, share routed to clusters:")
        for d, v in o["lodo"].items():
            print(f"  {d:<24} {v['to_clusters']:.3f}  (n={v['n']}; went: {v['went']})")
        print(f"unnamed domains, share routed to clusters: {o['unnamed_to_clusters']:.3f} "
              f"(general: mixed traffic of {', '.join(o['general_sources'])}, not counted in it)")
        for k, v in o["unnamed"].items():
            print(f"  {k:<24} {v['to_clusters']:.3f}  (n={v['n']}; went: {v['went']})")


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``osd route``: takes the parsed namespace (``add_parser``) or an argv list."""
    if not isinstance(args, argparse.Namespace):
        args = add_arguments(argparse.ArgumentParser(prog="osd route", description=__doc__)).parse_args(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = evaluate(args)
    _print(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=float))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
