"""``python -m bench.loop_concurrency``: the engine replica's own throughput at each concurrency,
without Ray or HTTP: the server's ``DraftPool`` class built in this process from the serve config,
driven through its ``generate`` stream by asyncio clients (chat prompts of the workload, a set of
its own per level, greedy). Reports aggregate tokens/s and what the engine loop's target forwards
were made of (sequences and tokens per forward, the target's compute), so that the server's
figures (``osd bench-serve``) can be split into what the loop gives and what the transport takes.

``--proposers`` (none listed) serves target-only through the same loop (continuous batching, no speculation).
``--busy N`` runs N other processes meanwhile, each busy ``--busy-ms`` in every ``--period-ms`` (the
CPU a server's other processes take in bursts; docs/serving.md, "Where the server's time goes
beside the loop"); ``--target-threads`` sets the target's threads instead of the config's.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from bench.bench import select, write_json
from bench.serve_bench import DEFAULT_WORKLOAD


def build_pool(config: str | None, proposers: list[str] | None = None, torch_attention: bool = False,
               target_threads: int | None = None):
    """The serve config's engine replica (co-located placement), learner off; ``proposers``: these
    instead of the config's (``[]``: target-only); ``torch_attention``: its target attends with
    torch ops instead of the native kernel (speculative/attend.py); ``target_threads``: the
    target's threads instead of the config's."""
    from deployments.drafts import DraftPool
    from deployments.launch import read_config

    _, cfg, _ = read_config(config) if config else read_config()
    if target_threads is not None:
        cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"num_threads": target_threads})})
    if proposers is not None:
        from config import DraftConfig

        draft = cfg.engine.draft.model_dump()
        draft.update(proposers=proposers, select=draft["select"] if proposers else "order",
                     adapter=draft["adapter"] if "draft" in proposers else None)
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"draft": DraftConfig.model_validate(draft)})})
    pool = DraftPool(cfg.model_copy(update={"placement": "colocated"}))
    if torch_attention:
        pool.loop.target.attention_kernel = None
    return pool


async def _level(pool, engine, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    from config import SamplingParams
    from deployments.protocol import Chunk, GenerateRequest, Refused

    loop = pool.loop
    forwards: list[tuple[int, int, float]] = []
    counted = pool._count_forward

    def on_step(calls: int, tokens: int, seconds: float) -> None:
        forwards.append((calls, tokens, seconds))
        counted(calls, tokens, seconds)

    loop.on_step = on_step
    queue = list(texts)
    outputs: dict[int, list[int]] = {}
    ttft: list[float] = []

    async def client() -> None:
        while queue:
            i = len(texts) - len(queue)
            text = queue.pop(0)
            req = GenerateRequest(request_id=uuid.uuid4().hex, params=SamplingParams(max_tokens=max_tokens),
                                  messages=[{"role": "user", "content": text}])
            t0, ids, seen = time.perf_counter(), [], False
            async for item in pool.generate(req, engine):
                if isinstance(item, Refused):
                    raise RuntimeError(item.error)
                if isinstance(item, Chunk):
                    if item.text and not seen:  # time to first text, as a client sees it
                        ttft.append(time.perf_counter() - t0)
                        seen = True
                    ids += item.tokens
            outputs[i] = ids

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    loop.on_step = counted
    tokens = sum(len(v) for v in outputs.values())
    n = max(len(forwards), 1)
    ttft.sort()
    return {
        "concurrency": concurrency, "requests": len(texts), "output_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall, "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2] if ttft else None,
        "forwards": len(forwards), "seqs_per_forward": sum(f[0] for f in forwards) / n,
        "tokens_per_forward": sum(f[1] for f in forwards) / n,
        "target_ms_per_forward": 1e3 * sum(f[2] for f in forwards) / n,
        "target_share_of_wall": sum(f[2] for f in forwards) / wall,
        "outputs": [outputs[i] for i in range(len(texts))],
        "forward_log": [[c, t, round(1e3 * s, 2)] for c, t, s in forwards],  # (sequences, tokens, ms) of each
    }


def _busy(busy_s: float, period_s: float) -> None:
    """A process that takes CPU in bursts: busy ``busy_s`` in every ``period_s``, until killed."""
    while True:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy_s:
            pass
        time.sleep(max(0.0, period_s - busy_s))


def run(config: str | None, proposers: list[str] | None, workload: str, n: int, levels: list[int], max_tokens: int,
        torch_attention: bool = False, target_threads: int | None = None, busy: tuple[int, float, float] = (0, 0.0, 0.0)) -> dict:
    """``busy``: (processes, seconds busy, in every so many seconds) running beside the levels."""
    import multiprocessing

    from router.router import GENERAL
    from workloads import load_workload

    pool = build_pool(config, proposers, torch_attention, target_threads)
    others = [multiprocessing.get_context("spawn").Process(target=_busy, args=busy[1:], daemon=True) for _ in range(busy[0])]
    try:
        engine = asyncio.run(pool.engine_for(GENERAL))
        records = select(load_workload(workload), n * len(levels))
        out = {"config": config, "proposers": "config" if proposers is None else proposers, "workload": workload,
               "attention": "kernel" if pool.loop.target.attention_kernel is not None else "torch", "n": n, "max_tokens": max_tokens,
               "step_cost": vars(pool.loop.step_cost) if pool.loop.step_cost else None,
               "target_threads": target_threads, "busy": {"processes": busy[0], "busy_s": busy[1], "period_s": busy[2]},
               "levels": []}
        for p in others:
            p.start()
        for i, c in enumerate(levels):
            texts = [r.text for r in records[i * n : (i + 1) * n]]
            res = asyncio.run(_level(pool, engine, texts, c, max_tokens))
            print(f"concurrency {c}: {res['tokens_per_s']:.1f} tokens/s, TTFT p50 {res['ttft_p50_ms']:.0f} ms, "
                  f"{res['forwards']} forwards of {res['seqs_per_forward']:.1f} seqs / {res['tokens_per_forward']:.1f} tokens, "
                  f"{res['target_ms_per_forward']:.1f} ms each ({100 * res['target_share_of_wall']:.0f}% of the wall)", flush=True)
            out["levels"].append(res)
        return out
    finally:
        for p in others:
            p.kill()
        pool.loop.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.loop_concurrency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="serve config (default serve_config.yaml)")
    ap.add_argument("--proposers", nargs="*", default=None, choices=["suffix", "ngram", "draft"],
                    help="these proposers instead of the config's (none listed: target-only through the same loop)")
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--n", type=int, default=24, help="requests per level (each level its own prompts)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--torch-attention", action="store_true", help="the target attends with torch ops, not the native kernel")
    ap.add_argument("--target-threads", type=int, default=None, help="the target's threads (default: the config's)")
    ap.add_argument("--busy", type=int, default=0, help="other processes taking CPU in bursts meanwhile")
    ap.add_argument("--busy-ms", type=float, default=2.0)
    ap.add_argument("--period-ms", type=float, default=10.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args.config, args.proposers, args.workload, args.n, args.concurrency, args.max_tokens, args.torch_attention,
              args.target_threads, (args.busy, args.busy_ms / 1e3, args.period_ms / 1e3))
    if len(res["levels"]) > 1:
        print(f"concurrency {res['levels'][-1]['concurrency']} / {res['levels'][0]['concurrency']}: "
              f"{res['levels'][-1]['tokens_per_s'] / res['levels'][0]['tokens_per_s']:.2f}x")
    if args.json:
        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
