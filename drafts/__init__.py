"""Draft construction, checkpoints and the proposer a config asks for."""

from .build import (
    build_proposer,
    fresh_draft,
    frequent_token_ids,
    load_draft,
    restrict_head,
    save_draft,
    truncated_draft,
)

__all__ = [
    "build_proposer",
    "fresh_draft",
    "frequent_token_ids",
    "load_draft",
    "restrict_head",
    "save_draft",
    "truncated_draft",
]
