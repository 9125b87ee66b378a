"""What the learner costs serving: the same requests served with the learner paused, training in the
background while yielding to requests, and training in the background without yielding.

Requests arrive one at a time with an idle ``gap`` between them (the spare compute the learner is
meant to use). Every mode serves the same prompts with the same draft weights and a fixed k, so
the work is identical and any difference in serving speed is interference: learned weights are
NOT installed during the measurement (``install=False``; the alpha effect of learning is what
``osd experiment online`` measures). Modes are interleaved block by block (rotating their order)
so drift of the machine hits all of them alike.

Reported per mode: serving tokens/s (generated tokens / time spent inside requests, gaps
excluded), request latency p50/p95, and what the learner did meanwhile (optimiser steps, seconds
per step, rounds stopped early by a request). ``throughput_vs_paused`` is the issue's ratio.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from config import SamplingParams
from learner.background import BackgroundConfig, BackgroundLearner
from bench.harness import serve_recorded
from learner.replay import ShardConfig
from learner.trainer import DraftTrainer, LearnerConfig, OnlineLearner

__all__ = ["MODES", "run_overhead", "format_overhead"]

#: mode -> BackgroundConfig overrides (None: learner paused, records only observed)
MODES: dict[str, dict | None] = {
    "paused": None,
    "background": {"yield_to_requests": True},
    "no-yield": {"yield_to_requests": False},
}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_overhead(
    engine,
    prompts: Sequence[Any],
    learner_cfg: LearnerConfig,
    *,
    modes: Sequence[str] = tuple(MODES),
    blocks: int = 3,
    gap_s: float = 1.0,
    max_tokens: int = 32,
    warmup: int = 8,
    background: BackgroundConfig = BackgroundConfig(),
    install: bool = False,
    draft_id: str = "draft",
    log: Callable[[str], None] | None = print,
) -> dict:
    """Serve ``prompts`` (text or token ids): the first ``warmup`` once, untimed, to fill the
    learner's shard; the rest once per mode, split into ``blocks``; see the module docstring."""
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; known: {list(MODES)}")
    if blocks < 1 or len(prompts) - warmup < blocks:
        raise ValueError(f"need blocks >= 1 and a timed prompt per block ({len(prompts)} prompts, {warmup} warm-up, "
                         f"{blocks} blocks)")
    dp = engine.learned_draft
    if dp is None:
        raise ValueError("the engine has no learned draft to train")
    trainer = DraftTrainer(draft_id, dp.runner.model, learner_cfg, keep_ids=dp.runner.vocab_map)
    learner = OnlineLearner(learner_cfg, ShardConfig(), [trainer])
    subs = [engine.stage_draft] if install else []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    encoded = [engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def serve(tokens, sink) -> tuple[float, int]:
        t0 = time.perf_counter()
        rec, _, _, gen = serve_recorded(engine, tokens, params, draft_id=draft_id, probs_dtype=torch.float16)
        dt = time.perf_counter() - t0
        sink(rec)
        return dt, len(gen.token_ids)

    for tokens in encoded[:warmup]:
        serve(tokens, learner.observe)
    encoded = encoded[warmup:]
    per = {m: {"latencies": [], "tokens": 0, "serving_s": 0.0, "steps": 0, "train_s": 0.0, "rounds": 0, "yielded": 0,
               "published": 0} for m in modes}
    size = -(-len(encoded) // blocks)
    for bi in range(blocks):
        chunk = encoded[bi * size:(bi + 1) * size]
        order = list(modes[bi % len(modes):]) + list(modes[:bi % len(modes)])
        for m in order:
            over = MODES[m]
            bg = None
            if over is not None:
                bg = BackgroundLearner(learner, subs, busy=lambda: engine.busy,
                                       cfg=background.model_copy(update=over)).start()
            sink = bg.submit if bg is not None else learner.observe
            for tokens in chunk:
                time.sleep(gap_s)
                dt, n = serve(tokens, sink)
                e = per[m]
                e["latencies"].append(dt)
                e["tokens"] += n
                e["serving_s"] += dt
            if bg is not None:
                bg.stop()
                s = bg.stats()
                e = per[m]
                e["steps"] += s.steps
                e["train_s"] += s.train_seconds
                e["rounds"] += s.rounds
                e["yielded"] += s.yielded_rounds
                e["published"] += s.published
                if bg.error is not None:
                    raise RuntimeError(f"learner thread failed in mode {m!r}") from bg.error
            if log is not None:
                e = per[m]
                log(f"block {bi + 1}/{blocks} {m}: {e['tokens'] / e['serving_s']:.2f} tok/s so far, {e['steps']} steps")
    out: dict[str, Any] = {}
    base = per.get("paused")
    base_tps = base["tokens"] / base["serving_s"] if base and base["serving_s"] else None
    for m, e in per.items():
        tps = e["tokens"] / e["serving_s"] if e["serving_s"] else None
        out[m] = {
            "requests": len(e["latencies"]),
            "tokens": e["tokens"],
            "serving_s": e["serving_s"],
            "tokens_per_s": tps,
            "throughput_vs_paused": tps / base_tps if tps and base_tps else None,
            "latency_p50_s": _pct(e["latencies"], 0.5),
            "latency_p95_s": _pct(e["latencies"], 0.95),
            "latency_mean_s": statistics.fmean(e["latencies"]) if e["latencies"] else None,
            "train_steps": e["steps"],
            "train_seconds": e["train_s"],
            "seconds_per_step": e["train_s"] / e["steps"] if e["steps"] else None,
            "rounds": e["rounds"],
            "rounds_cut_short": e["yielded"],
            "published": e["published"],
        }
    learner.close()
    return {
        "experiment": "overhead",
        "modes": out,
        "gap_s": gap_s,
        "blocks": blocks,
        "max_tokens": max_tokens,
        "prompts": len(encoded),
        "install": install,
        "serving_threads": torch.get_num_threads(),
        "background": background.model_dump(),
        "learner": learner_cfg.model_dump(mode="json"),
    }


def format_overhead(result: dict) -> str:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    hdr = f"{'mode':<11}{'tok/s':>8}{'vs paused':>10}{'p50 s':>8}{'p95 s':>8}{'steps':>7}{'s/step':>8}{'cut':>8}"
    lines = [hdr, "-" * len(hdr)]
    for m, e in result["modes"].items():
        lines.append(f"{m:<11}{f(e['tokens_per_s'], '.2f'):>8}{f(e['throughput_vs_paused'], '.3f'):>10}"
                     f"{f(e['latency_p50_s'], '.2f'):>8}{f(e['latency_p95_s'], '.2f'):>8}{e['train_steps']:>7}"
                     f"{f(e['seconds_per_step'], '.3f'):>8}{e['rounds_cut_short']:>8}")
    return "\n".join(lines)
