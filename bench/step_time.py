"""Seconds an offline distillation step takes, with and without bfloat16 autocast
(``python -m bench.step_time --teacher-cache FILE``).

It steps the served draft (the truncated target with the given adapters trained, as ``osd
distill --adapter-rank 16`` trains them) over the same batches of a teacher file's samples, the
prompts' positions included, once per mode in turn and ``--rounds`` times, and prints each step's
seconds and loss. The rate is tiny so that the rounds start alike."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time


def step_times(teacher_file: str, adapter: str, n_samples: int, n_steps: int, modes: list[str], rounds: int) -> dict:
    import torch

    from config import DraftConfig, ModelConfig
    from drafts.build import build_draft_model
    from learner.losses import get_loss
    from learner.offline import (DistillConfig, _batch_target, _batches, draft_loss, load_samples, set_trainable,
                                 shared_prefix_len, with_prompt_positions)
    from speculative.models import load_model

    target, tok = load_model(ModelConfig())
    samples = load_samples(teacher_file)[:n_samples]
    start = max(2, shared_prefix_len([s.tokens[: s.prompt_len] for s in samples]))
    samples = [dataclasses.replace(s, features=None) for s in with_prompt_positions(samples, target.get_output_embeddings(), start)]
    draft, _ = build_draft_model(DraftConfig(num_layers=2, adapter=None if adapter == "none" else adapter), target, tok)
    params = set_trainable(draft, DistillConfig(adapter_rank=16))
    opt = torch.optim.AdamW(params, lr=1e-9)
    loss_fn = get_loss("forward_kl")
    batches = _batches(samples, 512)[:n_steps]
    draft.train()
    out: dict = {m: {"seconds": [], "loss": []} for m in modes}
    for _ in range(rounds):
        for mode in modes:
            for batch in batches:
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                    loss = draft_loss(draft, batch, loss_fn, _batch_target(batch), 0)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                out[mode]["seconds"].append(time.perf_counter() - t0)
                out[mode]["loss"].append(float(loss.detach()))
    for m in modes:
        out[m]["median_s"] = statistics.median(out[m]["seconds"])
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
