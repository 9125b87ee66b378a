"""A draft that sees the target: one decoder layer over the target's own features (EAGLE-style).

Verification already computes the target's hidden state at every position it is fed; the one its
head reads (after the final norm) is the *feature* f_t, from which the target's distribution of
token t + 1 is head(f_t). The draft predicts the next feature from the current one and the token
that was actually chosen:

    h_t = Layer(fc([n(f_t) ; e(x_{t+1})]))   one Llama decoder layer, causal over t, own KV cache
    f^_{t+1} = norm(h_t)                      the predicted feature
    q(x_{t+2}) = softmax(head(f^_{t+1}))      the target's head (restricted to frequent tokens)

Proposing k tokens after the final features f_0..f_{m-1} and the pending token x_m: the last pair
(f_{m-1}, x_m) gives d_1; then the draft feeds its own predicted feature with its own token,
(f^_m, d_1) -> d_2, and so on (EAGLE's autoregression at the feature level). Training (the online
learner, with the existing losses) runs two passes per batch: on the target's features, and on
the draft's own predicted features, as it meets them beyond the first drafted token (EAGLE-3's
"training-time test"), so drafting k steps ahead does not drift.

With ``feature_layers`` (EAGLE-3's fusion of a low, a middle and a high layer) the target also
returns those decoder layers' outputs, and the draft first maps them with the final feature to one
feature, g_t = fuse([n_1(l_t) ; ... ; f_t]), which takes f_t's place above; ``fuse`` starts as the
final feature alone, and the draft's own predictions stand in for g when it drafts ahead.

Initialisation (our choice, for learning online from few records): fc maps [f ; e] -> e and the
layer, norm and head are the target's first layer, final norm and head, so the draft starts as the
one-layer truncated token draft and learns to read the features (normalised to the embeddings'
scale first: unscaled, a target's features dwarf its embeddings and the first updates drown the
token). Lossless by the engine's verification, as every proposer.
"""

from __future__ import annotations

import copy
from typing import Sequence, cast

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel


class FeatureDraft(nn.Module):
    """fc + one decoder layer + norm + head over (target feature, next token) pairs."""

    uses_features = True

    def __init__(self, config, head_rows: int, feature_layers: Sequence[int] | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        cfg = copy.deepcopy(config)
        layers = list(getattr(config, "feature_layers", None) or []) if feature_layers is None else list(feature_layers)
        n_target = getattr(config, "target_layers", None) or config.num_hidden_layers
        if any(not 0 <= i < n_target - 1 for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"feature_layers must be distinct layers of the target before its last (0..{n_target - 2}), got {layers}")
        cfg.feature_layers, cfg.target_layers = layers, n_target  # saved with the draft's config
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:1]
        cfg._attn_implementation = "sdpa"
        self.config = cfg
        self.feature_layers = tuple(layers)
        H = cfg.hidden_size
        self.feature_width = H * (len(layers) + 1)  # what the target returns: [layer outputs ... ; final feature]
        if layers:  # EAGLE-3's fusion: earlier layers' outputs (each normalised) and the final feature -> one feature
            self.layer_norms = nn.ModuleList(LlamaRMSNorm(H, eps=cfg.rms_norm_eps) for _ in layers)
            self.fuse = nn.Linear(self.feature_width, H, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.feature_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)  # features to the embeddings' scale
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layer = LlamaDecoderLayer(cfg, layer_idx=0)
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, head_rows, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)

    # -- what the learner and the runner ask of a draft -------------------------------------------
    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as the draft reads them: [..., feature_width] -> [..., H]. Without
        ``feature_layers`` they are the final features themselves; with them, a learned map of the
        normalised layer outputs and the final feature (it starts as the final feature alone)."""
        if not self.feature_layers:
            return features
        H = self.config.hidden_size
        x = features.to(self.fuse.weight.dtype)
        parts = [norm(x[..., i * H : (i + 1) * H]) for i, norm in enumerate(self.layer_norms)]
        return self.fuse(torch.cat(parts + [x[..., -H:]], dim=-1))

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                past_key_values: DynamicCache | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted features (after the draft's norm) for the pairs (features[b, t], input_ids[b, t]):
        [B, T, H]. ``features`` [B, T, H] are the target's, fused (:meth:`fuse_features`), or the
        draft's own predictions. ``attention_mask``: [B, 1, T, S] additive (None: causal over the cache + T)."""
        f = self.feature_norm(features.to(self.fc.weight.dtype))
        x = self.fc(torch.cat([f, self.embed_tokens(input_ids)], dim=-1))  # [B, T, H]
        B, T, _ = x.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if attention_mask is None and T > 1:
            attention_mask = _causal(T, past, x.dtype, x.device)[None, None].expand(B, 1, T, past + T)
        cache_position = torch.arange(past, past + T, device=x.device)
        pos_emb = self.rotary_emb(x, position_ids)
        h = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                       use_cache=past_key_values is not None, cache_position=cache_position, position_embeddings=pos_emb)
        return self.norm(h)

    def teacher_forced_logits(self, batch: Sequence) -> torch.Tensor:
        """Draft logits at the output positions of ``batch`` (learner ``Sample`` s with features),
        rows in sample order: [N, V_draft]; in training mode two passes, [2, N, V_draft]: on the
        target's features, then on the draft's own predictions of them (shifted by one position).

        The pair (f_j, x_{j+1}) predicts token j + 2; a sample's output positions p = prompt_len..L-1
        are predicted by the pairs j = p - 2 (a sample needs prompt_len >= 2 and features up to L - 3)."""
        return self.teacher_forced(batch, targets=False)[0]

    def teacher_forced(self, batch: Sequence, targets: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`teacher_forced_logits` with the features behind them, for EAGLE's feature loss:
        ``(logits, predicted, target, valid)``. predicted: the draft's feature for each logits row,
        [N, H] ([2, N, H] in training); target: the target's (fused) feature it predicts, f_{j+1} for
        the pair j, [N, H], detached (zeros where not valid); valid: [N] bool, False where the record
        ends before f_{j+1}. ``targets=False``: target and valid are None (not built)."""
        dev = self.fc.weight.device
        rows_b, rows_t, feats, ids, lens, nexts, has_next = [], [], [], [], [], [], []
        for b, s in enumerate(batch):
            L, p0 = int(s.tokens.shape[0]), int(s.prompt_len)
            if s.features is None or p0 < 2 or s.features.shape[0] < L - 2:
                raise ValueError("a feature draft trains on records with the target's features (prompt_len >= 2)")
            if s.features.shape[-1] != self.feature_width:
                raise ValueError(f"the draft reads features of width {self.feature_width} (feature_layers "
                                 f"{list(self.feature_layers)}), a record has {s.features.shape[-1]}")
            n = L - 2  # pairs j = 0..L-3
            feats.append(s.features[:n].float())
            ids.append(s.tokens[1 : n + 1].long())
            lens.append(n)
            rows_b.append(torch.full((L - p0,), b))
            rows_t.append(torch.arange(p0 - 2, L - 2))
            if targets:  # row p (pair j = p - 2) predicts f_{p-1}, where the record has it
                at, have = torch.arange(p0 - 1, L - 1), s.features.shape[0]
                has_next.append(at < have)
                nexts.append(torch.where(has_next[-1][:, None], s.features[at.clamp(max=have - 1)].float(), 0.0))
        W = max(lens)
        F = torch.zeros(len(batch), W, self.feature_width, device=dev)
        X = torch.zeros(len(batch), W, dtype=torch.long, device=dev)
        for b, (f, x) in enumerate(zip(feats, ids)):
            F[b, : len(x)], X[b, : len(x)] = f.to(dev), x.to(dev)
        pos = torch.arange(W, device=dev).expand(len(batch), W)
        mask = _causal(W, 0, F.dtype, dev)[None, None].expand(len(batch), 1, W, W)  # padding sits after: harmless
        rb, rt = torch.cat(rows_b).to(dev), torch.cat(rows_t).to(dev)
        G = self.fuse_features(F)  # [B, W, H]
        first = self(G, X, pos, attention_mask=mask)  # [B, W, H] predicted f_{j+1}
        target = valid = None
        if targets:
            valid = torch.cat(has_next).to(dev)  # [N]
            with torch.no_grad():
                target = self.fuse_features(torch.cat(nexts).to(dev))  # [N, H] (rows not valid: zeros)
        if not self.training:
            pred = first[rb, rt]  # [N, H]
            return self.lm_head(pred), pred, target, valid
        own = torch.cat([G[:, :1], first[:, :-1].detach()], dim=1)  # pair j reads the draft's own f^_j (j >= 1)
        second = self(own, X, pos, attention_mask=mask)
        pred = torch.stack([first[rb, rt], second[rb, rt]])  # [2, N, H]
        return self.lm_head(pred), pred, target, valid


def _causal(T: int, past: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """[T, past + T] additive mask: new row i sees the cache and new rows 0..i."""
    m = torch.full((T, past + T), torch.finfo(dtype).min, dtype=dtype, device=device)
    return m.triu(past + 1)


def feature_draft(target: PreTrainedModel, keep_ids: torch.Tensor | None = None,
                  feature_layers: Sequence[int] = ()) -> FeatureDraft:
    """A feature draft initialised from ``target`` (see the module docstring); ``keep_ids``
    restricts the head to those target tokens (then map proposals back with ``vocab_map=keep_ids``).
    ``feature_layers``: target layers (0-based, before the last) whose outputs it reads besides the
    final feature (EAGLE-3 fuses a low, a middle and a high one); the fusion starts as the final
    feature alone."""
    head = target.get_output_embeddings().weight.detach()
    head = head[keep_ids] if keep_ids is not None else head
    draft = FeatureDraft(target.config, head.shape[0], feature_layers)
    H = target.config.hidden_size
    with torch.no_grad():
        emb = cast(torch.Tensor, target.get_input_embeddings().weight)
        draft.embed_tokens.weight.copy_(emb)
        draft.feature_norm.weight.fill_(float(emb.float().pow(2).mean().sqrt()))  # an embedding's RMS
        if draft.feature_layers:
            n = len(draft.feature_layers)
            draft.fuse.weight.copy_(torch.cat([torch.zeros(H, n * H), torch.eye(H)], dim=1))
        draft.fc.weight.copy_(torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1))  # e: the feature is learned in
        draft.layer.load_state_dict(target.get_decoder().layers[0].state_dict())
        draft.norm.load_state_dict(target.get_decoder().norm.state_dict())
        draft.lm_head.weight.copy_(head)
    return draft.eval()
