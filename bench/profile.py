"""``osd profile``: what each draft option costs on this machine.

Measures, at a fixed context length: the target's time for one forward over j = 1..J tokens
relative to one token (how close to free verification is), and for each draft option its
time per proposed token and c = draft time per token / target time per step. For restricted
heads it also reports how many of the target's greedy output tokens the kept ids cover.
"""

from __future__ import annotations

import statistics
import time

import torch

from config import DraftConfig, ModelConfig
from drafts.build import build_draft_model
from speculative.models import encode_prompt, load_model
from speculative.proposers import NgramProposer
from speculative.runner import ModelRunner

from .bench import write_json
from workloads import load_workload

DRAFT_OPTIONS = [
    ("truncated-1", DraftConfig(kind="truncated", num_layers=1)),
    ("truncated-2", DraftConfig(kind="truncated", num_layers=2)),
    ("truncated-4", DraftConfig(kind="truncated", num_layers=4)),
    ("truncated-6", DraftConfig(kind="truncated", num_layers=6)),
    ("fresh-2", DraftConfig(kind="fresh", num_layers=2)),
    ("truncated-2+head8192", DraftConfig(kind="truncated", num_layers=2, head_vocab=8192)),
    ("truncated-2+head16384", DraftConfig(kind="truncated", num_layers=2, head_vocab=16384)),
    ("truncated-1+head4096", DraftConfig(kind="truncated", num_layers=1, head_vocab=4096)),
]


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step_time(runner: ModelRunner, context: list[int], extra: list[int], repeats: int) -> float:
    runner.forward("p", 0, context)
    n = len(context)
    return _median_time(lambda: runner.forward("p", n, extra, keep_last=len(extra)), repeats)


def profile(target_name: str, workload: str, context: int = 128, max_verify: int = 9, repeats: int = 15,
            coverage_prompts: int = 8, coverage_tokens: int = 48, device: str = "cpu", dtype: str = "float32") -> dict:
    target, tok = load_model(ModelConfig(name=target_name, device=device, dtype=dtype))
    recs = load_workload(workload)
    ctx = tok(" ".join(r.text for r in recs[:20]))["input_ids"][:context]
    extra = tok(" ".join(r.text for r in recs[20:40]))["input_ids"][:max_verify]
    t_runner = ModelRunner(target)
    verify = {j: _step_time(t_runner, ctx, extra[:j], repeats) for j in range(1, max_verify + 1)}
    t1 = verify[1]
    out = {
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "context": context,
        "target_ms_per_step": 1000 * t1,
        "verify_cost_relative": {j: round(v / t1, 3) for j, v in verify.items()},
        "drafts": {},
    }
    # the target's own greedy outputs on prompts not used to choose head ids: head coverage
    held_out = recs[1::2][:coverage_prompts]
    emitted: list[int] = []
    for r in held_out:
        ids = encode_prompt(tok, r.text)
        with torch.inference_mode():
            g = target.generate(torch.tensor([ids], device=target.device), max_new_tokens=coverage_tokens, do_sample=False)
        emitted += g[0, len(ids):].tolist()
    texts = [r.text for r in recs[0::2]]
    for name, cfg in DRAFT_OPTIONS:
        draft, keep = build_draft_model(cfg, target, tok, texts)
        runner = ModelRunner(draft, keep)
        d = _step_time(runner, ctx, extra[:1], repeats)
        entry = {"ms_per_token": round(1000 * d, 2), "c": round(d / t1, 3)}
        if keep is not None:
            kept = set(keep.tolist())
            entry["head_coverage_of_target_tokens"] = round(sum(t in kept for t in emitted) / max(1, len(emitted)), 3)
        out["drafts"][name] = entry
    ng = NgramProposer()
    seq = ctx + extra
    d = _median_time(lambda: ng.lookup(seq, 8), repeats)
    out["drafts"]["ngram"] = {"ms_per_token": round(1000 * d, 4), "c": round(d / t1, 5)}
    out["upper_bound_speedup_free_verify"] = {
        name: {k: round((k + 1) / (k * e["c"] + 1), 2) for k in (1, 2, 4)} for name, e in out["drafts"].items()
    }
    return out


def profile_main(args) -> int:
    torch.set_num_threads(args.threads)
    res = profile(args.target, args.workload, args.context, args.max_verify, args.repeats,
                  device=args.device, dtype=args.dtype)
    print(f"target: {res['target_ms_per_step']:.1f} ms per step at context {res['context']}")
    print("verify cost of j tokens relative to 1: " + ", ".join(f"{j}:{v:.2f}" for j, v in res["verify_cost_relative"].items()))
    print(f"{'draft':<24}{'ms/token':>10}{'c':>8}{'head coverage':>15}")
    for name, e in res["drafts"].items():
        cov = e.get("head_coverage_of_target_tokens")
        print(f"{name:<24}{e['ms_per_token']:>10.3f}{e['c']:>8.3f}{'' if cov is None else format(cov, '.3f'):>15}")
    write_json(res, args.json)
    return 0
