"""The Ray-free engine's settings."""

from __future__ import annotations


from pydantic import Field

from .base import _Strict
from .draft import DraftConfig, KPolicyConfig
from .model import ModelConfig


class EngineConfig(_Strict):
    """The Ray-free speculative engine: target + proposer + k policy."""

    model: ModelConfig = ModelConfig()
    draft: DraftConfig = DraftConfig()
    k: KPolicyConfig = KPolicyConfig()
    #: K of the target distribution recorded at each verified position (top-K probs + tail mass).
    record_top_k: int = Field(default=16, ge=1)
    #: Apply the tokenizer's chat template to text prompts.
    chat_template: bool = True
