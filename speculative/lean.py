"""The lean GPU path: the :class:`speculative.fast.FastRunner` forward on CUDA, in bfloat16, with a
paged KV pool on the device and CUDA graphs captured per (sequences, tokens, context) bucket.

Why: Hugging Face eager on one H100 took 26-31 ms a step for the 135M target (31-37 tokens/s). That
is launch-bound: about 1,000 small kernels a step, each paid for by Python and a CUDA launch. Here a
step is one graph replay: one host-to-device copy of the step's indices, the replay, and one copy
of what acceptance needs back.

The forward (:meth:`LeanRunner._run`) has fixed shapes for a bucket, so one capture serves every step
that fits it:
  - a batch of B sequences with up to T new tokens each is padded to ``B x T`` rows (B, T powers
    of two); padded rows write their keys and values to a *trash* slot of the pool that no real
    sequence owns, and read positions that are masked out;
  - each sequence attends over L context slots (L a power of two, at least :data:`MIN_CONTEXT`),
    gathered from the pool by a slot table ``ctx [B, L]``; slots past a sequence's length point at
    the trash slot and are masked (softmax weight exactly 0; the pool starts zeroed, so every slot
    read is finite);
  - linear layers take bfloat16 inputs and weights (``F.linear``); the residual stream, norms and
    rotary embeddings stay float32; attention (``F.scaled_dot_product_attention`` with the mask)
    runs in the KV pool's 16 bits.
Calls longer than :data:`GRAPH_TOKENS` (prompt chunks) or contexts past ``graph_context`` run the
same function eagerly, at their exact shapes. On a CPU (tests, or a machine without CUDA) everything
runs eagerly, bucket for bucket the same arithmetic.

Exactness: on the GPU the rows of a step are *not guaranteed* batch-invariant: cuBLAS picks its
kernel by shape, and a compiler specialises a size of 1. So a compiled runner pads every step to at
least 2 sequences of 2 tokens (:meth:`LeanRunner._compile`), and ``python -m bench.lean_check
--invariance`` checks bitwise, on the device, that a position's logits are the same from a decode
step, a verify step and a step shared with other sequences (on one H200: 0 of 80 rows differ,
compiled or not). Greedy speculative output then equals this runtime's own target-only output;
``bench/gpu_check.sh`` counts the prompts where it does not. Sampling draws from this runtime's
distribution as it stood for the rows verified.
"""

from __future__ import annotations

import logging
import time

from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from .adapters import fused_delta, has_adapters, is_adapter_key
from .fast import _rope
from .kvcache import BlockPool, PooledCaches, SeqCache
from .runner import ForwardCall, ModelRunner, TargetRows, VerifyCall, _select, target_rows, verify_groups
from .shape import FastPathError, llama_shape_problem

log = logging.getLogger(__name__)

#: calls of at most this many new tokens run from captured graphs (decode and verify steps, k_max up to 31)
GRAPH_TOKENS = 32
#: the smallest context bucket
MIN_CONTEXT = 128
#: the longest context bucket captured ahead of serving (longer ones are captured when first met)
WARM_CONTEXT = 2048


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def bucket(lens: list[int], ends: list[int], graph_context: int, max_batch: int, least: int = 1
           ) -> tuple[int, int, int] | None:
    """The (B, T, L) graph bucket of a batch whose calls feed ``lens`` tokens and end at ``ends``
    cached positions (B and T at least ``least``); None when it runs eagerly (a long call, a long
    context or a wide batch)."""
    T, L, B = _pow2(max(lens), least), _pow2(max(ends), MIN_CONTEXT), _pow2(len(lens), least)
    if T > GRAPH_TOKENS or L > graph_context or B > max_batch:
        return None
    return B, T, L


class _Layer:
    """One decoder layer's weights for the lean forward: fused q/k/v and gate/up, bfloat16."""

    def __init__(self, layer: Any, dtype: torch.dtype):  # a Llama-style decoder layer
        a, m = layer.self_attn, layer.mlp

        def fuse(*lins: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = torch.cat([lin.weight.detach() for lin in lins]).to(dtype).contiguous()
            if all(lin.bias is None for lin in lins):
                return w, None
            b = torch.cat([lin.bias.detach() if lin.bias is not None else w.new_zeros(lin.out_features)
                           for lin in lins]).float()
            return w, b

        self.norm1, self.eps1 = _norm(layer.input_layernorm)
        self.norm2, self.eps2 = _norm(layer.post_attention_layernorm)
        self.qkv, self.qkv_b = fuse(a.q_proj, a.k_proj, a.v_proj)
        self.o, self.o_b = fuse(a.o_proj)
        self.gate_up, self.gate_up_b = fuse(m.gate_proj, m.up_proj)
        self.down, self.down_b = fuse(m.down_proj)
        # low-rank adapters (speculative.adapters), float32, added after each fused product
        self.qkv_d, self.o_d = fused_delta((a.q_proj, a.k_proj, a.v_proj)), fused_delta((a.o_proj,))
        self.gate_up_d, self.down_d = fused_delta((m.gate_proj, m.up_proj)), fused_delta((m.down_proj,))
        self.inter = m.gate_proj.out_features


def _norm(norm: nn.Module) -> tuple[torch.Tensor, float]:
    eps = cast(float, getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6))
    return cast(torch.Tensor, norm.weight).detach().float(), float(eps)


def _lin(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, delta=None) -> torch.Tensor:
    """[R, K] -> [R, N] in the weights' dtype (float32 with a bias or an adapter): no cast back to
    float32 otherwise, which the residual add does by promotion (one kernel fewer per linear)."""
    y = F.linear(x.to(w.dtype), w)
    if b is not None:
        y = y.float() + b
    if delta is not None:
        a, bb = delta
        y = y.float() + (x.float() @ a.t()) @ bb.t()
    return y



def _layer(h: torch.Tensor, kv_layer: torch.Tensor, wslot: torch.Tensor, flat: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, allowed: torch.Tensor, Hq: int, Hkv: int, inter: int, norm1, eps1, qkv, qkv_b, qkv_d,
           o_w, o_b, o_d, norm2, eps2, gate_up, gate_up_b, gate_up_d, down, down_b, down_d) -> torch.Tensor:
    """One decoder layer of the padded forward (a pure function of its tensors, so that one
    ``torch.compile`` of it serves every layer). h: [R, H] float32 residual stream, R = B*T rows;
    kv_layer: [2, Hkv, slots, D] this layer's pool (the rows' keys and values are written at
    ``wslot`` [R]); flat: [B*L] the slots each sequence attends; cos, sin: [R, 1, D];
    allowed: [B, 1, g*T, L] the causal mask. Returns the new residual stream [R, H]."""
    B, L = allowed.shape[0], allowed.shape[-1]
    R, D = h.shape[0], cos.shape[-1]
    g = Hq // Hkv
    T = R // B
    x = F.rms_norm(h, (h.shape[-1],), norm1, eps1)
    heads = _lin(x, qkv, qkv_b, qkv_d).float().view(R, Hq + 2 * Hkv, D)  # [R, Hq + 2 Hkv, D]
    qk = _rope(heads[:, : Hq + Hkv], cos, sin)  # [R, Hq + Hkv, D]
    kv_layer[:, :, wslot] = torch.stack((qk[:, Hq:], heads[:, Hq + Hkv :])).transpose(1, 2).to(kv_layer.dtype)
    kv = kv_layer[:, :, flat].view(2, Hkv, B, L, D).transpose(1, 2)  # [2, B, Hkv, L, D] in the pool's dtype
    q = qk[:, :Hq].reshape(B, T, Hq, D).transpose(1, 2).reshape(B, Hkv, g * T, D).to(kv.dtype)  # [B, Hkv, g*T, D]
    o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=allowed)  # [B, Hkv, g*T, D]
    o = o.view(B, Hq, T, D).transpose(1, 2).reshape(R, Hq * D)  # [R, Hq*D]
    h = h + _lin(o, o_w, o_b, o_d)  # float32 + 16 bits: float32
    gate, up = _lin(F.rms_norm(h, (h.shape[-1],), norm2, eps2), gate_up, gate_up_b, gate_up_d).split(inter, -1)
    return h + _lin(F.silu(gate) * up, down, down_b, down_d)


class LeanRunner(PooledCaches, ModelRunner):
    """A :class:`ModelRunner` (``forward``, ``forward_batch``, ``verify``, caches by id) over a
    bfloat16 copy of a Llama-style model on the model's device, with CUDA graphs there. ``model``
    stays the float model: what the learner trains and what :meth:`load_state_dict` loads into."""

    ragged = False  # a batch is padded to its bucket

    def __init__(self, model: PreTrainedModel, vocab_map: torch.Tensor | None = None, name: str = "model",
                 kv_tokens: int = 32768, kv_dtype: str = "bfloat16", block_tokens: int = 16,
                 graphs: bool | None = None, graph_context: int = 4096, max_batch: int = 16,
                 dtype: str = "bfloat16", buckets: bool | None = None, compile: bool = False):
        why = llama_shape_problem(model)
        if why:
            raise FastPathError(f"{name}: cannot use the lean path: {why}")
        super().__init__(model, vocab_map, name)
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.dtype = getattr(torch, dtype)  # the weights' (float32: the forward checked against Hugging Face's)
        on_cuda = self.device.type == "cuda"
        if graphs and not on_cuda:
            log.warning("%s: CUDA graphs need a CUDA device (the model is on %s); running the lean forward eagerly",
                        name, self.device)
        self.graphs = on_cuda if graphs is None else bool(graphs and on_cuda)
        #: steps padded to their bucket: always with graphs; on a CPU only when asked (tests of the layout)
        self.buckets = self.graphs or bool(buckets)
        self.graph_context = _pow2(graph_context, MIN_CONTEXT)
        self.max_batch = _pow2(max_batch)
        self.pool = BlockPool(cfg.num_hidden_layers, self.n_kv, self.head_dim, kv_tokens + block_tokens, block_tokens,
                              kv_dtype, device=self.device, zeroed=True)
        self.trash = self.pool.take(1)[0] * block_tokens  # padded rows write here; no sequence owns it
        self._caches: dict[str, SeqCache] = {}  # type: ignore[assignment]
        self._graphs: dict[tuple[int, int, int], tuple] = {}
        self._graph_pool: Any = None  # CUDA's handle of the graphs' shared memory pool
        #: graphs captured (one per bucket met) and steps replayed from them / run eagerly
        self.stats = {"captured": 0, "replayed": 0, "eager": 0, "capture_s": 0.0}
        self.seen: set[tuple[int, int, int]] = set()  # buckets met (captured or, on a CPU, run padded)
        self._layer = _layer
        self.compiled = False
        #: the fewest sequences and tokens a step is padded to: 2 with compiled layers (below)
        self.least = 1
        self._pack()
        if compile:
            self._compile()

    def _compile(self) -> None:
        """Fuse each layer's small operations with ``torch.compile`` (inductor: Triton kernels on a
        GPU, C++ on a CPU), compiled here, before serving. The sizes are symbolic, so one
        compilation serves every bucket and no request of a new length compiles again. A missing
        compiler leaves the eager layers, with the reason logged once.

        Every step is padded to at least 2 sequences of 2 tokens (:attr:`least`). Compilers
        specialise a size of 1 (other kernels, other reductions), so a decode step of one sequence
        would round its row otherwise than a verify step or a batch does, and a speculative step
        could then accept what target-only decoding would not have produced. With one shape class,
        and reductions never split by size, a row's logits do not depend on the step it is in."""
        import torch._dynamo
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as fx_config

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        fx_config.use_duck_shape = False  # sizes that happen to be equal (rows = head size) are no reason to recompile
        inductor_config.split_reductions = False  # a reduction's order must not follow the rows' count
        self._layer = torch.compile(_layer, dynamic=True, fullgraph=True)
        self.least, self._graphs = 2, {}
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                # the shape class, then sizes of other divisibility (Triton specialises a size on it): steps and prompts
                for B, T, L in ((2, 2, MIN_CONTEXT), (2, 3, 37), (3, 17, 2 * MIN_CONTEXT), (2, 33, 33), (4, 8, 61)):
                    self._run(*self._split(self._trash_layout(B, T, L), B, T, L))
        except Exception as e:  # no C++ compiler, no Triton, an unsupported torch: the same layers, eagerly
            log.error("%s: torch.compile of the lean layers failed (%s: %s); running them eagerly",
                      self.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self._layer, self.least = _layer, 1
            return
        self.compiled = True
        self.stats["compile_s"] = round(time.perf_counter() - t0, 3)

    def _trash_layout(self, B: int, T: int, L: int) -> torch.Tensor:
        """A step's indices on the device that write and read only the trash slot (warm-ups, captures)."""
        buf = torch.zeros(4 * B * T + B * L, dtype=torch.long, device=self.device)
        args = self._split(buf, B, T, L)
        args[2].fill_(self.trash)
        args[3].fill_(self.trash)
        return buf

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, as a bench forks a draft) leaves the captured graphs behind:
        they read this runner's tensors; the copy captures its own."""
        state = self.__dict__.copy()
        state["_graphs"], state["_graph_pool"], state["seen"] = {}, None, set()
        return state

    def _pack(self) -> None:
        inner = self.model.model
        self.layers = [_Layer(layer, self.dtype) for layer in inner.layers]
        self.embed = inner.embed_tokens.weight.detach().to(self.dtype)
        self.final_norm, self.final_eps = _norm(inner.norm)
        self.head = self.model.lm_head.weight.detach().to(self.dtype).contiguous()
        self.head_b = None if self.model.lm_head.bias is None else self.model.lm_head.bias.detach().float()
        self.head_d = fused_delta((self.model.lm_head,))
        n = self.max_positions or 8192
        pos = torch.arange(n, device=self.device)
        probe = torch.zeros(1, 1, self.head_dim, device=self.device)
        cos, sin = inner.rotary_emb(probe, pos[None])  # [1, n, D] each
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()  # [n, D]
        self._graphs.clear()  # captured graphs read the old tensors

    def load_state_dict(self, state: dict) -> None:
        """New weights. Adapters only (an adapter learner's version): copied into the tensors the
        captured graphs read, so the graphs stay; a whole state packs everything again."""
        fresh = bool(state) and all(is_adapter_key(k) for k in state) and not has_adapters(self.model)
        self.pool.drop_index()  # cached prefixes were computed by the old weights
        super().load_state_dict(state)
        if state and all(is_adapter_key(k) for k in state) and not fresh:
            for lay, layer in zip(self.layers, self.model.model.layers):
                a, m = layer.self_attn, layer.mlp
                for old, new in ((lay.qkv_d, fused_delta((a.q_proj, a.k_proj, a.v_proj))), (lay.o_d, fused_delta((a.o_proj,))),
                                 (lay.gate_up_d, fused_delta((m.gate_proj, m.up_proj))), (lay.down_d, fused_delta((m.down_proj,)))):
                    if old is not None and new is not None:
                        old[0].copy_(new[0])
                        old[1].copy_(new[1])
            new = fused_delta((self.model.lm_head,))
            if self.head_d is not None and new is not None:
                self.head_d[0].copy_(new[0])
                self.head_d[1].copy_(new[1])
            return
        self._pack()

    # -- the forward ----------------------------------------------------------------------
    def _run(self, ids: torch.Tensor, pos: torch.Tensor, wslot: torch.Tensor, ctx: torch.Tensor, qpos: torch.Tensor,
             keep: torch.Tensor | None = None, layers: tuple[int, ...] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The padded forward. ids, pos, wslot: [B*T] (token, position, pool slot written);
        ctx: [B, L] pool slots of each sequence's positions 0..L-1; qpos: [B, T] each query's
        position (its causal limit). ``keep``: rows whose logits are computed (all when None).
        Returns (logits [rows, V] float32, features: None unless ``layers`` is given, then every
        row's outputs of those decoder layers and the final feature, [B*T, (len(layers)+1) H])."""
        L = ctx.shape[1]
        Hq, Hkv = self.n_heads, self.n_kv
        g = Hq // Hkv
        h = self.embed[ids].float()  # [R, H], R = B*T
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [R, 1, D]
        # [B, 1, g*T, L]: True where query row j*T + t (head j's query t) may attend key l (l <= its position)
        allowed = (torch.arange(L, device=ids.device)[None, None, :] <= qpos[:, :, None]).repeat(1, g, 1)[:, None]
        # the indices as tensors of their own (a view's offset into the step's buffer would be a compiled layer's guard)
        wslot, flat = wslot.clone(), ctx.reshape(-1).clone()  # [R], [B*L]
        outs = {}
        for li, lay in enumerate(self.layers):
            h = self._layer(h, self.pool.kv[li], wslot, flat, cos, sin, allowed, Hq, Hkv, lay.inter, lay.norm1, lay.eps1,
                            lay.qkv, lay.qkv_b, lay.qkv_d, lay.o, lay.o_b, lay.o_d, lay.norm2, lay.eps2,
                            lay.gate_up, lay.gate_up_b, lay.gate_up_d, lay.down, lay.down_b, lay.down_d)
            if layers and li in layers:
                outs[li] = h
        final = F.rms_norm(h, (h.shape[-1],), self.final_norm, self.final_eps)  # [R, H]
        logits = _lin(final if keep is None else final[keep], self.head, self.head_b, self.head_d).float()  # [rows, V]
        feats = None if layers is None else torch.cat([outs[i] for i in layers] + [final], -1)
        return logits, feats

    # -- a batch: layout, bucket, graph or eager ------------------------------------------
    def _layout(self, calls: list[ForwardCall], caches: list[SeqCache], B: int, T: int, L: int) -> torch.Tensor:
        """The step's indices in one int64 host tensor (one copy to the device): ids, pos, wslot
        ([B*T] each), qpos ([B*T]), ctx ([B*L])."""
        buf = torch.zeros(4 * B * T + B * L, dtype=torch.long)
        ids, pos, wslot, qpos, ctx = buf.split([B * T] * 4 + [B * L])
        wslot.fill_(self.trash)
        ctx.fill_(self.trash)
        for b, (c, cache) in enumerate(zip(calls, caches)):
            n, s, r = len(c.tokens), c.start, b * T
            ids[r : r + n] = torch.tensor(c.tokens)
            pos[r : r + n] = torch.arange(s, s + n)
            pos[r + n : r + T] = s + n - 1  # padded queries: a real position, their output is dropped
            qpos[r : r + T] = pos[r : r + T]
            wslot[r : r + n] = cache.slots[s : s + n]
            ctx[b * L : b * L + s + n] = cache.slots[: s + n]
        return buf

    def _logits(self, calls: list[ForwardCall], layers: tuple[int, ...] | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Each call's last ``keep_last`` logits rows ([keep_last, V], on the device); with
        ``layers`` (features asked), each call's features too ([len(tokens), (len(layers)+1) H])."""
        if len({c.seq_id for c in calls}) != len(calls):
            raise ValueError(f"{self.name}: a batch holds two calls for one sequence")
        caches = [self._open(c) for c in calls]
        lens = [len(c.tokens) for c in calls]
        ends = [c.start + n for c, n in zip(calls, lens)]
        key = None if layers is not None or not self.buckets else bucket(lens, ends, self.graph_context, self.max_batch,
                                                                            self.least)
        if key is None:  # eager, at the batch's own shape (compiled: at least the least one)
            B, T, L = max(len(calls), self.least), max(max(lens), self.least), max(ends)
        else:
            B, T, L = key
        buf = self._layout(calls, caches, B, T, L).to(self.device, non_blocking=True)
        rows = torch.cat([b * T + torch.arange(n - c.keep_last, n) for b, (c, n) in enumerate(zip(calls, lens))]).to(self.device)
        captured = self._graph(key) if key is not None and self.graphs else None  # None: capture failed, graphs off
        if captured is not None:
            graph, static, out = captured
            static.copy_(buf)
            graph.replay()
            self.stats["replayed"] += 1
            got, feats = out[rows], None
        elif key is None:  # eager, at the batch's own shape
            self.stats["eager"] += 1
            got, feats = self._run(*self._split(buf, B, T, L), keep=rows, layers=layers)
        else:  # the bucket's padded layout, run eagerly (a CPU, or graphs off)
            self.stats["eager"] += 1
            self.seen.add(key)
            got, feats = self._run(*self._split(buf, B, T, L))[0][rows], None
        for c, cache, e in zip(calls, caches, ends):
            cache.length = e
        logits = list(got.split([c.keep_last for c in calls]))
        if feats is None:
            return logits, None
        return logits, [feats[b * T : b * T + n] for b, n in enumerate(lens)]

    @staticmethod
    def _split(buf: torch.Tensor, B: int, T: int, L: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, pos, wslot, qpos, ctx = buf.split([B * T] * 4 + [B * L])
        return ids, pos, wslot, ctx.view(B, L), qpos.view(B, T)

    def _graph(self, key: tuple[int, int, int]):
        """The captured graph of a bucket, captured the first time the bucket is met; None when
        capturing fails (graphs are then off for this runner, with a logged reason)."""
        if key in self._graphs:
            return self._graphs[key]
        self.seen.add(key)
        t0 = time.perf_counter()
        B, T, L = key
        static = self._trash_layout(B, T, L)  # every write of the warm-up and the capture goes to the trash slot
        args = self._split(static, B, T, L)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool):
                out, _ = self._run(*args)
        except RuntimeError as e:  # a driver or torch that cannot capture: the same forward, eagerly
            log.error("%s: capturing a CUDA graph failed (%s); running the lean forward eagerly", self.name, e)
            self.graphs = False
            return None
        self._graphs[key] = (graph, static, out)
        self.stats["captured"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        return self._graphs[key]

    def warmup(self, batches: tuple[int, ...] = (1,), contexts: tuple[int, ...] | None = None) -> int:
        """Capture the graphs of the common buckets ahead of serving (decode and verify of up to
        :data:`GRAPH_TOKENS` tokens, for ``batches`` sequences and ``contexts`` positions, by default
        every context bucket up to :data:`WARM_CONTEXT`): a bucket first met by a request would cost
        it the capture, about 0.1 s. Returns the graphs captured; 0 where graphs are off."""
        if not self.graphs:
            return 0
        if contexts is None:
            contexts = tuple(1 << i for i in range(MIN_CONTEXT.bit_length() - 1, min(self.graph_context, WARM_CONTEXT).bit_length()))
        before = self.stats["captured"]
        with torch.inference_mode():
            for B in sorted({_pow2(b, self.least) for b in batches if _pow2(b, self.least) <= self.max_batch}):
                for L in contexts:
                    T = self.least
                    while T <= GRAPH_TOKENS and self.graphs:
                        self._graph((B, T, _pow2(L, MIN_CONTEXT)))
                        T *= 2
        torch.cuda.synchronize(self.device)
        return int(self.stats["captured"] - before)

    # -- the runner's calls ----------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seq_id: str, start: int, tokens: list[int], keep_last: int = 1) -> torch.Tensor:
        return self.forward_batch([ForwardCall(seq_id, start, tokens, keep_last)])[0]

    @torch.inference_mode()
    def forward_batch(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """Each call's last ``keep_last`` rows ([keep_last, V_model]) on the CPU."""
        logits, _ = self._logits(calls)
        return [lg.cpu() for lg in logits]

    @torch.inference_mode()
    def forward_batch_features(self, calls: list[ForwardCall], layers: tuple[int, ...] = ()
                               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        logits, feats = self._logits(calls, tuple(layers))
        return [lg.cpu() for lg in logits], [f.cpu() for f in feats]  # type: ignore[union-attr]

    @torch.inference_mode()
    def verify(self, calls: list[VerifyCall], max_batch_tokens: int = 64) -> list[TargetRows]:
        """Score the steps of several requests in one forward (long prefills alone, eagerly), the
        compaction to what acceptance needs done on the device: only argmax and top-k cross to the
        host (and whole rows when a call samples)."""
        out: list[TargetRows | None] = [None] * len(calls)
        for group in verify_groups(calls, max_batch_tokens):
            t0 = time.perf_counter()
            fwd = [ForwardCall(calls[i].seq_id, calls[i].start, calls[i].tokens, calls[i].rows) for i in group]
            want = [calls[i] for i in group if calls[i].features]
            layers = tuple(sorted({j for c in want for j in c.feature_layers})) if want else None
            logits, feats = self._logits(fwd, layers)
            rows = [target_rows(lg, calls[i], 0.0, len(group)) for i, lg in zip(group, logits)]
            rows = [_to_host(r) for r in rows]  # one synchronisation for the group
            seconds = time.perf_counter() - t0
            for j, (i, r) in enumerate(zip(group, rows)):
                r.seconds = seconds
                if calls[i].features and feats is not None:
                    r.features = _select(feats[j].float(), list(layers or ()), calls[i].feature_layers).cpu().to(torch.float16)
                out[i] = r
        return out  # type: ignore[return-value]


def _to_host(r: TargetRows) -> TargetRows:
    return TargetRows(r.argmax.cpu(), r.top_ids.cpu(), r.top_probs.cpu(), r.tail.cpu(),
                      None if r.logits is None else r.logits.cpu(), r.seconds, r.batch, r.features)
