"""Proposers: where the k draft tokens of a speculative step come from.

Interface (after transformers' candidate generators): ``propose()`` returns the draft tokens and
the draft distribution q they were drawn from; ``feedback()`` tells the proposer how much of the
sequence the verifier kept, so it can roll back its own state.

- :class:`LearnedDraft`: what the learned drafts share (a model the learner trains, its caches
  per sequence, its distribution over the target's vocabulary); :class:`DraftModelProposer`, a
  small causal LM (truncated target, fresh model, any model by path, optionally with a head
  restricted to the target's most frequent tokens), and the feature-conditioned draft
  (:mod:`speculative.feature`) are its two kinds.
- :class:`NgramProposer`: model-free prompt lookup (match the last n tokens earlier in the context).
- :class:`ChainedProposer`: proposers in a fixed order; the first that proposes drafts the step.
- :class:`ControllerProposer`: per step, the proposer with the best expected tokens per unit of
  cost from its live acceptance; the others are still probed.
- :class:`speculative.suffix.SuffixProposer`: suffix trees over past traffic (another module).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Protocol, Sequence, TypeVar

import torch

from config import NgramConfig, SamplingParams

from .kpolicy import StepChoice
from .runner import ForwardCall, ModelRunner
from .sampling import race_noise, race_sample, warp_logits

#: The k policy, asked once per step by the proposer that is about to propose: source -> k. The
#: engine passes a :class:`speculative.kpolicy.StepChoice`, which also ranks sources (``speedup``).
ChooseK = Callable[[str], int]


@dataclass
class Proposal:
    tokens: list[int]  # [k] draft tokens, target ids
    probs: torch.Tensor | None  # [k, V_target] draft distribution q; None = one-hot (greedy or deterministic)
    source: str  # "draft" | "ngram" | "suffix" | "none"
    seconds: float = 0.0
    input_tokens: int = 0  # tokens the draft model consumed (> k means it caught up on a lag)

    @property
    def k(self) -> int:
        return len(self.tokens)


EMPTY = Proposal([], None, "none")


@dataclass
class DraftForward:
    """A draft-model forward a proposal in the making waits on: the draft's runner and the call."""

    runner: ModelRunner
    call: ForwardCall  # its last ``keep_last`` rows come back

    def alone(self) -> torch.Tensor:
        """The call run by itself: its last ``keep_last`` rows, [keep_last, V_draft]."""
        c = self.call
        return self.runner.forward(c.seq_id, c.start, c.tokens, c.keep_last)


@dataclass
class DraftOutput:
    """What came back for a :class:`DraftForward`: its rows and its share of the forward's time."""

    logits: torch.Tensor  # [keep_last, V_draft]
    seconds: float


#: a proposal in the making (:meth:`Proposer.propose_steps`): it yields the draft forwards it needs,
#: one at a time, is sent their rows, and returns what it proposes. The engine loop drives the
#: proposals of all its sequences together, so that those waiting on the same draft model share one
#: forward a round (:meth:`speculative.scheduler.EngineLoop.step`); :func:`run_alone` drives one.
ProposalSteps = Generator[DraftForward, DraftOutput, Proposal]
R = TypeVar("R")


def run_alone(steps: Generator[DraftForward, DraftOutput, R]) -> R:
    """Drive ``steps`` with each draft forward run by itself (one sequence, in-process)."""
    try:
        fw = next(steps)
        while True:
            t0 = time.perf_counter()
            logits = fw.alone()
            fw = steps.send(DraftOutput(logits, time.perf_counter() - t0))
    except StopIteration as stop:
        return stop.value


class Proposer:
    """What every proposer is: it drafts tokens for a sequence, and says what else it can do.

    The capabilities an engine asks about are attributes here, set to True (or filled) by the
    proposers that have them; the hooks of a request's life do nothing unless a proposer needs them.
    A composite (:class:`ChainedProposer`) answers for its members."""

    #: the names its proposals carry (``Proposal.source``), one per proposer it is made of
    sources: tuple[str, ...] = ()
    #: it reads the target's features at the verified positions (verification then returns them)
    wants_features: bool = False
    #: with ``wants_features``: the target's decoder layers whose outputs it reads too
    feature_layers: tuple[int, ...] = ()
    #: it learns from the outputs it serves (a suffix tree): outputs served elsewhere can be handed
    #: to it (:meth:`add_served`), and forgotten (:meth:`forget`)
    learns_from_traffic: bool = False

    @property
    def parts(self) -> tuple["Proposer", ...]:
        """The proposers this one is made of (itself, or a chain's members)."""
        return (self,)

    @property
    def draft(self) -> "LearnedDraft | None":
        """The learned draft model among its parts (the one whose weights the learner sends), if any."""
        return None

    def begin(self, seq_id: str, prompt: list[int], scope: str | None = None) -> None:
        """A new request of ``scope`` (its domain; None: unscoped) with these prompt tokens."""

    def propose(
        self, seq_id: str, tokens: list[int], choose_k: ChooseK, params: SamplingParams, gen: torch.Generator | None
    ) -> Proposal:
        raise NotImplementedError

    def propose_steps(
        self, seq_id: str, tokens: list[int], choose_k: ChooseK, params: SamplingParams, gen: torch.Generator | None
    ) -> ProposalSteps:
        """:meth:`propose` as a proposal in the making (:data:`ProposalSteps`). A proposer without a
        batched draft model proposes at once, waiting on no forward."""
        return self.propose(seq_id, tokens, choose_k, params, gen)
        yield  # (a generator)

    def feedback(self, seq_id: str, committed: int) -> None:
        """The first ``committed`` tokens of the sequence are final (prompt + accepted output)."""

    def observe_features(self, seq_id: str, start: int, features: torch.Tensor) -> None:
        """The target's features ([n, H]) at final positions start..start+n-1; only proposers whose
        ``wants_features`` is True get them (verification computes them only then)."""

    def release(self, seq_id: str, tokens: list[int] | None = None) -> None:
        """The request ended (``tokens``: prompt + output as served, for proposers that learn from it)."""

    # -- proposers that learn from traffic ---------------------------------------------------------
    def add_served(self, seq_id: str, output, scope: str | None = None) -> None:
        """An output served elsewhere, taken in as if served here."""

    def forget(self, seq_ids) -> int:
        """Outputs of these requests leave it; returns how many did."""
        return 0

    def cached_ids(self) -> set[str]:
        """Ids of the requests whose outputs it holds."""
        return set()


class DraftRunner(Protocol):
    """What a learned draft's proposer needs of its runner besides proposing: the model the learner
    trains, the draft head's ids in the target's vocabulary (None: the same), dropping a
    sequence's cache, taking new weights, and the memo that makes a copy share its base."""

    model: Any
    vocab_map: torch.Tensor | None

    def release(self, seq_id: str) -> None: ...

    def load_state_dict(self, state: dict) -> None: ...

    def share_memo(self) -> dict[int, torch.Tensor]: ...


class LearnedDraft(Proposer):
    """A learned draft model: the learner trains its weights and publishes them; the proposer keeps
    how many of each sequence's cached positions hold final tokens, and draws the draft's tokens
    (with q, when sampling) over the target's vocabulary."""

    runner: DraftRunner

    def __init__(self, runner: DraftRunner, target_vocab: int):
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

    def _draw(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
              position: int) -> tuple[int, torch.Tensor | None]:
        """The draft token at ``position`` from the draft's logits ([V_draft]), as a target id, and
        q ([V_target]) when sampling. Greedy verification needs only the token; a seeded request
        races q with the noise the target's row at ``position`` will use."""
        vm = self.runner.vocab_map
        if params.greedy:
            j = int(logits.argmax())
            return (j if vm is None else int(vm[j])), None
        q = self._to_target(warp_logits(logits[None], params))[0]  # [V_target]
        if params.seed is not None:
            return int(race_sample(q[None], race_noise(params.seed, [position], q.shape[-1]))[0]), q
        return int(torch.multinomial(q, 1, generator=gen)), q

    @property
    def draft(self) -> "LearnedDraft":
        return self

    def feedback(self, seq_id: str, committed: int) -> None:
        self._valid[seq_id] = min(self._valid.get(seq_id, 0), committed)

    def release(self, seq_id: str, tokens: list[int] | None = None) -> None:
        self._valid.pop(seq_id, None)
        self.runner.release(seq_id)

    def load_state_dict(self, state: dict, version: int) -> None:
        """Swap draft weights between steps. KV caches computed with the old weights are dropped."""
        self.runner.load_state_dict(state)
        for seq_id in list(self._valid):
            self._valid[seq_id] = 0
        self.version = version


class DraftModelProposer(LearnedDraft):
    """Proposes k tokens autoregressively with a small LM and its own KV cache per sequence."""

    sources = ("draft",)
    runner: ModelRunner

    def __init__(self, runner: ModelRunner, target_vocab: int, context_tokens: int | None = None):
        super().__init__(runner, target_vocab)
        #: the draft reads at most the last ``context_tokens`` tokens a sequence had when it first
        #: proposed (None: all of them); its cache holds them from position 0 (RoPE scores depend on
        #: distances only), so a long prompt's draft prefill costs a window, not the prompt
        self.context_tokens = context_tokens
        self._offset: dict[str, int] = {}  # seq -> tokens before the draft's window

    def propose(self, seq_id, tokens, choose_k, params, gen) -> Proposal:
        return run_alone(self.propose_steps(seq_id, tokens, choose_k, params, gen))

    def release(self, seq_id: str, tokens: list[int] | None = None) -> None:
        self._offset.pop(seq_id, None)
        super().release(seq_id, tokens)

    def propose_steps(self, seq_id, tokens, choose_k, params, gen) -> ProposalSteps:
        """k forwards of one token each (the first catches up on the lag), each one a yield: the
        engine loop runs those of all sequences on this draft together. The proposal's seconds are
        its own work plus its share of each forward."""
        k = choose_k("draft")
        if k <= 0:
            return EMPTY
        spent, t = 0.0, time.perf_counter()
        if seq_id not in self._offset:  # its first proposal: where its window starts
            self._offset[seq_id] = max(0, len(tokens) - self.context_tokens) if self.context_tokens else 0
        off = self._offset[seq_id]
        start = max(off, min(self._valid.get(seq_id, 0), len(tokens) - 1))
        feed = tokens[start:]  # the lag: 1 token normally, more after prompt lookup or at the start
        consumed = len(feed)
        pos = start  # positions of the sequence; the draft's cache holds them from off on, at pos - off
        draft_tokens: list[int] = []
        rows = []
        for i in range(k):
            spent += time.perf_counter() - t
            out = yield DraftForward(self.runner, ForwardCall(seq_id, pos - off, feed, 1))
            t, spent = time.perf_counter(), spent + out.seconds
            logits = out.logits[-1]  # [V_draft]
            pos += len(feed)
            tok, q = self._draw(logits, params, gen, len(tokens) + i)
            if q is not None:
                rows.append(q)
            draft_tokens.append(tok)
            feed = [tok]
            consumed += i < k - 1
        # the cache now holds tokens + d_1..d_{k-1}
        self._valid[seq_id] = pos
        probs = torch.stack(rows) if rows else None  # [k, V_target] (sampling only)
        return Proposal(draft_tokens, probs, "draft", spent + time.perf_counter() - t, consumed)


class NgramProposer(Proposer):
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
        return model_free_proposal("ngram", choose_k, lambda k: self.lookup(tokens, k))


def model_free_proposal(source: str, choose_k: ChooseK, find: Callable[[int], list[int]]) -> Proposal:
    """A deterministic proposer's step: k from the policy, then ``find(k)``'s tokens (q one-hot),
    timed; EMPTY when k = 0 or nothing is found."""
    k = choose_k(source)
    if k <= 0:
        return EMPTY
    t0 = time.perf_counter()
    found = find(k)
    return Proposal(list(found), None, source, time.perf_counter() - t0) if found else EMPTY


def learned_draft(proposer: Proposer | None) -> "LearnedDraft | None":
    """The draft-model proposer of a proposer (itself, or the one inside a chain), if any."""
    return proposer.draft if proposer is not None else None


class ChainedProposer(Proposer):
    """Try proposers in order; the first that proposes anything wins the step."""

    def __init__(self, *proposers: Proposer):
        self.proposers = proposers
        self.sources = tuple(s for p in proposers for s in p.sources)
        self.wants_features = any(p.wants_features for p in proposers)
        self.feature_layers = next((tuple(p.feature_layers) for p in proposers if p.wants_features), ())
        self.learns_from_traffic = any(p.learns_from_traffic for p in proposers)

    @property
    def parts(self) -> tuple[Proposer, ...]:
        return tuple(q for p in self.proposers for q in p.parts)

    def ordered(self, seq_id: str, choose_k: ChooseK) -> Sequence[Proposer]:
        return self.proposers

    def begin(self, seq_id: str, prompt: list[int], scope: str | None = None) -> None:
        for p in self.proposers:
            p.begin(seq_id, prompt, scope)

    def propose(self, seq_id, tokens, choose_k, params, gen) -> Proposal:
        return run_alone(self.propose_steps(seq_id, tokens, choose_k, params, gen))

    def propose_steps(self, seq_id, tokens, choose_k, params, gen) -> ProposalSteps:
        for p in self.ordered(seq_id, choose_k):
            prop = yield from p.propose_steps(seq_id, tokens, choose_k, params, gen)
            if prop.k:
                return prop
        return EMPTY

    def feedback(self, seq_id: str, committed: int) -> None:
        for p in self.proposers:
            p.feedback(seq_id, committed)

    def observe_features(self, seq_id: str, start: int, features: torch.Tensor) -> None:
        for p in self.proposers:
            p.observe_features(seq_id, start, features)

    def release(self, seq_id: str, tokens: list[int] | None = None) -> None:
        for p in self.proposers:
            p.release(seq_id, tokens)

    @property
    def draft(self) -> LearnedDraft | None:
        """The learned draft among the proposers (a token draft or a feature-conditioned one)."""
        return next((p.draft for p in self.proposers if p.draft is not None), None)

    def add_served(self, seq_id: str, output, scope: str | None = None) -> None:
        for p in self.proposers:
            p.add_served(seq_id, output, scope)

    def forget(self, seq_ids) -> int:
        return sum(p.forget(seq_ids) for p in self.proposers)

    def cached_ids(self) -> set[str]:
        return set().union(*(p.cached_ids() for p in self.proposers))


class ControllerProposer(ChainedProposer):
    """Picks the proposer per step by expected tokens per unit of cost (after ATLAS's controller).

    Each step ranks the proposers by ``choose_k.speedup(source)``: S(k) = E[tokens](k) / (k c +
    v(k + 1)) maximised over k, from the request's live acceptance of that source (a new request
    starts from its domain's) and the source's measured cost c. The best one that has something to
    propose drafts the step, so a cheap model-free proposer that finds no match hands over to the
    next. A proposer not tried for ``probe_every`` steps of a request goes first once (probing),
    so one that got better is noticed; the k policy still lets every source fall to k = 0 (none).
    """

    def __init__(self, *proposers: Proposer, probe_every: int = 8):
        super().__init__(*proposers)
        self.probe_every = probe_every
        self._since: dict[str, list[int]] = {}  # seq -> steps since each proposer last drafted
        self.picks: dict[str, int] = {}  # source -> steps it drafted (all requests)

    def ordered(self, seq_id: str, choose_k: ChooseK) -> Sequence[Proposer]:
        since = self._since.setdefault(seq_id, [0] * len(self.proposers))
        speedup = choose_k.speedup if isinstance(choose_k, StepChoice) else None  # (a plain k callable ranks none)
        score = [max(speedup(s) for s in p.sources) if speedup else 0.0 for p in self.proposers]
        # best expected speedup first (ties: the given order); a proposer due a probe before all
        order = sorted(range(len(self.proposers)), key=lambda i: (since[i] < self.probe_every, -score[i], i))
        return [self.proposers[i] for i in order]

    def propose_steps(self, seq_id, tokens, choose_k, params, gen) -> ProposalSteps:
        prop = yield from super().propose_steps(seq_id, tokens, choose_k, params, gen)
        since = self._since[seq_id]
        for i, p in enumerate(self.proposers):
            since[i] = 0 if prop.source in p.sources else since[i] + 1
        if prop.k:
            self.picks[prop.source] = self.picks.get(prop.source, 0) + 1
        return prop

    def release(self, seq_id: str, tokens: list[int] | None = None) -> None:
        self._since.pop(seq_id, None)
        super().release(seq_id, tokens)
