"""Held-out top-1 agreement of saved drafts on one teacher file (``python -m bench.heldout_agreement``).

``osd train-draft --teacher-cache FILE`` writes its training samples first and its held-out ones
last; this scores any number of adapters (a folder, ``shipped``, or ``none`` for the bare draft) on
the last ``--heldout`` samples of such a file, so that drafts trained in separate runs are compared
on the very same positions (each run's own report measures only its own draft)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def heldout_agreement(teacher_file: str | Path, n_heldout: int, adapters: list[str], num_layers: int = 2) -> dict:
    """{adapter: top-1 agreement with the target on the file's last ``n_heldout`` samples}, plus
    ``positions``, the output positions they hold."""
    from config import DraftConfig, ModelConfig
    from drafts.build import build_draft_model
    from learner.offline import load_samples, top1_agreement_on
    from speculative.models import load_model

    if n_heldout < 1:
        raise ValueError("--heldout must be at least 1")
    target, tok = load_model(ModelConfig())
    held = load_samples(teacher_file)[-n_heldout:]
    out: dict = {"positions": sum(s.n_out for s in held)}
    for name in adapters:
        cfg = DraftConfig(num_layers=num_layers, adapter=None if name == "none" else name)
        draft, _ = build_draft_model(cfg, target, tok)
        out[name] = top1_agreement_on(draft, held)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.heldout_agreement", description=__doc__)
    ap.add_argument("--teacher-cache", required=True, help="a file osd train-draft --teacher-cache wrote")
    ap.add_argument("--heldout", type=int, required=True, help="how many samples at its end were held out")
    ap.add_argument("--adapters", nargs="+", required=True, help="folders, 'shipped', or 'none' (the bare draft)")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    print(json.dumps(heldout_agreement(a.teacher_cache, a.heldout, a.adapters, a.num_layers), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
