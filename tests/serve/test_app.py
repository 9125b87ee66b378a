"""The application over HTTP, driven with the official ``openai`` client and plain HTTP. Greedy
output over HTTP must equal the in-process target-only output; a published draft update must reach
every draft replica."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import urllib.error
import urllib.request
from urllib.parse import urlparse

import numpy as np
import pytest

from config import Grammar, SamplingParams

from .conftest import ADMIN_KEY, KEY, MAX_TOKENS, MODEL, PROMPTS, TINY_KEY, _call, _post, _target_only

pytestmark = pytest.mark.serve


def test_models_health_ready(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    for path in ("/health", "/ready", "/v1/health"):
        with urllib.request.urlopen(server + path, timeout=30) as r:
            assert r.status == 200
    # llama-server's aliases without /v1, for clients whose base URL leaves it out
    import openai

    bare = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in bare.models.list().data] == [MODEL]
    msgs = [{"role": "user", "content": "Name a colour."}]
    assert (bare.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0).choices[0].message.content
            == client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0).choices[0].message.content)
    paths = json.loads(urllib.request.urlopen(server + "/openapi.json", timeout=30).read())["paths"]
    assert "/v1/chat/completions" in paths and "/chat/completions" not in paths  # aliases stay out of the schema


def test_llama_servers_own_completion_api_answers_what_openais_does(server, client):
    """``/completion`` (and its alias ``/completions``, llama-server's own API): the greedy text the
    OpenAI endpoint gives, in llama-server's shape; streamed as partial results ending with the
    final one (``stop: true``) and no ``[DONE]``."""
    prompt = PROMPTS[0]
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "return_tokens": True}
    for path in ("/completion", "/completions"):
        status, out, _ = _call(server + path, body)
        assert status == 200 and out["content"] == text and out["stop"] is True, (path, out)
        assert len(out["tokens"]) == out["tokens_predicted"] <= 12 and out["stop_type"] in ("eos", "limit")
        assert out["timings"]["predicted_n"] == out["tokens_predicted"] and out["tokens_evaluated"] > 0
    req = urllib.request.Request(server + "/completion", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.read().decode().split("\n\n") if line]
    assert "[DONE]" not in events
    events = [json.loads(e) for e in events]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == text
    assert [t for e in events for t in e["tokens"]] == out["tokens"]
    paths = json.loads(urllib.request.urlopen(server + "/openapi.json", timeout=30).read())["paths"]
    assert "/completion" in paths and "/completions" not in paths
    # a chat templated by /apply-template and sent to /completion: the chat's own answer
    msgs = [{"role": "user", "content": "Name a colour."}]
    status, templated, _ = _call(server + "/apply-template", {"messages": msgs})
    assert status == 200 and templated["prompt"].endswith("assistant\n")
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0).choices[0].message.content
    assert _call(server + "/completion", {"prompt": templated["prompt"], "n_predict": 8, "temperature": 0})[1]["content"] == chat
    status, props, _ = _call(server + "/props")
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == 8192 and props["eos_token"] == "<|im_end|>"


def test_greedy_completion_equals_target_only(server, client, reference):
    served = set()
    for prompt in PROMPTS[:4]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == _target_only(reference, prompt), prompt
        spec = r.usage.model_extra["speculative"]
        assert 0 <= spec["accepted"] <= spec["proposed"]
        assert spec["alpha"] == (spec["accepted"] / spec["proposed"] if spec["proposed"] else None)
        if spec["proposed"]:  # every drafted step kept all its tokens or rejected one: at most one per step
            ta = spec["token_acceptance"]
            assert spec["alpha"] <= ta <= 1 and ta * (spec["accepted"] + spec["steps"]) >= spec["accepted"]
        # the learner may publish meanwhile (a round every 8 records here): any version it served
        assert isinstance(spec["draft_version"], int) and spec["draft_version"] >= 0
        assert spec["language"] and spec["domain"]
        assert r.usage.completion_tokens <= MAX_TOKENS and r.usage.prompt_tokens > 0
        served.add(spec["draft_id"])
    # the general draft, or a cluster's own once earlier traffic made one: a draft the router has
    known = set(_call(server + "/admin/drafts", key=ADMIN_KEY)[1]["drafts"])
    assert served and served <= known | {"general"}, (served, known)


def test_chat_stream_equals_whole_response(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.model_extra["speculative"]["proposed"] >= 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_logprobs_whole_streamed_and_across_the_target_hop(server, client):
    """The target's log-probabilities of a greedy chat: the stream's are the whole response's, and
    a split replica, whose rows come from the Target deployment, gives the same numbers."""
    import openai

    messages = [{"role": "user", "content": "Name three colours."}]
    ask = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**ask).choices[0].logprobs.content
    assert len(whole) >= 1 and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in whole)
    assert all(t.top_logprobs[0].token == t.token for t in whole)  # greedy: the most likely
    streamed = [t for c in client.chat.completions.create(**ask, stream=True)
                if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]
    split = openai.OpenAI(base_url=f"{server}/split/v1", api_key=KEY, max_retries=0, timeout=120)
    hop = split.chat.completions.create(**ask).choices[0].logprobs.content
    assert [t.token for t in hop] == [t.token for t in whole]
    assert [t.logprob for t in hop] == pytest.approx([t.logprob for t in whole], abs=1e-5)


def test_echo_with_logprobs_scores_the_prompt_where_the_target_is_co_located(server, client):
    """OpenAI's echo with logprobs (evaluation harnesses' loglikelihood) on the shipped runtime: the
    prompt's tokens first, the first unscored, the output's numbers as without echo; the split
    placement, whose target is another deployment, says it does not serve it."""
    ask = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, logprobs=1)
    plain = client.completions.create(**ask).choices[0].logprobs
    r = client.completions.create(**ask, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and lp.tokens[r.usage.prompt_tokens:] == plain.tokens
    assert lp.token_logprobs[r.usage.prompt_tokens:] == pytest.approx(plain.token_logprobs, abs=1e-5)
    status, body, _ = _call(f"{server}/split/v1/completions", {**ask, "echo": True})
    assert status == 400 and "co-located" in body["error"]["message"]


def test_stream_ends_with_done(server):
    req = urllib.request.Request(f"{server}/v1/completions", data=json.dumps(
        {"prompt": "Le chat est", "max_tokens": 6, "temperature": 0, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_string(client, reference):
    prompt = PROMPTS[4]
    full = _target_only(reference, prompt)
    stop = full.strip().split()[2]  # a word the unconstrained output contains
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_penalties_bias_and_token_stops_over_http_equal_target_only(client, reference):
    """OpenAI's penalties and logit bias, vLLM's repetition penalty, min_tokens and stop_token_ids,
    and min-p: greedy over HTTP (drafts, suffix tree, batching) is the processed target's own
    output in-process, and a seeded sample with min-p is too."""
    prompt = PROMPTS[1]
    plain = reference.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS))
    stop = plain.token_ids[5]
    asks = [dict(frequency_penalty=1.2, presence_penalty=0.4, logit_bias={plain.token_ids[0]: -100}),
            dict(repetition_penalty=1.5, min_tokens=4, stop_token_ids=[stop]),
            dict(temperature=0.8, seed=7, min_p=0.1, frequency_penalty=0.5)]
    texts = set()
    for ask in asks:
        body = {"temperature": 0, **ask}  # JSON makes logit_bias's ids strings, as OpenAI sends them
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=body)
        want = reference.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, **body))
        assert r.choices[0].text == want.text, ask
        assert r.choices[0].finish_reason == want.finish_reason
        texts.add(want.text)
    assert plain.text not in texts and len(texts) == 3  # each changed the output


def test_structured_output_over_http(server, client, reference):
    """A JSON schema (OpenAI's response_format), llama.cpp's json_object, vLLM's guided_choice
    streamed: the text follows the grammar, greedy equals the masked target's own output
    in-process, and a grammar that does not compile is a 400."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999}},
              "required": ["city", "population"], "additionalProperties": False}
    prompt = "The largest city in France, as JSON:"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    value = json.loads(r.choices[0].text)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    want = reference.generate(prompt, SamplingParams(max_tokens=40, grammar=Grammar(kind="json", source=json.dumps(schema))))
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    import openai  # a split replica: its whole rows come over the hop from the Target deployment

    split = openai.OpenAI(base_url=f"{server}/split/v1", api_key=KEY, max_retries=0, timeout=120)
    hop = split.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={
        "json_schema": schema, "frequency_penalty": 0.3})  # llama.cpp's field, and a penalty with it
    want = reference.generate(prompt, SamplingParams(max_tokens=40, frequency_penalty=0.3,
                                                     grammar=Grammar(kind="json", source=json.dumps(schema))))
    assert hop.choices[0].text == want.text
    small = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "legs": {"type": "integer"}},
             "required": ["name", "legs"], "additionalProperties": False}
    chat = client.chat.completions.create(model=MODEL, max_tokens=48, temperature=0,
                                          response_format={"type": "json_object", "schema": small},  # llama.cpp's form
                                          messages=[{"role": "user", "content": "Describe a cat in JSON."}])
    assert set(json.loads(chat.choices[0].message.content)) == {"name", "legs"} and chat.choices[0].finish_reason == "stop"
    ask = dict(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
               extra_body={"guided_choice": ["yes", "no", "sometimes"]})
    whole = client.completions.create(**ask).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True) if c.choices)
    assert whole in ("yes", "no", "sometimes") and streamed == whole
    status, err = _post(server + "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_regex": "a("})
    assert status == 400 and "does not compile" in err["error"]["message"]


def test_tokenize_and_detokenize_over_http(server, client, reference):
    """vLLM's and llama.cpp's token endpoints: the ids of a text are the prompt tokens its
    completion counts, and back to the text."""
    text = PROMPTS[0]
    status, got = _post(server + "/tokenize", {"prompt": text})
    assert status == 200 and got["tokens"] == reference.encode(text) and got["count"] == len(got["tokens"])
    usage = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0).usage
    assert usage.prompt_tokens == got["count"]
    status, back = _post(server + "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back["content"] == text
    assert _call(server + "/tokenize", {"content": text}, key=None)[0] == 401


def test_seeded_sampling_is_reproducible(client, reference):
    """A seeded request is the target's own sample for that seed: the same over HTTP (draft and
    adaptive k in the loop) as in-process without any draft, every time."""
    kw = dict(model=MODEL, prompt="Tell me a story about a fox.", max_tokens=16, temperature=0.9, top_p=0.9, seed=1234)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234)
    assert a == b == reference.generate(kw["prompt"], params).text
    texts = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in range(4)}
    assert len(texts) > 1  # the seed is used, not ignored


def test_several_choices_over_http(client, reference):
    """``n`` seeded choices are the target's own samples for the seed, the seed + 1, ...; a batch of
    prompts streamed answers each one, its chunks tagged with its choice's index, greedy as
    target-only (up to near-ties: its sequences share batched forwards, as concurrent requests do)."""
    kw = dict(model=MODEL, prompt="Tell me a story about a fox.", max_tokens=12, temperature=0.9)
    r = client.completions.create(n=3, seed=99, **kw)
    want = [reference.generate(kw["prompt"], SamplingParams(max_tokens=12, temperature=0.9, seed=99 + j)).text for j in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == want
    assert r.usage.prompt_tokens == client.completions.create(seed=99, **kw).usage.prompt_tokens  # counted once
    prompts = PROMPTS[:3]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1, 2]
    for i, p in enumerate(prompts):
        want_p = _target_only(reference, p)
        assert texts[i] == want_p or _tie_gap(reference, p, texts[i], want_p) < 1e-3, p


def test_concurrent_greedy_equals_sequential(client, reference):
    """Eight requests at once: their verify calls share padded forwards in the target. A
    divergence is tolerated only where the target's top two logits tie (padding changes rounding);
    such positions are counted and reported."""
    want = {p: _target_only(reference, p) for p in PROMPTS}

    def one(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text

    with cf.ThreadPoolExecutor(8) as pool:
        got = dict(zip(PROMPTS, pool.map(one, PROMPTS)))
    ties = []
    for p in PROMPTS:
        if got[p] != want[p]:
            ties.append((p, _tie_gap(reference, p, got[p], want[p])))
    print(f"concurrent greedy: {len(PROMPTS) - len(ties)} of {len(PROMPTS)} identical; near-tie divergences: {ties}")
    assert all(gap < 1e-3 for _, gap in ties), ties


def _tie_gap(engine, prompt: str, got: str, want: str) -> float:
    """Gap between the target's top two logits at the first token where the two outputs part."""
    import torch

    ids = engine.tokenizer(prompt)["input_ids"]
    a, b = engine.tokenizer(want)["input_ids"], engine.tokenizer(got)["input_ids"]
    n = next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i])
    with torch.inference_mode():
        logits = engine.target.model(torch.tensor([ids + a[:n]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def test_learner_publishes_to_every_replica_while_output_stays_lossless(server, client, reference):
    """Served requests feed the learner; its rounds publish new versions to both draft replicas;
    responses report the version; greedy output stays the target's."""
    import time

    for i in range(12):
        client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS, temperature=0)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        stats = _call(f"{server}/admin/learner", key=ADMIN_KEY)[1]
        if stats["observed"] >= 12 and stats["published"] >= 1:  # records travel fire-and-forget: a round may publish first
            break
        time.sleep(2)
    assert stats["observed"] >= 12 and stats["published"] >= 1, stats
    version = stats["drafts"]["general"]["version"]
    replicas = _call(f"{server}/admin/drafts", key=ADMIN_KEY)[1]["replicas"]
    assert len(replicas) == 2
    for prompt in PROMPTS[:4]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.usage.model_extra["speculative"]["draft_version"] >= version
        assert r.choices[0].text == _target_only(reference, prompt)
    code, out, _ = _call(f"{server}/admin/learner/pause", {}, key=ADMIN_KEY)
    assert code == 200 and out["paused"]
    kept = _call(f"{server}/admin/learner", key=ADMIN_KEY)[1]["drafts"]["general"]["versions"]  # the newest 3
    older = kept[-2] if len(kept) > 1 else kept[0]  # a round in progress may still publish once (pruning kept[0])
    code, out, _ = _call(f"{server}/admin/drafts/general/rollback", {"version": older}, key=ADMIN_KEY)
    assert code == 200 and out["weights_of"] == older and out["version"] > max(kept)
    assert _call(f"{server}/admin/learner/resume", {}, key=ADMIN_KEY)[1]["paused"] is False
    assert _call(f"{server}/admin/drafts/general/rollback", {"version": 999}, key=ADMIN_KEY)[0] == 400
    assert _call(f"{server}/admin/drafts/general/rollback", {"version": 0})[0] == 403


def test_a_restarted_draft_replica_comes_back_at_the_latest_version(server):
    """Kill a draft replica: Serve starts a new one, which loads the general draft by itself (no
    request waits for that) at the learner's latest weights, and takes in the outputs the surviving
    replica keeps (the new one's suffix trees start with them)."""
    import time

    import ray
    from ray import serve

    latest = _call(f"{server}/admin/learner", key=ADMIN_KEY)[1]["drafts"]["general"]["version"]
    assert latest >= 1
    pool = serve.get_deployment_handle("DraftPool", "osd")

    def names():
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "osd#DraftPool#" in a["name"]}

    before = names()
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True) if "osd#DraftPool#" in a["name"])
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    deadline, versions, errors = time.monotonic() + 180, [], []
    while victim["name"] in names():  # gone before anything is asked of the pool
        assert time.monotonic() < deadline
        time.sleep(0.5)
    loaded: list[dict] = []
    while time.monotonic() < deadline:
        try:
            loaded = pool.broadcast("versions").results()  # nobody asks the new replica to load anything
            if len(loaded) == 2 and all("general" in v for v in loaded) and len(names() - before) == 1:
                break
        except Exception as e:  # noqa: BLE001 - the dead replica answers with an error until it is replaced
            errors.append(repr(e)[:300])
        time.sleep(2)
    assert len(loaded) == 2 and all("general" in v for v in loaded), (loaded, errors[-3:])
    assert len(names() - before) == 1, (before, names())
    # the new replica runs the latest weights; the survivor installs what it has staged since its last step
    versions = pool.broadcast("preload", "general").results()
    assert len(versions) == 2 and min(versions) >= latest, (versions, latest)
    kept = pool.broadcast("served_ids", "general").results()
    assert all(k["kept"] and set(k["kept"]) <= set(k["trees"]) for k in kept), kept


def test_a_new_draft_is_served_as_a_fork_of_the_general_drafts_published_weights(server):
    """A draft the learner has not seen (a cluster's, loaded on both replicas at once) is served
    from its first load by a fork of what the general draft has published: v1 on every replica,
    and /admin/learner says what it was forked from."""
    from ray import serve

    general = _call(f"{server}/admin/learner", key=ADMIN_KEY)[1]["drafts"]["general"]["version"]
    assert general >= 1  # the general draft has learned (the tests above)
    pool = serve.get_deployment_handle("DraftPool", "osd")
    assert pool.broadcast("preload", "c97/en").results() == [1, 1]
    fork = _call(f"{server}/admin/learner", key=ADMIN_KEY)[1]["drafts"]["c97/en"]
    assert fork["version"] == 1 and fork["forked_from"]["parent"] == "general"
    assert fork["forked_from"]["parent_version"] >= general


def test_a_finished_output_reaches_every_draft_replicas_suffix_trees(server, client):
    """The shipped config drafts with suffix trees: an output one of the two draft replicas
    finished is broadcast to the other, and both keep it under its draft id and hold it in that
    draft's suffix trees (an isolated tenant's under its own draft id only); the counter counts
    what was sent and received."""
    import time

    from ray import serve

    from .conftest import ISO_KEY, scrape

    pool = serve.get_deployment_handle("DraftPool", "osd")
    assert pool.broadcast("preload", "general").results()  # loaded on both replicas: the trees are there
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    iso = _call(f"{server}/v1/completions", {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0},
                key=ISO_KEY)[1]
    draft, iso_draft = r.usage.model_extra["speculative"]["draft_id"], iso["usage"]["speculative"]["draft_id"]
    assert iso_draft == "general@iso"
    if draft != "general":  # the router gave a busy cluster of the package's traffic a draft of its own
        assert pool.broadcast("preload", draft).results()  # its trees take in what each replica keeps of it
    deadline = time.monotonic() + 30
    while True:
        held, held_iso = pool.broadcast("served_ids", draft).results(), pool.broadcast("served_ids", iso_draft).results()
        if (len(held) == 2 and all(r.id in h["kept"] and r.id in h["trees"] for h in held)
                and all(iso["id"] in h["kept"] for h in held_iso)):
            break
        assert time.monotonic() < deadline, (r.id, held, iso["id"], held_iso)
        time.sleep(0.5)
    assert not any(iso["id"] in h["kept"] + h["trees"] for h in held)
    assert not any(r.id in h["kept"] for h in held_iso)
    shared = {dict(labels)["direction"]: v for (name, labels), v in scrape(server).items()
              if name == "osd_draft_pool_outputs_shared_total"}
    assert shared.get("sent", 0) >= 2 and shared.get("received", 0) >= 2, shared


def test_published_update_reaches_every_replica(server, reference):
    """Publish new draft weights (the truncated draft, perturbed) through the object store to every
    replica: both hold the version, responses report it, and greedy output is unchanged. An isolated
    tenant's requests are served by its own general draft whatever the router does with the shared
    traffic (a busy cluster of it gets a draft of its own, forked at the learner's version)."""
    import ray
    from ray import serve

    from drafts.build import truncated_draft

    from .conftest import ISO_KEY

    draft = truncated_draft(reference.target.model, 2)
    rng = np.random.default_rng(0)
    state = {k: v.numpy() + rng.normal(0, 1e-3, v.shape).astype(np.float32) for k, v in draft.state_dict().items()}
    ref = ray.put(state)
    pool = serve.get_deployment_handle("DraftPool", "osd")
    v, own = 10_000, "general@iso"  # above anything the learner published in this package
    assert pool.broadcast("load_weights", own, [ref], v).results() == [v, v]  # two replicas, both installed it
    for prompt in PROMPTS[:3]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        status, r, _ = _call(f"{server}/v1/completions", body, key=ISO_KEY)
        assert status == 200, r
        spec = r["usage"]["speculative"]
        assert (spec["draft_id"], spec["draft_version"]) == (own, v), spec
        assert r["choices"][0]["text"] == _target_only(reference, prompt)
    assert pool.broadcast("load_weights", own, [ref], 3).results() == [v, v]  # an older version is ignored


BAD = [
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": ["a", [1]]}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 8500}, 400, None),  # prompt + max_tokens > context
    ("completions", {"prompt": "x", "seed": True}, 400, "seed"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, None),
    ("completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("completions", {"prompt": "x", "top_k": -1}, 400, "top_k"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": "x", "stop": 7}, 400, "stop"),
    ("completions", {"prompt": [1, 2, 10**9]}, 400, None),  # a token id outside the vocabulary
    ("completions", {"prompt": [1, -5]}, 400, None),
    ("completions", {"prompt": [1, True]}, 400, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("chat/completions", {"messages": "hello"}, 400, "messages"),
    ("chat/completions", [1, 2], 400, None),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {"prompt": "x", "response_format": {"type": "yaml"}}, 400, None),
    ("completions", {"prompt": "a\ud800"}, 400, "prompt"),  # a lone surrogate (JSON allows one)
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD, ids=[f"{e}-{i}" for i, (e, *_rest) in enumerate(BAD)])
def test_bad_input_is_a_clear_4xx(server, endpoint, body, status, param):
    code, out = _post(f"{server}/v1/{endpoint}", body)
    assert code == status, out
    err = out["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert err["param"].startswith(param)


@pytest.mark.parametrize("raw", [b"not json", b"\xff\xfe", b'{"prompt": "x", "temperature": NaN}', b"",
                                 b'{"prompt": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000])
def test_malformed_bodies(server, raw):
    """Invalid JSON, invalid UTF-8 (alone and inside a string), NaN, an empty body, and JSON
    nested 100,000 deep: each a 400 in OpenAI's error shape."""
    code, out = _post(f"{server}/v1/completions", raw, raw=True)
    assert code == 400 and out["error"]["message"] and out["error"]["type"] == "invalid_request_error"


def test_a_body_past_the_size_limit_is_refused_with_413_unread(server):
    """10 MB of prompt: refused by its declared length (and, sent without one, once the limit
    is crossed), before any of it is parsed; the server goes on serving."""
    big = json.dumps({"model": MODEL, "prompt": "x" * (10 << 20), "max_tokens": 1}).encode()
    u = urlparse(server)

    def send(headers: dict, pieces) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.putrequest("POST", "/v1/completions")
        for k, v in {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **headers}.items():
            conn.putheader(k, v)
        conn.endheaders()
        try:
            for piece in pieces:
                conn.send(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the rest was sent
        resp = conn.getresponse()
        out = (resp.status, json.loads(resp.read()))
        conn.close()
        return out

    mib = [big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)]
    code, out = send({"Content-Length": str(len(big))}, mib[:2])  # refused on the declared length
    assert code == 413 and "limit" in out["error"]["message"]
    code, out = send({"Transfer-Encoding": "chunked"}, [b"%x\r\n%s\r\n" % (len(p), p) for p in mib[:3]])
    assert code == 413  # no length declared: refused once the limit is crossed
    code, out = _post(f"{server}/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert code == 200


def test_a_token_id_prompt_decodes_like_its_text(client, reference):
    """A prompt given as token ids is served like the same prompt as text (greedy: the same text)."""
    prompt = PROMPTS[1]
    ids = reference.tokenizer(prompt)["input_ids"]
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert a.choices[0].text == _target_only(reference, prompt) and a.usage.prompt_tokens == len(ids)


def test_fuzzing_the_openapi_schema_finds_no_server_error_and_restarts_no_replica(server):
    """schemathesis draws bodies from the served OpenAPI schema for the generation endpoints (80
    in all, llama-server's /completion among them), plus the read-only ones: no answer is a 5xx and every replica of every deployment
    is the one that was there before (max_tokens capped at 4 to bound the run)."""
    import ray
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    def replicas():
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA::osd#" in a["name"])

    before = replicas()
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    seen: dict[int, int] = {}
    headers = {"Authorization": f"Bearer {KEY}"}
    for path, method, n in [("/v1/completions", "POST", 30), ("/v1/chat/completions", "POST", 30),
                            ("/completion", "POST", 20), ("/v1/models", "GET", 3), ("/ready", "GET", 2)]:
        op = schema[path][method]

        @given(case=op.as_strategy())
        @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def run(case):
            if isinstance(case.body, dict):  # at most 4 tokens (a chat without max_tokens would run 256)
                case.body.setdefault("max_tokens", 4)
                for f in ("max_tokens", "max_completion_tokens"):
                    if isinstance(case.body.get(f), int) and not isinstance(case.body.get(f), bool) and case.body[f] > 4:
                        case.body[f] = 4
            r = case.call(base_url=server, headers=headers, timeout=120)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (case.body, r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert r.json()["error"]["message"]
        run()
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0, seen
    assert replicas() == before


def test_keys_and_tenant_limits(server):
    body = {"prompt": "Hi", "max_tokens": 2}
    for key in (None, "sk-wrong"):
        code, out, _ = _call(f"{server}/v1/completions", body, key=key)
        assert code == 401 and out["error"]["code"] == "invalid_api_key"
    assert _call(f"{server}/v1/models", key="sk-wrong")[0] == 401
    assert _call(f"{server}/v1/completions", body, key=TINY_KEY)[0] == 200  # one request per minute ...
    code, out, headers = _call(f"{server}/v1/completions", body, key=TINY_KEY)
    assert code == 429 and out["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert _call(f"{server}/v1/completions", body)[0] == 200  # ... for that tenant only


def test_operator_endpoint_needs_the_admin_key(server, client):
    client.completions.create(model=MODEL, prompt="Le chat est", max_tokens=4, temperature=0)
    assert _call(f"{server}/admin/drafts")[0] == 403  # a tenant key is not enough
    assert _call(f"{server}/admin/drafts", key=None)[0] == 401
    code, out, _ = _call(f"{server}/admin/drafts", key=ADMIN_KEY)
    assert code == 200 and len(out["replicas"]) == 2
    assert any("general" in r for r in out["replicas"]) and out["acceptance"]


def test_split_placement_greedy_concurrent_equals_target_only(server, reference):
    """Draft replicas calling the Target deployment once a step, the controller over suffix tree,
    prompt lookup and the feature-conditioned draft (reading the target's features across the hop):
    concurrent greedy requests (each prompt twice) equal target-only, and drafts were proposed."""
    import openai

    split = openai.OpenAI(base_url=f"{server}/split/v1", api_key=KEY, max_retries=0, timeout=120)

    def one(p):
        return split.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0)

    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, PROMPTS[:4] * 2))
    for p, r in zip(PROMPTS[:4] * 2, got):
        assert r.choices[0].text == _target_only(reference, p), p
        assert r.usage.model_extra["speculative"]["steps"] >= 1
    assert sum(r.usage.model_extra["speculative"]["proposed"] for r in got) > 0


def test_anthropics_messages_over_http_say_what_the_chat_says(server, client):
    """Anthropic's Messages API over HTTP, whole and streamed as its events, against the same chat
    on the OpenAI endpoint (greedy)."""
    messages = [{"role": "user", "content": "Name three colours."}]
    want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": messages}

    def post(b):
        req = urllib.request.Request(f"{server}/v1/messages", data=json.dumps(b).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.headers["content-type"], r.read().decode()

    kind, text = post(body)
    msg = json.loads(text)
    assert kind.startswith("application/json") and msg["type"] == "message"
    assert msg["content"][0]["text"] == want.choices[0].message.content
    assert msg["usage"] == {"input_tokens": want.usage.prompt_tokens, "output_tokens": want.usage.completion_tokens,
                            "cache_read_input_tokens": msg["usage"]["cache_read_input_tokens"]}
    kind, text = post({**body, "stream": True})
    events = [(b.split("\n")[0][7:], json.loads(b.split("\n")[1][6:])) for b in text.split("\n\n") if b]
    assert kind.startswith("text/event-stream") and events[0][0] == "message_start" and events[-1][0] == "message_stop"
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == msg["content"][0]["text"]
    assert events[-2][1]["delta"]["stop_reason"] == msg["stop_reason"]


def test_openais_responses_api_over_http_with_its_own_sdk(client):
    """The OpenAI SDK's ``responses.create``, whole and streamed, against the same chat (greedy)."""
    messages = [{"role": "user", "content": "Name three colours."}]
    want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    r = client.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=12, temperature=0)
    assert r.output_text == want.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    events = list(client.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=12, temperature=0,
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].type in ("response.completed", "response.incomplete") and events[-1].response.output_text == r.output_text
