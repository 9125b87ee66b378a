"""How one speculative step is counted: vLLM's spec-decode counters, with our labels. The draft
pool calls :func:`count_step` once a step; it holds no decoding state of its own."""

from __future__ import annotations

from .meter import Meter


def count_step(m: Meter, labels: dict, *, k: int, accepted: int, emitted: int, proposer: str, version: str | int,
               draft_s: float, waited_s: float, cost: float = 1.0) -> None:
    """One step of a request into ``m``. ``labels``: tenant, domain, language, draft; ``k`` draft
    tokens proposed by ``proposer`` (the learned draft, "suffix", "ngram"), ``accepted`` of them;
    ``emitted`` output tokens; ``version``: the learned draft's version, or the model-free
    proposer's name; ``draft_s`` spent proposing, ``waited_s`` waiting for the step's verification;
    ``cost``: the step's in target-only steps (``StepResult.cost``)."""
    draft = labels["draft"]
    m.inc("osd_spec_decode_num_steps_total", **labels)
    m.inc("osd_spec_decode_emitted_tokens_total", emitted, **labels)
    m.inc("osd_spec_decode_step_cost_total", cost, **labels)
    m.observe("osd_spec_decode_k", k, draft=draft)
    m.inc("osd_spec_decode_draft_seconds_total", draft_s, draft=draft)
    m.inc("osd_spec_decode_verify_wait_seconds_total", waited_s, draft=draft)
    if k == 0:
        return
    m.inc("osd_spec_decode_num_drafts_total", **labels)
    m.inc("osd_spec_decode_num_draft_tokens_total", k, **labels)
    m.inc("osd_spec_decode_num_accepted_tokens_total", accepted, **labels)
    by = {"tenant": labels["tenant"], "domain": labels["domain"], "proposer": proposer}
    m.inc("osd_spec_decode_proposer_draft_tokens_total", k, **by)
    m.inc("osd_spec_decode_proposer_accepted_tokens_total", accepted, **by)
    m.observe("osd_spec_decode_accepted_length", accepted, draft=draft)
    m.inc("osd_spec_decode_draft_version_draft_tokens_total", k, draft=draft, draft_version=version)
    m.inc("osd_spec_decode_draft_version_accepted_tokens_total", accepted, draft=draft, draft_version=version)
    for i in range(k):
        m.inc("osd_spec_decode_num_draft_tokens_per_pos_total", draft=draft, position=i)
        if i < accepted:
            m.inc("osd_spec_decode_num_accepted_tokens_per_pos_total", draft=draft, position=i)
