"""One engine loop per model replica: every in-flight request's speculative step in one target forward.

This is the loop that serving engines run (vLLM's scheduler, llama.cpp's server slots), with
speculation inside it. Each :meth:`EngineLoop.step`:

  1. **admit** waiting sequences, first come first served, while the KV budget (tokens) holds
     their prompt + max_tokens + the draft's k; a sequence that does not fit waits, and past
     ``queue_timeout_s`` it fails with :class:`Overloaded` (a 503 with Retry-After at the edge);
  2. **plan**: every decoding sequence gets its step (the uncached token + k drafted), then
     prompts take what is left of ``step_tokens`` in chunks (chunked prefill: a long prompt is
     spread over several steps and never stalls the others for its whole prefill);
  3. **propose**: each decoding sequence's engine drafts its k tokens (suffix tree, prompt
     lookup or learned draft, k from its k policy); the sequences drafting with the same draft
     model share its forwards, one batched forward a round (a k-token draft takes k rounds);
  4. **verify**: one ragged target forward over all of the step's calls;
  5. **accept** per sequence, and hand each request its :class:`StepResult` through its sink.

A request that is cancelled (its client left) or ends (EOS, stop string, max_tokens) leaves at
the next step boundary, and its cache and budget are freed then.

Each sequence belongs to a :class:`SpeculativeEngine` (its draft: engines of several drafts share
one loop and one target); the engines' state is touched only by the thread that steps (other
threads hand work over with :meth:`EngineLoop.call`).

Lossless: the target's rows are batch-invariant on the fast path (see :mod:`speculative.fast`), so
a sequence's output does not depend on which others share its steps: greedy output equals
target-only output, and a seeded sample equals the seed's sample, under any concurrency.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generator

import numpy as np
import torch

from config import LoopConfig, SamplingParams

from .engine import PendingStep, RequestError, RequestState, SpeculativeEngine, StepResult, _calibration_ids
from .kpolicy import expected_tokens
from .kvcache import PooledCaches
from .proposers import DraftForward, DraftOutput
from .runner import ForwardCall, ModelRunner, VerifyCall
from .runtime import own_threads


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepCost:
    """Seconds of one target forward over ``tokens`` rows of ``seqs`` sequences, as a linear model
    ``base + per_token * tokens + per_seq * seqs`` (least squares over timed forwards)."""

    base: float
    per_token: float
    per_seq: float

    def __call__(self, tokens: int, seqs: int) -> float:
        return self.base + self.per_token * tokens + self.per_seq * seqs


#: (sequences, tokens each) of the forwards :func:`calibrate_step_cost` times
COST_GRID = ((1, 1), (1, 4), (1, 8), (2, 1), (4, 1), (4, 2), (8, 1), (8, 2))


def calibrate_step_cost(runner: ModelRunner, context: int = 64, repeats: int = 2) -> StepCost:
    """Time the runner's forward over the :data:`COST_GRID` shapes after ``context`` cached
    positions (best of ``repeats``) and fit :class:`StepCost`."""
    import numpy as np

    ids, seqs = _calibration_ids(context + 8, runner.vocab_size), [f"__cost_{i}__" for i in range(8)]
    rows, secs = [], []
    try:
        for s in seqs:
            runner.forward(s, 0, ids[:context])
        for b, n in COST_GRID:
            calls = [ForwardCall(s, context, ids[context : context + n], 1) for s in seqs[:b]]
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.forward_batch(calls)
                best = min(best, time.perf_counter() - t0)
            rows.append((1.0, b * n, b))
            secs.append(best)
    finally:
        for s in seqs:
            runner.release(s)
    base, per_token, per_seq = np.linalg.lstsq(np.array(rows), np.array(secs), rcond=None)[0]
    return StepCost(max(float(base), 0.0), max(float(per_token), 1e-6), max(float(per_seq), 0.0))


def shared_k_cap(acceptance: list[float], fed: int, cost: StepCost, k_max: int) -> int:
    """The most draft tokens a sequence may add to a step that ``len(acceptance)`` sequences share
    (``fed``: the tokens they feed without drafts): the k that maximises the step's expected output
    tokens per second, sum_i E[tokens](a_i, k) / cost(fed + B k, B). Alone, a request's own k policy
    decides; shared, each draft token costs the whole batch its rows, so drafting pays only where
    acceptance is high (a large batch decodes plain)."""
    B = len(acceptance)
    rate = [sum(expected_tokens(a, k) for a in acceptance) / cost(fed + B * k, B) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rate[k], -k))


class DraftSwitch:
    """Whether a shared step drafts at all, from what the loop's own steps yielded. Per class of
    batch size (2-3, 4-7, 8-15, 16+ decoding sequences) it keeps the output tokens per second of
    whole steps (proposing, the target's forward, accepting) that drafted and of those that decoded
    plainly, as moving averages; a class drafts while drafting measures at least as fast. Every
    ``explore``-th step of a class tries the other kind, so a change in the traffic (acceptance
    rising as the suffix trees learn, a cheaper draft) is noticed. The cost model and acceptance
    estimates behind :func:`shared_k_cap` leave out what proposing costs beside the forwards (the
    proposers' Python, the draft's own forwards); a full batch on a CPU was measured slower drafting
    than plain with the cap alone (docs/serving.md, "Drafting in a full batch")."""

    def __init__(self, explore: int = 8, decay: float = 0.9):
        self.explore, self.decay = explore, decay
        self.rate: dict[tuple[int, bool], float] = {}  # (class, plain) -> output tokens per second
        self.turns: dict[int, int] = {}

    @staticmethod
    def size_class(seqs: int) -> int:
        return min(seqs, 16).bit_length()

    def plain(self, seqs: int) -> bool:
        """This shared step decodes plainly (True) or drafts as the cap allows (False)."""
        c = self.size_class(seqs)
        turn = self.turns[c] = self.turns.get(c, 0) + 1
        drafted, plain = self.rate.get((c, False)), self.rate.get((c, True))
        if drafted is None or plain is None:  # measure both kinds first: drafting, then plain
            return drafted is not None
        better = plain > drafted
        return better != (turn % self.explore == 0)

    def observe(self, seqs: int, plain: bool, tokens: int, seconds: float) -> None:
        """A shared step without prefill: ``tokens`` output in ``seconds`` of the whole step."""
        if seconds <= 0:
            return
        key, r = (self.size_class(seqs), plain), tokens / seconds
        old = self.rate.get(key)
        self.rate[key] = r if old is None else self.decay * old + (1 - self.decay) * r


class Overloaded(RuntimeError):
    """A request waited ``queue_timeout_s`` without fitting the KV budget (retry later)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


# -- what a request's sink receives, in order: Started, then Step..., then Finished (or Failed) ------
@dataclass
class Started:
    prompt_tokens: int


@dataclass
class Step:
    result: StepResult
    waited: float = 0.0  # set by the consumer: seconds since its previous event


@dataclass
class Finished:
    state: RequestState  # the request's final state (output, stats, finish reason); no longer stepped


@dataclass
class Failed:
    error: Exception  # RequestError (the request as given), Overloaded, or what the step raised


@dataclass(eq=False)
class Sequence:
    """One request handed to the loop. ``sink`` is called from the loop's thread with each event."""

    engine: SpeculativeEngine
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[object], None]
    scope: str | None = None
    resume: list[int] = field(default_factory=list)  # output already sent by a replica that failed
    cache_salt: str | None = None  # requests share cached prompt prefixes only with the same salt (tenant)
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    reserved: int = 0  # KV tokens held in the budget while running
    started: bool = False  # in a step's plan once: its prompt is being computed
    #: an earlier sequence computing prompt positions this one shares, and how many (set when it is
    #: first planned; see ``LoopConfig.share_prompt_min``)
    twin: "Sequence | None" = None
    shared: int = 0

    def need(self, k_max: int) -> int:
        """KV positions it may hold at most: prompt + max_tokens, plus a step's draft tokens."""
        return len(self.prompt) + self.params.max_tokens + k_max + 1

    def send(self, ev: object) -> None:
        """Hand ``ev`` to the sink. A sink that raises (its consumer is gone: the event loop it
        posts to has closed) cancels this request alone; the loop's thread and the other requests
        go on."""
        try:
            self.sink(ev)
        except Exception:  # noqa: BLE001 - whatever the consumer's failure, it must not stop the loop
            log.warning("request %s: its consumer failed to take %s; the request is dropped",
                        self.request_id, type(ev).__name__, exc_info=True)
            self.cancelled = True


class EngineLoop:
    """The scheduler of one replica: sequences of any number of engines over one target runner."""

    def __init__(self, target: ModelRunner, cfg: LoopConfig, budget_tokens: int, k_max: int,
                 clock: Callable[[], float] = time.monotonic,
                 on_step: Callable[[int, int, float], None] | None = None, step_cost: StepCost | None = None):
        self.target = target
        self.cfg = cfg
        self.budget_tokens = budget_tokens  # KV positions all running sequences may hold together
        self.k_max = k_max
        self.clock = clock
        self.on_step = on_step  # (sequences, tokens, seconds) of each target forward, from the loop's thread
        self.step_cost = step_cost  # None: each request's own k policy decides, shared step or not
        self.last_k_cap: int | None = None
        #: why the last shared step drafted or not: "drafting" (the cap allowed drafts), "cap_zero"
        #: (the cost model allowed none), "plain_measured" (the switch); None: no shared step
        self.last_decision: str | None = None
        #: shared steps draft only where drafting measured faster than plain (None: the cap alone)
        self.switch: DraftSwitch | None = DraftSwitch() if cfg.measured_drafting else None
        self.reserved = 0  # KV positions reserved by running sequences
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0  # target forwards
        self.calls = 0  # sequences' calls in them
        self.tokens = 0  # tokens fed to them
        self.draft_forwards = 0  # the learned drafts' forwards (one a round of a step's proposals, per draft model)
        self.draft_calls = 0  # sequences' calls in them
        self.last_batch = 0  # sequences in the last step
        self.last_tokens = 0  # tokens the target took in the last step
        self._inbox: list[Sequence] = []
        self._calls: list[tuple[Callable[[], object], cf.Future]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- from any thread ------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        with self._lock:
            self._inbox.append(seq)
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """The request's client left: it is dropped at the next step boundary."""
        seq.cancelled = True
        self._wake.set()

    def call(self, fn: Callable[[], object]) -> cf.Future:
        """Run ``fn`` on the loop's thread between two steps (the engines are single-threaded)."""
        fut: cf.Future = cf.Future()
        with self._lock:
            self._calls.append((fn, fut))
        self._wake.set()
        if self._thread is None:  # not running in a thread (tests step by hand): run it now
            self._run_calls()
        return fut

    def reserve(self, tokens: int) -> bool:
        """Hold ``tokens`` KV positions of the budget for work beside the running sequences (a
        prompt scored between steps): False, nothing held, when the budget has no room. Call it
        on the loop's thread (:meth:`call`), and :meth:`unreserve` after."""
        if self.reserved + tokens > self.budget_tokens:
            return False
        self.reserved += tokens
        return True

    def unreserve(self, tokens: int) -> None:
        self.reserved -= tokens

    def prefix_cache_stats(self) -> dict | None:
        """The target's prefix cache: prompt positions looked up and found (``looked_up``, ``hit``,
        since start) and the blocks it indexes (``blocks``); None where the runner has no pool."""
        if not isinstance(self.target, PooledCaches):
            return None
        pool = self.target.pool
        return {**pool.prefix_stats, "blocks": pool.cached_blocks}

    def forget_prefixes(self, salt: str | None) -> int:
        """The prompt blocks cached for ``salt`` (a tenant whose records are deleted) leave the
        prefix cache; returns how many. Call it on the loop's thread (:meth:`call`)."""
        return self.target.forget_prefixes(salt) if isinstance(self.target, PooledCaches) else 0

    @property
    def queued(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def start(self, name: str = "engine-loop", threads: int | None = None) -> None:
        """Step in a thread of its own. ``threads``: torch's intra-op threads, set on the loop's
        thread (:func:`speculative.runtime.own_threads`); the calling thread then goes back to one,
        as do threads started later. Time the target on the loop's thread too (:meth:`call`)."""
        ready = threading.Event()
        if self.cfg.gil_switch_s is not None:  # the loop's thread gets the GIL back soon after each kernel
            sys.setswitchinterval(self.cfg.gil_switch_s)

        def run() -> None:
            if threads:
                own_threads(threads)
            ready.set()
            self._run()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()
        ready.wait()
        if threads:
            torch.set_num_threads(1)  # the caller's thread, and the default of threads started later

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.running and not self.waiting and not self._inbox and not self._calls:
                self._wake.wait(0.25)
                self._wake.clear()
            self._run_calls()
            if not self.step() and self.waiting:  # nothing to run yet: let the queue's clock move
                self._wake.wait(0.01)
                self._wake.clear()

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, fut in calls:
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> int:
        """One iteration (see the module docstring); returns the number of sequences stepped."""
        self._take_inbox()
        self._drop_cancelled()
        self._admit()
        while len(self.waiting) > self.cfg.max_waiting:  # the queue is full: the newest are turned away
            self.waiting.pop().send(Failed(Overloaded(
                f"{len(self.running)} requests are running and {self.cfg.max_waiting} queued on this replica; retry later")))
        decode, prefill = self._plan()
        if not decode and not prefill:
            return 0
        t_step = time.perf_counter()
        pending = self._propose(decode, self._k_cap(decode, prefill))
        calls = [p.call for _, p in pending] + [call for _, call in prefill]
        if not calls:
            return 0
        t0 = time.perf_counter()
        try:  # verify: one forward for every sequence of the step
            rows = self.target.verify(calls, max_batch_tokens=self._batch_tokens())
        except Exception as e:  # noqa: BLE001 - the forward failed: every sequence in it fails
            for seq in [s for s, _ in pending] + [s for s, _ in prefill]:
                self._fail(seq, e)
            return 0
        self.last_batch, self.last_tokens = len(calls), sum(len(c.tokens) for c in calls)
        self.steps, self.calls, self.tokens = self.steps + 1, self.calls + len(calls), self.tokens + self.last_tokens
        if self.on_step is not None:
            self.on_step(len(calls), self.last_tokens, time.perf_counter() - t0)
        emitted = 0
        for (seq, p), r in zip(pending, rows):  # accept
            try:
                res = seq.engine.accept(p, r)
            except Exception as e:  # noqa: BLE001
                self._fail(seq, e)
                continue
            emitted += len(res.emitted)
            seq.send(Step(res))
            if res.finished:
                self._finish(seq)
        for seq, call in prefill:
            seq.engine.prefilled(seq.request_id, len(call.tokens))
        if self.switch is not None and self.last_k_cap is not None and not prefill:  # a shared decode-only step: what its kind yields
            self.switch.observe(len(decode), self.last_k_cap == 0, emitted, time.perf_counter() - t_step)
        return len(calls)

    def _propose(self, decode: list[Sequence], cap: int | None) -> list[tuple[Sequence, PendingStep]]:
        """Every decoding sequence's proposal (a sequence whose proposer fails fails alone). The
        proposals are driven together: each round, the draft forwards they wait on run one batched
        forward per draft base (drafts of several domains whose adapters sit on one packed base share
        it, each row with its own draft's adapters), each call's rows the same as alone on the fast
        path (rows are batch-invariant there), and each proposal is charged its share of the forward's time."""
        done: dict[int, PendingStep] = {}
        waiting: list[tuple[Sequence, Generator[DraftForward, DraftOutput, PendingStep], DraftForward]] = []

        def advance(seq: Sequence, steps, sent: DraftOutput | None) -> None:
            try:
                waiting.append((seq, steps, steps.send(sent)))
            except StopIteration as stop:
                done[id(seq)] = stop.value
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._fail(seq, e)

        for seq in decode:
            advance(seq, seq.engine.propose_steps(seq.request_id, k_cap=cap), None)
        while waiting:
            by_base: dict[tuple, list] = {}  # runners of one packed base (drafts' adapters on it) share a forward
            for item in waiting:
                by_base.setdefault(item[2].runner.batch_key, []).append(item)
            waiting = []
            for items in by_base.values():
                runner = items[0][2].runner
                t0 = time.perf_counter()
                try:  # [keep_last, V_draft] each; one call alone, as run_alone runs it
                    rows = (runner.forward_with([(fw.runner, fw.call) for _, _, fw in items]) if len(items) > 1 else
                            [items[0][2].alone()])
                except Exception as e:  # noqa: BLE001 - the draft's forward failed: its sequences fail
                    for seq, steps, _ in items:
                        steps.close()
                        self._fail(seq, e)
                    continue
                share = (time.perf_counter() - t0) / len(items)
                self.draft_forwards, self.draft_calls = self.draft_forwards + 1, self.draft_calls + len(items)
                for (seq, steps, _), r in zip(items, rows):
                    advance(seq, steps, DraftOutput(r, share))
        return [(seq, done[id(seq)]) for seq in decode if id(seq) in done]

    def _k_cap(self, decode: list[Sequence], prefill: list) -> int | None:
        """The step's limit on each sequence's draft tokens (:func:`shared_k_cap`); None alone."""
        cap, decision = None, None
        if self.step_cost is not None and len(decode) > 1:
            if self.switch is not None and self.switch.plain(len(decode)):
                cap, decision = 0, "plain_measured"
            else:
                acceptance = [s.engine.acceptance(s.request_id) for s in decode]
                fed = sum(s.engine.uncached(s.request_id) for s in decode) + sum(len(c.tokens) for _, c in prefill)
                cap = shared_k_cap(acceptance, fed, self.step_cost, self.k_max)
                decision = "cap_zero" if cap == 0 else "drafting"
        self.last_k_cap, self.last_decision = cap, decision
        return cap

    def _batch_tokens(self) -> int:
        # the fast path's batch is ragged (no padding): everything in one forward; a padded
        # (Hugging Face) runner keeps long prefills apart so that they do not pad the others
        return self.cfg.step_tokens if getattr(self.target, "ragged", False) else self.cfg.padded_batch_tokens

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
        for seq in new:
            if seq.need(self.k_max) > self.budget_tokens:
                seq.send(Failed(RequestError(
                    f"prompt ({len(seq.prompt)} tokens) + max_tokens ({seq.params.max_tokens}) needs "
                    f"{seq.need(self.k_max)} positions of KV cache; a replica holds {self.budget_tokens}")))
            else:
                self.waiting.append(seq)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.running if s.cancelled]:
            self._release(seq)
        if any(s.cancelled for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
        now = self.clock()
        while self.waiting and now - self.waiting[0].enqueued > self.cfg.queue_timeout_s:
            seq = self.waiting.popleft()
            seq.send(Failed(Overloaded(
                f"the request waited {self.cfg.queue_timeout_s:g} s for KV cache on this replica "
                f"({self.reserved} of {self.budget_tokens} positions held by {len(self.running)} requests); retry later")))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running:
            seq = self.waiting[0]
            need = seq.need(self.k_max)
            if self.reserved + need > self.budget_tokens:
                return  # first come, first served: later requests do not overtake it
            self.waiting.popleft()
            try:
                seq.engine.add_request(seq.prompt, seq.params, seq.request_id, scope=seq.scope, cache_salt=seq.cache_salt)
            except Exception as e:  # noqa: BLE001 - a request that cannot be served as given
                seq.send(Failed(e))
                continue
            seq.reserved, self.reserved = need, self.reserved + need
            self.running.append(seq)
            st = seq.engine.requests[seq.request_id]
            try:
                if seq.resume:
                    seq.engine.resume(seq.request_id, seq.resume)
            except Exception as e:  # noqa: BLE001
                self._fail(seq, e)
                continue
            seq.send(Started(st.prompt_len))
            if st.finished:  # the resumed output had already ended it
                self._finish(seq)

    def _plan(self) -> tuple[list[Sequence], list[tuple[Sequence, VerifyCall]]]:
        """Who decodes this step, and which prompts prefill how much (the step's token budget:
        decoding sequences first, one step each; prompts after, in chunks, oldest first). A
        sequence whose prompt an earlier one is computing waits for it (:meth:`_waits`)."""
        budget = self.cfg.step_tokens
        decode: list[Sequence] = []
        prompts: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if not seq.started:
                if self._waits(seq):
                    continue
                seq.started = True
            uncached = seq.engine.uncached(seq.request_id)
            if uncached + self.k_max <= self.cfg.prefill_chunk or not seq.engine.can_chunk_prefill:
                decode.append(seq)
                budget -= uncached + self.k_max
            else:
                prompts.append((seq, uncached))
        prefill: list[tuple[Sequence, VerifyCall]] = []
        for seq, uncached in prompts:
            n = min(uncached - 1, self.cfg.prefill_chunk, budget)  # the last prompt token comes with the first draft
            if n <= 0:
                if prefill:
                    continue  # no room this step: it waits for the next
                n = min(uncached - 1, max(1, self.cfg.prefill_chunk // 4))  # the oldest prompt always moves
            prefill.append((seq, seq.engine.prefill_call(seq.request_id, n)))
            budget -= n
        return decode, prefill

    def _waits(self, seq: Sequence) -> bool:
        """Whether a sequence not started yet waits for an earlier started one (of its salt) that is
        computing at least ``share_prompt_min`` of its prompt positions the prefix cache does not
        hold yet; when it goes, it starts from what the cache holds then (``reattach``)."""
        if not (self.cfg.share_prompt_min and isinstance(self.target, PooledCaches) and self.target.prefix_caching):
            return False
        st = seq.engine.requests[seq.request_id]
        if seq.twin is None:  # looked for once, among those computing their prompts already
            for other in self.running:
                if other.started and other.cache_salt == seq.cache_salt:
                    n = common_prefix(st.tokens, other.engine.requests[other.request_id].tokens, len(st.tokens) - 1)
                    if n > seq.shared:
                        seq.twin, seq.shared = other, n
        cached = max(self.target.cached_prefix(st.tokens, seq.cache_salt), st.target_len)
        if seq.twin in self.running and seq.shared - cached >= self.cfg.share_prompt_min:
            return True
        if cached > st.target_len:
            seq.engine.reattach(seq.request_id, seq.cache_salt)
        return False

    def _fail(self, seq: Sequence, error: Exception) -> None:
        self._release(seq)
        seq.send(Failed(error))

    def _finish(self, seq: Sequence) -> None:
        st = seq.engine.requests[seq.request_id]  # released below: the state goes to the sink
        self._release(seq)
        seq.send(Finished(st))

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            seq.engine.release(seq.request_id)
            self.reserved -= seq.reserved
            seq.reserved = 0


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    n = max(0, min(len(a), len(b), limit))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n
