"""Which drafts the learner holds, and how they come and go.

Every cluster and named domain the router gives a draft, and every isolated tenant's copy, is a
draft to the learner, and drafts come and go as traffic shifts. :class:`DraftBook` keeps that
policy in one place, without Ray:

- **make**: a draft's trainer is made the first time the draft is loaded or sends a record: from
  its checkpoints (a restart), else from its domain's starting draft, else **forked** from what its
  parent (the general draft of its tenant scope, ``config.draft_ids.fork_parent``) has published;
- **park**: between rounds, beyond ``max_drafts`` in memory the least recently used draft (never
  the general one), and every draft the router retired, leaves memory; its checkpoints and replay
  logs stay on disk and it comes back when used again;
- **forget**: beyond ``max_parked`` parked drafts the least recently checkpointed one is deleted;
- **publish**: what the pool serves of each draft (the latest published weights, never the
  training copy a round is changing) and the transport out.

The learner deployment (``deployments/learner.py``) adds Ray around it; tests use it directly.
"""

from __future__ import annotations

import functools
import logging
import shutil
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Protocol
from urllib.parse import unquote

import torch

from config.draft_ids import GENERAL, fork_parent, start_domain
from config.learner import LearnerConfig
from speculative.adapters import load_state, share_base

from .checkpoints import LATEST, draft_folder
from .trainer import DraftTrainer, OnlineLearner

log = logging.getLogger("osd.learner")

#: publish(draft_id, state, version): the transport to the draft pool
Publish = Callable[[str, dict, int], None]


class Counts(Protocol):
    """What the book reports to (a ``telemetry`` meter)."""

    def inc(self, name: str, value: float = 1.0, **labels) -> None: ...

    def event(self, kind: str, **fields) -> None: ...


def _mtime(folder: Path) -> float:
    """When a draft's checkpoints last changed (its LATEST pointer, else the folder)."""
    latest = folder / LATEST
    return (latest if latest.exists() else folder).stat().st_mtime


def known_drafts(ckpt_dir: Path, most: int | None = None) -> list[str]:
    """Drafts with checkpoints, least recently checkpointed first: all, or the newest ``most``
    of them with the general draft always among them (first)."""
    if not ckpt_dir.is_dir():
        return []
    folders = sorted((p for p in ckpt_dir.iterdir() if p.is_dir()), key=lambda p: (_mtime(p), p.name))
    names = [unquote(p.name) for p in folders]
    if most is not None and len(names) > most:
        pinned = [GENERAL] if GENERAL in names else []
        rest = [d for d in names if d != GENERAL]
        names = pinned + rest[len(names) - most :]  # the newest most - len(pinned)
    return names


class DraftBook:
    """The drafts of one learner: their trainers (in ``learner.trainers``), what the pool serves of
    each (``served``), what each was forked from (``forks``), the publish route of each
    (``subscribers``, read by the background learner), and the bounds above.

    ``base``, ``keep_ids``: the configured starting draft; ``starts``: named domains' own starting
    drafts, ``{domain: (model, keep ids)}``; ``target_head``: for trainers that read prompt
    positions with the target's head. Records and loads arrive on several threads: one lock."""

    def __init__(self, learner: OnlineLearner, trainer_cfg: LearnerConfig, base: torch.nn.Module,
                 keep_ids: torch.Tensor | None, starts: dict[str, tuple[torch.nn.Module, torch.Tensor | None]],
                 max_drafts: int, max_parked: int, counts: Counts, publish: Publish | None = None,
                 target_head: torch.nn.Module | None = None):
        if trainer_cfg.checkpoint_dir is None:
            raise ValueError("a draft book parks drafts on disk: the trainer config needs a checkpoint_dir")
        self.learner, self.trainer_cfg = learner, trainer_cfg
        self.ckpt_dir = Path(trainer_cfg.checkpoint_dir)
        self.base, self.keep_ids, self.starts, self.target_head = base, keep_ids, starts, target_head
        self.max_drafts, self.max_parked = max_drafts, max_parked
        self.counts, self.publish_fn = counts, publish
        self.lock = threading.RLock()
        #: draft id -> the weights the pool serves of it (the latest published, or reloaded from its
        #: checkpoints); never the training copy, which a round is changing and may yet reject
        self.served: dict[str, tuple[dict, int]] = {}
        self.forks: dict[str, dict] = {}  # draft id -> the parent (and its version) it started from
        self.subscribers: dict[str, list] = {}  # draft id -> [publish to the pool]; one per trainer
        self.used: OrderedDict[str, None] = OrderedDict()  # drafts in memory, least recently used first
        self.retiring: set[str] = set()  # drafts the router retired, parked at the next look (with tenants' copies)

    # -- make ------------------------------------------------------------------------------------
    def checkpointed(self, draft_id: str) -> bool:
        return (self.ckpt_dir / draft_folder(draft_id)).is_dir()

    def trainer(self, draft_id: str) -> DraftTrainer:
        """The draft's trainer, made the first time the draft is loaded or sends a record: from its
        checkpoints (a restart), else from its domain's starting draft, else forked from what its
        parent (``fork_parent``: the general draft of its tenant scope) has learned so far and
        published, as version 1; a parent with nothing published yet gives the configured draft."""
        with self.lock:
            if draft_id not in self.learner.trainers:
                self.subscribers[draft_id] = [functools.partial(self.publish, draft_id)]
                domain = start_domain(draft_id, self.starts)
                base, keep = self.starts[domain] if domain is not None else (self.base, self.keep_ids)
                extra: dict[str, Any] = {}
                parent = fork_parent(draft_id, self.starts)
                new = not self.checkpointed(draft_id)
                if new and parent is not None and parent not in self.learner.trainers and self.checkpointed(parent):
                    self.trainer(parent)  # a parked parent: back in memory, its published weights with it
                if new and parent in self.served:
                    state, version = self.served[parent]
                    base = share_base(base)  # the parent's adapters on the shared base, or its whole draft
                    load_state(base, {k: torch.as_tensor(v) for k, v in state.items()})
                    extra = {"version": 1, "origin": {"forked_from": parent, "parent_version": version}}
                t = self.learner.add_trainer(DraftTrainer(draft_id, base, self.trainer_cfg, keep_ids=keep,
                                                          target_head=self.target_head, **extra))
                if t.version > 0:  # reloaded (a restart, or parked), or a fork: what the pool serves
                    self.served[draft_id] = (t.state(), t.version)
                if extra:
                    self.forks[draft_id] = {"parent": parent, "parent_version": version}
                    log.info("draft %r: forked from %r v%d, served as v%d", draft_id, parent, version, t.version)
                    self.counts.event("fork", draft=draft_id, parent=parent, parent_version=version, version=t.version)
            self.used[draft_id] = None
            self.used.move_to_end(draft_id)
            return self.learner.trainers[draft_id]

    def latest(self, draft_id: str) -> tuple[dict, int] | None:
        """The weights a replica loading ``draft_id`` serves: its latest published version, or for
        a draft new to the learner its fork of the parent's (its trainer is made now, so that its
        first request is served by the fork); None: the configured starting draft."""
        self.trainer(draft_id)
        return self.served.get(draft_id)

    def publish(self, draft_id: str, state: dict, version: int, kind: str = "publish") -> None:
        log.info("draft %r: publishing v%d", draft_id, version)
        self.served[draft_id] = (state, version)
        self.counts.event(kind, draft=draft_id, version=version)
        if self.publish_fn is not None:
            self.publish_fn(draft_id, state, version)

    # -- park and forget ---------------------------------------------------------------------------
    def parked(self) -> list[str]:
        """Drafts with checkpoints that are not in memory, least recently checkpointed first."""
        return [d for d in known_drafts(self.ckpt_dir) if d not in self.learner.trainers]

    def retire(self, draft_ids: list[str]) -> int:
        """Drafts the router retired (and every tenant's copy of them): out of memory between
        rounds, parked as an idle draft is; a draft used again comes back. Returns how many ids."""
        with self.lock:
            self.retiring |= set(draft_ids)
        return len(draft_ids)

    def park_idle(self) -> None:
        """Between rounds (the learner thread): the drafts the router retired, and while more than
        ``max_drafts`` drafts are in memory the least recently used one (never the general draft),
        leave memory; each comes back from its checkpoints and logs when it is next used."""
        parked = False
        with self.lock:
            retired, self.retiring = self.retiring, set()
            for d in [d for d in self.used if d.partition("@")[0] in retired - {GENERAL}]:
                self._park(d, "retired by the router")
                parked = True
            while len(self.learner.trainers) > self.max_drafts:
                idle = next((d for d in self.used if d != GENERAL and d in self.learner.trainers), None)
                if idle is None:
                    break
                self._park(idle, "idle")
                parked = True
            if parked:  # only parking adds parked drafts
                self.forget_oldest()

    def _park(self, draft_id: str, why: str) -> None:
        self.learner.park(draft_id)
        self.used.pop(draft_id)
        self.served.pop(draft_id, None)  # its weights are in its checkpoint
        self.counts.inc("osd_learner_parked_total")
        log.info("draft %r: %s, parked on disk (%d drafts in memory)", draft_id, why, len(self.learner.trainers))

    def forget_oldest(self) -> None:
        """Beyond ``max_parked`` parked drafts, delete the least recently checkpointed ones:
        checkpoints, replay and held-back logs (the draft, if used again, starts anew)."""
        parked = [d for d in self.parked() if d != GENERAL]
        for d in parked[: max(0, len(parked) - self.max_parked)]:
            self.learner.remove_trainer(d)  # its shard and held-back logs deleted, open or not
            shutil.rmtree(self.ckpt_dir / draft_folder(d), ignore_errors=True)
            for table in (self.served, self.forks, self.subscribers):
                table.pop(d, None)
            self.counts.inc("osd_learner_forgotten_total")
            self.counts.event("forget", draft=d)
            log.info("draft %r: parked longest, forgotten (checkpoints and logs deleted)", d)
