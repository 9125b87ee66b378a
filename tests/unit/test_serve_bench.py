"""osd bench-serve's arithmetic on hand-made responses (the live run is measured, not tested)."""

from __future__ import annotations

import pytest

from bench.serve_bench import curve_windows, format_curve, format_table, summarise_level
from workloads import WorkloadRecord


def _ok(arrivals, tokens, accepted, proposed, steps, wait_ms, target_ms, seconds):
    spec = {"accepted": accepted, "proposed": proposed, "steps": steps, "verify_wait_ms": wait_ms, "target_ms": target_ms}
    return {"status": 200, "seconds": seconds, "arrivals": arrivals, "text": "x",
            "usage": {"completion_tokens": tokens, "speculative": spec}}


def test_summarise_level_by_hand():
    code, sql = WorkloadRecord("a", "code"), WorkloadRecord("b", "sql")
    results = [
        (code, _ok([0.1, 0.2, 0.4], 3, 2, 4, 2, 10.0, 6.0, 0.5)),
        (sql, _ok([0.3, 0.35], 2, 0, 2, 2, 20.0, 8.0, 1.0)),
        (code, {"status": 429, "seconds": 0.01}),
        (sql, {"status": "connection", "seconds": 0.01}),
    ]
    lv = summarise_level(results, concurrency=2, wall=2.0)
    assert lv["requests"] == 4 and lv["ok"] == 2 and lv["errors"] == {"429": 1, "connection": 1}
    assert lv["output_tokens"] == 5 and lv["tokens_per_s"] == pytest.approx(2.5)
    assert lv["ttft_ms"]["p50"] == pytest.approx(200.0)  # first arrivals 0.1 and 0.3
    assert lv["itl_ms"]["p50"] == pytest.approx(100.0)  # gaps 0.1, 0.2, 0.05
    assert lv["latency_ms"]["p99"] == pytest.approx(995.0)
    assert lv["alpha_by_domain"] == {"code": 0.5, "sql": 0.0}
    assert lv["steps"] == 4
    assert lv["verify_wait_ms_per_step"] == pytest.approx(15.0) and lv["target_ms_per_step"] == pytest.approx(7.0)
    table = format_table({"levels": [lv, {**lv, "concurrency": 8, "tokens_per_s": 7.5}]})
    assert "15.0 / 7.0" in table and "concurrency 8 / concurrency 1" not in table  # no concurrency-1 level


def test_ratio_line_when_concurrency_one_ran():
    lv = summarise_level([(WorkloadRecord("a", "code"), _ok([0.1], 1, 0, 0, 1, 1.0, 1.0, 0.1))], 1, 1.0)
    table = format_table({"levels": [lv, {**lv, "concurrency": 8, "tokens_per_s": 3.0}]})
    assert "aggregate tok/s at concurrency 8 / concurrency 1 = 3.00" in table


def test_another_servers_level_without_the_speculative_usage_and_the_comparison_line():
    """--against: a server whose usage has no speculative extension (llama-server), or no usage at
    all (its streamed chunks count as tokens), is summarised; the table gives ours / theirs per level."""
    rec = WorkloadRecord("a", "code")
    plain = {"status": 200, "seconds": 0.5, "arrivals": [0.1, 0.2], "text": "xy", "usage": {"completion_tokens": 2}}
    bare = {"status": 200, "seconds": 0.5, "arrivals": [0.1, 0.2, 0.3], "text": "xyz", "usage": None}
    theirs = summarise_level([(rec, plain), (rec, bare)], 1, 1.0)
    assert theirs["ok"] == 2 and theirs["output_tokens"] == 5 and theirs["alpha_by_domain"] == {} and theirs["steps"] == 0
    ours = summarise_level([(rec, _ok([0.1], 10, 0, 0, 1, 1.0, 1.0, 0.1))], 1, 1.0)
    table = format_table({"levels": [ours], "against": {"url": "http://127.0.0.1:9", "levels": [theirs]}})
    assert "concurrency 1: ours 10.0 tok/s, theirs 5.0 tok/s (2/2 ok" in table and "ratio 2.00" in table


class _EchoClient:
    """Stands in for the server (not under test here): streams the answer ``a<n>`` to the n-th
    request and keeps the messages each request carried."""

    def __init__(self):
        from types import SimpleNamespace as NS

        self.NS, self.sent = NS, []
        self.chat = NS(completions=NS(create=self.create))

    def create(self, model, messages, **kw):
        self.sent.append(messages)
        NS, answer = self.NS, f"a{len(self.sent)}"
        yield NS(choices=[NS(delta=NS(content=answer))], usage=None)
        yield NS(choices=[], usage=NS(model_dump=lambda: {"completion_tokens": 1}))


def test_a_conversation_resends_its_history_turn_by_turn():
    from bench.serve_bench import run_level

    client = _EchoClient()
    records = [WorkloadRecord(f"q{i}", "chat") for i in range(6)]
    lv = run_level(client, "m", records, concurrency=1, max_tokens=4, level_seconds=60.0, turns=3)
    assert lv["requests"] == lv["ok"] == 6 and lv["output_tokens"] == 6
    first, third, fourth = client.sent[0], client.sent[2], client.sent[3]
    assert first == [{"role": "user", "content": "q0"}]
    assert third == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a1"},
                     {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a2"},
                     {"role": "user", "content": "q2"}]
    assert fourth == [{"role": "user", "content": "q3"}]  # the next conversation starts afresh


def test_learning_curve_windows_by_hand():
    """Two windows of 2 requests: per-domain alpha from the usage rows (by request index, whatever
    the order they finished in); tokens/s and each proposer's alpha from the /metrics reads at the
    windows' edges; a window past the last edge has neither."""
    rows = [{"i": 1, "domain": "sql", "status": 200, "accepted": 1, "proposed": 4, "draft_version": 0},
            {"i": 0, "domain": "sql", "status": 200, "accepted": 3, "proposed": 4, "draft_version": 0},
            {"i": 2, "domain": "code", "status": 200, "accepted": 2, "proposed": 2, "draft_version": 1},
            {"i": 3, "domain": "code", "status": 503},
            {"i": 4, "domain": "code", "status": 200, "accepted": 0, "proposed": 1, "draft_version": 2}]
    edges = [(10.0, 0, {}),
             (14.0, 40, {"draft": [10.0, 2.0], "suffix": [20.0, 15.0]}),
             (12.0, 20, {"draft": [4.0, 1.0]}),  # read out of order: sorted by time
             ]
    w = curve_windows(rows, edges, window=2)
    assert [x["requests"] for x in w] == ["1-2", "3-4", "5-5"]
    assert w[0]["alpha"] == pytest.approx(0.5) and w[1]["alpha_by_domain"] == {"code": 1.0}
    assert w[0]["tokens_per_s"] == pytest.approx(10.0) and w[0]["by_proposer"] == {
        "draft": {"proposed": 4.0, "accepted": 1.0, "alpha": 0.25}}
    assert w[1]["tokens_per_s"] == pytest.approx(10.0)
    assert w[1]["by_proposer"]["draft"]["alpha"] == pytest.approx(1 / 6)
    assert w[1]["by_proposer"]["suffix"] == {"proposed": 20.0, "accepted": 15.0, "alpha": 0.75}
    assert "tokens_per_s" not in w[2] and w[2]["draft_versions"] == [2]
    text = format_curve({"requests": 5, "window": 2, "windows": w})
    assert "draft=0.167/6" in text and "10.0 tok/s" in text


def test_curve_windows_report_the_requests_own_speed():
    rows = [{"i": 0, "domain": "sql", "status": 200, "accepted": 1, "proposed": 2, "draft_version": 0,
             "seconds": 0.5, "completion_tokens": 10},
            {"i": 1, "domain": "sql", "status": 200, "accepted": 1, "proposed": 2, "draft_version": 0,
             "seconds": 1.5, "completion_tokens": 30},
            {"i": 2, "domain": "sql", "status": 503, "seconds": 0.01}]  # a refusal does not count
    w = curve_windows(rows, [], window=3)
    assert w[0]["request_tokens_per_s"] == pytest.approx(20.0)
    assert "a request 20.0 tok/s" in format_curve({"requests": 3, "window": 3, "windows": w, "rate": 0.5, "late": 0})


def test_open_loop_arrivals_follow_their_schedule(monkeypatch):
    """--curve-rate: request i leaves at the i-th time of the seeded Poisson process whether or not
    the earlier ones are done (up to the cap in flight); a request the cap holds back is counted late."""
    import threading
    import time

    import numpy as np

    import bench.serve_bench as sb

    sent, lock, inflight, peak = [], threading.Lock(), [0], [0]

    def serve(service_s):
        def one(client, model, text, max_tokens):
            with lock:
                sent.append((text, time.perf_counter()))
                inflight[0] += 1
                peak[0] = max(peak[0], inflight[0])
            time.sleep(service_s)
            with lock:
                inflight[0] -= 1
            spec = {"accepted": 1, "proposed": 2, "draft_id": "general", "draft_version": 0}
            return {"status": 200, "seconds": service_s, "usage": {"completion_tokens": 4, "speculative": spec}}
        return one

    records = [WorkloadRecord(str(i), "sql") for i in range(12)]
    monkeypatch.setattr(sb, "one_request", serve(0.05))
    t0 = time.perf_counter()
    curve = sb.learning_curve(None, "m", records, concurrency=4, max_tokens=4, window=6, rate=40.0, seed=3)
    gaps = np.random.default_rng(3).exponential(1 / 40.0, 12)
    want = np.cumsum(gaps) - gaps[0]
    got = np.array([t for _, t in sorted(sent, key=lambda x: int(x[0]))]) - t0
    assert curve["late"] == 0 and curve["rate"] == 40.0 and curve["requests"] == 12
    assert np.all(got >= want - 1e-3) and np.all(got - want < 0.03)  # on time, never early
    assert peak[0] >= 2  # sent without waiting for the earlier ones (service 50 ms, gaps ~25 ms)
    assert curve["windows"][0]["request_tokens_per_s"] == pytest.approx(80.0)

    sent.clear()
    peak[0] = 0
    monkeypatch.setattr(sb, "one_request", serve(0.2))
    curve = sb.learning_curve(None, "m", records, concurrency=1, max_tokens=4, window=6, rate=100.0, seed=3)
    assert peak[0] == 1 and curve["late"] >= 10  # one in flight: the rest leave after their times
