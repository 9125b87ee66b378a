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
