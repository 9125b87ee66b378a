"""The paper's mixture of drafts, in-process: one shared draft against one draft per query mode.

A mixed stream (topics and languages interleaved, seeded) is served three ways, each with the same
online learner settings (a round every ``train_every`` records, on the draft with the most
traffic x lost acceptance), all drafts starting from the same weights unless a named domain has a
starting draft of its own (``--domain-checkpoints``: e.g. one distilled offline on that domain's
prompts):

* ``single``: every query to one draft, trained on everything (the baseline).
* ``supervised``: the :class:`router.Router` classifier (trained beforehand on labelled records
  that are NOT in the stream) names the domain; each domain it names ("sql", "chat/es", ...)
  gets its own draft the first time it is named (the router's ``spawn`` event: d-sql, d-chat-es),
  forked from the general draft's current weights (or built from the domain's own starting
  draft), and trains on its own shard. Unsure queries go to the general draft.
* ``clusters``: no labels; the router's online clusters (split by language) discover the modes and
  spawn a draft for a busy cluster with poor acceptance (and retire idle ones), forked from the
  general draft; everything else stays on the general draft, which keeps training.
* ``both``: the open-set router: a named domain the classifier is sure of (and, for chat, that the
  query is typical of) gets its own draft as in ``supervised``; every other query goes to its
  online cluster as in ``clusters``, starting from the draft of the likeliest named domain.

The bandit picks among a domain's drafts by observed acceptance. Reported per method and per label
(``domain``, or ``chat/<lang>`` for chat): alpha over the stream (window curves), alpha over the
last ``window`` records of the label and over the second half of the stream; route accuracy of the
named routes (``supervised``, ``both``: the share whose domain is the record's; ``routed_share``: the
share of requests given a named domain); drafts spawned and retired. Alpha of a request is accepted / proposed draft
tokens at a fixed k (greedy), as in :mod:`bench.experiments`.

Routing is judged against an **oracle**: after each request, every draft in memory at that moment
is scored in hindsight on it (the acceptance it would have had at the same k, from one
teacher-forced pass over the target's output: greedy output does not depend on the draft; see
:func:`counterfactual_counts`), without feeding the learner or the router. A row's
``alpha_by_draft`` is {draft: [accepted, proposed]}; the oracle takes per request the draft that
accepts most (ties to the routed one). Per method (and per label, in ``oracle_label``):
``routed_alpha``, ``oracle_alpha`` and ``routed_vs_oracle`` over the whole stream and its second
half; the aim is a ratio >= 0.95. Token drafts at a fixed k only (``--controller``, adaptive k and
feature drafts: ``oracle_skipped`` says why).
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from typing import Any, Callable, Mapping, Sequence

import torch

from bench.harness import ANY_SOURCE, _alpha, _draft_of, _f, _force_k, real_engine_factory, rows_alpha, serve_recorded
from config import RouterConfig, SamplingParams
from learner.replay import ShardConfig
from learner.trainer import DraftTrainer, LearnerConfig, OnlineLearner
from router.router import start_domain

__all__ = ["METHODS", "label_of", "mixed_stream", "run_mixture", "format_mixture", "plot_mixture", "alpha_by_draft",
           "counterfactual_counts", "oracle_summary", "mode_oracle", "recompute_oracle", "parse_starts"]

METHODS = ("single", "supervised", "clusters", "both")
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

    def __init__(self, engine_factory: Callable[..., Any], learner: OnlineLearner, cfg: LearnerConfig, k: int | None,
                 controller: bool = False, starts: Mapping[str, Any] | None = None):
        self.factory, self.learner, self.cfg, self.k = engine_factory, learner, cfg, k
        self.controller = controller
        self.starts = dict(starts or {})  # domain -> its own starting draft (what engine_factory(start) loads)
        self.start_of: dict[str, str | None] = {}  # draft id -> the domain whose starting draft it began from
        self.engines: dict[str, Any] = {}
        self.spawned: list[dict] = []
        self.retired: list[dict] = []

    def add(self, draft_id: str, parent: str | None = None, at: int = 0, domain: str | None = None) -> Any:
        own = start_domain(draft_id, self.starts) if parent is not None else None  # d-chat-es: chat/es's, else chat's
        # a fork keeps its parent's head and token ids: it is built from the parent's starting draft
        start = own if own is not None or parent is None else self.start_of[parent]
        eng = self.factory(self.starts[start]) if start is not None else self.factory()
        self.start_of[draft_id] = start
        _force_k(eng, self.k)
        dp = _draft_of(eng)
        if parent is not None:
            if own is None:  # fork: the parent's current weights (its adapters alone where it has them:
                # both drafts are built from the same start, so they share that base)
                from speculative.adapters import adapter_state, has_adapters

                model = _draft_of(self.engines[parent]).runner.model
                src = adapter_state(model) if has_adapters(model) else model.state_dict()
                dp.load_state_dict({n: t.detach().clone() for n, t in src.items()}, 0)
            self.spawned.append({"draft": draft_id, "parent": None if own is not None else parent, "at": at,
                                 "domain": domain, "start": own})
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


# -- the oracle: every draft in memory, scored in hindsight on the request just served ----------------
#
# Greedy decoding makes the target's output independent of the draft that served it, so the
# acceptance another draft would have had at the same fixed k follows from the output alone: the
# engine's step at output offset o proposes k' = min(k, max_tokens - o - 1) tokens (none when
# k' <= 0), keeps the longest prefix where the draft's token equals the target's, and emits that
# prefix plus one target token; it ends at max_tokens or at the step whose emitted tokens hold the
# EOS. While a draft agrees with the target its autoregressive proposals are its teacher-forced
# predictions on the target's tokens, so one teacher-forced pass per draft gives every step. Only a
# draft that agrees up to and past the EOS (the engine still compares the proposals it made after
# the EOS) needs the target's own greedy continuation past the EOS: computed then, once a request.

ORACLE_TARGET = 0.95  # routing's aim: the routed drafts' alpha >= 95% of the oracle's
_CF_SEQ = "__mixture_counterfactual__"


def counterfactual_counts(pred: Callable[[int], int], truth: Callable[[int], int], n_out: int, max_tokens: int,
                          k: int, eos_ended: bool) -> tuple[int, int]:
    """(accepted, proposed) of a draft with fixed ``k`` on a greedy request whose output had
    ``n_out`` tokens, as :class:`speculative.engine.SpeculativeEngine` counts them.
    ``pred(j)``: the draft's greedy token for output index j given the target's tokens before it;
    ``truth(j)``: the target's token at output index j (j >= n_out only when ``eos_ended``: the EOS,
    then the target's greedy continuation past it)."""
    o = acc = prop = 0
    while o < max_tokens:
        kk = max(min(k, max_tokens - o - 1), 0)  # the engine drafts nothing past max_tokens
        n = 0
        while n < kk and pred(o + n) == truth(o + n):
            n += 1
        acc, prop = acc + n, prop + kk
        if eos_ended and o + n >= n_out:  # this step emitted the EOS: the request ended
            break
        o += n + 1
        if not eos_ended and o >= n_out:
            break
    return acc, prop


class _TargetPath:
    """The target's greedy tokens after a prompt: the output served, then (lazily) its continuation."""

    def __init__(self, target, prompt: list[int], output: list[int], eos_ended: bool):
        self.target, self.prompt, self.eos_ended = target, list(prompt), eos_ended
        self.tokens, self.n_out = list(output), len(output)

    def __call__(self, j: int) -> int:
        while j >= len(self.tokens):
            if not self.eos_ended:
                raise IndexError(f"output index {j} past an output of {self.n_out} tokens that did not end at EOS")
            if len(self.tokens) == self.n_out:  # prefill prompt + output: the row after it is the EOS
                row = self.target.forward(_CF_SEQ, 0, self.prompt + self.tokens, 1)
            else:
                row = self.target.forward(_CF_SEQ, len(self.prompt) + len(self.tokens) - 1, [self.tokens[-1]], 1)
            self.tokens.append(int(row[-1].argmax()))
        return self.tokens[j]

    def close(self) -> None:
        if len(self.tokens) > self.n_out:
            self.target.release(_CF_SEQ)


class _DraftPath:
    """A draft's teacher-forced greedy predictions on the target's tokens: one pass over prompt +
    output, then one position at a time past the output when a counterfactual asks."""

    def __init__(self, dp, prompt: list[int], truth: _TargetPath):
        self.runner, self.truth, self.L = dp.runner, truth, len(prompt)
        out = truth.tokens[: truth.n_out]
        self.preds = self._ids(self.runner.forward(_CF_SEQ, 0, list(prompt) + out, truth.n_out + 1))  # indexes 0..n_out

    def _ids(self, logits: torch.Tensor) -> list[int]:
        ids = logits.argmax(-1)
        vm = self.runner.vocab_map
        return [int(t) for t in (ids if vm is None else vm[ids])]

    def __call__(self, j: int) -> int:
        while j >= len(self.preds):
            i = len(self.preds) - 1  # feed the target's token at output index i
            self.preds += self._ids(self.runner.forward(_CF_SEQ, self.L + i, [self.truth(i)], 1))
        return self.preds[j]

    def close(self) -> None:
        self.runner.release(_CF_SEQ)


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy decoding that ends only at EOS or max_tokens: what the counterfactual can replay."""
    return params.greedy and not params.stop and not params.ignore_eos


def counterfactual_skip_reason(engine, controller: bool = False, params: SamplingParams | None = None) -> str | None:
    """Why drafts served by ``engine`` (with ``params``) cannot be scored in hindsight (None: they can)."""
    if params is not None and not _plain_greedy(params):
        return "not greedy decoding (or stop strings, or ignore_eos)"
    if controller:
        return "--controller: other proposers draft some steps"
    if getattr(engine.cfg.k, "fixed_k", None) is None:
        return "adaptive k: k depends on the draft's own acceptance"
    dp = _draft_of(engine)
    if getattr(dp, "wants_features", False):
        return "feature draft: its proposals need the target's features"
    if getattr(engine.proposer, "sources", ("draft",)) != ("draft",):
        return "the engine's proposer is not the learned token draft alone"
    return None


@torch.inference_mode()
def alpha_by_draft(engines: dict[str, Any], prompt: Sequence[int], output: Sequence[int], finish_reason: str,
                   params: SamplingParams) -> dict[str, list[int]]:
    """{draft_id: [accepted, proposed]} that each engine's draft would have had on this greedy
    request (prompt and output token ids, as served) at its engine's fixed k, without serving it:
    no engine, learner or router state changes (the drafts' and the target's scratch caches are
    released). Every engine must share the target and pass :func:`counterfactual_skip_reason`."""
    if not _plain_greedy(params):
        raise ValueError("counterfactual acceptance needs greedy decoding without stop strings or ignore_eos")
    eos_ended = finish_reason == "stop"
    if not engines:
        return {}
    first = next(iter(engines.values()))
    truth = _TargetPath(first.target, list(prompt), list(output), eos_ended)
    out: dict[str, list[int]] = {}
    try:
        for d_id, eng in engines.items():
            path = _DraftPath(_draft_of(eng), list(prompt), truth)
            try:
                k = int(eng.cfg.k.fixed_k)
                acc, prop = counterfactual_counts(path, truth, len(output), params.max_tokens, k, eos_ended)
            finally:
                path.close()
            out[d_id] = [acc, prop]
    finally:
        truth.close()
    return out


def _oracle_pick(row: dict) -> tuple[str, int, int]:
    """(draft, accepted, proposed) of the oracle on one row: most accepted, ties to the routed draft
    (then fewest proposed, then the name)."""
    by = row["alpha_by_draft"]
    d = max(by, key=lambda x: (by[x][0], x == row["draft"], -by[x][1], x))
    return d, by[d][0], by[d][1]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def oracle_summary(rows: Sequence[dict]) -> dict:
    """Routed vs oracle over ``rows`` (each with ``alpha_by_draft``): alpha = summed accepted / summed
    proposed. The oracle always accepts at least as many tokens (``accepted_vs_oracle`` <= 1: fewer
    target steps for the same output); its alpha is higher in practice but not by construction:
    near max_tokens the engine proposes fewer than k, so a draft that accepts more in fewer, fuller
    steps can propose more per accepted token (max_tokens 6, k 3: accepted 4 of 6 vs 3 of 4)."""
    ra = sum(r["accepted"] for r in rows)
    rp = sum(r["proposed"] for r in rows)
    picks = [_oracle_pick(r) for r in rows]
    oa, op = sum(p[1] for p in picks), sum(p[2] for p in picks)
    routed, oracle = _alpha(ra, rp), _alpha(oa, op)
    return {"routed_alpha": routed, "oracle_alpha": oracle, "routed_vs_oracle": _ratio(routed, oracle),
            "routed_accepted": ra, "oracle_accepted": oa, "accepted_vs_oracle": _ratio(ra, oa), "n": len(rows),
            "oracle_other": sum(1 for r, p in zip(rows, picks) if p[0] != r["draft"])}


def mode_oracle(rows: Sequence[dict]) -> dict:
    """The best *fixed* draft per label in hindsight: for each label the one draft whose
    [accepted, proposed] summed over the label's rows (the routed draft's where it was not in
    memory yet) accepts most. Unlike the per-request oracle it does not profit from per-request
    luck (the best of 8 near-equal drafts on 32 tokens beats any choice made before the request):
    it asks whether the router sent each mode to its best draft."""
    by_label: dict[str, list[dict]] = {}
    for r in rows:
        by_label.setdefault(r["label"], []).append(r)
    acc = prop = 0
    best: dict[str, str] = {}
    for lb, rs in by_label.items():
        def total(d: str) -> tuple[int, int]:
            pairs = [r["alpha_by_draft"].get(d, [r["accepted"], r["proposed"]]) for r in rs]
            return sum(a for a, _ in pairs), sum(p for _, p in pairs)
        totals = {d: total(d) for d in sorted({d for r in rs for d in r["alpha_by_draft"]})}
        best[lb] = max(totals, key=lambda d: (totals[d][0], -totals[d][1], d))
        a, p = totals[best[lb]]
        acc, prop = acc + a, prop + p
    routed = rows_alpha(rows)
    alpha = _alpha(acc, prop)
    return {"mode_oracle_alpha": alpha, "routed_vs_mode_oracle": _ratio(routed, alpha), "mode_oracle_drafts": best}


def _run_method(method, engine_factory, stream, learner_cfg, router, *, max_tokens, k, window, log,
                controller: bool = False, starts: Mapping[str, Any] | None = None) -> dict:
    learner = OnlineLearner(learner_cfg, ShardConfig())
    drafts = _Drafts(engine_factory, learner, learner_cfg, k, controller, starts)
    drafts.add(GENERAL)
    params = SamplingParams(max_tokens=max_tokens)
    # the oracle: every draft in memory scored in hindsight on each request (token drafts, fixed k)
    skip = counterfactual_skip_reason(drafts.engines[GENERAL], controller, params)
    mismatches = 0
    rows, curves = [], {}
    wins: dict[str, deque] = {}
    t0 = time.perf_counter()
    for i, rec in enumerate(stream, start=1):
        label = label_of(rec)
        route = router.route(rec.text) if router is not None else None
        if router is not None:  # a named domain (chat/es too) seen for the first time gets its own draft, at once
            for ev in router.events():
                if ev.kind == "spawn":
                    drafts.add(ev.draft_id, parent=ev.parent or GENERAL, at=i, domain=ev.domain)
                else:
                    drafts.retire(ev.draft_id, i, ev.reason)
        draft_id = route.draft_id if route is not None and route.draft_id in drafts.engines else GENERAL
        record, acc, prop, gen = serve_recorded(drafts.engines[draft_id], rec.text, params, domain=label,
                                              draft_id=draft_id, probs_dtype=torch.float16, sources=ANY_SOURCE)
        by_draft = cf_routed = None
        if skip is None:  # before the learner's round: the drafts as they served this request; no side effect
            p_len = record.prompt_len
            by_draft = alpha_by_draft(drafts.engines, record.tokens[:p_len].tolist(), list(gen.token_ids),
                                      gen.finish_reason, params)
            if by_draft[draft_id] != [acc, prop]:  # the routed draft's own: exactly what serving measured
                mismatches += 1
                if log is not None:
                    log(f"[{method}] request {i}: counterfactual of the routed draft {draft_id} {by_draft[draft_id]} "
                        f"!= measured {[acc, prop]} (float rounding of a near-tie?)")
                cf_routed, by_draft[draft_id] = by_draft[draft_id], [acc, prop]
        learner.observe(record)
        rep = learner.maybe_train(drafts.subscribers())
        if route is not None:
            router.observe(route, acc, prop)
        row = {"i": i, "label": label, "draft": draft_id, "accepted": acc, "proposed": prop, "alpha": _alpha(acc, prop),
               "alpha_by_draft": by_draft}
        if cf_routed is not None:
            row["counterfactual_routed"] = cf_routed
        if route is not None:
            row.update(route_domain=route.domain, reason=route.reason, confidence=round(route.confidence, 4),
                       cluster=route.cluster)
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

    a = rows_alpha
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
    out.update(_oracle_fields(rows, labels, half, skip, mismatches))
    if log is not None and skip is None:
        log(f"[{method}] routed alpha {_f(out['routed_alpha']['all'])} vs oracle {_f(out['oracle_alpha']['all'])} "
            f"(ratio {_f(out['routed_vs_oracle']['all'])}; second half {_f(out['routed_vs_oracle']['second_half'])})")
    if router is not None:
        out["router"] = router.summary()
        # the named routes: a cluster's key is no domain name
        routed = [r for r in rows if r.get("route_domain") not in (None, "unknown") and r.get("cluster") is None]
        if method != "clusters" and routed:
            base = router.cfg.language.base_lang
            out["route_accuracy"] = sum(same_mode(r["route_domain"], r["label"], base) for r in routed) / len(routed)
            out["routed_share"] = len(routed) / len(rows)
    return out


def _oracle_fields(rows: list[dict], labels: list[str], half: int, skip: str | None, mismatches: int) -> dict:
    """A method's routed vs oracle alpha, whole stream and second half, overall and per label."""
    if skip is not None:
        return {"routed_alpha": None, "oracle_alpha": None, "routed_vs_oracle": None, "accepted_vs_oracle": None,
                "oracle_label": None, "counterfactual_mismatches": None, "oracle_skipped": skip}
    parts = {"all": rows, "second_half": rows[half:]}
    whole = {name: {**oracle_summary(rs), **mode_oracle(rs)} for name, rs in parts.items()}
    by_label = {lb: {name: oracle_summary([r for r in rs if r["label"] == lb]) for name, rs in parts.items()}
                for lb in labels}

    def pick(d, key):
        return {name: s[key] for name, s in d.items()}

    return {
        "routed_alpha": pick(whole, "routed_alpha"),
        "oracle_alpha": pick(whole, "oracle_alpha"),
        "routed_vs_oracle": pick(whole, "routed_vs_oracle"),
        "accepted_vs_oracle": pick(whole, "accepted_vs_oracle"),
        "mode_oracle_alpha": pick(whole, "mode_oracle_alpha"),
        "routed_vs_mode_oracle": pick(whole, "routed_vs_mode_oracle"),
        "mode_oracle_drafts": pick(whole, "mode_oracle_drafts"),
        "oracle_label": {lb: {key: pick(d, key) for key in ("routed_alpha", "oracle_alpha", "routed_vs_oracle",
                                                            "accepted_vs_oracle")}
                         for lb, d in by_label.items()},
        # requests where another draft in memory would have accepted more than the routed one
        "oracle_other": pick(whole, "oracle_other"),
        "oracle_target": ORACLE_TARGET,
        "oracle_met": {name: s["routed_vs_oracle"] is not None and s["routed_vs_oracle"] >= ORACLE_TARGET
                       for name, s in whole.items()},
        "counterfactual_mismatches": mismatches,
        "oracle_skipped": None,
    }


def recompute_oracle(result: dict) -> dict:
    """``result`` (a mixture JSON) with every method's oracle figures recomputed from its rows."""
    for e in result["methods"].values():
        rows = e["rows"]
        if rows and all(r.get("alpha_by_draft") for r in rows):
            labels = list(dict.fromkeys(r["label"] for r in rows))
            e.update(_oracle_fields(rows, labels, len(rows) // 2, None, e.get("counterfactual_mismatches") or 0))
    return result


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
    starts: Mapping[str, Any] | None = None,
) -> dict:
    """See the module docstring. ``train_records`` (labelled, e.g. bench/data/train.jsonl) train the
    supervised router; any of their texts that is also in the stream is dropped first.
    ``engine_factory()`` returns a fresh engine (shared target, fresh copy of the starting draft).
    ``controller``: every draft runs beside a suffix tree of its own and prompt lookup, the
    controller choosing per step (alpha then counts every drafted step).
    ``starts``: {domain: starting draft} for the named domains that have one of their own (a
    language variant takes its domain's: chat/es -> chat's): such a domain's draft is built by
    ``engine_factory(start)`` instead of forked from the general draft; a draft forked from it
    (a cluster's) keeps its head."""
    from router.router import Router
    from router.features import FeatureExtractor

    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; known: {list(METHODS)}")
    stream = mixed_stream(records, n_per_label, seed)
    if not stream:
        raise ValueError("empty stream")
    from router.router import training_label
    from workloads import named_for_routing

    in_stream = {r.text for r in stream}
    # as a served router fits its examples (router.router.fit_examples): general traffic is the
    # classifier's background class when the config says so, else left out
    train = [r for r in named_for_routing(train_records, keep_general=router_cfg.classifier.background)
             if r.text not in in_stream]
    extractor = extractor if extractor is not None else FeatureExtractor(router_cfg)
    counts: dict[str, int] = {}
    for r in stream:
        counts[label_of(r)] = counts.get(label_of(r), 0) + 1
    res: dict[str, Any] = {}
    out = {"experiment": "mixture", "n_records": len(stream), "labels": counts, "train_records": len(train),
           "max_tokens": max_tokens, "k": k, "window": window, "seed": seed, "controller": controller,
           "learner": learner_cfg.model_dump(mode="json"), "router": router_cfg.model_dump(mode="json"),
           "domain_starts": {d: v if isinstance(v, str) else type(v).__name__ for d, v in (starts or {}).items()},
           "methods": res}
    for m in methods:
        router = None
        if m != "single":
            bandit = router_cfg.bandit.model_copy(update={"seed": seed})
            router = Router(router_cfg.model_copy(update={"mode": m, "bandit": bandit}), extractor)
            if m in ("supervised", "both"):
                router.fit([r.text for r in train], [training_label(r) for r in train])
        res[m] = _run_method(m, engine_factory, stream, learner_cfg, router, max_tokens=max_tokens, k=k,
                             window=window, log=log, controller=controller, starts=starts)
        if on_method is not None:  # e.g. write the JSON so far: a long run keeps what it measured
            on_method(out)
    return out


def format_mixture(result: dict) -> str:
    """Method x label alpha over the second half of the stream (and the last ``window`` records);
    then routed vs oracle alpha per method (ratio per label, overall, second half)."""
    labels = list(result["labels"])
    hdr = f"{'method':<12}" + "".join(f"{lb[:9]:>10}" for lb in labels) + f"{'all':>8}{'drafts':>8}{'route acc':>10}"
    lines = ["alpha over the second half of the stream (last-window alpha in the JSON)", hdr, "-" * len(hdr)]
    for m, e in result["methods"].items():
        lines.append(f"{m:<12}" + "".join(f"{_f(e['second_half_alpha_label'].get(lb)):>10}" for lb in labels)
                     + f"{_f(e['second_half_alpha']):>8}{len(e['drafts_final']):>8}{_f(e.get('route_accuracy')):>10}")
    lines += ["", "routed alpha / oracle alpha (oracle: per request the draft in memory that accepts most, in hindsight;",
              f"target >= {ORACLE_TARGET:.2f}): per label and all over the stream, then over its second half; other = "
              "requests where another draft accepts more; per mode = routed / the best fixed draft per label in hindsight"]
    hdr = (f"{'method':<12}" + "".join(f"{lb[:9]:>10}" for lb in labels)
           + f"{'routed':>8}{'oracle':>8}{'ratio':>7}{'2nd half':>9}{'other':>7}{'per mode':>9}")
    lines += [hdr, "-" * len(hdr)]
    for m, e in result["methods"].items():
        if e.get("routed_vs_oracle") is None:
            lines.append(f"{m:<12}skipped: {e.get('oracle_skipped') or 'no oracle in this result'}")
            continue
        lines.append(f"{m:<12}" + "".join(f"{_f(e['oracle_label'].get(lb, {}).get('routed_vs_oracle', {}).get('all')):>10}"
                                          for lb in labels)
                     + f"{_f(e['routed_alpha']['all']):>8}{_f(e['oracle_alpha']['all']):>8}{_f(e['routed_vs_oracle']['all']):>7}"
                     + f"{_f(e['routed_vs_oracle']['second_half']):>9}{e['oracle_other']['all']:>7}"
                     + f"{_f((e.get('routed_vs_mode_oracle') or {}).get('all')):>9}")
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


def parse_starts(spec: str | None) -> dict[str, str]:
    """``--domain-checkpoints``: ``"code=DIR,sql=DIR"`` -> {domain: saved draft folder}."""
    out: dict[str, str] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        domain, sep, path = part.partition("=")
        if not sep or not domain.strip() or not path.strip():
            raise ValueError(f"--domain-checkpoints wants DOMAIN=DIR pairs, got {part!r}")
        if domain.strip() in out:
            raise ValueError(f"--domain-checkpoints names {domain.strip()!r} twice")
        out[domain.strip()] = path.strip()
    return out


def main(args) -> int:
    """``osd experiment mixture`` (argparse Namespace from bench.experiments.build_parser)."""
    from bench.bench import write_json
    from bench.harness import unseen_by
    from workloads import load_workload

    torch.set_num_threads(args.threads)
    starts = parse_starts(getattr(args, "domain_checkpoints", None))
    records = load_workload(args.workload)
    for ckpt in ([args.draft_checkpoint] if args.draft_checkpoint else []) + list(starts.values()):
        kept = unseen_by(records, ckpt, args.draft_kind)  # the stream holds no prompt a starting draft trained on
        if len(kept) < len(records) and not args.quiet:
            print(f"{len(records) - len(kept)} stream records dropped: {ckpt} was distilled on them", file=sys.stderr)
        records = kept
    train = load_workload(args.train)
    lcfg = LearnerConfig(train_every=args.train_every, batch_records=args.batch_records,
                         steps_per_round=args.steps_per_round, lr=args.lr, gate_margin=args.gate_margin,
                         holdout_fraction=args.holdout_fraction, positions=args.positions,
                         resample=not args.no_resample, adapter_rank=args.adapter_rank)
    rcfg = RouterConfig(drafts={"spawn_min_records": args.spawn_min_records, "spawn_window": args.spawn_window,
                                "spawn_alpha": args.spawn_alpha, "spawn_min_tokens": args.spawn_min_tokens,
                                "max_drafts": args.max_drafts})
    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    factory = real_engine_factory(args, texts=[r.text for r in records])
    result = run_mixture(factory, records, train, lcfg, rcfg, methods=[m for m in args.methods.split(",") if m],
                         n_per_label=args.n_per_label, max_tokens=args.max_tokens, k=args.k, window=args.window,
                         seed=args.seed, log=log, on_method=lambda r: write_json({**r, "workload": str(args.workload)}, args.json),
                         controller=args.controller, starts=starts)
    result["workload"] = str(args.workload)
    print(format_mixture(result))
    write_json(result, args.json)
    if args.png:
        print(f"wrote {plot_mixture(result, args.png)}")
    return 0
