"""Build an engine from an :class:`config.EngineConfig` (the one place that wires components)."""

from __future__ import annotations

from typing import Iterable

import torch

from config import EngineConfig

from .engine import SpeculativeEngine
from .models import load_model
from .runtime import make_runner


def build_engine(cfg: EngineConfig = EngineConfig(), texts: Iterable[str] = (), calibrate: bool = True) -> SpeculativeEngine:
    """Load the target, build the proposer the config names, return the engine.

    ``texts`` (e.g. workload prompts) choose the tokens a restricted draft head keeps.
    """
    from drafts.build import build_proposer  # drafts builds on this package

    if cfg.model.num_threads:
        torch.set_num_threads(cfg.model.num_threads)
    target, tok = load_model(cfg.model)
    proposer = build_proposer(cfg.draft, target, tok, texts, quantize=cfg.model.quantize)
    engine = SpeculativeEngine(make_runner(target, cfg.model.quantize, name="target"), tok, proposer, cfg)
    if calibrate:
        engine.calibrate()
    return engine
