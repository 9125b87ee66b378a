"""Ray-free core: model loading, per-request caches, propose -> verify -> accept, k policy, stats.

The names below load on first use, so that a light module of the core (:mod:`speculative.locate`)
can be imported without torch."""

from __future__ import annotations

import importlib

_WHERE = {
    "Generation": "engine", "PendingStep": "engine", "RequestError": "engine", "SpeculativeEngine": "engine",
    "StepResult": "engine",
    "CostModel": "kpolicy", "KPolicy": "kpolicy", "expected_speedup": "kpolicy", "expected_tokens": "kpolicy",
    "ModelLoadError": "locate", "VocabMismatchError": "models",
    "ChainedProposer": "proposers", "DraftModelProposer": "proposers", "LearnedDraft": "proposers", "NgramProposer": "proposers",
    "Proposal": "proposers",
    "ForwardCall": "runner", "ModelRunner": "runner", "TargetRows": "runner", "VerifyCall": "runner",
    "SpecStats": "stats",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'speculative' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
