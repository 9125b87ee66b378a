"""Proposers: where the k draft tokens of a speculative step come from.

Interface (after transformers' candidate generators): ``propose()`` returns the draft tokens and
the draft distribution q they were drawn from; ``feedback()`` tells the proposer how much of the
sequence the verifier kept, so it can roll back its own state.

- :class:`DraftModelProposer`: a small causal LM (truncated target, fresh model, any model by path,
  optionally with a head restricted to the target's most frequent tokens).
- :class:`NgramProposer`: model-free prompt lookup (match the last n tokens earlier in the context).
- :class:`ChainedProposer`: prompt lookup first, the learned draft when lookup finds nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from config import NgramConfig, SamplingParams

from .runner import ModelRunner
from .sampling import race_noise, race_sample, warp_logits

#: The k policy, asked once per step by the proposer that is about to propose: source -> k.
ChooseK = Callable[[str], int]


@dataclass
class Proposal:
    tokens: list[int]  # [k] draft tokens, target ids
    probs: torch.Tensor | None  # [k, V_target] draft distribution q; None = one-hot (greedy or deterministic)
    source: str  # "draft" | "ngram" | "none"
    seconds: float = 0.0
    input_tokens: int = 0  # tokens the draft model consumed (> k means it caught up on a lag)

    @property
    def k(self) -> int:
        return len(self.tokens)


EMPTY = Proposal([], None, "none")


class Proposer(Protocol):
    sources: tuple[str, ...]

    def propose(
        self, seq_id: str, tokens: list[int], choose_k: ChooseK, params: SamplingParams, gen: torch.Generator | None
    ) -> Proposal: ...

    def feedback(self, seq_id: str, committed: int) -> None:
        """The first ``committed`` tokens of the sequence are final (prompt + accepted output)."""

    def release(self, seq_id: str) -> None: ...


class DraftModelProposer:
    """Proposes k tokens autoregressively with a small LM and its own KV cache per sequence."""

    sources = ("draft",)

    def __init__(self, runner: ModelRunner, target_vocab: int):
        self.runner = runner
        self.target_vocab = target_vocab
        self._valid: dict[str, int] = {}  # seq -> cached positions that hold final tokens
        self.version = 0

    def _to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft distribution over its own head ([.., V_draft]) as one over the target vocabulary."""
        vm = self.runner.vocab_map
        if vm is None:
            return probs
        full = torch.zeros(*probs.shape[:-1], self.target_vocab)
        return full.index_copy_(-1, vm, probs)

    def propose(self, seq_id, tokens, choose_k, params, gen) -> Proposal:
        k = choose_k("draft")
        if k <= 0:
            return EMPTY
        t0 = time.perf_counter()
        start = min(self._valid.get(seq_id, 0), len(tokens) - 1)
        feed = tokens[start:]  # the lag: 1 token normally, more after prompt lookup or at the start
        consumed = len(feed)
        pos = start
        draft_tokens: list[int] = []
        rows = []
        vm = self.runner.vocab_map
        for i in range(k):
            logits = self.runner.forward(seq_id, pos, feed)[-1]  # [V_draft]
            pos += len(feed)
            if params.greedy:  # greedy verification needs only the tokens, not q
                j = int(logits.argmax())
                tok = j if vm is None else int(vm[j])
            else:
                q = self._to_target(warp_logits(logits[None], params))[0]  # [V_target]
                if params.seed is not None:  # seeded: race q with the noise the target's row will use
                    tok = int(race_sample(q[None], race_noise(params.seed, [len(tokens) + i], q.shape[-1]))[0])
                else:
                    tok = int(torch.multinomial(q, 1, generator=gen))
                rows.append(q)
            draft_tokens.append(tok)
            feed = [tok]
            consumed += i < k - 1
        # the cache now holds tokens + d_1..d_{k-1}
        self._valid[seq_id] = pos
        probs = torch.stack(rows) if rows else None  # [k, V_target] (sampling only)
        return Proposal(draft_tokens, probs, "draft", time.perf_counter() - t0, consumed)

    def feedback(self, seq_id: str, committed: int) -> None:
        self._valid[seq_id] = min(self._valid.get(seq_id, 0), committed)

    def release(self, seq_id: str) -> None:
        self._valid.pop(seq_id, None)
        self.runner.release(seq_id)

    def load_state_dict(self, state: dict, version: int) -> None:
        """Swap draft weights between steps. KV caches computed with the old weights are dropped."""
        self.runner.load_state_dict(state)
        for seq_id in list(self._valid):
            self._valid[seq_id] = 0
        self.version = version


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n = max_n..min_n)
    and propose the tokens that followed it. Costs microseconds; no model, no state."""

    sources = ("ngram",)

    def __init__(self, cfg: NgramConfig = NgramConfig()):
        self.cfg = cfg

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        n_tok = len(tokens)
        for n in range(min(self.cfg.max_n, n_tok - 1), self.cfg.min_n - 1, -1):
            tail = tokens[n_tok - n :]
            for i in range(n_tok - n - 1, -1, -1):  # most recent match first
                if tokens[i : i + n] == tail:
                    return tokens[i + n : i + n + k]
        return []

    def propose(self, seq_id, tokens, choose_k, params, gen) -> Proposal:
        k = choose_k("ngram")
        if k <= 0:
            return EMPTY
        t0 = time.perf_counter()
        found = self.lookup(tokens, k)
        if not found:
            return EMPTY
        return Proposal(found, None, "ngram", time.perf_counter() - t0)

    def feedback(self, seq_id: str, committed: int) -> None:
        pass

    def release(self, seq_id: str) -> None:
        pass


def learned_draft(proposer: "Proposer | None") -> "DraftModelProposer | None":
    """The draft-model proposer of a proposer (itself, or the one inside a chain), if any."""
    if isinstance(proposer, DraftModelProposer):
        return proposer
    return getattr(proposer, "draft", None)


class ChainedProposer:
    """Try proposers in order; the first that proposes anything wins the step."""

    def __init__(self, *proposers: Proposer):
        self.proposers = proposers
        self.sources = tuple(s for p in proposers for s in p.sources)

    def propose(self, seq_id, tokens, choose_k, params, gen) -> Proposal:
        for p in self.proposers:
            prop = p.propose(seq_id, tokens, choose_k, params, gen)
            if prop.k:
                return prop
        return EMPTY

    def feedback(self, seq_id: str, committed: int) -> None:
        for p in self.proposers:
            p.feedback(seq_id, committed)

    def release(self, seq_id: str) -> None:
        for p in self.proposers:
            p.release(seq_id)

    @property
    def draft(self) -> DraftModelProposer | None:
        return next((p for p in self.proposers if isinstance(p, DraftModelProposer)), None)
