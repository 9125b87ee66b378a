"""The feature-conditioned draft at serving time: :class:`FeatureRunner` (the model of
:mod:`speculative.feature_draft`, one KV cache per sequence, the head in the runtime's bits) and
:class:`FeatureDraftProposer`, which reads the target's features that verification returns and
drafts k tokens from them (the model's docstring says how)."""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import DynamicCache

from .adapters import base_memo, load_whole
from .feature_draft import FeatureDraft
from .proposers import EMPTY, LearnedDraft, Proposal


class FeatureRunner:
    """The draft's side of :class:`FeatureDraftProposer`: the model and one KV cache per sequence
    (its layer's, over the pairs fed so far). ``head_bits`` 4 or 8: the head (most of the draft's
    cost: 49152 x 576 for SmolLM2) runs as a packed int4 / int8 copy of the float head, re-packed
    when weights are swapped (the fast CPU path's kernels); None: the float head."""

    def __init__(self, model: FeatureDraft, vocab_map: torch.Tensor | None = None, name: str = "feature-draft",
                 head_bits: int | None = None):
        self.model = model
        self.vocab_map = vocab_map
        self.name = name
        self.head_bits = head_bits
        self._caches: dict[str, DynamicCache] = {}
        self._head = self._pack()

    def _pack(self) -> nn.Module:
        from .fast import Int4Linear, Int8Linear

        if self.head_bits is None:
            return self.model.lm_head
        return Int4Linear(self.model.lm_head) if self.head_bits == 4 else Int8Linear(self.model.lm_head)

    @torch.inference_mode()
    def step(self, seq_id: str, start: int, features: torch.Tensor, tokens: list[int], own: bool = False) -> torch.Tensor:
        """Feed pairs (features[i], tokens[i]) at pair positions start..; returns the predicted
        features [T, H] (the cache past ``start`` is dropped first). ``features``: the target's
        ([T, feature_width]), or with ``own`` the draft's own predictions ([T, H])."""
        cache = self._caches.get(seq_id)
        if cache is None or start == 0:
            cache = self._caches[seq_id] = DynamicCache(config=self.model.config)
        have = cache.get_seq_length()
        if start > have:
            raise ValueError(f"{self.name}: sequence {seq_id!r} has {have} cached pairs, cannot start at {start}")
        if start < have:
            cache.crop(start - have)  # negative: drop the (have - start) pairs past start
        dev = self.model.fc.weight.device
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)  # [1, T]
        pos = torch.arange(start, start + len(tokens), device=dev)[None]  # [1, T]
        features = features.to(dev)
        fused = features if own else self.model.fuse_features(features)  # [T, H]
        return self.model(fused[None], ids, pos, past_key_values=cache)[0]  # [T, H]

    @torch.inference_mode()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self._head(h).float().cpu()  # [T, V_draft], on the CPU (acceptance runs there), like ModelRunner

    def release(self, seq_id: str) -> None:
        self._caches.pop(seq_id, None)

    def share_memo(self) -> dict[int, torch.Tensor]:
        """``copy.deepcopy``'s memo that makes a copy share the float model's tensors."""
        return base_memo(self.model)

    def load_state_dict(self, state: dict) -> None:
        load_whole(self.model, state)  # in the parameters' places: a base shared with other copies stays theirs
        self._caches.clear()
        self._head = self._pack()


class FeatureDraftProposer(LearnedDraft):
    """Proposes with a :class:`FeatureDraft` from the target's features, which verification returns
    (``wants_features``). Learned online like the token draft (same learner, same versions)."""

    sources = ("feature",)
    wants_features = True

    runner: FeatureRunner

    def __init__(self, runner: FeatureRunner, target_vocab: int):
        super().__init__(runner, target_vocab)
        self._feats: dict[str, torch.Tensor] = {}  # seq -> [m, W] float32 target features, positions 0..m-1
        #: the target layers whose outputs verification returns besides the final feature (the model's)
        self.feature_layers = runner.model.feature_layers

    def observe_features(self, seq_id: str, start: int, features: torch.Tensor) -> None:
        have = self._feats.get(seq_id)
        kept = have[:start] if have is not None else torch.zeros(0, features.shape[-1])
        if kept.shape[0] != start:  # a gap (features of earlier positions never came): start over when they do
            self._feats.pop(seq_id, None)
            return
        self._feats[seq_id] = torch.cat([kept, features.detach().float().cpu()])  # kept on the CPU, like the records
        self._valid[seq_id] = min(self._valid.get(seq_id, 0), start)  # pairs from here on used other features

    def propose(self, seq_id, tokens, choose_k, params, gen) -> Proposal:
        feats = self._feats.get(seq_id)
        if feats is None or not len(feats) or len(tokens) != len(feats) + 1:  # before the prompt was verified (or after a gap)
            return EMPTY
        m = feats.shape[0]
        k = choose_k("feature")
        if k <= 0:
            return EMPTY
        t0 = time.perf_counter()
        start = min(self._valid.get(seq_id, 0), m - 1)  # pairs (f_j, x_{j+1}) cached and still valid
        h = self.runner.step(seq_id, start, feats[start:m], tokens[start + 1 : m + 1])[-1:]  # [1, H] f^_m
        draft_tokens, rows = [], []
        for i in range(k):
            tok, q = self._draw(self.runner.head(h)[0], params, gen, len(tokens) + i)
            draft_tokens.append(tok)
            if q is not None:
                rows.append(q)
            if i < k - 1:  # the draft's own feature and token: pair m + i
                h = self.runner.step(seq_id, m + i, h, [tok], own=True)
        self._valid[seq_id] = m  # pairs past m were built on the draft's own features: dropped next time
        probs = torch.stack(rows) if rows else None
        return Proposal(draft_tokens, probs, "feature", time.perf_counter() - t0, m - start + k - 1)

    def feedback(self, seq_id: str, committed: int) -> None:
        pass  # the features that arrive with each verification say what is final

    def release(self, seq_id: str, tokens: list[int] | None = None) -> None:
        self._feats.pop(seq_id, None)
        super().release(seq_id, tokens)
