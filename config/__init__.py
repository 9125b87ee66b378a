"""Typed settings: one pydantic model per component, one module per component.

Every component takes exactly one of these. Validation happens here, at the edge, so that bad
input (a negative, infinite or NaN temperature, ``max_tokens <= 0``, an unknown device,
``fixed_k > k_max``) is refused with a clear message before any model work starts.

- :mod:`config.model`: the target model (:class:`ModelConfig`);
- :mod:`config.draft`: the proposers and the k policy (:class:`DraftConfig`, :class:`KPolicyConfig`);
- :mod:`config.sampling`: a request's decoding parameters (:class:`SamplingParams`);
- :mod:`config.engine`: the Ray-free engine (:class:`EngineConfig`);
- :mod:`config.router`: the query router (:class:`RouterConfig`);
- :mod:`config.learner`: the online learner and its deployment (:class:`LearnerConfig`,
  :class:`LearnerServeConfig`);
- :mod:`config.serving`: the deployments' transport (target, engine loop, draft pool, ingress, metrics);
- :mod:`config.auth`: keys, tenants and their limits;
- :mod:`config.app`: the whole application, as ``serve_config.yaml`` gives it (:class:`AppConfig`).
"""

from __future__ import annotations

from pydantic import ValidationError

from .app import AppConfig
from .auth import AuthConfig, TenantKey, TenantLimits
from .base import EMBEDDED_TARGET, cache_dir, content_key, file_sha256
from .draft import ControllerConfig, DraftConfig, KPolicyConfig, NgramConfig, SuffixConfig, layer_list
from .engine import EngineConfig
from .learner import LOSS_NAMES, BackgroundConfig, LearnerConfig, LearnerServeConfig, LiveWatchConfig, check_loss_name
from .model import QUANTIZE_CHOICES, ModelConfig
from .router import (ROUTER_LANGUAGES, BanditConfig, ClassifierConfig, ClusterConfig, DraftLifecycleConfig, EmbedderConfig,
                     LanguageConfig, RouterConfig)
from .sampling import GREEDY_BELOW, MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, MAX_TOP_LOGPROBS, Grammar, SamplingParams
from .serving import DraftPoolConfig, IngressConfig, LoopConfig, MetricsConfig, TargetServeConfig

__all__ = [
    "EMBEDDED_TARGET",
    "LOSS_NAMES",
    "BackgroundConfig",
    "LearnerConfig",
    "LiveWatchConfig",
    "check_loss_name",
    "QUANTIZE_CHOICES",
    "GREEDY_BELOW",
    "ModelConfig",
    "SuffixConfig",
    "ControllerConfig",
    "DraftConfig",
    "layer_list",
    "NgramConfig",
    "KPolicyConfig",
    "SamplingParams",
    "Grammar",
    "EngineConfig",
    "RouterConfig",
    "EmbedderConfig",
    "LanguageConfig",
    "ClassifierConfig",
    "ClusterConfig",
    "DraftLifecycleConfig",
    "BanditConfig",
    "TargetServeConfig",
    "DraftPoolConfig",
    "IngressConfig",
    "AppConfig",
    "AuthConfig",
    "LearnerServeConfig",
    "MetricsConfig",
    "TenantKey",
    "TenantLimits",
    "ValidationError",
    "cache_dir",
    "content_key",
    "file_sha256",
    "LoopConfig",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MAX_TOP_LOGPROBS",
    "MAX_LOGIT_BIAS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_GRAMMAR_CHARS",
    "ROUTER_LANGUAGES",
]

