"""The speculative decoding engine: propose -> verify -> accept, with per-request state by id.

One :meth:`SpeculativeEngine.step` is one target forward. Invariants per request:
  - ``tokens``: prompt + output so far; the last token is *pending* (not yet in the target cache)
  - ``target_len``: positions of ``tokens`` whose KV entries in the target cache are final
A step feeds the target ``tokens[target_len:] + draft_tokens`` (the pending token, or the whole
prompt on the first step, then the k draft tokens) and reads k + 1 rows of logits: row i scores
the token after ``tokens + d_1..d_i``.
"""

from __future__ import annotations

import numbers
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generator

import torch
from transformers import PreTrainedTokenizerBase

from config import EngineConfig, SamplingParams

from .detokenize import StopScanner, final_text
from .kpolicy import CostModel, KPolicy, StepChoice
from .models import encode_prompt, eos_token_ids
from .proposers import (EMPTY, DraftForward, DraftModelProposer, DraftOutput, LearnedDraft, Proposal, Proposer, learned_draft,
                        run_alone)
from .runner import ModelRunner, TargetRows, VerifyCall
from .grammar import Constraint, GrammarError, ll_tokenizer
from .processors import process_rows
from .sampling import greedy_accept, greedy_pick, race_noise, race_sample, rejection_accept, warp_logits
from .stats import SpecStats
from .summary import token_logprobs


#: scopes (domains) whose acceptance the engine keeps as priors; the least recently seen goes first
MAX_SCOPES = 256


class RequestError(ValueError):
    """A request that cannot be served as given (empty prompt, prompt too long, unknown id)."""


def prompt_text(prompt: str | bytes) -> str:
    """A text prompt as valid, non-empty Unicode: UTF-8 bytes are decoded strictly, and a str with
    lone surrogates (undecodable bytes of a command line arrive so) is refused."""
    if isinstance(prompt, (bytes, bytearray)):
        try:
            prompt = bytes(prompt).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"prompt is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    if not isinstance(prompt, str):
        raise RequestError(f"prompt must be text or a list of token ids, not {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"prompt is not valid Unicode text (character {e.start}: {e.reason})") from None
    if not prompt.strip():
        raise RequestError("prompt is empty")
    return prompt


@dataclass
class StepResult:
    """Everything a step produced, for the client, the metrics and the learner.

    Row i of the target arrays is the target's distribution (temperature 1, top-K + tail) for the
    token at position ``start + i``, conditioned on ``context[:start] + draft_tokens[:i]``. Rows
    0..accepted are conditioned on final tokens (teacher context); later rows on the draft's own,
    rejected tokens (student context) - free extra training signal.
    """

    request_id: str
    source: str  # proposer that drafted this step: "draft" | "ngram" | "none"
    draft_version: int
    start: int  # position of row 0 = number of tokens before this step
    draft_tokens: list[int]  # [k]
    accepted: int  # n in 0..k
    draft_matches_target: list[bool]  # [k] d_i == argmax of target row i (the draft was right there)
    emitted: list[int]  # output tokens this step (after EOS / stop / max_tokens truncation)
    target_top_ids: torch.Tensor  # [k+1, K] long
    target_top_probs: torch.Tensor  # [k+1, K] float
    target_tail: torch.Tensor  # [k+1] float
    draft_s: float
    target_s: float
    finished: bool
    finish_reason: str | None  # "stop" | "length" | None
    #: [n, H] float16 target features at positions features_start.. (its final fed tokens), when
    #: the proposer reads them (a feature-conditioned draft); None otherwise
    features: torch.Tensor | None = None
    features_start: int = 0
    #: the step's cost in target-only steps by the engine's cost model, v(k + 1) + k c (the k
    #: policy's denominator; 1 for a step with nothing drafted): output tokens over the sum of it
    #: estimate the speed-up over target-only decoding
    cost: float = 1.0
    #: when the request asks (``SamplingParams.logprobs``): for each emitted token, its
    #: log-probability under the target and the most likely tokens' there, [(id, logprob)]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    #: when the request asks for log-probabilities and this step ended it at the end of sequence:
    #: that token's entry, as ``logprobs`` gives an emitted token's (the token itself is not emitted)
    eos_logprob: tuple[float, list[tuple[int, float]]] | None = None

    @property
    def proposed(self) -> int:
        return len(self.draft_tokens)

    @property
    def accepted_mask(self) -> list[bool]:  # [k] True where the draft token was kept
        return [i < self.accepted for i in range(self.proposed)]


@dataclass
class PendingStep:
    """A proposed step waiting for the target: what :meth:`SpeculativeEngine.accept` needs."""

    request_id: str
    start: int  # len(tokens) when proposed
    proposal: Proposal
    call: VerifyCall  # what the target must score


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    tokens: list[int]
    prompt_len: int
    policy: KPolicy
    generator: torch.Generator | None
    scope: str | None = None  # the request's domain: its k policy's prior and its proposers' scope
    target_len: int = 0
    finished: bool = False
    finish_reason: str | None = None
    #: what ended it at "stop": the stop string or stop token id matched (vLLM's ``stop_reason``);
    #: None at EOS, at the end of a grammar, or not stopped
    stop_reason: str | int | None = None
    #: the end-of-sequence token that ended it (not in ``tokens``); None otherwise
    eos_token: int | None = None
    #: prompt positions the target took from its prefix cache instead of computing them
    cached_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    started: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    stop_scan: StopScanner | None = None  # the rolling decoded tail its stop strings are looked for in
    constraint: Constraint | None = None  # structured output: the grammar's matcher, in step with the output

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    stats: SpecStats
    seconds: float
    first_token_s: float | None


def check_context(prompt_tokens: int, max_tokens: int, max_positions: int | None) -> None:
    """Refuse (:class:`RequestError`) a request the model's context cannot hold with its max_tokens."""
    if max_positions and prompt_tokens + max_tokens > max_positions:
        raise RequestError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                           f"context of {max_positions} positions")


class SpeculativeEngine:
    """Target + proposer + k policy, serving many requests addressed by id (single-threaded)."""

    def __init__(
        self,
        target: ModelRunner,  # or anything with its verify / release / vocab_size / max_positions / eos_ids
        tokenizer: PreTrainedTokenizerBase,
        proposer: Proposer | None,
        cfg: EngineConfig = EngineConfig(),
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.cfg = cfg
        self.costs = CostModel(ema=cfg.k.ema)
        self.global_policy = KPolicy(cfg.k, self.costs)  # engine-wide acceptance: the prior of new requests
        #: per scope (domain) acceptance, the prior of that scope's new requests (most recent last)
        self.scope_policy: OrderedDict[str, KPolicy] = OrderedDict()
        self.requests: dict[str, RequestState] = {}
        self.vocab_size = target.vocab_size
        self.max_positions = target.max_positions
        self.eos_ids = eos_token_ids(tokenizer, None) | set(target.eos_ids)
        self._staged: tuple[dict, int] | None = None  # draft weights handed over by another thread
        self._ll_tokenizer = None  # llguidance's view of the tokenizer, made at the first structured request
        self._staged_lock = threading.Lock()

    # -- requests -------------------------------------------------------------------------
    def encode(self, prompt: str | bytes) -> list[int]:
        """Text (str, or UTF-8 bytes) -> prompt token ids; text that is not valid Unicode is refused."""
        return encode_prompt(self.tokenizer, prompt_text(prompt), self.cfg.chat_template)

    def check_token_ids(self, tokens: list) -> list[int]:
        """Token ids must be integers (not floats, not bools) in [0, vocab)."""
        wrong = [t for t in tokens if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if wrong:
            raise RequestError(f"prompt token ids must be integers, got {wrong[:5]!r}")
        bad = [int(t) for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return [int(t) for t in tokens]

    def add_request(
        self,
        prompt: str | bytes | list[int],
        params: SamplingParams = SamplingParams(),
        request_id: str | None = None,
        generator: torch.Generator | None = None,
        scope: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request. Unseeded sampling draws from ``generator`` when given (reproducible
        experiments and tests), else from fresh entropy; a seeded request needs no generator.
        ``scope`` (the request's domain) selects the acceptance its k policy starts from and the
        proposers' per-domain state (suffix trees). Where the target caches prompt prefixes, the
        request starts after the longest one cached for requests of the same ``cache_salt`` (its
        tenant)."""
        if isinstance(prompt, (str, bytes, bytearray)):
            tokens = self.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            tokens = self.check_token_ids(list(prompt))
        else:
            raise RequestError(f"prompt must be text or a list of token ids, not {type(prompt).__name__}")
        if not tokens:
            raise RequestError("prompt is empty")
        named = [t for t in params.token_ids() if t >= self.vocab_size]
        if named:
            raise RequestError(f"logit_bias and stop_token_ids name token ids out of range [0, {self.vocab_size}): {named[:5]}")
        check_context(len(tokens), params.max_tokens, self.max_positions)
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already active")
        constraint = self._constraint(params)
        gen = None
        if not params.greedy and params.seed is None:  # seeded requests race with (seed, position) noise
            gen = generator
            if gen is None:
                gen = torch.Generator()
                gen.seed()  # fresh entropy for this request only; the global RNG is untouched
        prior = {s: e.value for s, e in self.global_policy.alpha.items()}
        home = self.global_policy  # whose probe schedule the request shares: its scope's, else the engine's
        if scope is not None:
            home = self._scope_policy(scope)
            self.scope_policy.move_to_end(scope)
            prior.update({s: e.value for s, e in home.alpha.items()})
        policy = KPolicy(self.cfg.k, self.costs, prior, probes=home.probes)
        self.requests[rid] = st = RequestState(rid, params, tokens, len(tokens), policy, gen, scope, constraint=constraint)
        if not self.wants_features:  # a feature draft reads the target's features at every prompt position
            st.target_len = st.cached_tokens = self.target.attach_prefix(rid, tokens, cache_salt)
        if self.proposer is not None:
            self.proposer.begin(rid, list(tokens), scope)
        return rid

    def resume(self, request_id: str, output: list[int]) -> None:
        """Continue a request whose first ``output`` tokens were produced elsewhere (a replica that
        failed mid-stream): they become its output so far, ending it at EOS, a stop string or
        max_tokens as if generated here. Greedy and seeded continuations equal the uninterrupted run."""
        st = self.requests[request_id]
        self._append(st, self.check_token_ids(list(output)))

    def release(self, request_id: str) -> None:
        st = self.requests.pop(request_id, None)
        self.target.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id, list(st.tokens) if st is not None else None)

    @property
    def wants_features(self) -> bool:
        """Whether verification returns the target's features (a feature-conditioned draft reads them)."""
        return self.proposer is not None and self.proposer.wants_features

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the proposer reads besides the final feature (a fusing draft)."""
        return tuple(self.proposer.feature_layers) if self.proposer is not None else ()

    @property
    def busy(self) -> bool:
        """Whether any request is live (a background learner yields while this is True)."""
        return bool(self.requests)

    # -- the speculative step -----------------------------------------------------------------
    def step(self, request_id: str) -> StepResult:
        """One speculative step in-process: the three phases below, with the local target. A server
        runs the same phases with the verify call sent to a remote, batching target."""
        pending = self.propose(request_id)  # 1. draft k tokens (local)
        rows = self.target.verify([pending.call])[0]  # 2. one target forward over them
        return self.accept(pending, rows)  # 3. keep the longest acceptable prefix

    def step_many(self, request_ids: list[str]) -> list[StepResult]:
        """One step of each request with their verifications batched into one target forward
        (a co-located server's loop). Greedy results equal :meth:`step` up to float rounding."""
        pending = [self.propose(rid) for rid in request_ids]
        rows = self.target.verify([p.call for p in pending])
        return [self.accept(p, r) for p, r in zip(pending, rows)]

    def acceptance(self, request_id: str) -> float:
        """The request's best per-token acceptance estimate over its proposer's sources (0: none)."""
        if self.proposer is None:
            return 0.0
        pol = self.requests[request_id].policy
        return max((pol.estimate(s).value for s in self.proposer.sources), default=0.0)

    # -- chunked prefill (the engine loop spreads a long prompt over several steps) --------------
    def uncached(self, request_id: str) -> int:
        """Tokens of the request not yet in the target's cache (the whole prompt at first, then 1)."""
        st = self.requests[request_id]
        return len(st.tokens) - st.target_len

    def reattach(self, request_id: str, cache_salt: str | None = None) -> int:
        """The request starts again from the longest prefix of its tokens the target has cached now
        (another request has computed it since): for one that has computed nothing yet, whose
        positions came from the cache or nowhere. Returns the positions cached."""
        st = self.requests[request_id]
        if not self.wants_features:
            st.target_len = st.cached_tokens = self.target.attach_prefix(request_id, st.tokens, cache_salt)
        return st.target_len

    @property
    def can_chunk_prefill(self) -> bool:
        """A feature-conditioned draft reads the target's features at every position, which a
        prefill chunk does not return: its prompts go whole."""
        return not self.wants_features

    def prefill_call(self, request_id: str, n: int) -> VerifyCall:
        """The target call that caches the next ``n`` uncached prompt tokens (at least one stays
        uncached: it is fed with the first draft, by :meth:`propose`); its row is not read."""
        st = self.requests[request_id]
        if not 0 < n < len(st.tokens) - st.target_len:
            raise RequestError(f"a prefill chunk of {n} tokens does not fit the {self.uncached(request_id)} uncached")
        return VerifyCall(request_id, st.target_len, st.tokens[st.target_len : st.target_len + n], 1, False, 1)

    def prefilled(self, request_id: str, n: int) -> None:
        """The chunk of :meth:`prefill_call` is in the target's cache."""
        self.requests[request_id].target_len += n

    def propose(self, request_id: str, k_cap: int | None = None) -> "PendingStep":
        """Phase 1: installs staged draft weights, asks the k policy for k and the proposer for
        d_1..d_k (with q), and states the target call that verifies them. ``k_cap``: at most this
        many (the engine loop's limit when the step is shared with other sequences)."""
        return run_alone(self.propose_steps(request_id, k_cap))

    def propose_steps(self, request_id: str, k_cap: int | None = None
                      ) -> Generator[DraftForward, DraftOutput, "PendingStep"]:
        """:meth:`propose` as steps that yield the draft model's forwards (the engine loop runs those
        of all its sequences on one draft together: :data:`speculative.proposers.ProposalSteps`)."""
        if self._staged is not None:
            self._install_staged()
        st = self.requests.get(request_id)
        if st is None:
            raise RequestError(f"unknown request id {request_id!r}")
        if st.finished:
            raise RequestError(f"request {request_id!r} has finished ({st.finish_reason})")
        budget = st.params.max_tokens - len(st.output) - 1  # drafting past max_tokens is wasted work
        if k_cap is not None:
            budget = min(budget, k_cap)
        prop: Proposal = EMPTY
        if self.proposer is not None and budget > 0:
            prop = yield from self.proposer.propose_steps(request_id, st.tokens, StepChoice(st.policy, budget), st.params,
                                                          st.generator)
        feed = st.tokens[st.target_len :] + prop.tokens  # the uncached suffix + d_1..d_k
        full = not st.params.greedy or st.params.processes_logits or st.params.greedy_rows  # choosing needs the whole rows
        call = VerifyCall(request_id, st.target_len, feed, prop.k + 1, full, self.cfg.record_top_k,
                          features=self.wants_features, feature_layers=self.feature_layers)
        return PendingStep(request_id, len(st.tokens), prop, call)

    def accept(self, pending: "PendingStep", rows: TargetRows) -> StepResult:
        """Phase 3: the accepted prefix and the recovered / bonus token from the target's rows
        ([k+1] argmax, or [k+1, V] logits when sampling), then the request's bookkeeping."""
        st = self.requests.get(pending.request_id)
        if st is None or len(st.tokens) != pending.start or st.finished:
            raise RequestError(f"request {pending.request_id!r} moved on since this step was proposed")
        prop, params, start, k = pending.proposal, st.params, pending.start, pending.proposal.k
        draft = torch.tensor(prop.tokens, dtype=torch.long)  # [k]
        logits = rows.logits  # [k+1, V] when the call asked for full rows
        if params.processes_logits:  # penalties, biases, min_tokens, a grammar: row j with d_1..d_j in its history
            assert logits is not None, "a request that processes logits asks for full rows"
            allowed = None if st.constraint is None else st.constraint.masks(prop.tokens)  # [k+1, V]
            logits = process_rows(logits, params, st.tokens, st.prompt_len, prop.tokens, self._min_tokens_ids(params), allowed)
        if params.greedy:
            n, next_token = greedy_accept(draft, rows.argmax if logits is None else greedy_pick(logits, params))
        elif params.seed is not None:  # seeded: the target's race winners, noise fixed by (seed, position)
            assert logits is not None, "a sampled request's verify call asks for full rows"
            p = warp_logits(logits, params)  # [k+1, V] target
            winners = race_sample(p, race_noise(params.seed, range(start, start + k + 1), p.shape[-1]))  # [k+1]
            n, next_token = greedy_accept(draft, winners)
        else:
            assert logits is not None, "a sampled request's verify call asks for full rows"
            p = warp_logits(logits, params)  # [k+1, V] target
            q = prop.probs if prop.probs is not None else torch.nn.functional.one_hot(draft, p.shape[-1]).float()
            n, next_token = rejection_accept(draft, q, p, st.generator)  # q: [k, V] draft

        # commit: the target cache keeps tokens + d_1..d_n; the new token is pending
        st.target_len = start + n
        feats, f_start = None, 0
        if rows.features is not None:  # [fed, W], the last fed position is start + k - 1 (a resent call feeds more)
            f_start = start + k - rows.features.shape[0]
            feats = rows.features[: start + n - f_start]  # the final positions f_start..start+n-1
        if self.proposer is not None:
            if feats is not None:
                self.proposer.observe_features(pending.request_id, f_start, feats)
            self.proposer.feedback(pending.request_id, start + n)
        emitted = self._append(st, prop.tokens[:n] + [next_token])
        scored = None  # the emitted tokens' log-probabilities, and the end of sequence's where it ended this step
        if params.logprobs is not None:
            ended = [st.eos_token] if st.eos_token is not None else []  # (accept runs on unfinished requests only)
            scored = token_logprobs(rows.top_ids, rows.top_probs, rows.logits, emitted + ended, params.logprobs)
        cost = self.costs.relative_verify(k + 1) + k * self.costs.c(prop.source) if k else 1.0  # before this step's times
        self._observe(st, prop, n, len(emitted), len(pending.call.tokens), rows.seconds, rows.batch)
        return StepResult(
            request_id=pending.request_id,
            source=prop.source,
            draft_version=self.draft_version,
            start=start,
            draft_tokens=prop.tokens,
            accepted=n,
            draft_matches_target=(draft == rows.argmax[:k]).tolist(),
            emitted=emitted,
            target_top_ids=rows.top_ids,
            target_top_probs=rows.top_probs,
            target_tail=rows.tail,
            draft_s=prop.seconds,
            target_s=rows.seconds,
            finished=st.finished,
            finish_reason=st.finish_reason,
            features=feats,
            features_start=f_start,
            cost=cost,
            logprobs=None if scored is None else scored[: len(emitted)],
            eos_logprob=None if scored is None or len(scored) == len(emitted) else scored[-1],
        )

    def _append(self, st: RequestState, new: list[int]) -> list[int]:
        """Append output tokens, ending the request at EOS, a stop string or max_tokens."""
        params, out = st.params, []
        for tok in new:
            if not params.ignore_eos and tok in self.eos_ids:
                st.finished, st.finish_reason, st.eos_token = True, "stop", tok
                break
            st.tokens.append(tok)
            out.append(tok)
            if tok in params.stop_token_ids:  # kept in the output, as vLLM does
                st.finished, st.finish_reason, st.stop_reason = True, "stop", tok
                break
            if params.stop and (hit := self._hit_stop(st)) is not None:
                st.finished, st.finish_reason, st.stop_reason = True, "stop", hit
                break
            if len(st.output) >= params.max_tokens:
                st.finished, st.finish_reason = True, "length"
                break
        if st.constraint is not None:
            st.constraint.commit(out)
            if st.constraint.done and not st.finished:  # complete: nothing but the end of the sequence follows
                st.finished, st.finish_reason = True, "stop"
        if st.first_token_s is None and out:
            st.first_token_s = time.perf_counter() - st.started
        return out

    def _constraint(self, params: SamplingParams) -> Constraint | None:
        """A structured-output request's matcher (llguidance's view of the tokenizer is made once)."""
        if params.grammar is None:
            return None
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
        try:
            return Constraint.compile(params.grammar, self._ll_tokenizer, self.vocab_size, frozenset(self.eos_ids))
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def _min_tokens_ids(self, params: SamplingParams) -> set[int]:
        """What min_tokens keeps out of the output until it has that many tokens."""
        return (self.eos_ids | set(params.stop_token_ids)) if params.min_tokens else set()

    def _hit_stop(self, st: RequestState) -> str | None:
        """The stop string the output holds (None: none), in time linear in the tokens since the
        last check (``StopScanner``: a rolling decoded tail, kept with the request's state)."""
        if st.stop_scan is None:
            st.stop_scan = StopScanner(self.tokenizer, st.params.stop)
        scan = st.stop_scan
        return scan.matched if scan.hit(st.tokens, st.prompt_len) else None

    def _observe(self, st: RequestState, prop: Proposal, n: int, emitted: int, fed: int, target_s: float, batch: int = 1) -> None:
        st.stats.observe(prop.k, n, emitted, prop.seconds, target_s)
        if prop.k:
            st.policy.observe(prop.source, prop.k, n)
            self.global_policy.observe(prop.source, prop.k, n)
            if st.scope is not None:
                self._scope_policy(st.scope).observe(prop.source, prop.k, n)
            if prop.input_tokens <= prop.k + 1:  # no catch-up/prefill inside: a clean per-token cost
                self.costs.observe_draft(prop.source, prop.k, prop.seconds)
        if fed == prop.k + 1 and batch == 1:  # no prefill or other requests inside: a clean verify cost
            self.costs.observe_verify(fed, target_s)

    def _scope_policy(self, scope: str) -> KPolicy:
        pol = self.scope_policy.get(scope)
        if pol is None:
            pol = self.scope_policy[scope] = KPolicy(self.cfg.k, self.costs)
            while len(self.scope_policy) > MAX_SCOPES:
                self.scope_policy.popitem(last=False)
        return pol

    # -- whole generations ----------------------------------------------------------------------
    def text_of(self, st: RequestState) -> str:
        return final_text(self.tokenizer, st.output, st.params.stop)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams = SamplingParams(),
        on_step: Callable[[StepResult], None] | None = None,
        generator: torch.Generator | None = None,
        scope: str | None = None,
    ) -> Generation:
        rid = self.add_request(prompt, params, generator=generator, scope=scope)
        st = self.requests[rid]
        try:
            while not st.finished:
                res = self.step(rid)
                if on_step is not None:
                    on_step(res)
            return Generation(
                text=self.text_of(st),
                token_ids=list(st.output),
                prompt_tokens=st.prompt_len,
                finish_reason=st.finish_reason or "length",
                stats=st.stats,
                seconds=time.perf_counter() - st.started,
                first_token_s=st.first_token_s,
            )
        finally:
            self.release(rid)

    # -- cost calibration ---------------------------------------------------------------------
    @torch.inference_mode()
    def calibrate(self, context: int = 64, repeats: int = 3, verify_s: dict[int, float] | None = None) -> dict:
        """Measure the target's time to verify j = 1..k_max+1 tokens (unless ``verify_s`` brings
        it, measured where the target lives) and the draft's time per token at a
        ``context``-token prefix (best of ``repeats``), seeding the k policy's cost model.
        Online measurements refine these as traffic flows."""
        if verify_s is None:
            verify_s = time_verify(self.target, self.cfg.k.k_max, context, repeats)
        self.costs.verify_s.update(verify_s)
        draft = self.learned_draft
        if isinstance(draft, DraftModelProposer):  # (a feature draft needs the target's features to run: measured online)
            runner, seq = draft.runner, "__calibrate__"
            ids = _calibration_ids(context + 1, self.vocab_size)
            try:
                runner.forward(seq, 0, ids[:context])
                self.costs.draft_s["draft"] = min(_timed(runner.forward, seq, context, ids[context:]) for _ in range(repeats))
            finally:
                runner.release(seq)
        for source in ("ngram", "suffix"):  # model-free: microseconds, refined as they run
            if self.proposer is not None and source in self.proposer.sources:
                self.costs.draft_s[source] = 0.0
        return {"verify_s": dict(self.costs.verify_s), "draft_s": dict(self.costs.draft_s)}

    # -- draft weights ----------------------------------------------------------------------
    @property
    def draft_version(self) -> int:
        return self.learned_draft.version if self.learned_draft is not None else 0

    @property
    def learns_from_traffic(self) -> bool:
        """Some proposer learns from past outputs (a suffix tree): outputs served elsewhere help it."""
        return self.proposer is not None and self.proposer.learns_from_traffic

    def add_served(self, seq_id: str, output, scope: str | None = None) -> None:
        """An output that another engine (another replica of this draft) served: proposers that
        learn from past traffic take it in as if it had been served here."""
        if self.proposer is not None:
            self.proposer.add_served(seq_id, output, scope)

    def forget_served(self, seq_ids) -> int:
        """Outputs of these requests leave the proposers that learn from traffic (their suffix
        trees); returns how many left. Call it between steps, from the thread that steps."""
        return self.proposer.forget(set(seq_ids)) if self.proposer is not None else 0

    def served_ids(self) -> set[str]:
        """Ids of the requests whose outputs the proposers that learn from traffic hold."""
        return self.proposer.cached_ids() if self.proposer is not None else set()

    @property
    def learned_draft(self) -> LearnedDraft | None:
        """The draft-model proposer (alone or inside a chain), if any."""
        return learned_draft(self.proposer)

    def swap_draft(self, state: dict, version: int) -> None:
        """Install new draft weights (numpy arrays or tensors) now; call it between steps, from
        the thread that steps (another thread uses :meth:`stage_draft`)."""
        if self.learned_draft is None:
            raise RuntimeError("this engine has no learned draft to update")
        self.learned_draft.load_state_dict(state, version)
        self._probe_sooner()

    def _probe_sooner(self) -> None:
        """New draft weights: every scope where the learned draft is within reach of paying (its
        optimistic acceptance beats the break-even at today's costs) probes it after half its
        current gap; elsewhere the gap stands, since a probe there buys no information worth its cost."""
        draft = self.learned_draft
        if draft is None:
            return
        for pol in (self.global_policy, *self.scope_policy.values()):
            pol.probes.sooner([s for s in draft.sources if pol.within_reach(s)])

    def stage_draft(self, state: dict, version: int) -> None:
        """Thread-safe hand-over of new draft weights: the next :meth:`step` installs them before
        it proposes (a newer staged version replaces an older one that was not installed yet)."""
        if self.learned_draft is None:
            raise RuntimeError("this engine has no learned draft to update")
        with self._staged_lock:
            if self._staged is None or version > self._staged[1]:
                self._staged = (state, version)

    def install_staged(self) -> int:
        """Install staged weights now (between steps, from the thread that steps); returns the
        draft version then running."""
        if self._staged is not None:
            self._install_staged()
        return self.draft_version

    def _install_staged(self) -> None:
        with self._staged_lock:
            staged, self._staged = self._staged, None
        draft = self.learned_draft
        if staged is not None and draft is not None and staged[1] > draft.version:
            draft.load_state_dict(*staged)
            self._probe_sooner()


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _calibration_ids(n: int, vocab_size: int) -> list[int]:
    return [(100 + i) % vocab_size for i in range(n)]


@torch.inference_mode()
def time_verify(target: ModelRunner, k_max: int, context: int = 64, repeats: int = 3) -> dict[int, float]:
    """Seconds for the target to score j = 1..k_max+1 new tokens after a ``context``-token prefix
    (best of ``repeats``): the verification costs of the k policy."""
    ids, seq = _calibration_ids(context + k_max + 1, target.vocab_size), "__calibrate__"
    try:
        target.forward(seq, 0, ids[:context])
        return {
            j: min(_timed(target.forward, seq, context, ids[context : context + j], j) for _ in range(repeats))
            for j in range(1, k_max + 2)
        }
    finally:
        target.release(seq)
