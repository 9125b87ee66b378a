"""Learner deployment: per-draft replay shards on disk, training rounds in a background thread,
the gate, versions and checkpoints; accepted weights go to every draft replica through the object
store (``DeploymentHandle.broadcast`` with a reference to a ``{name: numpy array}`` state dict).

Transport only: ``learner.background.BackgroundLearner`` around ``learner.trainer.OnlineLearner``
is the same loop the in-process experiments run. On restart the trainers reload their latest
checkpoints and the draft replicas pull the latest published version when they load a draft.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import math
import shutil
import threading
import time
from collections import OrderedDict

import torch
from pydantic import ValidationError
from ray import serve

from config import AppConfig
from drafts.build import build_proposer, domain_proposers
from learner.background import BackgroundLearner
from learner.replay import ReplayRecord, ShardConfig
from learner.trainer import LATEST, DraftTrainer, LearnerConfig, OnlineLearner, RoundReport, draft_folder
from router.router import GENERAL, fork_parent, start_domain
from speculative.adapters import load_state, share_base
from speculative.models import load_tokenizer, load_weights
from speculative.proposers import learned_draft
from telemetry.hub import json_safe

from .loopback import NodeInfo, bind_replica_grpc, replica_meter

log = logging.getLogger("osd.learner")


def _mtime(folder) -> float:
    """When a draft's checkpoints last changed (its LATEST pointer, else the folder)."""
    latest = folder / LATEST
    return (latest if latest.exists() else folder).stat().st_mtime


class LearnerServer:
    """Undecorated: tests build it directly; ``publish(draft_id, state, version)`` is the transport out."""

    def __init__(self, cfg: AppConfig, publish=None):
        torch.set_num_threads(1)
        root = cfg.learner.root()
        self.cfg = cfg
        self.ckpt_dir = root / "checkpoints"  # one folder per draft (learner.trainer.draft_folder)
        self.trainer_cfg = cfg.learner.trainer.model_copy(update={"checkpoint_dir": self.ckpt_dir})
        target = load_weights(cfg.engine.model)
        tok = load_tokenizer(cfg.engine.model.name)
        learned = learned_draft(build_proposer(cfg.engine.draft, target, tok))
        if learned is None:
            raise ValueError(f"the learner needs a learned draft; draft kind {cfg.engine.draft.kind!r} has none")
        self.base, self.keep_ids = learned.runner.model, learned.runner.vocab_map
        # named domains' own starting drafts: (model, keep ids) by domain, as the pool builds them
        self.starts = {d: (r.model, r.vocab_map) for d, p in domain_proposers(cfg.engine.draft, target, tok).items()
                       for r in [learned_draft(p).runner]}
        # a feature draft's prompt positions are read with the target's head: only it is kept
        self.target_head = copy.deepcopy(target.get_output_embeddings()) if self.trainer_cfg.prompt_positions else None
        del target
        shards = ShardConfig(dir=root / "shards", max_bytes=cfg.learner.shard_max_bytes)
        # at most max_drafts drafts in memory: after a restart the most recently checkpointed ones
        # (the general draft always); the others stay parked on disk until they are used again
        known = self._known_drafts(self.ckpt_dir, cfg.learner.max_drafts)
        self.learner = OnlineLearner(self.trainer_cfg, shards, open_drafts=known)
        self.meter = replica_meter("Learner", cfg.metrics)
        self._dropped = 0
        self.publish_fn = publish
        self.subscribers: dict[str, list] = {}  # draft id -> [publish to the pool]; one per trainer
        self._lock = threading.RLock()  # records arrive on several threads; one trainer per new draft
        background = cfg.learner.background
        self._last_record = float("-inf")  # monotonic time the last record arrived: traffic is flowing
        self.background = BackgroundLearner(self.learner, self.subscribers, cfg=background,
                                            on_round=self._count_round, store_on_submit=True,
                                            between_rounds=self._park_idle,
                                            busy=lambda: time.monotonic() - self._last_record < background.quiet_s)
        #: draft id -> the weights the pool serves of it (the latest published, or reloaded from its
        #: checkpoints); never the training copy, which a round is changing and may yet reject
        self.served: dict[str, tuple[dict, int]] = {}
        self.forks: dict[str, dict] = {}  # draft id -> the parent (and its version) it started from
        self.used: OrderedDict[str, None] = OrderedDict()  # drafts in memory, least recently used first
        self.retiring: set[str] = set()  # drafts the router retired, parked at the next look (with tenants' copies)
        for d in known:
            self._trainer(d)  # reloads its latest checkpoint (or the newest good one)
        self._forget_oldest()  # a bound lowered since the last run
        #: what a restart has to tell the draft pool: every draft's latest weights (a version
        #: checkpointed just before a crash may never have been broadcast)
        self.announce = [(d, state, v) for d, (state, v) in self.served.items()]
        self.background.start()

    @staticmethod
    def _known_drafts(ckpt, most: int | None = None) -> list[str]:
        """Drafts with checkpoints, least recently checkpointed first: all, or the newest ``most``
        of them with the general draft always among them (first)."""
        from urllib.parse import unquote

        if not ckpt.is_dir():
            return []
        folders = sorted((p for p in ckpt.iterdir() if p.is_dir()), key=lambda p: (_mtime(p), p.name))
        names = [unquote(p.name) for p in folders]
        if most is not None and len(names) > most:
            pinned = [GENERAL] if GENERAL in names else []
            rest = [d for d in names if d != GENERAL]
            names = pinned + rest[len(names) - most :]  # the newest most - len(pinned)
        return names

    def _checkpointed(self, draft_id: str) -> bool:
        return (self.ckpt_dir / draft_folder(draft_id)).is_dir()

    def _parked(self) -> list[str]:
        """Drafts with checkpoints that are not in memory, least recently checkpointed first."""
        return [d for d in self._known_drafts(self.ckpt_dir) if d not in self.learner.trainers]

    def _park_idle(self) -> None:
        """Between rounds (the learner thread): while more than ``learner.max_drafts`` drafts are in
        memory, take the least recently used one out (never the general draft); it comes back from
        its checkpoints and logs when it is next used."""
        parked = False
        with self._lock:
            retired, self.retiring = self.retiring, set()
            for d in [d for d in self.used if d.partition("@")[0] in retired - {GENERAL}]:
                self._park(d, "retired by the router")
                parked = True
            while len(self.learner.trainers) > self.cfg.learner.max_drafts:
                idle = next((d for d in self.used if d != GENERAL and d in self.learner.trainers), None)
                if idle is None:
                    break
                self._park(idle, "idle")
                parked = True
            if parked:  # only parking adds parked drafts
                self._forget_oldest()

    def _park(self, draft_id: str, why: str) -> None:
        self.learner.park(draft_id)
        self.used.pop(draft_id)
        self.served.pop(draft_id, None)  # its weights are in its checkpoint
        self.meter.inc("osd_learner_parked_total")
        log.info("draft %r: %s, parked on disk (%d drafts in memory)", draft_id, why, len(self.learner.trainers))

    def retire(self, draft_ids: list[str]) -> int:
        """Drafts the router retired (and every tenant's copy of them): out of memory between
        rounds, parked as an idle draft is; a draft used again comes back. Returns how many ids."""
        with self._lock:
            self.retiring |= set(draft_ids)
        return len(draft_ids)

    def _forget_oldest(self) -> None:
        """Beyond ``learner.max_parked`` parked drafts, delete the least recently checkpointed ones:
        checkpoints, replay and held-back logs (the draft, if used again, starts anew)."""
        parked = [d for d in self._parked() if d != GENERAL]
        for d in parked[: max(0, len(parked) - self.cfg.learner.max_parked)]:
            self.learner.remove_trainer(d)  # its shard and held-back logs deleted, open or not
            shutil.rmtree(self.ckpt_dir / draft_folder(d), ignore_errors=True)
            for table in (self.served, self.forks, self.subscribers):
                table.pop(d, None)
            self.meter.inc("osd_learner_forgotten_total")
            self.meter.event("forget", draft=d)
            log.info("draft %r: parked longest, forgotten (checkpoints and logs deleted)", d)

    def _trainer(self, draft_id: str) -> DraftTrainer:
        """The draft's trainer, made the first time the draft is loaded or sends a record: from its
        checkpoints (a restart), else from its domain's starting draft, else forked from what its
        parent (``fork_parent``: the general draft of its tenant scope) has learned so far and
        published, as version 1; a parent with nothing published yet gives the configured draft."""
        with self._lock:
            if draft_id not in self.learner.trainers:
                self.subscribers[draft_id] = [functools.partial(self._publish, draft_id)]
                base, keep = self.starts.get(start_domain(draft_id, self.starts), (self.base, self.keep_ids))
                extra, parent = {}, fork_parent(draft_id, self.starts)
                new = not self._checkpointed(draft_id)
                if new and parent is not None and parent not in self.learner.trainers and self._checkpointed(parent):
                    self._trainer(parent)  # a parked parent: back in memory, its published weights with it
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
                    self.meter.event("fork", draft=draft_id, parent=parent, parent_version=version, version=t.version)
            self.used[draft_id] = None
            self.used.move_to_end(draft_id)
            return self.learner.trainers[draft_id]

    def _count_round(self, rep: RoundReport) -> None:
        """A finished round into the meter (from the learner thread)."""
        m, d = self.meter, rep.draft_id
        result = ("published" if rep.version is not None else "rejected" if rep.steps > 0 and not rep.accepted
                  else "yielded" if rep.stopped_early else "empty")
        m.inc("osd_learner_rounds_total", draft=d, result=result)
        m.inc("osd_learner_steps_total", rep.steps, draft=d)
        m.inc("osd_learner_train_seconds_total", rep.train_seconds, draft=d)
        if rep.loss_after is not None and math.isfinite(rep.loss_after):  # a rejected NaN round keeps the last loss
            m.set("osd_learner_loss", rep.loss_after, draft=d)
        if result == "rejected":
            reason = "non_finite" if "non-finite" in rep.reason else "agreement_drop" if "agreement" in rep.reason else "other"
            m.inc("osd_learner_rejected_total", draft=d, reason=reason)
            m.event("reject", draft=d, reason=rep.reason)

    def _publish(self, draft_id: str, state: dict, version: int, kind: str = "publish") -> None:
        log.info("draft %r: publishing v%d", draft_id, version)
        self.served[draft_id] = (state, version)
        self.meter.event(kind, draft=draft_id, version=version)
        if self.publish_fn is not None:
            self.publish_fn(draft_id, state, version)

    # -- the serving side ----------------------------------------------------------------------
    def record(self, record: ReplayRecord) -> bool:
        """A finished request's record (from a draft replica): stored in its shard (written and
        flushed) before this returns True, so that a learner killed afterwards loses none of the
        records it took; training happens later, in the learner thread."""
        self.touch()
        self._trainer(record.draft_id)
        self.meter.inc("osd_learner_records_total", draft=record.draft_id)
        return self.background.submit(record)

    def touch(self) -> None:
        """Traffic is flowing (a request started or a record arrived): with ``background.quiet_s``
        no round starts, and a running one pauses, until that long after the last touch."""
        self._last_record = time.monotonic()

    def latest(self, draft_id: str) -> tuple[dict, int] | None:
        """The weights a replica loading ``draft_id`` serves: its latest published version, or for
        a draft new to the learner its fork of the parent's (its trainer is made now, so that its
        first request is served by the fork); None: the configured starting draft."""
        self._trainer(draft_id)
        return self.served.get(draft_id)

    # -- operators -----------------------------------------------------------------------------
    def pause(self) -> dict:
        self.background.pause()
        return self.stats()

    def resume(self) -> dict:
        self.background.resume()
        return self.stats()

    def delete_tenant(self, tenant: str) -> dict:
        """Delete every stored record of a tenant: queued, in the replay shards (memory and disk),
        held back for the gate. Draft weights trained on them stay (they cannot be unlearned)."""
        queued = self.background.forget_queued(lambda r: r.tenant == tenant)
        out = self.learner.delete_tenant(tenant)
        log.info("tenant %r: deleted %d stored records (%d queued, %d held back)", tenant,
                 out["shards"] + queued + out["holdout"], queued, out["holdout"])
        return {"tenant": tenant, "deleted": {**out, "queued": queued}}

    #: what ``configure`` may change while serving (not kept across a restart: the config file is)
    TUNABLE = ("lr", "gate_margin", "gate_z", "steps_per_round", "train_every", "batch_records", "max_cpu_share")

    def configure(self, changes: dict) -> dict:
        """Change training settings from the next round on (``TUNABLE`` fields of
        ``LearnerConfig``); the learning rate of every trainer's optimiser too."""
        unknown = sorted(set(changes) - set(self.TUNABLE))
        if unknown:
            raise ValueError(f"not tunable: {', '.join(unknown)} (tunable: {', '.join(self.TUNABLE)})")
        try:
            new = LearnerConfig.model_validate({**self.trainer_cfg.model_dump(), **changes})
        except ValidationError as e:
            raise ValueError("; ".join(f"{'.'.join(str(p) for p in er['loc'])}: {er['msg']}" for er in e.errors())) from None
        with self.background.exclusive:  # between two rounds
            self.trainer_cfg = self.learner.cfg = new
            for t in self.learner.trainers.values():
                t.cfg = new
                for g in t.opt.param_groups:
                    g["lr"] = new.lr
        log.warning("learner settings changed: %s", changes)
        return {k: getattr(new, k) for k in self.TUNABLE}

    def rollback(self, draft_id: str, version: int) -> dict:
        """Serve the weights of checkpoint ``version`` again, published under a new version."""
        t = self._trainer(draft_id) if self._checkpointed(draft_id) else None  # a parked draft comes back
        with self.background.exclusive:  # not in the middle of a round on these weights
            if t is None or version not in t.versions():  # checked here: a round may just have pruned it
                raise ValueError(f"draft {draft_id!r} has no checkpoint v{version}")
            new, state = t.rollback(version)
        self._publish(draft_id, state, new, kind="rollback")
        return {"draft_id": draft_id, "version": new, "weights_of": version}

    def telemetry(self) -> dict:
        m, s = self.meter, self.background.stats()
        m.inc("osd_learner_records_dropped_total", s.dropped - self._dropped)
        self._dropped = s.dropped
        m.set("osd_learner_paused", float(s.paused))
        m.set("osd_learner_drafts_in_memory", len(self.learner.trainers))
        for d, t in list(self.learner.trainers.items()):
            m.set("osd_draft_version", t.version, draft=d)
            if d in self.learner.shards:
                shard = self.learner.shards[d].stats()
                m.set("osd_learner_shard_records", shard["records"], draft=d)
                m.set("osd_learner_shard_bytes", shard["log_bytes"], draft=d)
        return m.snapshot()

    def stats(self) -> dict:
        """Operators' view (JSON-safe: a round on bad data reports its NaN loss as null)."""
        s = self.background.stats().to_dict()
        s["drafts"] = {d: {"version": t.version, "versions": t.versions(), "held_back": len(t.holdout),
                           "traffic": self.learner.traffic(d), "forked_from": self.forks.get(d)}
                       for d, t in list(self.learner.trainers.items())}
        s["settings"] = {k: getattr(self.trainer_cfg, k) for k in self.TUNABLE}
        s["parked"] = sorted(self._parked())
        s["live"] = {"watching": self.learner.live.watching(), "rolled_back": self.learner.live.rolled_back[-16:],
                     "kept": self.learner.live.kept[-16:]}
        return json_safe(s)


@serve.deployment(name="Learner", max_ongoing_requests=256)
class Learner(LearnerServer, NodeInfo):
    def __init__(self, cfg: AppConfig, pool_name: str = "DraftPool"):
        bind_replica_grpc(cfg.replica_grpc_host)
        self.pool_name = pool_name
        super().__init__(cfg, publish=self._broadcast)
        if self.announce:  # a restart: the pool may hold older weights than the checkpoints
            threading.Thread(target=self._announce, name="osd-learner-announce", daemon=True).start()

    def _announce(self) -> None:
        for draft_id, state, version in self.announce:
            log.info("draft %r: announcing v%d after a restart", draft_id, version)
            self._broadcast(draft_id, state, version)  # replicas at that version already ignore it
        self.announce = []

    async def record(self, record: ReplayRecord) -> bool:
        """The store is a file append: off the event loop, which serves the other calls."""
        return await asyncio.to_thread(LearnerServer.record, self, record)

    def _broadcast(self, draft_id: str, state: dict, version: int) -> None:
        """From the learner thread: one object-store copy, every draft replica loads it."""
        import ray

        t0 = time.perf_counter()
        try:
            ref = ray.put(state)
            app = serve.get_replica_context().app_name
            pool = serve.get_deployment_handle(self.pool_name, app)
            got = pool.broadcast("load_weights", draft_id, [ref], version).results()
            self.meter.observe("osd_learner_broadcast_seconds", time.perf_counter() - t0)
            log.info("draft %r v%d reached %d replicas (versions now %s)", draft_id, version, len(got), got)
        except Exception:  # noqa: BLE001 - the pool is down or shutting down: replicas pull it when they load
            log.exception("draft %r v%d: broadcast failed; replicas will load it from the learner", draft_id, version)
