"""Would the online learner gain from the target's distributions over the prompt's last tokens?

``python -m bench.prompt_rows --rows W <osd experiment shift options>`` runs ``osd experiment
shift`` with every replay record extended by rows for its last ``W`` prompt positions before the
learner sees it: the target's top-K there, from a separate forward of the target's float model
over the prompt (:func:`with_prompt_rows`). Rows that predict the chat template's system turn
before the user's text are left out: every record has it, and it says nothing about its domain.
The record's ``prompt_len`` moves back to the first of them, so the learner trains on them as on
output rows (its window of ``--draft-context`` tokens then ends where they start). A server would read them from the prefill; this measures first
whether they are worth it. The served stream, its outputs and its scores are those of the command
without ``--rows``; only what the learner trains on changes (and its seconds).
"""

from __future__ import annotations

import argparse
import sys

import torch

from learner.record import ReplayRecord


@torch.inference_mode()
def with_prompt_rows(rec: ReplayRecord, model: torch.nn.Module, rows: int, first: int = 2) -> ReplayRecord:
    """``rec`` with rows for positions ``max(first, 2, prompt_len - rows) .. prompt_len - 1`` first.

    Row t is the target's distribution of ``tokens[t]`` given ``tokens[:t]``: ``model``'s logits at
    t - 1 over the prompt, summarised to the record's top-K and tail. Those rows were never
    proposed by a draft (``proposed`` False, ``draft_wrong`` True, as for a row nothing drafted).
    ``first``: the template's fixed tokens before the user's text. No such position, or ``rows`` 0,
    gives ``rec`` back."""
    from learner.losses import sparse_from_logits

    p0 = rec.prompt_len
    start = max(first, 2, p0 - rows)
    if rows <= 0 or start >= p0 or rec.n_rows == 0:
        return rec
    logits = model(input_ids=rec.tokens[: p0 - 1].long()[None]).logits[0, start - 1 :]  # [p0 - start, V]
    sd = sparse_from_logits(logits.float(), rec.k)
    n = p0 - start
    return ReplayRecord(
        tokens=rec.tokens, prompt_len=start,
        positions=torch.cat([torch.arange(start, p0, dtype=torch.int32), rec.positions]),
        top_ids=torch.cat([sd.ids.to(torch.int32), rec.top_ids]),
        top_probs=torch.cat([sd.probs.to(rec.top_probs.dtype), rec.top_probs]),
        tail=torch.cat([sd.tail.to(rec.tail.dtype), rec.tail]),
        draft_wrong=torch.cat([torch.ones(n, dtype=torch.bool), rec.draft_wrong]),
        proposed=torch.cat([torch.zeros(n, dtype=torch.bool), rec.proposed]),
        domain=rec.domain, tenant=rec.tenant, draft_id=rec.draft_id, draft_version=rec.draft_version,
        created=rec.created, request_id=rec.request_id)


def template_start(engine) -> int:
    """How many tokens every prompt of ``engine`` starts with (its chat template's system turn)."""
    from learner.offline import shared_prefix_len

    return shared_prefix_len([torch.tensor(engine.encode(t)) for t in ("1 + 1", "Spell it backwards: hat")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prompt_rows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, required=True, help="prompt positions a record gains (0: the plain command)")
    a, rest = ap.parse_known_args(argv)
    import bench.experiments as experiments

    served = experiments.serve_recorded
    starts: dict[int, int] = {}  # id(engine) -> its template's start: one per method's engine, not per record

    def extended(engine, prompt, params, **kw):
        rec, *more = served(engine, prompt, params, **kw)
        if rec is None:
            return (rec, *more)
        if id(engine) not in starts:
            starts[id(engine)] = template_start(engine)
        return (with_prompt_rows(rec, engine.target.model, a.rows, starts[id(engine)]), *more)

    experiments.serve_recorded = extended  # the stream's learner is fed what this returns
    try:
        return experiments.main(["shift", *rest])  # what `osd experiment shift` runs
    finally:
        experiments.serve_recorded = served


if __name__ == "__main__":
    sys.exit(main())
