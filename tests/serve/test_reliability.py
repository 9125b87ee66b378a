"""Faults against the live application, each bounded in time."""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
import json
import socket
import time
from urllib.parse import urlparse

import pytest

from .conftest import MODEL, SOLO_KEY, _call, scrape, total

pytestmark = pytest.mark.serve


def test_a_client_that_leaves_mid_stream_frees_its_slot_and_its_kv_caches(server):
    """Tenant "solo" may run one request at a time: while its stream runs a second one is refused;
    once the client has closed the connection mid-stream, the slot is free again, the target holds
    no KV cache for it and the draft pool has stopped decoding it (its 600 tokens would take a minute)."""
    before = scrape(server)
    u = urlparse(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": MODEL, "prompt": "Count from 1 to 1000: 1, 2, 3, 4,", "max_tokens": 600, "temperature": 0,
            "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {SOLO_KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    got = b""
    while got.count(b"data: ") < 3:
        got += resp.read1(256)
    small = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert _call(server + "/v1/completions", small, key=SOLO_KEY)[0] == 429  # its one slot is taken
    t_left = time.monotonic()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline, status, after = time.monotonic() + 30, None, {}
    while time.monotonic() < deadline:
        time.sleep(1)
        after = scrape(server)
        if total(after, "osd_target_kv_caches") == 0 and total(after, "osd_draft_pool_requests_running") == 0:
            status = _call(server + "/v1/completions", small, key=SOLO_KEY)[0]
            if status == 200:
                break
    assert status == 200, "the tenant's slot was not freed"
    assert time.monotonic() - t_left < 30
    assert total(after, "osd_target_kv_caches") == 0 and total(after, "osd_draft_pool_requests_running") == 0
    left = total(after, "osd_requests_total", tenant="solo", status="499") - total(before, "osd_requests_total", tenant="solo", status="499")
    assert left == 1


def test_past_capacity_the_server_sheds_load_with_503_and_retry_after(server):
    """20 concurrent streams against an ingress that takes 12 in flight: the rest are refused at
    once with 503 and Retry-After (never queued without bound), and every accepted one completes."""
    import concurrent.futures as cf
    import urllib.error
    import urllib.request

    from .conftest import KEY

    body = json.dumps({"model": MODEL, "prompt": "Count from 1 to 100: 1, 2,", "max_tokens": 24, "temperature": 0,
                       "stream": True}).encode()

    def one(_):
        req = urllib.request.Request(server + "/v1/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                events = [line for line in r.read().decode().split("\n\n") if line]
                return 200, events, None, time.monotonic() - t0
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers.get("Retry-After"), time.monotonic() - t0

    with cf.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    statuses = sorted(r[0] for r in results)
    assert set(statuses) <= {200, 503} and statuses.count(503) >= 1 and statuses.count(200) >= 12, statuses
    for status, payload, retry_after, seconds in results:
        if status == 503:
            assert retry_after == "1" and payload["error"]["type"] == "server_overloaded" and seconds < 10
        else:
            assert payload[-1] == "data: [DONE]" and json.loads(payload[-2][6:])["choices"][0]["finish_reason"]


def test_a_draft_replica_killed_mid_stream_the_request_completes_unchanged(server, reference):
    """Every draft replica is killed while a greedy stream runs: the ingress continues the request
    on a replacement from the tokens already sent, and the text equals target-only decoding."""
    import ray

    from config import SamplingParams

    from .conftest import KEY

    prompt, n = "The history of the printing press", 40
    want = reference.generate(prompt, SamplingParams(max_tokens=n)).text
    before = scrape(server)
    u = urlparse(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    raw = b""
    while raw.count(b"data: ") < 3:  # a few steps streamed
        raw += resp.read1(256)
    for a in ray.util.list_named_actors(all_namespaces=True):
        if "osd#DraftPool#" in a["name"]:
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
    t0 = time.monotonic()
    while not raw.rstrip().endswith(b"data: [DONE]") and time.monotonic() - t0 < 240:
        chunk = resp.read1(4096)
        if not chunk:
            break
        raw += chunk
    conn.close()
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    assert not any("error" in e for e in events), events[-1]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == want
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == len(reference.generate(prompt, SamplingParams(max_tokens=n)).token_ids)
    assert usage["speculative"]["resumed_after"] > 0
    after = scrape(server)
    assert total(after, "osd_requests_resumed_total") - total(before, "osd_requests_resumed_total") == 1


def test_prompts_and_completions_are_not_written_to_logs(server):
    """No replica, proxy or controller log holds a request's prompt or its completion."""
    import uuid
    from pathlib import Path

    import ray

    from .conftest import KEY

    marker = f"zqx{uuid.uuid4().hex}"
    status, body, _ = _call(server + "/v1/completions", {"model": MODEL, "prompt": f"Spell {marker} backwards:",
                                                         "max_tokens": 24, "temperature": 0}, key=KEY)
    assert status == 200
    completion = body["choices"][0]["text"].strip()
    status, chat, _ = _call(server + "/v1/chat/completions", {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": f"What does {marker} mean?"}]}, key=KEY)
    assert status == 200
    time.sleep(2)  # let the log writers flush
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert files
    needles = [marker.encode()] + ([completion.encode()] if len(completion) >= 16 else [])
    hits = [(p.name, n[:20]) for p in files for n in needles if n in p.read_bytes()]
    assert not hits, hits


def _record(draft: str, tenant: str, i: int, nan: bool = False, n_pos: int = 6, k: int = 4):
    """A replay record as a draft replica would send it (rows cover positions 9 to the end)."""
    import torch

    from learner.replay import ReplayRecord

    probs = torch.full((n_pos, k), float("nan")) if nan else torch.full((n_pos, k), 0.2)
    return ReplayRecord(tokens=torch.arange(10, 10 + 9 + n_pos, dtype=torch.int32), prompt_len=8,
                        positions=torch.arange(9, 9 + n_pos, dtype=torch.int32),
                        top_ids=torch.arange(n_pos * k, dtype=torch.int32).reshape(n_pos, k), top_probs=probs,
                        tail=torch.full((n_pos,), 0.0 if nan else 0.2), draft_wrong=torch.ones(n_pos, dtype=torch.bool),
                        draft_id=draft, domain="probe", tenant=tenant, request_id=f"probe-{tenant}-{i}")


def test_a_candidate_with_nan_weights_is_never_published(server):
    """Records whose target distributions are NaN reach the live learner as any draft's records
    would; the rounds they feed produce non-finite candidates, which the gate rejects: the draft
    stays at version 0, no replica receives weights for it, the metrics count the rejection."""
    from ray import serve

    from .conftest import ADMIN_KEY

    learner = serve.get_deployment_handle("Learner", "osd")
    draft = "nan-probe"

    # a round picks the draft with the most untrained traffic: keep feeding until it is this one
    deadline, rejected, i = time.monotonic() + 180, 0.0, 0
    while time.monotonic() < deadline and not rejected:
        for _ in range(8):
            assert learner.record.remote(_record(draft, "alice", i, nan=True)).result(timeout_s=30)
            i += 1
        time.sleep(3)
        rejected = total(scrape(server), "osd_learner_rejected_total", draft=draft)
    assert rejected >= 1, f"no round on the NaN records within 180 s ({i} records)"
    stats = _call(server + "/admin/learner", key=ADMIN_KEY)[1]
    assert stats["drafts"][draft]["version"] == 0
    after = scrape(server)  # every rejection of it was for non-finite weights
    assert total(after, "osd_learner_rejected_total", draft=draft, reason="non_finite") == total(
        after, "osd_learner_rejected_total", draft=draft)
    versions = _call(server + "/admin/drafts", key=ADMIN_KEY)[1]["replicas"]
    assert all(v.get(draft, 0) == 0 for v in versions)
    events = _call(server + "/v1/stats", key=ADMIN_KEY)[1]["events"]
    assert not any(e["kind"] == "publish" and e.get("draft") == draft for e in events)


def test_a_tenants_stored_records_can_be_deleted(server):
    """Replay shards hold a tenant id per record; deleting a tenant's records removes them from
    the shards on disk (and memory), leaves other tenants' records, and needs the admin key."""
    import re
    from pathlib import Path

    import openai
    from ray import serve

    from .conftest import ADMIN_KEY, KEY, PROMPTS, STATE

    shards = Path(STATE["learner_dir"]) / "shards"

    def on_disk() -> set[str]:
        """Tenants with a record in a shard log (the record's JSON header names it)."""
        return {m.decode() for p in shards.glob("shard-*.log") for m in re.findall(rb'"tenant":\s*"([^"]+)"', p.read_bytes())}

    alice = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    learner = serve.get_deployment_handle("Learner", "osd")
    deadline, i = time.monotonic() + 120, 0
    while time.monotonic() < deadline and not {"alice", "solo"} <= on_disk():
        if "alice" not in on_disk():  # alice's records come from served requests (when the draft proposed)
            alice.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24, temperature=0)
        if "solo" not in on_disk():  # another tenant's, handed to the learner directly
            assert learner.record.remote(_record("general", "solo", i)).result(timeout_s=30)
        i += 1
        time.sleep(1)
    assert {"alice", "solo"} <= on_disk()
    time.sleep(2)  # a finished request's record is sent after its response: let the last ones arrive
    while _call(server + "/admin/learner", key=ADMIN_KEY)[1]["queue_depth"]:  # nothing still in flight
        time.sleep(0.5)
    others = on_disk() - {"alice"}
    req = urllib.request.Request(server + "/admin/tenants/alice/records", method="DELETE",
                                 headers={"Authorization": f"Bearer {KEY}"})
    try:
        urllib.request.urlopen(req, timeout=30)
        refused = None
    except urllib.error.HTTPError as e:
        refused = e.code
    assert refused == 403  # a tenant cannot delete (or see) records: operators only
    req = urllib.request.Request(server + "/admin/tenants/alice/records", method="DELETE",
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    assert out["tenant"] == "alice" and out["deleted"]["shards"] > 0
    assert on_disk() == others  # alice's records are gone from the files, every other tenant's stay
