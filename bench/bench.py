"""``osd bench``: target-only vs our speculative decoding vs Hugging Face assisted generation and
prompt-lookup decoding vs llama.cpp, on the same prompts, interleaved, in one process.

Every method decodes greedily. A lossless method must equal its reference token for token (ours:
target-only on the runtime served; Hugging Face's: HF greedy on the float model) and the report
says whether it did; target-only on another runtime and llama.cpp are other models (other
precisions), so for them the report gives their agreement with the served target instead.
Figures per domain and overall: tokens/s, speedup over target-only on the same prompts, and for
our engine alpha, mean acceptance length, c (draft cost per token / one target step) and the
speedup the measured alpha and c predict.
"""

from __future__ import annotations

import copy
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from config import DraftConfig, EngineConfig, KPolicyConfig, ModelConfig, SamplingParams
from speculative.engine import SpeculativeEngine
from speculative.runtime import FastPathError, make_runner, runtime_of
from speculative.kpolicy import expected_speedup
from speculative.proposers import NgramProposer
from speculative.stats import SpecStats

from workloads import WorkloadRecord, load_workload, without_prompts_of

#: target: target-only on the runtime served (``--quantize``; the reference of ours); spec: our
#: engine with the configured draft; spec_lookup: our engine with the prompt-lookup proposer alone;
#: spec_suffix: our engine with the suffix tree alone (over the bench's earlier outputs: it learns
#: as the bench goes, as a server does); spec_controller: the controller over suffix tree, prompt
#: lookup and the configured draft (no learner);
#: hf_assisted: HF generate with assistant_model = the same draft; hf_lookup: HF prompt-lookup
#: decoding; target_fp32 / target_int8 / target_int4 / target_lean / target_lean_compiled: target-only
#: on that runtime (the float32 reference is Hugging Face eager); llamacpp: llama.cpp's plain greedy decoding of the same GGUF.
METHODS = ("target", "spec", "spec_lookup", "spec_suffix", "spec_controller", "hf_assisted", "hf_lookup", "target_fp32",
           "target_int8", "target_int4", "target_lean", "target_lean_compiled", "llamacpp")
DEFAULT_METHODS = "target,spec,spec_lookup,hf_assisted,hf_lookup"
#: method -> (ModelConfig.quantize, ModelConfig.compile) of its runtime
RUNTIMES = {"target_fp32": ("none", False), "target_int8": ("int8", False), "target_int4": ("int4", False),
            "target_lean": ("lean", False), "target_lean_compiled": ("lean", True)}
#: methods that promise equality with their reference (the others report agreement)
LOSSLESS = ("target", "spec", "spec_lookup", "spec_suffix", "spec_controller", "hf_assisted", "hf_lookup")


def select(records: list[WorkloadRecord], n: int, domains: list[str] | None = None) -> list[WorkloadRecord]:
    """Up to n records, round-robin over domains (in file order within each) so every prefix is balanced."""
    by_domain: dict[str, list[WorkloadRecord]] = defaultdict(list)
    for r in records:
        if not domains or r.domain in domains:
            by_domain[r.domain].append(r)
    out, i = [], 0
    queues = list(by_domain.values())
    while len(out) < n and any(i < len(q) for q in queues):
        out.extend(q[i] for q in queues if i < len(q))
        i += 1
    return out[:n]


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    prompts: int = 0
    equal: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    first_s: float | None = 0.0  # seconds to the first token (the prefill), summed; None where not known

    def add(self, tokens: int, seconds: float, equal: bool | None, first_s: float | None = None) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.prompts += 1
        self.equal += bool(equal)
        self.first_s = None if first_s is None or self.first_s is None else self.first_s + first_s

    @property
    def decode_tps(self) -> float | None:
        """Output tokens after the first per second after it (the prefill left out)."""
        if self.first_s is None or self.seconds <= self.first_s:
            return None
        return (self.tokens - self.prompts) / (self.seconds - self.first_s)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def hf_greedy_generate(model, ids: list[int], max_tokens: int, eos: set[int], **kw) -> tuple[list[int], float]:
    """Hugging Face greedy ``generate`` on one prompt: (new tokens cut before the first EOS, seconds).
    ``kw`` go to ``generate`` (``assistant_model``, ``prompt_lookup_num_tokens``, ...)."""
    inp = torch.tensor([ids], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_tokens, do_sample=False, **kw
        )
    toks = out[0, len(ids) :].tolist()  # on a GPU this waits for the last kernel
    dt = time.perf_counter() - t0
    for i, t in enumerate(toks):  # HF keeps the EOS token; our engine ends before it
        if t in eos:
            return toks[:i], dt
    return toks, dt


def _other_runtimes(engine: SpeculativeEngine, methods: tuple[str, ...], skipped: dict) -> dict:
    """Target-only engines on the runtimes the methods name (not the one served: that is ``target``)."""
    served = runtime_of(engine.target)
    out = {}
    for m in methods:
        if m not in RUNTIMES:
            continue
        model = engine.target.model
        quantize, compiled = RUNTIMES[m]
        if quantize == "none" and model.dtype != torch.float32:
            model = copy.deepcopy(model).float()
        try:
            runner = make_runner(model, quantize, name="target", compile=compiled)
        except FastPathError as e:
            skipped[m] = str(e)
            continue
        if runtime_of(runner) == served:
            skipped[m] = f"the served runtime ({served}): see target"
            continue
        runner.warmup()  # CUDA graphs before timing, as the served target's
        out[m] = SpeculativeEngine(runner, engine.tokenizer, None, engine.cfg)
    return out


def _llamacpp(engine: SpeculativeEngine, methods: tuple[str, ...], skipped: dict, threads: int):
    if "llamacpp" not in methods:
        return None
    from .llamacpp import BackendUnavailable, gguf_of, load_llamacpp

    try:
        return load_llamacpp(gguf_of(engine.cfg.model.name), threads)
    except BackendUnavailable as e:
        skipped["llamacpp"] = str(e)
        return None


def run_bench(
    engine: SpeculativeEngine,
    records: list[WorkloadRecord],
    max_tokens: int,
    methods: tuple[str, ...] = tuple(DEFAULT_METHODS.split(",")),
    lookup_tokens: int = 10,
    progress: bool = True,
    threads: int | None = None,
    draft_acceptance: tuple[float, ...] = (),
) -> dict:
    """``draft_acceptance``: for each A, the method ``spec_controller@A``, whose learned draft
    proposes the target's own token with probability A (:mod:`bench.oracle`)."""
    target = engine.target.model
    runner = engine.learned_draft.runner if engine.learned_draft is not None else None
    assistant = runner.model if runner is not None and runner.vocab_map is None else None
    skipped = {}
    if "hf_assisted" in methods and assistant is None:
        skipped["hf_assisted"] = "needs a full-vocabulary draft model (this draft has none or a restricted head)"
        methods = tuple(m for m in methods if m != "hf_assisted")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {METHODS}")
    if "target" not in methods:
        methods = ("target",) + methods  # the reference output and speed
    params = SamplingParams(max_tokens=max_tokens)
    runtimes = _other_runtimes(engine, methods, skipped)
    llm = _llamacpp(engine, methods, skipped, threads or torch.get_num_threads())
    methods = tuple(m for m in methods if m not in skipped)
    alone = SpeculativeEngine(engine.target, engine.tokenizer, None, engine.cfg)  # target-only, runtime served
    lookup = None
    if "spec_lookup" in methods:
        cfg = engine.cfg.model_copy(update={"draft": DraftConfig(proposers=["ngram"])})
        lookup = SpeculativeEngine(engine.target, engine.tokenizer, NgramProposer(cfg.draft.ngram), cfg)
        lookup.costs.verify_s.update(engine.costs.verify_s)
        lookup.costs.draft_s["ngram"] = 0.0
    engines = {"spec": engine, "spec_lookup": lookup, **_proposer_engines(engine, methods)}
    oracles = _acceptance_engines(engine, draft_acceptance, engines, skipped)
    methods = methods + tuple(oracles)
    hf_methods = [m for m in methods if m.startswith("hf_")]
    tallies: dict[tuple[str, str], Tally] = defaultdict(Tally)
    rows = []
    for rec in tqdm(records, desc="bench", disable=not progress, unit="prompt"):
        ids = engine.encode(rec.text)
        g = alone.generate(ids, params)
        ref, dt = g.token_ids, g.seconds
        row = {"domain": rec.domain, "lang": rec.lang, "source": rec.source, "prompt_tokens": len(ids),
               "target": {"tokens": len(ref), "s": dt, "first_token_s": g.first_token_s}}
        for dom in (rec.domain, "overall"):
            tallies[("target", dom)].add(len(ref), dt, True, g.first_token_s)
        # HF's methods run the float model: their reference is HF greedy on it (untimed)
        hf_ref = hf_greedy_generate(target, ids, max_tokens, engine.eos_ids)[0] if hf_methods else None
        for m in methods:
            if m == "target":
                continue
            stats, first = None, None
            if m in oracles:
                oracles[m].reference = ids + ref
            if m in engines:
                g = engines[m].generate(ids, params)
                toks, dt, stats, first = g.token_ids, g.seconds, g.stats, g.first_token_s
            elif m in runtimes:  # target-only on another runtime
                g = runtimes[m].generate(ids, params)
                toks, dt = g.token_ids, g.seconds
            elif m == "llamacpp":
                from .llamacpp import llamacpp_greedy

                toks, dt = llamacpp_greedy(llm, ids, max_tokens, engine.eos_ids)
            elif m == "hf_assisted":
                toks, dt = hf_greedy_generate(target, ids, max_tokens, engine.eos_ids, assistant_model=assistant)
            elif m == "hf_lookup":
                toks, dt = hf_greedy_generate(target, ids, max_tokens, engine.eos_ids, prompt_lookup_num_tokens=lookup_tokens)
            else:
                raise ValueError(f"unknown method {m!r}; choose from {METHODS}")
            equal = toks == (hf_ref if m.startswith("hf_") else ref)
            row[m] = {"tokens": len(toks), "s": dt, "equal": equal}
            if stats is not None:
                row[m].update(proposed=stats.proposed, accepted=stats.accepted, rejected=stats.rejected, steps=stats.steps,
                              first_token_s=first, draft_s=stats.draft_s, target_s=stats.target_s)
            for dom in (rec.domain, "overall"):
                t = tallies[(m, dom)]
                t.add(len(toks), dt, equal, first)
                if stats is not None:
                    t.spec.merge(stats)
        rows.append(row)
    return summarise(engines, tallies, rows, methods, skipped, max_tokens)


def _proposer_engines(engine: SpeculativeEngine, methods) -> dict:
    """spec_suffix / spec_controller: engines over the same target runner, costs as measured for spec."""
    from config import SuffixConfig
    from drafts.build import controller_over
    from speculative.suffix import SuffixProposer

    out = {}
    for m in ("spec_suffix", "spec_controller"):
        if m not in methods:
            continue
        if m == "spec_suffix":
            prop = SuffixProposer(SuffixConfig())
        else:
            learned = engine.learned_draft
            prop = controller_over(copy.deepcopy(learned) if learned is not None else None)
        out[m] = _beside(engine, prop)
    return out


def _beside(engine: SpeculativeEngine, proposer) -> SpeculativeEngine:
    """An engine over ``engine``'s target with ``proposer``, starting from its measured costs (the
    model-free proposers' as free)."""
    e = SpeculativeEngine(engine.target, engine.tokenizer, proposer, engine.cfg)
    e.costs.verify_s.update(engine.costs.verify_s)
    e.costs.draft_s.update({**engine.costs.draft_s, "suffix": 0.0, "ngram": 0.0})
    return e


def _acceptance_engines(engine: SpeculativeEngine, acceptances, engines: dict, skipped: dict) -> dict:
    """``spec_controller@A`` for each A: the controller over a fresh suffix tree, prompt lookup and
    the learned draft with its acceptance set to A; added to ``engines``; returns method -> draft."""
    from drafts.build import controller_over
    from speculative.proposers import DraftModelProposer

    from .oracle import AcceptanceDraft

    learned = engine.learned_draft
    out = {}
    for i, a in enumerate(acceptances):
        m = f"spec_controller@{a:g}"
        if not isinstance(learned, DraftModelProposer):
            skipped[m] = "needs a learned token draft (this engine has none, or a feature draft)"
            continue
        draft = out[m] = AcceptanceDraft(learned, a, seed=i)
        engines[m] = _beside(engine, controller_over(draft))
    return out


def summarise(engines, tallies, rows, methods, skipped, max_tokens) -> dict:
    engine = engines["spec"]
    costs = engine.costs
    t1 = costs.verify_s.get(1)
    domains = sorted({d for (_, d) in tallies if d != "overall"}) + ["overall"]
    result = {"max_tokens": max_tokens, "methods": list(methods), "skipped": skipped, "domains": {}, "costs": {
        "target_ms_per_step": 1000 * t1 if t1 else None,
        "draft_ms_per_token": {s: 1000 * v for s, v in costs.draft_s.items()},
        "c": {s: costs.c(s) for s in costs.draft_s},
        "verify_cost_relative": {j: costs.relative_verify(j) for j in sorted(costs.verify_s)},
    }}
    for dom in domains:
        base = tallies[("target", dom)]
        d = {}
        for m in methods:
            t = tallies[(m, dom)]
            entry = {
                "prompts": t.prompts,
                "tokens": t.tokens,
                "seconds": round(t.seconds, 3),
                "tokens_per_s": round(t.tps, 2),
                "speedup": round(t.tps / base.tps, 3) if base.tps else None,
                # the share of the wall before the first token, and the speed after it (the decode)
                "prefill_share": round(t.first_s / t.seconds, 3) if t.first_s is not None and t.seconds else None,
                "decode_tokens_per_s": None if t.decode_tps is None else round(t.decode_tps, 2),
                "decode_speedup": round(t.decode_tps / base.decode_tps, 3) if t.decode_tps and base.decode_tps else None,
                "all_equal_target_greedy": t.equal == t.prompts,
                "equal_prompts": t.equal,
                "lossless_method": m.split("@")[0] in LOSSLESS,  # False: equal_prompts counts agreement with another model
            }
            if m in engines:
                s = t.spec
                a = s.alpha
                mc = engines[m].costs
                own = engines[m].proposer.sources if engines[m].proposer is not None else ()
                src = next((x for x in ("draft", *own) if x in own and x in mc.draft_s), None)  # its learned draft's first
                c = mc.c(src) if src else 0.0
                k_max = engine.cfg.k.k_max
                entry.update(
                    alpha=None if a is None else round(a, 4),
                    # accepted / checked (a token after the first rejection of a step is not checked)
                    token_acceptance=None if s.token_acceptance is None else round(s.token_acceptance, 4),
                    mean_acceptance_length=None if s.mean_acceptance_length is None else round(s.mean_acceptance_length, 3),
                    proposed=s.proposed,
                    accepted=s.accepted,
                    steps=s.steps,
                    mean_k=round(s.proposed / s.steps, 3) if s.steps else None,
                    c=round(c, 4),
                    # the paper's formula (free verification) and with this machine's measured verify cost
                    theoretical_speedup=None if a is None else round(max(expected_speedup(a, k, c) for k in range(k_max + 1)), 3),
                    theoretical_speedup_measured_verify=None if a is None else round(
                        max(expected_speedup(a, k, c, mc.relative_verify(k + 1)) for k in range(k_max + 1)), 3),
                )
                if dom == "overall" and isinstance(picks := getattr(engines[m].proposer, "picks", None), dict):
                    entry["picks"] = dict(picks)  # steps each source drafted (a controller's)
            d[m] = entry
        result["domains"][dom] = d
    result["rows"] = rows
    return result


def format_table(result: dict) -> str:
    lines = []
    hdr = f"{'domain':<9}{'method':<20}{'n':>4}{'tok/s':>8}{'speedup':>9}{'prefill':>8}{'dec.x':>7}{'equal':>7}{'alpha':>7}{'acc.len':>8}{'mean k':>7}{'c':>6}{'theory':>8}"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for dom, d in result["domains"].items():
        for m, e in d.items():
            def f(key, fmt):
                v = e.get(key)
                return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"
            lines.append(
                f"{dom:<9}{m:<20}{e['prompts']:>4}{e['tokens_per_s']:>8.2f}{f('speedup', '.2f'):>9}"
                f"{f('prefill_share', '.0%'):>8}{f('decode_speedup', '.2f'):>7}{_equal_cell(e):>7}{f('alpha', '.3f'):>7}"
                f"{f('mean_acceptance_length', '.2f'):>8}{f('mean_k', '.2f'):>7}{f('c', '.2f'):>6}{f('theoretical_speedup', '.2f'):>8}"
            )
    c = result["costs"]
    if c["target_ms_per_step"]:
        lines.append(f"target {c['target_ms_per_step']:.1f} ms/step; draft ms/token {c['draft_ms_per_token']}; "
                     f"verify cost v(j) {({j: round(v, 2) for j, v in c['verify_cost_relative'].items()})}")
    for m, why in result["skipped"].items():
        lines.append(f"skipped {m}: {why}")
    return "\n".join(lines)


def _equal_cell(e: dict) -> str:
    """'yes' when a lossless method equalled its reference on every prompt, else how many it did;
    for other models (runtimes, llama.cpp) '~n': prompts whose output agreed with the served target."""
    if not e.get("lossless_method", True):
        return f"~{e['equal_prompts']}"
    return "yes" if e["all_equal_target_greedy"] else str(e["equal_prompts"])


def bench_main(args) -> int:
    torch.set_num_threads(args.threads)
    workload = without_prompts_of(load_workload(args.workload), args.exclude)
    records = select(workload, args.n, args.domains)
    if not records:
        raise SystemExit(f"no records in {args.workload} (domains {args.domains})")
    from drafts.build import build_engine

    cfg = engine_config_from_args(args)
    engine = build_engine(cfg, texts=[r.text for r in workload])
    result = run_bench(engine, records, args.max_tokens, tuple(args.methods.split(",")), args.lookup_tokens,
                       threads=args.threads, draft_acceptance=tuple(args.draft_acceptance or ()))
    result["runtime"] = runtime_of(engine.target)
    result["config"] = json.loads(cfg.model_dump_json())
    result["workload"] = str(args.workload)
    print(format_table(result))
    write_json(result, args.json)
    return 0


def measurement_cli(prog: str, doc: str, add_args, run, argv=None) -> int:
    """A ``python -m bench.<x>`` measurement: the module's own options (``add_args(parser)``) plus
    --target, --threads and --json; ``run(args)`` returns the report, printed as JSON and written."""
    import argparse

    from config import EMBEDDED_TARGET

    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=EMBEDDED_TARGET)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    add_args(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = run(args)
    print(json.dumps(res, indent=1))
    write_json(res, args.json)
    return 0


def write_json(result: dict, path: str | None) -> None:
    """Write a report as JSON (parents created) and say so; nothing when no path was given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(name=args.target, device=getattr(args, "device", "cpu"), dtype=getattr(args, "dtype", "float32"),
                          quantize=args.quantize, compile=getattr(args, "compile", False)),
        draft=DraftConfig(
            # --draft ngram / none: prompt lookup alone / target-only; else the learned draft, after
            # prompt lookup with --ngram-first
            proposers=(["ngram"] if args.draft == "ngram" else [] if args.draft == "none" else
                       ["ngram", "draft"] if args.ngram_first else ["draft"]),
            kind=args.draft if args.draft in ("truncated", "fresh", "path") else "truncated",
            num_layers=args.draft_layers,
            path=args.draft_path,
            head_vocab=args.head_vocab,
            context_tokens=getattr(args, "draft_context", None),
            checkpoint=args.draft_checkpoint,
            adapter=getattr(args, "draft_adapter", None),
        ),
        k=KPolicyConfig(k_max=args.k_max, fixed_k=args.fixed_k),
    )
