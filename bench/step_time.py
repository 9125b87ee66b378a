"""Seconds an offline distillation step takes, with and without bfloat16 autocast
(``python -m bench.step_time --teacher-cache FILE``).

It runs :func:`learner.offline.distill` itself, the loop ``osd train-draft`` runs, for ``--steps``
steps in each mode in turn, ``--rounds`` times, on the served draft (the truncated target with the
given adapters trained, as ``osd distill --adapter-rank 16`` trains them) and the first samples of
a teacher file, the prompts' positions included. Every run has the same seed, so the same batches.
The rate is tiny so that the runs start alike. Prints each run's seconds a step and its losses."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics


def step_times(teacher_file: str, adapter: str, n_samples: int, n_steps: int, modes: list[str], rounds: int) -> dict:
    from config import DraftConfig, ModelConfig
    from drafts.build import build_draft_model
    from learner.offline import DistillConfig, distill, load_samples, shared_prefix_len, with_prompt_positions
    from speculative.models import load_model

    target, tok = load_model(ModelConfig())
    samples = load_samples(teacher_file)[:n_samples]
    start = max(2, shared_prefix_len([s.tokens[: s.prompt_len] for s in samples]))
    samples = [dataclasses.replace(s, features=None) for s in with_prompt_positions(samples, target.get_output_embeddings(), start)]
    draft, _ = build_draft_model(DraftConfig(num_layers=2, adapter=None if adapter == "none" else adapter), target, tok)
    out: dict = {m: {"seconds_a_step": [], "loss": []} for m in modes}
    for _ in range(rounds):
        for mode in modes:
            cfg = DistillConfig(adapter_rank=16, lr=1e-9, warmup_steps=0, max_steps=n_steps, epochs=1, seconds=3600,
                                autocast=mode)
            hist = distill(draft, samples, cfg, log=None, heldout=samples[:1])  # the agreement checks: one sample
            out[mode]["seconds_a_step"].append(hist["seconds"] / hist["steps"])
            out[mode]["loss"].append(hist["loss_curve"])
    for m in modes:
        out[m]["median_s"] = statistics.median(out[m]["seconds_a_step"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_time", description=__doc__)
    ap.add_argument("--teacher-cache", required=True, help="a file osd train-draft --teacher-cache wrote")
    ap.add_argument("--adapter", default="shipped", help="a folder, 'shipped', or 'none'")
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    print(json.dumps(step_times(a.teacher_cache, a.adapter, a.samples, a.steps, ["off", "bf16"], a.rounds), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
