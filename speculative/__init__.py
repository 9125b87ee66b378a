"""Ray-free core: model loading, per-request caches, propose -> verify -> accept, k policy, stats."""

from .engine import Generation, RequestError, SpeculativeEngine, StepResult
from .kpolicy import CostModel, KPolicy, expected_speedup, expected_tokens
from .models import ModelLoadError, VocabMismatchError
from .proposers import ChainedProposer, DraftModelProposer, NgramProposer, Proposal
from .runner import ForwardCall, ModelRunner
from .stats import SpecStats

__all__ = [
    "ChainedProposer",
    "CostModel",
    "DraftModelProposer",
    "ForwardCall",
    "Generation",
    "KPolicy",
    "ModelLoadError",
    "ModelRunner",
    "NgramProposer",
    "Proposal",
    "RequestError",
    "SpecStats",
    "SpeculativeEngine",
    "StepResult",
    "VocabMismatchError",
    "expected_speedup",
    "expected_tokens",
]
