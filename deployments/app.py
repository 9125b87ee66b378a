"""The application builder: typed args (``config.AppConfig``) -> the composed Serve app.

``serve run serve_config.yaml`` calls :func:`build_app` with the YAML's ``args``; ``osd serve``
calls :func:`build` with the same config and the YAML's per-deployment options.

    Ingress --route--> Router --retired drafts--> Learner
        \\--/metrics, /v1/stats--> Metrics <--telemetry (pulled every sample_s)-- every replica
        \\--stream (multiplexed by draft id)--> DraftPool --verify (batched)--> Target
                                                     \\--replay records--> Learner --weights (broadcast)--> DraftPool
"""

from __future__ import annotations

from ray.serve import Application

from config import AppConfig

from .drafts import DraftPoolDeployment
from .ingress import IngressDeployment
from .learner import Learner
from .metrics import MetricsDeployment
from .router import RouterDeployment
from .target import Target


def build(cfg: AppConfig, options: dict[str, dict] | None = None) -> Application:
    """``options``: deployment name -> ``.options()`` keywords (num_replicas, ray_actor_options, ...)."""
    opts = options or {}

    def dep(d):
        return d.options(**opts[d.name]) if d.name in opts else d

    learner = dep(Learner).bind(cfg) if cfg.learner.enabled and cfg.engine.draft.learned else None
    router = dep(RouterDeployment).bind(cfg.router, cfg.replica_grpc_host, cfg.metrics,
                                        str(cfg.learner.root() / "router"), cfg.router_save_s, learner)
    target = dep(Target).bind(cfg.engine.model, cfg.target, cfg.engine.k.k_max, cfg.replica_grpc_host, cfg.metrics) \
        if cfg.placement == "split" else None
    pool = dep(DraftPoolDeployment).bind(cfg, target, learner)
    metrics = None
    if cfg.metrics.enabled:
        sources = ["Ingress", "Router", "DraftPool"] + ["Target"] * (target is not None) + ["Learner"] * (learner is not None)
        metrics = dep(MetricsDeployment).bind(cfg.metrics, sources, cfg.replica_grpc_host)
    return dep(IngressDeployment).bind(cfg, router, pool, learner, metrics)


def build_app(args: dict) -> Application:
    """Entry point for ``import_path: deployments.app:build_app`` (args validated: a typo is an error)."""
    return build(AppConfig.model_validate(args or {}))
