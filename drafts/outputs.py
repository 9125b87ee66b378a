"""What an engine replica keeps besides its engines, without Ray: the finished outputs its suffix
trees learn from (its own and the other replicas'), and the published weights of drafts.

Suffix trees learn from every output served, wherever it was served: a replica keeps the recent
outputs of each draft (:class:`KeptOutputs`), so that a draft it loads later, or a replica that
starts later, starts with them, and sends its own to the others. Each output remembers its
tenant, so that a tenant's deletion reaches them. :class:`PublishedWeights` keeps the weights the
learner published of the drafts loaded here and of a few others (a replica would otherwise hold a
copy of every draft the learner ever published).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

import numpy as np

#: a kept output: (request id, scope, int32 ids, tenant)
Output = tuple[str, str, np.ndarray, "str | None"]


class KeptOutputs:
    """Recent finished outputs by draft id, bounded like a draft's suffix trees: ``max_requests``
    per draft, ``max_scopes`` drafts (the least recently used go), and the tenants of at most
    ``max_owners`` outputs. An output finished here and shared also waits in ``outbox`` (at most
    ``max_requests``: peers unreachable for long get the newest) for the other replicas."""

    def __init__(self, max_requests: int, max_scopes: int, max_owners: int):
        self.max_requests, self.max_scopes, self.max_owners = max_requests, max_scopes, max_owners
        self.served: OrderedDict[str, deque[Output]] = OrderedDict()
        #: request id -> tenant of every output the suffix trees or the kept outputs may hold
        self.owners: OrderedDict[str, str | None] = OrderedDict()
        self.outbox: list[tuple] = []  # (draft id, request id, scope, ids, tenant) not yet sent to the others

    def own(self, rid: str, tenant: str | None) -> None:
        """Whose output request ``rid`` is (for :meth:`forget_tenant`), oldest forgotten first."""
        self.owners[rid] = tenant
        self.owners.move_to_end(rid)
        while len(self.owners) > self.max_owners:
            self.owners.popitem(last=False)

    def remember(self, draft_id: str, item: Output) -> None:
        """Keep an output of ``draft_id`` (finished here or by another replica)."""
        self.own(item[0], item[3])
        q = self.served.get(draft_id)
        if q is None:
            q = self.served[draft_id] = deque(maxlen=self.max_requests)
            while len(self.served) > self.max_scopes:
                self.served.popitem(last=False)
        self.served.move_to_end(draft_id)
        q.append(item)

    def finished(self, draft_id: str, rid: str, scope: str, output: list[int], tenant: str | None = None,
                 share: bool = False) -> None:
        """An output finished here: kept, and with ``share`` sent to the others with the next batch."""
        item: Output = (rid, scope, np.asarray(output, dtype=np.int32), tenant)
        self.remember(draft_id, item)
        if share:
            self.outbox.append((draft_id, *item))
            del self.outbox[: -self.max_requests]

    def take_outbox(self) -> list[tuple]:
        batch, self.outbox = self.outbox, []
        return batch

    def of(self, draft_id: str) -> list[Output]:
        return list(self.served.get(draft_id, ()))

    def all(self) -> list[tuple]:
        """Every kept output, ``(draft id, request id, scope, ids, tenant)``, oldest draft first."""
        return [(d, *item) for d, q in self.served.items() for item in q]

    def forget_tenant(self, tenant: str) -> tuple[int, set[str]]:
        """A tenant's outputs leave the kept outputs and the outbox; returns how many kept ones
        left and the request ids of all its outputs (for the suffix trees), which are then forgotten."""
        kept = 0
        for q in self.served.values():
            stay = [item for item in q if item[3] != tenant]
            kept += len(q) - len(stay)
            q.clear()
            q.extend(stay)
        self.outbox = [item for item in self.outbox if item[4] != tenant]
        ids = {rid for rid, t in self.owners.items() if t == tenant}
        for rid in ids:
            self.owners.pop(rid, None)
        return kept, ids


class PublishedWeights:
    """A draft id's newest published weights, ``(state dict, version)``: those of the drafts
    loaded here (``loaded(draft_id)``), and of at most ``keep`` entries in all, the least recently
    published of the drafts not loaded going first."""

    def __init__(self, keep: int, loaded: Callable[[str], bool]):
        self.keep, self.loaded = keep, loaded
        self.weights: OrderedDict[str, tuple[dict, int]] = OrderedDict()

    def get(self, draft_id: str) -> tuple[dict, int] | None:
        return self.weights.get(draft_id)

    def version(self, draft_id: str) -> int:
        """The newest version kept of ``draft_id`` (0: none)."""
        return self.weights[draft_id][1] if draft_id in self.weights else 0

    def offer(self, draft_id: str, state: dict, version: int) -> bool:
        """Keep ``state`` if it is newer than what is kept of ``draft_id``; returns whether it was."""
        if version <= self.version(draft_id):
            return False
        self.weights[draft_id] = (state, version)
        self.weights.move_to_end(draft_id)
        for d in [d for d in self.weights if not self.loaded(d)]:
            if len(self.weights) <= self.keep:
                break
            del self.weights[d]
        return True
