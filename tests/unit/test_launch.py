"""What `osd serve` says after ready: a line per period of served load, and a deployment that
falls ill or recovers, once, with Serve's reason."""

from __future__ import annotations

from deployments.launch import health_lines, load_line


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
