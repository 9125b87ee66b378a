"""The whole application, as ``serve_config.yaml`` gives it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .auth import AuthConfig
from .base import _Strict
from .draft import DraftConfig
from .engine import EngineConfig
from .learner import LearnerServeConfig
from .model import ModelConfig
from .router import RouterConfig
from .serving import DraftPoolConfig, IngressConfig, LoopConfig, MetricsConfig, TargetServeConfig


class AppConfig(_Strict):
    """The whole application, as ``serve_config.yaml`` gives it (``args:`` of the app).

    placement ``colocated`` (the default): each replica of the pool is an engine replica, the
    target plus the drafts it serves, whose engine loop (``loop``) steps every request together in
    one target forward; scale by replicas (one target copy each). ``split``: draft replicas run a
    loop per request and call the Target deployment once per step (one hop a step, batched there).
    """

    placement: Literal["split", "colocated"] = "colocated"
    #: host of each replica's inter-deployment gRPC listener (Ray binds all interfaces); null: Ray's default
    replica_grpc_host: str | None = "127.0.0.1"
    engine: EngineConfig = EngineConfig(
        model=ModelConfig(num_threads=1),
        draft=DraftConfig(proposers=["ngram", "draft"], kind="truncated", num_layers=2),
    )
    target: TargetServeConfig = TargetServeConfig()
    loop: LoopConfig = LoopConfig()
    drafts: DraftPoolConfig = DraftPoolConfig()
    router: RouterConfig = RouterConfig(mode="clusters")
    #: how often the router deployment saves its state (under ``<learner state_dir>/router/<app>``,
    #: reloaded at start); 0: never saved, a restarted router starts afresh
    router_save_s: float = Field(default=30.0, ge=0.0)
    ingress: IngressConfig = IngressConfig()
    auth: AuthConfig = AuthConfig()
    learner: LearnerServeConfig = LearnerServeConfig()
    metrics: MetricsConfig = MetricsConfig()
