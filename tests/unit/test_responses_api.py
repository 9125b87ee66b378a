"""OpenAI's Responses API (``POST /v1/responses``) on the real ingress in one process (the app of
tests/inprocess.py on a tiny Llama): a response says what the same chat says on the chat
endpoint, in the shapes the OpenAI SDK's own types read, streamed or whole."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from inprocess import answer, request


@pytest.fixture
def app(tiny_app):
    return tiny_app


def call(app, body, key: str | None = "sk-alice"):
    """(status, the body or the list of stream events, checked against the SDK's types)."""
    from starlette.responses import StreamingResponse

    async def go():
        response = await app.ingress.responses(request(body, key))
        if isinstance(response, dict):
            return 200, response
        if isinstance(response, StreamingResponse):
            text = "".join([p if isinstance(p, str) else p.decode() async for p in response.body_iterator])
            events = []
            for block in filter(None, text.split("\n\n")):
                name, data = block.split("\n")
                event = json.loads(data[len("data: "):])
                assert name == f"event: {event['type']}"
                events.append(event)
            return response.status_code, events
        return response.status_code, json.loads(response.body)
    return app.run(go())


def chat(app, body):
    async def go():
        return await answer(await app.ingress.completion(request(body, "sk-alice"), chat=True))
    return app.run(go())


INPUT = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]},
         {"role": "user", "content": [{"type": "input_text", "text": "abc"}]}]
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"},
         {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "abc"}]


def test_a_response_is_the_same_chats_answer_in_the_sdks_shape(app):
    got, body = call(app, {"input": INPUT, "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0})
    assert got == 200, body
    r = Response.model_validate(body)  # the SDK's own type reads it
    _, want, _ = chat(app, {"messages": TURNS, "max_tokens": 7, "temperature": 0})
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (want["usage"]["prompt_tokens"], want["usage"]["completion_tokens"])
    assert want["choices"][0]["finish_reason"] == "length"  # at its limit: incomplete, and says why
    assert r.status == r.output[0].status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_a_text_input_is_a_user_turn(app):
    _, body = call(app, {"input": "Hello world", "max_output_tokens": 6, "temperature": 0})
    _, want, _ = chat(app, {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 6, "temperature": 0})
    assert Response.model_validate(body).output_text == want["choices"][0]["message"]["content"]


def test_the_stream_is_the_responses_events_of_the_same_text(app):
    body = {"input": INPUT, "instructions": "Be brief.", "max_output_tokens": 5, "temperature": 0}
    _, whole = call(app, body)
    got, events = call(app, {**body, "stream": True})
    assert got == 200
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]  # the SDK's own types
    kinds = [e.type for e in parsed]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    text = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")
    last = parsed[-1].response
    assert text == last.output_text == Response.model_validate(whole).output_text
    assert last.usage.output_tokens == whole["usage"]["output_tokens"] == 5
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0


def test_structured_output_through_text_format(app):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    got, body = call(app, {"input": "Hello", "max_output_tokens": 40, "temperature": 0,
                           "text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}})
    assert got == 200, body
    r = Response.model_validate(body)
    assert set(json.loads(r.output_text)) == {"a"}  # the grammar ends it: completed
    assert r.status == r.output[0].status == "completed" and r.incomplete_details is None


@pytest.mark.parametrize("body,says", [
    ({"max_output_tokens": 4}, "input"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "previous_response_id": "resp_1"}, "stores no responses"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text content"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "messages with a role"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "not supported"),
    ({"input": "x", "text": {"format": "json"}}, "an object with a type"),
    ({"input": "x", "text": "json"}, "valid dictionary"),
    ({"input": [{"role": "user"}]}, "a text or a list of text parts"),
    ({"input": [{"role": "tool", "content": "x"}]}, "messages with a role"),
    ({"input": "x", "max_output_tokens": 10**6}, "limit"),
])
def test_refusals_are_400s_in_openais_shape(app, body, says):
    got, err = call(app, body)
    assert got == 400 and says in err["error"]["message"], err
    assert app.ingress.running == 0


def test_the_key_is_checked_as_on_the_chat_endpoint(app):
    got, err = call(app, {"input": "x", "max_output_tokens": 4}, key=None)
    assert got == 401 and err["error"]["message"]


def test_a_client_that_leaves_mid_stream_frees_its_slot(app):
    async def go():
        response = await app.ingress.responses(request({"input": "Hello world", "max_output_tokens": 40,
                                                        "temperature": 0, "stream": True}, "sk-alice"))
        events = response.body_iterator
        first = [await events.__anext__() for _ in range(5)]  # created ... the first delta
        busy = app.ingress.running
        await events.aclose()  # the client went away
        return first, busy
    first, busy = app.run(go())
    assert first[4].startswith("event: response.output_text.delta") and busy == 1
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0 and app.ingress.slots == {}


@pytest.mark.parametrize("reasoning", [None, {}, {"effort": None, "summary": None}])
def test_reasoning_left_unset_is_served(app, reasoning):
    got, body = call(app, {"input": "x", "max_output_tokens": 2, "reasoning": reasoning})
    assert got == 200, body


# -- the translation by hand -------------------------------------------------------------------------------------
ANSWER = {"id": "chatcmpl-ab", "created": 7, "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}}


def _expected(status: str, text: str, usage: dict | None, **over) -> dict:
    done = status != "in_progress"
    item = {"type": "message", "id": "msg_ab", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if done else []}
    return {"id": "resp_ab", "object": "response", "created_at": 7, "status": status, "model": "m", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": "Be brief.", "metadata": {"k": "v"}, "max_output_tokens": 9, "parallel_tool_calls": False,
            "previous_response_id": None, "temperature": 1.0, "top_p": 1.0, "tool_choice": "none", "tools": [],
            "store": False, "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": None,
            "output": [item] if done else [], "usage": usage, **over}


USAGE = {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0}, "output_tokens": 2,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7}


def test_a_response_from_a_chat_answer_by_hand():
    from deployments.responses_api import ResponsesRequest, response

    req = ResponsesRequest(input="x", instructions="Be brief.", metadata={"k": "v"}, max_output_tokens=9)
    assert response(ANSWER, req, "m") == _expected("completed", "hi", USAGE)
    cut = {**ANSWER, "choices": [{"message": {"content": None}, "finish_reason": "length"}],
           "usage": {**ANSWER["usage"], "prompt_tokens_details": None}}
    assert response(cut, req, "m") == _expected("incomplete", "", {**USAGE, "input_tokens_details": {
        "cached_tokens": 0, "cache_write_tokens": 0}})
    dashed = response({**ANSWER, "id": "chatcmpl-x-y"}, req, "m")  # the chat id's part after its prefix
    assert (dashed["id"], dashed["output"][0]["id"]) == ("resp_x-y", "msg_x-y")
    bare = response(ANSWER, ResponsesRequest(input="x", temperature=0.5, top_p=0.9), "m")
    assert (bare["metadata"], bare["temperature"], bare["top_p"], bare["instructions"]) == ({}, 0.5, 0.9, None)


def test_the_events_of_a_chat_stream_by_hand(loop, monkeypatch):
    from deployments import responses_api
    from deployments.responses_api import ResponsesRequest, events

    monkeypatch.setattr(responses_api.time, "time", lambda: 7)
    req = ResponsesRequest(input="x", instructions="Be brief.", metadata={"k": "v"}, max_output_tokens=9)

    async def chat_stream(parts):
        for p in parts:
            yield p

    def run(chunks):
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        async def go():
            return [e async for e in events(chat_stream([sse[:10].encode(), sse[10:]]), req, "m", "ab")]
        out = []
        for block in loop.run(go()):
            name, data = block.strip().split("\n")
            event = json.loads(data[len("data: "):])
            assert name == f"event: {event['type']}"
            out.append(event)
        assert [e["sequence_number"] for e in out] == list(range(len(out)))
        return out

    got = run([{"choices": [{"delta": {"content": "h"}, "finish_reason": None}]},
               {"choices": [{"delta": {"content": "i"}, "finish_reason": "stop"}]},
               {"choices": [], "usage": ANSWER["usage"]}])
    where = {"item_id": "msg_ab", "output_index": 0}
    part = {"type": "output_text", "text": "", "annotations": []}
    shell = _expected("in_progress", "", None)
    assert [{k: v for k, v in e.items() if k != "sequence_number"} for e in got] == [
        {"type": "response.created", "response": shell},
        {"type": "response.in_progress", "response": shell},
        {"type": "response.output_item.added", "output_index": 0, "item": {
            "type": "message", "id": "msg_ab", "status": "in_progress", "role": "assistant", "content": []}},
        {"type": "response.content_part.added", **where, "content_index": 0, "part": part},
        {"type": "response.output_text.delta", **where, "content_index": 0, "delta": "h", "logprobs": []},
        {"type": "response.output_text.delta", **where, "content_index": 0, "delta": "i", "logprobs": []},
        {"type": "response.output_text.done", **where, "content_index": 0, "text": "hi", "logprobs": []},
        {"type": "response.content_part.done", **where, "content_index": 0, "part": {**part, "text": "hi"}},
        {"type": "response.output_item.done", "output_index": 0, "item": _expected("completed", "hi", USAGE)["output"][0]},
        {"type": "response.completed", "response": _expected("completed", "hi", USAGE)}]
    failed = run([{"choices": [{"delta": {"content": "h"}, "finish_reason": None}]}, {"error": {"message": "boom"}}])
    assert failed[-2] == {"type": "error", "sequence_number": 5, "code": "server_error", "message": "boom", "param": None}
    assert failed[-1]["type"] == "response.failed" and failed[-1]["response"]["status"] == "failed"
    assert failed[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    cut = run([{"choices": [{"delta": {"content": "h"}, "finish_reason": "length"}]}])
    assert cut[-1]["type"] == "response.incomplete" and cut[-1]["response"]["usage"] is None
    assert cut[-2]["item"]["status"] == "incomplete"
