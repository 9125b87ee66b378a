"""``python -m bench.layer_subsets``: would a draft made of some of the target's own layers, with no
training, agree with the target (self-speculative decoding: skip the middle layers)? Teacher-forced
top-1 agreement with the target's greedy output, for drafts of the first layers, of the first and
last ones, and of every other layer, each with the target's final norm and head.

Prompts of ``bench/data/open.jsonl`` (shuffled with a fixed seed; the first ``--n``), their last 384
prompt tokens in the chat template, ``--max-tokens`` greedy tokens each from the float target.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from config.model import ModelConfig
from speculative.models import encode_prompt, load_model
from workloads import load_workload

#: layer subsets of a 30-layer target (SmolLM2-135M); the last, every layer, is the target itself
SUBSETS = [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1, 29], [0, 1, 28, 29], [0, 1, 2, 3, 28, 29],
           [0, 1, 2, 3, 4, 5, 26, 27, 28, 29], list(range(0, 30, 2)) + [29], list(range(30))]


def agreement(model, layers: list[int], data: list[tuple[torch.Tensor, int]]) -> float:
    """Share of output positions where the draft of ``layers`` predicts the target's next token."""
    every = model.model.layers
    model.model.layers = torch.nn.ModuleList([every[i] for i in layers])  # the draft, for this call
    hits = total = 0
    try:
        with torch.no_grad():
            for seq, n_prompt in data:
                hidden = model.model(seq[None, :-1], use_cache=False).last_hidden_state
                pred = model.lm_head(hidden).argmax(-1)[0]  # [len - 1]
                hits += int((pred[n_prompt - 1:] == seq[n_prompt:]).sum())
                total += len(seq) - n_prompt
    finally:
        model.model.layers = every
    return hits / total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(ModelConfig(name="embedded:smollm2-135m-instruct", dtype="float32"))
    rows = load_workload("bench/data/open.jsonl")
    random.Random(0).shuffle(rows)
    data = []
    t0 = time.perf_counter()
    for row in rows[: args.n]:
        ids = encode_prompt(tok, row.text)[-384:]
        out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False)
        data.append((out[0], len(ids)))
    print(f"{len(data)} prompts of bench/data/open.jsonl, {args.max_tokens} greedy tokens each "
          f"({time.perf_counter() - t0:.0f} s); teacher-forced top-1 agreement with the target:")
    n_layers = len(model.model.layers)
    for layers in SUBSETS:
        if max(layers) < n_layers:
            print(f"  {len(layers):2d} layers {layers}: {agreement(model, layers, data):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
