"""A causal LM plus per-sequence KV caches addressed by id.

Both the target and a learned draft are driven through :class:`ModelRunner`. A call says
where the caller's trusted prefix ends (``start``): the cache is cropped back to it first, so
rejected draft positions are dropped lazily, on the next call, and a runner never needs to
know about acceptance. This is also the shape a remote (Ray) target needs: each call is
self-describing, per-request state lives here keyed by id, and ``forward_batch`` takes the
calls of several concurrent requests at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass(frozen=True)
class ForwardCall:
    """Extend sequence ``seq_id`` from position ``start`` with ``tokens``; return the last ``keep_last`` rows."""

    seq_id: str
    start: int
    tokens: list[int]
    keep_last: int = 1


class ModelRunner:
    """Runs one model over many sequences, each with its own KV cache.

    ``vocab_map`` ([V_model] long), when set, maps the model's output index to target token ids
    (a draft whose head covers only part of the target's vocabulary).
    """

    def __init__(self, model: PreTrainedModel, vocab_map: torch.Tensor | None = None, name: str = "model"):
        self.model = model
        self.vocab_map = vocab_map
        self.name = name
        self.device = next(model.parameters()).device
        self._caches: dict[str, DynamicCache] = {}

    # -- per-sequence state -------------------------------------------------------------
    def cached_length(self, seq_id: str) -> int:
        cache = self._caches.get(seq_id)
        return 0 if cache is None else cache.get_seq_length()

    def release(self, seq_id: str) -> None:
        self._caches.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._caches)

    # -- compute ------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seq_id: str, start: int, tokens: list[int], keep_last: int = 1) -> torch.Tensor:
        """Logits for the last ``keep_last`` of ``tokens`` placed at positions start.. : [keep_last, V_model]."""
        if not tokens:
            raise ValueError("forward needs at least one token")
        cache = self._caches.get(seq_id)
        have = 0 if cache is None else cache.get_seq_length()
        if start > have:
            raise ValueError(f"{self.name}: sequence {seq_id!r} has {have} cached positions, cannot start at {start}")
        if cache is None or start == 0:
            cache = self._caches[seq_id] = DynamicCache(config=self.model.config)
        elif start < have:
            cache.crop(start - have)  # negative: drop the (have - start) rejected positions
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=keep_last)
        return out.logits[0, -keep_last:].float().cpu()  # [keep_last, V_model], on the CPU (acceptance runs there)

    def forward_batch(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """The calls of several requests. Today one forward each; the interface is what a batched
        (padded or ragged-attention) implementation keeps."""
        return [self.forward(c.seq_id, c.start, c.tokens, c.keep_last) for c in calls]

    # -- weights ------------------------------------------------------------------------
    def load_state_dict(self, state: dict) -> None:
        """Swap weights in place (between steps, never during one). Accepts tensors or numpy arrays."""
        tensors = {k: torch.as_tensor(v) for k, v in state.items()}
        self.model.load_state_dict(tensors, strict=True)
