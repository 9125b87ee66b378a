"""bench.experiments on the tiny target: online / shift streams, plot, CLI parsing."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench.experiments import main, order_blocks, plot, run_online, run_shift
from drafts.build import truncated_draft
from learner.offline import DistillConfig
from learner.trainer import LearnerConfig

torch.set_num_threads(1)

TEXTS = {
    "code": ["def f(x): return x", "def g(y): return y"],
    "chat": ["Hello world, how are", "The quick brown fox"],
    "math": ["1 + 2 = 3, 4 + 5 =", "0123456789"],
}
RECORDS = [{"text": t, "domain": d} for i in range(2) for d, ts in TEXTS.items() for t in ts[i : i + 1]]
LCFG = LearnerConfig(train_every=2, batch_records=4, steps_per_round=3, lr=3e-2, positions="all",
                     holdout_fraction=0.0, gate_margin=1.0)
DCFG = DistillConfig(max_tokens=12, epochs=2, seconds=10.0, lr=1e-2, warmup_steps=0, log_every=1000)


@pytest.fixture(scope="module")
def factory(target, make_engine, draft_proposer):
    start = truncated_draft(target, 1)

    def make():
        import copy

        return make_engine(draft_proposer(copy.deepcopy(start)), k=4)

    return make


@pytest.fixture(scope="module")
def online(factory):
    return run_online(factory, RECORDS, LCFG, max_tokens=12, k=4, window=3, distill_cfg=DCFG, ignore_eos=True, log=None)


def test_run_online_gate_keeps_destructive_updates_out(factory):
    """The gate on (margin 0, half the records held back), steps large enough to wreck the draft:
    every round is rejected, nothing is published, and the served draft stays at version 0."""
    wreck = LCFG.model_copy(update={"gate_margin": 0.0, "holdout_fraction": 0.5, "lr": 50.0, "steps_per_round": 4})
    res = run_online(factory, RECORDS * 2, wreck, methods=("online",), max_tokens=12, k=4, window=3,
                     ignore_eos=True, log=None)
    on = res["methods"]["online"]
    assert on["rounds"] >= 1 and on["rejected_rounds"] == on["rounds"], on
    assert on["versions_published"] == 0 and on["accepted_rounds"] == 0
    assert {r["draft_version"] for r in on["rows"]} == {0}


def _check_curve(curve, n):
    xs = [x for x, _ in curve]
    assert xs == sorted(set(xs)) and xs[-1] == n
    assert all(a is None or 0.0 <= a <= 1.0 for _, a in curve)


def test_run_online(online):
    assert set(online["methods"]) == {"static", "online", "offline"}
    for m, e in online["methods"].items():
        _check_curve(e["curve"], len(RECORDS))
        assert 0.0 <= e["final_alpha"] <= 1.0
        assert set(e["final_alpha_domain"]) == set(TEXTS)
        assert sum(r["proposed"] for r in e["rows"]) > 0
        assert all(r["accepted"] + r["rejected"] <= r["proposed"] for r in e["rows"])
        checked = sum(r["accepted"] + r["rejected"] for r in e["rows"])
        assert e["token_acceptance"] == pytest.approx(sum(r["accepted"] for r in e["rows"]) / checked)
        assert e["token_acceptance"] >= e["mean_alpha"]
    on = online["methods"]["online"]
    assert on["versions_published"] >= 1 and on["accepted_rounds"] >= 1 and on["training_seconds"] > 0
    assert max(r["draft_version"] for r in on["rows"]) >= 1
    st = online["methods"]["static"]
    assert st["rounds"] == 0 and all(r["draft_version"] == 0 for r in st["rows"])
    off = online["methods"]["offline"]
    assert off["offline"]["steps"] > 0 and off["offline"]["prompts"] == len(RECORDS)
    assert off["offline"]["agreement_after"] >= off["offline"]["agreement_before"]
    json.dumps(online)  # JSON-serialisable


def test_order_blocks_and_shift(factory):
    items, bounds = order_blocks(RECORDS, ["math", "code"])
    assert [b["domain"] for b in bounds] == ["math", "code", "chat"]
    assert [d for _, d in items] == ["math"] * 2 + ["code"] * 2 + ["chat"] * 2
    res = run_shift(factory, RECORDS, LCFG, order=["math", "code", "chat"], fractions=(0.5, 1.0), max_tokens=8, k=3,
                    window=2, distill_cfg=DCFG.model_copy(update={"epochs": 1}), ignore_eos=True, log=None)
    assert res["order"] == ["math", "code", "chat"]
    starts = [b["start"] for b in res["boundaries"]]
    assert starts == [0, 2, 4] and all(b["end"] - b["start"] == 2 for b in res["boundaries"])
    assert list(res["methods"]) == ["static", "online", "offline@50", "offline@100"]
    assert res["methods"]["offline@50"]["offline"]["prompts"] == 3
    for e in res["methods"].values():
        _check_curve(e["curve"], 6)
        assert [r["domain"] for r in e["rows"]] == [d for _, d in items]
    json.dumps(res)


def test_plot(online, tmp_path):
    p = plot(online, tmp_path / "a" / "online.png")
    assert p.exists() and p.stat().st_size > 1000
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shifted = dict(online, boundaries=[{"domain": "code", "start": 0, "end": 2}, {"domain": "chat", "start": 2, "end": 6}])
    assert plot(shifted, tmp_path / "s.png").stat().st_size > 1000


def test_unknown_method(factory):
    for bad in ("nope", "offline@0", "offline@x", "offline@101"):
        with pytest.raises(ValueError, match="unknown method"):
            run_online(factory, RECORDS[:1], LCFG, methods=(bad,), max_tokens=4, log=None)


def test_offline_on_a_prefix_of_the_stream(factory):
    res = run_online(factory, RECORDS, LCFG, methods=("static", "offline@50"), max_tokens=8, k=3, window=2,
                     distill_cfg=DCFG, log=None)
    off = res["methods"]["offline@50"]
    assert off["offline"]["prompts"] == len(RECORDS) // 2
    rows = off["rows"][len(RECORDS) // 2:]
    assert off["second_half_alpha"] == pytest.approx(sum(r["accepted"] for r in rows) / sum(r["proposed"] for r in rows))


@pytest.mark.parametrize("argv,msg", [
    (["bogus"], "invalid choice"),
    ([], "required"),
    (["online", "--n", "x"], "invalid int"),
    (["shift", "--nope"], "unrecognized arguments"),
])
def test_main_parse_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    assert msg in capsys.readouterr().err


def test_stream_drops_prompts_the_starting_draft_trained_on(target, tmp_path):
    from bench.harness import unseen_by
    from workloads import WorkloadRecord
    from drafts.build import prompt_digest, save_draft, trained_prompts

    recs = [WorkloadRecord(t, d) for d, ts in TEXTS.items() for t in ts]
    save_draft(truncated_draft(target, 1), tmp_path / "d", None, meta={"trained_prompts": [prompt_digest(TEXTS["code"][1])]})
    assert trained_prompts(tmp_path / "d") == {prompt_digest("def g(y): return y")}
    kept = unseen_by(recs, str(tmp_path / "d"))
    assert [r.text for r in kept] == [r.text for r in recs if r.text != "def g(y): return y"]
    save_draft(truncated_draft(target, 1), tmp_path / "old", None, meta={})  # a draft saved before the field existed
    assert unseen_by(recs, str(tmp_path / "old")) == recs


def test_paired_gain_by_hand():
    from bench.experiments import paired_gain

    def rows(acc):
        return [{"i": i + 1, "accepted": a, "proposed": 4} for i, a in enumerate(acc)]

    res = {"methods": {"static": {"rows": rows([0, 0, 1, 1])}, "online": {"rows": rows([4, 0, 2, 3])}}}
    g = paired_gain(res, "online")  # second half: differences 1/4 and 2/4
    assert g["n"] == 2 and g["mean"] == pytest.approx(0.375) and g["se"] == pytest.approx(0.125)
    assert paired_gain(res, "online", start=0)["mean"] == pytest.approx((1 + 0 + 0.25 + 0.5) / 4)
    one = paired_gain(res, "online", start=3)  # one difference: a mean, no standard error
    assert one["n"] == 1 and one["mean"] == pytest.approx(0.5) and math.isnan(one["se"])
    res["methods"]["online"]["rows"][3]["proposed"] = 0  # a request that drafted nothing: left out
    assert paired_gain(res, "online", start=2)["n"] == 1
    res["methods"]["online"]["rows"][3]["proposed"] = 4
    res["methods"]["static"]["rows"][3]["proposed"] = 0
    assert paired_gain(res, "online", start=2)["n"] == 1
    none = paired_gain(res, "online", start=4)
    assert none["n"] == 0 and math.isnan(none["mean"]) and math.isnan(none["se"])
    res["methods"]["online"]["rows"][0]["i"] = 9
    with pytest.raises(ValueError, match="same records"):
        paired_gain(res, "online")


def test_suffix_trees_on_replicas_draft_what_another_replica_served_only_when_shared(factory):
    """suffix@2: two replicas' trees, each request drafted by one drawn at random (the same draws
    in every run), each output handed to the other tree; suffix-split@2: the same trees learning
    only their own requests. Each record comes twice in a row: a repeat that lands on the other
    replica is drafted from the first answer only when the trees share."""
    recs = [r for r in RECORDS for _ in range(2)]
    res = run_online(factory, recs, LCFG, methods=("suffix@2", "suffix-split@2", "suffix"), max_tokens=12, k=4,
                     window=3, ignore_eos=True, log=None)
    ms = res["methods"]
    assert (ms["suffix@2"]["replicas"], ms["suffix@2"]["shared"]) == (2, True)
    assert (ms["suffix-split@2"]["replicas"], ms["suffix-split@2"]["shared"]) == (2, False)
    draws = [r["replica"] for r in ms["suffix@2"]["rows"]]
    assert draws == [r["replica"] for r in ms["suffix-split@2"]["rows"]] and set(draws) == {0, 1}

    def repeats_elsewhere(m):  # (first time, repeat) of the records whose repeat went to the other replica
        rows = ms[m]["rows"]
        return [(a["accepted"], b["accepted"]) for a, b in zip(rows[0::2], rows[1::2]) if a["replica"] != b["replica"]]

    moved = repeats_elsewhere("suffix@2")
    assert len(moved) >= 2
    assert all(rep <= first for first, rep in repeats_elsewhere("suffix-split@2"))  # never saw the first answer
    assert all(rep >= first + 4 for first, rep in moved)  # shared: drafted from it
    rows = ms["suffix"]["rows"]  # one tree over all traffic drafts every repeat from the first answer
    assert all(b["accepted"] >= a["accepted"] + 4 for a, b in zip(rows[0::2], rows[1::2]))
    with pytest.raises(ValueError, match="suffix@<replicas"):
        run_online(factory, recs, LCFG, methods=("suffix@x",), max_tokens=12, log=None)


def test_other_proposers_as_methods_with_speed_and_conversations(factory):
    """target / lookup / suffix / controller run on the same stream; tokens/s and the speedup over
    target are reported; with turns = 2 each record is two requests, the second re-sending the
    first answer, which the suffix tree (matching the request's own prompt) then drafts from."""
    recs = RECORDS[:4]
    res = run_online(factory, recs, LCFG, methods=("target", "lookup", "suffix", "controller"), max_tokens=12, k=4,
                     window=3, ignore_eos=True, log=None, turns=2)
    ms = res["methods"]
    assert res["turns"] == 2
    for m, e in ms.items():
        assert [r["turn"] for r in e["rows"]] == [1, 2] * len(recs), m
        assert e["tokens_per_s"] > 0 and e["speedup"] > 0 and set(e["speedup_domain"]) <= set(TEXTS)
    assert ms["target"]["speedup"] == 1.0 and sum(r["proposed"] for r in ms["target"]["rows"]) == 0
    assert {r["draft_version"] for m in ("target", "lookup", "suffix") for r in ms[m]["rows"]} == {0}  # no learned draft
    second = [r for r in ms["suffix"]["rows"] if r["turn"] == 2]
    assert sum(r["accepted"] for r in second) > 0  # the answer, re-sent, is drafted from
    ctl = ms["controller"]
    assert sum(ctl["picks"].values()) > 0 and set(ctl["picks"]) <= {"suffix", "ngram", "draft"}
    assert ctl["rounds"] >= 1  # its draft learns online
    json.dumps(res)
    from bench.experiments import report

    text = report(res, segment=2)
    assert "alpha by turn" in text and f"suffix: alpha {sum(r['accepted'] for r in ms['suffix']['rows']) / sum(r['proposed'] for r in ms['suffix']['rows']):.3f}" in text
    # every step, added up by the source that drafted it; the first step of each request apart
    drafting = {"target": set(), "lookup": {"ngram"}, "suffix": {"suffix"}, "controller": {"suffix", "ngram", "draft"}}
    for m, e in ms.items():
        bs = e["by_source"]
        assert set(bs) <= drafting[m] | {"none", "prefill"}, m
        assert bs["prefill"]["steps"] == 2 * len(recs), m  # one a request
        assert sum(st["accepted"] for st in bs.values()) == sum(r["accepted"] for r in e["rows"]), m
        assert sum(st["proposed"] for st in bs.values()) == sum(r["proposed"] for r in e["rows"]), m
        assert all(st["target_s"] > 0 for st in bs.values()) and bs.get("none", {}).get("draft_s", 0) == 0, m
        tokens = sum(r["tokens"] for r in e["rows"])
        assert sum(st["steps"] + st["accepted"] for st in bs.values()) >= tokens, m  # a step emits up to accepted + 1
        assert set(e["costs"]["v"]) >= {"1"} and all(v >= 1.0 for v in e["costs"]["v"].values()), m
        per = e["by_domain_source"]  # the same steps by domain, which add up to them
        assert set(per) == {r["domain"] for r in e["rows"]}, m
        for d, dbs in per.items():
            assert dbs["prefill"]["steps"] == sum(r["domain"] == d for r in e["rows"]), (m, d)
            assert sum(st["accepted"] for st in dbs.values()) == sum(r["accepted"] for r in e["rows"] if r["domain"] == d)
        for src, st in bs.items():
            assert all(sum(per[d].get(src, {}).get(f, 0) for d in per) == pytest.approx(st[f]) for f in st), (m, src)
    picks, bs = ctl["picks"], ctl["by_source"]
    assert all(bs.get(src, {"steps": 0})["steps"] <= n for src, n in picks.items())
    assert sum(picks.values()) - sum(bs[src]["steps"] for src in picks if src in bs) <= bs["prefill"]["steps"]
    assert set(ctl["costs"]["c"]) >= {"draft"}
    assert "steps by source (mean seconds a step): " in text and "cost model at the end: v(j) 1: 1.00" in text
    assert "seconds saved against plain steps (tokens x a plain step - time spent): suffix " in text
    assert "  the same by domain: " in text
    assert "outside the draft and target calls (the engine's and proposers' own work): " in text
    steps = sum(st["steps"] for st in ms["suffix"]["by_source"].values())
    per = sum(r["tokens"] for r in ms["suffix"]["rows"]) / steps
    assert f"  tokens a target step: {per:.3f} (counted, not timed)" in text


def test_a_source_s_steps_as_the_report_gives_them():
    from bench.experiments import _step_line

    st = {"steps": 4, "proposed": 10, "accepted": 6, "draft_s": 0.002, "target_s": 0.1}
    assert _step_line("suffix", st) == "suffix 4 (6/10 accepted), target 25.0 ms + draft 0.5 ms"
    assert _step_line("none", {"steps": 2, "proposed": 0, "accepted": 0, "draft_s": 0.0, "target_s": 0.05}) == "none 2, target 25.0 ms"


def test_step_sums_of_several_parts_add_up_by_hand():
    from bench.experiments import _sum_steps

    a = {"none": {"steps": 2, "proposed": 0, "accepted": 0, "draft_s": 0.0, "target_s": 0.5}}
    b = {"none": {"steps": 1, "proposed": 0, "accepted": 0, "draft_s": 0.0, "target_s": 0.25},
         "draft": {"steps": 3, "proposed": 4, "accepted": 2, "draft_s": 0.1, "target_s": 0.3}}
    out = _sum_steps([a, b])
    assert out == {"none": {"steps": 3, "proposed": 0, "accepted": 0, "draft_s": 0.0, "target_s": 0.75},
                   "draft": b["draft"]}
    assert out["draft"] is not b["draft"] and a["none"]["steps"] == 2  # the parts are left as they were
    assert _sum_steps([]) == {}


def test_seconds_each_source_saved_against_plain_steps_by_hand():
    from bench.experiments import _net_seconds

    bs = {"none": {"steps": 10, "proposed": 0, "accepted": 0, "draft_s": 0.0, "target_s": 0.4},  # 40 ms a plain step
          "draft": {"steps": 2, "proposed": 2, "accepted": 0, "draft_s": 0.04, "target_s": 0.12},  # 2 tokens in 160 ms
          "suffix": {"steps": 4, "proposed": 10, "accepted": 6, "draft_s": 0.002, "target_s": 0.24},  # 10 in 242 ms
          "prefill": {"steps": 3, "proposed": 3, "accepted": 0, "draft_s": 0.0, "target_s": 0.9}}
    net = _net_seconds(bs)
    assert list(net) == ["suffix", "draft"]  # most steps first; plain steps and prefills are not drafting sources
    assert net["suffix"] == pytest.approx(10 * 0.04 - 0.242) and net["draft"] == pytest.approx(2 * 0.04 - 0.16)
    assert _net_seconds({k: v for k, v in bs.items() if k != "none"}) == {}
    from bench.experiments import _other_seconds

    rows = [{"seconds": 1.0}, {"seconds": 1.5}]  # 2.5 s of requests; the steps' calls took 1.702 s, 19 steps
    other = _other_seconds(rows, bs)
    assert other == pytest.approx((2.5 - 1.702, (2.5 - 1.702) / 19))
    assert _other_seconds(rows, {}) is None and _other_seconds([{"accepted": 1}], bs) is None
    assert _net_seconds({"none": dict(bs["none"], steps=0), "draft": bs["draft"]}) == {}


def test_a_stream_of_several_files_keeps_each_text_once_and_the_sources_asked_for(make_llama, make_tokenizer, tmp_path):
    """``osd experiment online --workload A B --sources ...`` on a model folder: the stream is drawn
    from both files in order (a text twice is served once), round-robin over domains, and only the
    sources named; what the draft learns online is a feature draft's with the feature loss on."""
    from inprocess import save_tiny_model
    from workloads import WorkloadRecord, save_workload

    folder = save_tiny_model(tmp_path / "model", make_llama, make_tokenizer)
    save_workload([WorkloadRecord("def f(x): return x", "code", "en", "stdlib:f"),
                   WorkloadRecord("1 + 2 = 3, 4 + 5 =", "math", "en", "champ:1"),
                   WorkloadRecord("Hello world, how are", "chat", "en", "sharegpt:a_0")], tmp_path / "a.jsonl")
    save_workload([WorkloadRecord("def f(x): return x", "code", "en", "stdlib:f"),
                   WorkloadRecord("def g(y): return y", "code", "en", "humaneval:2"),
                   WorkloadRecord("0123456789", "math", "en", "gsm:3"),
                   WorkloadRecord("The quick brown fox", "chat", "en", "sharegpt:b_0")], tmp_path / "b.jsonl")
    out = tmp_path / "r.json"
    assert main(["online", "--workload", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--sources", "stdlib",
                 "humaneval", "champ", "gsm", "--n", "10", "--max-tokens", "4", "--k", "2", "--methods", "static,online",
                 "--target", folder, "--draft-kind", "feature", "--feature-loss", "1.0", "--train-every", "2",
                 "--batch-records", "2", "--threads", "1", "--interleave", "--quiet", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["workload"] == f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"
    # code: f (once), g; math: the champ and the gsm records; chat's source not asked for
    assert [r["domain"] for r in res["methods"]["static"]["rows"]] == ["code", "math", "code", "math"]
    assert res["methods"]["online"]["rounds"] == 2
    assert res["interleaved"] is True  # --interleave: the two methods took turns, request by request
    static, online = ([r["started"] for r in res["methods"][m]["rows"]] for m in ("static", "online"))
    assert all(max(a, b) < min(c, d) for a, b, c, d in zip(static, online, static[1:], online[1:]))


def test_interleave_advances_each_run_a_request_in_turn_by_hand():
    """Three runs of 3, 1 and 2 requests: each round serves every live run once, starting one run
    later than the round before; a run that ends drops out, and what each returned comes back in
    the runs' order."""
    from bench.experiments import interleave

    served = []

    def run(name, n):
        for i in range(n):
            served.append(f"{name}{i}")
            yield
        return name * n

    assert interleave([run("a", 3), run("b", 1), run("c", 2)]) == ["aaa", "b", "cc"]
    # round 0 from a; round 1 from b (which ends), then c, a; round 2 from the first live run again
    assert served == ["a0", "b0", "c0", "c1", "a1", "a2"]
    served.clear()  # equal runs: the first of each round moves on by one, a, b, c, then a again
    assert interleave([run("a", 4), run("b", 4), run("c", 4)]) == ["aaaa", "bbbb", "cccc"]
    assert [x[0] for x in served] == list("abc" "bca" "cab" "abc")
    assert interleave([]) == []


def test_interleaved_methods_serve_the_same_stream_in_turns(factory):
    """target, lookup and suffix interleaved over two-turn conversations: every method's request i
    starts before any method's request i + 1, and each method serves what it serves alone (the same
    token counts; the suffix tree still drafts the re-sent answer), its own steps apart."""
    recs = RECORDS[:4]
    kw = dict(methods=("target", "lookup", "suffix"), max_tokens=12, k=4, window=3, ignore_eos=True, log=None, turns=2)
    apart = run_online(factory, recs, LCFG, **kw)
    both = run_online(factory, recs, LCFG, interleaved=True, **kw)
    assert both["interleaved"] is True and apart["interleaved"] is False
    starts = [[r["started"] for r in both["methods"][m]["rows"]] for m in kw["methods"]]
    assert all(max(col) < min(nxt) for col, nxt in zip(zip(*starts), list(zip(*starts))[1:]))
    seq = [[r["started"] for r in apart["methods"][m]["rows"]] for m in kw["methods"]]
    assert seq[0][-1] < seq[1][0] < seq[1][-1] < seq[2][0]  # one method after another
    for m in kw["methods"]:
        a, b = apart["methods"][m], both["methods"][m]
        assert [(r["domain"], r["turn"], r["tokens"]) for r in a["rows"]] == [(r["domain"], r["turn"], r["tokens"]) for r in b["rows"]]
        assert b["by_source"]["prefill"]["steps"] == 2 * len(recs)
    assert sum(r["accepted"] for r in both["methods"]["suffix"]["rows"] if r["turn"] == 2) > 0
    assert sum(r["proposed"] for r in both["methods"]["target"]["rows"]) == 0


def test_tokens_a_target_step_by_hand():
    from bench.experiments import _tokens_per_step

    bs = {"none": {"steps": 6, "proposed": 0, "accepted": 0, "draft_s": 0.0, "target_s": 0.3},
          "suffix": {"steps": 4, "proposed": 9, "accepted": 5, "draft_s": 0.0, "target_s": 0.2}}
    rows = [{"tokens": 8}, {"tokens": 7}]
    assert _tokens_per_step(rows, bs) == pytest.approx(15 / 10)
    assert _tokens_per_step(rows, {}) is None


def test_the_report_gives_per_token_acceptance_per_segment():
    """Hand-made rows: per segment, accepted over the tokens the target checked (accepted + rejected)."""
    from bench.experiments import report

    rows = [{"domain": "code", "accepted": 3, "proposed": 8, "rejected": 1, "tokens": 10},
            {"domain": "sql", "accepted": 1, "proposed": 8, "rejected": 2, "tokens": 10},
            {"domain": "code", "accepted": 0, "proposed": 4, "rejected": 1, "tokens": 10}]
    text = report({"methods": {"static": {"rows": rows}}}, segment=2)
    assert "per-token acceptance 0.500 (second half 0.250)" in text  # 4 / 8; rows 2-3: 1 / 4
    assert "per-token acceptance per 2 requests: 0.571 / 0.000" in text  # 4 / 7, 0 / 1
    assert "alpha per 2 requests: 0.250 / 0.000" in text
    assert "per-token" not in report({"methods": {"static": {"rows": [{k: v for k, v in r.items() if k != "rejected"}
                                                                      for r in rows]}}}, segment=2)  # stored without rejections


def test_a_methods_summary_and_speedups_by_hand():
    """Per-request rows -> the figures an experiment reports: alpha = summed accepted / summed
    proposed (whole, second half, last ``window`` rows, per domain), per-token acceptance, tokens/s,
    and each method's speedup over the target alone."""
    from bench.experiments import _speedups, _summary, token_acceptance

    def row(d, acc, prop, rej, tokens, s):
        return {"domain": d, "accepted": acc, "proposed": prop, "rejected": rej, "tokens": tokens, "seconds": s}

    rows = [row("a", 1, 4, 3, 4, 1.0), row("b", 4, 4, 0, 8, 1.0), row("a", 2, 4, 2, 6, 2.0),
            row("b", 0, 4, 4, 2, 1.0), row("a", 3, 4, 1, 6, 1.0)]
    s = _summary({"rows": rows}, window=2)
    assert s["mean_alpha"] == pytest.approx(10 / 20)
    assert s["second_half_alpha"] == pytest.approx(5 / 12)  # rows 2.. of 5
    assert s["final_alpha"] == pytest.approx(3 / 8)  # the last 2 rows
    assert s["mean_alpha_domain"] == {"a": pytest.approx(6 / 12), "b": pytest.approx(4 / 8)}
    assert s["final_alpha_domain"] == {"a": pytest.approx(5 / 8), "b": pytest.approx(4 / 8)}
    assert s["token_acceptance"] == pytest.approx(10 / (10 + 10))
    assert s["second_half_token_acceptance"] == pytest.approx(5 / (5 + 7))
    assert s["token_acceptance_domain"] == {"a": pytest.approx(6 / 12), "b": pytest.approx(4 / 8)}
    assert s["tokens_per_s"] == pytest.approx(26 / 6) and s["second_half_tokens_per_s"] == pytest.approx(14 / 4)
    assert s["tokens_per_s_domain"] == {"a": pytest.approx(16 / 4), "b": pytest.approx(10 / 2)}
    assert token_acceptance([{"accepted": 1, "proposed": 4}]) is None  # stored before rejections were kept
    assert token_acceptance([row("a", 0, 0, 0, 1, 1.0)]) is None  # nothing drafted

    target = _summary({"rows": [row("a", 0, 0, 0, 2, 1.0), row("b", 0, 0, 0, 2, 2.0), row("a", 0, 0, 0, 2, 1.0)]}, 2)
    out = {"target": target, "online": s, "idle": {**s, "tokens_per_s": None, "second_half_tokens_per_s": 0.0,
                                                  "tokens_per_s_domain": {"a": None, "b": 5.0, "c": 3.0}}}
    _speedups(out)
    # a domain without a figure, or one the target-only run did not serve: no speedup
    assert out["idle"]["speedup_domain"] == {"a": None, "b": pytest.approx(5.0), "c": None}
    assert target["speedup"] == 1.0
    assert s["speedup"] == pytest.approx((26 / 6) / (6 / 4))
    assert s["second_half_speedup"] == pytest.approx((14 / 4) / (4 / 3))
    assert s["speedup_domain"] == {"a": pytest.approx(4 / 2), "b": pytest.approx(5 / 1)}
    assert out["idle"]["speedup"] is None and out["idle"]["second_half_speedup"] is None
    no_target = {"online": dict(s)}
    no_target["online"].pop("speedup")
    _speedups(no_target)
    assert "speedup" not in no_target["online"]  # no target-only method: nothing to compare with


def test_stream_items_from_every_record_shape():
    from bench.experiments import _norm
    from workloads import WorkloadRecord

    assert _norm([WorkloadRecord("t", "sql", "en", "s"), {"prompt": "p", "domain": "math"}, {"text": "u"},
                  ("q", "code"), ("q", 3), ("a", "b", "c"), [1, 2, 3], "bare"]) == [
        ("t", "sql"), ("p", "math"), ("u", "unknown"), ("q", "code"), (("q", 3), "unknown"),
        (("a", "b", "c"), "unknown"), ([1, 2, 3], "unknown"), ("bare", "unknown")]
    with pytest.raises(ValueError, match="without 'text'"):
        _norm([{"domain": "x"}])
    with pytest.raises(ValueError, match="no records"):
        _norm([])


def test_replica_methods_offline_shares_and_round_budgets():
    import time

    from bench.experiments import _RoundBudget, _check_common, _offline_count, _replicas_of

    assert _replicas_of("suffix@1") == (1, True) and _replicas_of("suffix-split@3") == (3, False)
    assert _replicas_of("suffix") is None and _replicas_of("online@2") is None
    for bad in ("suffix@0", "suffix@x", "suffix-split@-1"):
        with pytest.raises(ValueError, match="unknown method"):
            _replicas_of(bad)
    assert _offline_count("offline", 40) == 40 and _offline_count("offline@50", 40) == 20
    assert _offline_count("offline@1", 40) == 1 and _offline_count("offline@100", 40) == 40
    assert _offline_count("offline@30", 1000) == 300 and _offline_count("offline@1", 10) == 1  # at least one
    for bad in ("offline@0", "offline@101", "offline@x"):
        with pytest.raises(ValueError, match="unknown method"):
            _offline_count(bad, 40)
    _check_common(["online"], 1, 1, 1)
    for args in (([], 1, 1, 1), (["online"], 0, 1, 1), (["online"], 1, 0, 1), (["online"], 1, 1, 0)):
        with pytest.raises(ValueError):
            _check_common(*args)
    assert _RoundBudget(None)() is False
    budget = _RoundBudget(0.05)
    assert budget() is False
    time.sleep(0.06)
    assert budget() is True
    budget.start()
    assert budget() is False


def test_serve_recorded_counts_only_its_own_request_into_shared_stats(factory):
    from bench.harness import serve_recorded
    from config import SamplingParams
    from speculative.stats import SpecStats

    engine, stats, params = factory(), SpecStats(), SamplingParams(max_tokens=8, ignore_eos=True)
    first = serve_recorded(engine, TEXTS["code"][0], params, stats=stats)
    second = serve_recorded(engine, TEXTS["math"][0], params, stats=stats)
    assert first[2] > 0 and second[2] > 0
    assert (first[1] + second[1], first[2] + second[2]) == (stats.accepted, stats.proposed)


def test_stream_evaluates_every_eval_every_requests_and_at_the_last(factory):
    """The window curves get a point every ``eval_every`` requests and one at the last request (a
    conversation's turns are requests)."""
    from bench.experiments import stream

    items = [(r["text"], r["domain"]) for r in RECORDS[:3]]
    res = stream(factory(), items, max_tokens=4, eval_every=2, window=2, ignore_eos=True, log=None)
    assert [i for i, _ in res["curve"]] == [2, 3]
    res = stream(factory(), items, max_tokens=4, eval_every=4, window=2, ignore_eos=True, log=None, turns=2)
    assert [i for i, _ in res["curve"]] == [4, 6] and len(res["rows"]) == 6
    assert sorted(i for c in res["domain_curves"].values() for i, _ in c) == [4, 6]


def test_stream_starts_the_round_budget_before_each_round(factory):
    """A learner's round gets its own ``seconds_per_round``: the budget starts again after every
    request, before the learner may train."""
    from bench.experiments import DRAFT_ID, _RoundBudget, stream
    from bench.harness import _draft_of
    from learner.replay import ShardConfig
    from learner.trainer import DraftTrainer, OnlineLearner

    class Counted(_RoundBudget):
        starts = 0

        def start(self):
            self.starts += 1
            super().start()

    engine, budget = factory(), Counted(60.0)
    dp = _draft_of(engine)
    learner = OnlineLearner(LCFG, ShardConfig(), [DraftTrainer(DRAFT_ID, dp.runner.model, LCFG)], should_yield=budget)
    try:
        res = stream(engine, [(r["text"], r["domain"]) for r in RECORDS[:3]], max_tokens=4, learner=learner, budget=budget,
                     ignore_eos=True, log=None)
    finally:
        learner.close()
    assert budget.starts == 3 and any("round" in r for r in res["rows"])


def test_an_experiment_reads_its_options_from_a_yaml_file_and_the_command_line_wins(tmp_path):
    from bench.experiments import parse_args

    flags = ["shift", "--workload", "a.jsonl", "b.jsonl", "--domains", "sql", "code", "--n", "120", "--max-tokens", "32",
             "--methods", "static,online", "--interleave", "--lr", "0.001", "--feature-layers", "2,15", "--fractions", "1.0"]
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("workload: [a.jsonl, b.jsonl]\ndomains: [sql, code]\nn: 120\nmax_tokens: 32\nmethods: static,online\n"
                   "interleave: true\nadaptive: false\nlr: 0.001\nfeature_layers: '2,15'\nfractions: '1.0'\n")
    from_file = parse_args(["shift", "--config", str(cfg)])
    assert vars(from_file) == {**vars(parse_args(flags)), "config": str(cfg)}
    assert from_file.workload == ["a.jsonl", "b.jsonl"] and from_file.n == 120 and from_file.feature_layers == [2, 15]
    assert from_file.interleave and not from_file.adaptive
    typed = parse_args(["shift", "--n", "7", "--config", str(cfg), "--lr", "0.5"])  # typed options win, before or after
    assert typed.n == 7 and typed.lr == 0.5 and typed.max_tokens == 32


@pytest.mark.parametrize("text", ["n_records: 3\n", "quantize: int3\n", "n: many\n", "config: other.yaml\n",
                                  "- n\n- 3\n", "order: {a: 1}\n"])
def test_an_experiment_config_with_an_unknown_option_or_a_bad_value_is_refused(tmp_path, text):
    from bench.experiments import parse_args

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit):
        parse_args(["online", "--config", str(cfg)])


def test_the_shipped_experiment_configs_parse():
    from pathlib import Path

    from bench.experiments import parse_args

    shipped = sorted((Path(__file__).resolve().parents[2] / "bench" / "configs").glob("*.yaml"))
    assert shipped
    for path in shipped:
        args = parse_args(["shift", "--config", str(path)])
        assert args.draft_adapter == "shipped" and args.adapter_rank == 16
        assert set(args.order.split(",")) <= set(args.domains), path.name


def test_the_experiments_learn_as_the_server_does_by_default():
    """No option given: the learner's settings are the server's (one set of defaults), and the
    draft starts from the shipped adapter where it fits, as a fresh server's does."""
    from bench.experiments import parse_args, starting_adapter
    from config.learner import SERVE_TRAINER, LearnerServeConfig

    for cmd in ("online", "shift"):
        args = parse_args([cmd])
        got = {k: getattr(args, k) for k in ("train_every", "batch_records", "steps_per_round", "lr", "gate_margin",
                                              "positions", "adapter_rank")}
        assert got == {k: getattr(SERVE_TRAINER, k) for k in got}
        assert LearnerServeConfig().trainer == SERVE_TRAINER and SERVE_TRAINER.adapter_rank > 0
        assert starting_adapter(args) == "shipped"
    for extra in (["--draft-layers", "1"], ["--head-vocab", "8192"], ["--draft-kind", "feature"],
                  ["--draft-checkpoint", "some/folder"], ["--draft-adapter", "none"]):
        assert starting_adapter(parse_args(["online", *extra])) is None, extra
    assert starting_adapter(parse_args(["online", "--draft-adapter", "my/adapter"])) == "my/adapter"
