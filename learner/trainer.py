"""The online learner core: distil each draft from the replay shards while serving (Ray-free).

* :class:`DraftTrainer` - one per draft. Holds a *training copy* of the draft (never the serving
  model), its AdamW optimiser, ``keep_ids``, the version counter and the held-back records of the
  gate. :meth:`DraftTrainer.train_round` runs a few steps, each on a batch of replay records (the maths
  is :mod:`learner.offline`'s: records -> :class:`learner.offline.Sample` via ``to_sample()``,
  :func:`learner.offline.draft_loss`, :func:`learner.offline.to_student_space`), then :meth:`DraftTrainer.gate` decides; a failing
  candidate is discarded (pre-round weights and optimiser state restored) and logged.
  :meth:`DraftTrainer.publish` bumps the version, checkpoints atomically
  (``checkpoint_dir/<draft_id>/v<version>`` + an atomically replaced ``LATEST`` file) and returns
  the state dict as numpy arrays (what an object store carries to the serving engines).
* :class:`OnlineLearner` - holds a :class:`learner.replay.ShardSet` and the trainers. ``observe``
  routes records to the shards (or, a ``holdout_fraction`` of them, to the trainer's held-back
  set) and keeps per-draft traffic / lost-acceptance counts over a recent window; ``maybe_train``
  runs one round every ``train_every`` records on the draft with the most rows served since its
  own last round x (1 - acceptance), every step on a fresh batch from its shard (``resample``),
  and hands accepted weights to the subscribers (e.g. ``engine.swap_draft``).

The learner never blocks a request: ``should_yield()`` is checked before every training step and
the round stops as soon as it returns True; ``max_cpu_share`` sleeps between steps so training
uses at most that share of wall time.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import random
import threading
import time
from collections import defaultdict, deque
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from speculative.adapters import (adapter_parameters, adapter_state, add_adapters, has_adapters, load_state, share_base,
                                  takes_adapters)
from config.learner import LearnerConfig
from learner.checkpoints import DraftCheckpoints, all_finite, draft_folder
from learner.live import LiveWatch, Verdict
from learner.losses import SparseDist, get_loss
from learner.offline import (Sample, draft_loss, set_trainable, to_student_space, top1_hits_on,
                             with_prompt_positions)
from learner.replay import ReplayRecord, ShardConfig, ShardSet

__all__ = ["LearnerConfig", "RoundReport", "DraftTrainer", "OnlineLearner", "records_to_batch"]

log = logging.getLogger(__name__)



@dataclass
class RoundReport:
    draft_id: str
    steps: int = 0
    loss_before: float | None = None
    loss_after: float | None = None
    seconds: float = 0.0  # the whole round: batch, steps, gate
    train_seconds: float = 0.0  # optimiser steps only (forward + backward + update)
    records: int = 0
    positions: int = 0  # trained rows per step
    stopped_early: bool = False  # should_yield stopped the round
    cut_short: bool = False  # ended after min_steps_per_round: the next round was due
    accepted: bool = False
    reason: str = ""
    agreement_before: float | None = None  # held-out top-1 agreement, pre-round weights
    agreement_after: float | None = None
    version: int | None = None  # published version (set by OnlineLearner on success)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Records -> training batch
# ---------------------------------------------------------------------------------------------


def in_window(s: Sample, context_tokens: int | None) -> Sample:
    """``s`` with only its last ``context_tokens`` prompt tokens (the window the served draft reads:
    ``engine.draft.context_tokens``); the output and its rows are unchanged. A sample with
    features, or a prompt within the window, comes back as it is."""
    cut = s.prompt_len - context_tokens if context_tokens else 0
    if cut <= 0 or s.features is not None:
        return s
    return dataclasses.replace(s, tokens=s.tokens[cut:], prompt_len=s.prompt_len - cut)


def records_to_batch(records: Iterable[ReplayRecord], positions: str = "all",
                     prompt_head: torch.nn.Module | None = None,
                     context_tokens: int | None = None) -> tuple[list[Sample], torch.Tensor]:
    """Samples (``to_sample()``, cut to ``context_tokens`` prompt tokens: :func:`in_window`) and
    the row mask over their concatenated output rows.

    ``positions="wrong"`` keeps the rows where ``draft_wrong``; ``"all"`` every row. Records that
    cannot become a Sample (no row inside the sequence, non-contiguous rows) are skipped.
    ``prompt_head`` (the target's head): records with features get rows for their prompt
    positions from 2 on too (:func:`learner.offline.with_prompt_positions`), all of them kept.
    """
    samples, masks = [], []
    for rec in records:
        try:
            s = in_window(rec.to_sample(), context_tokens)
        except ValueError:  # to_sample refuses a record with no row inside the sequence
            continue
        if positions == "wrong":
            m = rec.draft_wrong[rec.positions < rec.tokens.shape[0]]
        else:
            m = torch.ones(s.n_out, dtype=torch.bool)
        if prompt_head is not None and s.features is not None:
            n_out = s.n_out
            (s,) = with_prompt_positions([s], prompt_head, 2)
            m = torch.cat([torch.ones(s.n_out - n_out, dtype=torch.bool), m])  # the prompt's rows first
        samples.append(s)
        masks.append(m)
    mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
    return _same_width(samples), mask


#: ids of the columns that widen a narrower record's rows: above every vocabulary, so that they
#: become placeholder columns (probability 0, no logit) and the loss is the loss without them
PAD_ID = 1 << 30


def _same_width(samples: list[Sample]) -> list[Sample]:
    """Records written with different top-K (a config change, another replica) in one batch:
    the narrower rows get distinct ``PAD_ID + r`` columns of probability 0."""
    width = max((s.ids.shape[1] for s in samples), default=0)
    out = []
    for s in samples:
        pad = width - s.ids.shape[1]
        if pad:
            rows = s.ids.shape[0]
            extra = (PAD_ID + torch.arange(pad, dtype=s.ids.dtype)).expand(rows, pad)
            s = dataclasses.replace(s, ids=torch.cat([s.ids, extra], 1), probs=torch.cat([s.probs, s.probs.new_zeros(rows, pad)], 1))
        out.append(s)
    return out


def _state_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().clone().numpy() for k, v in model.state_dict().items()}


def _rate(hits: torch.Tensor) -> float | None:
    """Share of True in ``hits`` (None when empty)."""
    return float(hits.float().mean()) if hits.numel() else None


# ---------------------------------------------------------------------------------------------
# One draft
# ---------------------------------------------------------------------------------------------


class DraftTrainer:
    """Training copy + optimiser + versions + checkpoints of one draft.

    ``draft`` is deep-copied: the serving model is never touched (it gets weights through
    :meth:`publish` and a subscriber). ``version`` is the version of the weights currently
    accepted (0 = the initial draft). With ``cfg.checkpoint_dir`` set, the constructor reloads
    the latest checkpoint (:meth:`load_latest`) or, when there is none, saves the initial weights
    as ``v<version>``, with ``origin`` (where the initial weights came from) in its meta.
    """

    def __init__(
        self,
        draft_id: str,
        draft: torch.nn.Module,
        cfg: LearnerConfig = LearnerConfig(),
        keep_ids: torch.Tensor | None = None,
        version: int = 0,
        target_head: torch.nn.Module | None = None,
        origin: dict | None = None,
    ):
        self.draft_id = draft_id
        self.cfg = cfg
        if cfg.prompt_positions and target_head is None:
            raise ValueError("prompt_positions: the trainer needs the target's head (target_head)")
        # what prompt rows are read with (only for records that carry features)
        self.prompt_head = target_head if cfg.prompt_positions else None
        if cfg.adapter_rank and not has_adapters(draft) and not takes_adapters(draft):
            log.warning("draft %s (%s) takes no adapters: its learner trains the whole draft", draft_id,
                        type(draft).__name__)
            cfg = self.cfg = cfg.model_copy(update={"adapter_rank": 0})
        if cfg.adapter_rank or has_adapters(draft):
            # adapters alone learn: the copy shares the base's frozen tensors with ``draft`` (and with
            # every other trainer made from it), and owns only its adapters
            self.model = share_base(draft).eval()
            if not has_adapters(self.model):
                add_adapters(self.model, cfg.adapter_rank)
        else:
            self.model = copy.deepcopy(draft).eval()  # the training copy; the serving model is never touched
        self.params = adapter_parameters(self.model) if has_adapters(self.model) else set_trainable(self.model, cfg)
        self.keep_ids = keep_ids.to(torch.long).cpu() if keep_ids is not None else None
        n_head = self.model.get_output_embeddings().weight.shape[0]
        if self.keep_ids is not None and len(self.keep_ids) != n_head:
            raise ValueError(f"keep_ids has {len(self.keep_ids)} ids but the draft head has {n_head} rows")
        self.loss_fn = get_loss(cfg.loss, **cfg.loss_options)
        self.opt = self._new_optimizer()
        self.version = int(version)
        self.holdout: deque[ReplayRecord] = deque(maxlen=cfg.holdout_max)
        self.rounds = 0
        self.rejected = 0
        self.history: deque[RoundReport] = deque(maxlen=cfg.keep_reports)  # this draft's newest rounds'
        self.skipped: list[int] = []  # checkpoint versions that did not load (moved aside)
        root = self.ckpt_root
        self.ckpts = DraftCheckpoints(root, draft_id, cfg.keep_versions) if root is not None else None
        if self.ckpts is not None:
            if self.load_latest() is None:
                if self.skipped:  # none loaded: the initial weights, above every version a replica may hold
                    self.version = max(self.skipped) + 1
                self._checkpoint(self.version, {"initial": True, **(origin or {})})

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    # -- held-back records ----------------------------------------------------------------------
    def add_holdout(self, record: ReplayRecord) -> None:
        # replaced, not mutated: a round in another thread may be reading the old one
        self.holdout = deque([*self.holdout, record], maxlen=self.holdout.maxlen)

    def holdout_samples(self) -> list[Sample]:
        return records_to_batch(self.holdout, "all", context_tokens=self.cfg.context_tokens)[0]

    def holdout_hits(self, model: torch.nn.Module | None = None, pause: Callable[[], None] | None = None) -> torch.Tensor:
        """Per held-back position: teacher-forced top-1 agreement with the target. [N] bool. In
        pieces of ``micro_batch_records`` records, ``pause`` (if given) called before each."""
        return top1_hits_on(model if model is not None else self.model, self.holdout_samples(), self.keep_ids,
                            batch_records=self.cfg.micro_batch_records, between=pause)

    def agreement(self, model: torch.nn.Module | None = None) -> float | None:
        """Teacher-forced top-1 agreement on the held-back records (None without any)."""
        return _rate(self.holdout_hits(model))

    # -- training -------------------------------------------------------------------------------
    def _loss(self, samples: Sequence[Sample], mask: torch.Tensor) -> torch.Tensor:
        target = SparseDist(
            ids=torch.cat([s.ids for s in samples]).long()[mask],
            probs=torch.cat([s.probs for s in samples])[mask],
            tail=torch.cat([s.tail for s in samples])[mask],
        )
        n_ph = 0
        if self.keep_ids is not None:
            target, n_ph = to_student_space(target, self.keep_ids)
        elif target.ids.numel() and int(target.ids.max()) >= PAD_ID:  # widened rows (``_same_width``)
            target, n_ph = to_student_space(target, torch.arange(self.model.get_output_embeddings().weight.shape[0]))
        device = next(self.model.parameters()).device
        target = SparseDist(ids=target.ids.to(device), probs=target.probs.to(device), tail=target.tail.to(device))
        loss_fn = self.loss_fn
        if self.cfg.loss == "draft_opd":  # which rows the served draft got wrong, for this batch's rows
            wrong = torch.cat([s.wrong if s.wrong is not None else torch.zeros(s.n_out, dtype=torch.bool)
                               for s in samples])[mask]
            loss_fn = functools.partial(self.loss_fn, wrong=wrong)
        return draft_loss(self.model, samples, loss_fn, target, n_ph, self.cfg.feature_loss, rows=mask)

    @torch.no_grad()
    def _eval_loss(self, samples, mask, pause: Callable[[], None] | None = None) -> float:
        """The loss over all rows of ``mask``, in the training step's pieces (``pause`` before each)."""
        was = self.model.training
        self.model.eval()
        try:
            loss = 0.0
            for part, part_mask, share in self._pieces(samples, mask):
                if pause is not None:
                    pause()
                loss += float(self._loss(part, part_mask)) * share
            return loss
        finally:
            self.model.train(was)

    def _learned_state(self) -> dict[str, torch.Tensor]:
        """What training changes: the adapters, or the whole state."""
        return adapter_state(self.model) if has_adapters(self.model) else self.model.state_dict()

    def snapshot(self) -> tuple[dict, dict]:
        """Deep copies of what training changes (the adapters, or every weight) and the optimiser state."""
        return (
            {k: v.detach().clone() for k, v in self._learned_state().items()},
            copy.deepcopy(self.opt.state_dict()),
        )

    def restore(self, snap: tuple[dict, dict]) -> None:
        weights, opt_state = snap
        self.model.load_state_dict(weights, strict=not has_adapters(self.model))
        self.opt.load_state_dict(copy.deepcopy(opt_state))

    def _pieces(self, samples: Sequence[Sample], mask: torch.Tensor):
        """(samples, row mask, share of the rows) in pieces of ``micro_batch_records`` samples (one
        piece without it); pieces without a row of ``mask`` are left out. The mean over all rows is
        the sum of the pieces' means weighted by their shares."""
        n, total = self.cfg.micro_batch_records or len(samples), int(mask.sum())
        offsets = [0]
        for smp in samples:
            offsets.append(offsets[-1] + smp.n_out)
        for i in range(0, len(samples), n):
            j = min(i + n, len(samples))
            part_mask = mask[offsets[i]:offsets[j]]
            rows = int(part_mask.sum())
            if rows:
                yield samples[i:j], part_mask, rows / total

    def train_round(
        self,
        records: Sequence[ReplayRecord],
        should_yield: Callable[[], bool] | None = None,
        pause: Callable[[], None] | None = None,
        next_batch: Callable[[], Sequence[ReplayRecord]] | None = None,
        next_due: Callable[[], bool] | None = None,
    ) -> RoundReport:
        """Up to ``steps_per_round`` steps, the first on ``records``, then the gate.

        Every later step repeats ``records``, or, with ``next_batch``, trains on a fresh batch
        that it returns (stochastic steps over the replay window: no step re-fits the records of
        the one before). The round's ``loss_before`` / ``loss_after`` are measured on ``records``.

        Returns the report; ``accepted`` is True when the new weights passed the gate (they stay
        in the training copy; call :meth:`publish` to version and ship them). Otherwise the
        pre-round weights and optimiser state are restored. ``pause`` (if given) is called before
        every forward/backward piece of a step and may block, e.g. while requests are live
        (``micro_batch_records`` sets the pieces). ``should_yield`` is checked before
        every step: when it returns True the round stops (a round with 0 steps changes nothing).
        ``next_due`` is asked before every step after ``min_steps_per_round`` of them: when it returns
        True (the next round's records have arrived) the round ends there and goes to the gate.
        """
        cfg = self.cfg
        rep = RoundReport(draft_id=self.draft_id, records=len(records))
        t0 = time.perf_counter()
        # 1. the batch: the records' teacher rows (positions the loss reads)
        samples, mask = records_to_batch(records, cfg.positions, self.prompt_head, cfg.context_tokens)
        rep.positions = int(mask.sum())
        if rep.positions == 0:
            rep.reason = "no trainable rows"
            rep.seconds = time.perf_counter() - t0
            return rep
        if should_yield is not None and should_yield():
            rep.stopped_early, rep.reason = True, "yielded before the first step"
            rep.seconds = time.perf_counter() - t0
            return rep
        # 2. before: a snapshot to restore, the held-back agreement and the batch's loss
        snap = self.snapshot()
        before_hits = self.holdout_hits(pause=pause)
        rep.agreement_before = _rate(before_hits)
        rep.loss_before = self._eval_loss(samples, mask, pause)
        # 3. the steps: each a forward/backward in pieces (pausing while requests are live), one
        #    optimiser step, then a sleep that keeps training within max_cpu_share
        self.model.train()
        try:
            for i in range(cfg.steps_per_round):
                if i > 0 and should_yield is not None and should_yield():
                    rep.stopped_early = True
                    break
                if cfg.min_steps_per_round is not None and rep.steps >= cfg.min_steps_per_round \
                        and next_due is not None and next_due():
                    rep.cut_short = True
                    break
                ts = time.perf_counter()
                self.opt.zero_grad(set_to_none=True)
                step_samples, step_mask = (samples, mask) if i == 0 or next_batch is None else records_to_batch(next_batch(), cfg.positions, self.prompt_head, cfg.context_tokens)
                if not bool(step_mask.any()):
                    continue
                for part, part_mask, share in self._pieces(step_samples, step_mask):
                    if pause is not None:
                        t_wait = time.perf_counter()
                        pause()
                        ts += time.perf_counter() - t_wait  # waiting is not training time
                    (self._loss(part, part_mask) * share).backward()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
                self.opt.step()
                rep.steps += 1
                rep.train_seconds += time.perf_counter() - ts
                if cfg.max_cpu_share < 1.0 and i + 1 < cfg.steps_per_round:
                    self._pause((time.perf_counter() - ts) * (1.0 / cfg.max_cpu_share - 1.0), should_yield)
        except Exception:
            self.restore(snap)
            self.model.eval()
            raise
        self.model.eval()
        # 4. after: the batch's loss again, and the gate on the held-back agreement; a rejected
        #    candidate gives the snapshot back
        rep.loss_after = self._eval_loss(samples, mask, pause)
        ok, reason = self.gate(baseline=rep.agreement_before, loss=rep.loss_after, baseline_hits=before_hits, pause=pause)
        rep.agreement_after = self._last_gate_agreement
        rep.accepted, rep.reason = ok, reason if not rep.stopped_early else f"{reason}; stopped early (yield)"
        if not ok:
            self.restore(snap)
            self.rejected += 1
            log.warning("draft %r: candidate rejected (%s); weights of v%d restored", self.draft_id, reason, self.version)
        self.rounds += 1
        rep.seconds = time.perf_counter() - t0
        self.history.append(rep)
        return rep

    @staticmethod
    def _pause(seconds: float, should_yield: Callable[[], bool] | None) -> None:
        end = time.perf_counter() + seconds
        while True:
            left = end - time.perf_counter()
            if left <= 0 or (should_yield is not None and should_yield()):
                return
            time.sleep(min(left, 0.01))

    # -- gate -------------------------------------------------------------------------------------
    _last_gate_agreement: float | None = None

    def gate(
        self,
        candidate: torch.nn.Module | dict | None = None,
        baseline: float | None = None,
        loss: float | None = None,
        baseline_hits: torch.Tensor | None = None,
        pause: Callable[[], None] | None = None,
    ) -> tuple[bool, str]:
        """Whether ``candidate`` may replace the current weights: ``(ok, reason)``.

        ``candidate``: a model, a state dict (tensors or numpy arrays; loaded into a scratch copy)
        or None (the training copy). Fails on any NaN/Inf parameter (or a non-finite ``loss``), and
        when its top-1 agreement on the held-back records is below ``baseline - gate_margin``;
        ``baseline`` defaults to the agreement of the training copy (meaningful when the candidate
        is a separate model / state). Without held-back records only the finiteness checks apply.

        With ``gate_z > 0`` and the current weights' per-position hits (``baseline_hits``, what
        :meth:`holdout_hits` returned for them), the test is paired: with ``b`` positions only the
        candidate gets right and ``c`` only the current weights do, out of ``n``, the candidate
        fails when ``(b - c) / n < -(gate_margin + gate_z * sqrt(b + c) / n)``, i.e. only a drop
        larger than the margin by ``gate_z`` standard errors (McNemar) rejects it.
        """
        self._last_gate_agreement = None
        if candidate is None:
            model = self.model
        elif isinstance(candidate, dict):
            model = share_base(self.model)  # the candidate's tensors take their places in the copy
            load_state(model, {k: torch.as_tensor(v) for k, v in candidate.items()})
        else:
            model = candidate
        if not all_finite(model.parameters()):
            return False, "non-finite parameter"
        if loss is not None and not math.isfinite(loss):
            return False, "non-finite loss"
        if baseline is None and model is not self.model:
            baseline = self.agreement()
        hits = self.holdout_hits(model, pause=pause)
        got = _rate(hits)
        self._last_gate_agreement = got
        if got is None or baseline is None:
            return True, "ok (no held-out records)"
        if self.cfg.gate_z > 0 and baseline_hits is not None and baseline_hits.shape == hits.shape:
            n = hits.numel()
            b, c = int((hits & ~baseline_hits).sum()), int((baseline_hits & ~hits).sum())
            bound = self.cfg.gate_margin + self.cfg.gate_z * math.sqrt(b + c) / n
            if (b - c) / n < -bound:
                return False, f"held-out agreement {got:.4f} vs {baseline:.4f}: paired drop {(c - b) / n:.4f} > {bound:.4f}"
            return True, f"ok (held-out agreement {baseline:.4f} -> {got:.4f}, paired bound {bound:.4f})"
        if got < baseline - self.cfg.gate_margin:
            return False, f"held-out agreement {got:.4f} < {baseline:.4f} - margin {self.cfg.gate_margin}"
        return True, f"ok (held-out agreement {baseline:.4f} -> {got:.4f})"

    # -- versions and checkpoints ----------------------------------------------------------------
    @property
    def ckpt_root(self) -> Path | None:
        return Path(self.cfg.checkpoint_dir) / draft_folder(self.draft_id) if self.cfg.checkpoint_dir is not None else None

    def state(self) -> dict[str, np.ndarray]:
        """The training copy's state dict as numpy arrays: its adapters alone when it learns adapters
        (the base never changes: a version is about 1% of the draft)."""
        if has_adapters(self.model):
            return {k: v.detach().cpu().clone().numpy() for k, v in adapter_state(self.model).items()}
        return _state_numpy(self.model)

    def publish(self) -> tuple[int, dict[str, np.ndarray]]:
        """Bump the version, checkpoint it, return ``(version, {name: numpy array})``."""
        self.version += 1
        self._checkpoint(self.version)
        return self.version, self.state()

    def versions(self) -> list[int]:
        """Checkpointed versions, ascending."""
        return self.ckpts.versions() if self.ckpts is not None else []

    def latest_version(self) -> int | None:
        return self.ckpts.latest() if self.ckpts is not None else None

    def _checkpoint(self, version: int, meta: dict | None = None) -> None:
        if self.ckpts is not None:
            self.ckpts.save(self.model, version, self.keep_ids, meta)

    def _load_version(self, version: int) -> None:
        """Load checkpoint ``version`` into the training copy (:meth:`DraftCheckpoints.load_into`)."""
        if self.ckpts is None:
            raise RuntimeError("no checkpoint_dir configured")
        self.keep_ids = self.ckpts.load_into(self.model, version, self.keep_ids)
        self.opt = self._new_optimizer()  # the optimiser state belongs to other weights

    def load_latest(self) -> int | None:
        """Load the newest checkpoint that reads back whole (:meth:`DraftCheckpoints.load_newest`:
        unreadable ones moved aside, the newest good weights served above them); None if there is none."""
        if self.ckpts is None:
            self.skipped = []
            return None
        version, self.skipped, self.keep_ids = self.ckpts.load_newest(self.model, self.keep_ids)
        if version is None:
            return None
        self.version = version
        self.opt = self._new_optimizer()
        return version

    def rollback(self, version: int) -> tuple[int, dict[str, np.ndarray]]:
        """Restore the weights of checkpoint ``version`` and re-publish them under a NEW version
        (versions stay monotonic for the serving side and the replay records). Returns
        ``(new version, state)`` to hand to the subscribers."""
        self._load_version(version)
        self.version = max([self.version, *self.versions()]) + 1
        self._checkpoint(self.version, {"rolled_back_from": version})
        log.warning("draft %r: rolled back to the weights of v%d, published as v%d", self.draft_id, version, self.version)
        return self.version, self.state()


# ---------------------------------------------------------------------------------------------
# All drafts
# ---------------------------------------------------------------------------------------------


def _subscribers_of(subscribers, draft_id: str) -> Sequence[Callable]:
    return subscribers.get(draft_id, ()) if isinstance(subscribers, dict) else subscribers


class OnlineLearner:
    """Replay shards + one :class:`DraftTrainer` per draft; decides when and what to train."""

    def __init__(
        self,
        cfg: LearnerConfig,
        shards: ShardSet | ShardConfig | None = None,
        trainers: Iterable[DraftTrainer] = (),
        should_yield: Callable[[], bool] | None = None,
        pause: Callable[[], None] | None = None,
        open_drafts: Iterable[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.live = LiveWatch(cfg.live_rollback, clock)  # each newest publish's served acceptance
        if shards is None:
            shards = ShardConfig()
        # the shards already on disk are reopened now (a restart trains on, and deletes from, them):
        # every one, or those of ``open_drafts`` (the others when their draft comes back)
        self.shards = shards if isinstance(shards, ShardSet) else ShardSet.open(shards, open_drafts)
        #: the trainers' held-back records, persisted beside the shards (``<dir>/holdout``) when
        #: the shards are: a restarted learner gates against the same records
        scfg = self.shards.cfg
        self.holdouts = ShardSet.open(scfg.model_copy(update={
            "dir": scfg.dir / "holdout" if scfg.dir is not None else None,
            "eviction": "fifo", "max_records": cfg.holdout_max}), open_drafts)
        self._store_lock = threading.RLock()  # a record stored, or a shard closed (park, remove_trainer)
        self.trainers: dict[str, DraftTrainer] = {}
        for t in trainers:
            self.add_trainer(t)
        self.should_yield = should_yield
        self.pause = pause
        #: records handed over but not counted yet (a background learner's queue): with them the
        #: next round may be due while this one trains (``cfg.min_steps_per_round``)
        self.waiting: Callable[[], int] = lambda: 0
        self._recent: dict[str, deque[tuple[int, int, int]]] = {}  # (rows, proposed rows, wrong proposed rows)
        self._since = 0
        self._pending: defaultdict[str, int] = defaultdict(int)  # rows observed per draft since its last round
        self._rng = random.Random(f"holdout:{cfg.seed}")
        self.observed = 0
        self.reports: deque[RoundReport] = deque(maxlen=cfg.keep_reports)  # the newest rounds'
        self.training: str | None = None  # the draft whose round is running

    def add_trainer(self, trainer: DraftTrainer) -> DraftTrainer:
        d = trainer.draft_id
        if not trainer.holdout and (d in self.holdouts or d in self.holdouts.logged()):  # a restart, or parked
            trainer.holdout = deque(self.holdouts[d].records(), maxlen=trainer.holdout.maxlen)
        self.trainers[d] = trainer
        return trainer

    def park(self, draft_id: str) -> None:
        """Take an idle draft out of memory: its trainer (its checkpoints stay on disk), replay shard
        and held-back records (their logs stay on disk). Its next record reopens the shard; a
        trainer reloaded from its checkpoints (``add_trainer``) takes its held-back records back.
        Call it between rounds; only for shards kept on disk."""
        if self.shards.cfg.dir is None:
            raise ValueError("parking a draft needs its shards on disk (ShardConfig.dir)")
        with self._store_lock:  # no record is being stored in the shards closed here
            self.remove_trainer(draft_id, drop_shard=False)
            self.shards.drop(draft_id, delete=False)
            self.holdouts.drop(draft_id, delete=False)

    def remove_trainer(self, draft_id: str, drop_shard: bool = True) -> None:
        """A retired draft: forget its trainer, traffic window and (``drop_shard``) replay shard and
        held-back records, their logs deleted (open or not)."""
        with self._store_lock:  # no record is being stored in a shard closed here
            self.trainers.pop(draft_id, None)
            self.live.forget(draft_id)
            self._recent.pop(draft_id, None)
            self._pending.pop(draft_id, None)
            if drop_shard:
                self.shards.drop(draft_id)
                self.holdouts.drop(draft_id)

    # -- traffic ----------------------------------------------------------------------------------
    def observe(self, record: ReplayRecord) -> None:
        """Store the record (shard or held-back set), then count its traffic and lost acceptance."""
        self.store(record)
        self.count(record)

    def store(self, record: ReplayRecord) -> str:
        """Keep the record: in its draft's replay shard, or (a ``holdout_fraction`` of the teacher
        records of a draft with a trainer) among the trainer's held-back records. With the shards on
        disk it is written and flushed before this returns (a killed process loses nothing stored).
        Thread-safe beside a round in another thread. Returns ``"shard"`` or ``"holdout"``."""
        with self._store_lock:
            trainer = self.trainers.get(record.draft_id)
            if trainer is not None and record.context == "teacher" and self._rng.random() < self.cfg.holdout_fraction:
                self.holdouts.append(record)
                trainer.add_holdout(record)
                return "holdout"
            self.shards.append(record)
            return "shard"

    def count(self, record: ReplayRecord) -> None:
        """The record's traffic and lost acceptance (what picks the next draft to train, and when)."""
        d = record.draft_id
        proposed = record.proposed
        wrong = int((record.draft_wrong & proposed).sum())
        self._recent.setdefault(d, deque(maxlen=self.cfg.window)).append((record.n_rows, int(proposed.sum()), wrong))
        if record.context == "teacher":  # as served
            self.live.observe(d, record.draft_version, int(proposed.sum()), int(proposed.sum()) - wrong)
        self.observed += 1
        self._since += 1
        self._pending[d] += record.n_rows

    def traffic(self, draft_id: str) -> dict:
        """Over the recent window: rows (traffic), proposed rows, acceptance."""
        rows = proposed = wrong = 0
        for r, p, w in self._recent.get(draft_id, ()):
            rows, proposed, wrong = rows + r, proposed + p, wrong + w
        acceptance = (proposed - wrong) / proposed if proposed else 0.0
        return {"rows": rows, "proposed": proposed, "acceptance": acceptance}

    def pick_draft(self) -> str | None:
        """The trainable draft (trainer + non-empty shard) with the most lost acceptance still to
        learn from: rows it served since its own last round x (1 - its recent acceptance).

        Counting only the rows since a draft's last round, not all its recent traffic, keeps the
        busiest draft from taking every round: a draft just trained waits until new traffic
        arrives, and the others, forked drafts with little traffic too, get their turn."""
        best, best_score = None, -1.0
        for d in list(self.trainers):  # a copy: another thread may add a trainer meanwhile
            if d not in self.shards or len(self.shards[d]) == 0:
                continue
            score = self._pending[d] * (1.0 - self.traffic(d)["acceptance"])
            if score > best_score:
                best, best_score = d, score
        return best

    # -- training ---------------------------------------------------------------------------------
    def maybe_train(self, subscribers: Sequence[Callable[[dict, int], Any]] | dict[str, Sequence[Callable]] = (), force: bool = False) -> RoundReport | None:
        """Every ``train_every`` observed records (or when ``force``): one round on the picked
        draft; on success publish and call each subscriber with ``(state, version)``.

        ``subscribers``: callables for every draft, or a dict draft id -> callables.
        Returns the round's report, or None when no round ran.
        """
        if not force and self._since < self.cfg.train_every:
            return None
        if self.should_yield is not None and self.should_yield():
            return None  # keep the count: train at the next quiet moment
        self._since = 0
        d = self.pick_draft()
        if d is None:
            return None
        trainer = self.trainers[d]
        self._pending[d] = 0
        shard, n = self.shards[d], self.cfg.batch_records
        self.training = d
        try:
            rep = trainer.train_round(shard.sample(n), self.should_yield, self.pause,
                                      next_batch=(lambda: shard.sample(n)) if self.cfg.resample else None,
                                      next_due=lambda: self._since + self.waiting() >= self.cfg.train_every)
        finally:
            self.training = None
        if rep.accepted and rep.steps > 0:
            served = trainer.version
            version, state = trainer.publish()
            rep.version = version
            for sub in _subscribers_of(subscribers, d):
                sub(state, version)
            self.live.published(d, version, served)
        self.reports.append(rep)
        return rep

    def check_live(self, subscribers: Sequence[Callable[[dict, int], Any]] | dict[str, Sequence[Callable]] = ()
                   ) -> list[Verdict]:
        """Roll back each watched version that serves worse than the one it replaced
        (:class:`learner.live.LiveWatch`): the old weights are republished under a new version and
        handed to the subscribers. A draft that moved on meanwhile (a newer version, parked) or
        whose old checkpoint is gone keeps what it has. Returns the verdicts carried out."""
        done = []
        for v in self.live.verdicts():
            t = self.trainers.get(v.draft_id)
            if t is None or t.version != v.version or v.previous not in t.versions():
                log.warning("draft %r: v%d serves worse than v%d (%.3f < %.3f) but cannot go back to it",
                            v.draft_id, v.version, v.previous, v.acceptance, v.baseline)
                continue
            new, state = t.rollback(v.previous)
            for sub in _subscribers_of(subscribers, v.draft_id):
                sub(state, new)
            self.live.carried_out(v, new)
            log.warning("draft %r: v%d served %.3f acceptance against v%d's %.3f: rolled back (as v%d)",
                        v.draft_id, v.version, v.acceptance, v.previous, v.baseline, new)
            done.append(v)
        return done

    def delete_tenant(self, tenant: str) -> dict[str, int]:
        """Forget every stored record of ``tenant``: replay shards (memory and disk) and the
        trainers' held-back records. Weights already trained on them are not unlearned."""
        held = 0
        for t in list(self.trainers.values()):
            keep = [r for r in t.holdout if r.tenant != tenant]
            held += len(t.holdout) - len(keep)
            t.holdout = deque(keep, maxlen=t.holdout.maxlen)  # replaced, not mutated: a round may be reading it
        self.holdouts.delete_tenant(tenant)
        return {"shards": self.shards.delete_tenant(tenant), "holdout": held}

    def close(self) -> None:
        self.shards.close()
        self.holdouts.close()
