"""The paper's mixture of drafts, in-process: one shared draft against one draft per query mode.

A mixed stream (topics and languages interleaved, seeded) is served three ways, each with the same
online learner settings (a round every ``train_every`` records, on the draft with the most
traffic x lost acceptance), all drafts starting from the same weights:

* ``single``: every query to one draft, trained on everything (the baseline).
* ``supervised``: the :class:`router.Router` classifier (trained beforehand on labelled records
  that are NOT in the stream) names the domain; each domain it names ("sql", "chat/es", ...)
  gets its own draft the first time it is seen, forked from the general draft's current weights,
  and trains on its own shard. Unsure queries go to the general draft.
* ``clusters``: no labels; the router's online clusters (split by language) discover the modes and
  spawn a draft for a busy cluster with poor acceptance (and retire idle ones), forked from the
  general draft; everything else stays on the general draft, which keeps training.

The bandit picks among a domain's drafts by observed acceptance. Reported per method and per label
(``domain``, or ``chat/<lang>`` for chat): alpha over the stream (window curves), alpha over the
last ``window`` records of the label and over the second half of the stream; route accuracy for
the supervised router; drafts spawned and retired. Alpha of a request is accepted / proposed draft
tokens at a fixed k (greedy), as in :mod:`bench.experiments`.
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch

from bench.harness import ANY_SOURCE, _alpha, _draft_of, _force_k, real_engine_factory, serve_recorded
from config import RouterConfig, SamplingParams
from learner.replay import ShardConfig
from learner.trainer import DraftTrainer, LearnerConfig, OnlineLearner

__all__ = ["METHODS", "label_of", "mixed_stream", "run_mixture", "format_mixture", "plot_mixture"]

METHODS = ("single", "supervised", "clusters")
GENERAL = "general"


def label_of(rec) -> str:
    """The mode a record belongs to: its domain; chat is split by language ("chat/es")."""
    d = getattr(rec, "domain", "unknown") or "unknown"
    lang = getattr(rec, "lang", "und") or "und"
    return f"chat/{lang}" if d == "chat" else d


def same_mode(route_domain: str, label: str, base_lang: str = "en") -> bool:
    """Whether the router's domain names the record's label ("chat" is chat in the base language)."""
    return route_domain == label or f"{route_domain}/{base_lang}" == label


def mixed_stream(records: Sequence[Any], n_per_label: int | None, seed: int = 0) -> list[Any]:
    """Up to ``n_per_label`` records of each label, shuffled together (seeded)."""
    by: dict[str, list] = {}
    for r in records:
        by.setdefault(label_of(r), []).append(r)
    out = [r for rs in by.values() for r in (rs if n_per_label is None else rs[:n_per_label])]
    random.Random(f"mixture/{seed}").shuffle(out)
    return out


class _Drafts:
    """The engines of one method: one per draft, all sharing the target; plus their trainers."""

    def __init__(self, engine_factory: Callable[[], Any], learner: OnlineLearner, cfg: LearnerConfig, k: int | None,
                 controller: bool = False):
        self.factory, self.learner, self.cfg, self.k = engine_factory, learner, cfg, k
        self.controller = controller
        self.engines: dict[str, Any] = {}
        self.spawned: list[dict] = []
        self.retired: list[dict] = []

    def add(self, draft_id: str, parent: str | None = None, at: int = 0, domain: str | None = None) -> Any:
        eng = self.factory()
        _force_k(eng, self.k)
        dp = _draft_of(eng)
        if parent is not None:  # fork: the parent's current weights
            src = _draft_of(self.engines[parent]).runner.model.state_dict()
            dp.load_state_dict({n: t.detach().clone() for n, t in src.items()}, 0)
            self.spawned.append({"draft": draft_id, "parent": parent, "at": at, "domain": domain})
        if self.controller:  # this draft's own suffix tree and prompt lookup beside it, chosen per step
            from drafts.build import controller_over

            eng.proposer = controller_over(dp)
        self.engines[draft_id] = eng
        self.learner.add_trainer(DraftTrainer(draft_id, dp.runner.model, self.cfg, keep_ids=dp.runner.vocab_map))
        return eng

    def retire(self, draft_id: str, at: int, reason: str) -> None:
        if draft_id == GENERAL or draft_id not in self.engines:
            return
        self.engines.pop(draft_id)
        self.learner.remove_trainer(draft_id)
        self.retired.append({"draft": draft_id, "at": at, "reason": reason})

    def subscribers(self) -> dict[str, list]:
        return {d: [e.swap_draft] for d, e in self.engines.items()}


def _run_method(method, engine_factory, stream, learner_cfg, router, *, max_tokens, k, window, log,
                controller: bool = False) -> dict:
    learner = OnlineLearner(learner_cfg, ShardConfig())
    drafts = _Drafts(engine_factory, learner, learner_cfg, k, controller)
    drafts.add(GENERAL)
    params = SamplingParams(max_tokens=max_tokens)
    rows, curves = [], {}
    wins: dict[str, deque] = {}
    t0 = time.perf_counter()
    for i, rec in enumerate(stream, start=1):
        label = label_of(rec)
        route = router.route(rec.text) if router is not None else None
        if route is not None and method == "supervised" and route.domain != "unknown" and route.domain not in router.drafts.values():
            d_id = f"d:{route.domain}"  # a named domain (chat/es too) seen for the first time gets its own draft
            router.register_draft(d_id, route.domain)
            drafts.add(d_id, parent=GENERAL, at=i, domain=route.domain)  # used from the next query on
        if router is not None:
            for ev in router.events():
                if ev.kind == "spawn":
                    drafts.add(ev.draft_id, parent=ev.parent or GENERAL, at=i, domain=ev.domain)
                else:
                    drafts.retire(ev.draft_id, i, ev.reason)
        draft_id = route.draft_id if route is not None and route.draft_id in drafts.engines else GENERAL
        record, acc, prop, _ = serve_recorded(drafts.engines[draft_id], rec.text, params, domain=label,
                                              draft_id=draft_id, probs_dtype=torch.float16, sources=ANY_SOURCE)
        learner.observe(record)
        rep = learner.maybe_train(drafts.subscribers())
        if route is not None:
            router.observe(route, acc, prop)
        row = {"i": i, "label": label, "draft": draft_id, "accepted": acc, "proposed": prop, "alpha": _alpha(acc, prop)}
        if route is not None:
            row.update(route_domain=route.domain, reason=route.reason, confidence=round(route.confidence, 4))
        if rep is not None:
            row["round"] = {"draft": rep.draft_id, "accepted": rep.accepted, "steps": rep.steps, "version": rep.version}
        rows.append(row)
        w = wins.setdefault(label, deque(maxlen=window))
        w.append((acc, prop))
        curves.setdefault(label, []).append([i, _alpha(sum(a for a, _ in w), sum(p for _, p in w))])
        if log is not None and (i % 10 == 0 or i == len(stream)):
            log(f"[{method}] {i}/{len(stream)} drafts {sorted(drafts.engines)} ({time.perf_counter() - t0:.0f}s)")
    learner.close()
    labels = list(dict.fromkeys(r["label"] for r in rows))
    half = len(rows) // 2

    def a(rs):
        return _alpha(sum(r["accepted"] for r in rs), sum(r["proposed"] for r in rs))

    out = {
        "final_alpha_label": {lb: a([r for r in rows if r["label"] == lb][-window:]) for lb in labels},
        "second_half_alpha_label": {lb: a([r for r in rows[half:] if r["label"] == lb]) for lb in labels},
        "second_half_alpha": a(rows[half:]),
        "mean_alpha": a(rows),
        "rounds": len(learner.reports),
        "published": sum(1 for r in learner.reports if r.version is not None),
        "training_seconds": sum(r.seconds for r in learner.reports),
        "drafts_final": sorted(drafts.engines),
        "spawned": drafts.spawned,
        "retired": drafts.retired,
        "seconds": time.perf_counter() - t0,
        "curves": curves,
        "rows": rows,
    }
    if router is not None:
        out["router"] = router.summary()
        routed = [r for r in rows if r.get("route_domain") not in (None, "unknown")]
        if method != "clusters" and routed:
            out["route_accuracy"] = sum(same_mode(r["route_domain"], r["label"], router.cfg.base_lang) for r in routed) / len(routed)
            out["routed_share"] = len(routed) / len(rows)
    return out


def run_mixture(
    engine_factory: Callable[[], Any],
    records: Sequence[Any],
    train_records: Sequence[Any],
    learner_cfg: LearnerConfig = LearnerConfig(),
    router_cfg: RouterConfig = RouterConfig(),
    methods: Sequence[str] = METHODS,
    n_per_label: int | None = 20,
    max_tokens: int = 32,
    k: int | None = 4,
    window: int = 10,
    seed: int = 0,
    extractor=None,
    log: Callable[[str], None] | None = print,
    on_method: Callable[[dict], None] | None = None,
    controller: bool = False,
) -> dict:
    """See the module docstring. ``train_records`` (labelled, e.g. bench/data/train.jsonl) train the
    supervised router; any of their texts that is also in the stream is dropped first.
    ``engine_factory()`` returns a fresh engine (shared target, fresh copy of the starting draft).
    ``controller``: every draft runs beside a suffix tree of its own and prompt lookup, the
    controller choosing per step (alpha then counts every drafted step)."""
    from router import Router
    from router.features import FeatureExtractor

    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {list(METHODS)}")
    stream = mixed_stream(records, n_per_label, seed)
    if not stream:
        raise ValueError("empty stream")
    in_stream = {r.text for r in stream}
    train = [r for r in train_records if r.text not in in_stream]
    extractor = extractor if extractor is not None else FeatureExtractor(router_cfg)
    counts: dict[str, int] = {}
    for r in stream:
        counts[label_of(r)] = counts.get(label_of(r), 0) + 1
    res: dict[str, Any] = {}
    out = {"experiment": "mixture", "n_records": len(stream), "labels": counts, "train_records": len(train),
           "max_tokens": max_tokens, "k": k, "window": window, "seed": seed, "controller": controller,
           "learner": learner_cfg.model_dump(mode="json"), "router": router_cfg.model_dump(mode="json"), "methods": res}
    for m in methods:
        router = None
        if m != "single":
            router = Router(router_cfg.model_copy(update={"mode": m, "seed": seed}), extractor)
            if m == "supervised":
                router.fit([r.text for r in train], [r.domain for r in train])
        res[m] = _run_method(m, engine_factory, stream, learner_cfg, router, max_tokens=max_tokens, k=k,
                             window=window, log=log, controller=controller)
        if on_method is not None:  # e.g. write the JSON so far: a long run keeps what it measured
            on_method(out)
    return out


def format_mixture(result: dict) -> str:
    """Method x label alpha over the second half of the stream (and the last ``window`` records)."""
    labels = list(result["labels"])

    def f(v):
        return f"{v:.3f}" if isinstance(v, (int, float)) else "-"

    hdr = f"{'method':<12}" + "".join(f"{lb[:9]:>10}" for lb in labels) + f"{'all':>8}{'drafts':>8}{'route acc':>10}"
    lines = ["alpha over the second half of the stream (last-window alpha in the JSON)", hdr, "-" * len(hdr)]
    for m, e in result["methods"].items():
        lines.append(f"{m:<12}" + "".join(f"{f(e['second_half_alpha_label'].get(lb)):>10}" for lb in labels)
                     + f"{f(e['second_half_alpha']):>8}{len(e['drafts_final']):>8}{f(e.get('route_accuracy')):>10}")
    return "\n".join(lines)


def plot_mixture(result: dict, path) -> Any:
    """PNG: one panel per label, window alpha vs records processed, one line per method."""
    import math
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(result["labels"])
    cols = min(4, len(labels))
    rows_n = math.ceil(len(labels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.6 * cols, 2.8 * rows_n), squeeze=False, sharey=True)
    try:
        for ax, lb in zip(axes.flat, labels):
            for m, e in result["methods"].items():
                pts = [(x, y) for x, y in e["curves"].get(lb, []) if y is not None]
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], label=m, lw=1.3)
            ax.set_title(lb, fontsize=9)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(labels):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.supxlabel("records processed (whole stream)")
        fig.supylabel(f"alpha (last {result['window']} of the label)")
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def main(args) -> int:
    """``osd experiment mixture`` (argparse Namespace from bench.experiments.build_parser)."""
    from bench.bench import write_json
    from workloads import load_workload

    torch.set_num_threads(args.threads)
    records = load_workload(args.workload)
    train = load_workload(args.train)
    lcfg = LearnerConfig(train_every=args.train_every, batch_records=args.batch_records,
                         steps_per_round=args.steps_per_round, lr=args.lr, gate_margin=args.gate_margin,
                         holdout_fraction=args.holdout_fraction, positions=args.positions,
                         resample=not args.no_resample)
    rcfg = RouterConfig(spawn_min_records=args.spawn_min_records, spawn_window=args.spawn_window,
                        spawn_alpha=args.spawn_alpha, spawn_min_tokens=args.spawn_min_tokens, max_drafts=args.max_drafts)
    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    factory = real_engine_factory(args, texts=[r.text for r in records])
    result = run_mixture(factory, records, train, lcfg, rcfg, methods=[m for m in args.methods.split(",") if m],
                         n_per_label=args.n_per_label, max_tokens=args.max_tokens, k=args.k, window=args.window,
                         seed=args.seed, log=log, on_method=lambda r: write_json({**r, "workload": str(args.workload)}, args.json),
                         controller=args.controller)
    result["workload"] = str(args.workload)
    print(format_mixture(result))
    write_json(result, args.json)
    if args.png:
        print(f"wrote {plot_mixture(result, args.png)}")
    return 0
