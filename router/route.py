"""What the router answers for one query. Its own module, importing nothing heavy: the ingress
receives a ``Route`` from the router's replica, and unpickling it imports only this (not the
embedder, scikit-learn and SciPy behind ``router.router``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Route:
    """Where one query goes and why; recorded with the request for metrics and dashboards."""

    domain: str  # routing domain: "code", "chat/fr" (classifier), "c3/fr" (cluster) or "unknown"
    lang: str  # ISO 639-1 code or "und"
    draft_id: str
    confidence: float  # classifier probability, or cosine similarity to the cluster (0: new cluster)
    reason: str  # "classifier" | "classifier: n-grams" | "cluster" | "bandit-explore" | "fallback: ..."
    topic: str | None = None  # the classifier's label, when it ran (even if unsure)
    cluster: int | None = None
    lang_conf: float = 0.0
    latency_ms: float = 0.0
    typicality: float | None = None  # similarity to the topic's nearest training example(s)

    def to_dict(self) -> dict:
        return asdict(self)
