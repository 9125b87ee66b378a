"""bench.prompt_rows: a record extended by the target's rows over its prompt's last positions."""

from __future__ import annotations

import torch

from bench.prompt_rows import with_prompt_rows
from learner.record import ReplayRecord
from learner.trainer import records_to_batch


def _record(length: int, prompt_len: int, k: int = 4) -> ReplayRecord:
    rows = length - prompt_len
    probs = torch.full((rows, k), 0.2)
    return ReplayRecord(tokens=torch.arange(3, 3 + length, dtype=torch.int32), prompt_len=prompt_len,
                        positions=torch.arange(prompt_len, length, dtype=torch.int32),
                        top_ids=torch.tensor([[1, 2, 3, 4][:k]] * rows, dtype=torch.int32), top_probs=probs,
                        tail=1 - probs.sum(-1), draft_wrong=torch.tensor([False, True] * (rows // 2) + [True] * (rows % 2)),
                        domain="code", draft_id="d", draft_version=3, request_id="r")


def test_the_prompt_rows_are_the_targets_distributions_there_and_the_output_rows_stay(target):
    rec = _record(14, 9)
    out = with_prompt_rows(rec, target, 3)
    assert out.prompt_len == 6 and out.positions.tolist() == list(range(6, 14))
    with torch.inference_mode():
        p = torch.softmax(target(input_ids=rec.tokens.long()[None]).logits[0].float(), -1)  # row t-1 predicts token t
    for i, t in enumerate(range(6, 9)):
        want = torch.topk(p[t - 1], 4)
        assert out.top_ids[i].tolist() == want.indices.tolist()
        assert torch.allclose(out.top_probs[i].float(), want.values, atol=1e-3)
        assert abs(float(out.tail[i]) - (1 - float(want.values.sum()))) < 1e-3
    assert torch.equal(out.top_ids[3:], rec.top_ids) and torch.equal(out.top_probs[3:], rec.top_probs)
    assert torch.equal(out.draft_wrong[3:], rec.draft_wrong) and out.draft_wrong[:3].all()
    assert not out.proposed[:3].any() and out.proposed[3:].all()
    assert (out.domain, out.draft_id, out.draft_version, out.request_id) == ("code", "d", 3, "r")
    assert torch.equal(out.tokens, rec.tokens)


def test_rows_start_at_the_second_prompt_position_or_after_the_templates_start_and_none_leave_the_record(target):
    rec = _record(10, 5)
    assert with_prompt_rows(rec, target, 50).positions.tolist()[:3] == [2, 3, 4]
    assert with_prompt_rows(rec, target, 0) is rec
    assert with_prompt_rows(rec, target, 50, first=4).positions.tolist()[:2] == [4, 5]
    short = _record(6, 2)
    assert with_prompt_rows(short, target, 8) is short


def test_the_trainer_trains_on_the_prompt_rows_as_on_output_rows(target):
    rec = _record(14, 9)
    (plain,), _ = records_to_batch([rec], "all")
    (more,), mask = records_to_batch([with_prompt_rows(rec, target, 3)], "all")
    assert more.n_out == plain.n_out + 3 and mask.shape == (more.n_out,) and bool(mask.all())
    assert torch.equal(more.ids[3:], plain.ids)


def test_the_template_start_is_what_every_prompt_of_the_engine_begins_with(make_engine, make_tokenizer):
    from bench.prompt_rows import template_start

    tok = make_tokenizer()
    assert template_start(make_engine(tokenizer=tok)) == 0  # no chat template: prompts share nothing
    tok.chat_template = "sys: be brief\nuser: {{ messages[0]['content'] }}\nbot: "
    engine = make_engine(tokenizer=tok, chat_template=True)
    assert template_start(engine) == len(tok("sys: be brief\nuser: ")["input_ids"]) > 10
