"""Memory the learner holds per draft (``python -m bench.learner_memory``): the served config's
draft, one training copy and its AdamW state after a first step per draft, measured as the growth
of this process's resident memory. With ``--adapter-rank``, each draft is an adapter learner: its
adapters and their AdamW state on the one base they share. The learner keeps ``learner.max_drafts`` of them at most (the
replay shards, ``shard_max_bytes`` each, come on top)."""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def served_draft(config: str | None = None):
    """(the config, the runner of its learned draft as the learner replica builds it: cut from the
    target, which is let go), on one torch thread as the learner trains."""
    import torch

    from deployments.launch import DEFAULT_CONFIG, read_config
    from drafts.build import build_proposer
    from speculative.models import load_tokenizer, load_weights
    from speculative.proposers import learned_draft

    torch.set_num_threads(1)
    _, cfg, _ = read_config(config or DEFAULT_CONFIG)
    target = load_weights(cfg.engine.model)
    runner = learned_draft(build_proposer(cfg.engine.draft, target, load_tokenizer(cfg.engine.model.name))).runner
    del target
    gc.collect()
    return cfg, runner


def measure(config: str | None = None, drafts: int = 6, adapter_rank: int | None = None) -> dict:
    import torch

    from learner.trainer import DraftTrainer

    cfg, runner = served_draft(config)
    tcfg = cfg.learner.trainer
    if adapter_rank is not None:
        tcfg = tcfg.model_copy(update={"adapter_rank": adapter_rank})
    held, grown, base = [], [], _rss_mib()
    for i in range(drafts):
        t = DraftTrainer(f"d{i}", runner.model, tcfg, keep_ids=runner.vocab_map)
        for p in t.params:  # a first step allocates the optimiser's state, as a first round does
            p.grad = torch.zeros_like(p)
        t.opt.step()
        t.opt.zero_grad(set_to_none=True)
        held.append(t)
        grown.append(_rss_mib() - base)
    per = (grown[-1] - grown[0]) / (drafts - 1)
    return {"draft_kind": cfg.engine.draft.kind, "adapter_rank": tcfg.adapter_rank, "draft_layers": cfg.engine.draft.num_layers,
            "params": sum(p.numel() for p in runner.model.parameters()),
            "trainable": sum(p.numel() for p in held[0].params),
            "rss_growth_mib_after_each": [round(g, 1) for g in grown], "mib_per_draft": round(per, 1),
            "max_drafts": cfg.learner.max_drafts, "mib_at_max_drafts": round(per * cfg.learner.max_drafts)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=None, help="a Serve config file (default: serve_config.yaml)")
    ap.add_argument("--drafts", type=int, default=6)
    ap.add_argument("--adapter-rank", type=int, default=None,
                    help="trainers that learn adapters of this rank on one shared base (default: the config's)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = measure(a.config, a.drafts, a.adapter_rank)
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
