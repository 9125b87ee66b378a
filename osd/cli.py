"""``osd``: one entry point, one subcommand per job.

  osd serve                        the server (Ray Serve, OpenAI-compatible) on serve_config.yaml
  osd bench-serve --url URL        drive the running server at concurrency 1/4/8 (tokens/s, TTFT, ITL)
  osd top [--url URL]              live figures of a running server: acceptance per domain, rates, learner
  osd generate "prompt"            one-shot generation with live speculative statistics
  osd generate --interactive       a chat loop on the embedded default
  osd bench --workload F --n N     target-only vs ours vs HF assisted vs HF prompt lookup
  osd profile                      draft options' cost ratio c, verify cost of j tokens
  osd workload build --out F       build the workload file from public corpora
  osd workload open --out F        other sources of the domains, and domains no label names
  osd train-draft --domain code    distil a draft offline for a few minutes (by hand)
  osd experiment online|shift      alpha vs records: static / online learner / offline bound
  osd experiment mixture           one shared draft vs per-domain drafts picked by the router
  osd experiment overhead          serving speed with the learner paused / in the background
  osd draft versions|rollback      the learner's checkpoints; serve an earlier draft version again
  osd route --workload F           routing accuracy (topic, language), confusion table, latency
  osd distill                      the general starting draft (all domains), cached; --draft-checkpoint default
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

DEFAULT_WORKLOAD = Path(__file__).resolve().parent.parent / "bench" / "data" / "workload.jsonl"


def _engine_args(p: argparse.ArgumentParser) -> None:
    from config import EMBEDDED_TARGET, QUANTIZE_CHOICES

    g = p.add_argument_group("engine")
    g.add_argument("--target", default=EMBEDDED_TARGET, help="target model: embedded default, HF id, folder or .gguf")
    g.add_argument("--draft", default="truncated", choices=["truncated", "fresh", "path", "ngram", "none"])
    g.add_argument("--draft-layers", type=int, default=2)
    g.add_argument("--draft-path", default=None, help="with --draft path: any causal LM sharing the target's vocabulary")
    g.add_argument("--draft-checkpoint", default=None, help="a draft saved by osd train-draft, or 'default' (osd distill)")
    g.add_argument("--draft-adapter", default=None,
                   help="adapters to start the built draft from: a folder of osd train-draft --adapter-rank, or 'shipped'")
    g.add_argument("--head-vocab", type=int, default=None, help="restrict the draft head to the N most frequent tokens")
    g.add_argument("--draft-context", type=int, default=None, metavar="N",
                   help="the learned draft reads at most the last N tokens of a prompt (default: all)")
    g.add_argument("--ngram-first", action="store_true", help="try prompt lookup before the learned draft")
    g.add_argument("--k-max", type=int, default=6)
    g.add_argument("--fixed-k", type=int, default=None, help="always propose this many tokens (default: adaptive)")
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--device", default="cpu", help="torch device of target and draft (cpu, cuda, cuda:1, ...)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--quantize", default="auto", choices=QUANTIZE_CHOICES, help="runtime: int4 / int8 weights on our fast CPU path, lean = our bfloat16 forward with CUDA graphs on a GPU, none = Hugging Face eager in --dtype (the float32 reference); auto = int4 on a CPU, lean on a GPU")
    g.add_argument("--compile", action="store_true", help="lean runtime: fuse its layers with torch.compile at start (see ModelConfig.compile)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="osd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate with live speculative statistics")
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--interactive", "-i", action="store_true")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    _engine_args(g)

    b = sub.add_parser("bench", help="benchmark against target-only and Hugging Face baselines")
    b.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    b.add_argument("--n", type=int, default=100)
    b.add_argument("--max-tokens", type=int, default=48)
    b.add_argument("--domains", nargs="*", default=None)
    b.add_argument("--exclude", nargs="+", default=None, help="workload files whose prompts are skipped (e.g. what a draft trained on)")
    b.add_argument("--methods", default="target,spec,spec_lookup,hf_assisted,hf_lookup",
                   help="comma-separated: target, spec, spec_lookup, spec_suffix, spec_controller, hf_assisted, hf_lookup, "
                        "target_fp32, target_int8, target_int4, llamacpp")
    b.add_argument("--lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    b.add_argument("--draft-acceptance", type=float, nargs="*", default=None, metavar="A",
                   help="also spec_controller@A: the learned draft proposing the target's own token with probability A "
                        "(its forwards still run): what a draft trained to that acceptance would buy")
    b.add_argument("--json", default=None)
    _engine_args(b)

    p = sub.add_parser("profile", help="cost ratio c of each draft option and the target's verify cost")
    p.add_argument("--target", default=None)
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--max-verify", type=int, default=9)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--paths", default="none,int8,int4,llamacpp", help="runtimes: none (HF eager), int8, int4, llamacpp")
    p.add_argument("--drafts", default=None, help="comma-separated draft options (default: all; e.g. truncated-2,truncated-2+head8192)")
    p.add_argument("--alpha", type=float, nargs="*", default=None, help="acceptance rates for the limit S(k)")
    p.add_argument("--alpha-from", default=None, help="an osd bench JSON: S(k) at the acceptance rates it measured")
    p.add_argument("--json", default=None)

    sub.add_parser("top", help="live figures of a running server (osd top -h)", add_help=False)
    sub.add_parser("workload", help="osd workload build: a workload file from public corpora (osd workload build -h)", add_help=False)
    sub.add_parser("draft", help="the learner's checkpoints: osd draft versions | rollback (osd draft -h)", add_help=False)
    sub.add_parser("route", help="route a workload: topic / language accuracy, confusion, latency (osd route -h)", add_help=False)
    sub.add_parser("train-draft", help="distil a draft offline from the target's generations (osd train-draft -h)", add_help=False)
    sub.add_parser("experiment", help="experiments: online | shift | mixture | overhead (osd experiment online -h)", add_help=False)
    sub.add_parser("distill", help="build the cached general starting draft (train-draft on all domains)", add_help=False)
    return ap


def _generate(args) -> int:
    import torch

    from config import SamplingParams
    from bench.bench import engine_config_from_args
    from speculative.detokenize import Detokenizer
    from speculative.engine import RequestError, prompt_text
    from drafts.build import build_engine

    torch.set_num_threads(args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop,
    )
    if not args.interactive and not args.prompt:
        raise SystemExit("osd generate: give a prompt, or --interactive")
    if args.prompt:
        prompt_text(args.prompt)  # refuse bad text before the model loads
    engine = build_engine(engine_config_from_args(args))
    tty = sys.stderr.isatty()

    def run(prompt: str) -> None:
        rid = engine.add_request(prompt, params)
        st = engine.requests[rid]
        detok = Detokenizer(engine.tokenizer, params.stop)  # prints only final text: no half characters
        try:
            while not st.finished:
                res = engine.step(rid)
                sys.stdout.write(detok.update(st.output))
                sys.stdout.flush()
                s = st.stats
                line = (f"[step {s.steps} k={res.proposed} ({res.source}) accepted {res.accepted} | alpha "
                        f"{'-' if s.alpha is None else f'{s.alpha:.2f}'} | {len(st.output) / max(1e-9, s.draft_s + s.target_s):.1f} tok/s]")
                if tty:
                    sys.stderr.write("\x1b7\x1b[999;1H\x1b[2K" + line + "\x1b8")
                    sys.stderr.flush()
            s = st.stats.summary()
            sys.stdout.write(detok.finish(st.output) + "\n")
            secs = s["draft_s"] + s["target_s"]
            alpha = "-" if s["alpha"] is None else f"{s['alpha']:.3f}"
            mal = "-" if s["mean_acceptance_length"] is None else f"{s['mean_acceptance_length']:.2f}"
            print(f"-- {s['emitted']} tokens in {secs:.2f} s ({s['emitted'] / max(secs, 1e-9):.1f} tok/s), "
                  f"{s['steps']} target steps, proposed {s['proposed']}, accepted {s['accepted']}, alpha {alpha}, "
                  f"mean acceptance length {mal}, finish {st.finish_reason}", file=sys.stderr)
        finally:
            engine.release(rid)

    if args.prompt:
        run(args.prompt)
    if args.interactive:
        while True:
            try:
                prompt = input("\nyou> ")
            except EOFError:
                break
            if prompt.strip() in ("/quit", "/exit"):
                break
            if prompt.strip():
                try:
                    run(prompt)
                except RequestError as e:  # a bad prompt ends that turn, not the session
                    print(f"error: {e}", file=sys.stderr)
    return 0


def _subcommand(argv: list[str]):
    """The main of a subcommand whose options live with its library (None: parsed here)."""
    if argv[:1] == ["serve"]:  # the application; options live with its launcher
        from deployments.launch import main as serve_main

        return serve_main
    if argv[:1] == ["bench-serve"]:
        from bench.serve_bench import main as bench_serve_main

        return bench_serve_main
    if argv[:1] == ["train-draft"]:  # its options live with the trainer
        from learner.offline import main as train_main

        return train_main
    if argv[:1] == ["workload"]:  # osd workload build ...: options live with the builder
        from workloads import main as workload_main

        def build(rest: list[str]) -> int:
            if rest[:1] == ["open"]:  # sources beyond the built-in ones, and domains no label names
                from workloads.open_set import main as open_main

                return open_main(rest[1:])
            if rest[:1] != ["build"]:
                print("usage: osd workload build --out FILE [--per-domain N] [--domains ...] [--languages ...]\n"
                      "       osd workload open --out FILE [--per-source N] [--sources ...]", file=sys.stderr)
                return 2
            return workload_main(rest[1:])

        return build
    if argv[:1] == ["draft"]:  # operator commands on the learner's checkpoints
        from learner.ops import main as draft_main

        return draft_main
    if argv[:1] == ["route"]:  # osd route: options live with the router
        from router.cli import main as route_main

        return route_main
    if argv[:1] == ["experiment"]:  # osd experiment online|shift: options live with the harness
        from bench.experiments import main as experiment_main

        return experiment_main
    if argv[:1] == ["distill"]:  # the general starting draft: all domains, cached as "default"
        from learner.offline import main as train_main

        return lambda rest: train_main(distill_args(rest))
    return None


def distill_args(rest: list[str]) -> list[str]:
    """``osd distill``'s command line for ``osd train-draft``: the general starting draft's defaults
    (all domains of train.jsonl, never the benchmark's prompts, the prompts' positions trained on
    too, cached where ``"default"`` finds the draft of that ``--kind``), then ``rest``, whose
    options override them (``--no-prompt-positions``: output positions only).
    ``--adapter-rank R``: the general starting adapter instead, written where ``draft.adapter:
    shipped`` reads it (the package's ``drafts/starting``), on the full head that the served draft
    has, with the recipe of the adapter in the package: 720 prompts of router_train.jsonl, 180 of
    each domain, never a prompt of the benchmarks' files nor of the two sources the shift
    experiment streams (DB-GPT's SQL, HumanEval), 1,200 s of training. The package's adapter then
    trained as long again from there: the same command with ``--init-adapter shipped
    --teacher-outputs served`` (docs/proposers.md, "Twice the steps"), and once more with
    ``--n-prompts 1500`` added ("Twice the prompts").
    """
    from drafts.build import default_draft_path, shipped_adapter_path

    known = argparse.ArgumentParser(add_help=False)
    known.add_argument("--kind", default="truncated")
    known.add_argument("--adapter-rank", type=int, default=0)
    seen = known.parse_known_args(rest)[0]
    data = DEFAULT_WORKLOAD.parent
    if seen.adapter_rank:
        recipe = ["--workload", str(data / "router_train.jsonl"),
                  "--exclude", *(str(data / f) for f in ("workload.jsonl", "open.jsonl", "mixture.jsonl")),
                  "--exclude-sources", "dbgpt-example", "humaneval", "--balance-domains",
                  "--out", str(shipped_adapter_path()), "--n-prompts", "720", "--holdout", "0.01",
                  "--seconds", "1200", "--lr", "0.002"]
    else:
        recipe = ["--workload", str(data / "train.jsonl"), "--exclude", str(DEFAULT_WORKLOAD),
                  "--out", str(default_draft_path(seen.kind)), "--head-vocab", "8192",
                  "--n-prompts", "400", "--holdout", "0.05", "--seconds", "900"]
    return recipe + ["--max-tokens", "48", "--prompt-positions"] + list(rest)


def _run(argv: list[str]) -> int:
    sub = _subcommand(argv)
    if sub is not None:
        return sub(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "generate":
        return _generate(args)
    if args.cmd == "bench":
        from bench.bench import bench_main

        return bench_main(args)
    if args.cmd == "profile":
        from bench.profile import profile_main
        from config import EMBEDDED_TARGET

        args.target = args.target or EMBEDDED_TARGET
        return profile_main(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Every subcommand; bad input (a request, a setting, a model that cannot be loaded) ends with one
    clear line on stderr and exit status 2, never a traceback."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["top"]:  # a light client: no torch or transformers to import
        from telemetry.top import main as top_main

        return top_main(argv[1:])
    from pydantic import ValidationError
    from transformers.utils import logging as hf_logging

    from speculative.engine import RequestError
    from speculative.models import ModelLoadError, VocabMismatchError

    hf_logging.disable_progress_bar()
    try:
        return _run(argv)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'input'}: {err['msg']}" for err in e.errors())
        print(f"osd {argv[0] if argv else ''}: error: {problems}", file=sys.stderr)
        return 2
    except (RequestError, ModelLoadError, VocabMismatchError, ValueError, UnicodeError) as e:
        print(f"osd {argv[0] if argv else ''}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:  # a file named on the command line
        print(f"osd {argv[0] if argv else ''}: error: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
