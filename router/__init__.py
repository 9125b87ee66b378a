"""Query routing: MiniLM embeddings + language id, domains named by a classifier or
discovered by online clustering, and the choice of draft by observed acceptance.

    from router.router import Router
    router = Router(RouterConfig()).fit(texts, domains)
    route = router.route("Écris une fonction Python ...")   # Route(domain, lang, draft_id, ...)
    router.observe(route, step.accepted, step.proposed)      # after each speculative step
    for event in router.events(): ...                        # spawn / retire drafts

Modules: ``router.router`` (the router and the drafts' life cycle), ``router.route`` (what it
answers: light, so the ingress can receive it without the embedder), ``router.features``
(embedding, language id), ``router.domains`` (classifier, online clusters, their names),
``router.bandit`` (draft choice by acceptance). The package itself imports nothing.
"""
