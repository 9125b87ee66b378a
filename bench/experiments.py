"""The paper's experiments, in-process: acceptance (alpha) over a stream of requests.

* :func:`run_online` - the workload streamed once through a fresh engine per method:
  ``static`` (the starting draft, never updated), ``online`` (an :class:`learner.trainer.OnlineLearner`
  fed one :class:`learner.replay.ReplayRecord` per request, publishing into ``engine.swap_draft``)
  and ``offline`` (the upper bound: a draft distilled beforehand on the target's greedy outputs for
  ALL the stream's prompts, then streamed without updates).
  Proposers other than the token draft run as methods of their own on the same stream: ``target``
  (no proposer: the speed reference), ``lookup`` (prompt lookup), ``suffix`` (suffix trees over
  the stream served so far, learned online by construction) and ``controller`` (suffix tree,
  prompt lookup and the online-learned draft, chosen per step; ``controller-static`` the same with
  the draft not learning, the comparison for what learning adds to the served mix); their alpha counts every drafted
  step, whichever proposer drafted it. ``suffix@R`` runs the suffix tree as R draft replicas hold
  it: R trees, each request drafted by one drawn at random (seeded), each finished output handed
  to the other trees (``add_served``, as the draft pool shares it);
  ``suffix-split@R`` the same without sharing (``drafts.share_outputs_s: 0``): each tree learns
  from its 1/R of the traffic.
* :func:`run_shift` - the same, with the stream ordered in domain blocks; offline drafts trained
  on the first 30/50/70/100% of the stream; block boundaries are reported.
* :func:`plot` - alpha vs records processed, one line per method (block boundaries for shift).
* :func:`main` - ``python -m bench.experiments {online,shift} ...`` on the real engine.

Alpha of a request = accepted draft tokens / proposed draft tokens (greedy, fixed k unless
``adaptive``, so the draft proposes on every step that has budget). Each row also keeps the
request's output tokens and decoding seconds: tokens/s per method (and per domain) and its ratio to
the ``target`` method's are reported when ``target`` runs. ``turns`` > 1 makes each record a
conversation: turn t + 1 re-sends the history (user turns and the target's answers) with a
follow-up question, as chat clients and agents do; each turn is a request of its own. Curves are moving windows over the last ``window``
requests (token-weighted: sum accepted / sum proposed), sampled every ``eval_every`` requests.
Everything returned is JSON-serialisable.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Sequence

import torch
import yaml

from config import QUANTIZE_CHOICES, KPolicyConfig, SamplingParams, layer_list
from config.learner import SERVE_TRAINER
from learner.offline import DistillConfig, collect_teacher_data, distill
from learner.replay import LEARNED_SOURCES, ShardConfig
from learner.trainer import DraftTrainer, LearnerConfig, OnlineLearner
from speculative.stats import SpecStats

from .harness import (ANY_SOURCE, STEP_FIELDS, _alpha, _draft_of, _f, _force_k, real_engine_factory, rows_alpha,
                      serve_recorded, unseen_by)

__all__ = ["run_online", "run_shift", "plot", "main", "order_blocks", "stream", "format_table", "serve_recorded"]

DRAFT_ID = "draft"
DEFAULT_SHIFT_ORDER = ("sql", "math", "code", "chat")
DEFAULT_FRACTIONS = (0.3, 0.5, 0.7, 1.0)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _norm(records: Sequence[Any]) -> list[tuple[Any, str]]:
    """(prompt, domain) pairs from WorkloadRecords, dicts ({"text"|"prompt", "domain"}), (prompt, domain)
    tuples or bare prompts (text or token ids)."""
    out = []
    for r in records:
        if hasattr(r, "text"):
            out.append((r.text, getattr(r, "domain", "unknown") or "unknown"))
        elif isinstance(r, dict):
            p = r.get("prompt", r.get("text"))
            if p is None:
                raise ValueError(f"record without 'text' or 'prompt': {r!r}")
            out.append((p, r.get("domain") or "unknown"))
        elif isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], str):
            out.append((r[0], r[1]))
        else:
            out.append((r, "unknown"))
    if not out:
        raise ValueError("no records")
    return out


class _RoundBudget:
    """``should_yield`` for the learner: True once ``seconds`` have passed since :meth:`start`."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.t0 > self.seconds


def stream(engine, items: list[tuple[Any, str]], **kw: Any) -> dict:
    """:func:`stream_requests` (same arguments) run to its end: per-request rows and the window curves."""
    return _drain(stream_requests(engine, items, **kw))


def _drain(requests: Iterator[None]) -> Any:
    """Run a generator to its end and return what it returns."""
    while True:
        try:
            next(requests)
        except StopIteration as done:
            return done.value


def interleave(runs: Sequence[Iterator[None]]) -> list:
    """Advance ``runs`` (generators of :func:`stream_requests`) one request each in turn until all end;
    what each returned, in order. Each round starts one run later than the last, so that no run
    always follows the same one. Drift in the machine's speed then falls on every run alike."""
    out: list = [None] * len(runs)
    live = list(range(len(runs)))
    turn = 0
    while live:
        shift = turn % len(live)
        for i in live[shift:] + live[:shift]:
            try:
                next(runs[i])
            except StopIteration as done:
                out[i] = done.value
                live.remove(i)
        turn += 1
    return out


def stream_requests(
    engine,
    items: list[tuple[Any, str]],
    *,
    max_tokens: int,
    learner: OnlineLearner | None = None,
    budget: _RoundBudget | None = None,
    eval_every: int = 1,
    window: int = 20,
    ignore_eos: bool = False,
    log: Callable[[str], None] | None = print,
    label: str = "",
    sources: tuple[str, ...] = ("draft",),
    turns: int = 1,
    replicas: _Replicas | None = None,
) -> Generator[None, None, dict]:
    """Stream ``items`` through ``engine`` (greedy); with a learner, observe each request's record and
    train (subscriber: ``engine.swap_draft``). Alpha counts the steps ``sources`` drafted. With
    ``turns`` > 1 every item is a conversation of that many requests; with ``replicas`` each
    request is drafted by one replica's proposer. A generator: it yields after each request (and
    its learner round), which :func:`interleave` advances, and returns per-request rows and the
    window curves (:func:`stream` runs it to its end)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    subs = [engine.swap_draft] if engine.learned_draft is not None else []
    win: deque[tuple[int, int]] = deque(maxlen=window)
    dwin: dict[str, deque[tuple[int, int]]] = {}
    rows, curve, dcurve = [], [], {}
    by_domain: dict[str, dict[str, dict]] = {}  # domain -> source -> step sums
    t_start = time.perf_counter()
    requests = _Conversation(engine, items, turns)
    total = len(items) * turns  # requests
    for i, (prompt, domain, turn) in enumerate(requests, start=1):
        counted = SpecStats()
        replica = replicas.route() if replicas is not None else None
        started = time.time()
        rec, acc, prop, gen = serve_recorded(engine, prompt, params, domain=domain, draft_id=DRAFT_ID, sources=sources,
                                             stats=counted, by_source=by_domain.setdefault(domain, {}))
        requests.send(gen.text)  # the next turn of a conversation answers it
        if replicas is not None:
            replicas.finished(i, gen.token_ids, domain)
        draft = engine.learned_draft
        row = {"i": i, "domain": domain, "accepted": acc, "proposed": prop, "rejected": counted.rejected,
               "alpha": _alpha(acc, prop),
               "tokens": len(gen.token_ids), "seconds": gen.seconds, "started": started, "turn": turn,
               "draft_version": int(draft.version) if draft is not None else 0}
        if replica is not None:
            row["replica"] = replica
        if learner is not None:
            learner.observe(rec)
            if budget is not None:
                budget.start()
            rep = learner.maybe_train(subs)
            if rep is not None:
                row["round"] = {"accepted": rep.accepted, "steps": rep.steps, "seconds": rep.seconds,
                                "version": rep.version, "reason": rep.reason}
        rows.append(row)
        win.append((acc, prop))
        dwin.setdefault(domain, deque(maxlen=window)).append((acc, prop))
        if i % eval_every == 0 or i == total:
            a = _alpha(sum(x for x, _ in win), sum(y for _, y in win))
            curve.append([i, a])
            da = _alpha(sum(x for x, _ in dwin[domain]), sum(y for _, y in dwin[domain]))
            dcurve.setdefault(domain, []).append([i, da])
            if log is not None:
                v = row["draft_version"]
                log(f"[{label}] {i}/{total} {domain}: alpha {row['alpha'] if row['alpha'] is None else round(row['alpha'], 3)}"
                    f" window {a if a is None else round(a, 3)} (draft v{v}, {time.perf_counter() - t_start:.1f}s)")
        yield
    return {"rows": rows, "curve": curve, "domain_curves": dcurve, "by_source": _sum_steps(by_domain.values()),
            "by_domain_source": by_domain}


def _sum_steps(parts) -> dict[str, dict]:
    """Several ``by_source`` dicts (source -> step sums) added up into one."""
    out: dict[str, dict] = {}
    for part in parts:
        for src, st in part.items():
            acc = out.setdefault(src, dict.fromkeys(STEP_FIELDS, 0))
            for f in STEP_FIELDS:
                acc[f] += st[f]
    return out


class _Replicas:
    """R copies of a proposer that learns from traffic, as R draft replicas hold them: each request
    is drafted by a copy drawn at random (seeded, so shared and split runs draw the same), as
    Serve's router spreads requests (round-robin would hand each replica whole domains of a stream
    whose domains interleave); with ``share`` its finished output reaches the other copies before
    the next request (the draft pool broadcasts within ``drafts.share_outputs_s``)."""

    def __init__(self, engine, proposers: list, share: bool, seed: int = 0):
        self.engine, self.proposers, self.share = engine, proposers, share
        self.rng, self.current = random.Random(seed), 0
        engine.proposer = proposers[0]

    def route(self) -> int:
        self.current = self.rng.randrange(len(self.proposers))
        self.engine.proposer = self.proposers[self.current]
        return self.current

    def finished(self, i: int, output: Sequence[int], scope: str) -> None:
        if self.share:
            for j, p in enumerate(self.proposers):
                if j != self.current:
                    p.add_served(f"request-{i}", output, scope)


def _replicas_of(method: str) -> tuple[int, bool] | None:
    """``suffix@R`` -> (R, shared), ``suffix-split@R`` -> (R, not shared); None for other methods."""
    name, at, r = method.partition("@")
    if name not in ("suffix", "suffix-split") or not at:
        return None
    if not r.isdigit() or int(r) < 1:
        raise ValueError(f"unknown method {method!r} ({name}@<replicas >= 1>)")
    return int(r), name == "suffix"


#: follow-ups of a conversation's later turns (``turns`` > 1): what users and agent loops send next
FOLLOW_UPS = (
    "Please give that answer again, but shorter.",
    "Check your answer above and write out the final version in full.",
    "Repeat the most important part of your answer and explain it in one sentence.",
)


class _Conversation:
    """The requests of a stream: each item once (``turns`` = 1), or as a conversation whose next
    turn is built from the answer :meth:`send` receives (chat history + a follow-up)."""

    def __init__(self, engine, items, turns: int):
        if turns < 1:
            raise ValueError("turns must be >= 1")
        self.engine, self.items, self.turns = engine, items, turns
        self.answer: str | None = None

    def send(self, text: str) -> None:
        self.answer = text

    def __iter__(self):
        from speculative.models import encode_messages

        for prompt, domain in self.items:
            if self.turns <= 1:
                yield prompt, domain, 1
                continue
            messages = [{"role": "user", "content": prompt}]
            for t in range(self.turns):
                yield encode_messages(self.engine.tokenizer, messages), domain, t + 1
                messages += [{"role": "assistant", "content": self.answer or ""},
                             {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]


def token_acceptance(rows: Sequence[dict]) -> float | None:
    """Per-token acceptance over request rows: accepted / (accepted + rejected) (see
    :mod:`speculative.stats`); None for rows without rejection counts (streams stored before
    they were kept) or without drafted tokens."""
    if any("rejected" not in r for r in rows):
        return None
    return _alpha(sum(r["accepted"] for r in rows), sum(r["accepted"] + r["rejected"] for r in rows))


def _summary(res: dict, window: int) -> dict:
    rows = res["rows"]
    a = rows_alpha

    def tps(rs):
        s = sum(r.get("seconds", 0.0) for r in rs)
        return sum(r["tokens"] for r in rs) / s if s else None

    domains = list(dict.fromkeys(r["domain"] for r in rows))
    by_dom = {d: [r for r in rows if r["domain"] == d] for d in domains}
    return {
        "token_acceptance": token_acceptance(rows),
        "second_half_token_acceptance": token_acceptance(rows[len(rows) // 2:]),
        "token_acceptance_domain": {d: token_acceptance(rs) for d, rs in by_dom.items()},
        "final_alpha": a(rows[-window:]),
        "final_alpha_domain": {d: a(rs[-window:]) for d, rs in by_dom.items()},
        "mean_alpha": a(rows),
        "second_half_alpha": a(rows[len(rows) // 2:]),
        "mean_alpha_domain": {d: a(rs) for d, rs in by_dom.items()},
        "tokens_per_s": tps(rows),
        "tokens_per_s_domain": {d: tps(rs) for d, rs in by_dom.items()},
        "second_half_tokens_per_s": tps(rows[len(rows) // 2:]),
    }


def _speedups(out: dict) -> None:
    """Each method's tokens/s over the ``target`` method's (overall, second half, per domain)."""
    ref = out.get("target")
    if ref is None:
        return
    for e in out.values():
        e["speedup"] = e["tokens_per_s"] / ref["tokens_per_s"] if e["tokens_per_s"] and ref["tokens_per_s"] else None
        e["second_half_speedup"] = (e["second_half_tokens_per_s"] / ref["second_half_tokens_per_s"]
                                    if e["second_half_tokens_per_s"] and ref["second_half_tokens_per_s"] else None)
        e["speedup_domain"] = {d: (v / ref["tokens_per_s_domain"][d] if v and ref["tokens_per_s_domain"].get(d) else None)
                               for d, v in e["tokens_per_s_domain"].items()}


def _offline_train(engine, prompts: list, max_tokens: int, distill_cfg: DistillConfig, log) -> dict:
    """Distil the engine's serving draft in place on the target's greedy outputs for ``prompts``."""
    t0 = time.perf_counter()
    dp = _draft_of(engine)
    samples = collect_teacher_data(engine, None, prompts, max_tokens, distill_cfg.top_k,
                                   chat_template=engine.cfg.chat_template, log=None)
    t_collect = time.perf_counter() - t0
    model = dp.runner.model
    hist = distill(model, samples, distill_cfg, keep_ids=dp.runner.vocab_map, log=log)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    dp.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, 1)  # drop caches, version 1
    return {"collect_seconds": t_collect, "train_seconds": hist["seconds"], "seconds": time.perf_counter() - t0,
            "samples": len(samples), "steps": hist["steps"], "agreement_before": hist["agreement_before"],
            "agreement_after": hist["agreement_after"], "prompts": len(prompts)}


def _run_methods(
    engine_factory: Callable[[], Any],
    items: list[tuple[Any, str]],
    methods: Sequence[str],
    learner_cfg: LearnerConfig,
    *,
    offline_prompts: dict[str, list] ,
    distill_cfg: DistillConfig,
    max_tokens: int,
    k: int | None,
    eval_every: int,
    window: int,
    seconds_per_round: float | None,
    ignore_eos: bool,
    log,
    adaptive: bool = False,
    turns: int = 1,
    interleaved: bool = False,
) -> dict:
    """Each method's stream on a fresh engine, one method after another or, ``interleaved``, request
    by request in turn (:func:`interleave`; every engine is built first)."""
    out, runs = {}, []
    for m in methods:
        engine = engine_factory()
        if adaptive:  # the engine's k policy (k_max = k), on costs measured now
            engine.cfg = engine.cfg.model_copy(update={"k": KPolicyConfig(k_max=max(k or 1, 1))})
        else:
            _force_k(engine, k)
        entry: dict[str, Any] = {"training_seconds": 0.0, "rounds": 0, "accepted_rounds": 0, "rejected_rounds": 0,
                                 "versions_published": 0}
        learner = budget = replicas = None
        sources = LEARNED_SOURCES  # the learned draft's steps
        if m in PROPOSER_METHODS:
            engine.proposer = _method_proposer(m, engine)
            sources = ANY_SOURCE
        elif (rep := _replicas_of(m)) is not None:
            replicas = _Replicas(engine, [_method_proposer("suffix", engine) for _ in range(rep[0])], share=rep[1])
            entry["replicas"], entry["shared"] = rep
            sources = ANY_SOURCE
        if adaptive and engine.proposer is not None:
            engine.calibrate()
        if m in ("online", "controller"):
            dp = _draft_of(engine)
            budget = _RoundBudget(seconds_per_round)
            trainer = DraftTrainer(DRAFT_ID, dp.runner.model, learner_cfg, keep_ids=dp.runner.vocab_map,
                                   target_head=engine.target.model.get_output_embeddings())  # read with prompt_positions
            learner = OnlineLearner(learner_cfg, ShardConfig(), [trainer], should_yield=budget)
        elif m in PROPOSER_METHODS or replicas is not None:
            pass
        elif m in offline_prompts:
            if getattr(_draft_of(engine).runner.model, "uses_features", False):
                raise ValueError(f"{m}: offline distillation reads no target features; a feature draft learns online")
            if log:
                log(f"[{m}] distilling the offline draft on {len(offline_prompts[m])} prompts")
            off = _offline_train(engine, offline_prompts[m], max_tokens, distill_cfg, log)
            entry["offline"] = off
            entry["training_seconds"] = off["seconds"]
            entry["rounds"] = entry["accepted_rounds"] = 1
        elif m != "static":
            raise ValueError(f"unknown method {m!r}")
        run = stream_requests(engine, items, max_tokens=max_tokens, learner=learner, budget=budget,
                              eval_every=eval_every, window=window, ignore_eos=ignore_eos, log=log, label=m,
                              sources=sources, turns=turns, replicas=replicas)
        if interleaved:
            runs.append((m, engine, entry, learner, run))
        else:  # this method's whole stream before the next method's engine is built
            out[m] = _finish_method(m, engine, entry, learner, _drain(run), window)
    if interleaved:
        for (m, engine, entry, learner, _), res in zip(runs, interleave([r[-1] for r in runs])):
            out[m] = _finish_method(m, engine, entry, learner, res, window)
    _speedups(out)
    return out


def _finish_method(m: str, engine, entry: dict, learner, res: dict, window: int) -> dict:
    """A method's entry of the result from its stream ``res``: learner rounds, summary, rows, steps."""
    if learner is not None:
        reps = learner.reports
        entry["training_seconds"] = sum(r.seconds for r in reps)
        entry["rounds"] = len(reps)
        entry["accepted_rounds"] = sum(1 for r in reps if r.accepted and r.steps > 0)
        entry["rejected_rounds"] = sum(1 for r in reps if not r.accepted)
        entry["versions_published"] = sum(1 for r in reps if r.version is not None)
        entry["reports"] = [r.to_dict() for r in reps]
        learner.close()
    entry.update(_summary(res, window))
    entry.update(curve=res["curve"], domain_curves=res["domain_curves"], rows=res["rows"], by_source=res["by_source"],
                 by_domain_source=res["by_domain_source"], costs=_costs(engine))
    if m in ("controller", "controller-static"):
        entry["picks"] = dict(engine.proposer.picks)
    return entry


def _costs(engine) -> dict:
    """The engine's cost model as the stream left it: v(j) (verifying j tokens over one) and c per
    source (draft seconds per token over one target step), what the k policy and the controller
    decided by."""
    costs = engine.costs
    return {"v": {str(j): costs.relative_verify(j) for j in sorted(costs.verify_s)},
            "c": {src: costs.c(src) for src in sorted(costs.draft_s)},
            "verify_s": {str(j): s for j, s in sorted(costs.verify_s.items())}}


#: methods that replace the token draft with another proposer (see the module docstring)
PROPOSER_METHODS = ("target", "lookup", "suffix", "controller", "controller-static")


def _method_proposer(method: str, engine):
    from config import NgramConfig, SuffixConfig
    from drafts.build import controller_over
    from speculative.proposers import NgramProposer
    from speculative.suffix import SuffixProposer

    if method == "target":
        return None
    if method == "lookup":
        return NgramProposer(NgramConfig())
    if method == "suffix":
        return SuffixProposer(SuffixConfig())
    return controller_over(_draft_of(engine))


def _check_common(methods, eval_every, window, max_tokens):
    if not methods:
        raise ValueError("no methods")
    if eval_every < 1 or window < 1 or max_tokens < 1:
        raise ValueError("eval_every, window and max_tokens must be >= 1")


# ---------------------------------------------------------------------------------------------
# experiments
# ---------------------------------------------------------------------------------------------


def run_online(
    engine_factory: Callable[[], Any],
    records: Sequence[Any],
    learner_cfg: LearnerConfig = LearnerConfig(),
    methods: Sequence[str] = ("static", "online", "offline"),
    eval_every: int = 1,
    max_tokens: int = 32,
    k: int | None = 4,
    window: int = 20,
    seconds_per_round: float | None = None,
    distill_cfg: DistillConfig | None = None,
    ignore_eos: bool = False,
    log: Callable[[str], None] | None = print,
    adaptive: bool = False,
    turns: int = 1,
    interleaved: bool = False,
) -> dict:
    """Alpha over the stream for static / online / offline (bound trained on ALL prompts) /
    ``offline@<pct>`` (trained on the first pct% only: over the rest of the stream it measures
    what offline training on this domain's earlier prompts carries over to new ones).

    ``engine_factory()`` must return a fresh engine with a fresh copy of the same starting draft.
    ``interleaved``: the methods serve the stream request by request in turn (:func:`interleave`).
    ``k``: fixed draft length (None keeps the engine's policy). ``seconds_per_round``: wall budget
    of one online round (None: ``learner_cfg.steps_per_round`` steps). ``distill_cfg``: the
    offline bound's training (default: 3 epochs, lr = learner lr x 10, <= 120 s).
    """
    items = _norm(records)
    offline = {m: [p for p, _ in items[: _offline_count(m, len(items))]] for m in methods if m.startswith("offline")}
    return _run_stream("online", engine_factory, items, learner_cfg, methods, offline, {}, eval_every=eval_every,
                       max_tokens=max_tokens, k=k, window=window, seconds_per_round=seconds_per_round,
                       distill_cfg=distill_cfg, ignore_eos=ignore_eos, log=log, adaptive=adaptive, turns=turns,
                       interleaved=interleaved)


def paired_gain(result: dict, method: str, base: str = "static", start: int | None = None) -> dict:
    """Per-record alpha of ``method`` minus that of ``base`` on the same records (the stream is
    deterministic), over records ``start``.. (default: the second half): mean, standard error, n."""
    a, b = result["methods"][method]["rows"], result["methods"][base]["rows"]
    if [r["i"] for r in a] != [r["i"] for r in b]:
        raise ValueError(f"{method} and {base} did not serve the same records")
    start = len(a) // 2 if start is None else start
    d = [x["accepted"] / x["proposed"] - y["accepted"] / y["proposed"]
         for x, y in zip(a[start:], b[start:]) if x["proposed"] and y["proposed"]]
    sd = statistics.stdev(d) if len(d) > 1 else float("nan")
    return {"mean": statistics.fmean(d) if d else float("nan"), "se": sd / math.sqrt(len(d)) if d else float("nan"), "n": len(d)}


def _offline_count(method: str, n: int) -> int:
    """Stream records an offline method trains on: "offline" all, "offline@<pct>" the first pct%."""
    if method == "offline":
        return n
    pct = method.partition("@")[2]
    if not pct.isdigit() or not 0 < int(pct) <= 100:
        raise ValueError(f"unknown method {method!r} (offline or offline@<1..100>)")
    return max(1, round(int(pct) / 100 * n))


def order_blocks(records: Sequence[Any], order: Sequence[str] | None = DEFAULT_SHIFT_ORDER) -> tuple[list[tuple[Any, str]], list[dict]]:
    """The records ordered in domain blocks (file order inside a block); domains not in ``order``
    follow in first-seen order. Returns (items, boundaries [{"domain", "start", "end"}]) with
    ``start`` = records seen before the block (0-based), ``end`` = records seen after it."""
    items = _norm(records)
    seen = list(dict.fromkeys(d for _, d in items))
    order = [d for d in (order or ()) if d in seen] + [d for d in seen if d not in (order or ())]
    out, bounds = [], []
    for d in order:
        blk = [it for it in items if it[1] == d]
        bounds.append({"domain": d, "start": len(out), "end": len(out) + len(blk)})
        out.extend(blk)
    return out, bounds


def run_shift(
    engine_factory: Callable[[], Any],
    records: Sequence[Any],
    learner_cfg: LearnerConfig = LearnerConfig(),
    order: Sequence[str] | None = DEFAULT_SHIFT_ORDER,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    methods: Sequence[str] | None = None,
    eval_every: int = 1,
    max_tokens: int = 32,
    k: int | None = 4,
    window: int = 20,
    seconds_per_round: float | None = None,
    distill_cfg: DistillConfig | None = None,
    ignore_eos: bool = False,
    log: Callable[[str], None] | None = print,
    adaptive: bool = False,
    turns: int = 1,
    interleaved: bool = False,
) -> dict:
    """Domain-shift stream (blocks in ``order``): static, online, and ``offline@<pct>`` drafts
    trained on the first ``fraction`` of the stream. ``boundaries`` mark the blocks."""
    items, bounds = order_blocks(records, order)
    if any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"fractions must be in (0, 1], got {list(fractions)}")
    offline = {f"offline@{round(f * 100)}": [p for p, _ in items[: max(1, round(f * len(items)))]] for f in fractions}
    methods = list(methods) if methods is not None else ["static", "online", *offline]
    extra = {"order": [b["domain"] for b in bounds], "boundaries": bounds, "fractions": list(fractions)}
    return _run_stream("shift", engine_factory, items, learner_cfg, methods, offline, extra, eval_every=eval_every,
                       max_tokens=max_tokens, k=k, window=window, seconds_per_round=seconds_per_round,
                       distill_cfg=distill_cfg, ignore_eos=ignore_eos, log=log, adaptive=adaptive, turns=turns,
                       interleaved=interleaved)


def _run_stream(experiment, engine_factory, items, learner_cfg, methods, offline, extra, *, eval_every, max_tokens,
                k, window, seconds_per_round, distill_cfg, ignore_eos, log, adaptive=False, turns=1,
                interleaved=False) -> dict:
    """What online and shift share: the default offline training, the methods' runs, the report."""
    _check_common(methods, eval_every, window, max_tokens)
    distill_cfg = distill_cfg or DistillConfig(max_tokens=max_tokens, seconds=120.0, epochs=3, warmup_steps=0,
                                               lr=min(learner_cfg.lr * 10, 1e-2), log_every=1000)
    res = _run_methods(engine_factory, items, methods, learner_cfg, offline_prompts=offline, distill_cfg=distill_cfg,
                       max_tokens=max_tokens, k=k, eval_every=eval_every, window=window,
                       seconds_per_round=seconds_per_round, ignore_eos=ignore_eos, log=log, adaptive=adaptive,
                       turns=turns, interleaved=interleaved)
    return {"experiment": experiment, "n_records": len(items), "turns": turns, "adaptive": adaptive,
            "interleaved": interleaved, **extra,
            "domains": list(dict.fromkeys(d for _, d in items)), "max_tokens": max_tokens, "k": k,
            "eval_every": eval_every, "window": window, "learner": json.loads(learner_cfg.model_dump_json()),
            "distill": json.loads(distill_cfg.model_dump_json()), "methods": res}


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------


def plot(result: dict, path: str | Path) -> Path:
    """PNG: window alpha vs records processed, one line per method; block boundaries (shift) as
    dashed vertical lines labelled with the block's domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        for m, e in result["methods"].items():
            pts = [(x, y) for x, y in e["curve"] if y is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], label=m, lw=1.5)
        for b in result.get("boundaries", []):
            if b["start"] > 0:
                ax.axvline(b["start"] + 0.5, color="grey", ls="--", lw=1)
            ax.text(b["start"] + 1, 1.01, b["domain"], fontsize=8, va="bottom")
        ax.set_xlabel("records processed")
        ax.set_ylabel(f"alpha (window {result.get('window', '?')})")
        ax.set_ylim(0, 1.08)
        ax.set_title(f"{result.get('experiment', '')}: acceptance vs records")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path


def format_table(result: dict) -> str:
    """Method x domain final alpha (last ``window`` records), with training time and rounds."""
    doms = []
    for e in result["methods"].values():
        doms += [d for d in e["final_alpha_domain"] if d not in doms]

    def f(v):
        return f"{v:.3f}" if isinstance(v, (int, float)) else "-"

    hdr = (f"{'method':<13}" + "".join(f"{d[:8]:>9}" for d in doms)
           + f"{'all':>9}{'mean':>9}{'2nd half':>9}{'tok/s':>8}{'speedup':>8}{'train s':>9}{'rounds':>8}{'acc/rej':>9}")
    lines = [hdr, "-" * len(hdr)]
    for m, e in result["methods"].items():
        lines.append(f"{m:<13}" + "".join(f"{f(e['final_alpha_domain'].get(d)):>9}" for d in doms)
                     + f"{f(e['final_alpha']):>9}{f(e['mean_alpha']):>9}{f(e.get('second_half_alpha')):>9}"
                     + f"{f(e.get('tokens_per_s')):>8}{f(e.get('speedup')):>8}{e['training_seconds']:>9.1f}{e['rounds']:>8}"
                     + f"{str(e['accepted_rounds']) + '/' + str(e['rejected_rounds']):>9}")
    return "\n".join(lines)


def report(result: dict, segment: int = 20) -> str:
    """Per method, from the per-request rows: alpha per domain and overall (whole stream and second
    half), the share of output tokens that came from accepted drafts, alpha per ``segment``
    requests and per conversation turn, tokens/s per domain and the ratio to ``target``'s."""
    def alpha(rs):
        p = sum(r["proposed"] for r in rs)
        return f"{sum(r['accepted'] for r in rs) / p:.3f}" if p else "-"

    def tps(rs):
        s = sum(r.get("seconds", 0.0) for r in rs)
        return sum(r["tokens"] for r in rs) / s if s else None

    ref = result["methods"].get("target")
    lines = []
    for m, e in result["methods"].items():
        rows = e["rows"]
        half = rows[len(rows) // 2:]
        doms = list(dict.fromkeys(r["domain"] for r in rows))
        by = lambda rs, d: [r for r in rs if r["domain"] == d]  # noqa: E731
        tokens = sum(r["tokens"] for r in rows)
        lines.append(f"{m}: alpha {alpha(rows)} (second half {alpha(half)}), drafted "
                     f"{sum(r['accepted'] for r in rows) / tokens:.1%} of {tokens} tokens, "
                     f"rounds {e.get('accepted_rounds', 0)}/{e.get('rounds', 0)} published")
        if (whole := token_acceptance(rows)) is not None:
            lines.append(f"  per-token acceptance {_f(whole)} (second half {_f(token_acceptance(half))}): "
                         + ", ".join(f"{d} {_f(token_acceptance(by(rows, d)))}" for d in doms))
        lines.append("  alpha by domain: " + ", ".join(f"{d} {alpha(by(rows, d))} (2nd half {alpha(by(half, d))})" for d in doms))
        segs = [rows[i:i + segment] for i in range(0, len(rows), segment)]
        lines.append(f"  alpha per {segment} requests: " + " / ".join(alpha(s) for s in segs))
        if whole is not None:
            lines.append(f"  per-token acceptance per {segment} requests: " + " / ".join(_f(token_acceptance(s)) for s in segs))
        if any(r.get("turn", 1) > 1 for r in rows):
            turns = sorted({r["turn"] for r in rows})
            lines.append("  alpha by turn: " + " / ".join(alpha([r for r in rows if r["turn"] == t]) for t in turns))
        if all("seconds" in r for r in rows):
            speed = {d: tps(by(rows, d)) for d in doms} | {"all": tps(rows)}
            ratio = {}
            if ref is not None and all("seconds" in r for r in ref["rows"]):
                base = {d: tps(by(ref["rows"], d)) for d in doms} | {"all": tps(ref["rows"])}
                ratio = {d: v / base[d] for d, v in speed.items() if v and base.get(d)}
            lines.append("  tokens/s: " + ", ".join(f"{d} {v:.1f}" + (f" ({ratio[d]:.3f}x)" if d in ratio else "")
                                                     for d, v in speed.items() if v))
        steps = e.get("by_source") or {}
        if steps:
            lines.append("  steps by source (mean seconds a step): " + "; ".join(
                _step_line(src, st) for src, st in sorted(steps.items(), key=lambda kv: -kv[1]["steps"])))
        if (per_step := _tokens_per_step(rows, steps)) is not None:
            lines.append(f"  tokens a target step: {per_step:.3f} (counted, not timed)")
        other = _other_seconds(rows, steps)
        if other is not None:
            lines.append(f"  outside the draft and target calls (the engine's and proposers' own work): "
                         f"{other[0]:.2f} s, {1000 * other[1]:.2f} ms a step")
        net = _net_seconds(steps)
        if net:
            lines.append("  seconds saved against plain steps (tokens x a plain step - time spent): "
                         + ", ".join(f"{src} {v:+.2f}" for src, v in net.items()))
            per = {d: _net_seconds(bs) for d, bs in (e.get("by_domain_source") or {}).items()}
            if any(per.values()):
                lines.append("  the same by domain: " + "; ".join(
                    f"{d} " + ", ".join(f"{src} {v:+.2f}" for src, v in n.items()) for d, n in per.items() if n))
        if e.get("costs", {}).get("v"):
            c = e["costs"]
            lines.append("  cost model at the end: v(j) " + ", ".join(f"{j}: {v:.2f}" for j, v in c["v"].items())
                         + "".join(f"; c {src} {v:.3f}" for src, v in c["c"].items()))
    return "\n".join(lines)


def _tokens_per_step(rows: list[dict], by_source: dict) -> float | None:
    """Output tokens over target steps (every step is one target call): a method's gain counted,
    not timed; the machine's speed moves it only through the k policy's choices (None without steps)."""
    steps = sum(st["steps"] for st in by_source.values())
    return sum(r["tokens"] for r in rows) / steps if steps else None


def _other_seconds(rows: list[dict], by_source: dict) -> tuple[float, float] | None:
    """The requests' wall seconds not spent inside a draft or target call, in all and a step: what
    proposing, accepting and bookkeeping cost (None without steps or without request times)."""
    steps = sum(st["steps"] for st in by_source.values())
    if not steps or not all("seconds" in r for r in rows):
        return None
    other = sum(r["seconds"] for r in rows) - sum(st["draft_s"] + st["target_s"] for st in by_source.values())
    return other, other / steps


def _net_seconds(by_source: dict) -> dict[str, float]:
    """What each drafting source of ``by_source`` saved: the tokens its steps emitted (steps +
    accepted) at the mean time of a plain step ("none"), minus the draft and target seconds they
    took. Negative: plain decoding would have been faster. Empty without plain steps to compare."""
    plain = by_source.get("none")
    if not plain or not plain["steps"]:
        return {}
    t = plain["target_s"] / plain["steps"]
    return {src: (st["steps"] + st["accepted"]) * t - st["draft_s"] - st["target_s"]
            for src, st in sorted(by_source.items(), key=lambda kv: -kv[1]["steps"]) if src not in ("none", "prefill")}


def _step_line(source: str, st: dict) -> str:
    """One source's steps of ``by_source`` for :func:`report`."""
    n = st["steps"]
    text = f"{source} {n}" + (f" ({st['accepted']}/{st['proposed']} accepted)" if st["proposed"] else "")
    text += f", target {1000 * st['target_s'] / n:.1f} ms"
    return text + (f" + draft {1000 * st['draft_s'] / n:.1f} ms" if st["draft_s"] else "")


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="osd experiment", description="online / shift acceptance experiments")
    sub = ap.add_subparsers(dest="cmd", metavar="{online,shift,overhead,mixture,report}")
    sub.required = True
    default_wl = Path(__file__).resolve().parent / "data" / "workload.jsonl"
    # the learner's defaults are the server's (config.learner.SERVE_TRAINER): an experiment shows
    # what a fresh `make run` would learn
    t = SERVE_TRAINER
    for name, help_ in (("online", "static vs online vs offline-bound draft on one stream"),
                        ("shift", "domain-block stream; offline drafts on the first 30/50/70/100%")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--workload", nargs="+", default=[str(default_wl)],
                       help="workload JSONL file(s) (the format of the workloads package); several: in order, each text once")
        p.add_argument("--n", type=int, default=40, help="records (round-robin over domains, bench.select)")
        p.add_argument("--domains", nargs="*", default=None, help="keep only these domains")
        p.add_argument("--sources", nargs="*", default=None,
                       help="keep only records of these sources (the part of a record's source before ':')")
        p.add_argument("--max-tokens", type=int, default=48)
        p.add_argument("--k", type=int, default=4, help="fixed draft length (with --adaptive: the k policy's k_max)")
        p.add_argument("--adaptive", action="store_true", help="the engine's adaptive k policy instead of a fixed k")
        p.add_argument("--turns", type=int, default=1, help="requests per record: a conversation re-sending its history")
        p.add_argument("--interleave", action="store_true",
                       help="serve the methods request by request in turn (all engines built first), so that drift in "
                            "the machine's speed falls on every method alike; default: one method after another")
        p.add_argument("--eval-every", type=int, default=1)
        p.add_argument("--window", type=int, default=10, help="moving-window size (records)")
        p.add_argument("--methods", default=None,
                       help="comma list (online default static,online,offline); also target, lookup, suffix, controller, "
                            "controller-static (the same controller, its learned draft not learning), "
                            "suffix@R (R replicas' trees sharing outputs), suffix-split@R (not sharing)")
        p.add_argument("--train-every", type=int, default=t.train_every)
        p.add_argument("--batch-records", type=int, default=t.batch_records)
        p.add_argument("--steps-per-round", type=int, default=t.steps_per_round)
        p.add_argument("--seconds-per-round", type=float, default=None, help="wall budget of one online round")
        p.add_argument("--lr", type=float, default=t.lr)
        p.add_argument("--gate-margin", type=float, default=t.gate_margin)
        p.add_argument("--gate-z", type=float, default=t.gate_z, help="paired gate: standard errors allowed on top of the margin")
        p.add_argument("--holdout-fraction", type=float, default=t.holdout_fraction)
        p.add_argument("--positions", choices=["wrong", "all"], default=t.positions)
        p.add_argument("--loss", default="forward_kl", help="the learner's loss (draft_opd: forward KL where the "
                       "served draft was right, reverse KL where it was wrong)")
        p.add_argument("--no-resample", action="store_true", help="repeat one batch for all steps of a round")
        p.add_argument("--freeze-embeddings", action="store_true", help="do not train the draft's input embeddings")
        p.add_argument("--adapter-rank", type=int, default=t.adapter_rank,
                       help="learn low-rank adapters of this rank on the draft's projections and head (base frozen); "
                            "0: the whole draft (on the int4 runtime its updates are rounded away when it is packed)")
        p.add_argument("--prompt-positions", action="store_true",
                       help="a feature draft learns the records' prompt positions too (the target's head over their features)")
        p.add_argument("--feature-loss", type=float, default=0.0,
                       help="a feature draft learns online with EAGLE's feature loss at this weight too (0: off)")
        p.add_argument("--include-trained", action="store_true",
                       help="keep prompts the starting draft was distilled on (default: dropped from the stream)")
        p.add_argument("--offline-seconds", type=float, default=120.0)
        p.add_argument("--offline-epochs", type=int, default=3)
        p.add_argument("--offline-lr", type=float, default=1e-3)
        p.add_argument("--target", default=None, help="target model (default: the embedded one)")
        p.add_argument("--draft-kind", choices=["truncated", "feature"], default="truncated",
                       help="the learned draft: the truncated target (tokens only) or the feature-conditioned one")
        p.add_argument("--feature-layers", type=layer_list, default=[],
                       help="a feature draft without a checkpoint: target layers (comma-separated) fused with the final feature")
        p.add_argument("--draft-layers", type=int, default=2)
        p.add_argument("--head-vocab", type=int, default=None)
        p.add_argument("--draft-context", type=int, default=None, metavar="N",
                       help="the learned draft reads at most the last N tokens of a prompt (default: all)")
        p.add_argument("--learner-context", type=int, default=None, metavar="N",
                       help="prompt tokens a record trains on (0: the whole prompt); default: --draft-context, the "
                            "window the draft reads, as the server's learner takes it")
        p.add_argument("--draft-checkpoint", default=None, help="starting draft (a saved draft folder)")
        p.add_argument("--draft-adapter", default=AUTO_ADAPTER,
                       help="adapters the built draft starts from (osd train-draft --adapter-rank, or 'shipped'); "
                            "default: the shipped adapter where it fits the draft (a truncated 2-layer draft with the "
                            "full head and no --draft-checkpoint), as a fresh server starts; 'none': the bare draft")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--quantize", default="auto", choices=QUANTIZE_CHOICES, help="runtime of target and draft (see osd bench -h)")
        p.add_argument("--compile", action="store_true", help="lean runtime: fuse its layers with torch.compile at start (see ModelConfig.compile)")
        p.add_argument("--checkpoint-dir", default=None, help="online learner checkpoints (the learned draft)")
        p.add_argument("--json", default=None, help="write the result JSON here")
        p.add_argument("--png", default=None, help="write the plot here")
        p.add_argument("--quiet", action="store_true")
        p.add_argument("--config", default=None, help=CONFIG_HELP)
        if name == "shift":
            p.add_argument("--order", default=",".join(DEFAULT_SHIFT_ORDER), help="domain block order")
            p.add_argument("--fractions", default="0.3,0.5,0.7,1.0")
    x = sub.add_parser("mixture", help="one shared draft vs per-domain drafts (supervised router, clusters, both)")
    x.add_argument("--workload", default=str(Path(__file__).resolve().parent / "data" / "mixture.jsonl"))
    x.add_argument("--train", default=str(Path(__file__).resolve().parent / "data" / "train.jsonl"),
                   help="labelled records for the supervised router (stream texts are dropped)")
    x.add_argument("--methods", default="single,supervised,clusters",
                   help="comma-separated, of single, supervised, clusters and both (named domains and clusters)")
    x.add_argument("--n-per-label", type=int, default=20, help="records per label (domain, chat per language)")
    x.add_argument("--seed", type=int, default=0)
    x.add_argument("--max-tokens", type=int, default=32)
    x.add_argument("--k", type=int, default=4)
    x.add_argument("--window", type=int, default=10)
    x.add_argument("--train-every", type=int, default=t.train_every)  # the server's rounds (SERVE_TRAINER)
    x.add_argument("--batch-records", type=int, default=t.batch_records)
    x.add_argument("--steps-per-round", type=int, default=t.steps_per_round)
    x.add_argument("--lr", type=float, default=t.lr)
    x.add_argument("--gate-margin", type=float, default=t.gate_margin)
    x.add_argument("--adapter-rank", type=int, default=t.adapter_rank,
                   help="each draft learns low-rank adapters of this rank (base frozen); 0: the whole draft")
    x.add_argument("--holdout-fraction", type=float, default=t.holdout_fraction)
    x.add_argument("--positions", choices=["wrong", "all"], default=t.positions)
    x.add_argument("--no-resample", action="store_true", help="repeat one batch for all steps of a round")
    x.add_argument("--spawn-min-records", type=int, default=10)
    x.add_argument("--spawn-window", type=int, default=100)
    x.add_argument("--spawn-alpha", type=float, default=0.5)
    x.add_argument("--spawn-min-tokens", type=int, default=64)
    x.add_argument("--max-drafts", type=int, default=8)
    x.add_argument("--target", default=None)
    x.add_argument("--draft-kind", choices=["truncated", "feature"], default="truncated")
    x.add_argument("--controller", action="store_true",
                   help="each draft beside a suffix tree of its own and prompt lookup, chosen per step")
    x.add_argument("--draft-layers", type=int, default=2)
    x.add_argument("--head-vocab", type=int, default=None)
    x.add_argument("--draft-checkpoint", default=None)
    x.add_argument("--domain-checkpoints", default=None, metavar="DOMAIN=DIR,...",
                   help="a starting draft of its own for these named domains (chat/es takes chat's), e.g. distilled "
                        "with osd distill --domain D; the others fork the general draft")
    x.add_argument("--threads", type=int, default=2)
    x.add_argument("--device", default="cpu")
    x.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    x.add_argument("--quantize", default="auto", choices=QUANTIZE_CHOICES, help="runtime of target and draft (see osd bench -h)")
    x.add_argument("--compile", action="store_true", help="lean runtime: fuse its layers with torch.compile at start (see ModelConfig.compile)")
    x.add_argument("--json", default=None)
    x.add_argument("--png", default=None)
    x.add_argument("--quiet", action="store_true")
    x.add_argument("--config", default=None, help=CONFIG_HELP)
    r = sub.add_parser("report", help="the figures of online / shift / mixture result JSONs, from their per-request rows")
    r.add_argument("json", nargs="+", help="result files written with --json")
    r.add_argument("--segment", type=int, default=20, help="alpha per this many requests")
    o = sub.add_parser("overhead", help="serving speed with the learner paused / in the background / not yielding")
    o.add_argument("--workload", default=str(default_wl))
    o.add_argument("--n", type=int, default=24, help="timed requests per mode")
    o.add_argument("--domains", nargs="*", default=None)
    o.add_argument("--modes", default="paused,background,no-yield")
    o.add_argument("--blocks", type=int, default=3, help="modes interleaved in this many blocks")
    o.add_argument("--gap", type=float, default=1.0, help="idle seconds before each request")
    o.add_argument("--warmup", type=int, default=8, help="untimed requests that fill the shard first")
    o.add_argument("--max-tokens", type=int, default=32)
    o.add_argument("--k", type=int, default=4, help="fixed draft length")
    o.add_argument("--train-every", type=int, default=1)
    o.add_argument("--batch-records", type=int, default=8)
    o.add_argument("--steps-per-round", type=int, default=8)
    o.add_argument("--lr", type=float, default=1e-4)
    o.add_argument("--nice", type=int, default=19)
    o.add_argument("--learner-threads", type=int, default=1)
    o.add_argument("--max-cpu-share", type=float, default=1.0)
    o.add_argument("--micro-batch", type=int, default=1, help="records per forward/backward piece of a step")
    o.add_argument("--no-resample", action="store_true", help="repeat one batch for all steps of a round")
    o.add_argument("--target", default=None)
    o.add_argument("--draft-layers", type=int, default=2)
    o.add_argument("--head-vocab", type=int, default=None)
    o.add_argument("--draft-checkpoint", default=None)
    o.add_argument("--threads", type=int, default=2, help="serving torch threads")
    o.add_argument("--device", default="cpu")
    o.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    o.add_argument("--quantize", default="auto", choices=QUANTIZE_CHOICES, help="runtime of target and draft (see osd bench -h)")
    o.add_argument("--compile", action="store_true", help="lean runtime: fuse its layers with torch.compile at start (see ModelConfig.compile)")
    o.add_argument("--json", default=None)
    o.add_argument("--quiet", action="store_true")
    o.add_argument("--config", default=None, help=CONFIG_HELP)
    return ap


CONFIG_HELP = ("a YAML file of this command's options, by name (max_tokens: 32, methods: static,online, "
               "workload: [a.jsonl, b.jsonl], interleave: true); options given on the command line win")


def config_argv(path: str | Path) -> list[str]:
    """The options of an experiment's YAML file as command-line words, so that the parser checks
    them as it checks flags (unknown names, choices, types): ``max_tokens: 32`` -> ``--max-tokens
    32``; a list gives several values; ``true`` gives a switch alone and ``false`` leaves it off."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: an experiment's config is a mapping of option names to values")
    words: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            raise SystemExit(f"{path}: a config file cannot name another (config: {value})")
        if value is True:
            words.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            words += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            raise SystemExit(f"{path}: {key} takes a value or a list, not a mapping")
        else:
            words += [flag, str(value)]
    return words


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; with ``--config FILE``, the file's options first and the command line's
    after them, so that what is typed wins."""
    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    at = argv.index(args.cmd) + 1
    return ap.parse_args(argv[:at] + config_argv(args.config) + argv[at:])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cmd == "report":
        for path in args.json:
            print(f"== {path}")
            result = json.loads(Path(path).read_text())
            if result.get("experiment") == "mixture":  # its tables, the oracle figures recomputed from the rows
                from bench.mixture import format_mixture, recompute_oracle

                print(format_mixture(recompute_oracle(result)))
            else:
                print(report(result, args.segment))
        return 0
    if args.cmd == "mixture":
        from bench.mixture import main as mixture_main

        return mixture_main(args)
    from bench.bench import select, write_json
    from workloads import load_workload, load_workloads

    torch.set_num_threads(args.threads)
    if isinstance(args.workload, list):  # online, shift: one file or several
        all_recs = load_workloads(args.workload, args.sources)
        args.workload = ",".join(args.workload)
    else:
        all_recs = load_workload(args.workload)
    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    stream_recs = all_recs
    if args.cmd in ("online", "shift"):
        args.draft_adapter = starting_adapter(args)
        if log:
            log(f"starting draft: {args.draft_checkpoint or args.draft_kind}, adapter {args.draft_adapter or 'none'}; "
                f"learner: adapter rank {args.adapter_rank}, lr {args.lr}, {args.steps_per_round} steps every "
                f"{args.train_every} records")
    start = args.draft_checkpoint or getattr(args, "draft_adapter", None)
    if args.cmd in ("online", "shift") and start and not args.include_trained:
        stream_recs = unseen_by(all_recs, start, getattr(args, "draft_kind", "truncated"))
        if log:
            dropped = len(all_recs) - len(stream_recs)
            log(f"stream: {dropped} of {len(all_recs)} records dropped (the starting draft trained on them)" if dropped else
                "stream: no record dropped (the starting draft lists no training prompt of this workload; drafts saved "
                "before trained_prompts existed list none: rebuild them to be sure)")
    records = select(stream_recs, args.n + (args.warmup if args.cmd == "overhead" else 0), args.domains)
    if not records:
        raise SystemExit(f"no records in {args.workload} (domains {args.domains})")
    if args.cmd == "overhead":
        return _main_overhead(args, all_recs, records, log)
    lcfg = LearnerConfig(train_every=args.train_every, batch_records=args.batch_records, steps_per_round=args.steps_per_round,
                         lr=args.lr, gate_margin=args.gate_margin, gate_z=args.gate_z, holdout_fraction=args.holdout_fraction,
                         positions=args.positions, checkpoint_dir=args.checkpoint_dir, resample=not args.no_resample,
                         train_embeddings=not args.freeze_embeddings, prompt_positions=args.prompt_positions,
                         feature_loss=args.feature_loss, adapter_rank=args.adapter_rank,
                         loss=getattr(args, "loss", "forward_kl"),
                         context_tokens=args.draft_context if args.learner_context is None else (args.learner_context or None))
    dcfg = DistillConfig(max_tokens=args.max_tokens, seconds=args.offline_seconds, epochs=args.offline_epochs,
                         lr=args.offline_lr, warmup_steps=0, log_every=1000, feature_loss=args.feature_loss)
    factory = real_engine_factory(args, texts=[r.text for r in all_recs])
    methods = tuple(args.methods.split(",")) if args.methods else None
    common = dict(eval_every=args.eval_every, max_tokens=args.max_tokens, k=args.k, window=args.window,
                  seconds_per_round=args.seconds_per_round, distill_cfg=dcfg, log=log, adaptive=args.adaptive,
                  turns=args.turns, interleaved=args.interleave)
    if args.cmd == "online":
        result = run_online(factory, records, lcfg, methods=methods or ("static", "online", "offline"), **common)
    else:
        order = [d for d in args.order.split(",") if d]
        fractions = [float(x) for x in args.fractions.split(",") if x]
        result = run_shift(factory, records, lcfg, order=order, fractions=fractions, methods=methods, **common)
    result["workload"] = str(args.workload)
    print(format_table(result))
    write_json(result, args.json)
    if args.png:
        print(f"wrote {plot(result, args.png)}")
    return 0


#: ``--draft-adapter``'s default: the shipped adapter where it fits the draft (:func:`starting_adapter`)
AUTO_ADAPTER = "auto"


def starting_adapter(args) -> str | None:
    """The adapter ``osd experiment online|shift`` starts the draft from: ``--draft-adapter`` as
    given (``none``: no adapter), else the shipped one where it fits the draft (as a fresh server's)."""
    from drafts.build import SHIPPED_ADAPTER

    name = getattr(args, "draft_adapter", None)
    if name in (None, "none"):
        return None
    if name != AUTO_ADAPTER:
        return name
    fits = (args.draft_kind == "truncated" and args.draft_layers == 2 and args.head_vocab is None
            and not args.draft_checkpoint)
    return SHIPPED_ADAPTER if fits else None


def _main_overhead(args, all_recs, records, log) -> int:
    from bench.bench import write_json
    from bench.overhead import format_overhead, run_overhead
    from learner.background import BackgroundConfig

    engine = real_engine_factory(args, texts=[r.text for r in all_recs])()
    lcfg = LearnerConfig(train_every=args.train_every, batch_records=args.batch_records,
                         steps_per_round=args.steps_per_round, lr=args.lr, holdout_fraction=0.0,
                         max_cpu_share=args.max_cpu_share, micro_batch_records=args.micro_batch,
                         resample=not args.no_resample)
    bcfg = BackgroundConfig(nice=args.nice, threads=args.learner_threads)
    result = run_overhead(engine, [r.text for r in records], lcfg,
                          modes=[m for m in args.modes.split(",") if m], blocks=args.blocks, gap_s=args.gap,
                          max_tokens=args.max_tokens, warmup=args.warmup, background=bcfg, log=log)
    result["workload"] = str(args.workload)
    print(format_overhead(result))
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
