"""Draft ids: names, not settings, kept here (the lowest layer) because the router, the learner
and the draft pool must agree on them. ``general`` is the draft every query can fall back to;
a named domain's own draft is ``d-<domain>``; an isolated tenant's copy of a draft is
``<draft>@<tenant>``; a cluster's draft is named by the router (``c3/en``)."""

from __future__ import annotations

GENERAL = "general"  # the draft every query can fall back to; never retired
NAMED = "d-"  # prefix of a named domain's own draft: d-sql, d-chat-es (no "/": draft ids go in URLs)


def named_draft_id(domain: str) -> str:
    """The draft a named domain gets of its own: "sql" -> "d-sql", "chat/es" -> "d-chat-es"."""
    return NAMED + domain.replace("/", "-")


def start_domain(draft_id: str, domains) -> str | None:
    """Of ``domains`` (those with a starting draft of their own), the one whose starting draft
    ``draft_id`` takes: its named domain's, else that domain's parent's (d-chat-es takes chat's
    when chat/es has none); a tenant's copy (``d-sql@alice``) as its draft's; None for the general
    draft, a cluster's, or a domain without one."""
    base = draft_id.split("@", 1)[0]
    own = [d for d in domains if base == named_draft_id(d) or base.startswith(named_draft_id(d) + "-")]
    return max(own, key=len) if own else None


def fork_parent(draft_id: str, domains) -> str | None:
    """The draft whose current weights ``draft_id`` starts from when it is first trained and
    served: the general draft of its tenant scope (``general``, or ``general@alice`` for an
    isolated tenant's copy, so that no tenant's learning reaches another's drafts); None for a
    general draft itself and for a draft that starts from its domain's own starting draft
    (``start_domain``), whose head and token ids may differ from the general draft's."""
    base, at, tenant = draft_id.partition("@")
    if base == GENERAL or start_domain(draft_id, domains) is not None:
        return None
    return GENERAL + at + tenant
