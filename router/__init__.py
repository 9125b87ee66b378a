"""Query routing: MiniLM embeddings + language id, domains named by a classifier or
discovered by online clustering, and the choice of draft by observed acceptance.

    router = Router(RouterConfig()).fit(texts, domains)
    route = router.route("Écris une fonction Python ...")   # Route(domain, lang, draft_id, ...)
    router.observe(route, step.accepted, step.proposed)      # after each speculative step
    for event in router.events(): ...                        # spawn / retire drafts
"""

from router.bandit import AcceptanceBandit
from router.domains import BACKGROUND, Cluster, ClusterEvent, DomainClassifier, OnlineClusters
from router.features import EMBED_DIM, UND, FeatureExtractor, QueryFeatures
from router.router import GENERAL, UNKNOWN, DraftEvent, Route, Router

__all__ = [
    "AcceptanceBandit", "BACKGROUND", "Cluster", "ClusterEvent", "DomainClassifier", "DraftEvent", "EMBED_DIM",
    "FeatureExtractor", "GENERAL", "OnlineClusters", "QueryFeatures", "Route", "Router", "UND", "UNKNOWN",
]
