"""Typed settings of the online learner: its rounds and gate (:class:`LearnerConfig`), the
rollback on live acceptance (:class:`LiveWatchConfig`), how its thread shares the machine
(:class:`BackgroundConfig`) and the learner deployment (:class:`LearnerServeConfig`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from .base import _Strict, cache_dir

#: the losses ``learner.losses.get_loss`` knows (``learner.losses.LOSSES`` holds the functions)
LOSS_NAMES = ("forward_kl", "reverse_kl", "jsd", "tvd", "draft_opd")


def check_loss_name(name: str) -> str:
    """Validate a loss name (for typed configs): one of :data:`LOSS_NAMES`."""
    if name not in LOSS_NAMES:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSS_NAMES)}")
    return name


class LiveWatchConfig(BaseModel):
    """When a published draft version is rolled back for serving worse than the one before it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    #: proposed draft tokens each side needs before a verdict
    min_proposed: int = Field(default=400, ge=1)
    #: acceptance the new version may lose before the test is asked at all
    margin: float = Field(default=0.02, ge=0.0)
    #: standard errors on top of the margin (one-sided)
    z: float = Field(default=2.0, ge=0.0)
    #: a watch that has not decided by then closes, the version kept
    watch_s: float = Field(default=1800.0, gt=0.0)
    #: records of the old version before the publish that make its side
    baseline_records: int = Field(default=64, ge=1)


#: the most steps a round may take (a step is 1-4 s of a core on the 2-layer draft here)
MAX_STEPS_PER_ROUND = 4096


class LearnerConfig(BaseModel):
    """Settings of the online learner (shared by all drafts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: records observed (all drafts together) between training rounds
    train_every: int = Field(default=64, ge=1)
    #: records sampled from the chosen draft's shard per round
    batch_records: int = Field(default=16, ge=1)
    #: optimiser steps per round (each over a whole batch); at most MAX_STEPS_PER_ROUND, so that a
    #: setting (an operator's PATCH /admin/learner) cannot hold the learner in one round for good
    steps_per_round: int = Field(default=4, ge=1, le=MAX_STEPS_PER_ROUND)
    #: a round may end after this many steps once the next one is due (``train_every`` more records
    #: arrived while it trained): with spare compute a round takes all ``steps_per_round``, under
    #: steady traffic rounds keep up with it. None: always all of them
    min_steps_per_round: int | None = Field(default=None, ge=1, le=MAX_STEPS_PER_ROUND)
    #: every step of a round draws a fresh batch from the shard (True), or all steps repeat the
    #: round's one batch (False: they fit those records and forget the rest of the window)
    resample: bool = True
    lr: float = Field(default=1e-4, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    #: max global gradient norm; 0 disables clipping
    grad_clip: float = Field(default=1.0, ge=0.0)
    #: loss name for learner.losses.get_loss
    loss: Annotated[str, AfterValidator(check_loss_name)] = "forward_kl"
    loss_options: dict[str, float] = Field(default_factory=dict)
    #: train only where the draft was wrong (``draft_wrong`` rows) or on all rows
    positions: Literal["wrong", "all"] = "wrong"
    #: records with the target's features (a feature draft's): also train on their prompt positions
    #: (from position 2), the target's distribution there being its head over the recorded feature
    #: (the trainer then needs ``target_head``); the gate's held-out agreement stays on output rows
    prompt_positions: bool = False
    #: a feature draft: weight of EAGLE's feature loss added to ``loss`` (see ``DistillConfig``); 0: off
    feature_loss: float = Field(default=0.0, ge=0.0)
    #: train the output head / the input embeddings (with a tied head: trained only when both
    #: are); the transformer layers and norms are always trained
    train_head: bool = True
    train_embeddings: bool = True
    #: share of observed records held back (never trained on) for the gate
    holdout_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    #: held-back records kept per draft (oldest dropped)
    holdout_max: int = Field(default=64, ge=1)
    #: max allowed drop of held-out top-1 agreement (candidate >= current - margin)
    gate_margin: float = Field(default=0.0, ge=0.0)
    #: > 0: the gate tests the paired per-position difference and allows this many standard
    #: errors on top of the margin (held-out sets are small; see DraftTrainer.gate); 0: margin only
    gate_z: float = Field(default=0.0, ge=0.0)
    checkpoint_dir: Path | None = None
    #: checkpoints kept per draft (the newest ones; LATEST is never deleted)
    keep_versions: int = Field(default=3, ge=1)
    #: recent records per draft used by pick_draft
    window: int = Field(default=256, ge=1)
    #: fraction of wall time training may use (sleeps between steps); 1 = no sleeping
    max_cpu_share: float = Field(default=1.0, gt=0.0, le=1.0)
    #: records per forward/backward inside a step, and per forward of the round's evaluations
    #: (gradients accumulated: same step, smaller pieces); ``pause`` is checked between pieces.
    #: One record needs no padding, so attention runs causal without a mask: a round's memory is
    #: one record's activations, not the batch's padded square. None: the whole batch at once
    micro_batch_records: int | None = Field(default=1, ge=1)
    #: > 0: learn a low-rank adapter of this rank on each projection of the draft, the base weights
    #: frozen (:mod:`speculative.adapters`); a version is the adapters alone. 0: the whole draft
    adapter_rank: int = Field(default=0, ge=0)
    #: the draft's window as served (``engine.draft.context_tokens``): a record trains on its last
    #: this many prompt tokens and its output, the context the served draft reads, instead of the
    #: whole prompt (cheaper on long prompts). None: the whole prompt. The learner deployment takes
    #: the engine's when the trainer names none
    context_tokens: int | None = Field(default=None, ge=16)
    #: after each publish, served acceptance of the new version against the one it replaced; a
    #: version that serves worse is rolled back (:mod:`learner.live`)
    live_rollback: LiveWatchConfig = LiveWatchConfig()
    #: round reports kept (the newest; ``OnlineLearner.reports``): a long-running learner does not
    #: keep one per round forever
    keep_reports: int = Field(default=1024, ge=1)
    seed: int = 0


class BackgroundConfig(BaseModel):
    """How the learner thread shares the machine with serving."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: OS niceness of the learner thread (0 = same as serving, 19 = lowest)
    nice: int = Field(default=19, ge=0, le=19)
    #: torch intra-op threads of the learner thread
    threads: int = Field(default=1, ge=1)
    #: yield to live requests (pause between steps while ``busy()``); False trains regardless
    yield_to_requests: bool = True
    #: a learner in another process than serving (the Learner deployment) counts serving as busy
    #: until this many seconds after the last record arrived: on a small machine it trains in the
    #: gaps of traffic, not against it (0: serving is never busy to it; serve_config.yaml sets 5)
    quiet_s: float = Field(default=0.0, ge=0.0)
    #: a floor under the learner while serving never pauses: it may train against live requests
    #: as long as its thread's CPU time stays within this share of the wall time serving was busy
    #: (:class:`learner.background.ShareBudget`). 0: it trains only when serving is idle (or
    #: ``quiet_s`` after the last record), so steady traffic starves it
    min_share: float = Field(default=0.0, ge=0.0, le=1.0)
    #: the most CPU seconds of unused share the learner may bank (a round's length or so): after a
    #: long stretch without records to train on it cannot then take the CPU for minutes
    share_burst_s: float = Field(default=10.0, gt=0.0)
    #: how often the idle loop looks at the queue and at ``busy()``
    poll_s: float = Field(default=0.01, gt=0.0)
    #: bound of the hand-over queue; a full queue drops the record (counted), never blocks serving
    queue_max: int = Field(default=10_000, ge=1)


#: the learner's rounds as a server runs them, and the defaults of ``osd experiment online|shift``:
#: rank-16 adapters on the draft's projections and head (a whole-draft update is rounded away by the
#: served draft's 4-bit packing: docs/proposers.md, "Adapters"), a round every 16 records of up to 16
#: steps at 1e-3 (at least 2 when the next round is due; 16 against 2, 4, 8 and 32 chosen on a stream that is
#: never scored: docs/proposers.md, "How many steps a round"), every position, the gate allowing 0.02 of
#: held-out agreement
SERVE_TRAINER = LearnerConfig(train_every=16, batch_records=16, steps_per_round=16, min_steps_per_round=2, lr=1e-3,
                              positions="all", gate_margin=0.02, adapter_rank=16)


class LearnerServeConfig(_Strict):
    """The learner deployment: replay shards and checkpoints under ``state_dir`` (default
    ``<cache_dir>/serve``), trained in rounds in a background thread of its own process.
    ``trainer``: :class:`config.learner.LearnerConfig` (train_every, batch_records, lr,
    gate_margin, ...); ``background``: :class:`config.learner.BackgroundConfig` (nice, threads);
    ``shard_max_bytes``: per-draft replay bound. ``max_drafts``: drafts held in memory (a trainer
    with its optimiser, a replay shard, held-back records); beyond it the least recently used is
    parked on disk (checkpoints and logs) and comes back when it is next used (the general draft is
    never parked). ``max_parked``: parked drafts kept on disk; beyond it the least recently
    checkpointed is forgotten (checkpoints, replay and held-back logs deleted: a draft the router
    retired leaves nothing behind; one used again starts anew, as a fork of its general draft)."""

    enabled: bool = True
    state_dir: str | None = None
    #: a serving learner's rounds (:data:`SERVE_TRAINER`); ``osd experiment online|shift`` take
    #: the same values as their defaults
    trainer: LearnerConfig = SERVE_TRAINER  # frozen: shared safely as the default

    @field_validator("trainer", mode="before")
    @classmethod
    def _over_serve_trainer(cls, v):
        """A partial ``trainer`` (``{lr: 0.002}``) changes those keys of :data:`SERVE_TRAINER`, not
        of ``LearnerConfig()``: one set of defaults, and no silent fall back to whole-draft rounds."""
        if isinstance(v, dict):
            return {**SERVE_TRAINER.model_dump(), **v}
        return v
    background: BackgroundConfig = BackgroundConfig()
    shard_max_bytes: int = Field(default=64 << 20, gt=0)
    max_drafts: int = Field(default=12, ge=1)
    max_parked: int = Field(default=48, ge=0)
    #: a publish waits this long for the draft replicas to answer that they loaded it; a replica
    #: slower than that still loads it (the call stays in flight), but the learner thread goes on
    broadcast_timeout_s: float = Field(default=30.0, gt=0.0)
    #: an operator's call that needs the learner thread between two holds (a rollback, new
    #: settings) waits this long, then answers 503 with what the thread is doing
    operator_wait_s: float = Field(default=60.0, gt=0.0)

    def root(self) -> Path:
        return Path(self.state_dir) if self.state_dir else cache_dir() / "serve"
