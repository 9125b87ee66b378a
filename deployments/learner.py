"""Learner deployment: per-draft replay shards on disk, training rounds in a background thread,
the gate, versions and checkpoints; accepted weights go to every draft replica through the object
store (``DeploymentHandle.broadcast`` with a reference to a ``{name: numpy array}`` state dict).

Transport only: ``learner.background.BackgroundLearner`` around ``learner.trainer.OnlineLearner``
is the same loop the in-process experiments run, and ``learner.lifecycle.DraftBook`` decides which
drafts are in memory (made, forked, parked, forgotten). On restart the trainers reload their latest
checkpoints and the draft replicas pull the latest published version when they load a draft.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import threading
import time

import torch
from pydantic import ValidationError
from ray import serve

from config import AppConfig
from drafts.build import build_proposer, domain_proposers
from learner.background import BackgroundLearner
from learner.lifecycle import DraftBook, known_drafts
from learner.replay import ReplayRecord, ShardConfig
from learner.trainer import LearnerConfig, OnlineLearner, RoundReport
from speculative.models import load_tokenizer, load_weights
from speculative.proposers import learned_draft
from telemetry.hub import json_safe

from .loopback import NodeInfo, bind_replica_grpc, replica_meter

log = logging.getLogger("osd.learner")


class LearnerServer:
    """Undecorated: tests build it directly; ``publish(draft_id, state, version)`` is the transport out."""

    def __init__(self, cfg: AppConfig, publish=None):
        torch.set_num_threads(1)
        root = cfg.learner.root()
        self.cfg = cfg
        self.ckpt_dir = root / "checkpoints"  # one folder per draft (learner.trainer.draft_folder)
        self.trainer_cfg = cfg.learner.trainer.model_copy(update={"checkpoint_dir": self.ckpt_dir,
                                                                  "context_tokens": self.window(cfg)})
        target = load_weights(cfg.engine.model)
        tok = load_tokenizer(cfg.engine.model.name)
        learned = learned_draft(build_proposer(cfg.engine.draft, target, tok))
        if learned is None:
            raise ValueError(f"the learner needs a learned draft; draft.proposers {cfg.engine.draft.proposers} has none")
        base, keep_ids = learned.runner.model, learned.runner.vocab_map
        # named domains' own starting drafts: (model, keep ids) by domain, as the pool builds them
        starts = {d: (r.model, r.vocab_map) for d, p in domain_proposers(cfg.engine.draft, target, tok).items()
                  for r in [learned_draft(p).runner]}
        # a feature draft's prompt positions are read with the target's head: only it is kept
        target_head = copy.deepcopy(target.get_output_embeddings()) if self.trainer_cfg.prompt_positions else None
        del target
        shards = ShardConfig(dir=root / "shards", max_bytes=cfg.learner.shard_max_bytes)
        # at most max_drafts drafts in memory: after a restart the most recently checkpointed ones
        # (the general draft always); the others stay parked on disk until they are used again
        known = known_drafts(self.ckpt_dir, cfg.learner.max_drafts)
        self.learner = OnlineLearner(self.trainer_cfg, shards, open_drafts=known)
        self.meter = replica_meter("Learner", cfg.metrics)
        self._dropped = 0
        self._against_s = 0.0  # against-traffic CPU seconds already counted into the meter
        self.book = DraftBook(self.learner, self.trainer_cfg, base, keep_ids, starts, cfg.learner.max_drafts,
                              cfg.learner.max_parked, self.meter, publish, target_head)
        background = cfg.learner.background
        self._last_record = float("-inf")  # monotonic time the last record arrived: traffic is flowing
        self.background = BackgroundLearner(self.learner, self.book.subscribers, cfg=background,
                                            on_round=self._count_round, store_on_submit=True,
                                            between_rounds=self.book.park_idle,
                                            busy=lambda: time.monotonic() - self._last_record < background.quiet_s)
        for d in known:
            self.book.trainer(d)  # reloads its latest checkpoint (or the newest good one)
        self.book.forget_oldest()  # a bound lowered since the last run
        #: what a restart has to tell the draft pool: every draft's latest weights (a version
        #: checkpointed just before a crash may never have been broadcast)
        self.announce = [(d, state, v) for d, (state, v) in self.book.served.items()]
        self.background.start()

    @staticmethod
    def window(cfg: AppConfig) -> int | None:
        """The prompt tokens a record trains on: the trainer's ``context_tokens``, else the window the
        served draft reads (``engine.draft.context_tokens``); None: the whole prompt."""
        return cfg.learner.trainer.context_tokens or cfg.engine.draft.context_tokens

    def _count_round(self, rep: RoundReport) -> None:
        """A finished round into the meter (from the learner thread)."""
        m, d = self.meter, rep.draft_id
        result = ("published" if rep.version is not None else "rejected" if rep.steps > 0 and not rep.accepted
                  else "yielded" if rep.stopped_early else "empty")
        m.inc("osd_learner_rounds_total", draft=d, result=result)
        m.inc("osd_learner_steps_total", rep.steps, draft=d)
        if rep.cut_short:
            m.inc("osd_learner_rounds_cut_total", draft=d)
        m.inc("osd_learner_train_seconds_total", rep.train_seconds, draft=d)
        if rep.loss_after is not None and math.isfinite(rep.loss_after):  # a rejected NaN round keeps the last loss
            m.set("osd_learner_loss", rep.loss_after, draft=d)
        if result == "rejected":
            reason = "non_finite" if "non-finite" in rep.reason else "agreement_drop" if "agreement" in rep.reason else "other"
            m.inc("osd_learner_rejected_total", draft=d, reason=reason)
            m.event("reject", draft=d, reason=rep.reason)

    # -- the serving side ----------------------------------------------------------------------
    def record(self, record: ReplayRecord) -> bool:
        """A finished request's record (from a draft replica): stored in its shard (written and
        flushed) before this returns True, so that a learner killed afterwards loses none of the
        records it took; training happens later, in the learner thread."""
        self.touch()
        self.book.trainer(record.draft_id)
        self.meter.inc("osd_learner_records_total", draft=record.draft_id)
        return self.background.submit(record)

    def touch(self) -> None:
        """Traffic is flowing (a request started or a record arrived): with ``background.quiet_s``
        no round starts, and a running one pauses, until that long after the last touch."""
        self._last_record = time.monotonic()

    def latest(self, draft_id: str) -> tuple[dict, int] | None:
        """The weights a replica loading ``draft_id`` serves (``DraftBook.latest``)."""
        return self.book.latest(draft_id)

    def retire(self, draft_ids: list[str]) -> int:
        """Drafts the router retired: parked between rounds (``DraftBook.retire``)."""
        return self.book.retire(draft_ids)

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
    TUNABLE = ("lr", "gate_margin", "gate_z", "steps_per_round", "min_steps_per_round", "train_every", "batch_records",
               "max_cpu_share")

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
        with self.background.interrupt(self.cfg.learner.operator_wait_s):  # between two rounds (one in flight ends at its next step)
            self.trainer_cfg = self.learner.cfg = self.book.trainer_cfg = new
            for t in self.learner.trainers.values():
                t.cfg = new
                for g in t.opt.param_groups:
                    g["lr"] = new.lr
        log.warning("learner settings changed: %s", changes)
        return {k: getattr(new, k) for k in self.TUNABLE}

    def rollback(self, draft_id: str, version: int) -> dict:
        """Serve the weights of checkpoint ``version`` again, published under a new version."""
        t = self.book.trainer(draft_id) if self.book.checkpointed(draft_id) else None  # a parked draft comes back
        with self.background.interrupt(self.cfg.learner.operator_wait_s):  # not in the middle of a round on these weights
            if t is None or version not in t.versions():  # checked here: a round may just have pruned it
                raise ValueError(f"draft {draft_id!r} has no checkpoint v{version}")
            new, state = t.rollback(version)
        self.book.publish(draft_id, state, new, kind="rollback")
        return {"draft_id": draft_id, "version": new, "weights_of": version}

    def telemetry(self) -> dict:
        m, s = self.meter, self.background.stats()
        m.inc("osd_learner_records_dropped_total", s.dropped - self._dropped)
        self._dropped = s.dropped
        m.inc("osd_learner_against_traffic_seconds_total", s.against_traffic_s - self._against_s)
        self._against_s = s.against_traffic_s
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
                           "traffic": self.learner.traffic(d), "forked_from": self.book.forks.get(d),
                           "rounds": t.rounds, "rejected": t.rejected,
                           "last_round": t.history[-1].to_dict() if t.history else None}
                       for d, t in list(self.learner.trainers.items())}
        s["settings"] = {k: getattr(self.trainer_cfg, k) for k in self.TUNABLE}
        s["parked"] = sorted(self.book.parked())
        s["live"] = {"watching": self.learner.live.watching(), "rolled_back": self.learner.live.rolled_back[-16:],
                     "kept": self.learner.live.kept[-16:]}
        return json_safe(s)


@serve.deployment(name="Learner", max_ongoing_requests=256)
class Learner(LearnerServer, NodeInfo):
    def __init__(self, cfg: AppConfig, pool_name: str = "DraftPool"):
        bind_replica_grpc(cfg.replica_grpc_host)
        self.pool_name = pool_name
        self._pool = None  # the draft pool's handle, made at the first publish
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
        """From the learner thread (which holds ``exclusive`` meanwhile): one object-store copy, every
        draft replica loads it; waited on at most ``learner.broadcast_timeout_s``."""
        import ray

        t0 = time.perf_counter()
        try:
            ref = ray.put(state)
            if self._pool is None:  # one handle for the replica's life (a new one starts a router each time)
                self._pool = serve.get_deployment_handle(self.pool_name, serve.get_replica_context().app_name)
            got = self._pool.broadcast("load_weights", draft_id, [ref], version).results(
                timeout_s=self.cfg.learner.broadcast_timeout_s)
            self.meter.observe("osd_learner_broadcast_seconds", time.perf_counter() - t0)
            log.info("draft %r v%d reached %d replicas (versions now %s)", draft_id, version, len(got), got)
        except TimeoutError:
            log.warning("draft %r v%d: not every draft replica answered within %g s; the learner goes on (a slow "
                        "replica still loads it)", draft_id, version, self.cfg.learner.broadcast_timeout_s)
        except Exception:  # noqa: BLE001 - the pool is down or shutting down: replicas pull it when they load
            log.exception("draft %r v%d: broadcast failed; replicas will load it from the learner", draft_id, version)
