"""``python -m bench.lean_check``: the lean GPU path's own check, in seconds (``bench/gpu_check.sh lean``).

1. A tiny random Llama on the device: captured-graph replays against the same padded layout run
   eagerly (expected bitwise equal: the same kernels) and against the exact, unpadded shapes
   (the bucket's effect on a row), over decode and verify steps of several sequences.
2. With ``--target``: the target's step, ms per step of j = 1..9 new tokens at a context of
   ``--context`` tokens, for Hugging Face eager (float32, the reference), the lean forward run
   eagerly and the lean forward from graphs, and the seconds the graphs took to capture.
3. Greedy equality under batching: ``--sequences`` prompts decoded target-only one at a time, then
   all at once in shared steps (one forward for every sequence), on the graphed runner; the number
   of sequences whose tokens differ and the first position where they do.

Runs on a CPU too (graphs off there), which is how the script is checked before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 3)


def tiny_check(device: str) -> dict:
    """Graph replay vs the padded layout run eagerly vs exact shapes, on a tiny random Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculative import ForwardCall
    from speculative.lean import LeanRunner

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(device).eval()
    graphed = LeanRunner(model, graphs=True)
    padded = LeanRunner(model, graphs=False, buckets=True)
    exact = LeanRunner(model, graphs=False)
    gen = torch.Generator().manual_seed(0)
    worst_padded = worst_exact = 0.0
    for i in range(4):
        prompt = torch.randint(2, 128, (5 + 11 * i,), generator=gen).tolist()
        for r in (graphed, padded, exact):
            r.forward(f"s{i}", 0, prompt)
    for step in range(8):
        calls = []
        for i in range(4):
            have = exact.cached_length(f"s{i}")
            n = 1 + (i + step) % 5
            calls.append(ForwardCall(f"s{i}", have - (i + step) % 2, torch.randint(2, 128, (n,), generator=gen).tolist(), n))
        for group in (calls, calls[:1]):
            a, b, c = graphed.forward_batch(group), padded.forward_batch(group), exact.forward_batch(group)
            worst_padded = max(worst_padded, max(float((x - y).abs().max()) for x, y in zip(a, b)))
            worst_exact = max(worst_exact, max(float((x - y).abs().max()) for x, y in zip(a, c)))
    return {"graphs": graphed.graphs, "stats": {k: round(v, 3) if isinstance(v, float) else v for k, v in graphed.stats.items()},
            "max_abs_graph_vs_padded_eager": worst_padded, "max_abs_graph_vs_exact_shapes": worst_exact}


def target_steps(target: str, device: str, context: int, repeats: int, compiled: bool = False) -> dict:
    """ms per step of j new tokens for HF eager float32, lean eager and lean graphs (``compiled``:
    and lean graphs over compiled layers, with the seconds its compilation and captures took)."""
    from config import ModelConfig
    from speculative.runtime import make_runner, runtime_of
    from speculative.lean import LeanRunner
    from speculative.models import load_model

    model = load_model(ModelConfig(name=target, device=device))[0]
    dev = torch.device(device)
    ctx = torch.randint(100, 20000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    extra = torch.randint(100, 20000, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    t0 = time.perf_counter()
    graphed = LeanRunner(model, graphs=True, name="target")
    captured = graphed.warmup()
    out["warmup"] = {"graphs": captured, "seconds": round(time.perf_counter() - t0, 2)}
    runners = [("eager-float32", make_runner(model, "none", name="target")),
               ("lean-eager", LeanRunner(model, graphs=False, name="target")), ("lean-graphs", graphed)]
    if compiled:
        t0 = time.perf_counter()
        fused = LeanRunner(model, graphs=True, name="target", compile=True)
        captured = fused.warmup()
        out["warmup-compiled"] = {"compiled": fused.compiled, "graphs": captured, "seconds": round(time.perf_counter() - t0, 2)}
        runners.append(("lean-graphs-compiled", fused))
    for name, runner in runners:
        runner.forward("p", 0, ctx)
        ms = {j: _median_ms(lambda j=j: runner.forward("p", context, extra[:j], keep_last=j), dev, repeats)
              for j in range(1, 10)}
        out[name] = {"runtime": runtime_of(runner), "ms_per_step": ms[1],
                     "v": {j: round(m / ms[1], 3) for j, m in ms.items()}}
        runner.release("p")
    for name, runner in runners[2:]:
        out[name]["stats"] = runner.stats
    return out


def batched_equality(target: str, device: str, sequences: int, tokens: int, compiled: bool = False) -> dict:
    """Target-only greedy, alone vs all sequences in shared steps, on the graphed lean runner
    (``compiled``: over compiled layers)."""
    from config import ModelConfig
    from speculative import ForwardCall
    from speculative.lean import LeanRunner
    from speculative.models import load_model

    model, tok = load_model(ModelConfig(name=target, device=device))
    runner = LeanRunner(model, name="target", compile=compiled)
    prompts = [tok.encode(f"Question {i}: explain {w} in two sentences.")
               for i, w in enumerate(["recursion", "a hash map", "photosynthesis", "inflation", "TCP", "a B-tree",
                                      "gradient descent", "the French revolution"][:sequences])]

    def alone(p: list[int], sid: str) -> list[int]:
        out = [int(runner.forward(sid, 0, p)[-1].argmax())]
        for _ in range(tokens - 1):
            out.append(int(runner.forward(sid, len(p) + len(out) - 1, out[-1:])[-1].argmax()))
        runner.release(sid)
        return out

    want = [alone(p, f"a{i}") for i, p in enumerate(prompts)]
    got: list[list[int]] = [[int(runner.forward(f"b{i}", 0, p)[-1].argmax())] for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        calls = [ForwardCall(f"b{i}", len(p) + len(g) - 1, g[-1:]) for i, (p, g) in enumerate(zip(prompts, got))]
        for g, lg in zip(got, runner.forward_batch(calls)):
            g.append(int(lg[-1].argmax()))
    seconds = time.perf_counter() - t0
    diff = [next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), None) for w, g in zip(want, got)]
    return {"sequences": len(prompts), "tokens": tokens, "differ": sum(d is not None for d in diff),
            "first_difference": diff, "batched_tokens_per_s": round(len(prompts) * (tokens - 1) / seconds, 1),
            "stats": runner.stats}


def host_breakdown(device: str, steps: int = 64, compiled: bool = False) -> dict:
    """Where a verify step's time goes on the lean runner, for a random model of SmolLM2-135M's
    shape (no weights file needed): the whole ``verify`` call (what the engine pays) against the
    graph replay alone, per new-token count T, each phase timed with the device synchronised."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculative import VerifyCall
    from speculative.lean import LeanRunner

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
                      rope_theta=100000.0, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).to(device).eval()
    runner = LeanRunner(model, name="target", compile=compiled)
    runner.warmup()
    dev = torch.device(device)
    out = {}
    for T in (1, 7, 17):
        runner.verify([VerifyCall("h", 0, list(range(100, 300)), 1)])
        pos = 200
        walls = []
        for i in range(steps):
            _sync(dev)
            t0 = time.perf_counter()
            runner.verify([VerifyCall("h", pos, list(range(1000, 1000 + T)), T)])
            walls.append(time.perf_counter() - t0)
            pos += 1
        keys = [k for k in runner._graphs if k[0] == runner.least and k[1] >= T]
        replay = _median_ms(runner._graphs[min(keys)][0].replay, dev, steps) if keys else None
        out[T] = {"verify_ms": round(1000 * statistics.median(walls), 3), "replay_ms": replay}
        runner.release("h")
    return out


def row_invariance(device: str, compiled: bool) -> dict:
    """Bitwise: the logits of 5 positions from 5 decode steps of one sequence, from one verify step
    of the 5 tokens, and from a step shared with 2 other sequences, on a random model of
    SmolLM2-135M's shape (no weights file needed). Counts the rows that differ and the argmaxes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculative import ForwardCall
    from speculative.lean import LeanRunner

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
                      rope_theta=100000.0, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).to(device).eval()
    t0 = time.perf_counter()
    lean = LeanRunner(model, name="target", compile=compiled)
    lean.warmup((1, 2, 4))
    setup_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    rows = argmax = 0
    for trial in range(8):
        ids = [torch.randint(100, 20000, (40 + 13 * i + trial,), generator=gen).tolist() for i in range(3)]
        for i in range(3):
            lean.forward(f"v{i}", 0, ids[i])
        ends = [len(x) for x in ids]
        draft = torch.randint(100, 20000, (5,), generator=gen).tolist()
        alone = torch.stack([lean.forward("v0", ends[0] + j, draft[j : j + 1])[0] for j in range(5)])
        verify = lean.forward("v0", ends[0], draft, 5)
        shared = lean.forward_batch([ForwardCall("v0", ends[0], draft, 5)]
                                    + [ForwardCall(f"v{i}", ends[i], draft[:i], i) for i in (1, 2)])[0]
        for other in (verify, shared):
            rows += int((other != alone).any(-1).sum())
            argmax += int((other.argmax(-1) != alone.argmax(-1)).sum())
        for i in range(3):
            lean.release(f"v{i}")
    return {"compiled": lean.compiled, "rows_compared": 8 * 2 * 5, "rows_differ": rows, "argmax_differ": argmax,
            "setup_s": round(setup_s, 1), "stats": {k: round(v, 3) if isinstance(v, float) else v for k, v in lean.stats.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--target", default=None, help="the target (a .gguf, a folder or embedded:...); omitted: the tiny check only")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--json", default=None)
    p.add_argument("--host", action="store_true", help="also: verify call against graph replay, a random SmolLM2-135M-shaped model")
    p.add_argument("--compile", action="store_true", help="also the lean runner over compiled layers (torch.compile)")
    p.add_argument("--invariance", action="store_true",
                   help="also: bitwise, a row's logits from decode, verify and shared steps (a random SmolLM2-135M-shaped model)")
    args = p.parse_args(argv)
    res = {"device": args.device, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
           "tiny": tiny_check(args.device)}
    print(json.dumps(res["tiny"]), flush=True)
    if args.invariance:
        for compiled in (False, True) if args.compile else (False,):
            key = "invariance-compiled" if compiled else "invariance"
            res[key] = row_invariance(args.device, compiled)
            print(f"{key}:", json.dumps(res[key]), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
    if args.host:
        res["host"] = host_breakdown(args.device)
        print("verify call against replay, ms by new tokens:", json.dumps(res["host"]), flush=True)
        if args.compile:
            res["host-compiled"] = host_breakdown(args.device, compiled=True)
            print("the same, compiled layers:", json.dumps(res["host-compiled"]), flush=True)
    if args.target:
        res["steps"] = target_steps(args.target, args.device, args.context, args.repeats, args.compile)
        for name in ("eager-float32", "lean-eager", "lean-graphs") + (("lean-graphs-compiled",) if args.compile else ()):
            e = res["steps"][name]
            print(f"{name:14s} {e['ms_per_step']:8.3f} ms/step  v(j): " + " ".join(f"{v:.2f}" for v in e["v"].values()), flush=True)
        print("warmup:", res["steps"]["warmup"], res["steps"].get("warmup-compiled", ""), flush=True)
        res["batched"] = batched_equality(args.target, args.device, args.sequences, args.tokens)
        print("batched greedy:", json.dumps(res["batched"]), flush=True)
        if args.compile:
            res["batched-compiled"] = batched_equality(args.target, args.device, args.sequences, args.tokens, compiled=True)
            print("batched greedy, compiled layers:", json.dumps(res["batched-compiled"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
