"""``osd profile``: what each runtime and draft option costs on this machine.

For each path (the target on a runtime: Hugging Face eager float32, our int8 and int4 fast path,
and llama.cpp when installed), at a fixed context length: the target's milliseconds per step, the
cost of verifying j = 1..J tokens in one forward relative to one token, v(j); for each draft
option on the same runtime its time per proposed token and c = that / one target step; and the
physical limit of speculation at acceptance rate a,

    S(k) = (1 - a^(k+1)) / ((1 - a) (k c + v(k + 1))),

maximised over k (k = 0: target alone, S = 1), at the acceptance rates measured by ``osd bench``
(``--alpha-from`` its JSON) or given (``--alpha``). For restricted heads it also reports how many of
the target's greedy output tokens the kept ids cover. For each of our runtimes it splits a decode
step's time between the linear layers' kernels, attention and the rest (:func:`step_split`).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from config import DraftConfig, ModelConfig
from drafts.build import build_draft_model
from speculative.runtime import FastPathError, make_runner, runtime_of
from speculative.kvcache import kv_bytes_per_token
from speculative.kpolicy import expected_speedup
from speculative.models import encode_prompt, load_model
from speculative.proposers import NgramProposer

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
#: the runtimes profiled by default: ModelConfig.quantize values, and llama.cpp
PATHS = ("none", "int8", "int4", "llamacpp")


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step_time(runner, context: list[int], extra: list[int], repeats: int) -> float:
    runner.forward("p", 0, context)
    n = len(context)
    return _median_time(lambda: runner.forward("p", n, extra, keep_last=len(extra)), repeats)


#: the linear layers' kernels, by the profiler's op names (leaf ops: self time is the kernel's own)
MATRIX_OPS = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "aten::mm", "aten::addmm")
#: torch's attention ops (Hugging Face eager and the torch attention of the fast path)
ATTENTION_OPS = ("aten::bmm", "aten::_softmax", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math")


@contextlib.contextmanager
def _timed(owner, name: str, total: list[float]):
    """``owner.name`` timed into ``total[0]`` (seconds) while inside."""
    real = getattr(owner, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            total[0] += time.perf_counter() - t0
    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, real)


def step_split(runner, context: list[int], token: list[int], repeats: int) -> dict:
    """Where one decode step's time goes: milliseconds in the linear layers' kernels (torch's, or
    the native int4 and int8 kernels timed around their own calls), in attention (torch's attention ops, or the
    fast path's native kernel, timed around its own call) and in the rest (norms, rotary embeddings,
    casts, indexing, Python), per step; ``outside_matrix_share``: the share of the step not in the
    linear kernels. The split is taken on the layer-by-layer path; where the fast path runs a step's
    layers in one native call (the same kernels on the same inputs), that step's time and what it
    leaves outside the kernels come as ``one_call_*``."""
    runner.forward("split", 0, context)
    n = len(context)
    step = lambda: runner.forward("split", n, token, keep_last=len(token))  # noqa: E731 - rewrites the same position
    one_call = None
    timed_path = contextlib.nullcontext()
    if getattr(runner, "_table", None) is not None:  # the layers in one native call
        one_call = _median_time(step, repeats)
        timed_path = runner.layer_by_layer()  # whose kernel calls can be timed
    with timed_path:
        split = _split(runner, step, repeats)
    runner.release("split")
    if one_call is not None:
        ms, kernels = 1e3 * one_call, split["matrix_ms"] + split["attention_ms"]
        split |= {"one_call_step_ms": round(ms, 2), "one_call_rest_ms": round(max(ms - kernels, 0.0), 2),
                  "one_call_outside_matrix_share": round(max(0.0, 1 - split["matrix_ms"] / ms), 3)}
    return split


def _split(runner, step, repeats: int) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from speculative.attend import load_kernel
    from speculative.qmatmul import load_q4, load_q8

    wall = _median_time(step, repeats)
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    passes = time.perf_counter() - t0  # the wall of the passes the parts are taken from (profiled, then timed)
    ops = {e.key: e.self_cpu_time_total / 1e3 / repeats for e in prof.key_averages()}  # ms per step
    matrix = sum(ops.get(k, 0.0) for k in MATRIX_OPS)
    attention = sum(ops.get(k, 0.0) for k in ATTENTION_OPS)
    native_attention, native_matrix = [0.0], [0.0]
    # the native kernels timed around their own (ctypes) calls, not the Python wrappers that allocate
    # and check around them: those are the rest
    with contextlib.ExitStack() as timing:
        for kernel, total in ((load_kernel(), native_attention), (load_q4(), native_matrix), (load_q8(), native_matrix)):
            if kernel is not None:
                timing.enter_context(_timed(kernel, "fn", total))
        t0 = time.perf_counter()
        for _ in range(repeats):
            step()
        passes += time.perf_counter() - t0
    attention += 1e3 * native_attention[0] / repeats
    matrix += 1e3 * native_matrix[0] / repeats
    ms = 1e3 * wall
    return {"step_ms": round(ms, 2), "matrix_ms": round(matrix, 2), "attention_ms": round(attention, 2),
            "rest_ms": round(max(ms - matrix - attention, 0.0), 2), "outside_matrix_share": round(max(0.0, 1 - matrix / ms), 3),
            "passes_ms": round(1e3 * passes / repeats, 2)}


def speculation_limit(a: float, c: float, v: dict[int, float], k_max: int) -> dict:
    """The best k and S(k) (formula above) at acceptance a, draft cost c and relative verify costs v."""
    ks = [k for k in range(k_max + 1) if (k + 1) in v]
    scores = {k: expected_speedup(a, k, c, v[k + 1]) for k in ks}
    best = max(scores, key=lambda k: (scores[k], -k))
    return {"best_k": best, "S": round(scores[best], 3), "S_by_k": {k: round(x, 3) for k, x in scores.items()}}


def measured_alphas(bench_json: str) -> dict[str, float]:
    """Acceptance rates an ``osd bench`` report measured: '<method>/<domain>' -> alpha."""
    res = json.loads(Path(bench_json).read_text())
    out = {}
    for dom, d in res["domains"].items():
        for m, e in d.items():
            if e.get("alpha") is not None:
                out[f"{m}/{dom}"] = e["alpha"]
    return out


def profile(target_name: str, workload: str, context: int = 128, max_verify: int = 9, repeats: int = 15,
            coverage_prompts: int = 8, coverage_tokens: int = 48, device: str = "cpu", dtype: str = "float32",
            paths: tuple[str, ...] = PATHS, drafts: tuple[str, ...] | None = None, alphas: dict[str, float] | None = None,
            threads: int = 2) -> dict:
    target, tok = load_model(ModelConfig(name=target_name, device=device, dtype=dtype))
    recs = load_workload(workload)
    ctx = tok(" ".join(r.text for r in recs[:20]))["input_ids"][:context]
    extra = tok(" ".join(r.text for r in recs[20:40]))["input_ids"][:max_verify]
    alphas = alphas or {"a=0.3": 0.3, "a=0.5": 0.5, "a=0.7": 0.7}
    out = {"device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."), "context": context,
           "alphas": alphas, "paths": {}, "skipped": {}}
    # the target's own greedy outputs on prompts not used to choose head ids: head coverage
    held_out = recs[1::2][:coverage_prompts]
    emitted: list[int] = []
    for r in held_out:
        ids = encode_prompt(tok, r.text)
        with torch.inference_mode():
            g = target.generate(torch.tensor([ids], device=target.device), max_new_tokens=coverage_tokens, do_sample=False)
        emitted += g[0, len(ids):].tolist()
    texts = [r.text for r in recs[0::2]]
    # each draft option built once (its head ids chosen once), then run on every path
    options = [(n, *build_draft_model(c, target, tok, texts)) for n, c in DRAFT_OPTIONS if drafts is None or n in drafts]
    ng = NgramProposer()
    ngram_s = _median_time(lambda: ng.lookup(ctx + extra, 8), repeats)
    for path in paths:
        if path == "llamacpp":
            entry = _llamacpp_path(target_name, ctx, extra, repeats, threads, out["skipped"])
            if entry is None:
                continue
            t1, rel = entry["target_ms_per_step"] / 1000, entry["verify_cost_relative"]
        else:
            try:
                t_runner = make_runner(target, path, name="target")
            except FastPathError as e:
                out["skipped"][path] = str(e)
                continue
            verify = {j: _step_time(t_runner, ctx, extra[:j], repeats) for j in range(1, max_verify + 1)}
            t1 = verify[1]
            rel = {j: round(v / t1, 3) for j, v in verify.items()}
            entry = {"runtime": runtime_of(t_runner), "target_ms_per_step": round(1000 * t1, 2),
                     "verify_cost_relative": rel, "drafts": {},
                     "kv_bytes_per_token": kv_bytes_per_token(target.config, path, eager_dtype=dtype),
                     "step_split": step_split(t_runner, ctx, extra[:1], repeats)}
            del t_runner
            for name, draft, keep in options:
                runner = make_runner(draft, path, keep, name="draft", draft=True)
                d = _step_time(runner, ctx, extra[:1], repeats)
                e = {"ms_per_token": round(1000 * d, 2), "c": round(d / t1, 3)}
                if keep is not None:
                    kept = set(keep.tolist())
                    e["head_coverage_of_target_tokens"] = round(sum(t in kept for t in emitted) / max(1, len(emitted)), 3)
                entry["drafts"][name] = e
        entry.setdefault("drafts", {})["ngram"] = {"ms_per_token": round(1000 * ngram_s, 4), "c": round(ngram_s / t1, 5)}
        entry["limit"] = {
            name: {label: speculation_limit(a, e["c"], rel, max_verify - 1) for label, a in alphas.items()}
            for name, e in entry["drafts"].items()
        }
        out["paths"][path] = entry
    return out


def _llamacpp_path(target_name, ctx, extra, repeats, threads, skipped) -> dict | None:
    from .llamacpp import BackendUnavailable, gguf_of, llamacpp_verify_times, load_llamacpp

    try:
        llm = load_llamacpp(gguf_of(target_name), threads, logits_all=True)
    except BackendUnavailable as e:
        skipped["llamacpp"] = str(e)
        return None
    times = llamacpp_verify_times(llm, ctx, extra, repeats)
    t1 = times[1]
    return {"runtime": "llama.cpp", "target_ms_per_step": round(1000 * t1, 2),
            "verify_cost_relative": {j: round(v / t1, 3) for j, v in times.items()}, "drafts": {}}


def format_profile(res: dict) -> str:
    lines = []
    for path, e in res["paths"].items():
        kv = f"; KV cache {e['kv_bytes_per_token']} bytes per token" if e.get("kv_bytes_per_token") else ""
        lines.append(f"== {e['runtime']}: target {e['target_ms_per_step']:.1f} ms per step at context {res['context']}{kv}")
        lines.append("   v(j), j = 1..: " + ", ".join(f"{v:.2f}" for v in e["verify_cost_relative"].values()))
        if e.get("step_split"):
            sp = e["step_split"]
            lines.append(f"   a step: linear kernels {sp['matrix_ms']:.1f} ms, attention {sp['attention_ms']:.1f}, the rest "
                         f"{sp['rest_ms']:.1f} of {sp['step_ms']:.1f}: {100 * sp['outside_matrix_share']:.0f}% outside the "
                         "linear kernels")
            if "one_call_step_ms" in sp:
                lines.append(f"   the layers in one native call: {sp['one_call_step_ms']:.1f} ms a step, the rest "
                             f"{sp['one_call_rest_ms']:.1f}: {100 * sp['one_call_outside_matrix_share']:.0f}% outside the linear kernels")
        lines.append(f"   {'draft':<24}{'ms/token':>10}{'c':>8}{'coverage':>10}  " + "  ".join(f"{a:>14}" for a in res["alphas"]))
        for name, d in e["drafts"].items():
            cov = d.get("head_coverage_of_target_tokens")
            lim = "  ".join(f"{'S=' + format(x['S'], '.2f') + ' k=' + str(x['best_k']):>14}" for x in e["limit"][name].values())
            lines.append(f"   {name:<24}{d['ms_per_token']:>10.3f}{d['c']:>8.3f}{'' if cov is None else format(cov, '.3f'):>10}  {lim}")
    for path, why in res["skipped"].items():
        lines.append(f"skipped {path}: {why}")
    return "\n".join(lines)


def profile_main(args) -> int:
    torch.set_num_threads(args.threads)
    alphas = {f"a={a}": a for a in args.alpha} if args.alpha else None
    if args.alpha_from:
        alphas = {**(alphas or {}), **measured_alphas(args.alpha_from)}
    res = profile(args.target, args.workload, args.context, args.max_verify, args.repeats,
                  device=args.device, dtype=args.dtype, paths=tuple(args.paths.split(",")),
                  drafts=tuple(args.drafts.split(",")) if args.drafts else None, alphas=alphas, threads=args.threads)
    print(format_profile(res))
    write_json(res, args.json)
    return 0
