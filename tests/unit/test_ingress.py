"""The ingress's own logic in one process: requests checked and answered in OpenAI's shapes, streams
framed, tenants' slots and tokens settled once, metrics counted, failures answered. The real
`Ingress`, `DraftPool` (co-located target), `RouterServer`, `LearnerServer` and `MetricsServer` on a
tiny Llama saved to a folder, joined by in-process handles (tests/inprocess.py); tests/serve/ runs
the same classes under Ray Serve over HTTP."""

from __future__ import annotations

import asyncio
import time
import json
import math

import pytest

from config import EngineConfig, SamplingParams
from deployments import ingress as ingress_mod
from deployments.ingress import Settle, _body_schema
from deployments.protocol import ChatRequest, TargetUnavailable
from inprocess import (ADMIN, ISO, KEY, MODEL, TINY, App, Handle, LocalPool, answer, app_config, counter, hist,
                       request, save_tiny_model)
from router.router import GENERAL
from speculative import ModelRunner, SpeculativeEngine
from speculative.locate import TextVocab
from speculative.models import load_tokenizer, load_weights


@pytest.fixture(scope="module")
def folder(tmp_path_factory, make_llama, make_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), make_llama, make_tokenizer)


@pytest.fixture
def app(folder):
    return App(app_config(folder))


_LOOP: list = []


@pytest.fixture(autouse=True)
def _loop(loop):
    """Every test here runs on the shared per-test loop (`run` below reads it)."""
    _LOOP[:] = [loop]


def run(coro):
    return _LOOP[0].run(coro)


def reference(folder: str, ids: list[int], n: int) -> list[int]:
    """Target-only greedy output of the same model (the engine without a proposer)."""
    engine = SpeculativeEngine(ModelRunner(load_weights(app_config(folder).engine.model), name="t"),
                               load_tokenizer(folder), None, EngineConfig(chat_template=False))
    return engine.generate(list(ids), SamplingParams(max_tokens=n, ignore_eos=True)).token_ids


# -- answers ---------------------------------------------------------------------------------------

def test_a_completion_is_the_target_only_greedy_text_in_openais_shape(app, folder):
    tok = load_tokenizer(folder)
    app.ingress.tenants.clock = lambda: 1000.0  # still: the token bucket does not refill meanwhile
    status, body, _ = run(app.post({"prompt": "Hello world", "max_tokens": 12, "ignore_eos": True}))
    assert status == 200
    expect = tok.decode(reference(folder, tok("Hello world")["input_ids"], 12))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": expect, "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (11, 12, 23)
    spec = usage["speculative"]
    assert spec["proposed"] > 0 and 0 <= spec["accepted"] <= spec["proposed"] and spec["draft_id"] == GENERAL
    assert spec["domain"] == app.pool.calls[0][2][0].domain and spec["draft_version"] == 0
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0
    bucket = app.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate - 23  # charged prompt + completion


def test_chat_whole_and_streamed_agree_and_streams_are_framed_as_openais(app, folder):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    _, whole, _ = run(app.post({"messages": msgs, "max_tokens": 10, "ignore_eos": True}, chat=True))
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-") and whole["model"] == MODEL
    assert whole["choices"][0]["index"] == 0 and whole["choices"][0]["message"]["content"]
    assert whole["choices"][0]["message"]["role"] == "assistant" and whole["choices"][0]["finish_reason"] == "length"
    status, events, headers = run(app.post({"messages": msgs, "max_tokens": 10, "ignore_eos": True, "stream": True,
                                            "stream_options": {"include_usage": True}}, chat=True))
    assert status == 200 and headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] and c["usage"] is None for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                        "stop_reason": None}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"] and len(chunks) >= 3
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 10 == whole["usage"]["total_tokens"]
    assert app.ingress.tenants.in_flight["alice"] == 0 and app.ingress.running == 0


def test_openai_answers_carry_llama_servers_timings_and_a_fingerprint(app):
    """As llama-server's OpenAI endpoints: ``timings`` of a single choice on the answer (streamed:
    on the usage chunk, or else on the last), and ``system_fingerprint`` on every object."""
    body = {"prompt": "Hello", "max_tokens": 6, "ignore_eos": True}
    for chat in (False, True):
        ask = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "ignore_eos": True} if chat else body
        _, whole, _ = run(app.post(ask, chat=chat))
        t, u = whole["timings"], whole["usage"]
        assert whole["system_fingerprint"].startswith("osd-serve-")
        assert t["predicted_n"] == u["completion_tokens"] == 6 and t["prompt_n"] + t["cache_n"] == u["prompt_tokens"]
        assert t["prompt_ms"] > 0 and t["predicted_ms"] >= 0
        for usage in (True, False):
            _, events, _ = run(app.post({**ask, "stream": True, "stream_options": {"include_usage": usage}}, chat=chat))
            events = [e for e in events if isinstance(e, dict)]
            timed = [e for e in events if "timings" in e]
            assert len(timed) == 1 and timed[0] is events[-1] and all(e["system_fingerprint"] == whole["system_fingerprint"] for e in events)
            assert timed[0]["timings"]["predicted_n"] == 6 and (timed[0].get("usage") is not None) == usage
        _, events, _ = run(app.post({**ask, "stream": True, "timings_per_token": True}, chat=chat))
        texts = [e for e in events if isinstance(e, dict) and e["choices"] and (e["choices"][0].get("text") or
                                                                              e["choices"][0].get("delta", {}).get("content"))]
        assert texts and all("timings" in e for e in texts)  # each chunk of text: the timings so far
        counts = [e["timings"]["predicted_n"] for e in texts]
        assert counts == sorted(counts) and 0 < counts[-1] <= events[-2]["timings"]["predicted_n"] == 6
        assert all(e["timings"]["prompt_n"] + e["timings"]["cache_n"] == u["prompt_tokens"] for e in texts)
    _, two, _ = run(app.post({**body, "n": 2}))
    assert len(two["choices"]) == 2 and "timings" not in two  # llama-server's timings are one slot's


def test_logprobs_whole_and_streamed_in_openais_shapes(app):
    """Chat's content list and the completions' columns; one entry a completion token, the top
    ones most likely first, greedy tokens the most likely; a stream's entries are the whole
    response's, spread over its chunks."""
    msgs = [{"role": "user", "content": "Hi there"}]
    body = {"messages": msgs, "max_tokens": 10, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    _, whole, _ = run(app.post(body, chat=True))
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 10
    for e in content:
        assert set(e) == {"id", "token", "logprob", "bytes", "top_logprobs"} and e["logprob"] <= 0.0
        assert e["bytes"] == list(e["token"].encode("utf-8", "replace")) and len(e["top_logprobs"]) == 3
        top = [t["logprob"] for t in e["top_logprobs"]]
        assert top == sorted(top, reverse=True) and e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]
    assert "".join(e["token"] for e in content) == whole["choices"][0]["message"]["content"]
    _, events, _ = run(app.post({**body, "stream": True}, chat=True))
    streamed = [e for c in events[:-1] if (c["choices"][0].get("logprobs") or {}).get("content") for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    _, plain, _ = run(app.post({"messages": msgs, "max_tokens": 4}, chat=True))
    assert plain["choices"][0]["logprobs"] is None  # not asked: none

    _, whole, _ = run(app.post({"prompt": "abc", "max_tokens": 6, "ignore_eos": True, "logprobs": 2}))
    lp = whole["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    assert all(len(t) <= 2 and max(t.values()) == lp["token_logprobs"][i] for i, t in enumerate(lp["top_logprobs"]))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    _, events, _ = run(app.post({"prompt": "abc", "max_tokens": 6, "ignore_eos": True, "logprobs": 2, "stream": True}))
    parts = [c["choices"][0]["logprobs"] for c in events[:-1] if c["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"] and [o for p in parts for o in p["text_offset"]] == lp["text_offset"]
    assert [v for p in parts for v in p["token_logprobs"]] == lp["token_logprobs"]
    # a chunk a token, its text that token's (the steps of k = 3 emit up to four at once)
    texts = [c["choices"][0]["text"] for c in events[:-1] if c["choices"][0]["logprobs"]]
    assert all(p["tokens"] == [t] for p, t in zip(parts, texts, strict=True))


def test_a_completion_stream_without_usage_ends_with_an_empty_text_and_done(app):
    status, events, _ = run(app.post({"prompt": "abc", "max_tokens": 6, "ignore_eos": True, "stream": True}))
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" not in c and c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                                        "stop_reason": None}
    assert all(c["choices"][0]["text"] for c in chunks[:-1])  # empty steps are not sent
    _, whole, _ = run(app.post({"prompt": "abc", "max_tokens": 6, "ignore_eos": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_a_stop_string_ends_the_text_before_it(app):
    _, whole, _ = run(app.post({"prompt": "Hello world", "max_tokens": 12, "ignore_eos": True}))
    text = whole["choices"][0]["text"]
    stop = text[4:6]
    _, body, _ = run(app.post({"prompt": "Hello world", "max_tokens": 12, "ignore_eos": True, "stop": [stop]}))
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["text"] == text[: text.index(stop)]
    assert body["choices"][0]["stop_reason"] == stop


def test_the_stop_reason_names_the_stop_string_met_first_or_the_stop_token(app, folder):
    """vLLM's ``stop_reason``: of several stop strings, the one the text meets first (whatever
    their order in the request); a stop token's id; None at max_tokens."""
    tok = load_tokenizer(folder)
    ids = reference(folder, tok("Hello world")["input_ids"], 12)
    text = tok.decode(ids)
    early, late = text[3:5], text[8:10]
    first = min((early, late), key=text.index)
    _, body, _ = run(app.post({"prompt": "Hello world", "max_tokens": 12, "ignore_eos": True, "stop": [late, early]}))
    assert body["choices"][0]["stop_reason"] == first and body["choices"][0]["text"] == text[: text.index(first)]
    status, events, _ = run(app.post({"prompt": "Hello world", "max_tokens": 12, "ignore_eos": True, "stop_token_ids": [ids[5]],
                                      "stream": True}))
    assert status == 200 and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"][0]["stop_reason"] == ids[5]
    assert all(e["choices"][0]["stop_reason"] is None for e in events[:-2])


def test_a_token_id_prompt_is_routed_as_its_text_and_answered_like_it(app, folder):
    tok = load_tokenizer(folder)
    app.ingress.tenants.clock = lambda: 1000.0  # still: a token charged would show in the bucket
    ids = tok("Hello world")["input_ids"]
    _, by_ids, _ = run(app.post({"prompt": ids, "max_tokens": 8, "ignore_eos": True}))
    _, by_text, _ = run(app.post({"prompt": "Hello world", "max_tokens": 8, "ignore_eos": True}))
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert app.pool.calls[0][2][0].prompt_ids == ids and app.pool.calls[0][2][0].prompt is None
    assert app.pool.calls[1][2][0].prompt == "Hello world" and app.pool.calls[1][2][0].prompt_ids is None
    # ids outside the vocabulary: the router sees the text of the others, the pool refuses the request
    assert app.ingress._decode([-1, *ids, 128, 10_000]) == "Hello world"
    assert app.ingress._decode([0, *ids]) == tok.decode([0, *ids])  # id 0 is in the vocabulary
    before = app.ingress.tenants.tokens["alice"].level
    status, body, _ = run(app.post({"prompt": [*ids, 128], "max_tokens": 4}))
    assert status == 400 and "outside the vocabulary" in body["error"]["message"]
    assert app.ingress.tenants.tokens["alice"].level == before  # refused: no tokens charged
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0


def test_chat_requests_reach_the_pool_as_messages_under_their_route(app):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye now"}]
    run(app.post({"messages": msgs, "max_tokens": 4, "user": "x"}, chat=True))
    name, draft_id, (gen,) = app.pool.calls[0]
    assert name == "stream" and gen.prompt is None and gen.prompt_ids is None
    assert gen.messages[0] == {"role": "system", "content": "Be brief."} and len(gen.messages) == 4
    assert gen.tenant == "alice" and gen.request_id.startswith("chatcmpl-") and gen.params.max_tokens == 4
    route = app.router.router.route("Bye now")  # the last user turn is what is routed
    assert (gen.domain, gen.lang, draft_id) == (route.domain, route.lang, route.draft_id)


def test_default_max_tokens_differ_for_completions_and_chat(folder):
    a = App(app_config(folder, ingress={"default_max_tokens": 7}))
    _, body, _ = run(a.post({"prompt": "abc", "ignore_eos": True}))
    assert body["usage"]["completion_tokens"] == ingress_mod.COMPLETION_DEFAULT_MAX_TOKENS == 16
    _, body, _ = run(a.post({"messages": [{"role": "user", "content": "abc"}], "ignore_eos": True}, chat=True))
    assert body["usage"]["completion_tokens"] == 7


# -- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, raw, status, says, param", [
    (["a list"], None, 400, "must be a JSON object", None),
    (None, b"{nope", 400, "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)", None),
    (None, b"\xff\xfe{}", 400, "not valid UTF-8", None),
    (None, b"[" * 1000 + b"]" * 1000, 400, "nested too deeply", None),
    ({"prompt": "a", "max_tokens": 0}, None, 400, "max_tokens: ", "max_tokens"),
    ({"prompt": "a", "n": 0}, None, 400, "n: ", "n"),
    ({"prompt": ["a", "b"], "n": 9}, None, 400, "the request asks for 18 choices (n = 9 for 2 prompt(s)); this server "
                                                "serves at most 16", "n"),
    ({"prompt": ["a", [65]]}, None, 400, "prompt: Value error, a batch of prompts is all strings or all lists", "prompt"),
    ({"prompt": ["a", " "]}, None, 400, "prompt: Value error, prompt is empty", "prompt"),
    ({"prompt": "a", "model": "gpt-4"}, None, 404, f"model 'gpt-4' does not exist; GET /v1/models lists '{MODEL}'", "model"),
    ({"prompt": "a", "max_tokens": 65}, None, 400, "max_tokens 65 exceeds this server's limit of 64", "max_tokens"),
    ({"prompt": "x" * 201}, None, 400, "the prompt is longer than 200 characters", None),
    ({"prompt": [65] * 201}, None, 400, "the prompt (decoded from its token ids) is longer than 200 characters", None),
])
def test_bad_requests_are_refused_with_openais_error_shape(app, body, raw, status, says, param):
    if raw is not None and len(raw) > 2048:
        pytest.skip("past the body limit: the 413 test")
    app.ingress.tenants.clock = lambda: 1000.0  # still: a token charged would show in the bucket
    got, err, _ = run(app.post(body, raw=raw))
    bucket = app.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate  # a refused request is charged no tokens
    assert got == status and says in err["error"]["message"], err
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0
    assert counter(app.ingress.meter, "osd_requests_total", tenant="alice", status=status) == 1
    assert app.pool.calls == []


def test_nesting_too_deep_within_the_size_limit(folder):
    a = App(app_config(folder, ingress={"max_body_bytes": 1 << 16}))
    got, err, _ = run(a.post(raw=b"[" * 5000 + b"]" * 5000))
    assert got == 400 and err["error"]["message"] == "the body's JSON is nested too deeply"


def test_the_model_name_may_be_given_or_left_out_and_max_tokens_may_reach_the_limit(app):
    assert run(app.post({"prompt": "a", "model": MODEL, "max_tokens": 2}))[0] == 200
    assert run(app.post({"prompt": "a", "max_tokens": 2}))[0] == 200
    assert run(app.post({"prompt": "a", "max_tokens": 64}))[0] == 200


def test_chat_prompts_count_every_messages_characters(app):
    app.ingress.tenants.clock = lambda: 1000.0  # still: a token charged would show in the bucket
    msgs = [{"role": "user", "content": "x" * 150}, {"role": "assistant", "content": "y" * 30},
            {"role": "user", "content": "z" * 20}]
    assert run(app.post({"messages": msgs, "max_tokens": 2}, chat=True))[0] == 200  # 200: at the limit
    charged = app.ingress.tenants.tokens["alice"].level
    msgs[2]["content"] += "!"
    got, err, _ = run(app.post({"messages": msgs, "max_tokens": 2}, chat=True))
    assert got == 400 and "longer than 200 characters" in err["error"]["message"]
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    got, err, _ = run(app.post({"messages": bad, "max_tokens": 2}, chat=True))
    assert got == 400 and err["error"]["message"] == "only text content parts are supported"
    assert app.ingress.tenants.tokens["alice"].level == charged  # the refusals were charged nothing


def test_a_parameter_not_served_is_a_400_naming_it_and_a_lone_surrogate_too(app):
    got, err, _ = run(app.post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "mirostat": 2}, chat=True))
    assert got == 400 and err["error"]["param"] == "mirostat" and err["error"]["message"].startswith("mirostat is not supported")
    got, err, _ = run(app.post({"prompt": "hi", "max_tokens": 2, "logit_bias": {"10000000": 5}}))
    assert got == 400 and "out of range" in err["error"]["message"]  # the replica checks ids against its vocabulary
    got, err, _ = run(app.post({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}))
    assert got == 400 and "min_tokens (3) is more than max_tokens (2)" in err["error"]["message"]
    got, err, _ = run(app.post({"prompt": "hi", "max_tokens": 2, "frequency_penalty": 0.0, "logprobs": None}))
    assert got == 200  # the defaults pass
    got, err, _ = run(app.post(raw=b'{"prompt": "a\\ud800", "max_tokens": 2}'))
    assert got == 400 and "lone surrogate" in err["error"]["message"] and err["error"]["param"] == "prompt"


def test_a_body_past_the_limit_is_refused_declared_or_sent(app):
    big = {"prompt": "a" * 3000}
    got, err, _ = run(app.post(big))
    assert got == 413 and err["error"]["message"] == "the body is larger than this server's limit of 2048 bytes"
    data = json.dumps(big).encode()
    # declared large: refused unread, whatever is sent
    got, err, _ = run(app.post(raw=b'{"prompt": "a"}', headers={"content-length": "5000"}))
    assert got == 413 and err["error"]["message"] == "the body is larger than this server's limit of 2048 bytes"
    # declared small but sent large, in parts: refused once the limit is passed
    got, err, _ = run(app.post(raw=data, headers={"content-length": "10"}, chunk=500))
    assert got == 413
    at = json.dumps({"prompt": "a" * (2048 - 14)}).encode()  # exactly the limit: read
    assert len(at) == 2048
    got, err, _ = run(app.post(raw=at))
    assert got == 400 and "longer than 200 characters" in err["error"]["message"]
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0


def test_keys_limits_and_the_answers_that_refuse_them(app):
    got, err, _ = run(app.post({"prompt": "a", "max_tokens": 2}, key="sk-wrong"))
    assert got == 401 and err["error"]["code"] == "invalid_api_key" and err["error"]["type"] == "invalid_request_error"
    assert counter(app.ingress.meter, "osd_requests_total", tenant="unauthenticated", status=401) == 1
    assert run(app.post({"prompt": "a", "max_tokens": 2}, key=TINY))[0] == 200
    got, err, headers = run(app.post({"prompt": "a", "max_tokens": 2}, key=TINY))
    assert got == 429 and err["error"]["code"] == "rate_limit_exceeded" and err["error"]["type"] == "rate_limit_error"
    wait = app.ingress.tenants.requests["tiny"].wait_for(1, app.ingress.tenants.clock())
    assert int(headers["retry-after"]) == max(1, math.ceil(wait)) and int(headers["retry-after"]) > 1
    assert counter(app.ingress.meter, "osd_requests_total", tenant="tiny", status=429) == 1
    assert app.ingress.tenants.in_flight["tiny"] == 0


def test_past_capacity_requests_are_shed_before_any_work(app):
    app.ingress.running = app.cfg.ingress.max_in_flight
    got, err, headers = run(app.post({"prompt": "a", "max_tokens": 2}))
    assert got == 503 and headers["retry-after"] == "1" and err["error"]["code"] == "server_overloaded"
    assert f"({app.cfg.ingress.max_in_flight} requests in flight)" in err["error"]["message"]
    assert counter(app.ingress.meter, "osd_requests_total", tenant="alice", status=503) == 1
    assert app.ingress.tenants.in_flight.get("alice", 0) == 0 and app.pool.calls == []
    app.ingress.running -= 1  # one below: admitted
    assert run(app.post({"prompt": "a", "max_tokens": 2}))[0] == 200
    assert app.ingress.running == app.cfg.ingress.max_in_flight - 1


# -- accounting and metrics ------------------------------------------------------------------------

def test_a_finished_request_is_counted_once_with_its_tokens_and_latencies(app):
    m = app.ingress.meter
    app.ingress.tenants.clock = lambda: 1000.0  # still: the token bucket does not refill meanwhile
    _, events, _ = run(app.post({"prompt": "Hello", "max_tokens": 9, "ignore_eos": True, "stream": True,
                                 "stream_options": {"include_usage": True}}))
    u = events[-2]["usage"]
    texts = sum(bool(e["choices"][0]["text"]) for e in events[:-2])
    assert counter(m, "osd_requests_total", tenant="alice", status=200) == 1
    assert counter(m, "osd_prompt_tokens_total", tenant="alice", status=200) == u["prompt_tokens"] == 5
    assert counter(m, "osd_generation_tokens_total", tenant="alice", status=200) == 9
    assert hist(m, "osd_time_to_first_token_seconds", tenant="alice")[0] == 1
    # one gap per later chunk with text (a step can emit no text: an EOS, ignored, decodes to nothing)
    assert hist(m, "osd_inter_token_latency_seconds", tenant="alice")[0] == texts - 1 and texts >= 3
    n, total = hist(m, "osd_time_per_output_token_seconds", tenant="alice")
    e2e_n, e2e = hist(m, "osd_e2e_request_latency_seconds", tenant="alice")
    ttft = hist(m, "osd_time_to_first_token_seconds", tenant="alice")[1]
    # one clock reading ends both: per output token after the first = (e2e - ttft) / (tokens - 1)
    assert n == 1 and e2e_n == 1 and 0 < ttft < e2e and total == pytest.approx((e2e - ttft) / 8, rel=1e-6)
    gaps = hist(m, "osd_inter_token_latency_seconds", tenant="alice")[1]
    assert 0 < gaps < e2e - ttft  # the gaps between chunks lie between the first chunk and the end
    assert hist(m, "osd_router_latency_seconds")[0] == 1 and 0 < hist(m, "osd_router_latency_seconds")[1] < ttft
    route = app.pool.calls[0]
    assert counter(m, "osd_routes_total", reason="cluster", domain=route[2][0].domain) == 1
    # the tenant's tokens were charged: prompt + completion
    bucket = app.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate - 14 and app.ingress.tenants.in_flight["alice"] == 0


def test_a_one_token_answer_has_no_time_per_output_token_and_a_two_token_one_has(app):
    run(app.post({"prompt": "Hello", "max_tokens": 1, "ignore_eos": True}))
    assert hist(app.ingress.meter, "osd_time_per_output_token_seconds", tenant="alice")[0] == 0
    assert hist(app.ingress.meter, "osd_e2e_request_latency_seconds", tenant="alice")[0] == 1
    run(app.post({"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}))
    assert hist(app.ingress.meter, "osd_time_per_output_token_seconds", tenant="alice")[0] == 1


@pytest.mark.parametrize("wait, header", [(0.0, "1"), (0.2, "1"), (1.0, "1"), (2.5, "3")])
def test_a_429_says_when_to_retry_in_whole_seconds_at_least_one(wait, header):
    from deployments.tenants import Admission

    resp = ingress_mod._refused(Admission("t", False, 429, "slow down", wait))
    assert resp.status_code == 429 and resp.headers["retry-after"] == header


def test_the_router_learns_each_answers_acceptance(app):
    seen = []
    app.router.observe = lambda route, accepted, proposed: seen.append((route.draft_id, accepted, proposed))
    _, body, _ = run(app.post({"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}))
    _, events, _ = run(app.post({"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True}))
    spec = body["usage"]["speculative"]
    assert seen == [(GENERAL, spec["accepted"], spec["proposed"])] * 2 and spec["proposed"] > 0


def test_an_isolated_tenant_gets_a_draft_of_its_own_and_the_router_does_not_learn_from_it(app):
    seen = []
    app.router.observe = lambda *a: seen.append(a)
    _, body, _ = run(app.post({"prompt": "Hello", "max_tokens": 4}, key=ISO))
    assert app.pool.calls[0][1] == f"{GENERAL}@iso" and body["usage"]["speculative"]["draft_id"] == f"{GENERAL}@iso"
    assert seen == []
    run(app.post({"prompt": "Hello", "max_tokens": 4}))
    assert app.pool.calls[1][1] == GENERAL and len(seen) == 1


def test_an_isolated_tenant_gets_nothing_another_tenants_traffic_taught_and_sees_no_cluster(folder):
    """Suffix trees: alice's output of a prompt, served twice, teaches the shared draft's tree (her
    second answer is drafted from her first); an isolated tenant sending that prompt afterwards is
    drafted exactly as on a fresh server (its own engine, trees and k priors, nothing of alice's), and
    its usage names its own draft and no router cluster, while alice's names hers."""
    cfg = app_config(folder, engine={"draft": {"proposers": ["suffix"]}})
    body = {"prompt": "Hello world, tell me", "max_tokens": 24, "ignore_eos": True}

    def spec(b):
        s = b["usage"]["speculative"]
        return s["proposed"], s["accepted"], s["steps"]

    fresh = App(cfg)
    _, alone, _ = run(fresh.post(body, key=ISO))
    shared = App(cfg)
    _, first, _ = run(shared.post(body))
    _, again, _ = run(shared.post(body))
    assert spec(again)[1] > spec(first)[1]  # the shared tree learned alice's output
    clusters = set(shared.router.router.summary()["clusters"])
    assert first["usage"]["speculative"]["domain"] in clusters  # alice's usage names her cluster
    t = shared.router.router.t
    _, iso, _ = run(shared.post(body, key=ISO))
    assert iso["choices"][0]["text"] == again["choices"][0]["text"]  # the same text (lossless)
    assert spec(iso) == spec(alone)  # drafted as with nobody else's traffic
    s = iso["usage"]["speculative"]
    assert s["draft_id"] == f"{GENERAL}@iso" and s["domain"] == "unknown"
    assert not any(c in json.dumps(iso) for c in clusters) and s["domain"] not in clusters
    assert shared.router.router.t == t and set(shared.router.router.summary()["clusters"]) == clusters
    pool = shared.pools[0]
    assert pool.held[f"{GENERAL}@iso"] is not pool.held[GENERAL]  # its own engine: trees and k priors
    assert [item[3] for item in pool.outputs.served[GENERAL]] == ["alice", "alice"]
    assert [item[3] for item in pool.outputs.served[f"{GENERAL}@iso"]] == ["iso"]


def test_deleting_a_tenants_records_reaches_every_pool_replicas_kept_outputs_and_suffix_trees(folder):
    """``DELETE /admin/tenants/{tenant}/records`` (admin key; a tenant's key is refused) is
    broadcast to every draft pool replica: the tenant's outputs leave their kept outputs and the
    trees of their loaded engines, other tenants' stay; without a learner too."""
    cfg = app_config(folder, engine={"draft": {"proposers": ["suffix"]}})
    pools = [LocalPool(cfg), LocalPool(cfg)]
    a = App(cfg, pools=pools)
    for p in pools:
        run(p.loaded(GENERAL))
    body = {"prompt": "Hello world", "max_tokens": 8, "ignore_eos": True}
    for key in (KEY, ADMIN, KEY):  # alice, ops, alice: on the two replicas in turn
        assert run(a.post(body, key=key))[0] == 200
    owners = {rid: t for p in pools for rid, t in p.outputs.owners.items()}
    assert sorted(owners.values()) == ["alice", "alice", "ops"]
    assert run(answer(run(a.ingress.delete_tenant(request(key=KEY), "alice"))))[0] == 403
    status, out, _ = run(answer(run(a.ingress.delete_tenant(request(key=ADMIN), "alice"))))
    assert status == 200 and out == {"tenant": "alice", "pool": {"replicas": 2, "kept": 2, "trees": 2, "prefixes": 0}}
    ops = [rid for rid, t in owners.items() if t == "ops"]
    left = [run(p.served_ids(GENERAL)) for p in pools]
    assert sorted(r for x in left for r in x["trees"]) == ops and sorted(r for x in left for r in x["kept"]) == ops


def test_running_is_a_gauge_in_the_telemetry(app):
    app.ingress.running = 3
    snap = app.ingress.telemetry()
    assert snap["gauges"][("osd_requests_running", ())] == 3 and snap["source"] == "Ingress"


def test_settle_runs_once():
    calls = []
    s = Settle(lambda *a: calls.append(a))
    s(3, 200, None)
    s(0, 499, None)
    assert calls == [(3, 200, None)] and s.settled


@pytest.mark.parametrize("n", [1, 3])
def test_a_stream_dropped_before_it_ran_settles_as_499_and_cancels_its_sequences(app, n):
    app.ingress.tenants.clock = lambda: 1000.0

    async def go():
        resp = await app.ingress.completion(request({"prompt": "Hi", "max_tokens": 4, "stream": True, "n": n}, KEY),
                                            chat=False)
        assert app.ingress.running == n and app.ingress.tenants.in_flight["alice"] == n
        assert len(app.pool.streams) == n and not any(s.cancelled for s in app.pool.streams)
        del resp  # the client left before the first byte
        import gc

        gc.collect()
        assert all(s.cancelled for s in app.pool.streams)
    run(go())
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0
    assert counter(app.ingress.meter, "osd_requests_total", tenant="alice", status=499) == 1
    bucket = app.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate  # nothing was generated: no tokens charged


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_leaving_mid_stream_is_a_499_and_ends_the_decoding(app, n):
    app.ingress.tenants.clock = lambda: 1000.0

    async def go():
        resp = await app.ingress.completion(request({"prompt": "Hi", "max_tokens": 30, "ignore_eos": True,
                                                     "stream": True, "n": n}, KEY), chat=False)
        it = resp.body_iterator
        await it.__anext__()
        await it.__anext__()
        await it.aclose()
        for _ in range(5):
            await asyncio.sleep(0)
    run(go())
    assert counter(app.ingress.meter, "osd_requests_total", tenant="alice", status=499) == 1
    assert counter(app.ingress.meter, "osd_requests_total", tenant="alice", status=200) == 0
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0
    pool = app.pools[0]
    for _ in range(1000):  # the engine loop drops it at its next step boundary (running first, then its KV)
        if not pool.loop.running and pool.loop.reserved == 0 and all(not e.requests for e in pool.held.values()):
            break
        time.sleep(0.01)
    assert pool.running == 0 and not pool.loop.running and all(not e.requests for e in pool.held.values())
    assert pool.loop.reserved == 0
    bucket = app.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate  # it never got its usage: nothing charged


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("when", ["opening", "decoding"])
def test_a_whole_request_whose_client_leaves_is_a_499_and_ends_its_sequences(app, n, when):
    """The request's task is cancelled (the client went away before the answer), while its
    sequences are being opened or while they decode: counted as 499, nothing charged, its slots
    freed and every sequence it opened cancelled."""
    app.ingress.tenants.clock = lambda: 1000.0

    async def go():
        body = {"prompt": "Hi", "max_tokens": 30, "ignore_eos": True, "n": n}
        task = asyncio.ensure_future(app.ingress.completion(request(body, KEY), chat=False))
        while len(app.pool.streams) < n or (when == "decoding" and app.pools[0].running < n):
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(go())
    assert counter(app.ingress.meter, "osd_requests_total", tenant="alice", status=499) == 1
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0
    assert all(s.cancelled for s in app.pool.streams)
    bucket = app.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate


def test_a_request_the_engine_replica_cannot_queue_is_a_503_with_retry_after(folder):
    """One request runs at a time and none may wait: of two at once, one is served whole and the
    other is answered 503 with Retry-After (retry later), and the replica's budget returns to zero."""
    app = App(app_config(folder, loop={"max_running": 1, "max_waiting": 0}))

    async def both():
        body = {"prompt": "Hello world", "max_tokens": 30, "ignore_eos": True, "temperature": 0}
        return await asyncio.gather(*(app.post(body) for _ in range(2)))
    answers = run(both())
    assert sorted(status for status, _, _ in answers) == [200, 503]
    _, body, headers = next(a for a in answers if a[0] == 503)
    assert body["error"]["code"] == "overloaded" and int(headers["retry-after"]) >= 1
    _, ok, _ = next(a for a in answers if a[0] == 200)
    assert ok["usage"]["completion_tokens"] == 30
    assert app.pools[0].loop.reserved == 0
    assert counter(app.pools[0].meter, "osd_engine_requests_overloaded_total") == 1


# -- failures --------------------------------------------------------------------------------------

def test_a_replica_dying_mid_stream_is_resumed_on_another_and_the_text_is_unchanged(folder):
    cfg = app_config(folder)
    a = App(cfg, pools=[LocalPool(cfg, fail_after=3), LocalPool(cfg)])
    b = App(cfg)
    _, whole, _ = run(b.post({"prompt": "Hello world", "max_tokens": 14, "ignore_eos": True}))
    _, body, _ = run(a.post({"prompt": "Hello world", "max_tokens": 14, "ignore_eos": True}))
    assert body["choices"] == whole["choices"]
    (_, first), (_, second) = a.pools[0].requests[0], a.pools[1].requests[0]
    assert second.request_id == first.request_id + "-r1" and len(second.resume) >= 3
    assert body["usage"]["speculative"]["resumed_after"] == len(second.resume)
    assert counter(a.ingress.meter, "osd_requests_resumed_total", tenant="alice") == 1
    assert a.ingress.running == 0 and a.ingress.tenants.in_flight["alice"] == 0


def _llama_chunks(app) -> list:
    """llama-server's stream of a greedy request: each chunk's text, ids and log-probability ids."""
    body = {"prompt": "Hello world", "n_predict": 14, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_tokens": True, "n_probs": 1}
    _, events, _ = run(app.post(body, llama=True))
    return [(e["content"], e["tokens"], [p["id"] for p in e["completion_probabilities"]]) for e in events[:-1]]


def test_a_resumed_stream_sends_the_chunks_an_unbroken_one_does_a_token_each(folder):
    """llama-server's stream (a chunk a token, with its ids): the replica dies after three steps and
    another goes on; the client sees the same chunks as from a replica that never died."""
    cfg = app_config(folder)
    a = App(cfg, pools=[LocalPool(cfg, fail_after=3), LocalPool(cfg)])
    whole, resumed = _llama_chunks(App(cfg)), _llama_chunks(a)
    assert len(a.pools[1].requests) == 1 and len(a.pools[1].requests[0][1].resume) >= 3  # it did resume
    assert resumed == whole and len(whole) == 14
    assert all(len(toks) == 1 and ids == toks for _, toks, ids in whole)


def test_steps_sent_together_a_stream_interval_still_reach_the_client_a_token_a_chunk(folder):
    cfg = app_config(folder, drafts={"stream_interval_s": 0.05})
    assert _llama_chunks(App(cfg)) == _llama_chunks(App(app_config(folder)))


def test_the_target_gone_is_a_retryable_503_whole_or_streamed(folder):
    cfg = app_config(folder)
    gone = TargetUnavailable("the target model is restarting; retry the request")
    a = App(cfg, pools=[LocalPool(cfg, fail_after=1, fail_with=gone), LocalPool(cfg, fail_after=1, fail_with=gone)])
    a.ingress.tenants.clock = lambda: 1000.0
    got, err, headers = run(a.post({"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}))
    assert got == 503 and headers["retry-after"] == str(TargetUnavailable.retry_after_s)
    assert err["error"] == {"message": str(gone), "type": "server_error", "param": None, "code": "target_unavailable"}
    assert counter(a.ingress.meter, "osd_requests_total", tenant="alice", status=503) == 1
    got, events, _ = run(a.post({"prompt": "Hi", "max_tokens": 8, "ignore_eos": True, "stream": True}))
    assert got == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "target_unavailable"
    assert counter(a.ingress.meter, "osd_requests_total", tenant="alice", status=503) == 2
    assert a.ingress.running == 0 and a.ingress.tenants.in_flight["alice"] == 0
    bucket = a.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate  # no tokens charged for what the target never answered


@pytest.mark.parametrize("n", [1, 2])
def test_a_request_that_fails_otherwise_is_a_500_in_openais_shape_whole_or_streamed(folder, n):
    """Of several choices one fails (once): the request fails, and the others end with it."""
    cfg = app_config(folder)
    a = App(cfg, pools=[LocalPool(cfg, fail_after=1, fail_with=RuntimeError("boom"))])
    a.ingress.tenants.clock = lambda: 1000.0  # still: a token charged would show in the bucket
    pool = a.pools[0]

    def ended() -> bool:
        def gone() -> bool:  # (the loop's thread takes a sequence out of running before it gives its KV back)
            return not pool.loop.running and pool.loop.reserved == 0 and all(not e.requests for e in pool.held.values())
        for _ in range(1000):  # the engine loop drops them at its next step boundary
            if gone():
                break
            time.sleep(0.01)
        return gone()

    body = {"prompt": "Hi", "max_tokens": 30, "ignore_eos": True, "n": n}
    got, events, _ = run(a.post({**body, "stream": True}))
    assert got == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "generation failed: boom" and events[-2]["error"]["type"] == "server_error"
    assert counter(a.ingress.meter, "osd_requests_total", tenant="alice", status=500) == 1
    assert a.ingress.running == 0 and a.ingress.tenants.in_flight["alice"] == 0 and ended()
    assert all(s.cancelled for s in a.pool.streams)
    pool.fail_after, pool.fail_with = 1, RuntimeError("boom")

    async def whole():
        answer = await a.post(body)  # whole: a 500 in OpenAI's shape
        await asyncio.sleep(0)
        return answer, [t for t in asyncio.all_tasks() if "collect" in repr(t.get_coro()) and not t.done()]
    (got, err, _), left = run(whole())
    assert got == 500 and err["error"]["type"] == "server_error" and "RuntimeError" in err["error"]["message"]
    assert a.ingress.running == 0 and a.ingress.tenants.in_flight["alice"] == 0 and ended()
    assert all(s.cancelled for s in a.pool.streams) and left == []  # no choice's reader left behind
    assert counter(a.ingress.meter, "osd_requests_total", tenant="alice", status=500) == 2
    bucket = a.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate  # a failed request is charged no tokens


def test_the_target_gone_is_recognised_bare_or_wrapped():
    gone = TargetUnavailable("x")

    class Wrapped(Exception):
        cause = gone
    assert ingress_mod._target_gone(gone) and ingress_mod._target_gone(Wrapped())
    assert not ingress_mod._target_gone(RuntimeError("x"))
    assert ingress_mod._unavailable_body(Wrapped())["error"]["message"] == "x"


# -- health, models, operators ---------------------------------------------------------------------

def test_ready_names_the_part_that_does_not_answer(app):
    status, body, _ = run(answer_of(app.ingress.ready()))
    assert (status, body) == (200, {"status": "ready"})

    async def never():
        await asyncio.sleep(10)
    app.router.summary = never
    app.ingress.recent.clear()  # each case below asks anew (an answer is kept for a second)
    status, body, headers = run(answer_of(app.ingress.ready(timeout_s=0.05)))
    assert status == 503 and headers["retry-after"] == "5" and body["error"]["code"] == "not_ready"
    assert body["error"]["message"] == "router not ready: no answer within 0 s"
    del app.router.summary

    def broken(timeout_s=3.0):
        raise RuntimeError("pool down")
    app.pools[0].ready = broken
    app.ingress.recent.clear()
    status, body, _ = run(answer_of(app.ingress.ready()))
    assert status == 503 and body["error"]["message"] == "draft pool or target not ready: pool down"


def test_ready_and_stats_reach_the_replicas_at_most_once_a_second(folder):
    """Many ``/ready`` and ``/v1/stats`` calls at once and in a row: each fans out to the replicas
    once per second (per caller's scope for stats); a second later they ask again."""
    a = App(app_config(folder), metrics=True)
    now = [100.0]
    a.ingress.recent.clock = lambda: now[0]
    calls = {"summary": 0, "ready": 0, "stats": 0}

    def counting(obj, name):
        real = getattr(obj, name)

        def call(*args, **kw):
            calls[name] += 1
            return real(*args, **kw)
        setattr(obj, name, call)
    counting(a.router, "summary")
    counting(a.pools[0], "ready")
    counting(a.metrics, "stats")

    async def many():
        readies = await asyncio.gather(*(answer_of(a.ingress.ready()) for _ in range(20)))
        stats = await asyncio.gather(*(a.ingress.stats(request(None, key)) for key in [ADMIN] * 10 + [KEY] * 10))
        return readies, stats
    readies, stats = run(many())
    assert {r[0] for r in readies} == {200} and calls["summary"] == 1 and calls["ready"] == 1
    assert calls["stats"] == 2  # the admin's view and alice's, once each
    assert stats[0] == stats[9] and stats[10] == stats[19]
    now[0] += 0.5
    run(answer_of(a.ingress.ready()))
    run(a.ingress.stats(request(None, KEY)))
    assert (calls["summary"], calls["stats"]) == (1, 2)
    now[0] += 0.6  # past a second: asked again
    run(answer_of(a.ingress.ready()))
    run(a.ingress.stats(request(None, KEY)))
    assert (calls["summary"], calls["ready"], calls["stats"]) == (2, 2, 3)


async def answer_of(coro):
    return await answer(await coro)


def test_models_lists_the_served_name_and_the_models_sizes(app, folder):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    assert app.ingress.models() == {"object": "list", "data": [{
        "id": MODEL, "object": "model", "created": 0, "owned_by": "osd-serve",
        "meta": {"n_vocab": cfg.vocab_size, "n_ctx_train": cfg.max_position_embeddings, "n_embd": cfg.hidden_size}}]}


def test_operator_endpoints_need_the_admin_key(app):
    for key, status in ((None, 401), (KEY, 403)):
        got, err, _ = run(answer_of(app.ingress.drafts(request(key=key))))
        assert got == status, key
    assert err["error"]["code"] == "forbidden" and err["error"]["message"] == "this endpoint needs the admin key"
    run(app.post({"prompt": "Hello", "max_tokens": 4}))
    got, body, _ = run(answer_of(app.ingress.drafts(request(key=ADMIN))))
    assert got == 200 and body["replicas"] == [{GENERAL: 0}]
    assert set(body) == {"replicas", "acceptance", "drafts", "clusters"}
    assert body["acceptance"] == app.router.router.summary()["acceptance"] != {}


def test_an_open_server_lets_anyone_operate(folder):
    a = App(app_config(folder, auth={"keys": []}))
    assert a.ingress.tenants.open
    assert run(answer_of(a.ingress.drafts(request())))[0] == 200
    got, err, _ = run(answer_of(a.ingress.learner_call(request(), "stats")))
    assert got == 404 and err["error"]["message"] == "this application runs without a learner"


def test_a_stop_string_too_long_and_a_number_too_long_are_400s(folder):
    app = App(app_config(folder, ingress={"max_body_bytes": 8192}))
    status, body, _ = run(app.post({"prompt": "Hi", "max_tokens": 4, "stop": ["x" * 257]}))
    assert status == 400 and "at most 256 characters" in body["error"]["message"] and body["error"]["param"] == "stop"
    status, body, _ = run(app.post(raw=b'{"prompt": "Hi", "seed": ' + b"9" * 4400 + b"}"))
    assert status == 400 and "number too long" in body["error"]["message"]


def test_an_ingress_without_keys_behind_a_public_host_refuses_to_start(folder):
    """Serve's HTTP host beyond loopback and no key: the ingress does not start (its message says
    how to set keys) unless ``auth.allow_open``; with keys, or on loopback, it starts."""
    from deployments.ingress import Ingress
    from deployments.tenants import OpenServerError

    open_cfg = app_config(folder, auth={"keys": []})
    with pytest.raises(OpenServerError, match="refusing to start without API keys while Serve's HTTP host is '0.0.0.0'.*"
                                              "OSD_API_KEYS"):
        Ingress(open_cfg, None, None, http_host="0.0.0.0")
    assert Ingress(open_cfg, None, None, http_host="127.0.0.1").tenants.open
    assert Ingress(app_config(folder, auth={"keys": [], "allow_open": True}), None, None, http_host="0.0.0.0").tenants.open
    assert not Ingress(app_config(folder), None, None, http_host="0.0.0.0").tenants.open


def test_osd_serve_says_the_server_is_open_only_when_it_is(monkeypatch):
    from deployments.launch import examples

    said = examples("http://127.0.0.1:8000", MODEL, open_=True)
    assert "No API keys are configured" in said and "api_key='none'" in said
    said = examples("http://127.0.0.1:8000", MODEL, open_=False)
    assert "No API keys" not in said and "Authorization: Bearer $OSD_KEY" in said


def test_metrics_and_stats(folder):
    a = App(app_config(folder), metrics=True)
    got, _, _ = run(answer_of(a.ingress.prometheus(request(key=KEY))))
    assert got == 403
    run(a.post({"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}))
    run(a.post({"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}, key=ISO))
    resp = run(a.ingress.prometheus(request(key=ADMIN)))
    assert resp.media_type.startswith("text/plain; version=0.0.4")
    text = resp.body.decode()
    assert 'osd_requests_total{status="200",tenant="alice"} 1.0' in text or 'osd_requests_total{tenant="alice",status="200"} 1.0' in text
    # a tenant sees its own figures only, whatever it asks for, and no operator's view
    got, mine, _ = run(answer_of(a.ingress.stats(request(key=KEY, query="tenant=iso"))))
    assert got == 200 and mine["scope"] == "alice" and "running" not in mine and "events" not in mine
    assert mine["totals"]["requests"] == 1 and mine["totals"]["generation_tokens"] == 5
    got, theirs, _ = run(answer_of(a.ingress.stats(request(key=ADMIN, query="tenant=iso"))))
    assert theirs["scope"] == "iso" and theirs["totals"]["generation_tokens"] == 3 and "running" in theirs
    got, every, _ = run(answer_of(a.ingress.stats(request(key=ADMIN))))
    assert every["scope"] == "all" and every["totals"]["generation_tokens"] == 8 and every["totals"]["requests"] == 2
    assert run(answer_of(a.ingress.stats(request(key="sk-wrong"))))[0] == 401
    b = App(app_config(folder))  # metrics off
    for call in (b.ingress.prometheus, b.ingress.stats):
        got, err, _ = run(answer_of(call(request(key=ADMIN))))
        assert got == 404 and "metrics are disabled" in err["error"]["message"]


def test_dashboard_files(app):
    assert run(answer(app.ingress.dashboard_file("../serve_config.yaml")))[0] == 404
    resp = app.ingress.dashboard_file("dashboard.js")
    assert resp.media_type == "text/javascript" and str(resp.path).endswith("static/dashboard.js")


def test_the_openapi_body_schema_inlines_its_definitions():
    schema = _body_schema(ChatRequest)["requestBody"]
    assert schema["required"] is True
    body = schema["content"]["application/json"]["schema"]
    assert "$defs" not in json.dumps(body) and "$ref" not in json.dumps(body)
    assert set(body["properties"]["messages"]["items"]["properties"]) >= {"role", "content"}


# -- the learner behind the operator endpoints -----------------------------------------------------

@pytest.fixture
def learning(folder, tmp_path):
    """The app with its learner: records from the pool, rounds every 2 records, updates published
    into the pool (a gate that takes any finite update: the path is tested here, not the gate)."""
    from deployments.learner import LearnerServer

    cfg = app_config(folder, learner={"enabled": True, "state_dir": str(tmp_path / "learner"),
                                      "trainer": {"train_every": 2, "batch_records": 2, "steps_per_round": 1,
                                                  "gate_margin": 1.0, "holdout_fraction": 0.0},
                                      "background": {"nice": 0, "threads": 1}})
    pool_box: list = []
    server = LearnerServer(cfg, publish=lambda d, state, v: pool_box[0].load_weights(d, [state], v))
    pools = [LocalPool(cfg, learner=Handle(server))]
    pool_box.append(pools[0])
    a = App(cfg, pools=pools, learner=server)
    yield a
    server.background.stop()


def test_records_reach_the_learner_and_its_updates_reach_the_pool(learning):
    import time

    for i in range(4):
        run(learning.post({"prompt": f"Hello {i}", "max_tokens": 8, "ignore_eos": True}))
    deadline = time.monotonic() + 60
    while learning.pools[0].published.version(GENERAL) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert learning.pools[0].published.version(GENERAL) >= 1
    _, body, _ = run(learning.post({"prompt": "Hello again", "max_tokens": 8, "ignore_eos": True}))
    assert body["usage"]["speculative"]["draft_version"] >= 1  # installed before the next step
    got, stats, _ = run(answer_of(learning.ingress.learner_call(request(key=ADMIN), "stats")))
    assert got == 200 and stats["drafts"][GENERAL]["version"] >= 1
    assert run(answer_of(learning.ingress.learner_call(request(key=KEY), "stats")))[0] == 403


def test_learner_operator_calls_check_their_bodies(learning):
    ing = learning.ingress
    cases = [
        (ing.rollback(request(raw=b"{", key=ADMIN), GENERAL), 400, "not valid JSON"),
        (ing.rollback(request([3], key=ADMIN), GENERAL), 400, 'the body must be {"version": <int>}'),
        (ing.rollback(request({"version": True}, key=ADMIN), GENERAL), 400, 'the body must be {"version": <int>}'),
        (ing.rollback(request({"version": "1"}, key=ADMIN), GENERAL), 400, 'the body must be {"version": <int>}'),
        (ing.rollback(request({"version": 7}, key=ADMIN), GENERAL), 400, f"draft {GENERAL!r} has no checkpoint v7"),
        (ing.rollback(request({"version": 7}, key=KEY), GENERAL), 403, "needs the admin key"),
        (ing.configure_learner(request({}, key=ADMIN)), 400, "the body must be a JSON object of settings"),
        (ing.configure_learner(request([1], key=ADMIN)), 400, "the body must be a JSON object of settings"),
        (ing.configure_learner(request(raw=b"\xff", key=ADMIN)), 400, "not valid UTF-8"),
        (ing.configure_learner(request({"bogus": 1}, key=ADMIN)), 400, "not tunable: bogus"),
        (ing.configure_learner(request({"lr": -1}, key=ADMIN)), 400, "lr: Input should be greater than 0"),
    ]
    for coro, status, says in cases:
        got, err, _ = run(answer_of(coro))
        assert got == status and says in err["error"]["message"], (status, says, err)
    got, body, _ = run(answer_of(ing.configure_learner(request({"lr": 0.0005}, key=ADMIN))))
    assert got == 200 and body["lr"] == 0.0005
    got, body, _ = run(answer_of(ing.learner_call(request(key=ADMIN), "delete_tenant", "alice")))
    assert got == 200 and body["tenant"] == "alice"


def test_an_operators_call_the_learner_cannot_take_in_time_is_a_503_that_says_why(folder, tmp_path):
    """A round whose publish does not return holds the learner thread: a rollback waits
    ``learner.operator_wait_s``, then answers 503 (retryable, with Retry-After) saying what the thread
    is doing; once the publish returns, the rollback goes through."""
    import threading

    from deployments.learner import LearnerServer

    cfg = app_config(folder, learner={"enabled": True, "state_dir": str(tmp_path / "learner"), "operator_wait_s": 0.5,
                                      "trainer": {"train_every": 2, "batch_records": 2, "steps_per_round": 1,
                                                  "gate_margin": 1.0, "holdout_fraction": 0.0},
                                      "background": {"nice": 0, "threads": 1}})
    entered, release = threading.Event(), threading.Event()

    def stuck(draft_id, state, version):
        entered.set()
        release.wait(60)

    server = LearnerServer(cfg, publish=stuck)
    a = App(cfg, pools=[LocalPool(cfg, learner=Handle(server))], learner=server)
    try:
        for i in range(2):
            run(a.post({"prompt": f"Hello {i}", "max_tokens": 8, "ignore_eos": True}))
        assert entered.wait(60)
        t0 = time.monotonic()
        got, err, headers = run(answer_of(a.ingress.rollback(request({"version": 0}, key=ADMIN), GENERAL)))
        assert got == 503 and err["error"]["code"] == "learner_busy" and headers["retry-after"] == "10"
        assert "a round, its gate and its publish" in err["error"]["message"] and 0.5 <= time.monotonic() - t0 < 10
        release.set()
        got, body, _ = run(answer_of(a.ingress.rollback(request({"version": 0}, key=ADMIN), GENERAL)))
        assert got == 200 and body["weights_of"] == 0, body
    finally:
        release.set()
        server.background.stop()


def test_an_unexpected_learner_error_is_not_turned_into_a_400(learning):
    def broken():
        raise KeyError("x")
    learning.learner.stats = broken
    with pytest.raises(KeyError):
        run(learning.ingress.learner_call(request(key=ADMIN), "stats"))


def test_named_domains_are_served_by_drafts_of_their_own_from_their_checkpoints(folder, tmp_path, make_llama):
    """``router: {mode: both, examples}`` and ``draft.domain_checkpoints``: a SQL request over the
    app is served by d-sql, built from sql's saved draft; a math request by d-math, which has no
    saved draft and starts from the configured one; the output is the target's either way."""
    import torch

    from inprocess import domain_engine, save_domain_draft
    from workloads import WorkloadRecord, save_workload

    recs = [WorkloadRecord(f"SELECT col{i} FROM table{i} WHERE id = {i}", "sql", "en", "spider") for i in range(8)]
    recs += [WorkloadRecord(f"What is {i} plus {i + 3}? Show the steps.", "math", "en", "gsm8k") for i in range(8)]
    save_workload(recs, tmp_path / "ex.jsonl")
    keep = save_domain_draft(tmp_path / "sql", make_llama)
    a = App(app_config(folder, router={"mode": "both", "examples": str(tmp_path / "ex.jsonl"), "classifier": {"background": False}},
                       engine=domain_engine(folder, {"sql": str(tmp_path / "sql")})))
    tok = load_tokenizer(folder)
    for prompt, draft_id, layers, ids in (("SELECT name FROM users WHERE id = 3", "d-sql", 1, keep),
                                          ("What is 5 plus 8? Show the steps.", "d-math", 2, None)):
        status, body, _ = run(a.post({"prompt": prompt, "max_tokens": 8, "ignore_eos": True}))
        assert status == 200 and body["usage"]["speculative"]["draft_id"] == draft_id, body["usage"]
        assert body["choices"][0]["text"] == tok.decode(reference(folder, tok(prompt)["input_ids"], 8))
        runner = a.pools[0].held[draft_id].learned_draft.runner
        assert len(runner.model.model.layers) == layers
        assert (runner.vocab_map is None) if ids is None else torch.equal(runner.vocab_map, ids)
    assert set(a.router.router.drafts) == {GENERAL, "d-sql", "d-math"}


def test_tokenize_and_detokenize_read_text_as_a_completion_does(app, folder):
    tok = load_tokenizer(folder)
    text = "Hello world, tokens!"

    async def call(route, body, key=KEY):
        return await answer(await getattr(app.ingress, route)(request(body, key)))

    status, body, _ = run(call("tokenize", {"prompt": text}))
    assert status == 200 and body == {"tokens": tok(text)["input_ids"], "count": len(tok(text)["input_ids"])}
    status, same, _ = run(call("tokenize", {"content": text, "add_special_tokens": False}))  # llama.cpp's name
    assert status == 200 and same["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    status, back, _ = run(call("detokenize", {"tokens": body["tokens"]}))
    assert status == 200 and back["prompt"] == back["content"] == tok.decode(body["tokens"])
    # the completion of those ids is the completion of the text
    by_ids = run(app.post({"prompt": body["tokens"], "max_tokens": 6}))[1]["choices"][0]["text"]
    assert by_ids == run(app.post({"prompt": text, "max_tokens": 6}))[1]["choices"][0]["text"]
    for route, bad, message in (("tokenize", {}, "send the text as prompt"), ("tokenize", {"prompt": "a", "content": "b"}, "once"),
                                ("tokenize", {"prompt": "x" * 201}, "longer than 200 characters"),
                                ("detokenize", {"tokens": [len(tok)]}, "out of range"), ("detokenize", {"tokens": [-1]}, ">= 0"),
                                ("detokenize", {"tokens": "12"}, "tokens")):
        status, err, _ = run(call(route, bad))
        assert status == 400 and message in err["error"]["message"], (route, bad, err)
    assert run(call("tokenize", {"prompt": text}, key="wrong"))[0] == 401
    assert isinstance(app.ingress._vocab, TextVocab)  # the tokenizer.json, without transformers
    app.ingress._vocab = None  # a model folder without one: the transformers tokenizer answers the same
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ingress_mod, "light_vocab", lambda name: None)
        assert run(call("tokenize", {"prompt": text}))[1] == body
        assert run(call("detokenize", {"tokens": body["tokens"]}))[1] == back
    assert not isinstance(app.ingress._vocab, TextVocab)


def test_echo_puts_the_prompts_text_before_the_completion_whole_and_streamed(app, folder):
    tok = load_tokenizer(folder)
    plain = run(app.post({"prompt": "Hello world", "max_tokens": 6, "ignore_eos": True}))[1]
    echoed = run(app.post({"prompt": "Hello world", "max_tokens": 6, "ignore_eos": True, "echo": True}))[1]
    assert echoed["choices"][0]["text"] == "Hello world" + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"] | {"speculative": echoed["usage"]["speculative"]}  # the same tokens counted
    ids = tok("Hello world")["input_ids"]
    by_ids = run(app.post({"prompt": ids, "max_tokens": 6, "ignore_eos": True, "echo": True}))[1]
    assert by_ids["choices"][0]["text"] == tok.decode(ids) + plain["choices"][0]["text"]
    status, events, _ = run(app.post({"prompt": "Hello world", "max_tokens": 6, "ignore_eos": True, "echo": True,
                                      "stream": True}))
    chunks = [e for e in events if e != "[DONE]"]
    assert status == 200 and chunks[0]["choices"][0]["text"] == "Hello world"
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == echoed["choices"][0]["text"]


def test_echo_with_logprobs_scores_the_prompt_as_the_target_would_its_own_output(app, folder):
    """OpenAI's echo with logprobs (how evaluation harnesses score a text): the prompt's tokens come
    first in ``logprobs``, the first one null, each later one with the target's log-probability
    given the tokens before it. Scoring the prompt followed by the output gives the output's own
    log-probabilities; streamed, the echo's chunk carries the prompt's; several choices of a prompt
    share one scoring."""
    tok = load_tokenizer(folder)
    ids = tok("Hello world")["input_ids"]
    plain = run(app.post({"prompt": "Hello world", "max_tokens": 5, "ignore_eos": True, "logprobs": 2}))[1]
    out_lp = plain["choices"][0]["logprobs"]
    status, echoed, _ = run(app.post({"prompt": "Hello world", "max_tokens": 5, "ignore_eos": True, "logprobs": 2,
                                      "echo": True}))
    lp = echoed["choices"][0]["logprobs"]
    assert status == 200 and len(lp["tokens"]) == len(ids) + 5 == echoed["usage"]["prompt_tokens"] + 5
    assert lp["tokens"] == [tok.decode([i]) for i in ids] + out_lp["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["token_logprobs"][len(ids):] == out_lp["token_logprobs"] and lp["text_offset"][0] == 0
    # the prompt followed by the output, scored: the output's log-probabilities, position by position
    whole_ids = ids + reference(folder, ids, 5)
    scored = run(app.post({"prompt": whole_ids, "max_tokens": 1, "logprobs": 2, "echo": True}))[1]["choices"][0]["logprobs"]
    assert scored["token_logprobs"][len(ids):len(ids) + 5] == pytest.approx(out_lp["token_logprobs"], abs=1e-4)
    assert scored["token_logprobs"][1:len(ids)] == pytest.approx(lp["token_logprobs"][1:len(ids)], abs=1e-4)
    # streamed: the echo's chunk carries the prompt's log-probabilities, then the output's follow
    _, events, _ = run(app.post({"prompt": "Hello world", "max_tokens": 5, "ignore_eos": True, "logprobs": 2,
                                 "echo": True, "stream": True}))
    chunks = [e for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["logprobs"]]
    assert chunks[0]["choices"][0]["text"] == "Hello world" and chunks[0]["choices"][0]["logprobs"]["tokens"] == lp["tokens"][:len(ids)]
    assert [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]] == lp["token_logprobs"]
    scored_tokens = counter(app.pools[0].meter, "osd_engine_prompt_scored_tokens_total")
    assert scored_tokens == 2 * (len(ids) - 1) + len(whole_ids) - 1  # three scorings so far, each counted
    assert counter(app.pools[0].meter, "osd_engine_prompt_scoring_seconds_total") > 0
    # two choices of one prompt: scored once (its first choice), both carry the prompt's
    calls = len(app.pool.calls)
    both = run(app.post({"prompt": "Hello world", "max_tokens": 3, "ignore_eos": True, "logprobs": 1, "echo": True,
                         "n": 2}))[1]["choices"]
    assert [c[2][0].prompt_logprobs for c in app.pool.calls[calls:]] == [1, None]
    assert [c["logprobs"]["token_logprobs"][: len(ids)] for c in both] == [lp["token_logprobs"][: len(ids)]] * 2
    assert counter(app.pools[0].meter, "osd_engine_prompt_scored_tokens_total") == scored_tokens + len(ids) - 1
    # without echo, the prompt is not scored
    run(app.post({"prompt": "Hello world", "max_tokens": 2, "logprobs": 1}))
    assert app.pool.calls[-1][2][0].prompt_logprobs is None


def test_vllms_prompt_logprobs_rank_each_prompt_token_on_completions_and_chat(app, folder):
    """vLLM's ``prompt_logprobs``: per prompt token (the first None) its id's log-probability, rank
    and text, with the N most likely tokens'; on each completion choice, at the top of a chat
    response; in a stream, with each choice's first chunk. llama-server's API refuses it."""
    tok = load_tokenizer(folder)
    ids = tok("Hello world")["input_ids"]
    echo = run(app.post({"prompt": "Hello world", "max_tokens": 2, "logprobs": 2, "echo": True}))[1]["choices"][0]["logprobs"]
    status, body, _ = run(app.post({"prompt": "Hello world", "max_tokens": 2, "prompt_logprobs": 2}))
    plp = body["choices"][0]["prompt_logprobs"]
    assert status == 200 and plp[0] is None and len(plp) == len(ids) == body["usage"]["prompt_tokens"]
    assert body["choices"][0]["logprobs"] is None  # the output's were not asked
    for j, entry in enumerate(plp[1:], 1):
        mine = entry[str(ids[j])]
        assert mine["logprob"] == pytest.approx(echo["token_logprobs"][j], abs=1e-6) and mine["rank"] >= 1
        assert mine["decoded_token"] == tok.decode([ids[j]])
        top = sorted((v for k, v in entry.items() if k != str(ids[j]) or v["rank"] <= 2), key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == [1, 2] and len(entry) == 2 + (mine["rank"] > 2)
        assert [v["logprob"] for v in top] == pytest.approx(sorted(echo["top_logprobs"][j].values(), reverse=True), abs=1e-6)
        assert (mine["rank"] > 2) == (mine["logprob"] < top[1]["logprob"])
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = run(app.post({"messages": msgs, "max_tokens": 2, "prompt_logprobs": 0, "n": 2}, chat=True))[1]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # its own token only
    assert [c[2][0].prompt_logprobs for c in app.pool.calls[-2:]] == [0, None]  # scored once for both choices
    _, events, _ = run(app.post({"messages": msgs, "max_tokens": 2, "prompt_logprobs": 0, "stream": True}, chat=True))
    assert events[0]["prompt_logprobs"] == chat["prompt_logprobs"] and "prompt_logprobs" not in events[1]
    _, events, _ = run(app.post({"prompt": "Hello world", "max_tokens": 2, "prompt_logprobs": 2, "stream": True}))
    assert events[0]["choices"][0]["prompt_logprobs"] == plp and events[0]["choices"][0]["text"] == ""
    assert all("prompt_logprobs" not in e["choices"][0] for e in events[1:] if e != "[DONE]" and e["choices"])
    status, err, _ = run(app.post({"prompt": "Hello world", "n_predict": 2, "prompt_logprobs": 1}, llama=True))
    assert status == 400 and "prompt_logprobs" in err["error"]["message"]


# -- several choices: n, and a batch of prompts ------------------------------------------------------

def test_n_choices_are_each_the_seeded_answer_with_the_seed_plus_their_index(app):
    """Choice j of a seeded request is what the request alone returns with seed + j: choice 0 is the
    request's own answer and the others differ from it, each reproducibly."""
    app.ingress.tenants.clock = lambda: 1000.0
    body = {"prompt": "Hello world", "max_tokens": 8, "ignore_eos": True, "temperature": 1.0, "seed": 7}
    status, many, _ = run(app.post({**body, "n": 3}))
    assert status == 200 and [c["index"] for c in many["choices"]] == [0, 1, 2]
    alone = [run(app.post({**body, "seed": 7 + j}))[1]["choices"][0]["text"] for j in range(3)]
    assert [c["text"] for c in many["choices"]] == alone and len(set(alone)) > 1
    usage = many["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (11, 24, 35)  # the prompt once
    spec = usage["speculative"]
    assert len(spec["choices"]) == 3 and spec["proposed"] == sum(s["proposed"] for s in spec["choices"]) > 0
    assert spec["accepted"] == sum(s["accepted"] for s in spec["choices"]) and spec["alpha"] == spec["accepted"] / spec["proposed"]
    ids = [gen.request_id for _, gen in app.pools[0].requests[:3]]
    assert len(set(ids)) == 3 and all(i.startswith(many["id"]) for i in ids)
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0
    bucket = app.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate - 35 - 3 * 19  # this request's tokens, and the three alone


def test_a_batch_of_prompts_answers_each_prompt_n_times_in_order(app, folder):
    """Choice p * n + j answers prompt p: greedy, every choice of a prompt is its target-only text;
    text and token-id prompts alike, each routed as its text; with echo, each choice's own prompt first."""
    tok = load_tokenizer(folder)
    ids = tok("The cat sat")["input_ids"]
    status, body, _ = run(app.post({"prompt": ["Hello world", "A B C"], "n": 2, "max_tokens": 6, "ignore_eos": True,
                                    "echo": True}))
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c, prompt in zip(body["choices"], ["Hello world", "Hello world", "A B C", "A B C"]):
        assert c["text"] == prompt + tok.decode(reference(folder, tok(prompt)["input_ids"], 6))
    assert body["usage"]["prompt_tokens"] == len(tok("Hello world")["input_ids"]) + len(tok("A B C")["input_ids"])
    assert body["usage"]["completion_tokens"] == 24
    status, body, _ = run(app.post({"prompt": [ids, ids[:2]], "max_tokens": 5, "ignore_eos": True}))
    assert [c["text"] for c in body["choices"]] == [tok.decode(reference(folder, p, 5)) for p in (ids, ids[:2])]
    assert [gen.prompt_ids for _, gen in app.pools[0].requests[-2:]] == [ids, ids[:2]]
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0


def test_streamed_choices_interleave_by_index_and_each_ends_once(app):
    """Streamed, every choice's chunks carry its index: each choice's text equals the whole answer's,
    chat sends each choice its role first, each choice ends with one finish chunk, and the usage
    comes once, after all of them."""
    msgs = [{"role": "user", "content": "Hi there"}]
    for chat, body in ((True, {"messages": msgs}), (False, {"prompt": ["Hello world", "A B C"]})):
        body = {**body, "n": 2, "max_tokens": 7, "ignore_eos": True, "temperature": 1.0, "seed": 3}
        _, whole, _ = run(app.post(body, chat=chat))
        status, events, _ = run(app.post({**body, "stream": True, "stream_options": {"include_usage": True}}, chat=chat))
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["choices"] == []
        chunks = events[:-2]
        assert all(len(c["choices"]) == 1 for c in chunks)
        count = len(whole["choices"])
        for i, choice in enumerate(whole["choices"]):
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
            key = "delta" if chat else None
            text = "".join((m["delta"].get("content", "") if key else m["text"]) for m in mine)
            assert text == (choice["message"]["content"] if chat else choice["text"])
            assert [m["finish_reason"] for m in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"
            if chat:
                assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert {c["choices"][0]["index"] for c in chunks} == set(range(count))
        assert events[-2]["usage"] == {**whole["usage"], "speculative": events[-2]["usage"]["speculative"]}
        assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0
    assert not any(s.cancelled for s in app.pool.streams)  # each ended by itself: none to cancel


def test_a_request_of_several_choices_holds_a_slot_for_each(folder):
    """Each choice is a sequence in flight: a request needing more than a tenant may run at once is a
    400, one that would pass the tenant's limit now a 429, one past the ingress's capacity a 503;
    none of them reaches the pool, and every slot is freed after."""
    limits = {"requests_per_minute": 600.0, "tokens_per_minute": 200000.0, "max_concurrent": 3}
    a = App(app_config(folder, ingress={"max_in_flight": 4}, auth={"default_limits": limits}))
    status, err, _ = run(a.post({"prompt": "Hi", "n": 4, "max_tokens": 2}))
    assert status == 400 and err["error"]["param"] == "n" and "more than tenant 'alice' may run at once (3)" in err["error"]["message"]
    a.ingress.tenants.in_flight["alice"] = 1  # another of alice's requests runs
    status, err, headers = run(a.post({"prompt": "Hi", "n": 3, "max_tokens": 2}))
    assert status == 429 and headers["retry-after"] == "1"
    a.ingress.tenants.in_flight["alice"] = 0
    a.ingress.running = 2
    status, err, _ = run(a.post({"prompt": "Hi", "n": 3, "max_tokens": 2}))
    assert status == 503 and err["error"]["code"] == "server_overloaded"
    a.ingress.running = 0
    assert a.pools[0].requests == []
    a.ingress.tenants.in_flight["alice"] = 1  # two choices and another request: three, within the limit
    assert run(a.post({"prompt": "Hi", "n": 2, "max_tokens": 2}))[0] == 200
    a.ingress.tenants.in_flight["alice"] = 2  # two choices would be the fourth
    assert run(a.post({"prompt": "Hi", "n": 2, "max_tokens": 2}))[0] == 429
    a.ingress.tenants.in_flight["alice"] = 0
    assert run(a.post({"prompt": "Hi", "n": 3, "max_tokens": 2}))[0] == 200
    assert a.ingress.running == 0 and a.ingress.tenants.in_flight["alice"] == 0


def test_a_request_of_more_choices_than_the_server_ever_runs_is_a_400_not_a_retry_later(folder):
    """More choices than ``max_in_flight`` could never be admitted, even on an idle server: a 400
    (a 503 would send the client to retry forever); as many as it runs are served."""
    a = App(app_config(folder, ingress={"max_in_flight": 4}))
    status, err, _ = run(a.post({"prompt": ["Hi"] * 5, "max_tokens": 2}))
    assert status == 400 and err["error"]["param"] == "n" and "runs at most 4 sequences at once" in err["error"]["message"]
    assert a.pools[0].requests == [] and a.ingress.running == 0
    assert run(a.post({"prompt": ["Hi"] * 4, "max_tokens": 2}))[0] == 200


def test_a_request_may_ask_for_exactly_max_choices(folder):
    a = App(app_config(folder, ingress={"max_choices": 4}))
    status, body, _ = run(a.post({"prompt": ["Hi", "Yo"], "n": 2, "max_tokens": 2}))
    assert status == 200 and len(body["choices"]) == 4
    status, err, _ = run(a.post({"prompt": ["Hi", "Yo", "Ah"], "n": 2, "max_tokens": 2}))
    assert status == 400 and err["error"]["param"] == "n" and "at most 4" in err["error"]["message"]
    assert a.ingress.running == 0 and a.ingress.tenants.in_flight["alice"] == 0


def test_a_choice_the_replica_refuses_ends_the_others_too(folder):
    """Of three choices the first runs, the replica refuses the second for now (none may wait) and
    the third as given (a token id past the vocabulary): the request is a 400, since a retry cannot
    mend it, and the choice that started is cancelled at once, its budget returned. Alone, the second
    refusal is a 503 with Retry-After."""
    app = App(app_config(folder, loop={"max_running": 1, "max_waiting": 0}))
    status, body, _ = run(app.post({"prompt": [[65, 66], [67, 68], [1 << 30]], "max_tokens": 30, "ignore_eos": True}))
    assert status == 400 and "prompt token id 1073741824 is outside the vocabulary" in body["error"]["message"]
    assert len(app.pool.streams) == 3 and all(s.cancelled for s in app.pool.streams)
    status, body, headers = run(app.post({"prompt": "Hello world", "n": 2, "max_tokens": 30, "ignore_eos": True}))
    assert status == 503 and body["error"]["code"] == "overloaded" and int(headers["retry-after"]) >= 1
    assert len(app.pool.streams) == 5 and all(s.cancelled for s in app.pool.streams)
    pool = app.pools[0]
    for _ in range(1000):  # the engine loop drops them at its next step boundary (running first, then their KV)
        if not pool.loop.running and pool.loop.reserved == 0 and all(not e.requests for e in pool.held.values()):
            break
        time.sleep(0.01)
    assert pool.loop.reserved == 0 and all(not e.requests for e in pool.held.values())
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0


def test_slots_show_each_streaming_sequence_its_counts_and_never_its_text(app):
    """llama-server's /slots: a slot per sequence the server admits at once; a busy one says its
    request, tenant, prompt and output counts and settings (no stop strings, grammar or biases:
    they hold the request's text), an idle one that it is idle; the admin key only."""
    total = app.cfg.ingress.max_in_flight
    got, idle, _ = run(answer_of(app.ingress.slot_states(request(key=ADMIN))))
    assert got == 200 and len(idle) == total and not any(s["is_processing"] for s in idle)
    assert [s["id"] for s in idle] == list(range(total))
    got, err, _ = run(answer_of(app.ingress.slot_states(request(key=KEY))))
    assert got == 403

    async def during():
        body = {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
                "stop": ["zzz secret"]}
        response = await app.ingress.completion(request(body, KEY), chat=False)
        parts = response.body_iterator
        seen = []
        async for part in parts:  # the first chunks: the sequence streams, its slot is busy
            seen.append(part)
            if len(seen) == 3:
                break
        _, mid, _ = await answer(await app.ingress.slot_states(request(key=ADMIN)))
        async for part in parts:
            seen.append(part)
        _, after, _ = await answer(await app.ingress.slot_states(request(key=ADMIN)))
        return mid, after, "".join(p if isinstance(p, str) else p.decode() for p in seen)

    mid, after, text = run(during())
    busy = [s for s in mid if s["is_processing"]]
    assert len(busy) == 1 and busy[0]["id"] == 0 and busy[0]["tenant"] == "alice"
    assert busy[0]["n_prompt_tokens"] == len("Hello world") and 0 < busy[0]["next_token"][0]["n_decoded"] < 12
    assert busy[0]["next_token"][0]["n_remain"] == 12 - busy[0]["next_token"][0]["n_decoded"]
    assert busy[0]["params"]["n_predict"] == 12 and "stop" not in busy[0]["params"] and "zzz" not in json.dumps(mid)
    assert "[DONE]" in text and not any(s["is_processing"] for s in after) and app.ingress.slots == {}


def test_slots_fail_on_no_slot_for_load_balancers(app):
    got, _, _ = run(answer_of(app.ingress.slot_states(request(key=ADMIN, query="fail_on_no_slot=1"))))
    assert got == 200
    app.ingress.running = app.cfg.ingress.max_in_flight  # every sequence the server admits is in flight
    got, err, _ = run(answer_of(app.ingress.slot_states(request(key=ADMIN, query="fail_on_no_slot=1"))))
    assert got == 503 and err["error"]["message"] == "no slot available"
    got, _, _ = run(answer_of(app.ingress.slot_states(request(key=ADMIN))))
    assert got == 200  # without the flag: the slots, busy or not
