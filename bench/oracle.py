"""A learned draft with its acceptance set by hand, to measure what a better-trained draft would buy.

``osd bench --draft-acceptance 0.4 0.8`` adds a method ``spec_controller@0.4`` (and ``@0.8``): the
controller over the suffix tree, prompt lookup and the configured learned draft, as
``spec_controller``, except that each greedy token the draft proposes is replaced, with
probability A, by the target's own token at that position (known from the bench's target-only
pass of the same prompt), and otherwise by a token the target does not choose. The draft's
forwards still run, so its cost is the real one; only what it proposes changes. Every token the
target checks is then accepted with probability A, whatever the draft learned, and the method's
tokens/s is what the server would make if learning had raised the draft to that acceptance.
Outputs stay the target's: verification decides, as for any draft.
"""

from __future__ import annotations

import copy
import random

import torch

from config import SamplingParams
from speculative.proposers import DraftModelProposer


class AcceptanceDraft(DraftModelProposer):
    """``inner``'s weights and costs, with per-token acceptance ``acceptance`` against
    ``reference`` (the sequence's tokens as the target decodes them: prompt, then output)."""

    def __init__(self, inner: DraftModelProposer, acceptance: float, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], not {acceptance}")
        super().__init__(copy.deepcopy(inner.runner), inner.target_vocab, inner.context_tokens)  # caches of its own
        self.acceptance = acceptance
        self.reference: list[int] = []
        self.rng = random.Random(seed)

    def _draw(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
              position: int) -> tuple[int, torch.Tensor | None]:
        if not params.greedy:
            raise ValueError("AcceptanceDraft: greedy decoding only (the reference is the target's greedy output)")
        own, _ = super()._draw(logits, params, gen, position)  # the draft's own choice, paid for
        if position >= len(self.reference):  # past the reference's end: the request stops before
            return own, None
        want = self.reference[position]
        if self.rng.random() < self.acceptance:
            return want, None
        return (own if own != want else (want + 1) % self.target_vocab), None
