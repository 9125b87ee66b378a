"""Ray-free core: model loading, per-request caches, propose -> verify -> accept, k policy, stats."""

from .engine import Generation, PendingStep, RequestError, SpeculativeEngine, StepResult
from .kpolicy import CostModel, KPolicy, expected_speedup, expected_tokens
from .models import ModelLoadError, VocabMismatchError
from .proposers import ChainedProposer, DraftModelProposer, NgramProposer, Proposal
from .runner import ForwardCall, ModelRunner, TargetRows, VerifyCall
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
    "PendingStep",
    "Proposal",
    "RequestError",
    "SpecStats",
    "SpeculativeEngine",
    "StepResult",
    "TargetRows",
    "VerifyCall",
    "VocabMismatchError",
    "expected_speedup",
    "expected_tokens",
]
