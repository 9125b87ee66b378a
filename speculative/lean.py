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

Exactness: on the GPU the rows of a step are *not* guaranteed batch-invariant. cuBLAS picks its
kernel by shape, so a row's logits may differ in the last bits between a decode (1 row), a verify
(k + 1 rows) and a batch of sequences. Greedy speculative output therefore equals this runtime's own
target-only output up to near-ties of the top two logits; ``bench/gpu_check.sh lean`` counts the
sequences where it differs. Sampling draws from this runtime's distribution as it stood for the rows
verified.
"""

from __future__ import annotations

import logging
import time

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


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def bucket(lens: list[int], ends: list[int], graph_context: int, max_batch: int) -> tuple[int, int, int] | None:
    """The (B, T, L) graph bucket of a batch whose calls feed ``lens`` tokens and end at ``ends``
    cached positions; None when it runs eagerly (a long call, a long context or a wide batch)."""
    T, L, B = _pow2(max(lens)), _pow2(max(ends), MIN_CONTEXT), _pow2(len(lens))
    if T > GRAPH_TOKENS or L > graph_context or B > max_batch:
        return None
    return B, T, L


class _Layer:
    """One decoder layer's weights for the lean forward: fused q/k/v and gate/up, bfloat16."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
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
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    return norm.weight.detach().float(), float(eps)


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


class LeanRunner(PooledCaches, ModelRunner):
    """A :class:`ModelRunner` (``forward``, ``forward_batch``, ``verify``, caches by id) over a
    bfloat16 copy of a Llama-style model on the model's device, with CUDA graphs there. ``model``
    stays the float model: what the learner trains and what :meth:`load_state_dict` loads into."""

    ragged = False  # a batch is padded to its bucket

    def __init__(self, model: PreTrainedModel, vocab_map: torch.Tensor | None = None, name: str = "model",
                 kv_tokens: int = 32768, kv_dtype: str = "bfloat16", block_tokens: int = 16,
                 graphs: bool | None = None, graph_context: int = 4096, max_batch: int = 16,
                 dtype: str = "bfloat16", buckets: bool | None = None):
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
        self._graph_pool = None
        #: graphs captured (one per bucket met) and steps replayed from them / run eagerly
        self.stats = {"captured": 0, "replayed": 0, "eager": 0, "capture_s": 0.0}
        self.seen: set[tuple[int, int, int]] = set()  # buckets met (captured or, on a CPU, run padded)
        self._pack()

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
        B, L = ctx.shape
        T = qpos.shape[1]
        R = B * T
        Hq, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        g = Hq // Hkv
        h = self.embed[ids].float()  # [R, H]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [R, 1, D]
        # [B, 1, g*T, L]: True where query row j*T + t (head j's query t) may attend key l (l <= its position)
        allowed = (torch.arange(L, device=ids.device)[None, None, :] <= qpos[:, :, None]).repeat(1, g, 1)[:, None]
        flat = ctx.reshape(-1)  # [B*L]
        outs = {}
        for li, lay in enumerate(self.layers):
            x = F.rms_norm(h, (h.shape[-1],), lay.norm1, lay.eps1)
            heads = _lin(x, lay.qkv, lay.qkv_b, lay.qkv_d).float().view(R, Hq + 2 * Hkv, D)  # [R, Hq + 2 Hkv, D]
            qk = _rope(heads[:, : Hq + Hkv], cos, sin)  # [R, Hq + Hkv, D]
            kv_layer = self.pool.kv[li]  # [2, Hkv, slots, D]
            kv_layer[:, :, wslot] = torch.stack((qk[:, Hq:], heads[:, Hq + Hkv :])).transpose(1, 2).to(kv_layer.dtype)
            kv = kv_layer[:, :, flat].view(2, Hkv, B, L, D).transpose(1, 2)  # [2, B, Hkv, L, D] in the pool's dtype
            q = qk[:, :Hq].reshape(B, T, Hq, D).transpose(1, 2).reshape(B, Hkv, g * T, D).to(kv.dtype)  # [B, Hkv, g*T, D]
            o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=allowed)  # [B, Hkv, g*T, D]
            o = o.view(B, Hq, T, D).transpose(1, 2).reshape(R, Hq * D)  # [R, Hq*D]
            h = h + _lin(o, lay.o, lay.o_b, lay.o_d)  # float32 + 16 bits: float32
            gate, up = _lin(F.rms_norm(h, (h.shape[-1],), lay.norm2, lay.eps2), lay.gate_up, lay.gate_up_b,
                            lay.gate_up_d).split(lay.inter, -1)
            h = h + _lin(F.silu(gate) * up, lay.down, lay.down_b, lay.down_d)
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
        key = None if layers is not None or not self.buckets else bucket(lens, ends, self.graph_context, self.max_batch)
        if key is None:  # eager, at the batch's own shape
            B, T, L = len(calls), max(lens), max(ends)
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
    def _split(buf: torch.Tensor, B: int, T: int, L: int):
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
        static = torch.zeros(4 * B * T + B * L, dtype=torch.long, device=self.device)
        args = self._split(static, B, T, L)
        args[2].fill_(self.trash)  # every write of the warm-up and the capture goes to the trash slot
        args[3].fill_(self.trash)
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

    def warmup(self, batches: tuple[int, ...] = (1,), contexts: tuple[int, ...] = (MIN_CONTEXT, 2 * MIN_CONTEXT)) -> int:
        """Capture the graphs of the common buckets ahead of serving (decode and verify of up to
        :data:`GRAPH_TOKENS` tokens, for ``batches`` sequences and ``contexts`` positions). Returns
        the graphs captured; 0 where graphs are off."""
        if not self.graphs:
            return 0
        before = self.stats["captured"]
        with torch.inference_mode():
            for B in sorted({_pow2(b) for b in batches if _pow2(b) <= self.max_batch}):
                for L in contexts:
                    T = 1
                    while T <= GRAPH_TOKENS and self.graphs:
                        self._graph((_pow2(B), T, _pow2(L, MIN_CONTEXT)))
                        T *= 2
        torch.cuda.synchronize(self.device)
        return self.stats["captured"] - before

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
