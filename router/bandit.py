"""Which draft serves a domain: the one with the best observed acceptance, with a little exploration.

For each (domain, draft) the bandit keeps decayed token counts, accepted a and rejected b
(proposed - accepted), fed by the engine's per-step ``StepResult.accepted`` / ``proposed``. The
per-token acceptance rate of a draft in a domain has the posterior Beta(a0 + a, b0 + b), with prior
``cfg.bandit.prior`` = (a0, b0). Counts are multiplied by ``cfg.bandit.decay`` at every observation of the arm, so
at most about proposed / (1 - decay) tokens count: a draft that is retrained (or drifts) is
re-estimated, and the posterior never gets so narrow that exploration stops.

``choose`` is Thompson sampling (one draw per candidate, take the largest) plus, with probability
``cfg.bandit.explore_rate``, a uniform pick. A domain that no candidate has served yet gets the default
(the general draft, or the domain's own draft). Seeded: same observations, same choices.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from config import RouterConfig


class AcceptanceBandit:
    def __init__(self, cfg: RouterConfig = RouterConfig()):
        self.cfg = cfg
        self.counts: dict[tuple[str, str], list[float]] = {}  # (domain, draft) -> [accepted, rejected]
        self.rng = np.random.default_rng(cfg.bandit.seed)

    def observe(self, domain: str, draft_id: str, accepted: int, proposed: int) -> None:
        """One speculative step (or a request's total): ``accepted`` of ``proposed`` tokens kept."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got accepted={accepted} proposed={proposed}")
        if proposed == 0:
            return  # k = 0 steps say nothing about the draft
        ab = self.counts.setdefault((domain, draft_id), [0.0, 0.0])
        ab[0] = ab[0] * self.cfg.bandit.decay + accepted
        ab[1] = ab[1] * self.cfg.bandit.decay + proposed - accepted

    def posterior(self, domain: str, draft_id: str) -> tuple[float, float]:
        """Beta parameters of the draft's acceptance rate in the domain."""
        a, b = self.counts.get((domain, draft_id), (0.0, 0.0))
        return self.cfg.bandit.prior[0] + a, self.cfg.bandit.prior[1] + b

    def mean(self, domain: str, draft_id: str) -> float:
        a, b = self.posterior(domain, draft_id)
        return a / (a + b)

    def seen(self, domain: str) -> bool:
        return any(d == domain for d, _ in self.counts)

    def choose(self, domain: str, candidates: Sequence[str], default: str) -> tuple[str, bool]:
        """(draft, explored): explored is True when the pick is not the best posterior mean."""
        if len(candidates) == 1:
            return candidates[0], False
        if not self.seen(domain):
            return default, False
        best = max(candidates, key=lambda d: self.mean(domain, d))
        if self.rng.random() < self.cfg.bandit.explore_rate:
            pick = candidates[int(self.rng.integers(len(candidates)))]
        else:
            a, b = np.array([self.posterior(domain, d) for d in candidates]).T  # [m], [m]
            pick = candidates[int(self.rng.beta(a, b).argmax())]
        return pick, pick != best

    def forget(self, domain: str | None = None, draft_id: str | None = None) -> None:
        """Drop the statistics of a domain, of a draft, or of both together."""
        self.counts = {k: v for k, v in self.counts.items()
                       if not ((domain is None or k[0] == domain) and (draft_id is None or k[1] == draft_id))}

    def state(self) -> dict:
        return {"counts": [[d, r, *ab] for (d, r), ab in self.counts.items()],
                "rng": self.rng.bit_generator.state}

    @classmethod
    def from_state(cls, cfg: RouterConfig, state: dict) -> "AcceptanceBandit":
        self = cls(cfg)
        self.counts = {(d, r): [a, b] for d, r, a, b in state["counts"]}
        self.rng.bit_generator.state = state["rng"]
        return self
