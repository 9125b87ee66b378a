"""``python -m bench.compile_cpu [eager|per-layer|stack]``: torch.compile over the int4 fast path's forward,
timed against the eager forward (docs/fast.md, "torch.compile on the CPU path").

per-layer: each decoder layer's MLP block compiled (30 compiled calls a step); stack: the whole
decoder stack of one sequence as one compiled function (one call a step). Prints ms per decode
step (1 new token) and per verify of 5, at a context of 200 tokens, and the compile seconds."""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

from config import ModelConfig
from speculative.fast import FastRunner, _rms, _rope
from speculative.models import load_model


def _stack(r: FastRunner, mlps=None):
    """One sequence's decoder stack over a contiguous cache: (h, cos, sin, pool, first slot, start)
    -> logits; ``mlps``: a callable per layer for its MLP block (h -> h)."""
    Hq, Hkv, D = r.n_heads, r.n_kv, r.head_dim
    g = Hq // Hkv
    inner = r.model.model

    def body(h, cos, sin, kv_all, first: int, start: int):
        n = h.shape[0]
        L = start + n
        t = torch.arange(n).repeat(g)
        mask = torch.arange(L)[None, :] > (start + t)[:, None]
        for li, (norm1, qkv, o_proj, norm2, gate_up, down) in enumerate(r.layers):
            heads = qkv(_rms(norm1, h)).view(-1, Hq + 2 * Hkv, D)
            qk = _rope(heads[:, : Hq + Hkv], cos, sin)
            layer = kv_all[li]
            layer[:, :, first + start : first + L] = torch.stack((qk[:, Hq:], heads[:, Hq + Hkv :])).transpose(1, 2).to(layer.dtype)
            kv = layer[:, :, first : first + L].float().double()
            qh = qk[:, :Hq].double().transpose(0, 1).reshape(Hkv, g * n, D)
            scores = (qh @ kv[0].transpose(1, 2) * D**-0.5).masked_fill(mask, float("-inf"))
            out = (torch.softmax(scores, dim=-1) @ kv[1]).view(Hq, n, D).transpose(0, 1).reshape(n, Hq * D).float()
            h = h + o_proj(out)
            if mlps is not None:
                h = mlps[li](h)
                continue
            gg, u = gate_up(_rms(norm2, h)).split(gate_up.splits, dim=-1)
            h = h + down(nn.functional.silu(gg) * u)
        return r.head(_rms(inner.norm, h[-1:]))

    def run(fn, start: int, toks: list[int]):
        pos = torch.arange(start, start + len(toks))
        h = inner.embed_tokens(torch.tensor(toks)).float()
        cos, sin = inner.rotary_emb(h[None], pos[None])
        return fn(h, cos[0][:, None], sin[0][:, None], r.pool.kv, 0, start)

    return body, run


def main(argv: list[str] | None = None) -> int:
    mode = (argv or sys.argv[1:] or ["stack"])[0]
    torch.set_num_threads(2)
    torch._dynamo.config.cache_size_limit = 64
    model, _ = load_model(ModelConfig())
    r = FastRunner(model, name="target")
    ctx = torch.randint(100, 20000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    if mode == "per-layer":
        def block(norm2, gate_up, down):
            def mlp(h):
                g, u = gate_up(_rms(norm2, h)).split(gate_up.splits, dim=-1)
                return h + down(nn.functional.silu(g) * u)
            return torch.compile(mlp, dynamic=True)
        fn, run = _stack(r, [block(n2, gu, d) for _, _, _, n2, gu, d in r.layers])
    elif mode == "stack":
        body, run = _stack(r)
        fn = torch.compile(body, dynamic=True)
    else:
        fn, run = _stack(r)  # eager

    def ms(j: int, n: int = 20) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            run(fn, 200, ctx[:j])
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    with torch.inference_mode():
        r.pool.kv.zero_()
        t0 = time.perf_counter()
        run(fn, 0, ctx)
        run(fn, 200, ctx[:1])
        run(fn, 200, ctx[:5])
        print(f"{mode}: compile and first calls {time.perf_counter() - t0:.1f} s")
        print(f"{mode}: decode {ms(1):.1f} ms, verify of 5 {ms(5):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
