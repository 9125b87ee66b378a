"""Choosing k, the number of draft tokens per step.

With per-token acceptance a (i.i.d. model), a step that proposes k tokens yields on average
E[tokens](k) = (1 - a^(k+1)) / (1 - a) output tokens (k + 1 when a = 1) and costs
k * t_draft + t_verify(k + 1), where t_verify(j) is the target's time for one forward over j
tokens. In units of a plain target step (t_verify(1) = 1, c = t_draft / t_verify(1),
v(j) = t_verify(j) / t_verify(1)) the speedup over target-only decoding is

    S(k) = (1 - a^(k+1)) / ((1 - a) * (k c + v(k + 1)))

which with free verification (v = 1) is the paper's formula. k = 0 gives S = 1: plain decoding.
We pick argmax_k S(k). a is a decayed count estimate (Beta prior); costs are moving averages of
what the engine measures, so the policy calibrates itself to the machine. While k = 0 is chosen
the draft is re-probed with k = 1 at exponentially backed-off intervals, so a draft that improves
(the learner swaps in new weights) is noticed, at a bounded cost; the requests of one scope share
the intervals, so a new request does not re-probe from the start what its scope found useless. New
weights bring the next probe closer only where the draft is within reach of paying.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from config import KPolicyConfig


def expected_tokens(a: float, k: int) -> float:
    """E[output tokens] of a step proposing k tokens at per-token acceptance a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_speedup(a: float, k: int, c: float, v: float = 1.0) -> float:
    """S(k) above; v is the relative cost of verifying k + 1 tokens (1 = free verification)."""
    return expected_tokens(a, k) / (k * c + v)


@dataclass
class CostModel:
    """Moving averages of measured seconds: target forward over j tokens, draft seconds per token."""

    ema: float = 0.15
    verify_s: dict[int, float] = field(default_factory=dict)  # j tokens -> seconds
    draft_s: dict[str, float] = field(default_factory=dict)  # source -> seconds per proposed token

    def _update(self, table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - self.ema) * old + self.ema * value

    def observe_verify(self, n_tokens: int, seconds: float) -> None:
        self._update(self.verify_s, n_tokens, seconds)

    def observe_draft(self, source: str, k: int, seconds: float) -> None:
        if k > 0:
            self._update(self.draft_s, source, seconds / k)

    def _one(self) -> float | None:
        """t_verify(1); before a k = 0 step was measured, the smallest measured size stands in
        (so c and v stay conservative instead of 0 and 1)."""
        if not self.verify_s:
            return None
        return self.verify_s.get(1) or self.verify_s[min(self.verify_s)]

    def relative_verify(self, j: int) -> float:
        """v(j) = t_verify(j) / t_verify(1); unmeasured sizes borrow the nearest measured smaller one
        (optimistic, so larger k gets tried and measured)."""
        one = self._one()
        if not one or j <= 1:
            return 1.0
        known = [i for i in self.verify_s if i <= j]
        return max(1.0, self.verify_s[max(known)] / one) if known else 1.0

    def c(self, source: str) -> float:
        """Draft cost per token relative to one target step (0 until both are measured)."""
        one = self._one()
        d = self.draft_s.get(source)
        return d / one if one and d is not None else 0.0


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance a as a decayed Beta posterior: (prior * m + accepted) / (m + trials)."""

    prior: float
    strength: float = 1.0
    decay: float = 0.9  # memory of about 10 steps
    accepted: float = 0.0
    trials: float = 0.0

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        # geometric model: `accepted` successes, then one failure unless all were accepted
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + (accepted < proposed)

    @property
    def value(self) -> float:
        return (self.prior * self.strength + self.accepted) / (self.strength + self.trials)

    def upper(self, z: float) -> float:
        """An optimistic a: the estimate plus ``z`` standard deviations of its Beta posterior (whose
        weight, prior strength + decayed trials, is at most about 11, so it stays wide). A normal
        approximation: near a = 0 the posterior's right tail is longer (after five failed probes from
        the prior 0.6, Beta(0.6, 4.5), its 97.7% quantile is 0.48 where this gives 0.38), so a draft there counts
        as out of reach sooner; its backed-off probes still notice one that got better."""
        a = self.value
        return min(1.0, a + z * (a * (1.0 - a) / (self.strength + self.trials + 1.0)) ** 0.5)


#: the longest gap between probes of a source held at k = 0 (steps)
MAX_PROBE_GAP = 256
#: how optimistic "within reach" is (:meth:`KPolicy.within_reach`): standard deviations above the estimate
REACH_Z = 2.0


@dataclass
class ProbeSchedule:
    """When a source held at k = 0 is probed with one token: after ``gap`` steps at k = 0 (at first
    ``probe_every``), the gap doubling while probes fail, up to ``MAX_PROBE_GAP``; a step that
    drafts for real starts it over. The engine gives the requests of one scope one schedule, so a
    draft that the scope's traffic found useless is not probed again from the short gap by every
    new request. New draft weights may halve the gap (:meth:`sooner`; the engine does so only where
    the draft is within reach of paying, :meth:`KPolicy.within_reach`): restarting it instead would
    bring the short gap back with every publication of a learner publishing every few requests."""

    probe_every: int
    idle: dict[str, int] = field(default_factory=dict)  # steps at k = 0 since the last probe
    gap: dict[str, int] = field(default_factory=dict)

    def drafted(self, source: str) -> None:
        self.idle[source] = 0
        self.gap[source] = self.probe_every

    def due(self, source: str) -> bool:
        """One more step at k = 0 for ``source``: whether it is probed now instead."""
        idle = self.idle.get(source, 0) + 1
        gap = self.gap.get(source, self.probe_every)
        if idle >= gap:  # probe with one token; back off while probes keep failing
            self.idle[source] = 0
            self.gap[source] = min(gap * 2, MAX_PROBE_GAP)
            return True
        self.idle[source] = idle
        return False

    def sooner(self, sources) -> None:
        for source in sources:
            if source in self.gap:
                self.gap[source] = max(self.probe_every, self.gap[source] // 2)


class KPolicy:
    """Adaptive k for one request (or one draft), one acceptance estimate per proposer source;
    ``probes``: the probe schedule it shares (default: one of its own)."""

    def __init__(self, cfg: KPolicyConfig, costs: CostModel, prior: dict[str, float] | None = None,
                 probes: ProbeSchedule | None = None):
        self.cfg = cfg
        self.costs = costs
        self.prior = prior or {}
        self.alpha: dict[str, AcceptanceEstimate] = {}
        self.probes = probes if probes is not None else ProbeSchedule(cfg.probe_every)

    def estimate(self, source: str) -> AcceptanceEstimate:
        if source not in self.alpha:
            self.alpha[source] = AcceptanceEstimate(self.prior.get(source, self.cfg.prior_alpha))
        return self.alpha[source]

    def speedups(self, a: float, c: float) -> list[float]:
        """S(k) for k = 0..k_max at acceptance ``a`` and draft cost ``c`` (S(0) = 1: plain decoding)."""
        return [expected_speedup(a, k, c, self.costs.relative_verify(k + 1)) for k in range(self.cfg.k_max + 1)]

    def best_speedup(self, source: str) -> float:
        """max over k of S(k) for ``source`` now: what the controller ranks by."""
        return max(self.speedups(self.estimate(source).value, self.costs.c(source)))

    def within_reach(self, source: str) -> bool:
        """Whether drafting with ``source`` could pay at an optimistic acceptance (:data:`REACH_Z`
        deviations above the estimate) at today's costs: new draft weights shorten the probe gap of
        a source only then, so that a draft that cannot pay on this machine (its break-even
        acceptance far above what it reaches) is not probed again after every publication."""
        return self.best_k(self.estimate(source).upper(REACH_Z), self.costs.c(source)) > 0

    def best_k(self, a: float, c: float) -> int:
        scores = self.speedups(a, c)
        return max(range(len(scores)), key=lambda k: (scores[k], -k))

    def choose(self, source: str) -> int:
        if self.cfg.fixed_k is not None:
            return self.cfg.fixed_k
        k = self.best_k(self.estimate(source).value, self.costs.c(source))
        if k > 0:
            self.probes.drafted(source)
            return k
        return 1 if self.probes.due(source) else 0

    def observe(self, source: str, proposed: int, accepted: int) -> None:
        self.estimate(source).observe(proposed, accepted)


class StepChoice:
    """What a proposer asks while proposing one step of one request: k for a source (the request's
    policy, capped by the tokens it may still emit) and, for a controller, each source's expected
    speedup. Calling it is the k policy's decision for this step (probe counters advance);
    ``speedup`` only reads."""

    def __init__(self, policy: KPolicy, budget: int):
        self.policy = policy
        self.budget = budget

    def __call__(self, source: str) -> int:
        return min(self.policy.choose(source), self.budget)

    def speedup(self, source: str) -> float:
        return self.policy.best_speedup(source)
