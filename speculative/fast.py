"""The fast CPU path: int4 (or int8) weights, our own lean Llama forward, preallocated KV caches.

Why this design (each kernel timed over all linear layers of SmolLM2-135M by ``python -m
bench.kernels``; the figures are in docs/fast.md):
  - float32 ``F.linear`` is several times slower than any packed kernel;
  - torch's fbgemm dynamic int8 (``quantize_dynamic``) is fast, but its activation scale is one per
    *call*, so a row's result depends on the other rows in the call: verifying k + 1 tokens at
    once would not give the logits of decoding them one by one, and greedy equality with the
    target alone would hold only up to luck;
  - ``torch._int_mm`` with per-row int8 activation scales, and ``aten._weight_int8pack_mm`` (int8
    weights, one scale per output row, bfloat16 activations), are slower than 4 bits;
  - ``aten._weight_int4pack_mm_for_cpu`` (4-bit groups of 32, bfloat16 activations) is the fastest
    of torch's; the embedded GGUF's layers are Q4_1, i.e. 4-bit groups of 32;
  - our native kernels (:mod:`speculative.qmatmul`: rows rounded to 8 bits a group of 32, integer
    dot products, as llama.cpp does for Q4_1), the default where a C compiler is found, take about
    half of torch's int4 time from 8 rows up (docs/fast.md, "The native matrix kernels").
All these weight-only kernels compute each output row from its input row alone: bitwise the same
whatever else shares the call. int4 is the default (``quantize: auto``), the head stays in 8 bits.
Hugging Face's eager Llama around those kernels makes 211 linear calls a step, grows its cache with
a ``torch.cat`` per layer and builds masks, so :class:`FastRunner` runs its own
forward over the same weights: fused q/k/v and gate/up projections (121 kernel calls a step),
KV caches in fixed blocks of one preallocated 16-bit pool (:mod:`speculative.kvcache`), and sequences of a batch concatenated row-wise (ragged, no
padding: the linear layers see every row of every sequence in one call; each row attends to its
own sequence's keys). Where the native kernels build, a step's decoder layers run in one native call
(:mod:`speculative.fused`: the same kernels, bitwise the same rows as the layer-by-layer path).

Exactness: every op is row-wise except attention, which runs in float64 over the cached keys and
values (stored in 16 bits, rounded once when written) and is rounded to float32 after. The native
kernel (:mod:`speculative.attend`, the default) computes each row alone in one fixed order, so a
row's logits are bitwise the same whether it is decoded alone, verified with k others, prefilled
with its prompt or batched with other sequences; the torch attention (where the kernel cannot be
built) gets there to ~1e-16 relative before the rounding.
The served target *is* this model: greedy speculative output equals its own target-only output,
and rejection sampling draws from its distribution. The float32 Hugging Face model stays one flag
away (``ModelConfig.quantize = "none"``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, cast

import torch
from torch import nn
from transformers import PreTrainedModel

from .adapters import fused_delta, has_adapters, is_adapter_key
from .attend import PagedAttention, load_kernel, load_rope, rope_kv
from .fused import load_layers, load_silu, run_layers, silu_mul
from .kvcache import BlockPool, PooledCaches, SeqCache, as_float64
from .qmatmul import GROUP, load_q4, load_q8, load_rms, pack_q4, pack_q8, q4_mm, q8_mm, rms_norm
from .runner import ForwardCall, ModelRunner
from .shape import FastPathError, supports_fast_path


def _fused_bias(linears) -> tuple[torch.Tensor | None, list[int]]:
    """(the stacked biases of fused linears, zeros where one has none; None if none has one), and
    each linear's share of the output columns."""
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias.detach().float() if lin.bias is not None else torch.zeros(lin.out_features)
                          for lin in linears])
    return bias, [lin.out_features for lin in linears]


def _adapter_of(linears) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused low-rank adapter of ``linears`` in float64 (A [r, K], B [N, r]), or None."""
    delta = fused_delta(linears)
    return None if delta is None else (delta[0].double(), delta[1].double())


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, parts) -> torch.Tensor:
    """The packed product ``y`` plus the bias and each row range's adapter update B (A x): ``parts``
    holds (first row, end row, adapter or None). The update runs in float64 and is rounded once:
    a row's result stays the same whatever other rows share the call."""
    if bias is not None:
        y = y + bias
    for r0, r1, adapter in parts:
        if adapter is None:
            continue
        a, b = adapter
        y[r0:r1] += ((x[r0:r1].double() @ a.t()) @ b.t()).float()  # (y is this call's own product)
    return y


class _PackedLinear(nn.Module):
    """What the packed linears share: their buffers are tensors, and the linears' low-rank
    adapters ride beside the packed product."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    adapter: tuple[torch.Tensor, torch.Tensor] | None

    def set_adapter(self, linears) -> None:
        """Take the linears' low-rank adapters (:mod:`speculative.adapters`), or none."""
        self.adapter = _adapter_of(linears)

    def _product(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] float -> [M, N] float32, no bias nor adapter
        raise NotImplementedError

    def forward(self, x: torch.Tensor, adapters: list[tuple[int, int, tuple | None]] | None = None) -> torch.Tensor:
        """x [M, K] -> y [M, N] float32. ``adapters``: (first row, end row, adapter or None) for
        rows that take other adapters than this linear's own (sequences of several drafts sharing
        this packed base in one forward); None: this linear's own adapter for every row."""
        parts = [(0, x.shape[0], self.adapter)] if adapters is None else adapters
        return _finish(self._product(x), x, self.bias, parts)


class Int8Linear(_PackedLinear):
    """y = x W^T + b with W in 8 bits. Two kernels, each computing an output row from its input row
    alone:
      - the native one (:mod:`speculative.qmatmul`, the default where it builds and the input width
        is a multiple of 32): W symmetric per group of 32 inputs, the scale amax / 127 in float16,
        like llama.cpp's Q8_0 (the embedded GGUF's embeddings, which the head shares: the served
        head holds them exactly); x rounded to 8 bits per group of 32, integer dot products,
        outputs padded to 16;
      - torch's ``aten._weight_int8pack_mm``: one scale per output row (symmetric, amax / 127), x
        rounded to bfloat16, the scale too.
    y comes back in float32. Several linears of the same input fuse into one (their rows stacked),
    which gives the same numbers as running them apart."""

    scale: torch.Tensor
    wsum: torch.Tensor

    def __init__(self, *linears: nn.Linear, native: bool = True):
        super().__init__()
        w = torch.cat([lin.weight.detach().float() for lin in linears])  # [N, K]
        n, k = w.shape
        self.in_features, self.out_features = k, n
        self.kernel = load_q8() if native and k % GROUP == 0 else None
        if self.kernel is None:
            scale = w.abs().amax(1).clamp_min(1e-12) / 127  # [N]
            self.register_buffer("weight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous())
            self.register_buffer("scale", scale.to(torch.bfloat16))
        else:
            w = torch.cat([w, w.new_zeros(-n % 16, k)])  # [N + pad, K]
            groups = w.view(w.shape[0], k // GROUP, GROUP)  # [N', K/32, 32]
            d = (groups.abs().amax(-1) / 127).half().float()  # [N', K/32]
            q = torch.where(d[..., None] > 0, groups / d[..., None], torch.zeros_like(groups))
            w8, wsum, d8 = pack_q8(q.round().clamp(-127, 127).to(torch.int8).view(w.shape), d)
            self.register_buffer("weight", w8)  # (the kernel's layout)
            self.register_buffer("wsum", wsum)
            self.register_buffer("scale", d8)
        self.bias, self.splits = _fused_bias(linears)
        self.set_adapter(linears)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return q8_mm(self.kernel, self.weight, self.wsum, self.scale, x)[:, : self.out_features]
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scale).float()


class Int4Linear(_PackedLinear):
    """y = x W^T + b with W in 4 bits, asymmetric per group of ``group`` inputs (a scale and a
    minimum per group, like llama.cpp's Q4_1 blocks of 32: the embedded GGUF's weights are Q4_1, so
    a group holds them up to the rounding of its scale and minimum). Two kernels, each computing an
    output row from its input row alone:
      - the native one (:mod:`speculative.qmatmul`, the default where it builds): x rounded to 8
        bits per group of 32, integer dot products; scale and minimum in float16;
      - torch's ``aten._weight_int4pack_mm_for_cpu`` (``native=False``, or no compiler): x rounded
        to bfloat16; scale and minimum in bfloat16.
    Output rows are padded to a multiple of 16 (both kernels' tile). Fuses several linears like
    :class:`Int8Linear`."""

    dm: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, *linears: nn.Linear, group: int = 32, native: bool = True):
        super().__init__()
        w = torch.cat([lin.weight.detach().float() for lin in linears])  # [N, K]
        n, k = w.shape
        if k % group:
            raise FastPathError(f"int4 needs input widths divisible by {group}, got {k}")
        pad = -n % 16
        w = torch.cat([w, w.new_zeros(pad, k)])  # [N + pad, K]
        groups = w.view(w.shape[0], k // group, group)  # [N', K/g, g]
        lo, hi = groups.amin(-1), groups.amax(-1)  # [N', K/g]
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(w.shape)
        self.kernel = load_q4() if native and group == GROUP else None
        if self.kernel is not None:
            wq, dm = pack_q4(q, scale, lo)
            self.register_buffer("weight", wq)  # (the kernel's layout)
            self.register_buffer("dm", dm)
        else:
            # the kernel computes (q - 8) * scale + zero: zero = lo + 8 * scale
            self.register_buffer("scales_zeros", torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(torch.bfloat16).contiguous())
            self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.group, self.in_features, self.out_features = group, k, n
        self.bias, self.splits = _fused_bias(linears)
        self.set_adapter(linears)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = q4_mm(self.kernel, self.weight, self.dm, x)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.weight, self.group, self.scales_zeros)
        return y[:, : self.out_features].float()


class FastRunner(PooledCaches, ModelRunner):
    """A :class:`ModelRunner` (same calls: ``forward``, ``forward_batch``, ``verify``, caches by
    id) over an int4 / int8 copy of a Llama-style model. ``model`` stays the float model: what the
    learner trains and what :meth:`load_state_dict` loads into; the packed copy is rebuilt from it."""

    ragged = True  # a batch's rows are concatenated, never padded: one forward costs its real tokens
    float_dropped = False  # drop_float_weights() ran: the packed copy is all there is

    def __init__(self, model: PreTrainedModel, vocab_map: torch.Tensor | None = None, name: str = "model",
                 bits: int = 4, head_bits: int = 8, kv_tokens: int = 32768, kv_dtype: str = "float16",
                 block_tokens: int = 16, native: bool = True):
        if bits not in (4, 8) or head_bits not in (4, 8):
            raise FastPathError(f"{name}: the fast path has int4 and int8 weights, not {bits} / {head_bits} bits")
        why = supports_fast_path(model)
        if why:
            raise FastPathError(f"{name}: cannot use the fast path: {why}")
        super().__init__(model, vocab_map, name)
        cfg = model.config
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.bits, self.head_bits = bits, head_bits
        #: the native int4 / int8 kernels (:mod:`speculative.qmatmul`) where they build; False: torch's
        self.native = native
        #: the native RMSNorm (one call a norm; :mod:`speculative.qmatmul`), or None: torch's
        self.rms_kernel = load_rms() if native else None
        #: every sequence's keys and values: ``kv_tokens`` positions in all, in fixed blocks
        self.pool = BlockPool(self.n_layers, self.n_kv, self.head_dim, kv_tokens, block_tokens, kv_dtype)
        self._caches: dict[str, SeqCache] = {}  # type: ignore[assignment]
        #: the native attention over the pool (:mod:`speculative.attend`, 16-bit pools); None: the torch attention
        self.attention_kernel = load_kernel() if self.pool.kv.element_size() == 2 else None
        #: the native rotary embedding and pool write (:func:`speculative.attend.rope_kv`; bitwise
        #: torch's, in one call a layer instead of a dozen), or None: torch's ops
        self.rope_kernel = load_rope() if native and self.pool.kv.element_size() == 2 else None
        #: the native gated activation (:mod:`speculative.fused`; both paths use it), or None: torch's
        self.silu_kernel = load_silu() if native else None
        #: every decoder layer in one native call a step (:mod:`speculative.fused`), or None
        self.layers_kernel = load_layers() if native else None
        self.inter = cfg.intermediate_size
        self._quantise()

    def _quantise(self) -> None:
        m = self.model

        def lin(*linears: nn.Linear) -> _PackedLinear:  # int4 where the input width allows groups of 32
            if self.bits == 4 and linears[0].in_features % 32 == 0:
                return Int4Linear(*linears, native=self.native)
            return Int8Linear(*linears, native=self.native)

        self.layers = [
            (layer.input_layernorm, lin(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
             lin(layer.self_attn.o_proj), layer.post_attention_layernorm,
             lin(layer.mlp.gate_proj, layer.mlp.up_proj), lin(layer.mlp.down_proj))
            for layer in m.model.layers
        ]
        # a target's head in 8 bits, as the GGUF keeps its embeddings (Q8_0): teacher-forced top-1
        # agreement with the float32 model on its own greedy outputs is 97.3% so, 91.8% with a 4-bit
        # head (python -m bench.quality). A draft's head may take 4 bits: its precision moves
        # acceptance, never the output.
        self.head = lin(m.lm_head) if self.head_bits == 4 else Int8Linear(m.lm_head, native=self.native)
        self._sources: list[tuple[_PackedLinear, tuple[nn.Module, ...]]] = [(packed, srcs) for layer, (_, qkv, o, _, gu, d) in zip(m.model.layers, self.layers)
                         for packed, srcs in ((qkv, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
                                              (o, (layer.self_attn.o_proj,)), (gu, (layer.mlp.gate_proj, layer.mlp.up_proj)),
                                              (d, (layer.mlp.down_proj,)))] + [(self.head, (m.lm_head,))]
        self._table = self._layer_table()

    def _layer_table(self) -> torch.Tensor | None:
        """The addresses :func:`speculative.fused.run_layers` reads (weights, norms, pool layers),
        or None where the one native call does not cover this model: a kernel missing, a projection
        in 8 bits, with a bias, padded outputs or adapters, norms of other epsilons or dtypes."""
        if None in (self.layers_kernel, self.silu_kernel, self.rms_kernel, self.attention_kernel, self.rope_kernel):
            return None
        if len({_eps(n) for layer in self.layers for n in (layer[0], layer[3])}) != 1:
            return None
        rows: list[int] = []
        for (norm1, qkv, o, norm2, gate_up, down), kv in zip(self.layers, self.pool.kv):
            for lin in (qkv, o, gate_up, down):
                if (not isinstance(lin, Int4Linear) or lin.kernel is None or lin.bias is not None or lin.adapter is not None
                        or lin.weight.shape[0] * 16 != lin.out_features):
                    return None
            w1, w2 = (cast(torch.Tensor, n.weight).detach() for n in (norm1, norm2))
            if any(w.dtype != torch.float32 or not w.is_contiguous() for w in (w1, w2)):
                return None
            q4 = [cast(Int4Linear, lin) for lin in (qkv, o, gate_up, down)]
            rows += [w1.data_ptr(), q4[0].weight.data_ptr(), q4[0].dm.data_ptr(), q4[1].weight.data_ptr(), q4[1].dm.data_ptr(),
                     w2.data_ptr(), q4[2].weight.data_ptr(), q4[2].dm.data_ptr(), q4[3].weight.data_ptr(),
                     q4[3].dm.data_ptr(), kv.data_ptr()]
        return torch.tensor(rows, dtype=torch.int64)

    @contextlib.contextmanager
    def layer_by_layer(self) -> Iterator["FastRunner"]:
        """Steps inside take the layer-by-layer path (the one call set aside): what the profiler
        and the benches time kernel by kernel, or against the one call."""
        table, self._table = self._table, None
        try:
            yield self
        finally:
            self._table = table

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_table"] = None  # addresses of this runner's tensors: a copy builds its own
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._table = self._layer_table()

    def drop_float_weights(self) -> int:
        """Free the float projections the packed copy was made from; returns the bytes let go
        (424 MB for SmolLM2-135M's target). For a runner that will never take new weights (a
        target): :meth:`load_state_dict` refuses afterwards. Embeddings, norms and the head stay,
        copied into memory of their own: a loader's file mapping lives as long as any tensor on it
        does, with every page of it that was read (the whole file, once the projections were packed)."""
        freed = 0
        for layer in self.model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                freed += lin.weight.numel() * lin.weight.element_size()
                lin.weight = nn.Parameter(lin.weight.new_empty(0), requires_grad=False)
        for t in [*self.model.parameters(), *self.model.buffers()]:
            t.data = t.data.clone()
        self.float_dropped = True
        self._table = self._layer_table()  # the norms' weights moved
        return freed

    def load_state_dict(self, state: dict) -> None:
        """New weights: a whole state packs the model again; a state of adapters only (what an
        adapter learner publishes) swaps the adapters and leaves the packed base as it is."""
        if self.float_dropped:
            raise RuntimeError(f"{self.name}: its float weights were dropped (a target's); it takes no new weights")
        self.pool.drop_index()  # cached prefixes were computed by the old weights
        if state and all(is_adapter_key(k) for k in state):
            added = not has_adapters(self.model)
            super().load_state_dict(state)  # (adds the adapters to the float model the first time)
            if added:
                self._quantise()
            for packed, srcs in self._sources:
                packed.set_adapter(srcs)
            self._table = self._layer_table()
            return
        super().load_state_dict(state)
        self._quantise()

    # -- compute ------------------------------------------------------------------------
    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm of rows x [R, hidden] float32: natively (one call) or torch's."""
        if self.rms_kernel is None:
            return _rms(norm, x)
        return rms_norm(self.rms_kernel, x, cast(torch.Tensor, norm.weight).detach(), _eps(norm))

    @torch.inference_mode()
    def forward(self, seq_id: str, start: int, tokens: list[int], keep_last: int = 1) -> torch.Tensor:
        """Logits for the last ``keep_last`` of ``tokens`` placed at positions start.. : [keep_last, V_model]."""
        return self.forward_batch([ForwardCall(seq_id, start, tokens, keep_last)])[0]

    def forward_batch(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """Several sequences in one pass: their new rows concatenated ([sum T, hidden]) through every
        linear layer, attention per sequence against its own cache. Each call's result is the same
        as alone. Returns each call's last ``keep_last`` rows ([keep_last, V_model])."""
        return self._batch(calls, False)[0]

    def forward_batch_features(self, calls: list[ForwardCall], layers: tuple[int, ...] = ()
                               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`forward_batch`, plus each call's features after the final norm, [len(tokens), H]
        float32; with ``layers``, those decoder layers' outputs first, [len(tokens), (len(layers) + 1) H]."""
        logits, feats = self._batch(calls, True, layers)
        assert feats is not None  # asked for
        return logits, feats

    @property
    def batch_key(self) -> tuple:
        """Runners with equal keys share one packed base (the same packed tensors: engines of
        several drafts copied from one start with :meth:`share_memo`) and may run their calls in one
        forward (:meth:`forward_with`), each row with its own runner's adapters, caches and pool."""
        return ("fast", *(t.data_ptr() for t in self._packed_tensors()))

    def _packed_tensors(self) -> list[torch.Tensor]:
        packed = [p for layer in self.layers for p in (layer[1], layer[2], layer[4], layer[5])] + [self.head]
        return [t for p in packed for t in (*p.buffers(), p.bias) if t is not None]

    def share_memo(self) -> dict[int, torch.Tensor]:
        """The float base's tensors and the packed products' (every one but the adapters')."""
        return super().share_memo() | {id(t): t for t in self._packed_tensors()}

    def forward_with(self, pairs: list[tuple["ModelRunner", ForwardCall]]) -> list[torch.Tensor]:
        """The calls of several runners of this one's :attr:`batch_key` in one forward, each call's
        rows as its own runner gives them alone (its adapters, its caches): [keep_last, V_model] each,
        in the order of ``pairs``."""
        runners: dict[int, FastRunner] = {}
        calls: dict[int, list[ForwardCall]] = {}
        key = self.batch_key
        for runner, call in pairs:
            if not isinstance(runner, FastRunner) or runner.batch_key != key:
                raise ValueError(f"{self.name}: {runner.name} does not share this runner's packed base")
            runners.setdefault(id(runner), runner)
            calls.setdefault(id(runner), []).append(call)
        rows = iter(self._run([(runners[k], calls[k]) for k in runners], False)[0])
        by_runner = {k: iter([next(rows) for _ in calls[k]]) for k in runners}
        return [next(by_runner[id(runner)]) for runner, _ in pairs]

    def _batch(self, calls: list[ForwardCall], features: bool, layers: tuple[int, ...] = ()
               ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        return self._run([(self, calls)], features, layers)

    @torch.inference_mode()
    def _run(self, segments: list[tuple["FastRunner", list[ForwardCall]]], features: bool, layers: tuple[int, ...] = ()
             ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The forward of ``segments``: (runner, its calls), runners sharing this one's packed base.
        Every row goes through the shared products; each segment's rows take its runner's adapters,
        and write and attend to its runner's caches."""
        for runner, seg_calls in segments:
            if len({c.seq_id for c in seg_calls}) != len(seg_calls):
                raise ValueError(f"{runner.name}: a batch holds two calls for one sequence")
        calls = [c for _, seg_calls in segments for c in seg_calls]
        caches = [runner._open(c) for runner, seg_calls in segments for c in seg_calls]
        lens = [len(c.tokens) for c in calls]  # [B] new rows per call
        ids = torch.tensor([t for c in calls for t in c.tokens], dtype=torch.long)  # [R] R = sum T
        pos = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(calls, lens)])  # [R]
        inner = self.model.model
        h = inner.embed_tokens(ids).float()  # [R, hidden]
        cos, sin = inner.rotary_emb(h[None], pos[None])  # [1, R, D] each
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [R, D]
        Hq, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        segs: list[_Segment] = []
        c0 = r0 = k0 = 0
        for runner, seg_calls in segments:
            c1 = c0 + len(seg_calls)
            r1, k1 = r0 + sum(lens[c0:c1]), k0 + sum(c.keep_last for c in seg_calls)
            seg_caches, seg_lens = caches[c0:c1], lens[c0:c1]
            slots_new = torch.cat([cache.slots[c.start : c.start + n] for c, cache, n in zip(seg_calls, seg_caches, seg_lens)])
            plan: PagedAttention | _AttentionPlan
            if self.attention_kernel is not None:
                plan = PagedAttention(self.attention_kernel, seg_calls, seg_caches, seg_lens, Hq, Hkv, D)
            else:
                plan = _AttentionPlan(seg_calls, seg_caches, seg_lens, Hq, Hkv, D)
            segs.append(_Segment(runner, r0, r1, k0, k1, slots_new, plan, seg_caches))
            c0, r0, k0 = c1, r1, k1
        alone = len(segs) == 1 and segs[0].runner is self  # this runner's own rows only

        def adapters(pick, kept: bool = False) -> list[tuple[int, int, tuple | None]] | None:
            # each segment's rows (or kept rows) with its runner's adapters; None: this runner's own for all
            if alone:
                return None
            return [(g.k0, g.k1, pick(g.runner).adapter) if kept else (g.r0, g.r1, pick(g.runner).adapter) for g in segs]

        outs: dict[int, torch.Tensor] = {}  # the layer outputs the features ask for
        table = self._table if alone and not features and isinstance(segs[0].plan, PagedAttention) else None
        if table is not None:  # every layer in one native call: the same kernels, the same rows
            assert self.layers_kernel is not None and self.layers
            run_layers(self.layers_kernel, table, h, (Hq, Hkv, D), self.inter, _eps(self.layers[0][0]), cos, sin,
                       segs[0].slots, self.pool.kv, segs[0].plan)
        for li, (norm1, qkv, o_proj, norm2, gate_up, down) in enumerate(self.layers if table is None else []):
            heads = qkv(self._norm(norm1, h), adapters(lambda r: r.layers[li][1])).view(-1, Hq + 2 * Hkv, D)  # [R, Hq + 2 Hkv, D]: q, k, v heads
            if self.rope_kernel is not None:  # q and k rotated in place, k and v written to each segment's pool
                for g in segs:
                    rope_kv(self.rope_kernel, heads[g.r0 : g.r1], cos[g.r0 : g.r1], sin[g.r0 : g.r1], g.runner.pool.kv[li], g.slots)
                q = heads[:, :Hq]  # [R, Hq, D]
            else:
                qk = _rope(heads[:, : Hq + Hkv], cos[:, None], sin[:, None])  # [R, Hq + Hkv, D] (one rotation for q and k)
                q = qk[:, :Hq]  # [R, Hq, D]
                kv_new = torch.stack((qk[:, Hq:], heads[:, Hq + Hkv :])).transpose(1, 2)  # [2, Hkv, R, D]
                for g in segs:  # every call's new rows, in 16 bits
                    g.runner.pool.kv[li][:, :, g.slots] = kv_new[:, :, g.r0 : g.r1].to(g.runner.pool.kv.dtype)
            parts = [g.plan.attend(q[g.r0 : g.r1], g.runner.pool.kv[li], lambda i, end, sc=g.caches: sc[i].read(li, end))
                     for g in segs]  # [rows, Hq*D] each, segments in row order
            out = parts[0] if len(parts) == 1 else torch.cat(parts)  # [R, Hq*D]
            h = h + o_proj(out, adapters(lambda r: r.layers[li][2]))
            gu = gate_up(self._norm(norm2, h), adapters(lambda r: r.layers[li][4]))  # [R, 2 I]: gate, up
            if self.silu_kernel is not None:
                act = silu_mul(self.silu_kernel, gu, self.inter)  # [R, I]
            else:
                g, u = gu.split(gate_up.splits, dim=-1)  # [R, I] each
                act = nn.functional.silu(g) * u
            h = h + down(act, adapters(lambda r: r.layers[li][5]))
            if features and li in layers:
                outs[li] = h
        for c, cache, n in zip(calls, caches, lens):
            cache.length = c.start + n
        ends = torch.cumsum(torch.tensor(lens), 0).tolist()
        kept = torch.cat([torch.arange(e - c.keep_last, e) for c, e in zip(calls, ends)])  # the rows asked for
        logits = self.head(self._norm(inner.norm, h[kept]), adapters(lambda r: r.head, kept=True))  # [sum keep_last, V_model]
        if features:  # every row: the asked layers' outputs, then the final feature (after the final norm)
            if len(segs) > 1:
                raise ValueError("features come from one runner's forward")
            feats = list(torch.cat([outs[i] for i in layers] + [self._norm(inner.norm, h)], dim=-1).split(lens))
        else:
            feats = None
        return list(logits.split([c.keep_last for c in calls])), feats


class _Segment(NamedTuple):
    """One runner's calls within a forward (:meth:`FastRunner._run`): its rows [r0, r1), its kept
    rows [k0, k1) among the rows asked for, its calls' new pool slots, attention plan and caches."""

    runner: FastRunner
    r0: int
    r1: int
    k0: int
    k1: int
    slots: torch.Tensor
    plan: "PagedAttention | _AttentionPlan"
    caches: list[SeqCache]


#: calls of at most this many new tokens (decode and verify steps) attend together, padded to the
#: longest of them; longer ones (prompt chunks) attend one by one (padding them would cost more)
SMALL_CALL = 16
#: small calls attend together in groups of at most this many key positions (sequences x the
#: group's longest context): the gathered keys and values are float64, so 8 sequences of 3,400
#: positions at once would take about 150 MB a layer; a group of 8,192 takes about 25 MB
ATTEND_POSITIONS = 8192


class _SmallBatch:
    """Small calls attending in one batched product, padded to the longest: the layout of their
    keys (``ctx``, pool slots), queries (``q_rows``), mask and the rows kept."""

    def __init__(self, members, calls, caches, lens, row0, g: int):
        ns = [lens[i] for i in members]
        ends = [calls[i].start + lens[i] for i in members]  # [Bs] cached positions after the call
        self.B, self.n, self.L = len(members), max(ns), max(ends)
        ctx = torch.empty(self.B, self.L, dtype=torch.long)  # [Bs, L] slot of each key position
        q_rows = torch.empty(self.B, self.n, dtype=torch.long)  # [Bs, n] row of each (padded) query
        for b, i in enumerate(members):
            slots = caches[i].slots
            ctx[b, : ends[b]] = slots[: ends[b]]
            ctx[b, ends[b] :] = slots[0]
            q_rows[b] = row0[i] + torch.arange(self.n).clamp(max=lens[i] - 1)
        self.ctx, self.q_rows = ctx, q_rows.view(-1)
        self.gather: torch.Tensor | None = None  # [Bs * Hkv * L] flat pool rows, in (sequence, head, position) order
        t = torch.arange(self.n).repeat(g)  # [g*n] each query row's index within its call
        starts = torch.tensor([calls[i].start for i in members])  # [Bs]
        # [Bs, 1, g*n, L]: True where a key is masked (after the query's own position, or padding)
        self.masked = (torch.arange(self.L)[None, None, :] > (starts[:, None] + t[None, :])[:, :, None])[:, None]
        self.keep = torch.cat([b * self.n + torch.arange(ns[b]) for b in range(self.B)])  # real rows of the padded output
        self.rows = torch.cat([row0[i] + torch.arange(lens[i]) for i in members])

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, Hq: int, Hkv: int, D: int) -> torch.Tensor:
        """The batch's real rows' attention outputs, [sum n, Hq*D] float32."""
        B, n, L, g = self.B, self.n, self.L, Hq // Hkv
        if self.gather is None:  # the same for every layer: row h * slots + slot of the pool's [2, Hkv * slots, D] view
            self.gather = (torch.arange(Hkv)[None, :, None] * kv_layer.shape[2] + self.ctx[:, None, :]).view(-1)
        # one gather straight into the products' layout (no transposed copies): [2, Bs, Hkv, L, D]
        kv = as_float64(kv_layer.view(2, -1, D).index_select(1, self.gather)).view(2, B, Hkv, L, D)
        qh = q[self.q_rows].view(B, n, Hq, D).double().transpose(1, 2).reshape(B, Hkv, g * n, D)  # [Bs, Hkv, g*n, D]
        scores = (qh @ kv[0].transpose(-1, -2) * D**-0.5).masked_fill(self.masked, float("-inf"))  # [Bs, Hkv, g*n, L]
        o = torch.softmax(scores, dim=-1) @ kv[1]  # [Bs, Hkv, g*n, D]
        o = o.view(B, Hq, n, D).transpose(1, 2).reshape(B * n, Hq * D)  # [Bs*n, Hq*D]
        return o[self.keep].float()


def _groups(members: list[int], ends: list[int], budget: int) -> list[list[int]]:
    """``members`` (in order) cut into runs whose count x longest context stays within ``budget``
    key positions (a call longer than the budget alone is a group of its own)."""
    groups: list[list[int]] = []
    longest = 0
    for i, end in zip(members, ends):
        if groups and (len(groups[-1]) + 1) * max(longest, end) <= budget:
            groups[-1].append(i)
            longest = max(longest, end)
        else:
            groups.append([i])
            longest = end
    return groups


class _AttentionPlan:
    """The torch attention of one forward (where the native kernel is unavailable), its indices
    computed once for all layers: the padded layouts in which the calls of at most
    :data:`SMALL_CALL` rows attend in batched products (one set of ops per layer for a group of
    sequences, instead of one per sequence; groups of at most :data:`ATTEND_POSITIONS` key
    positions). Padded keys are masked (their softmax weight is exactly 0) and point at the
    sequence's own first slot (always written: finite); padded query rows are computed and
    dropped. A lone small call attends unpadded."""

    def __init__(self, calls, caches, lens, Hq: int, Hkv: int, D: int):
        self.Hq, self.Hkv, self.D = Hq, Hkv, D
        self.R = sum(lens)
        row0 = [0]
        for n in lens[:-1]:
            row0.append(row0[-1] + n)
        small = [i for i, n in enumerate(lens) if n <= SMALL_CALL]
        if len(small) < 2:
            small = []
        self.one_by_one = [(i, row0[i], lens[i], calls[i].start) for i in range(len(calls)) if i not in set(small)]
        groups = _groups(small, [calls[i].start + lens[i] for i in small], ATTEND_POSITIONS)
        self.batches = [_SmallBatch(m, calls, caches, lens, row0, Hq // Hkv) for m in groups]

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, read) -> torch.Tensor:
        """q: [R, Hq, D] float32; kv_layer: the pool's [2, Hkv, slots, D] (this layer's new rows
        written); ``read(i, end)`` a call's keys and values [2, Hkv, end, D] float64 -> [R, Hq*D]."""
        Hq, Hkv, D = self.Hq, self.Hkv, self.D
        if not self.batches and len(self.one_by_one) == 1:
            i, _, _, start = self.one_by_one[0]
            return _attend(q, read(i, start + q.shape[0]), start)
        out = q.new_empty(self.R, Hq * D)
        for batch in self.batches:
            out[batch.rows] = batch.attend(q, kv_layer, Hq, Hkv, D)
        for i, row, n, start in self.one_by_one:
            out[row : row + n] = _attend(q[row : row + n], read(i, start + n), start)
        return out


def _rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm (its weight and epsilon) as one fused op, row by row. x: [R, hidden]."""
    return nn.functional.rms_norm(x, (x.shape[-1],), cast(torch.Tensor, norm.weight).float(), _eps(norm))


def _eps(norm: nn.Module) -> float:
    return cast(float, getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, HF's ``rotate_half`` convention. x: [R, H, D]; cos, sin: [R, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


#: queries of one call attend this many at a time: a long prompt's scores ([H, rows, L] float64)
#: stay tens of MB instead of growing with the square of its length
ATTEND_ROWS = 256


def _attend(q: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of ``n`` new queries at positions start.. over the L = start + n cached
    positions, in float64 (see the module docstring), :data:`ATTEND_ROWS` queries at a time.
    q: [n, Hq, D]; kv: [2, Hkv, L, D] -> [n, Hq*D]."""
    n = q.shape[0]
    if n > ATTEND_ROWS:
        return torch.cat([_attend(q[i : i + ATTEND_ROWS], kv[:, :, : start + min(n, i + ATTEND_ROWS)], start + i)
                          for i in range(0, n, ATTEND_ROWS)])
    Hq, D = q.shape[1], q.shape[2]
    Hkv, L = kv.shape[1], kv.shape[2]
    g = Hq // Hkv  # query heads per key/value head (grouped-query attention)
    qh = q.double().transpose(0, 1).reshape(Hkv, g * n, D)  # [Hkv, g*n, D]: head h*g+j, row t -> (h, j*n+t)
    scores = qh @ kv[0].transpose(1, 2) * D**-0.5  # [Hkv, g*n, L]
    if n > 1:
        t = torch.arange(n).repeat(g)  # [g*n] each query's row
        scores = scores.masked_fill(torch.arange(L)[None, :] > (start + t)[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ kv[1]  # [Hkv, g*n, D]
    return out.view(Hq, n, D).transpose(0, 1).reshape(n, Hq * D).float()
