"""``python -m bench.draft_batch``: what the engine loop saves by running the learned drafts'
forwards of several sequences together. The serve config's draft (its runtime, as served) takes
one-token steps at a ``--context``-token prefix for 1, 4 and 8 sequences, once batched (one
forward, as the loop's propose phase runs a round) and once one sequence at a time (as each
proposal ran its own); best of ``--repeats``.

With ``--drafts N`` the sequences are spread over N drafts that share the start's packed base,
each with an adapter of its own (random, of the served adapter's rank and keys: the cost of a
trained one), as a replica's domain drafts are. A round then also runs one forward per draft (how
the loop ran drafts of several domains before they shared a forward), and the shared forward is
checked to give each sequence its own draft's rows."""

from __future__ import annotations

import argparse
import copy
import time

from bench.bench import write_json


def _drafts(draft, n: int, seed: int = 0) -> list:
    """``n`` copies of ``draft`` sharing its base, each with random adapters (B ~ 0.02 N(0, 1))."""
    import torch

    from speculative.adapters import adapter_state

    if n == 1:
        return [draft]
    state = adapter_state(draft.runner.model)
    if not state:
        raise SystemExit("--drafts needs a draft with adapters (draft.adapter in the serve config)")
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        d = copy.deepcopy(draft, draft.runner.share_memo())
        d.load_state_dict({k: (torch.randn(v.shape, generator=g) * 0.02).to(v.dtype) if k.endswith("lora_B") else v
                           for k, v in state.items()}, i + 1)
        out.append(d)
    return out


def measure(sequences: tuple[int, ...] = (1, 4, 8), context: int = 100, repeats: int = 20, threads: int = 2,
            drafts: int = 1) -> list[dict]:
    import torch

    from deployments.launch import read_config
    from drafts.build import build_engine
    from speculative.proposers import learned_draft
    from speculative.runner import ForwardCall

    _, cfg, _ = read_config()
    engine_cfg = cfg.engine.model_copy(update={"model": cfg.engine.model.model_copy(update={"num_threads": threads})})
    draft = learned_draft(build_engine(engine_cfg, calibrate=False).proposer)
    if draft is None:
        raise SystemExit("the serve config's engine has no learned draft")
    runners = [d.runner for d in _drafts(draft, drafts)]
    torch.set_num_threads(threads)
    rows = []
    for n in sequences:
        seqs = [(runners[i % len(runners)], f"s{i}") for i in range(n)]
        for r, s in seqs:
            r.forward(s, 0, list(range(10, 10 + context)))
        batched = per_draft = alone = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            together = runners[0].forward_with([(r, ForwardCall(s, context, [5], 1)) for r, s in seqs])
            batched = min(batched, time.perf_counter() - t0)
            if len(runners) > 1:
                t0 = time.perf_counter()
                for r in runners:
                    mine = [ForwardCall(s, context, [5], 1) for q, s in seqs if q is r]
                    if mine:
                        r.forward_batch(mine)
                per_draft = min(per_draft, time.perf_counter() - t0)
            t0 = time.perf_counter()
            one = [r.forward(s, context, [5], 1) for r, s in seqs]
            alone = min(alone, time.perf_counter() - t0)
            if not all(torch.equal(x, y) for x, y in zip(together, one)):
                raise SystemExit("a shared forward's rows differ from the sequences' own")
        for r, s in seqs:
            r.release(s)
        row = {"sequences": n, "drafts": len(runners), "batched_ms": 1e3 * batched, "one_by_one_ms": 1e3 * alone}
        if len(runners) > 1:
            row["one_forward_per_draft_ms"] = 1e3 * per_draft
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.draft_batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--drafts", type=int, default=1, help="drafts (adapters on one base) the sequences are spread over")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = measure(context=args.context, repeats=args.repeats, drafts=args.drafts)
    for r in rows:
        per = f", one forward per draft {r['one_forward_per_draft_ms']:.2f} ms" if "one_forward_per_draft_ms" in r else ""
        print(f"{r['sequences']} sequences on {r['drafts']} draft(s): one round batched {r['batched_ms']:.2f} ms{per}, "
              f"one by one {r['one_by_one_ms']:.2f} ms")
    write_json({"context": args.context, "repeats": args.repeats, "drafts": args.drafts, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
