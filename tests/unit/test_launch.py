"""What `osd serve` says after ready: a line per period of served load, and a deployment that
falls ill or recovers, once, with Serve's reason."""

from __future__ import annotations

from deployments.launch import bounded, health_lines, load_line, watch


def test_a_period_of_load_is_one_line_and_an_idle_one_none():
    t0 = {"requests": 10, "errors": 1, "generation_tokens": 400}
    assert load_line(t0, t0, 60) is None
    line = load_line(t0, {"requests": 40, "errors": 3, "generation_tokens": 1600}, 60)
    assert line.endswith("last 60 s: 30 requests, 20.0 tokens/s, 2 errors")
    assert "5 requests, 1.0 tokens/s, 0 errors" in load_line(None, {"requests": 5, "errors": 0, "generation_tokens": 60}, 60)


def test_a_deployment_falling_ill_is_said_once_with_its_reason_and_its_recovery_once():
    healthy = {"DraftPool": ("HEALTHY", ""), "Ingress": ("HEALTHY", "")}
    assert health_lines({}, healthy) == []  # starting up: nothing to say
    ill = {**healthy, "DraftPool": ("UNHEALTHY", "replica died: out of memory\n")}
    said = health_lines({"DraftPool": "HEALTHY", "Ingress": "HEALTHY"}, ill)
    assert len(said) == 1 and said[0].endswith("DraftPool is UNHEALTHY: replica died: out of memory")
    assert health_lines({"DraftPool": "UNHEALTHY", "Ingress": "HEALTHY"}, ill) == []  # not again
    back = health_lines({"DraftPool": "UNHEALTHY", "Ingress": "HEALTHY"}, {**healthy, "DraftPool": ("UPDATING", "")})
    assert len(back) == 1 and back[0].endswith("DraftPool is UPDATING again")
    assert health_lines({}, {"Ingress": ("DEPLOY_FAILED", "")})[0].endswith("Ingress is DEPLOY_FAILED: no reason given")


def test_a_call_that_never_answers_cannot_keep_the_console_from_stopping():
    """watch: a status call into Serve that hangs is given up after call_timeout_s, so the stop
    set by Ctrl-C is seen; the load line still comes from the calls that answer."""
    import threading
    import time

    hang = threading.Event()
    calls = {"status": 0}

    def statuses_of(app):
        calls["status"] += 1
        if calls["status"] == 2:  # the second poll never answers
            hang.wait()
        return {"Metrics": ("HEALTHY", "")}

    said, stop = [], threading.Event()
    totals = iter([{"requests": 0, "errors": 0, "generation_tokens": 0}, {"requests": 4, "errors": 0, "generation_tokens": 40}])
    t = threading.Thread(target=watch, args=("osd", stop, 0.05, said.append),
                         kwargs={"statuses_of": statuses_of, "totals_of": lambda app: next(totals, {"requests": 4, "errors": 0,
                                                                                                     "generation_tokens": 40}),
                                 "call_timeout_s": 0.2}, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while calls["status"] < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    t.join(2)
    hang.set()
    assert not t.is_alive() and calls["status"] >= 4  # polling went on past the hung call, then stopped
    assert any("4 requests" in line for line in said), said


def test_bounded_returns_raises_or_gives_up():
    import pytest

    assert bounded(lambda: 7, 1.0) == 7
    with pytest.raises(ValueError):
        bounded(lambda: (_ for _ in ()).throw(ValueError("x")), 1.0)
    import threading

    never = threading.Event()
    with pytest.raises(TimeoutError):
        bounded(never.wait, 0.1)
    left = [t for t in threading.enumerate() if t.name == "osd-bounded-call"]
    assert left and all(t.daemon for t in left)  # a hung call cannot hold the process at exit
    never.set()


def test_load_lines_for_one_request_and_for_an_instant():
    assert "2 requests, 10.0 tokens/s, 0 errors" in load_line(None, {"requests": 2, "errors": 0, "generation_tokens": 10}, 1)
    assert "1 requests" in load_line(None, {"requests": 1, "errors": 0, "generation_tokens": 1}, 0.5)
    assert load_line(None, {"requests": 3, "errors": 0, "generation_tokens": 9}, 0) is None


def test_the_console_says_load_once_a_period_from_the_first_period_on():
    """watch polls statuses every poll_s and asks for the served totals once every every_s, the
    first time one period after it starts; the line's rate is over the seconds since the last."""
    import threading
    import time

    polls, loads = [], []

    def statuses_of(app):
        polls.append(time.monotonic())
        return {"Metrics": ("HEALTHY", "")}

    def totals_of(app):
        loads.append(time.monotonic())
        n = len(loads)
        return {"requests": 10 * n, "errors": 0, "generation_tokens": 100 * n}

    said, stop = [], threading.Event()
    t0 = time.monotonic()
    t = threading.Thread(target=watch, args=("osd", stop, 0.3, said.append),
                         kwargs={"statuses_of": statuses_of, "totals_of": totals_of, "poll_s": 0.02}, daemon=True)
    t.start()
    time.sleep(1.0)
    stop.set()
    t.join(2)
    assert not t.is_alive()
    assert len(polls) >= 20 and 2 <= len(loads) <= 4, (len(polls), len(loads))
    assert loads[0] - t0 >= 0.28  # not before one period
    rates = [float(line.split("requests, ")[1].split(" tokens/s")[0]) for line in said]
    assert rates and all(200 < r < 500 for r in rates[1:]), said  # 100 tokens in about 0.3 s
