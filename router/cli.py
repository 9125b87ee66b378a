"""``osd route``: route every record of a workload; accuracy per label, confusion, latency.

The classifier is trained on ``--train`` minus every record whose text appears in the evaluated
workload (or in an ``--exclude`` file), so accuracy is measured on examples not used to train.
Topic accuracy compares the classifier's label with ``domain``; language accuracy compares the
language id with ``lang``, overall and on chatterbot-sourced records (their label is the corpus'
language folder: ground truth; ShareGPT labels were themselves made by py3langid). As the
workload holds few non-English chatterbot records, ``--lang-corpus chatterbot`` also scores the
language id on every first turn of the chatterbot-corpus wheel (about 4300 texts, 26 languages).
Latency is single-query ``Router.route`` after a warm-up, per query.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np
from sklearn.metrics import accuracy_score, classification_report, confusion_matrix

from config import RouterConfig

DATA = Path(__file__).resolve().parent.parent / "bench" / "data"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--workload", default=str(DATA / "workload.jsonl"), help="records to route (JSONL)")
    p.add_argument("--train", default=str(DATA / "train.jsonl"), help="labelled records for the classifier")
    p.add_argument("--exclude", nargs="*", default=[], help="more workload files whose texts are never trained on")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--mode", choices=["supervised", "clusters", "both"], default="both")
    p.add_argument("--confidence-threshold", type=float, default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="MiniLM input length (RouterConfig.max_tokens)")
    p.add_argument("--quantize", action="store_true", help="int8 MiniLM (RouterConfig.quantize)")
    p.add_argument("--load", default=None, help="route with a router saved by --save instead of training one")
    p.add_argument("--save", default=None, help="save the trained router (after routing) to this folder")
    p.add_argument("--warmup", type=int, default=10, help="queries embedded before timing")
    p.add_argument("--lang-corpus", choices=["chatterbot", "none"], default="chatterbot",
                   help="also score language id on the whole chatterbot-corpus wheel (pip-downloaded once)")
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
    from workloads import load_workload
    from router.router import Router

    records = load_workload(args.workload)
    report: dict = {"workload": args.workload, "n_records": len(records)}
    if args.load:
        router = Router.load(args.load)
    else:
        overrides = {"mode": args.mode, "quantize": args.quantize}
        for key in ("confidence_threshold", "max_tokens"):
            if getattr(args, key) is not None:
                overrides[key] = getattr(args, key)
        router = Router(RouterConfig(**overrides))
        banned = {r.text for f in [args.workload, *args.exclude] for r in load_workload(f)}
        pool = [r for r in load_workload(args.train) if r.domain != "unknown"]
        train = [r for r in pool if r.text not in banned]
        t0 = time.perf_counter()
        router.fit([r.text for r in train], [r.domain for r in train],
                   [r.lang for r in train] if args.lang_prior else None)
        report["train"] = {"file": args.train, "n": len(train), "excluded_as_in_workload": len(pool) - len(train),
                           "domains": dict(Counter(r.domain for r in train)), "fit_s": time.perf_counter() - t0}
    cfg = router.cfg
    report["config"] = cfg.model_dump(mode="json")

    # warm-up (features only: the routing state is not touched), then one query at a time
    router.extractor.extract([r.text for r in records[: args.warmup]])
    routes, ms = [], []
    for r in records:
        t0 = time.perf_counter()
        routes.append(router.route(r.text))
        ms.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    router.extractor.extract([r.text for r in records])
    report["latency_ms"] = {**_percentiles(ms),
                            "batched_features_per_query": (time.perf_counter() - t0) * 1e3 / max(len(records), 1)}

    # topic: the classifier's label (also where it was unsure) against `domain`
    labelled = [(r.domain, x.topic) for r, x in zip(records, routes) if r.domain != "unknown" and x.topic]
    if labelled:
        truth, pred = map(list, zip(*labelled))
        labels = sorted(set(truth) | set(pred))
        cm = confusion_matrix(truth, pred, labels=labels)
        report["topic"] = {
            "n": len(truth), "accuracy": float(accuracy_score(truth, pred)),
            "below_threshold": sum(x.confidence < cfg.confidence_threshold for x in routes if x.topic) / len(truth),
            "per_label": {k: v for k, v in classification_report(truth, pred, labels=labels, output_dict=True,
                                                                 zero_division=0).items() if k in labels},
            "confusion": {"labels": labels, "matrix": cm.tolist()},
            "errors": [{"text": r.text[:120], "domain": r.domain, "predicted": x.topic, "confidence": x.confidence,
                        "source": r.source} for r, x in zip(records, routes)
                       if x.topic and r.domain not in ("unknown", x.topic)][:20],
        }

    # language: overall, and on chatterbot records whose label is ground truth
    langs = [(r.lang, x.lang, r.source) for r, x in zip(records, routes) if r.lang != "und"]
    bot = [(t, p) for t, p, s in langs if s.startswith("chatterbot:")]
    report["language"] = {"overall": _lang_scores([t for t, _, _ in langs], [p for _, p, _ in langs]),
                          "chatterbot": _lang_scores([t for t, _ in bot], [p for _, p in bot])}
    if args.lang_corpus == "chatterbot":
        seen = {r.text for r in load_workload(args.train)}  # the language prior's training texts
        corpus = [r for r in _chatterbot_corpus() if r.text not in seen]
        pred = [router.extractor.language(r.text)[0] for r in corpus]
        scores = _lang_scores([r.lang for r in corpus], pred)
        lengths = np.array([len(r.text) for r in corpus])
        right = np.array([r.lang == p for r, p in zip(corpus, pred)])
        buckets = {"<20 chars": (0, 20), "20-49 chars": (20, 50), ">=50 chars": (50, np.inf)}
        scores["by_length"] = {name: {"accuracy": float(right[m].mean()), "n": int(m.sum())}
                               for name, (lo, hi) in buckets.items() if (m := (lengths >= lo) & (lengths < hi)).any()}
        report["language"]["chatterbot_corpus"] = scores

    report["routes"] = {k: dict(Counter(getattr(x, k) for x in routes)) for k in ("draft_id", "domain", "reason")}
    report["router"] = router.summary()
    if args.save:
        router.save(args.save)
    return report


def _print(report: dict) -> None:
    lat = report["latency_ms"]
    if "train" in report:
        tr = report["train"]
        print(f"trained on {tr['n']} records of {tr['file']} ({tr['excluded_as_in_workload']} left out: "
              f"in the evaluated workload) in {tr['fit_s']:.1f} s")
    if "topic" in report:
        t = report["topic"]
        print(f"\ntopic accuracy {t['accuracy']:.3f} on {t['n']} records "
              f"({t['below_threshold']:.1%} below the confidence threshold)")
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
    print(f"routes by draft: {report['routes']['draft_id']}; by reason: {report['routes']['reason']}")


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
