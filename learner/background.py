"""The online learner in a background thread beside serving (Ray-free, in-process).

Serving threads hand over one :class:`learner.replay.ReplayRecord` per finished request with
:meth:`BackgroundLearner.submit` (a non-blocking queue put). The learner thread drains the queue
into :meth:`learner.trainer.OnlineLearner.observe` and, every ``train_every`` records, runs a
round, but only while the ``busy`` callable (e.g. ``lambda: engine.busy``) says no request is
live: a round starts only when serving is idle, and inside a step the thread stops between two
forward/backward pieces (``LearnerConfig.micro_batch_records``) for as long as a request is live,
then goes on where it was. A request competes at most with the piece in flight. The thread runs at OS nice
``BackgroundConfig.nice`` (Linux priorities are per thread) with its own torch thread count,
and ``LearnerConfig.max_cpu_share`` caps its share of wall time. ``BackgroundConfig.min_share``
puts a floor under it: under traffic that never pauses it still trains, within that share of the
CPU (:class:`ShareBudget`). Accepted weights go to the
subscribers, e.g. ``engine.stage_draft``, which installs them between two steps of the serving
thread. A Ray learner deployment runs the same loop in its own process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import torch

from config.learner import BackgroundConfig
from learner.replay import ReplayRecord
from learner.trainer import OnlineLearner, RoundReport

__all__ = ["BackgroundConfig", "BackgroundLearner", "LearnerStats", "ShareBudget"]

log = logging.getLogger(__name__)


@dataclass
class LearnerStats:
    """What metrics need from the learner thread (a snapshot; see :meth:`BackgroundLearner.stats`)."""

    observed: int = 0
    dropped: int = 0
    rounds: int = 0
    steps: int = 0
    published: int = 0
    rejected: int = 0
    yielded_rounds: int = 0
    cut_rounds: int = 0  # ended after min_steps_per_round because the next round was due
    errors: int = 0  # rounds that raised (weights restored, learning went on)
    train_seconds: float = 0.0
    against_traffic_s: float = 0.0  # CPU seconds trained while serving was busy (min_share)
    queue_depth: int = 0
    running: bool = False
    paused: bool = False
    training: str | None = None  # the draft whose round is running now
    #: what the learner thread holds its lock for now (a round, a live check, housekeeping) and
    #: for how many seconds so far: what an operator's rollback or new settings wait for
    holding: str | None = None
    holding_s: float | None = None
    last_round: dict | None = None
    versions: dict[str, int] = field(default_factory=dict)

    @property
    def seconds_per_step(self) -> float | None:
        return self.train_seconds / self.steps if self.steps else None

    def to_dict(self) -> dict:
        return {**asdict(self), "seconds_per_step": self.seconds_per_step}


class ShareBudget:
    """The learner's floor of CPU while serving is busy (``BackgroundConfig.min_share``).

    A bucket: it fills by ``share`` CPU seconds per wall second that serving is busy (at most
    ``burst_s``) and empties by the CPU the learner's thread uses while it runs against live
    requests. :meth:`hold` is asked from the learner thread (``cpu`` defaults to
    ``time.thread_time``: that thread's CPU), before a round and between two pieces of a step.
    Time when serving is idle is neither earned nor charged: the learner runs freely then."""

    def __init__(self, share: float, burst_s: float, wall: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.thread_time):
        self.share, self.burst_s, self._wall, self._cpu = share, burst_s, wall, cpu
        self.credit = 0.0
        self.used_s = 0.0  # CPU seconds the learner has trained against live requests, in all
        self._at: tuple[float, float] | None = None  # (wall, cpu) at the last look
        self._against = False  # since the last look the learner was let run against traffic

    def hold(self, busy: bool) -> bool:
        """True: hold the learner back now (serving is busy and the share is spent)."""
        wall, cpu = self._wall(), self._cpu()
        if self._at is not None:
            if self._against:
                self.credit -= cpu - self._at[1]
                self.used_s += cpu - self._at[1]
            if busy:
                self.credit = min(self.credit + self.share * (wall - self._at[0]), self.burst_s)
        self._at = (wall, cpu)
        self._against = busy and self.share > 0 and self.credit > 0
        return busy and not self._against


class LearnerBusy(TimeoutError):
    """An operator's call waited its bound for the learner thread to let go of ``exclusive``; the
    message says what the thread was doing and for how long. Retryable."""


class BackgroundLearner:
    """Runs ``learner`` in a daemon thread; see the module docstring."""

    def __init__(
        self,
        learner: OnlineLearner,
        subscribers: Sequence[Callable[[dict, int], Any]] | dict[str, Sequence[Callable]] = (),
        busy: Callable[[], bool] | None = None,
        cfg: BackgroundConfig = BackgroundConfig(),
        on_round: Callable[[RoundReport], Any] | None = None,
        store_on_submit: bool = False,
        between_rounds: Callable[[], Any] | None = None,
    ):
        self.learner = learner
        self.subscribers = subscribers
        self.busy = busy if busy is not None else (lambda: False)
        self.cfg = cfg
        self.on_round = on_round  # every finished round's report (metrics), from the learner thread
        #: store each record in the caller's thread before :meth:`submit` returns (durable when the
        #: shards are on disk); the learner thread then only counts it. False: both in the thread
        self.store_on_submit = store_on_submit
        #: housekeeping in the learner thread after every look for a round, holding ``exclusive``
        #: (e.g. taking idle drafts out of memory: never in the middle of a round)
        self.between_rounds = between_rounds
        self._queue: queue.Queue[ReplayRecord] = queue.Queue(maxsize=cfg.queue_max)
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = LearnerStats()
        self._lock = threading.Lock()
        #: held while a round trains: whoever changes a draft's weights from another thread (an
        #: operator's rollback) takes it, so a round never sees its weights change under it
        self.exclusive = threading.RLock()
        self._interrupts = 0  # callers waiting for, or holding, exclusive through interrupt()
        self._native_id: int | None = None  # the learner thread's id for the OS (its niceness)
        self._holding: tuple[str, float] | None = None  # what the learner thread holds exclusive for, since when
        self._interrupts_lock = threading.Lock()
        self.error: BaseException | None = None
        #: asked only from the learner thread (its CPU clock is that thread's)
        self._share = ShareBudget(cfg.min_share, cfg.share_burst_s)
        learner.should_yield = self._should_yield
        learner.pause = self._wait_while_busy
        learner.waiting = self._queue.qsize

    # -- serving side ---------------------------------------------------------------------------
    def submit(self, record: ReplayRecord) -> bool:
        """Hand a finished request's record to the learner. False if it was dropped (a full queue).

        Never blocks on training; with ``store_on_submit`` it writes the record to its shard first
        (a flushed append), and a full queue then loses only the record's traffic count."""
        if self.store_on_submit:
            self.learner.store(record)
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            if self.store_on_submit:
                log.warning("learner queue full: a stored record's traffic is not counted")
                return True
            with self._lock:
                self._stats.dropped += 1
            return False

    def forget_queued(self, predicate) -> int:
        """Drop the records still waiting in the hand-over queue for which ``predicate`` is true."""
        kept, dropped = [], 0
        while True:
            try:
                rec = self._queue.get_nowait()
            except queue.Empty:
                break
            if predicate(rec):
                dropped += 1
            else:
                kept.append(rec)
        for rec in kept:
            self._queue.put_nowait(rec)
        return dropped

    def start(self) -> "BackgroundLearner":
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="osd-learner", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the step in flight; records still queued are observed first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._drain()

    def pause(self) -> None:
        """Stop training (records are still observed) until :meth:`resume`."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    @contextlib.contextmanager
    def interrupt(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold ``exclusive`` without waiting out a long round: the round in flight ends at its next
        step (or while it waits for traffic to pass), goes to the gate as any round stopped early, and
        no round starts while a caller waits for the lock or holds it. For an operator's calls: after
        ``timeout_s`` (None: no bound) without the lock, :class:`LearnerBusy` names what holds it."""
        with self._interrupts_lock:
            self._interrupts += 1
            if self._interrupts == 1:
                self._renice(0)  # a nice-19 thread on a busy machine would take minutes to reach its next step
        try:
            if not self.exclusive.acquire(timeout=-1 if timeout_s is None else timeout_s):
                what, since = self._holding or ("between two holds", time.monotonic())
                log.warning("an operator's call gave up after %g s; the learner thread (%s) is at:\n%s", timeout_s, what,
                            self._stack())
                raise LearnerBusy(f"the learner thread has been busy for {time.monotonic() - since:.0f} s ({what}); "
                                  f"waited {timeout_s:g} s, retry later")
            try:
                yield
            finally:
                self.exclusive.release()
        finally:
            with self._interrupts_lock:
                self._interrupts -= 1
                if self._interrupts == 0:
                    self._renice(self.cfg.nice)

    def _renice(self, nice: int) -> None:
        """The learner thread's niceness, from another thread (Linux: a thread id is a process id to
        setpriority). Lowering it needs CAP_SYS_NICE: without, the caller just waits longer."""
        tid = self._native_id
        if tid is None:  # not started yet
            return
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (AttributeError, OSError) as e:  # not Linux, not allowed, or the thread has ended
            log.debug("learner thread: could not set nice %d (%s)", nice, e)

    def _stack(self) -> str:
        """Where the learner thread is now (for the log of a call that waited too long for it)."""
        frame = sys._current_frames().get(self._thread.ident) if self._thread is not None and self._thread.ident else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)"

    @contextlib.contextmanager
    def _held(self, what: str) -> Iterator[None]:
        """``exclusive`` from the learner thread, saying what for (an operator who waits too long is told)."""
        with self.exclusive:
            self._holding = (what, time.monotonic())
            try:
                yield
            finally:
                self._holding = None

    def stats(self) -> LearnerStats:
        with self._lock:
            s = replace(self._stats)
        s.queue_depth = self._queue.qsize()
        s.against_traffic_s = self._share.used_s
        s.running = self._thread is not None and self._thread.is_alive()
        s.paused = self._paused.is_set()
        s.training = self.learner.training
        held = self._holding
        if held is not None:
            s.holding, s.holding_s = held[0], round(time.monotonic() - held[1], 3)
        s.versions = {d: t.version for d, t in self.learner.trainers.items()}
        return s

    def __enter__(self) -> "BackgroundLearner":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- learner thread ------------------------------------------------------------------------
    def _busy(self) -> bool:
        """Hold training back: serving is busy, and the learner's floor share is spent."""
        return self._share.hold(self.cfg.yield_to_requests and bool(self.busy()))

    def _should_yield(self) -> bool:
        """End the round now: stopping, paused by the operator, or an operator's call waiting (interrupt)."""
        return self._stop.is_set() or self._paused.is_set() or self._interrupts > 0

    def _wait_while_busy(self) -> None:
        """Inside a step, between two pieces: hold the CPU back while a request is live."""
        while self._busy() and not self._should_yield():
            time.sleep(self.cfg.poll_s)

    def _drain(self) -> int:
        n = 0
        while True:
            try:
                rec = self._queue.get_nowait()
            except queue.Empty:
                break
            (self.learner.count if self.store_on_submit else self.learner.observe)(rec)
            n += 1
        if n:
            with self._lock:
                self._stats.observed += n
        return n

    def _housekeeping(self) -> None:
        if self.between_rounds is not None:
            with self._held("housekeeping between rounds"):
                self.between_rounds()

    def _run(self) -> None:
        try:
            self._native_id = threading.get_native_id()
            if self.cfg.nice:
                os.setpriority(os.PRIO_PROCESS, self._native_id, self.cfg.nice)
        except (AttributeError, OSError) as e:  # not Linux, or not allowed: run at normal priority
            log.warning("learner thread: could not set nice %d (%s)", self.cfg.nice, e)
        torch.set_num_threads(self.cfg.threads)  # per calling thread (OpenMP); serving keeps its own
        while not self._stop.is_set():
            try:
                self._drain()
                if self.learner.live.watching():  # a version serving worse than the one before goes back
                    with self._held("checking a new version's live acceptance"):
                        self.learner.check_live(self.subscribers)
                if self._should_yield() or self._busy():  # paused or serving: no round, housekeeping still
                    self._housekeeping()
                    time.sleep(self.cfg.poll_s)
                    continue
                with self._held("a round, its gate and its publish"):
                    rep = self.learner.maybe_train(self.subscribers)
                self._housekeeping()
                if rep is None:
                    time.sleep(self.cfg.poll_s)
                else:
                    self._count(rep)
            except Exception as e:  # one failed round (its weights restored) must not end learning
                self.error = e
                with self._lock:
                    self._stats.errors += 1
                log.exception("learner round failed; the learner goes on")
                time.sleep(self.cfg.poll_s)
            except BaseException as e:  # interpreter shutdown and the like: stop, keep serving
                self.error = e
                log.exception("learner thread stopped")
                return

    def _count(self, rep: RoundReport) -> None:
        with self._lock:
            s = self._stats
            s.rounds += 1
            s.steps += rep.steps
            s.train_seconds += rep.train_seconds
            s.published += int(rep.version is not None)
            s.rejected += int(rep.steps > 0 and not rep.accepted)
            s.yielded_rounds += int(rep.stopped_early)
            s.cut_rounds += int(rep.cut_short)
            s.last_round = rep.to_dict()
        if self.on_round is not None:
            self.on_round(rep)
