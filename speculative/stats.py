"""Speculative decoding statistics.

Definitions (as in vLLM's spec-decode metrics):
  - acceptance rate alpha = accepted / proposed (draft tokens kept over draft tokens proposed)
  - per-token acceptance = accepted / (accepted + rejected), where a step that kept fewer tokens
    than it proposed rejected one (the tokens after it were never checked): the probability that a
    drafted token is accepted given that those before it were, the alpha of Leviathan et al.'s
    E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha) and the acceptance rate EAGLE reports.
    At k = 1 the two agree; at k = 4 a per-token 0.8 is an accepted / proposed of 0.59.
  - mean acceptance length = 1 + accepted / drafts, where drafts counts steps that proposed >= 1 token
    (tokens produced per target forward on those steps)
  - per-position acceptance rate[i] = steps whose i-th draft token was accepted / steps that proposed >= i+1
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    steps: int = 0  # target forwards
    drafts: int = 0  # steps that proposed at least one token
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # steps that kept fewer tokens than they proposed
    emitted: int = 0  # output tokens
    draft_s: float = 0.0
    target_s: float = 0.0
    proposed_at: list[int] = field(default_factory=list)  # [position] steps that proposed > position tokens
    accepted_at: list[int] = field(default_factory=list)  # [position] steps that accepted > position tokens

    def observe(self, proposed: int, accepted: int, emitted: int, draft_s: float, target_s: float) -> None:
        self.steps += 1
        self.drafts += proposed > 0
        self.proposed += proposed
        self.accepted += accepted
        self.rejected += accepted < proposed
        self.emitted += emitted
        self.draft_s += draft_s
        self.target_s += target_s
        while len(self.proposed_at) < proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted

    def merge(self, other: "SpecStats") -> None:
        for i in range(len(other.proposed_at)):
            if i >= len(self.proposed_at):
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[i] += other.proposed_at[i]
            self.accepted_at[i] += other.accepted_at[i]
        for name in ("steps", "drafts", "proposed", "accepted", "rejected", "emitted", "draft_s", "target_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def token_acceptance(self) -> float | None:
        checked = self.accepted + self.rejected
        return self.accepted / checked if checked else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_position(self) -> list[float]:
        return [a / p for a, p in zip(self.accepted_at, self.proposed_at) if p]

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "alpha": self.alpha,
            "token_acceptance": self.token_acceptance,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_per_step": self.emitted / self.steps if self.steps else None,
            "per_position_acceptance": self.per_position,
            "draft_s": self.draft_s,
            "target_s": self.target_s,
        }
