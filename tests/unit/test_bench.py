"""The benchmark harness end to end on the tiny model: balanced selection, every method's output
checked against target-only greedy, and the report's figures consistent with its rows."""

from __future__ import annotations

import pytest
import torch

from bench.bench import format_table, run_bench, select
from bench.experiments import token_acceptance
from workloads import WorkloadRecord, without_prompts_of
from drafts.build import truncated_draft


def _records():
    texts = {
        "code": ["def f(x): return x", "abcabc abcabc", "for i in range(3):"],
        "chat": ["Hello world!", "The quick brown fox", "How are you?"],
        "math": ["1 + 1 = 2, 2 + 2 = 4", "x*x - 1 = 0"],
    }
    return [WorkloadRecord(t, d, "en", f"test:{d}{i}") for d, ts in texts.items() for i, t in enumerate(ts)]


def test_select_is_round_robin_and_bounded():
    recs = _records()
    picked = select(recs, 5)
    assert [r.domain for r in picked] == ["code", "chat", "math", "code", "chat"]
    assert select(recs, 100) == [r for r in picked] + [r for r in select(recs, 100)[5:]]
    assert len(select(recs, 100)) == len(recs)
    assert {r.domain for r in select(recs, 10, ["math"])} == {"math"}


@pytest.fixture
def bench_engine(make_engine, target, draft_proposer):
    return make_engine(draft_proposer(truncated_draft(target, 1)), k=2)


def test_run_bench_all_methods(bench_engine):
    recs = _records()
    res = run_bench(bench_engine, recs, max_tokens=12, progress=False)
    overall = res["domains"]["overall"]
    assert set(overall) == {"target", "spec", "spec_lookup", "hf_assisted", "hf_lookup"}
    # every method decodes greedily: all outputs equal the target's
    for m, e in overall.items():
        assert e["all_equal_target_greedy"], m
        assert e["prompts"] == len(recs)
    # the report is consistent with its per-prompt rows
    rows = res["rows"]
    assert overall["target"]["tokens"] == sum(r["target"]["tokens"] for r in rows)
    assert overall["spec"]["proposed"] == sum(r["spec"]["proposed"] for r in rows)
    spec = overall["spec"]
    assert spec["alpha"] == pytest.approx(spec["accepted"] / spec["proposed"], abs=1e-4)
    assert spec["mean_k"] == pytest.approx(spec["proposed"] / spec["steps"], abs=1e-3)
    # rows carry rejections too, so any subset of prompts gives its per-token acceptance
    assert sum(r["spec"]["rejected"] for r in rows) > 0
    assert token_acceptance([r["spec"] for r in rows]) == pytest.approx(spec["token_acceptance"], abs=1e-4)
    assert overall["target"]["speedup"] == 1.0
    assert set(res["domains"]) == {"code", "chat", "math", "overall"}
    table = format_table(res)
    assert "overall" in table and "spec_lookup" in table


def test_run_bench_skips_assisted_for_restricted_head(make_engine, target, draft_proposer):
    import torch

    from drafts.build import restrict_head

    keep = torch.arange(0, 64)
    draft = restrict_head(truncated_draft(target, 1), keep)
    engine = make_engine(draft_proposer(draft, keep), k=2)
    res = run_bench(engine, _records()[:2], max_tokens=6, methods=("spec", "hf_assisted"), progress=False)
    assert "hf_assisted" in res["skipped"]
    assert set(res["domains"]["overall"]) == {"target", "spec"}
    assert res["domains"]["overall"]["spec"]["all_equal_target_greedy"]


def test_without_prompts_of_drops_the_excluded_file_s_prompts(tmp_path):
    recs = [WorkloadRecord("a", "code"), WorkloadRecord("b", "code"), WorkloadRecord("c", "sql")]
    (tmp_path / "x.jsonl").write_text(WorkloadRecord("b", "chat").to_json() + "\n")
    assert [r.text for r in without_prompts_of(recs, tmp_path / "x.jsonl")] == ["a", "c"]
    assert without_prompts_of(recs, None) == recs


def test_a_missing_llama_cpp_is_a_clear_message_and_the_bench_carries_on(bench_engine, monkeypatch, tmp_path):
    import sys

    from bench.llamacpp import BackendUnavailable, gguf_of, load_llamacpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    with pytest.raises(BackendUnavailable, match=r"llama.cpp is not installed: pip install 'osd-serve\[llamacpp\]'"):
        load_llamacpp(tmp_path / "model.gguf")
    with pytest.raises(BackendUnavailable, match="runs GGUF files"):
        gguf_of(str(tmp_path))  # a folder without a .gguf
    res = run_bench(bench_engine, _records()[:2], max_tokens=4, methods=("spec", "llamacpp"), progress=False)
    assert "llamacpp" in res["skipped"] and set(res["domains"]["overall"]) == {"target", "spec"}


def test_other_runtimes_are_timed_and_reported_as_agreement(bench_engine):
    res = run_bench(bench_engine, _records()[:3], max_tokens=6, methods=("target_int8", "target_int4", "target_fp32"),
                    progress=False)
    overall = res["domains"]["overall"]
    assert "target_fp32" in res["skipped"]  # the tiny engine serves float32 eager: that is "target"
    assert {"target_int8", "target_int4"} <= set(overall)
    for m in ("target_int8", "target_int4"):
        assert overall[m]["lossless_method"] is False and overall[m]["tokens"] > 0
    assert "~" in format_table(res)


def test_suffix_and_controller_methods_are_lossless_and_learn_as_the_bench_goes(bench_engine):
    """spec_suffix / spec_controller decode every prompt to the target's output; served twice, the
    suffix tree drafts the repeats from the first pass."""
    recs = _records()[:3] * 2
    res = run_bench(bench_engine, recs, max_tokens=12, methods=("spec_suffix", "spec_controller"), progress=False)
    overall = res["domains"]["overall"]
    for m in ("spec_suffix", "spec_controller"):
        assert overall[m]["all_equal_target_greedy"] and overall[m]["lossless_method"], m
    second = [r["spec_suffix"] for r in res["rows"][3:]]
    assert sum(r["accepted"] for r in second) > 0


def test_a_draft_with_acceptance_set_by_hand_is_accepted_at_that_rate_and_stays_lossless(make_engine, target, draft_proposer,
                                                                                         prompts):
    """bench.oracle: at A = 1 every token the draft proposes is accepted, at A = 0 none, at 0.5 about
    half of those checked; outputs equal target-only in every case (verification decides)."""
    from config import SamplingParams
    from bench.oracle import AcceptanceDraft

    inner = draft_proposer(truncated_draft(target, 1))
    alone = make_engine(None)
    rates = {}
    for a in (1.0, 0.0, 0.5):
        draft = AcceptanceDraft(inner, a, seed=3)
        engine = make_engine(draft, k=3)
        accepted = checked = proposed = 0
        for ids in prompts * 3:
            ref = alone.generate(ids, SamplingParams(max_tokens=24)).token_ids
            draft.reference = ids + ref
            g = engine.generate(ids, SamplingParams(max_tokens=24))
            assert g.token_ids == ref
            accepted, checked = accepted + g.stats.accepted, checked + g.stats.accepted + g.stats.rejected
            proposed += g.stats.proposed
        assert proposed > 0
        rates[a] = accepted / checked
    assert rates[1.0] == 1.0 and rates[0.0] == 0.0
    assert 0.3 < rates[0.5] < 0.7, rates


def test_acceptance_draft_refuses_sampling_and_bad_rates(target, draft_proposer):
    from bench.oracle import AcceptanceDraft

    inner = draft_proposer(truncated_draft(target, 1))
    with pytest.raises(ValueError):
        AcceptanceDraft(inner, 1.5)
    draft = AcceptanceDraft(inner, 0.5)
    import torch
    from config import SamplingParams
    with pytest.raises(ValueError, match="greedy"):
        draft._draw(torch.zeros(8), SamplingParams(temperature=1.0), None, 0)


def test_bench_measures_the_controller_at_each_draft_acceptance(bench_engine):
    """``spec_controller@A`` methods: lossless, reported with the controller's picks; the one at
    A = 1 drafts with the learned draft and accepts more tokens than the one at A = 0 on the same prompts."""
    recs = _records()[:4]
    res = run_bench(bench_engine, recs, max_tokens=12, methods=("spec_controller",), draft_acceptance=(0.0, 1.0),
                    progress=False)
    overall = res["domains"]["overall"]
    for m in ("spec_controller@0", "spec_controller@1"):
        assert overall[m]["all_equal_target_greedy"] and overall[m]["lossless_method"], m
        assert set(overall[m]["picks"]) <= {"suffix", "ngram", "draft"}
    assert overall["spec_controller@1"]["picks"].get("draft", 0) > 0
    assert overall["spec_controller@1"]["accepted"] > overall["spec_controller@0"]["accepted"]
    assert "spec_controller@1" in format_table(res)


def test_the_report_splits_each_method_into_prefill_and_decode(bench_engine):
    """prefill_share and decode_tokens_per_s come from the rows' seconds to the first token: the
    decode speed is the tokens after the first over the seconds after it."""
    recs = _records()[:3]
    res = run_bench(bench_engine, recs, max_tokens=10, methods=("spec",), progress=False)
    for m in ("target", "spec"):
        e = res["domains"]["overall"][m]
        firsts = [r[m]["first_token_s"] for r in res["rows"]]
        secs = [r[m]["s"] for r in res["rows"]]
        toks = [r[m]["tokens"] for r in res["rows"]]
        assert all(0 < f <= s for f, s in zip(firsts, secs))
        assert e["prefill_share"] == round(sum(firsts) / sum(secs), 3)
        assert e["decode_tokens_per_s"] == round((sum(toks) - len(toks)) / (sum(secs) - sum(firsts)), 2)
    assert res["domains"]["overall"]["target"]["decode_speedup"] == 1.0
    assert "prefill" in format_table(res)


def test_acceptance_draft_past_the_reference_and_its_wrong_token(target, draft_proposer):
    """Past the reference's end the draft's own token is proposed; a draw that must be wrong where
    the draft was right proposes another token of the vocabulary (never the reference's)."""
    import torch
    from config import SamplingParams
    from bench.oracle import AcceptanceDraft

    inner = draft_proposer(truncated_draft(target, 1))
    V = inner.target_vocab
    logits = torch.zeros(V)
    greedy = SamplingParams()
    for want in (0, 5, V - 1):
        logits.zero_()
        logits[want] = 1.0  # the draft's own choice is the reference's token
        wrong = AcceptanceDraft(inner, 0.0)
        wrong.reference = [want] * 4
        tok, _ = wrong._draw(logits, greedy, None, 2)
        assert 0 <= tok < V and tok != want
        assert wrong._draw(logits, greedy, None, 4) == (want, None)  # past the end: its own token
        right = AcceptanceDraft(inner, 1.0)
        right.reference = [7, 7, (want + 3) % V]
        assert right._draw(logits, greedy, None, 2) == ((want + 3) % V, None)


def test_tally_speeds():
    from bench.bench import Tally

    t = Tally()
    t.add(10, 2.0, True, 0.5)
    t.add(1, 0.5, True, 0.5)  # one token: all of its time is before it
    assert t.tps == 11 / 2.5 and t.decode_tps == (11 - 2) / (2.5 - 1.0)
    only_first = Tally()
    only_first.add(1, 0.5, True, 0.5)
    assert only_first.decode_tps is None  # no time after the first token
    unknown = Tally()
    unknown.add(10, 2.0, True, None)
    assert unknown.first_s is None and unknown.decode_tps is None


def test_quality_counts_a_sequence_equal_only_when_every_position_and_its_end_agree():
    from bench.quality import _tally

    eos = {0}
    # argmax row i predicts out[i]; the last row what follows out
    assert _tally(torch.tensor([5, 6, 7, 9]), [5, 6, 7], 3, eos) == (3, True)  # ran to max_tokens: any next
    assert _tally(torch.tensor([5, 6, 0]), [5, 6], 4, eos) == (2, True)  # stopped: the next is the end
    assert _tally(torch.tensor([5, 6, 8]), [5, 6], 4, eos) == (2, False)  # would have gone on
    assert _tally(torch.tensor([5, 4, 7, 9]), [5, 6, 7], 3, eos) == (2, False)  # one flipped position
    assert _tally(torch.tensor([0]), [], 4, eos) == (0, True)  # an immediate end on both sides
