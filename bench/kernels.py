"""The measurements behind the fast path's choice of kernels (docs/fast.md).

1. Every linear layer of the target, one forward, M rows at once, for each candidate kernel:
   float32 ``F.linear``, fbgemm dynamic int8, ``torch._int_mm`` with per-row int8 activations,
   int8 weight-only and int4 weight-only (torch's kernels, bfloat16 activations), and the native
   int8 and int4 kernels (:mod:`speculative.qmatmul`, 8-bit activations); and whether a row's result depends on the other rows of
   the call (max |row computed with 8 others - row alone|).
2. The int4 runtime's step split: a whole step vs its matrix kernels alone (the rest is per-op
   overhead).
3. Prefill of n prompt tokens: the int4 runtime vs llama.cpp (when installed).

    python -m bench.kernels --json results/fast/kernels.json
"""

from __future__ import annotations

import statistics
import time

import torch

from config import EMBEDDED_TARGET, ModelConfig
from speculative.fast import FastRunner, Int4Linear, Int8Linear
from speculative.models import load_model

from .bench import measurement_cli
from .llamacpp import BackendUnavailable, gguf_of, load_llamacpp

ROWS = (1, 2, 4, 8, 9, 16, 32, 64)


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 2)


def _kernels(linears: list[torch.nn.Linear]) -> dict:
    """name -> (module-like callables over the model's linears)."""
    import torch.ao.quantization as tq

    def fbgemm(lin):
        return tq.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)[0]

    def int_mm(lin):  # per-row symmetric int8 activations, per-channel int8 weights, int32 accumulation
        w = lin.weight.detach().float()
        s = w.abs().amax(1).clamp_min(1e-12) / 127
        wt = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8).t().contiguous()

        def f(x):
            xs = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
            return torch._int_mm((x / xs).round().to(torch.int8), wt).float() * xs * s
        return f

    return {
        "float32": [lin for lin in linears],
        "fbgemm_dynamic_int8": [fbgemm(lin) for lin in linears],
        "int_mm_per_row_int8": [int_mm(lin) for lin in linears],
        "int8_weight_only": [Int8Linear(lin, native=False) for lin in linears],
        "int4_weight_only": [Int4Linear(lin, native=False) for lin in linears],
        "int8_native": [Int8Linear(lin) for lin in linears],  # 8-bit activations, integer products
        "int4_native": [Int4Linear(lin) for lin in linears],
    }


@torch.inference_mode()
def measure(target_name: str = EMBEDDED_TARGET, repeats: int = 9, prefill: tuple[int, ...] = (32, 100, 300),
            threads: int = 2) -> dict:
    target, _ = load_model(ModelConfig(name=target_name, quantize="none"))
    linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    out: dict = {"linears": len(linears), "kernels": {}, "skipped": {}}
    g = torch.Generator().manual_seed(0)
    for name, fns in _kernels(linears).items():
        entry = {}
        for m in ROWS:
            xs = {k: torch.randn(m, k, generator=g) for k in {lin.in_features for lin in linears}}
            entry[f"M={m}"] = _median_ms(lambda: [f(xs[lin.in_features]) for f, lin in zip(fns, linears)], repeats)
        lin, f = linears[0], fns[0]
        x = torch.randn(9, lin.in_features, generator=g)
        alone = torch.cat([f(x[i : i + 1]) for i in range(9)])
        entry["row_dependence"] = float((f(x) - alone).abs().max())
        out["kernels"][name] = entry
    runner = FastRunner(target, bits=4)
    ids = [(1000 + 7 * i) % target.config.vocab_size for i in range(max(prefill + (128,)))]
    runner.forward("s", 0, ids[:128])
    packed = [mod for layer in runner.layers for mod in (layer[1], layer[2], layer[4], layer[5])] + [runner.head]
    xs = {w: torch.randn(1, w, generator=g) for w in {target.config.hidden_size, target.config.intermediate_size}}

    out["int4_step_ms"] = _median_ms(lambda: runner.forward("s", 128, [5]), 4 * repeats)
    out["int4_step_kernels_ms"] = _median_ms(lambda: [mod(xs[mod.in_features]) for mod in packed], 4 * repeats)
    out["prefill_ms"] = {"int4": {n: _median_ms(lambda: runner.forward("p", 0, ids[:n]), 3) for n in prefill}}
    try:
        llm = load_llamacpp(gguf_of(target_name), threads)

        def llama_prefill(n):
            llm.reset()
            llm.eval(ids[:n])
        out["prefill_ms"]["llama.cpp"] = {n: _median_ms(lambda: llama_prefill(n), 3) for n in prefill}
    except BackendUnavailable as e:
        out["skipped"]["llama.cpp"] = str(e)
    return out


def main(argv=None) -> int:
    return measurement_cli("python -m bench.kernels", __doc__,
                           lambda ap: ap.add_argument("--repeats", type=int, default=9),
                           lambda a: measure(a.target, a.repeats, threads=a.threads), argv)


if __name__ == "__main__":
    raise SystemExit(main())
