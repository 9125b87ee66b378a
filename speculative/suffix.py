"""Suffix trees over past traffic (SuffixDecoding, Oliaro et al., arXiv 2411.04975).

No model: every scope (a domain, or a domain of one isolated tenant) keeps a suffix tree over the
outputs it served, fed token by token as they are generated, and every request also has a tree
over its own prompt and output. A step matches the longest suffix of the context in both trees and
proposes the most frequent continuation, as long as the match supports it (``spec_factor`` x match
length + ``spec_offset`` tokens at most) and each token's estimated probability (its count over
its parent's) stays above ``min_token_prob``. The trees are learned online by construction: what
was served is what gets proposed. Strongest where outputs repeat (agent loops, templated answers,
text-to-SQL over one schema, retries); it proposes nothing where nothing matches.

The tree itself is ``arctic_inference.suffix_decoding.SuffixDecodingCache`` (C++), which builds
on this CPU without vLLM (see :data:`INSTALL_HINT`; about 20 s; the Makefile does it). This module adds what serving needs around it: scopes, bounds
on requests and tokens with oldest-first eviction, and the proposer interface.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from config import SuffixConfig

from .proposers import Proposal, Proposer, model_free_proposal

INSTALL_HINT = (
    "the suffix-tree proposer needs arctic-inference 0.3.0 (C++, builds on a CPU in ~20 s against the "
    "installed torch): pip install nanobind==2.9.2 ninja cmake grpcio-tools setuptools wheel, then, with "
    "the environment's bin folder first on PATH (its CMake must find this Python): "
    "pip install --no-build-isolation --no-deps arctic-inference==0.3.0"
)


class SuffixUnavailable(RuntimeError):
    """arctic-inference is not installed: the message says how to install it."""


def _cache_class():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise SuffixUnavailable(f"{INSTALL_HINT} ({e})") from None
    return SuffixDecodingCache


@dataclass
class _Active:
    scope: str | None
    fed: int  # tokens of the sequence already in the trees (prompt + output so far)


class _Scope:
    """One scope's tree of past outputs, with its bounds."""

    def __init__(self, cfg: SuffixConfig, cache_cls):
        self.cfg = cfg
        self.cache = cache_cls(max_tree_depth=cfg.max_depth, max_cached_requests=-1)  # we evict
        self.sizes: OrderedDict[str, int] = OrderedDict()  # cached output tokens by request, oldest first
        self.tokens = 0
        self.active: set[str] = set()

    def start(self, seq_id: str, prompt: list[int]) -> None:
        if seq_id in self.sizes:  # a reused id: its old output goes first
            self._evict(seq_id)
        self.cache.start_request(seq_id, prompt)
        self.active.add(seq_id)
        self.sizes[seq_id] = 0
        self._bound()

    def add(self, seq_id: str, tokens: Sequence[int] | np.ndarray) -> None:
        self.cache.add_active_response(seq_id, tokens)
        if seq_id in self.sizes:  # (evicted while active: the request's own tree still learns)
            self.sizes[seq_id] += len(tokens)
            self.tokens += len(tokens)
            self._bound()

    def stop(self, seq_id: str) -> None:
        self.cache.stop_request(seq_id)
        self.active.discard(seq_id)

    def _evict(self, seq_id: str) -> None:
        self.tokens -= self.sizes.pop(seq_id)
        self.cache.evict_cached_response(seq_id)

    def _bound(self) -> None:
        """Oldest outputs out until both bounds hold; the newest output always stays."""
        while len(self.sizes) > 1 and (len(self.sizes) > self.cfg.max_requests or self.tokens > self.cfg.max_tokens):
            self._evict(next(iter(self.sizes)))


class SuffixProposer(Proposer):
    """Proposes from suffix trees over past outputs of its scope and the request's own context.

    Lossless like any proposer: its proposals are one-hot (deterministic), so greedy verification
    and rejection sampling treat them as prompt lookup's."""

    sources = ("suffix",)
    learns_from_traffic = True

    def __init__(self, cfg: SuffixConfig = SuffixConfig()):
        self.cfg = cfg
        self._cache_cls = _cache_class()
        self.scopes: OrderedDict[str | None, _Scope] = OrderedDict()  # least recently used first
        self.active: dict[str, _Active] = {}

    def __deepcopy__(self, memo) -> "SuffixProposer":
        """A copy starts empty (the trees are C++ objects): each engine, e.g. one draft replica's
        engine per draft id and so per isolated tenant, learns from its own traffic only."""
        return SuffixProposer(self.cfg)

    # -- bookkeeping --------------------------------------------------------------------------------
    def _scope(self, scope: str | None) -> _Scope:
        sc = self.scopes.get(scope)
        if sc is None:
            sc = self.scopes[scope] = _Scope(self.cfg, self._cache_cls)
            idle = [s for s, v in self.scopes.items() if not v.active and s != scope]
            while len(self.scopes) > self.cfg.max_scopes and idle:
                del self.scopes[idle.pop(0)]
        self.scopes.move_to_end(scope)
        return sc

    def begin(self, seq_id: str, prompt: list[int], scope: str | None = None) -> None:
        """A new request of ``scope``: its prompt becomes matchable for itself."""
        if seq_id in self.active:
            self.release(seq_id)
        self._scope(scope).start(seq_id, list(prompt))
        self.active[seq_id] = _Active(scope, len(prompt))

    def _sync(self, seq_id: str, tokens: list[int]) -> _Scope:
        """Feed the tokens generated since the last call (all final) into the trees."""
        a = self.active.get(seq_id)
        if a is None:  # a request nobody announced: its tokens so far are its prompt
            self.begin(seq_id, tokens)
            a = self.active[seq_id]
        sc = self._scope(a.scope)
        if len(tokens) > a.fed:
            sc.add(seq_id, tokens[a.fed :])
            a.fed = len(tokens)
        return sc

    # -- the proposer interface ----------------------------------------------------------------------
    def propose(self, seq_id, tokens, choose_k, params, gen) -> Proposal:
        return model_free_proposal("suffix", choose_k, lambda k: self._speculate(seq_id, tokens, k))

    def _speculate(self, seq_id: str, tokens: list[int], k: int) -> list[int]:
        sc = self._sync(seq_id, tokens)
        draft = sc.cache.speculate(
            seq_id,
            tokens[-self.cfg.max_depth :],
            max_spec_tokens=k,
            max_spec_factor=self.cfg.spec_factor,
            max_spec_offset=self.cfg.spec_offset,
            min_token_prob=self.cfg.min_token_prob,
        )
        return list(draft.token_ids)

    # feedback: the tokens a step passes to propose() are final, nothing to roll back

    def release(self, seq_id: str, tokens: list[int] | None = None) -> None:
        """The request ended: its last tokens join its scope's tree, which keeps its output."""
        a = self.active.pop(seq_id, None)
        if a is None:
            return
        sc = self.scopes.get(a.scope)
        if sc is None:
            return
        if tokens is not None and len(tokens) > a.fed:
            sc.add(seq_id, list(tokens[a.fed :]))
        sc.stop(seq_id)

    def add_served(self, seq_id: str, output, scope: str | None = None) -> None:
        """An output served elsewhere (another replica of this draft) joins ``scope``'s tree as if
        it had been served here (only outputs are kept across requests, so its prompt is not
        needed). ``output``: token ids, a list or an array; an array that came through Ray's object
        store is read-only, which the tree's binding refuses, so it is copied. A request active here
        under the same id is left alone."""
        if seq_id in self.active or len(output) == 0:
            return
        sc = self._scope(scope)
        sc.start(seq_id, [])
        sc.add(seq_id, np.array(output, dtype=np.int32))
        sc.stop(seq_id)

    def forget(self, seq_ids) -> int:
        """The outputs of these requests leave every scope's tree (a tenant's records deleted);
        returns how many left. A request still running here is not touched: a deletion reaches
        the outputs of requests that ended before it."""
        n = 0
        for sc in self.scopes.values():
            for rid in [r for r in sc.sizes if r in seq_ids and r not in sc.active]:
                sc._evict(rid)
                n += 1
        return n

    # -- introspection ------------------------------------------------------------------------------
    def cached_ids(self) -> set[str]:
        """Ids of the requests whose outputs the trees hold, over all scopes."""
        return {rid for sc in self.scopes.values() for rid in sc.sizes}

    def stats(self) -> dict:
        """Per scope: cached outputs, their tokens and the active requests."""
        return {str(s): {"requests": len(v.sizes), "tokens": v.tokens, "active": len(v.active)} for s, v in self.scopes.items()}
