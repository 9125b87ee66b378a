"""API keys, tenants and limits, by hand with an injected clock (no Ray, no HTTP)."""

from __future__ import annotations

import pytest

from config import AuthConfig, TenantKey, TenantLimits
from deployments.tenants import Bucket, OpenServerError, Tenants, digest, is_loopback, load_keys, refuse_open


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _tenants(**limits) -> tuple[Tenants, Clock]:
    clock = Clock()
    keys = [TenantKey(tenant="alice", key_sha256=digest("sk-alice"), limits=TenantLimits(**limits)),
            TenantKey(tenant="ops", key_sha256=digest("sk-ops"), admin=True)]
    return Tenants(AuthConfig(), keys, clock), clock


def test_keys_are_stored_as_digests_and_compared_hashed():
    t, _ = _tenants()
    assert "sk-alice" not in repr(t.by_digest)
    assert t.identify("Bearer sk-alice").tenant == "alice"
    assert t.identify("bearer  sk-alice ").tenant == "alice"
    for bad in (None, "", "Bearer", "Bearer sk-alicE", "Basic sk-alice", "sk-alice"):
        assert t.identify(bad).status == 401, bad
    assert t.identify("Bearer sk-ops").admin and not t.identify("Bearer sk-alice").admin


def test_every_stored_key_is_compared_in_constant_time_whichever_matches(monkeypatch):
    """A presented key's digest is compared with each stored digest by ``hmac.compare_digest``,
    all of them every time: no early exit on the first match, no dict lookup by the secret."""
    import hmac

    import deployments.tenants as mod

    t, _ = _tenants()
    calls, real = [], hmac.compare_digest
    monkeypatch.setattr(mod.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    for key in ("Bearer sk-alice", "Bearer sk-ops", "Bearer sk-nobody"):
        calls.clear()
        t.identify(key)
        assert len(calls) == 2 and {a for a, _ in calls} == set(t.by_digest)
        assert {b for _, b in calls} == {digest(key.split()[1])}


def test_open_without_keys():
    t = Tenants(AuthConfig(), keys=[])
    assert t.open and t.admit(None).status == 200 and t.admit("Bearer anything").tenant == "anonymous"


def test_keys_from_env_and_file(tmp_path):
    f = tmp_path / "keys.yaml"
    f.write_text(f"- tenant: bob\n  key_sha256: {digest('sk-bob')}\n  limits: {{requests_per_minute: 5}}\n")
    env = {"OSD_API_KEYS": "carol:sk-carol, dave:sk-d:ave", "OSD_ADMIN_KEY": "sk-root"}
    keys = load_keys(AuthConfig(keys_file=str(f)), env)
    t = Tenants(AuthConfig(), keys)
    assert [t.identify(f"Bearer {k}").tenant for k in ("sk-bob", "sk-carol", "sk-d:ave", "sk-root")] == ["bob", "carol", "dave", "admin"]
    assert t.identify("Bearer sk-root").admin and t.limits(keys[0]).requests_per_minute == 5
    with pytest.raises(ValueError, match="tenant:key"):
        load_keys(AuthConfig(), {"OSD_API_KEYS": "nocolon"})


def test_request_rate_limit_and_retry_after():
    t, clock = _tenants(requests_per_minute=2)
    assert t.admit("Bearer sk-alice").status == 200
    assert t.admit("Bearer sk-alice").status == 200
    third = t.admit("Bearer sk-alice")
    assert third.status == 429 and "requests per minute" in third.message
    assert third.retry_after == pytest.approx(30.0)  # one request refills in 60 / 2 s
    clock.t += 30.0
    assert t.admit("Bearer sk-alice").status == 200
    assert t.admit("Bearer sk-ops").status == 200  # other tenants are not affected


def test_concurrency_limit_frees_on_done():
    t, _ = _tenants(max_concurrent=1)
    assert t.admit("Bearer sk-alice").status == 200
    busy = t.admit("Bearer sk-alice")
    assert busy.status == 429 and busy.retry_after > 0
    t.done("alice", 10)
    assert t.admit("Bearer sk-alice").status == 200


def test_a_request_of_several_sequences_takes_a_slot_for_each_all_or_none():
    t, _ = _tenants(max_concurrent=4)
    first = t.admit("Bearer sk-alice")
    assert t.admit_more(first, 2).status == 200 and t.in_flight["alice"] == 3
    other = t.admit("Bearer sk-alice")  # the fourth slot
    wait = t.admit_more(other, 1)  # would be the fifth: later, and nothing taken
    assert wait.status == 429 and wait.retry_after == 1.0 and t.in_flight["alice"] == 4
    never = t.admit_more(other, 4)  # five in all: never within the limit
    assert never.status == 400 and "runs 5 sequences, more than tenant 'alice' may run at once (4)" in never.message
    t.done("alice", 10, slots=3)
    assert t.in_flight["alice"] == 1 and t.admit_more(other, 3).status == 200 and t.in_flight["alice"] == 4
    t.done("alice", 0, slots=9)  # a cleanup past what is held frees no more than that
    assert t.in_flight["alice"] == 0
    t.done("bob", 0, slots=2)  # a done without its admit frees nothing
    assert "bob" not in t.in_flight


def test_an_open_server_counts_every_sequence_without_limits():
    t = Tenants(AuthConfig(), [])
    who = t.admit(None)
    assert t.admit_more(who, 20).status == 200 and t.in_flight["anonymous"] == 21


def test_token_rate_charged_after_the_answer():
    t, clock = _tenants(tokens_per_minute=100)
    assert t.admit("Bearer sk-alice").status == 200
    t.done("alice", 250)  # one long answer overdraws the bucket ...
    refused = t.admit("Bearer sk-alice")
    assert refused.status == 429 and "tokens per minute" in refused.message
    assert refused.retry_after == pytest.approx(151 * 60 / 100)  # ... paid back before the next request
    clock.t += refused.retry_after + 1e-9
    assert t.admit("Bearer sk-alice").status == 200


def test_bucket_refills_continuously_up_to_its_rate():
    b = Bucket(60.0)
    assert b.wait_for(60, 0.0) == 0.0
    b.take(60, 0.0)
    assert b.wait_for(1, 0.0) == pytest.approx(1.0)
    assert b.wait_for(1, 0.5) == pytest.approx(0.5)
    assert b.wait_for(30, 1000.0) == 0.0 and b.level == 60.0  # capped at one minute's worth


def test_training_isolation_per_tenant_or_for_all():
    keys = [TenantKey(tenant="a", key_sha256=digest("ka"), isolate_training=True),
            TenantKey(tenant="b", key_sha256=digest("kb")),
            TenantKey(tenant="c", key_sha256=digest("kc"), isolate_training=False)]
    t = Tenants(AuthConfig(isolate_training=False), keys)
    assert t.isolated("a") and not t.isolated("b") and not t.isolated("c")
    t = Tenants(AuthConfig(isolate_training=True), keys)
    assert t.isolated("a") and t.isolated("b") and not t.isolated("c")


def test_tenants_are_isolated_by_default_but_a_servers_only_tenant_is_not():
    """A multi-tenant operator gets isolation without asking (a key says false to share); an open
    server's one tenant ("anonymous"), or the one tenant all the keys name, has nobody to be
    isolated from, unless its key asks."""
    keys = [TenantKey(tenant="a", key_sha256=digest("ka")), TenantKey(tenant="b", key_sha256=digest("kb")),
            TenantKey(tenant="a", key_sha256=digest("ka2"))]
    assert AuthConfig().isolate_training
    t = Tenants(AuthConfig(), keys)
    assert t.isolated("a") and t.isolated("b")
    assert not Tenants(AuthConfig(), keys=[]).isolated("anonymous")
    assert not Tenants(AuthConfig(), keys=[keys[0], keys[2]]).isolated("a")
    assert Tenants(AuthConfig(), keys=[keys[0].model_copy(update={"isolate_training": True})]).isolated("a")


def test_open_service_counts_anonymous_requests_and_grants_no_admin():
    """Without keys every request is "anonymous": never an admin, still counted in flight (the
    dashboards' per-tenant gauges), freed by done."""
    t = Tenants(AuthConfig(), keys=[])
    who = t.identify("Bearer whatever")
    assert (who.tenant, who.admin, who.status) == ("anonymous", False, 200)
    assert not t.admit(None).admin and not t.admit(None).admin
    assert t.in_flight == {"anonymous": 2}
    t.done("anonymous", 5)
    assert t.in_flight == {"anonymous": 1}
    t.done("anonymous", 5)
    t.done("anonymous", 5)  # one done too many (a retried cleanup) never goes below zero
    assert t.in_flight == {"anonymous": 0}
    t.done("ghost", 5)  # never admitted: nothing to free, nothing counted
    assert t.in_flight == {"anonymous": 0}


def test_a_refused_key_is_no_tenant_and_takes_no_slot():
    t, _ = _tenants(max_concurrent=1)
    bad = t.admit("Bearer sk-nobody")
    assert (bad.tenant, bad.admin, bad.status) == ("", False, 401) and t.in_flight == {}
    assert t.admit("Bearer sk-alice").status == 200 and t.in_flight == {"alice": 1}
    busy = t.admit("Bearer sk-alice")
    assert busy.status == 429 and busy.retry_after == 1.0 and t.in_flight == {"alice": 1}  # a refusal takes no slot
    assert "1 requests in flight" in busy.message


def test_a_wait_of_under_a_second_is_still_a_refusal():
    t, clock = _tenants(requests_per_minute=2)  # a burst of two, then one every 30 s
    assert t.admit("Bearer sk-alice").status == 200 and t.admit("Bearer sk-alice").status == 200
    clock.t += 29.75
    early = t.admit("Bearer sk-alice")
    assert early.status == 429 and early.retry_after == pytest.approx(0.25)
    clock.t += 0.25
    assert t.admit("Bearer sk-alice").status == 200


def test_over_two_limits_the_longer_wait_is_the_one_reported():
    t, _ = _tenants(requests_per_minute=1, tokens_per_minute=100)
    assert t.admit("Bearer sk-alice").status == 200
    t.done("alice", 101)  # tokens: 1.2 s to wait; requests: 60 s
    refused = t.admit("Bearer sk-alice")
    assert refused.status == 429 and "requests per minute" in refused.message
    assert refused.retry_after == pytest.approx(60.0)


# -- no open server by accident ----------------------------------------------------------------------
def test_without_keys_a_host_beyond_loopback_is_refused_unless_allowed():
    """No key configured: loopback (or no HTTP at all) starts open; any other bind host is refused
    with a message that says how to set keys, unless ``auth.allow_open``. With a key nothing is
    refused."""
    for host in (None, "127.0.0.1", "127.0.0.53", "localhost", "::1", "[::1]"):
        assert is_loopback(host)
        refuse_open(AuthConfig(), True, host)
    for host in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "myhost.example"):
        assert not is_loopback(host)
        with pytest.raises(OpenServerError, match=r"without API keys .*OSD_API_KEYS=.*OSD_ADMIN_KEY=.*auth.keys_file.*"
                                                  r"auth.allow_open: true"):
            refuse_open(AuthConfig(), True, host)
        refuse_open(AuthConfig(allow_open=True), True, host)  # open on purpose
        refuse_open(AuthConfig(), False, host)  # keys configured


@pytest.mark.parametrize("name,text", [("keys.yaml", ""), ("keys.yaml", "# nobody yet\n"), ("keys.yaml", "[]"),
                                       ("keys.json", "[]"), ("keys.json", "null")])
def test_an_empty_keys_file_is_an_error_not_an_open_server(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ValueError, match="names no key"):
        load_keys(AuthConfig(keys_file=str(f)), {})
    with pytest.raises(ValueError, match="names no key"):
        Tenants(AuthConfig(keys_file=str(f)))


def test_a_keys_file_that_is_not_a_list_is_an_error(tmp_path):
    f = tmp_path / "keys.yaml"
    f.write_text(f"tenant: bob\nkey_sha256: {digest('sk-bob')}\n")
    with pytest.raises(ValueError, match="expected a list"):
        load_keys(AuthConfig(keys_file=str(f)), {})


@pytest.mark.parametrize("name", ["admin", "other", "anonymous", "unauthenticated"])
def test_the_servers_own_tenant_names_are_refused_for_keys(tmp_path, name):
    """``admin`` would share the admin key's buckets, ``other`` is the metrics' overflow label:
    refused from a keys file, inline keys and the environment; the admin key itself still loads."""
    f = tmp_path / "keys.yaml"
    f.write_text(f"- tenant: {name}\n  key_sha256: {digest('sk-x')}\n")
    with pytest.raises(ValueError, match=f"'{name}' are reserved"):
        load_keys(AuthConfig(keys_file=str(f)), {})
    with pytest.raises(ValueError, match="reserved"):
        load_keys(AuthConfig(keys=[TenantKey(tenant=name, key_sha256=digest("sk-x"))]), {})
    with pytest.raises(ValueError, match="reserved"):
        load_keys(AuthConfig(), {"OSD_API_KEYS": f"{name}:sk-x"})
    assert [k.tenant for k in load_keys(AuthConfig(), {"OSD_ADMIN_KEY": "sk-root"})] == ["admin"]
