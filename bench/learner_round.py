"""Seconds and peak memory of one learner round on served records (``python -m bench.learner_round``).

Serves ``--n`` prompts of a workload with the served config's engine, keeps each request's replay
record (what the draft pool sends the learner), then, in a fresh process per setting, runs one
round of the served config's trainer on those records with each ``--micro`` setting (records per
forward/backward piece; 0: the whole batch at once) and each ``--context`` setting (the prompt
tokens a record trains on; 0: the whole prompt; default: the served config's window, as the learner
deployment takes it) and reports the round's seconds and how far the
process's resident memory rose above what it held before the round (its high-water mark, from
``/proc/self/status``). One torch thread, as the learner replica trains.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path


def _vm(key: str) -> float:
    """A ``/proc/self/status`` figure in MiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_peak() -> None:
    """Restart the high-water mark at the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def make_records(workload: str, n: int, max_tokens: int, config: str | None, sources: list[str] | None = None) -> list:
    from bench.bench import select
    from bench.harness import serve_recorded
    from config import SamplingParams
    from deployments.launch import DEFAULT_CONFIG, read_config
    from drafts.build import build_engine
    from workloads import load_workloads

    _, cfg, _ = read_config(config or DEFAULT_CONFIG)
    engine = build_engine(cfg.engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [serve_recorded(engine, r.text, params, domain=r.domain, draft_id="general")[0]
            for r in select(load_workloads(workload.split(","), sources), n)]


def one_round(records_path: str, micro: int, config: str | None, context: int | None = None) -> dict:
    import time

    from bench.learner_memory import served_draft
    from learner.trainer import DraftTrainer

    cfg, runner = served_draft(config)
    records = pickle.loads(Path(records_path).read_bytes())
    from deployments.learner import LearnerServer

    window = LearnerServer.window(cfg) if context is None else (context or None)
    tcfg = cfg.learner.trainer.model_copy(update={"micro_batch_records": micro or None, "checkpoint_dir": None,
                                                  "context_tokens": window})
    trainer = DraftTrainer("general", runner.model, tcfg, keep_ids=runner.vocab_map)
    batch = records[: tcfg.batch_records]
    for r in records[tcfg.batch_records :]:  # the gate's held-back records, as the learner keeps some
        trainer.add_holdout(r)
    before = _vm("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    rep = trainer.train_round(batch)
    secs = time.perf_counter() - t0
    return {"micro_batch_records": micro or None, "context_tokens": window, "records": len(batch), "positions": rep.positions,
            "steps": rep.steps, "round_s": round(secs, 2), "train_s": round(rep.train_seconds, 2),
            "rss_before_mib": round(before), "peak_rise_mib": round(_vm("VmHWM") - before),
            "loss_before": rep.loss_before, "loss_after": rep.loss_after}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="bench/data/open.jsonl", help="a workload file, or several comma-separated")
    ap.add_argument("--sources", nargs="*", default=None, help="keep only records of these sources")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--micro", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--context", type=int, nargs="+", default=None,
                    help="prompt tokens a record trains on (0: the whole prompt); default: the served config's window")
    ap.add_argument("--config", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--_round", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._round:  # the child: one round, one setting
        print(json.dumps(one_round(a._round, a.micro[0], a.config, a.context[0] if a.context else None)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "records.pkl"
        path.write_bytes(pickle.dumps(make_records(a.workload, a.n, a.max_tokens, a.config, a.sources)))
        rows = []
        for m, c in [(m, c) for m in a.micro for c in (a.context or [None])]:
            cmd = [sys.executable, "-m", "bench.learner_round", "--_round", str(path), "--micro", str(m)]
            cmd += ["--config", a.config] if a.config else []
            cmd += ["--context", str(c)] if c is not None else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"workload": a.workload, "sources": a.sources, "n": a.n, "max_tokens": a.max_tokens, "rounds": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
