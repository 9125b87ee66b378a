"""A draft replica's own logic in one process: the speculative loop of a request with its step
metrics, the records it sends the learner, published weights by version, finished outputs shared
between replicas' suffix trees, and the remote verifier's wait for a restarted target. The real
`DraftPool` on the tiny Llama (its target co-located, or behind a verifier handle), joined to its
peers by in-process handles (tests/inprocess.py); tests/serve/ runs it under Ray Serve."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from ray.exceptions import ActorUnavailableError, RayActorError

from config import SamplingParams
from deployments.drafts import RemoteVerifier
from deployments.protocol import Accepted, GenerateRequest, Refused
from deployments.protocol import TargetUnavailable
from deployments.target import Target
from inprocess import Handle, LocalPool, app_config, counter, hist, save_tiny_model
from router.router import GENERAL

SUFFIX = {"draft": {"proposers": ["suffix"], "suffix": {"max_requests": 3, "max_scopes": 2}}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, make_llama, make_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), make_llama, make_tokenizer)


def engine_cfg(folder, **draft):
    cfg = app_config(folder)
    return app_config(folder, engine={**cfg.engine.model_dump(), **draft})


class Recorder:
    """The learner's `record` as a replica calls it (fire and forget); keeps what arrived."""

    def __init__(self, latest=None):
        self.records, self.asked, self._latest, self.touched = [], [], latest, 0

    def touch(self):
        self.touched += 1

    def record(self, rec):
        self.records.append(rec)
        return True

    def latest(self, draft_id):
        self.asked.append(draft_id)
        return self._latest


# -- one request -----------------------------------------------------------------------------------

def test_a_request_streams_its_header_steps_and_usage_and_counts_every_step(folder, loop):
    pool = LocalPool(app_config(folder))
    t0 = time.perf_counter()
    items = loop.run(pool.serve(n=12, domain="code", lang="en", tenant="alice"))
    elapsed = time.perf_counter() - t0
    head, steps, end = items[0], items[1:-1], items[-1]
    assert head == Accepted(11)  # a raw prompt: the tokenizer's chat template is not applied
    assert sum(len(s.tokens) for s in steps) == 12 and end.finish_reason == "length"
    u, spec = end.usage, end.usage["speculative"]
    assert (u["prompt_tokens"], u["completion_tokens"]) == (11, 12)
    assert spec["steps"] == len(steps)
    assert spec["proposed"] > 0 and spec["alpha"] == spec["accepted"] / spec["proposed"]
    assert spec["mean_k"] == spec["proposed"] / spec["steps"] and spec["resumed_after"] == 0
    assert (spec["domain"], spec["language"], spec["draft_id"], spec["draft_version"]) == ("code", "en", GENERAL, 0)
    assert spec["verify_wait_ms"] >= spec["target_ms"] > 0
    waited = counter(pool.meter, "osd_spec_decode_verify_wait_seconds_total", draft=GENERAL)
    assert 0 < waited < elapsed and spec["verify_wait_ms"] == pytest.approx(1e3 * waited / spec["steps"], rel=1e-9)
    assert pool.outputs.served == {} and pool.outputs.outbox == []  # no suffix tree here: outputs are not kept
    forward = hist(pool.meter, "osd_target_forward_seconds")  # the co-located target's batches, timed around
    assert forward[0] == spec["steps"] and 0 < spec["target_ms"] * spec["steps"] / 1e3 <= forward[1]
    m, labels = pool.meter, {"tenant": "alice", "domain": "code", "language": "en", "draft": GENERAL}
    assert counter(m, "osd_spec_decode_num_steps_total", **labels) == spec["steps"]
    assert counter(m, "osd_spec_decode_emitted_tokens_total", **labels) == 12  # tokens per step = 12 / steps
    by = {"tenant": "alice", "domain": "code", "proposer": "draft"}  # the truncated draft drafted every step
    assert counter(m, "osd_spec_decode_proposer_draft_tokens_total", **by) == spec["proposed"]
    assert counter(m, "osd_spec_decode_proposer_accepted_tokens_total", **by) == spec["accepted"]
    assert counter(m, "osd_spec_decode_num_draft_tokens_total", **labels) == spec["proposed"]
    assert counter(m, "osd_spec_decode_num_accepted_tokens_total", **labels) == spec["accepted"]
    drafts = counter(m, "osd_spec_decode_num_drafts_total", **labels)
    assert 0 < drafts <= spec["steps"]
    per_pos = [counter(m, "osd_spec_decode_num_draft_tokens_per_pos_total", draft=GENERAL, position=i) for i in range(4)]
    acc_pos = [counter(m, "osd_spec_decode_num_accepted_tokens_per_pos_total", draft=GENERAL, position=i) for i in range(4)]
    assert per_pos[0] == drafts and sum(per_pos) == spec["proposed"] and per_pos[3] == 0
    assert sum(acc_pos) == spec["accepted"] and all(a <= p for a, p in zip(acc_pos, per_pos))
    assert all(acc_pos[i + 1] <= acc_pos[i] for i in range(2))  # a later position is accepted only after the earlier
    assert counter(m, "osd_spec_decode_draft_version_draft_tokens_total", draft=GENERAL, draft_version=0) == spec["proposed"]
    assert counter(m, "osd_spec_decode_draft_version_accepted_tokens_total", draft=GENERAL, draft_version=0) == spec["accepted"]
    assert pool.running == 0 and not pool.held[GENERAL].requests  # released
    snap = pool.telemetry()
    assert snap["gauges"][("osd_draft_pool_requests_running", ())] == 0
    assert snap["gauges"][("osd_draft_pool_drafts_loaded", ())] == 1


def test_a_tenants_requests_share_a_cached_prefix_and_the_replica_counts_it(folder, loop):
    """Prefix caching in an engine replica: a tenant's second request with the same opening skips
    it (the same output as the first's run from scratch), another tenant's does not, the
    replica's metrics count the positions looked up and found, and deleting the tenant's records
    drops its cached prompts."""
    pool = LocalPool(app_config(folder, quantize="int4"))
    opening = "Summarise the following report in two short sentences for a busy reader: "
    first = loop.run(pool.serve(prompt=opening + "sales rose.", n=8, tenant="alice"))
    pool.telemetry()
    before = counter(pool.meter, "osd_engine_prefix_cache_hit_tokens_total")
    again = loop.run(pool.serve(prompt=opening + "sales rose.", n=8, tenant="alice"))
    pool.telemetry()
    hit = counter(pool.meter, "osd_engine_prefix_cache_hit_tokens_total") - before
    assert hit >= 48 and [s.tokens for s in again[1:-1]] != [] and (
        sum((s.tokens for s in again[1:-1]), []) == sum((s.tokens for s in first[1:-1]), []))
    # each response's usage says how many of its prompt's positions came from the cache (OpenAI's field)
    assert [r[-1].usage["prompt_tokens_details"]["cached_tokens"] for r in (first, again)] == [0, hit]
    for r, n in ((first, 0), (again, hit)):  # said on the first chunk too (llama-server's per-chunk cache_n)
        assert r[1].cached_tokens == n and all(c.cached_tokens is None for c in r[2:-1]), r
    other = loop.run(pool.serve(prompt=opening + "sales rose.", n=8, tenant="bob"))
    assert other[-1].usage["prompt_tokens_details"]["cached_tokens"] == 0
    pool.telemetry()
    assert counter(pool.meter, "osd_engine_prefix_cache_hit_tokens_total") - before == hit  # bob found nothing
    assert counter(pool.meter, "osd_engine_prefix_cache_queried_tokens_total") >= 3 * hit
    assert pool.telemetry()["gauges"][("osd_engine_prefix_cache_blocks", ())] > 0
    assert loop.run(pool.forget_tenant("alice"))["prefixes"] > 0  # alice's records deleted: her cached prompts too
    loop.run(pool.serve(prompt=opening + "sales rose.", n=8, tenant="alice"))
    pool.telemetry()
    assert counter(pool.meter, "osd_engine_prefix_cache_hit_tokens_total") - before == hit


def test_steps_closer_than_the_stream_interval_travel_together_first_text_and_last_at_once(folder, loop):
    every = loop.run(LocalPool(app_config(folder)).serve(n=12, domain="code", lang="en", tenant="alice"))
    held = LocalPool(app_config(folder, drafts={"stream_interval_s": 3600.0}))
    items = loop.run(held.serve(n=12, domain="code", lang="en", tenant="alice"))
    steps, every_steps = items[1:-1], every[1:-1]
    assert len(every_steps) > 2 and len(steps) == 2  # the first text at once, the rest with the last
    # the prefill's token alone shows no text yet (the detokeniser holds the newest token back): the
    # first chunk is the first step with text, carrying the steps before it, not the empty step
    assert every_steps[0].text == ""
    first = next(i for i, s in enumerate(every_steps) if s.text)
    assert steps[0].text == every_steps[first].text
    assert steps[0].tokens == [t for s in every_steps[: first + 1] for t in s.tokens]
    assert [t for s in steps for t in s.tokens] == [t for s in every_steps for t in s.tokens]
    assert "".join(s.text for s in steps) == "".join(s.text for s in every_steps)
    assert items[-1].usage["speculative"]["steps"] == len(every_steps)  # every step still counted


def test_the_steps_cost_counts_one_target_step_each_without_a_draft_and_more_with_one(folder, loop):
    """osd_spec_decode_step_cost_total: a step with nothing drafted costs exactly one target-only
    step; a drafted step v(k + 1) + k c >= 1, so the estimated speed-up (output tokens over the
    cost) is at most the tokens per step (below 1 where the drafts are rejected, as on this random
    tiny model)."""
    def total(pool, name):
        return sum(v for (n, _), v in pool.meter._counters.items() if n == name)

    for proposers in ([], ["ngram"]):
        pool = LocalPool(engine_cfg(folder, draft={"proposers": proposers}))
        loop.run(pool.serve(prompt="abcabcabcabcabcabc", n=24))
        steps, emitted, cost = (total(pool, f"osd_spec_decode_{x}_total") for x in ("num_steps", "emitted_tokens", "step_cost"))
        drafted = total(pool, "osd_spec_decode_num_drafts_total")
        assert steps > 0 and cost >= steps
        if not proposers:
            assert drafted == 0 and cost == steps and emitted == steps  # target-only: one token a step at one step's cost
        else:
            assert drafted > 0 and cost > steps and emitted / cost < emitted / steps  # verifying k + 1 tokens costs more


def test_steps_that_requests_share_are_counted_by_whether_they_drafted(folder, loop):
    """osd_engine_shared_steps_total: steps of several decoding requests, by the decision behind
    them (drafting, cap_zero, plain_measured); a lone request's steps are not counted."""
    pool = LocalPool(engine_cfg(folder, draft={"proposers": ["ngram"]}))
    loop.run(pool.serve(prompt="abcabcabcabc", n=12))
    shared = {lb: v for (n, lb), v in pool.meter._counters.items() if n == "osd_engine_shared_steps_total"}
    assert shared == {}
    async def together():
        return await asyncio.gather(*(pool.serve(prompt=f"abc{i}abc{i}abc{i}", n=16) for i in range(4)))

    items = loop.run(together())
    shared = {d: counter(pool.meter, "osd_engine_shared_steps_total", decision=d) for d in ("drafting", "cap_zero", "plain_measured")}
    shared = {d: v for d, v in shared.items() if v}
    assert sum(shared.values()) >= 8
    assert sum(shared.values()) <= sum(it[-1].usage["speculative"]["steps"] for it in items)


def test_the_step_counts_of_a_model_free_proposer_are_labelled_by_its_name(folder, loop):
    pool = LocalPool(engine_cfg(folder, draft={"proposers": ["ngram"]}))
    items = loop.run(pool.serve(prompt="abcabcabcabc", n=12))
    spec = items[-1].usage["speculative"]
    assert spec["proposed"] > 0 and spec["draft_version"] == 0
    assert counter(pool.meter, "osd_spec_decode_draft_version_draft_tokens_total", draft=GENERAL,
                   draft_version="ngram") == spec["proposed"]


def test_a_token_id_prompt_outside_the_vocabulary_is_refused_in_the_header(folder, loop):
    pool = LocalPool(app_config(folder))

    async def go(ids):
        engine = await pool.engine_for(GENERAL)
        gen = GenerateRequest("r", SamplingParams(max_tokens=3), prompt_ids=ids)
        return [item async for item in pool.generate(gen, engine)]
    assert loop.run(go([5, 128])) == [Refused("prompt token id 128 is outside the vocabulary [0, 128)")]
    assert loop.run(go([-1])) == [Refused("prompt token id -1 is outside the vocabulary [0, 128)")]
    assert loop.run(go([0, 127]))[0] == Accepted(2)


def test_text_the_tokenizer_cannot_read_is_refused_not_raised(folder, loop):
    """A lone surrogate that got past the edge: the replica refuses the request (a 400), it does not fail."""
    pool = LocalPool(app_config(folder))

    async def go(**text):
        engine = await pool.engine_for(GENERAL)
        gen = GenerateRequest("r", SamplingParams(max_tokens=3), **text)
        return [item async for item in pool.generate(gen, engine)]
    for text in ({"prompt": "ab\ud800"}, {"messages": [{"role": "user", "content": "ab\ud800"}]}):
        items = loop.run(go(**text))
        assert len(items) == 1 and isinstance(items[0], Refused) and "cannot be tokenized" in items[0].error and items[0].status == 400
    assert pool.running == 0


def test_a_resumed_request_continues_after_the_tokens_already_sent(folder, loop):
    pool = LocalPool(app_config(folder))
    whole = loop.run(pool.serve(n=12))
    tokens = [t for item in whole[1:-1] for t in item.tokens]
    again = loop.run(pool.serve(n=12, resume=tokens[:5]))
    rest = [t for item in again[1:-1] for t in item.tokens]
    assert rest == tokens[5:] and again[-1].usage["speculative"]["resumed_after"] == 5
    assert again[-1].usage["completion_tokens"] == 12


def test_a_dropped_cache_is_sent_whole_and_the_output_is_unchanged(folder, loop):
    """The split placement: a draft replica whose target (another deployment) dropped its cache."""
    cfg = app_config(folder, placement="split")
    target = Target.func_or_class(cfg.engine.model, cfg.target, cfg.engine.k.k_max, None)
    pool = LocalPool(cfg, target=Handle(target))
    expect = loop.run(pool.serve(n=12))
    verify, calls = pool.verifier.verify, []

    async def forgetful(call):
        calls.append(call)
        if len(calls) == 3:
            return None  # the target dropped this sequence's cache (TTL, LRU, restart)
        return await verify(call)
    pool.verifier.verify = forgetful
    got = loop.run(pool.serve(n=12))
    assert sum((i.tokens for i in got[1:-1]), []) == sum((i.tokens for i in expect[1:-1]), [])
    dropped, again = calls[2], calls[3]
    assert dropped.start > 0 and again.start == 0 and len(again.tokens) == dropped.start + len(dropped.tokens)
    assert again.tokens[dropped.start:] == dropped.tokens and again.seq_id == dropped.seq_id


def test_the_learner_gets_a_record_of_a_request_whose_draft_proposed(folder, loop):
    learner = Recorder()
    pool = LocalPool(app_config(folder), learner=Handle(learner))
    items = loop.run(pool.serve(n=10, domain="sql", tenant="bob"))
    assert len(learner.records) == 1 and learner.asked == [GENERAL]  # a new replica asked for the latest weights
    assert learner.touched == 1  # the request told the learner that traffic flows
    rec = learner.records[0]
    assert (rec.domain, rec.tenant, rec.draft_id) == ("sql", "bob", GENERAL)
    assert rec.prompt_len == 11 and len(rec.tokens) == 11 + 10
    assert items[-1].usage["speculative"]["proposed"] > 0
    still = LocalPool(engine_cfg(folder, k={"fixed_k": 0}), learner=Handle(learner))
    loop.run(still.serve(n=6))
    assert len(learner.records) == 1  # nothing drafted, nothing to learn


def test_published_weights_are_kept_by_version_and_staged_into_the_loaded_draft(folder, loop):
    pool = LocalPool(app_config(folder))
    loop.run(pool.serve(n=4))
    engine = pool.held[GENERAL]
    state = {k: v.clone() for k, v in engine.learned_draft.runner.model.state_dict().items()}
    assert pool.load_weights("first", [state], 1) == 1 and pool.published.version("first") == 1  # v1 of a new draft
    assert pool.load_weights("nothing", [state], 0) == 0 and pool.published.get("nothing") is None  # the base: nothing
    assert pool.load_weights(GENERAL, [state], 2) == 2 and pool.published.version(GENERAL) == 2
    assert pool.load_weights(GENERAL, [state], 1) == 2 and pool.published.version(GENERAL) == 2  # older: ignored
    assert pool.load_weights(GENERAL, [state], 2) == 2
    assert pool.load_weights("other", [state], 3) == 3 and "other" not in pool.engines
    pool.loop.call(lambda: None).result(5)  # a step boundary of the engine loop, no request running
    assert engine.draft_version == 2 and pool.versions() == {GENERAL: 2}  # installed there, not at the next request
    items = loop.run(pool.serve(n=4))
    assert items[-1].usage["speculative"]["draft_version"] == 2
    later = loop.run(pool.engine_for("other"))  # a draft loaded later starts at its published version
    assert later.draft_version == 3


def test_a_new_replica_starts_from_the_learners_latest_weights(folder, loop):
    probe = LocalPool(app_config(folder))
    state = {k: v.clone() for k, v in loop.run(probe.engine_for(GENERAL)).learned_draft.runner.model.state_dict().items()}
    learner = Recorder(latest=(state, 4))
    pool = LocalPool(app_config(folder), learner=Handle(learner))
    assert loop.run(pool.engine_for(GENERAL)).draft_version == 4 and pool.published.version(GENERAL) == 4
    loop.run(pool.engine_for(GENERAL))
    assert learner.asked == [GENERAL]  # known now: not asked again
    none = LocalPool(app_config(folder), learner=Handle(Recorder(latest=None)))
    assert loop.run(none.engine_for(GENERAL)).draft_version == 0 and none.published.get(GENERAL) is None


# -- suffix trees over the whole pool's traffic ----------------------------------------------------

def replicas(folder, n: int) -> list:
    cfg = engine_cfg(folder, **SUFFIX)
    pools = [LocalPool(cfg) for _ in range(n)]
    for i, p in enumerate(pools):
        p.name = f"r{i}"
    handle = Handle(*pools)
    for p in pools:
        p.peers = handle
    return pools


def test_finished_outputs_reach_the_other_replicas_and_a_new_replica_catches_up(folder, loop):
    a, b = replicas(folder, 2)
    loop.run(a.serve(n=8, request_id="q1", domain="code"))
    assert [(d, rid, scope) for d, rid, scope, _, _ in a.outputs.outbox] == [(GENERAL, "q1", "code")]
    assert loop.run(b.share_served()) == 0  # nothing finished there: nothing sent
    assert not [c for c in a.peers.calls if c[0] == "broadcast:add_served"]
    assert loop.run(a.share_served()) == 1 and a.outputs.outbox == []
    assert loop.run(a.share_served()) == 0
    assert loop.run(b.served_ids(GENERAL)) == {"kept": ["q1"], "trees": None}  # not loaded in b: kept for later
    assert loop.run(a.served_ids(GENERAL))["kept"] == ["q1"]  # its own, once (its broadcast came back, ignored)
    assert counter(a.meter, "osd_draft_pool_outputs_shared_total", direction="sent") == 1
    assert counter(b.meter, "osd_draft_pool_outputs_shared_total", direction="received") == 1
    assert counter(a.meter, "osd_draft_pool_outputs_shared_total", direction="received") == 0
    loop.run(b.loaded(GENERAL))  # loaded after: starts with what was served
    assert loop.run(b.served_ids(GENERAL))["trees"] == ["q1"]
    loop.run(a.serve(n=8, request_id="q2", domain="code"))
    loop.run(a.share_served())
    assert loop.run(b.served_ids(GENERAL))["trees"] == ["q1", "q2"]  # loaded: straight into its trees
    c = replicas(folder, 1)[0]
    c.peers = Handle(a, b, c)
    assert loop.run(c.catch_up()) == 2  # the same two outputs kept by a and b: taken once
    assert loop.run(c.served_ids(GENERAL))["kept"] == ["q1", "q2"] and loop.run(c.catch_up()) == 0
    ids = dict((rid, arr) for _, rid, _, arr, _ in loop.run(c.kept()))
    assert ids["q1"].dtype == np.int32 and len(ids["q1"]) == 8


def test_kept_outputs_are_bounded_as_the_suffix_trees_and_queued_for_peers_only_when_there_are_some(folder, loop):
    """The replica's kept outputs take the suffix trees' bounds (max_requests 3, max_scopes 2;
    the bounds themselves: tests/unit/test_outputs.py), and a served output waits in the outbox
    only where there are peers to send it to."""
    (a,) = replicas(folder, 1)
    for i in range(5):
        loop.run(a.serve(n=2, request_id=f"x{i}", draft_id="d1"))
    assert [item[0] for item in a.outputs.served["d1"]] == ["x2", "x3", "x4"]  # max_requests 3: the oldest go
    assert [item[1] for item in a.outputs.outbox] == ["x2", "x3", "x4"]  # peers unreachable: the newest wait
    for d in ("d2", "d1", "d3"):  # d1 used again: d2 is now the oldest
        loop.run(a.serve(n=2, request_id=f"y-{d}", draft_id=d))
    assert list(a.outputs.served) == ["d1", "d3"]  # max_scopes 2: the least recently used draft goes
    alone = LocalPool(engine_cfg(folder, **SUFFIX))  # no peers: kept, nothing queued to send
    loop.run(alone.serve(n=2, request_id="x", draft_id="d1"))
    assert [item[0] for item in alone.outputs.served["d1"]] == ["x"]
    assert alone.outputs.outbox == [] and loop.run(alone.share_served()) == 0 and loop.run(alone.catch_up()) == 0


def test_a_replicas_own_broadcast_is_ignored_and_outputs_of_unloaded_drafts_are_kept(folder, loop):
    (a,) = replicas(folder, 1)
    item = ("d1", "x", "s", np.array([1, 2], dtype=np.int32))
    assert loop.run(a.add_served(a.name, [item])) == 0 and "d1" not in a.outputs.served
    assert loop.run(a.add_served("other", [item, ("d2", "y", "s", np.array([3], dtype=np.int32))])) == 2
    assert [item[0] for item in a.outputs.served["d1"]] == ["x"] and list(a.outputs.served) == ["d1", "d2"]


def test_forgetting_a_tenant_reaches_kept_outputs_the_outbox_and_every_loaded_engines_trees(folder, loop):
    """Deleting a tenant's records: its outputs leave every replica's kept outputs, the outbox not
    yet sent and the suffix trees of the loaded engines (its own requests', those another replica
    sent, and a request cancelled mid-way whose partial output joined a tree); other tenants' stay,
    and a replica that starts afterwards takes in none of them. The trees change on the engine loop."""
    import threading

    cfg = engine_cfg(folder, draft={"proposers": ["suffix"], "suffix": {"max_requests": 16, "max_scopes": 4}})
    a, b = LocalPool(cfg), LocalPool(cfg)
    a.name, b.name = "r0", "r1"
    a.peers = b.peers = Handle(a, b)
    loop.run(a.serve(n=8, request_id="al1", domain="code", tenant="alice"))
    loop.run(a.serve(n=8, request_id="bo1", domain="code", tenant="bob"))
    loop.run(a.serve(n=8, request_id="al2", domain="chat", tenant="alice"))
    loop.run(a.share_served())
    loop.run(b.loaded(GENERAL))
    loop.run(a.serve(n=8, request_id="al3", domain="code", tenant="alice"))  # still in a's outbox

    async def cancelled():  # alice's client leaves after two steps: her partial output is in a's tree
        agen = a.generate(GenerateRequest("al4", SamplingParams(max_tokens=30, ignore_eos=True), prompt="Hi there",
                                          domain="code", tenant="alice"), await a.loaded(GENERAL), GENERAL)
        for _ in range(3):
            await agen.__anext__()
        await agen.aclose()
        while a.loop.running:  # dropped at the loop's next step
            await asyncio.sleep(0.01)
    loop.run(cancelled())
    assert loop.run(a.served_ids(GENERAL)) == {"kept": ["al1", "bo1", "al2", "al3"],
                                               "trees": ["al1", "al2", "al3", "al4", "bo1"]}
    assert loop.run(b.served_ids(GENERAL)) == {"kept": ["al1", "bo1", "al2"], "trees": ["al1", "al2", "bo1"]}
    threads = []
    engine = a.held[GENERAL]
    real = engine.forget_served
    engine.forget_served = lambda ids: (threads.append(threading.current_thread().name), real(ids))[1]
    answers = loop.run(a.peers.broadcast("forget_tenant", "alice").results_async())
    assert answers == [{"kept": 3, "trees": 4, "prefixes": 0}, {"kept": 2, "trees": 2, "prefixes": 0}]  # Hugging Face eager: no prefix cache
    assert threads == [f"engine-loop-{id(a):x}"]  # a's trees changed on its engine loop's thread
    for p in (a, b):
        assert loop.run(p.served_ids(GENERAL)) == {"kept": ["bo1"], "trees": ["bo1"]}
        assert "alice" not in p.outputs.owners.values()
    assert a.outputs.outbox == []
    c = LocalPool(cfg)
    c.name, c.peers = "r2", Handle(a, b, c)
    loop.run(c.catch_up())
    loop.run(c.loaded(GENERAL))
    assert loop.run(c.served_ids(GENERAL)) == {"kept": ["bo1"], "trees": ["bo1"]}


# -- the remote verifier ---------------------------------------------------------------------------

class FlakyTarget:
    """A target handle whose first `fail` calls raise `error` (its replica died), then answers."""

    def __init__(self, fail: int, error=RayActorError):
        self.fail, self.error, self.calls, self.released = fail, error, 0, []

    async def verify(self, call):
        self.calls += 1
        if self.calls <= self.fail:
            raise self.error()
        return ("rows", call)

    async def stats(self):
        return {}

    def release(self, seq_id):
        self.released.append(seq_id)


@pytest.mark.parametrize("error", [RayActorError, ActorUnavailableError])
def test_the_remote_verifier_waits_for_a_replacement_target(loop, error):
    target = FlakyTarget(fail=2, error=(lambda: ActorUnavailableError("gone", None)) if error is ActorUnavailableError else error)
    v = RemoteVerifier(Handle(target), wait_s=5.0)
    t0 = time.monotonic()
    assert loop.run(v.verify("call")) == ("rows", "call") and target.calls == 3
    assert time.monotonic() - t0 < 2.0  # retried every 0.5 s at most


def test_the_remote_verifier_gives_up_after_its_wait_as_target_unavailable(loop):
    target = FlakyTarget(fail=10**6)
    v = RemoteVerifier(Handle(target), wait_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(TargetUnavailable, match="the target model is restarting \\(RayActorError\\); retry the request"):
        loop.run(v.verify("call"))
    # it sleeps no longer than what is left of the wait (0.5 s at most between tries)
    assert 0.2 <= time.monotonic() - t0 < 0.4 and target.calls >= 2


def test_a_target_that_hangs_after_a_failure_is_timed_out(loop):
    class Hangs(FlakyTarget):
        async def verify(self, call):
            self.calls += 1
            if self.calls == 1:
                raise RayActorError()
            await asyncio.sleep(30)

    v = RemoteVerifier(Handle(Hangs(0)), wait_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TargetUnavailable):
        loop.run(v.verify("call"))
    assert time.monotonic() - t0 < 2.0


def test_the_remote_verifier_passes_other_errors_and_releases_without_waiting(loop):
    v = RemoteVerifier(Handle(FlakyTarget(fail=1, error=lambda: ValueError("bad call"))), wait_s=5.0)
    with pytest.raises(ValueError, match="bad call"):
        loop.run(v.verify("call"))
    target = FlakyTarget(0)
    v = RemoteVerifier(Handle(target))
    loop.run(v.ready(1.0))
    v.release("seq-1")
    assert target.released == ["seq-1"]


def test_a_split_replica_is_ready_only_when_its_target_answers(folder, loop):
    class Silent(FlakyTarget):
        async def stats(self):
            await asyncio.sleep(30)

    pool = LocalPool(app_config(folder))
    assert loop.run(pool.ready()) is True  # co-located: itself
    pool.verifier = RemoteVerifier(Handle(Silent(0)))
    with pytest.raises(asyncio.TimeoutError):
        loop.run(pool.ready(timeout_s=0.1))


def test_a_replica_keeps_the_published_weights_of_few_drafts_it_does_not_hold(folder, loop):
    """Broadcasts reach every replica for every draft: beyond ``drafts_per_replica`` entries the
    least recently published weights of drafts not loaded here are forgotten (a loaded draft's
    never), and a forgotten draft asks the learner when it loads."""
    cfg = app_config(folder, drafts={"drafts_per_replica": 2})
    probe = LocalPool(cfg)
    state = {k: v.clone() for k, v in loop.run(probe.engine_for(GENERAL)).learned_draft.runner.model.state_dict().items()}
    learner = Recorder(latest=(state, 7))
    pool = LocalPool(cfg, learner=Handle(learner))
    loop.run(pool.loaded("held"))  # loaded (asked the learner: v7)
    assert list(pool.published.weights) == ["held"] and learner.asked == ["held"]
    for i, d in enumerate(["x", "y", "z"]):
        pool.load_weights(d, [state], 10 + i)
    assert list(pool.published.weights) == ["held", "z"]  # x and y forgotten, the loaded one kept
    pool.load_weights("held", [state], 8)
    assert list(pool.published.weights) == ["z", "held"]
    assert pool.load_weights("w", [state], 20) == 20 and list(pool.published.weights) == ["held", "w"]
    assert loop.run(pool.engine_for("w")).draft_version == 20 and learner.asked == ["held"]  # kept: not asked
    assert loop.run(pool.engine_for("x")).draft_version == 7 and learner.asked == ["held", "x"]  # from the learner
    assert list(pool.published.weights) == ["held", "x"]  # x pushed w out: w's engine is gone


def test_a_draft_loads_with_its_starting_weights_when_the_learner_does_not_answer(folder, loop):
    """A learner that does not answer within ``drafts.learner_wait_s`` (restarting) does not hold
    the request up: the draft loads with its starting weights, counted; a later load asks again."""
    import asyncio

    class Slow(Recorder):
        async def latest(self, draft_id):
            self.asked.append(draft_id)
            await asyncio.sleep(30)

    learner = Slow()
    pool = LocalPool(app_config(folder, drafts={"learner_wait_s": 0.2}), learner=Handle(learner))
    t0 = time.perf_counter()
    engine = loop.run(pool.engine_for("c1/en"))
    assert time.perf_counter() - t0 < 5 and engine.draft_version == 0 and pool.published.get("c1/en") is None
    assert counter(pool.meter, "osd_draft_pool_learner_unanswered_total", draft="c1/en") == 1
    learner.__class__ = Recorder  # answering again
    learner._latest = ({k: v.clone() for k, v in engine.learned_draft.runner.model.state_dict().items()}, 3)
    assert loop.run(pool.engine_for("c1/en")).draft_version == 3 and learner.asked == ["c1/en", "c1/en"]


def test_a_replicas_drafts_read_the_configured_window_of_the_prompt_and_serve_the_same_tokens(folder, loop):
    """engine.draft.context_tokens reaches every draft a replica loads (the general one and one
    loaded later), and a long prompt served with a 16-token window gives the tokens it gives without."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # longer than the window
    windowed = LocalPool(engine_cfg(folder, draft={"kind": "truncated", "num_layers": 2, "context_tokens": 16}))
    whole = LocalPool(app_config(folder))
    got = loop.run(windowed.serve(prompt, n=12))
    want = loop.run(whole.serve(prompt, n=12))
    assert [t for s in got[1:-1] for t in s.tokens] == [t for s in want[1:-1] for t in s.tokens]
    assert got[-1].usage["speculative"]["proposed"] > 0
    assert windowed.held[GENERAL].learned_draft.context_tokens == 16
    assert loop.run(windowed.engine_for("other")).learned_draft.context_tokens == 16
    assert whole.held[GENERAL].learned_draft.context_tokens is None


def test_a_prompt_scored_past_the_context_is_refused_before_its_forward(folder, loop):
    """Scoring a prompt runs a forward of its own before the request joins the loop: a prompt the
    model's context cannot hold with its max_tokens is refused as the engine refuses it (400),
    never run; within the context, the scores come with the header and are counted."""
    pool = LocalPool(app_config(folder))
    context = pool.view.max_positions
    items = loop.run(pool.serve(n=8, prompt=None, prompt_ids=[5] * (context - 4), prompt_logprobs=1))
    assert len(items) == 1 and isinstance(items[0], Refused) and items[0].status == 400
    assert "exceeds the model's context" in items[0].error
    assert counter(pool.meter, "osd_engine_prompt_scored_tokens_total") == 0
    items = loop.run(pool.serve(n=2, prompt=None, prompt_ids=[5, 6, 7, 8], prompt_logprobs=1))
    head = items[0]
    assert isinstance(head, Accepted) and head.prompt_ids == [5, 6, 7, 8] and len(head.prompt_logprobs) == 3
    assert all(len(top) == 1 and rank >= 1 for _, top, rank in head.prompt_logprobs)
    assert counter(pool.meter, "osd_engine_prompt_scored_tokens_total") == 3


def test_a_prompt_is_scored_a_prefill_chunk_between_steps_with_its_kv_held_from_the_budget(folder, loop):
    """Scoring goes a prefill chunk at a time, each between two steps of the loop (the other
    requests go on in between), with the prompt's KV positions held from the loop's budget
    meanwhile: the same numbers as one forward over it; the budget given back after; no room in
    the budget, a 503 before any forward."""
    from speculative.summary import prompt_logprobs

    cfg = app_config(folder)
    pool = LocalPool(app_config(folder, loop={**cfg.loop.model_dump(), "prefill_chunk": 8}))
    ids = [(7 * i) % 50 + 3 for i in range(40)]
    calls, real = [], pool.loop.call

    def counting(fn):
        calls.append(fn)
        return real(fn)
    pool.loop.call = counting
    t0 = time.perf_counter()
    items = loop.run(pool.serve(n=2, prompt=None, prompt_ids=ids, prompt_logprobs=2))
    took = time.perf_counter() - t0
    pool.loop.call = real
    assert 0 < counter(pool.meter, "osd_engine_prompt_scoring_seconds_total") <= took
    head = items[0]
    assert isinstance(head, Accepted) and len(head.prompt_logprobs) == len(ids) - 1
    assert len(calls) >= 5 + 2  # a reservation, five chunks of 8, the release
    whole = real(lambda: prompt_logprobs(pool.loop.target, ids, 2, chunk=64)).result()
    assert [r for _, _, r in head.prompt_logprobs] == [r for _, _, r in whole]
    # (float32 eager rows: the chunking rounds the largest values differently in the last bits)
    assert [lp for lp, _, _ in head.prompt_logprobs] == pytest.approx([lp for lp, _, _ in whole], rel=1e-5, abs=1e-5)
    assert real(lambda: pool.loop.reserved).result() == 0 and len(pool.loop.target) == 0  # all given back
    for size in (33, 34, 41):  # the last chunk one row, a whole chunk, or ending just short of one
        got = loop.run(pool.serve(n=1, prompt=None, prompt_ids=(ids * 2)[:size], prompt_logprobs=0))[0]
        assert isinstance(got, Accepted) and len(got.prompt_logprobs) == size - 1, size
    held = real(lambda: pool.loop.budget_tokens - 10).result()
    assert real(lambda: pool.loop.reserve(held)).result()
    items = loop.run(pool.serve(n=2, prompt=None, prompt_ids=ids[:20], prompt_logprobs=0))
    assert isinstance(items[0], Refused) and items[0].status == 503 and "KV positions" in items[0].error
    real(lambda: pool.loop.unreserve(held)).result()
