"""A causal LM plus per-sequence KV caches addressed by id.

Both the target and a learned draft are driven through :class:`ModelRunner`. A call says
where the caller's trusted prefix ends (``start``): the cache is cropped back to it first, so
rejected draft positions are dropped lazily, on the next call, and a runner never needs to
know about acceptance. This is also the shape a remote (Ray) target needs: each call is
self-describing, per-request state lives here keyed by id, and ``forward_batch`` takes the
calls of several concurrent requests at once.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from .adapters import base_memo, load_state
from .models import eos_token_ids
from .summary import summarise


@dataclass(frozen=True)
class ForwardCall:
    """Extend sequence ``seq_id`` from position ``start`` with ``tokens``; return the last ``keep_last`` rows."""

    seq_id: str
    start: int
    tokens: list[int]
    keep_last: int = 1


@dataclass(frozen=True)
class VerifyCall:
    """One speculative step's request to the target: extend ``seq_id`` from ``start`` with
    ``tokens`` (the uncached suffix + the k draft tokens) and score the last ``rows`` = k + 1
    positions. ``full_rows``: the whole logits rows come back (rejection sampling needs p over the
    vocabulary); greedy needs only the argmax, and the learner the top-K."""

    seq_id: str
    start: int
    tokens: list[int]
    rows: int
    full_rows: bool = False
    top_k: int = 16
    features: bool = False  # also return the target's features at every fed position (feature drafts)
    #: with ``features``: decoder layers (0-based) whose outputs come first, then the final feature
    #: (a draft that fuses several of the target's layers, EAGLE-3)
    feature_layers: tuple[int, ...] = ()


@dataclass
class TargetRows:
    """The target's answer to a :class:`VerifyCall`, small enough to cross a process hop.

    Row i scores the token after the call's first ``len(tokens) - rows + i + 1`` new tokens.
    """

    argmax: torch.Tensor  # [rows] long
    top_ids: torch.Tensor  # [rows, K] long: target distribution at temperature 1 (learner signal)
    top_probs: torch.Tensor  # [rows, K] float
    tail: torch.Tensor  # [rows] float: 1 - sum(top_probs)
    logits: torch.Tensor | None  # [rows, V] float when the call asked for full rows, else None
    seconds: float = 0.0  # the target's compute time for the forward this call was part of
    batch: int = 1  # calls in that forward
    #: [len(tokens), H] float16 when the call asked: the hidden state the target's head reads (after
    #: the final norm) at each fed position, what a feature-conditioned draft proposes from; with
    #: ``feature_layers``, those layers' outputs first: [len(tokens), (len(feature_layers) + 1) H]
    features: torch.Tensor | None = None


def target_rows(logits: torch.Tensor, call: VerifyCall, seconds: float = 0.0, batch: int = 1,
                features: torch.Tensor | None = None) -> TargetRows:
    """Compact the logits of one call ([rows, V]) into what the engine needs."""
    argmax, ids, probs, tail = summarise(logits, call.top_k)
    feats = features.to(torch.float16) if call.features and features is not None else None
    return TargetRows(argmax, ids, probs, tail, logits if call.full_rows else None, seconds, batch, feats)


def _select(features: torch.Tensor, have: list[int], want: tuple[int, ...]) -> torch.Tensor:
    """From features over the layers ``have`` (then the final one), those of ``want`` in its order,
    then the final one: [T, (len(have) + 1) H] -> [T, (len(want) + 1) H]."""
    if list(want) == have:
        return features
    chunks = features.chunk(len(have) + 1, dim=-1)
    return torch.cat([chunks[have.index(i)] for i in want] + [chunks[-1]], dim=-1)


@contextlib.contextmanager
def layer_outputs(model: PreTrainedModel, layers: Sequence[int]):
    """While open, each forward of ``model`` records the outputs of its decoder ``layers``
    (0-based) in the yielded dict, layer -> [B, T, H] (the latest forward's): what a fusing feature
    draft reads besides the final feature."""
    seen: dict[int, torch.Tensor] = {}
    blocks = model.get_decoder().layers

    def keep(i):
        return lambda _m, _i, out: seen.__setitem__(i, out.detach())

    hooks = [blocks[i].register_forward_hook(keep(i)) for i in layers]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def fused_features(layer_out: dict[int, torch.Tensor], final: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """The features a call asked for: the outputs of ``layers`` in that order, then the final
    feature, concatenated on the last dimension ([..., (len(layers) + 1) H])."""
    return torch.cat([layer_out[i] for i in layers] + [final], dim=-1) if layers else final


def verify_groups(calls: list[VerifyCall], max_batch_tokens: int) -> list[list[int]]:
    """The forwards a verify runs, as indices into ``calls``: the short calls (decode and verify
    steps) together, then each call longer than ``max_batch_tokens`` (a prefill) alone."""
    short = [i for i, c in enumerate(calls) if len(c.tokens) <= max_batch_tokens]
    return ([short] if short else []) + [[i] for i, c in enumerate(calls) if len(c.tokens) > max_batch_tokens]


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

    def attach_prefix(self, seq_id: str, tokens: list[int], salt: str | None = None) -> int:
        """Positions of ``tokens`` already cached for a new sequence (a runtime with prefix caching,
        :class:`speculative.kvcache.PooledCaches`); none here."""
        return 0

    def limit_prefix_cache(self, tokens: int | None) -> None:
        """Bound the cached prefixes no sequence holds (a runtime with prefix caching); none here."""

    def release(self, seq_id: str) -> None:
        self._caches.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._caches)

    # -- compute ------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seq_id: str, start: int, tokens: list[int], keep_last: int = 1) -> torch.Tensor:
        """Logits for the last ``keep_last`` of ``tokens`` placed at positions start.. : [keep_last, V_model]."""
        cache, have = self._cached(seq_id, start, tokens)
        if cache is None or start == 0:
            cache = self._caches[seq_id] = DynamicCache(config=self.model.config)
        elif start < have:
            cache.crop(start - have)  # negative: drop the (have - start) rejected positions
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=keep_last)
        return out.logits[0, -keep_last:].float().cpu()  # [keep_last, V_model], on the CPU (acceptance runs there)

    def forward_batch_features(self, calls: list[ForwardCall], layers: tuple[int, ...] = ()
                               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`forward_batch`, plus each call's features: the hidden state after the final norm
        (what the head reads) at every one of its tokens, [len(tokens), H] float32; with ``layers``,
        those decoder layers' outputs first, [len(tokens), (len(layers) + 1) H]."""
        norm = self.model.get_decoder().norm
        seen: list[torch.Tensor] = []
        hook = norm.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
        try:
            with layer_outputs(self.model, layers) as inner:
                if len(calls) == 1:
                    logits = [self.forward(calls[0].seq_id, calls[0].start, calls[0].tokens, calls[0].keep_last)]
                else:
                    logits = self.forward_batch(calls)
        finally:
            hook.remove()
        feats = fused_features(inner, seen[-1], layers)  # [B, T, (len(layers) + 1) H], right-padded rows
        return logits, [feats[b, : len(c.tokens)].float().cpu() for b, c in enumerate(calls)]

    @property
    def batch_key(self) -> tuple:
        """Runners of equal keys can run their calls in one forward (:meth:`forward_with`); a
        runner shares it with no other but those sharing its packed base (the fast path's)."""
        return ("runner", id(self))

    def share_memo(self) -> dict[int, torch.Tensor]:
        """``copy.deepcopy``'s memo that makes a copy of anything holding this runner share its
        base (every tensor but the adapters') instead of copying it: a replica's engines of several
        drafts then cost their adapters (and caches), not another model each."""
        return base_memo(self.model)

    def forward_with(self, pairs: list[tuple["ModelRunner", ForwardCall]]) -> list[torch.Tensor]:
        """The calls of the runners of this one's :attr:`batch_key`, ``(runner, call)``, in one
        forward; each call's rows as its runner gives them. Here: this runner's own calls only."""
        if any(runner is not self for runner, _ in pairs):
            raise ValueError(f"{self.name}: calls of another runner")
        return self.forward_batch([c for _, c in pairs])

    @torch.inference_mode()
    def forward_batch(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """The calls of several sequences in **one** forward: each call's cached prefix is
        left-padded to the longest, its new tokens right-padded to the longest, with a mask that
        keeps the real positions and per-sequence position ids. Returns each call's last
        ``keep_last`` rows ([keep_last, V_model]); the new KV entries go back to each sequence.

        Results equal :meth:`forward` up to float rounding (other GEMM shapes); a single call runs
        unpadded. Two calls for one sequence in a batch are refused."""
        if len(calls) == 1:
            c = calls[0]
            return [self.forward(c.seq_id, c.start, c.tokens, c.keep_last)]
        if len({c.seq_id for c in calls}) != len(calls):
            raise ValueError(f"{self.name}: a batch holds two calls for one sequence")
        past = [self._prefix(c) for c in calls]  # per call: its cache (read up to c.start) or None
        plen = [c.start for c in calls]  # [B] cached positions kept
        tlen = [len(c.tokens) for c in calls]  # [B] new tokens
        P, T, B = max(plen), max(tlen), len(calls)
        dev = self.device
        ids = torch.zeros(B, T, dtype=torch.long, device=dev)  # [B, T] right-padded new tokens
        pos = torch.zeros(B, T, dtype=torch.long, device=dev)  # [B, T] true positions
        keep = torch.zeros(B, P + T, dtype=torch.long, device=dev)  # [B, P+T] 1 = a real position
        for b, c in enumerate(calls):
            ids[b, : tlen[b]] = torch.tensor(c.tokens, dtype=torch.long)
            pos[b] = torch.arange(c.start, c.start + T)
            keep[b, P - plen[b] : P + tlen[b]] = 1
        cache = DynamicCache(config=self.model.config)
        if P:
            ref: DynamicCache = next(p for p in past if p is not None)  # a cached sequence: shapes and dtype of a KV row
            for layer in range(self.model.config.num_hidden_layers):
                ks, vs = [], []
                for b in range(B):
                    own = past[b]
                    k, v = self._layer_kv(own if own is not None else ref, layer, plen[b])  # [1, H, plen, D]
                    pad = P - plen[b]
                    ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                    vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
                cache.update(torch.cat(ks), torch.cat(vs), layer)  # [B, H, P, D]
        out = self.model(input_ids=ids, attention_mask=keep, position_ids=pos, past_key_values=cache, use_cache=True)
        logits = out.logits.float().cpu()  # [B, T, V]
        results = []
        for b, c in enumerate(calls):
            new = DynamicCache(config=self.model.config)
            lo, hi = P - plen[b], P + tlen[b]  # this sequence's real positions in the batch cache
            for layer in range(len(cache.layers)):
                k, v = self._layer_kv(cache, layer, hi)
                new.update(k[b : b + 1, :, lo:].clone(), v[b : b + 1, :, lo:].clone(), layer)
            self._caches[c.seq_id] = new
            results.append(logits[b, tlen[b] - c.keep_last : tlen[b]])
        return results

    def _cached(self, seq_id: str, start: int, tokens: list[int]):
        """(the sequence's cache or None, its cached positions), refusing an empty call and a start
        past what is cached. Caches are anything with ``get_seq_length()``."""
        if not tokens:
            raise ValueError("forward needs at least one token")
        cache = self._caches.get(seq_id)
        have = 0 if cache is None else cache.get_seq_length()
        if start > have:
            raise ValueError(f"{self.name}: sequence {seq_id!r} has {have} cached positions, cannot start at {start}")
        return cache, have

    def _prefix(self, c: ForwardCall) -> DynamicCache | None:
        cache, _ = self._cached(c.seq_id, c.start, c.tokens)
        return cache if c.start else None

    @staticmethod
    def _layer_kv(cache: DynamicCache, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` positions of one layer's keys and values ([B, H, n, D] each)."""
        kv: Any = cache.layers[layer]  # a full-attention layer: keys and values are tensors
        return kv.keys[:, :, :n], kv.values[:, :, :n]

    def verify(self, calls: list[VerifyCall], max_batch_tokens: int = 64) -> list[TargetRows]:
        """Score the steps of several requests: short calls (decode steps) share one padded
        forward; long ones (prefills over ``max_batch_tokens``) run alone, so that one prompt does
        not pad every other sequence to its length."""
        out: list[TargetRows | None] = [None] * len(calls)
        for group in verify_groups(calls, max_batch_tokens):
            t0 = time.perf_counter()
            fwd = [ForwardCall(calls[i].seq_id, calls[i].start, calls[i].tokens, calls[i].rows) for i in group]
            feats: list[torch.Tensor | None]
            if any(calls[i].features for i in group):
                layers = sorted({j for i in group if calls[i].features for j in calls[i].feature_layers})
                logits, fused = self.forward_batch_features(fwd, tuple(layers))
                feats = [_select(f, layers, calls[i].feature_layers) for i, f in zip(group, fused)]
            else:
                logits = self.forward_batch(fwd)
                feats = [None for _ in group]
            seconds = time.perf_counter() - t0
            for i, lg, f in zip(group, logits, feats):
                out[i] = target_rows(lg, calls[i], seconds, len(group), f)
        return out  # type: ignore[return-value]

    def warmup(self, batches: tuple[int, ...] = (1,)) -> int:
        """Prepare the steps of up to ``batches`` sequences ahead of serving (a runtime with CUDA
        graphs captures them here, not on a request); returns how many were prepared. Eager: none."""
        return 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_ids(self) -> set[int]:
        return eos_token_ids(None, self.model)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    # -- weights ------------------------------------------------------------------------
    def drop_float_weights(self) -> int:
        """A runtime that computes from its own packed copy frees the float weights it was made
        from (for a runner that will never take new weights, a target); this one computes from
        them, so it keeps them. Returns the bytes let go."""
        return 0

    def load_state_dict(self, state: dict) -> None:
        """New weights, between steps (never during one): adapters only, or a whole draft
        (:func:`speculative.adapters.load_state`). Accepts tensors or numpy arrays."""
        try:
            load_state(self.model, {k: torch.as_tensor(v) for k, v in state.items()})
        except KeyError as e:
            raise KeyError(f"{self.name}: {e.args[0]}") from None
