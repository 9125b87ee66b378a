"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the real
ingress in one process (the app of tests/inprocess.py on a tiny Llama): a message says what the
same chat says on the chat endpoint, its stream is Anthropic's events of the same text, and
its errors have Anthropic's shape."""

from __future__ import annotations

import json

import pytest

from inprocess import ADMIN, answer, request


@pytest.fixture
def app(tiny_app):
    return tiny_app


def call(app, body, count: bool = False, key: str | None = "sk-alice", raw: bytes | None = None):
    """(status, body or the list of (event, data) of a stream, headers)."""
    from starlette.responses import StreamingResponse

    async def go():
        response = await app.ingress.messages(request(body, key, raw=raw), count_only=count)
        if isinstance(response, dict):
            return 200, response, {}
        if isinstance(response, StreamingResponse):
            text = "".join([p if isinstance(p, str) else p.decode() async for p in response.body_iterator])
            events = []
            for block in filter(None, text.split("\n\n")):
                name, data = block.split("\n")
                assert name.startswith("event: ") and data.startswith("data: "), block
                events.append((name[len("event: "):], json.loads(data[len("data: "):])))
            return response.status_code, events, dict(response.headers)
        return response.status_code, json.loads(response.body), dict(response.headers)
    return app.run(go())


def chat(app, body):
    async def go():
        return await answer(await app.ingress.completion(request(body, "sk-alice"), chat=True))
    return app.run(go())


MESSAGES = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "text", "text": "abc"}]}]


@pytest.mark.parametrize("system", [None, "Be brief.", [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]])
def test_a_message_is_the_same_chats_answer_in_anthropics_shape(app, system):
    body = {"model": None, "max_tokens": 12, "temperature": 0, "messages": MESSAGES}
    if system is not None:
        body["system"] = system
    status, msg, _ = call(app, body)
    assert status == 200, msg
    turns = ([{"role": "system", "content": "Be brief."}] if system else []) + [
        {"role": m["role"], "content": m["content"]} for m in MESSAGES]
    status, want, _ = chat(app, {"messages": turns, "max_tokens": 12, "temperature": 0})
    assert status == 200
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith("msg_")
    assert msg["content"] == [{"type": "text", "text": want["choices"][0]["message"]["content"]}]
    assert msg["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    assert msg["usage"]["output_tokens"] == want["usage"]["completion_tokens"]
    assert (msg["stop_reason"], msg["stop_sequence"]) == (
        {"length": "max_tokens", "stop": "end_turn"}[want["choices"][0]["finish_reason"]], None)


def test_the_stream_is_anthropics_events_of_the_same_text_and_counts(app):
    body = {"max_tokens": 12, "temperature": 0, "messages": MESSAGES}
    _, whole, _ = call(app, body)
    status, events, headers = call(app, {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) <= {"content_block_delta"}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole["content"][0]["text"]
    start, delta = events[0][1], events[-2][1]
    assert start["message"]["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert delta["delta"]["stop_reason"] == whole["stop_reason"]
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0  # settled


def test_a_stop_sequence_is_named_as_the_reason(app):
    _, whole, _ = call(app, {"max_tokens": 12, "temperature": 0, "messages": MESSAGES})
    text = whole["content"][0]["text"]
    stop = text[3:5]  # a piece of what it would say: it ends there
    status, msg, _ = call(app, {"max_tokens": 12, "temperature": 0, "messages": MESSAGES, "stop_sequences": [stop]})
    assert status == 200 and (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", stop)
    assert msg["content"][0]["text"] == text[: text.index(stop)]
    _, events, _ = call(app, {"max_tokens": 12, "temperature": 0, "messages": MESSAGES, "stop_sequences": [stop],
                             "stream": True})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_count_tokens_is_the_messages_prompt_tokens(app):
    _, whole, _ = call(app, {"max_tokens": 4, "temperature": 0, "messages": MESSAGES, "system": "Be brief."})
    status, counted, _ = call(app, {"messages": MESSAGES, "system": "Be brief."}, count=True)
    assert status == 200 and counted == {"input_tokens": whole["usage"]["input_tokens"]}
    status, err, _ = call(app, {"messages": MESSAGES}, count=True, key=None)
    assert status == 401 and err["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body,status,kind", [
    ({"messages": MESSAGES}, 400, "invalid_request_error"),  # max_tokens is required
    ({"max_tokens": 4, "messages": MESSAGES, "tools": [{"name": "f", "input_schema": {}}]}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": MESSAGES, "temperature": 1.5}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": MESSAGES, "model": "claude-sonnet"}, 404, "not_found_error"),
    ({"max_tokens": 10**6, "messages": MESSAGES}, 400, "invalid_request_error"),  # past the server's limit
])
def test_refusals_are_in_anthropics_error_shape(app, body, status, kind):
    got, err, _ = call(app, body)
    assert (got, err["type"], err["error"]["type"]) == (status, "error", kind), err
    assert err["error"]["message"]
    assert app.ingress.running == 0


def test_keys_and_bodies_are_checked_as_on_the_other_endpoints(app):
    status, err, _ = call(app, {"max_tokens": 4, "messages": MESSAGES}, key=None)
    assert status == 401 and err["error"]["type"] == "authentication_error"
    status, err, _ = call(app, None, raw=b"{not json")
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    status, err, _ = call(app, None, raw=b"x" * 4096)  # past the body limit (2,048 bytes here)
    assert status == 413 and err["error"]["type"] == "request_too_large"
    status, msg, _ = call(app, {"max_tokens": 4, "messages": MESSAGES}, key=ADMIN)  # any valid key
    assert status == 200 and msg["usage"]["output_tokens"] <= 4


def test_a_client_that_leaves_mid_stream_frees_its_slot(app):
    async def go():
        response = await app.ingress.messages(request({"max_tokens": 40, "temperature": 0, "messages": MESSAGES,
                                                       "stream": True}, "sk-alice"))
        events = response.body_iterator
        first = [await events.__anext__() for _ in range(3)]  # message_start, the block's start, a delta
        busy = app.ingress.running, app.ingress.tenants.in_flight["alice"]
        await events.aclose()  # the client went away
        return first, busy
    first, busy = app.run(go())
    assert first[2].startswith("event: content_block_delta") and busy == (1, 1)
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0 and app.ingress.slots == {}


# -- the translation by hand -------------------------------------------------------------------------------------
def test_stop_reasons_by_hand():
    from deployments.anthropic_api import stop_reason

    assert stop_reason("stop", "x y") == ("stop_sequence", "x y")  # a stop string met
    assert stop_reason("stop", None) == ("end_turn", None)  # the end of sequence
    assert stop_reason("stop", 7) == ("end_turn", None)  # a stop token id
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("length", "x") == ("max_tokens", None)
    assert stop_reason(None, None) == (None, None)


def test_a_message_from_a_chat_answer_by_hand():
    from deployments.anthropic_api import message

    answer = {"id": "chatcmpl-ab-cd", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop", "stop_reason": None}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}}
    assert message(answer, "m") == {
        "id": "msg_ab-cd", "type": "message", "role": "assistant", "model": "m", "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 2, "cache_read_input_tokens": 3}}
    answer["usage"].pop("prompt_tokens_details")
    answer["choices"][0]["message"]["content"] = None
    out = message(answer, "m")
    assert out["usage"]["cache_read_input_tokens"] == 0 and out["content"] == [{"type": "text", "text": ""}]


def test_the_events_of_a_chat_stream_by_hand(loop):
    from deployments.anthropic_api import events

    async def chat_stream(parts):
        for p in parts:
            yield p

    def run(parts):
        async def go():
            return [e async for e in events(chat_stream(parts), "msg_1", "m", 9)]
        out = []
        for block in loop.run(go()):
            name, data = block.strip().split("\n")
            out.append((name[len("event: "):], json.loads(data[len("data: "):])))
        return out

    chunks = [{"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": "a"}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": "b"}, "finish_reason": "stop", "stop_reason": "b!"}], "usage": None},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    got = run([sse[:17].encode(), sse[17:60], sse[60:]])  # split anywhere, bytes or text
    assert got == [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": 9, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "b"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "b!"},
                           "usage": {"input_tokens": 9, "output_tokens": 4}}),
        ("message_stop", {"type": "message_stop"})]
    failed = run([f"data: {json.dumps(chunks[1])}\n\n", 'data: {"error": {"message": "boom"}}\n\n'])
    assert failed[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})
    assert [n for n, _ in failed] == ["message_start", "content_block_start", "content_block_delta", "error"]
    no_usage = run([f"data: {json.dumps(chunks[1])}\n\n"])
    assert no_usage[-2][1]["usage"]["output_tokens"] == 0 and no_usage[-2][1]["delta"]["stop_reason"] is None


def test_requests_by_hand():
    from pydantic import ValidationError

    from deployments.anthropic_api import chat_body

    req, chat = chat_body({"max_tokens": 5, "messages": MESSAGES[:1], "system": [{"type": "text", "text": "S"}],
                           "thinking": None, "metadata": {"user_id": "u1"}, "stop_sequences": ["x"], "top_k": 3})
    assert chat == {"messages": [{"role": "system", "content": "S"}, MESSAGES[0]], "max_tokens": 5, "stream": False,
                    "top_k": 3, "stop": ["x"], "user": "u1"}
    _, chat = chat_body({"max_tokens": 5, "messages": MESSAGES[:1], "stream": True, "thinking": {"type": "disabled"},
                         "metadata": {"user_id": 5}})
    assert chat["stream_options"] == {"include_usage": True} and "user" not in chat
    for bad in ([{"type": "image"}], [{"type": "text"}], [{"type": "text", "text": 5}]):
        with pytest.raises(ValueError, match="text blocks"):
            chat_body({"max_tokens": 5, "messages": MESSAGES[:1], "system": bad})
    with pytest.raises(ValidationError):
        chat_body({"max_tokens": 5, "messages": ["hi"]})
