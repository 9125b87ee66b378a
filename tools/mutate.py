"""Mutation testing of the lossless core: does the test suite notice when the code is broken?

``make mutate`` (or ``python tools/mutate.py [--only FILE] [--json OUT]``) applies one small
change at a time to the functions of the files below (operator swaps, comparison boundaries,
``and``/``or``, dropped ``not``, integer constants +-1, index shifts, ``True``/``False``) and runs
the tests that cover that file; a mutant is *killed* when a test fails (or hangs past a time limit)
and *survives* when every test passes. Each survivor needs a new test or a written reason why it
cannot change behaviour (an equivalent mutant): ``tools/equivalent_mutants.json``, keyed by file,
function and the mutated source line.

It runs in one process: the mutated module is compiled and each mutated function's code object is
swapped into the live function (``func.__code__``), so every reference to it (imports by name,
bound methods) runs the mutant, and pytest runs in-process with ``-x``, fast tests first. Not part
of CI (minutes, not seconds).
"""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import importlib
import inspect
import io
import json
import signal
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_ROUTER_TESTS = ["tests/unit/test_router_policy.py", "tests/unit/test_router.py", "tests/unit/test_router_open.py",
                 "tests/unit/test_mixture.py"]
#: the replay records the learner trains on: built from verification, encoded, sharded, sampled
_REPLAY_TESTS = ["tests/unit/test_replay.py", "tests/unit/test_trainer.py", "tests/unit/test_background.py",
                 "tests/unit/test_feature.py", "tests/unit/test_detokenize.py"]

#: file -> (module, functions to mutate (None: all; a class name takes its methods), tests that cover it, fast first)
TARGETS: dict[str, tuple[str, set[str] | None, list[str]]] = {
    "speculative/sampling.py": ("speculative.sampling", None,
                                ["tests/unit/test_sampling.py", "tests/unit/test_processors.py", "tests/unit/test_engine.py",
                                 "tests/unit/test_lossless.py"]),
    # penalties, biases and min_tokens on each verified row (the processed target's law)
    "speculative/processors.py": ("speculative.processors", None,
                                  ["tests/unit/test_processors.py", "tests/unit/test_lossless.py"]),
    "speculative/grammar.py": ("speculative.grammar", None, ["tests/unit/test_grammar.py", "tests/unit/test_lossless.py"]),
    "speculative/engine.py": ("speculative.engine", None,
                              ["tests/unit/test_engine.py", "tests/unit/test_input.py", "tests/unit/test_kpolicy.py",
                               "tests/unit/test_background.py", "tests/unit/test_processors.py", "tests/unit/test_grammar.py",
                               "tests/unit/test_logprobs.py", "tests/unit/test_prefix_cache.py", "tests/unit/test_feature.py",
                               "tests/unit/test_lossless.py"]),
    "speculative/proposers.py": ("speculative.proposers", None,
                                 ["tests/unit/test_engine.py", "tests/unit/test_drafts.py", "tests/unit/test_lossless.py"]),
    "speculative/kpolicy.py": ("speculative.kpolicy", None,
                               ["tests/unit/test_kpolicy.py", "tests/unit/test_engine.py", "tests/unit/test_lossless.py"]),
    "learner/trainer.py": ("learner.trainer", None,
                           ["tests/unit/test_trainer.py", "tests/unit/test_experiments.py", "tests/unit/test_background.py",
                            "tests/unit/test_mixture.py", "tests/unit/test_feature.py"]),
    # the caches and batched forwards under every verification, suffix trees, streamed text
    "speculative/runner.py": ("speculative.runner", None,
                              ["tests/unit/test_batching.py", "tests/unit/test_fast.py", "tests/unit/test_engine.py",
                               "tests/unit/test_feature.py"]),
    "speculative/fast.py": ("speculative.fast", None, ["tests/unit/test_fast.py", "tests/unit/test_qmatmul.py",
                                                       "tests/unit/test_feature.py", "tests/unit/test_adapters.py"]),
    # the GPU's lean forward (padded buckets, graphs), checked on the CPU; which runtime serves a model
    # the layers in one native call and the rotary write (their Python side: tables, checks, arguments)
    "speculative/fused.py": ("speculative.fused", None, ["tests/unit/test_fast.py"]),
    "speculative/lean.py": ("speculative.lean", None, ["tests/unit/test_lean.py"]),
    "speculative/runtime.py": ("speculative.runtime", None, ["tests/unit/test_fast.py", "tests/unit/test_lean.py"]),
    "speculative/suffix.py": ("speculative.suffix", None, ["tests/unit/test_suffix.py"]),
    # what a verification keeps of its logits (the native pass's Python side: when it applies, its checks)
    "speculative/summary.py": ("speculative.summary", None, ["tests/unit/test_summary.py", "tests/unit/test_logprobs.py"]),
    # the engine loop's decisions: the shared step's draft cap and the measured drafting switch
    "speculative/scheduler.py": ("speculative.scheduler", {"DraftSwitch", "shared_k_cap", "EngineLoop._k_cap",
                                                         "EngineLoop._waits", "common_prefix", "EngineLoop.reserve",
                                                         "EngineLoop.unreserve"},
                                 ["tests/unit/test_scheduler.py"]),
    # the prefix cache's look-up, shared by a sequence's attach and the loop's wait for a twin
    "speculative/kvcache.py": ("speculative.kvcache", {"BlockPool.lookup", "SeqCache.attach", "PooledCaches.cached_prefix"},
                               ["tests/unit/test_prefix_cache.py", "tests/unit/test_scheduler.py"]),
    # the instrument that sets a draft's acceptance by hand, the bench's prefill / decode split, and
    # the console's calls into Serve that may not answer
    "bench/oracle.py": ("bench.oracle", None, ["tests/unit/test_bench.py"]),
    "bench/bench.py": ("bench.bench", {"Tally", "_acceptance_engines"}, ["tests/unit/test_bench.py"]),
    "deployments/launch.py": ("deployments.launch", {"bounded", "watch", "load_line", "health_lines"},
                              ["tests/unit/test_launch.py"]),
    # the feature-conditioned draft (its fusion, its cache of features, its proposer) and the losses
    # every draft is distilled with
    "speculative/feature.py": ("speculative.feature", None, ["tests/unit/test_feature.py"]),
    "speculative/feature_draft.py": ("speculative.feature_draft", None, ["tests/unit/test_feature.py"]),
    "learner/losses.py": ("learner.losses", None,
                          ["tests/unit/test_losses.py", "tests/unit/test_offline.py", "tests/unit/test_trainer.py",
                           "tests/unit/test_feature.py"]),
    "speculative/detokenize.py": ("speculative.detokenize", None, ["tests/unit/test_detokenize.py"]),
    "learner/record.py": ("learner.record", None, _REPLAY_TESTS),
    "learner/builder.py": ("learner.builder", None, _REPLAY_TESTS),
    "learner/shards.py": ("learner.shards", None, _REPLAY_TESTS),
    # the router: named domains (classifier, background, typicality), discovered ones (online
    # clusters), and the acceptance bandit that picks a draft among a domain's candidates
    "router/domains.py": ("router.domains", None, _ROUTER_TESTS),
    "router/bandit.py": ("router.bandit", None, _ROUTER_TESTS),
    "router/router.py": ("router.router", None, _ROUTER_TESTS),
    # distillation: the teacher's rows, the student's space and logits, the agreement the gate reads
    "learner/offline.py": ("learner.offline", None,
                           ["tests/unit/test_offline.py", "tests/unit/test_losses.py", "tests/unit/test_trainer.py",
                            "tests/unit/test_feature.py"]),
    # what the dashboards' acceptance rates are computed from, and the learner's background thread
    "speculative/stats.py": ("speculative.stats", None, ["tests/unit/test_stats.py"]),
    "learner/background.py": ("learner.background", None, ["tests/unit/test_background.py"]),
    # the edge: API keys, per-tenant limits, and the request shapes every client sends
    "deployments/tenants.py": ("deployments.tenants", None, ["tests/unit/test_tenants.py"]),
    "deployments/protocol.py": ("deployments.protocol", None, ["tests/unit/test_protocol.py", "tests/unit/test_llama_api.py"]),
    # llama-server's own completion API: its answers' shapes, stop types and timings
    "deployments/llama_api.py": ("deployments.llama_api", None, ["tests/unit/test_llama_api.py"]),
    "deployments/anthropic_api.py": ("deployments.anthropic_api", None, ["tests/unit/test_anthropic_api.py"]),
    "deployments/responses_api.py": ("deployments.responses_api", None, ["tests/unit/test_responses_api.py"]),
    "deployments/openai_api.py": ("deployments.openai_api", None, ["tests/unit/test_openai_api.py", "tests/unit/test_ingress.py"]),
    "deployments/resume.py": ("deployments.resume", None, ["tests/unit/test_resume.py"]),
    "telemetry/hub.py": ("telemetry.hub", None, ["tests/unit/test_telemetry.py"]),
    "telemetry/meter.py": ("telemetry.meter", None, ["tests/unit/test_telemetry.py"]),
    "telemetry/catalog.py": ("telemetry.catalog", None, ["tests/unit/test_telemetry.py"]),
    "telemetry/top.py": ("telemetry.top", None, ["tests/unit/test_telemetry.py"]),
    # drafts built from the target: truncated copies, restricted heads, saved and loaded, checkpoints by name
    "drafts/build.py": ("drafts.build", None, ["tests/unit/test_drafts.py", "tests/unit/test_suffix.py", "tests/unit/test_offline.py",
                                              "tests/unit/test_feature.py", "tests/unit/test_engine.py"]),
    # the typed configs: validators, the cache folder, content keys of files
    "config/__init__.py": ("config", None, ["tests/unit/test_config.py"]),
    # the router's features: cleaned text, the ONNX embedder (export, atomic publication), language, caches
    "router/features.py": ("router.features", None, ["tests/unit/test_router_onnx.py", "tests/unit/test_router.py"]),
    # the HTTP edge: checks, OpenAI shapes, streams, accounting, failures (the Serve routes that only
    # forward to these are tested live, tests/serve/)
    "deployments/ingress.py": ("deployments.ingress", {"_error", "_refused", "Timing", "Settle", "_json_body", "_target_gone",
                                                       "_unavailable_body", "_unavailable", "_validation_message",
                                                       "Ingress", "_body_schema", "_nth_seed", "_all", "_merged", "_dropped",
                                                       "_overloaded", "_Pieces"}, ["tests/unit/test_ingress.py"]),
    # a draft replica (the loop of a request, its metrics and records, weights by version, outputs
    # shared between replicas, the wait for a restarted target), the learner's and the router's and
    # the metrics replica's servers: the undecorated classes, in one process
    "deployments/drafts.py": ("deployments.drafts", {"TargetView", "RemoteVerifier", "DraftPool"},
                              ["tests/unit/test_draft_pool.py", "tests/unit/test_ingress.py", "tests/unit/test_learner_server.py"]),
    "deployments/learner.py": ("deployments.learner", {"LearnerServer"},
                               ["tests/unit/test_learner_server.py", "tests/unit/test_ingress.py"]),
    # which drafts the learner holds, a draft's checkpoints, what an engine replica keeps besides engines
    "learner/lifecycle.py": ("learner.lifecycle", None, ["tests/unit/test_lifecycle.py", "tests/unit/test_learner_server.py"]),
    "learner/checkpoints.py": ("learner.checkpoints", None, ["tests/unit/test_trainer.py", "tests/unit/test_adapters.py",
                                                             "tests/unit/test_learner_server.py"]),
    "drafts/outputs.py": ("drafts.outputs", None, ["tests/unit/test_outputs.py", "tests/unit/test_draft_pool.py",
                                                   "tests/unit/test_ingress.py"]),
    "deployments/router.py": ("deployments.router", {"RouterServer"}, ["tests/unit/test_servers.py", "tests/unit/test_ingress.py"]),
    "deployments/metrics.py": ("deployments.metrics", {"MetricsServer"}, ["tests/unit/test_servers.py"]),
    # loading models and tokenizers, prompts and chats as ids, EOS ids, devices, vocabularies (the
    # GGUF dequantisation is left out: it needs a GGUF file and 30 s a run)
    "speculative/locate.py": ("speculative.locate", {"embedded_gguf_path", "gguf_cache_folder", "locate", "light_vocab",
                                                     "token_bytes", "_byte_decoder"},
                              ["tests/unit/test_models.py", "tests/unit/test_cache_keys.py", "tests/unit/test_detokenize.py",
                               "tests/unit/test_llama_api.py"]),
    "speculative/models.py": ("speculative.models", {"resolve_model_folder",
                                                     "load_tokenizer", "_cannot_load", "load_weights", "load_model",
                                                     "check_device", "load_config", "encode_prompt", "encode_messages",
                                                     "eos_token_ids", "check_same_vocab"},
                              ["tests/unit/test_models.py", "tests/unit/test_config.py", "tests/unit/test_input.py",
                               "tests/unit/test_cache_keys.py"]),
    # how `osd route` scores the router on traffic it never trained on (leave-one-source-out,
    # leave-one-domain-out, unnamed kinds) and language id: the figures routing is judged by
    "router/cli.py": ("router.cli", {"_outcome", "open_set_report", "_lang_scores", "_percentiles"},
                      ["tests/unit/test_router_open.py"]),
    "deployments/loopback.py": ("deployments.loopback", None, ["tests/unit/test_loopback.py"]),
    # `osd draft`: checkpointed versions listed, an earlier one published again
    "learner/ops.py": ("learner.ops", None, ["tests/unit/test_trainer.py"]),
    # the workload files and the parsers of the public sources they are built from
    "workloads/__init__.py": ("workloads", None, ["tests/unit/test_workloads.py", "tests/unit/test_open_set_sources.py"]),
    # the parsers of the public sources `osd route` judges the router on (new formats of the named
    # domains, kinds no label names) and the files built from them (not ``_modules_from_wheel``: its
    # mutants empty ``sys.modules`` and take the mutation run down with them)
    "workloads/open_set.py": ("workloads.open_set", {"parse_humaneval", "parse_codeio", "parse_dbgpt_examples",
                                                     "parse_gsm_symbolic", "parse_mathgenerator", "parse_chitchat",
                                                     "parse_alice", "_ask", "parse_jokes", "parse_quotes",
                                                     "parse_fiction", "parse_word_games", "build_open_workload",
                                                     "build_router_train", "main"},
                              ["tests/unit/test_open_set_sources.py", "tests/unit/test_workloads.py"]),
    # the mixture experiment: its drafts (each named domain's own, started from its own draft or
    # forked), its stream, and what routing is judged by: every draft's counterfactual acceptance on
    # each request, the per-request and per-mode oracles and the routed/oracle ratios
    "bench/mixture.py": ("bench.mixture", {"_Drafts", "parse_starts", "label_of", "same_mode", "mixed_stream",
                                           "counterfactual_counts", "_TargetPath", "_DraftPath", "_plain_greedy",
                                           "counterfactual_skip_reason", "alpha_by_draft", "_oracle_pick", "_ratio",
                                           "oracle_summary", "mode_oracle", "_oracle_fields", "recompute_oracle"},
                         ["tests/unit/test_mixture.py"]),
    # the online and shift experiments' figures: token acceptance, windows, speedups, paired gains,
    # the shift order
    "bench/experiments.py": ("bench.experiments", {"_norm", "token_acceptance", "_summary", "_speedups", "paired_gain",
                                                   "_offline_count", "order_blocks", "_check_common",
                                                   "_RoundBudget", "_replicas_of", "_costs", "_step_line", "_net_seconds",
                                                   "_other_seconds", "_sum_steps", "stream_requests", "interleave",
                                                   "_drain", "_tokens_per_step", "_finish_method"},
                             ["tests/unit/test_experiments.py", "tests/unit/test_mixture.py"]),
    # one request served and recorded as the experiments count it (alpha, steps by source)
    "bench/harness.py": ("bench.harness", {"serve_recorded", "unseen_by"}, ["tests/unit/test_experiments.py", "tests/unit/test_mixture.py"]),
    "deployments/target.py": ("deployments.target", {"BatchedTarget"},
                              ["tests/unit/test_target_server.py", "tests/unit/test_draft_pool.py"]),
}

#: Survivors that cannot change behaviour, each with why (``tools/equivalent_mutants.json``): by
#: (file, function, mutated line), every mutant of the line, or by (file, function, mutated line,
#: mutated form) where other mutants of the line do change it.
EQUIVALENT_FILE = ROOT / "tools" / "equivalent_mutants.json"


def load_equivalent(path: Path = EQUIVALENT_FILE) -> dict[tuple[str, ...], str]:
    """The equivalent mutants of ``path`` as (file, function, line[, mutation]) -> why."""
    rows = json.loads(path.read_text())
    return {(r["file"], r["function"], r["line"], *([r["mutation"]] if "mutation" in r else [])): r["why"] for r in rows}


@functools.cache
def _equivalents() -> dict[tuple[str, ...], str]:
    return load_equivalent()

SWAP_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
            ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}
SWAP_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
            ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}


@dataclass
class Mutant:
    file: str
    function: str  # qualified name of the outermost function holding the change
    line: int
    kind: str
    before: str
    after: str
    status: str = "pending"  # killed | survived | equivalent | timeout
    seconds: float = 0.0
    killer: str = ""


def _sites(tree: ast.Module):
    """Yield (qualname of the outermost function, node, kind, mutate(node) -> new node | None)."""

    def walk(node, qual, outer):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{qual}.{child.name}" if qual else child.name
                body = child.body[1:] if ast.get_docstring(child) else child.body
                for stmt in body:
                    yield from walk_stmt(stmt, outer or name)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{qual}.{child.name}" if qual else child.name, outer)

    def walk_stmt(stmt, func):
        for node in ast.walk(stmt):
            yield from _node_mutations(func, node)

    yield from walk(tree, "", None)


def _not_code(tree: ast.Module) -> set[int]:
    """Ids of nodes whose mutation is noise: messages (f-strings, raise, assert, log calls) and
    annotations."""
    skip = set()
    for node in ast.walk(tree):
        parts = []
        if isinstance(node, (ast.JoinedStr, ast.Raise, ast.Assert)):
            parts = [node]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in {"info", "debug", "warning", "error", "log"}:
            parts = [node]
        elif isinstance(node, ast.AnnAssign):
            parts = [node.annotation]
        elif isinstance(node, ast.arg) and node.annotation is not None:
            parts = [node.annotation]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            parts = [node.returns]
        for part in parts:
            skip.update(id(n) for n in ast.walk(part))
    return skip


INDEXABLE = (ast.Name, ast.BinOp, ast.UnaryOp, ast.Attribute, ast.Call)


def _node_mutations(func, node):
    if isinstance(node, ast.BinOp) and type(node.op) in SWAP_BIN:
        yield func, node, "binop", lambda n: setattr(n, "op", SWAP_BIN[type(n.op)]())
    elif isinstance(node, ast.AugAssign) and type(node.op) in SWAP_BIN:
        yield func, node, "augassign", lambda n: setattr(n, "op", SWAP_BIN[type(n.op)]())
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in SWAP_CMP:
                yield func, node, "compare", (lambda i: lambda n: n.ops.__setitem__(i, SWAP_CMP[type(n.ops[i])]()))(i)
    elif isinstance(node, ast.BoolOp):
        yield func, node, "boolop", lambda n: setattr(n, "op", ast.Or() if isinstance(n.op, ast.And) else ast.And())
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield func, node, "not", lambda n: setattr(n, "op", ast.UAdd())  # +x: truthiness kept, 'not' dropped
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        yield func, node, "bool", lambda n: setattr(n, "value", not n.value)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        yield func, node, "int+1", lambda n: setattr(n, "value", n.value + 1)
        if node.value != 0:
            yield func, node, "int-1", lambda n: setattr(n, "value", n.value - 1)
    elif isinstance(node, ast.Constant) and type(node.value) is float and node.value not in (0.0,):
        yield func, node, "float*2", lambda n: setattr(n, "value", n.value * 2)
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and (
            isinstance(node.slice, INDEXABLE) or isinstance(node.slice, ast.Constant) and type(node.slice.value) is int):
        yield func, node, "index+1", lambda n: setattr(n, "slice", ast.BinOp(n.slice, ast.Add(), ast.Constant(1)))
    elif isinstance(node, ast.Slice):
        if node.lower is not None:
            yield func, node, "slice.lower+1", lambda n: setattr(n, "lower", ast.BinOp(n.lower, ast.Add(), ast.Constant(1)))
        if node.upper is not None:
            yield func, node, "slice.upper-1", lambda n: setattr(n, "upper", ast.BinOp(n.upper, ast.Sub(), ast.Constant(1)))


def enumerate_mutants(file: str, only: set[str] | None, root: Path = ROOT) -> list[tuple[Mutant, ast.Module]]:
    src = (root / file).read_text()
    tree = ast.parse(src)
    skip = _not_code(tree)
    lines = src.splitlines()
    out = []
    sites = [s for s in _sites(tree) if id(s[1]) not in skip and (only is None or _named(s[0], sorted(only)))]
    for func, node, kind, mutate in sites:
        mutated_tree = copy.deepcopy(tree)
        target = next(n for n in ast.walk(mutated_tree) if _same(n, node))
        before_line = lines[node.lineno - 1].strip()
        mutate(target)
        ast.fix_missing_locations(mutated_tree)
        after = ast.unparse(target)
        if after == ast.unparse(node):
            continue
        out.append((Mutant(file, func, node.lineno, kind, before_line, f"{ast.unparse(node)} -> {after}"), mutated_tree))
    return out


def _same(a: ast.AST, b: ast.AST) -> bool:
    return (type(a) is type(b) and getattr(a, "lineno", None) == getattr(b, "lineno", None)
            and getattr(a, "col_offset", None) == getattr(b, "col_offset", None)
            and getattr(a, "end_col_offset", None) == getattr(b, "end_col_offset", None))


def _code_by_qualname(code, qualname: str):
    for const in code.co_consts:
        if hasattr(const, "co_qualname"):
            if const.co_qualname == qualname:
                return const
            found = _code_by_qualname(const, qualname)
            if found is not None:
                return found
    return None


def _live_function(module, qualname: str):
    obj = module
    for part in qualname.split("."):
        obj = obj.__dict__[part] if isinstance(obj, type) else getattr(obj, part)
        if isinstance(obj, property):
            obj = obj.fget
        elif isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
    return inspect.unwrap(obj)  # through decorators (torch.inference_mode) to the function defined here


def _clear_caches(module) -> None:
    """Forget what the module's cached functions (``functools.cache``) returned: a result cached
    by an earlier test run would hide a mutant from every test, and one computed by a mutant would
    leak into the next. Called before a mutant is swapped in and after it is swapped out."""
    for obj in list(vars(module).values()):
        if callable(obj) and hasattr(obj, "cache_clear"):
            obj.cache_clear()


class _Timeout(Exception):
    pass


def run_tests(tests: list[str], timeout: float) -> tuple[bool, str]:
    """(all passed, the first failing test id)."""
    import pytest

    class Reporter:
        failed = ""

        def pytest_runtest_logreport(self, report):
            if report.failed and not self.failed:
                self.failed = report.nodeid

    rep = Reporter()

    def alarm(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            code = pytest.main([*tests, "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-W", "ignore"], plugins=[rep])
    except _Timeout:
        return False, "timeout"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return code == 0, rep.failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="files of TARGETS to mutate (default: all)")
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose code and tests are used (e.g. an older commit's)")
    ap.add_argument("--json", default=None, help="write every mutant and its outcome here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a mutant's test run counts as a hang")
    ap.add_argument("--limit", type=int, default=None, help="at most this many mutants per file (a quick look)")
    ap.add_argument("--functions", nargs="*", default=None,
                    help="mutate only these functions (qualified names; a class name takes its methods)")
    ap.add_argument("--exclude-tests", nargs="*", default=[], help="test files left out (to score an older suite)")
    ap.add_argument("--survivors-of", default=None,
                    help="a JSON of an earlier run: test again only its survivors (tests added since), keep the rest")
    ap.add_argument("--merge", nargs="*", default=None,
                    help="JSON files of runs over different files: report them as one run (no tests run)")
    args = ap.parse_args(argv)
    if args.merge:
        merged = [Mutant(**m) for f in args.merge for m in json.loads(Path(f).read_text())["mutants"]]
        report(merged, 0.0, args.json)
        return 0
    root = Path(args.root).resolve()
    sys.path[:0] = [str(root), str(root / "tests")]
    import os

    os.chdir(root)
    import torch

    torch.set_num_threads(1)
    def kept(tests: list[str]) -> list[str]:
        return [t for t in tests if t not in args.exclude_tests]

    chosen = {f: v for f, v in TARGETS.items() if not args.only or f in args.only}
    ok, failed = run_tests(kept(sorted({t for _, _, ts in chosen.values() for t in ts})), 1800)
    if not ok:
        print(f"the unmutated suite fails ({failed}): fix it first", file=sys.stderr)
        return 2
    earlier: dict[tuple, dict] = {}
    if args.survivors_of:
        for m in json.loads(Path(args.survivors_of).read_text())["mutants"]:
            _occurrence(m, earlier)
    results: list[Mutant] = []
    t_all = time.perf_counter()
    for file, (modname, only, tests) in TARGETS.items():
        if args.only and file not in args.only:
            continue
        module = importlib.import_module(modname)
        mutants = [(m, t) for m, t in enumerate_mutants(file, only, root)
                   if not args.functions or _named(m.function, args.functions)][: args.limit]
        print(f"{file}: {len(mutants)} mutants", flush=True)
        seen: dict[tuple, dict] = {}
        for m, tree in mutants:
            before = earlier.get(_occurrence(asdict(m), seen))
            if before is not None and before["status"] in ("killed", "timeout"):
                results.append(Mutant(**{**before, "line": m.line}))  # killed then; tests were only added since
                continue
            code = _code_by_qualname(compile(tree, str(root / file), "exec"), m.function)
            live = _live_function(module, m.function)
            original = live.__code__
            t0 = time.perf_counter()
            _clear_caches(module)
            try:
                live.__code__ = code
            except ValueError as e:  # a closure whose free variables differ: cannot be swapped in
                print(f"  skipped    {m.file}:{m.line} {m.function}: {e}", flush=True)
                continue
            try:
                passed, killer = run_tests(kept(tests), args.timeout)
            finally:
                live.__code__ = original
                _clear_caches(module)
            m.seconds = time.perf_counter() - t0
            m.killer = killer
            m.status = ("equivalent" if _equivalent(m) else "survived") if passed else (
                "timeout" if killer == "timeout" else "killed")
            results.append(m)
            if m.status != "killed":
                print(f"  {m.status:10s} {m.file}:{m.line} {m.function} [{m.kind}] {m.after}   | {m.before}", flush=True)
            if args.json:  # after every mutant, so that an interrupted run keeps what it measured
                Path(args.json).write_text(json.dumps({"partial": True, "mutants": [asdict(m) for m in results]},
                                                      indent=1))
    report(results, time.perf_counter() - t_all, args.json)
    return 0


def _equivalent(m: "Mutant") -> bool:
    """In ``tools/equivalent_mutants.json``: by its line (every mutant of it), or by its line and mutated form (that one)."""
    known = _equivalents()
    return (m.file, m.function, m.before) in known or (m.file, m.function, m.before, m.after) in known


def _occurrence(m: dict, taken: dict) -> tuple:
    """A mutant's key across runs: the mutated line's text, not its number (an edit above it moves
    it), its kind and form, and which of the mutants alike in all of these it is (a line can hold
    the same form several times: ``v[0]`` read twice), in the order they are enumerated. Reserves
    the key in ``taken``."""
    base = (m["file"], m["function"], m["before"], m["kind"], m["after"])
    n = 0
    while (*base, n) in taken:
        n += 1
    taken[(*base, n)] = m
    return (*base, n)


def _named(function: str, names: list[str]) -> bool:
    """``function`` (a qualified name) is one of ``names``, or a method of a class among them."""
    return any(function == n or function.startswith(n + ".") for n in names)


def report(results: list[Mutant], seconds: float, json_out: str | None) -> None:
    """Print the score (killed / (mutants - equivalent)) and per-file counts; write the JSON."""
    for m in results:  # equivalence is decided by the current table, also for merged runs
        if m.status in ("survived", "equivalent"):
            m.status = "equivalent" if _equivalent(m) else "survived"
    killed = sum(m.status in ("killed", "timeout") for m in results)
    equivalent = sum(m.status == "equivalent" for m in results)
    survived = [m for m in results if m.status == "survived"]
    score = killed / max(1, len(results) - equivalent)
    print(f"\n{len(results)} mutants: {killed} killed, {equivalent} equivalent (reasons in tools/equivalent_mutants.json), "
          f"{len(survived)} survived; score {killed}/{len(results) - equivalent} = {score:.1%} "
          f"({seconds:.0f} s)")
    per_file = {}
    for m in results:
        f = per_file.setdefault(m.file, {"mutants": 0, "killed": 0, "equivalent": 0, "survived": 0})
        f["mutants"] += 1
        f["killed" if m.status in ("killed", "timeout") else m.status] += 1
    for f, c in per_file.items():
        print(f"  {f}: {c}")
    for m in results:
        if m.status == "survived":
            print(f"  survived   {m.file}:{m.line} {m.function} [{m.kind}] {m.after}")
    if json_out:
        Path(json_out).write_text(json.dumps({"score": score, "per_file": per_file,
                                              "mutants": [asdict(m) for m in results]}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
