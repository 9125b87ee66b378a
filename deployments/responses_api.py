"""OpenAI's Responses API over the chat endpoint (llama-server answers it too).

``POST /v1/responses``: a request (``input`` as text or messages, ``instructions``,
``max_output_tokens``, ``text.format`` for structured output) becomes a chat completions request
(:func:`chat_body`), served as any chat is; its answer becomes a response object
(:func:`response`), its stream the Responses API's events (:func:`events`). Errors keep OpenAI's
shape. Stateless: nothing is stored, so ``previous_response_id`` is refused, and so are tools and
reasoning settings, which would change the output.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .openai_api import chunks_of, no_tools

ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, gt=0, strict=True)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = Field(default=False, strict=True)
    user: str | None = None
    metadata: dict | None = None
    text: dict | None = None
    tools: list | None = None
    reasoning: dict | None = None
    previous_response_id: str | None = None

    _no_tools = field_validator("tools")(no_tools)

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, v):
        if v and any(v.get(k) is not None for k in ("effort", "summary", "generate_summary")):
            raise ValueError("reasoning is not supported by this server (send none)")
        return v

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, v):
        if v is not None:
            raise ValueError("previous_response_id: this server stores no responses (send the conversation as input)")
        return v

    def messages(self) -> list[dict]:
        """``instructions`` as a system turn, then ``input``: a text (a user turn) or messages
        (``{"role", "content"}``, the content a text or ``input_text`` / ``output_text`` parts)."""
        turns = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return turns + [{"role": "user", "content": self.input}]
        for item in self.input:
            if item.get("type", "message") != "message" or item.get("role") not in ROLES:
                raise ValueError("input items are messages with a role (user, assistant, system or developer)")
            content = item.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                           and isinstance(p.get("text"), str) for p in content):
                    raise ValueError("only text content parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ValueError("a message's content is a text or a list of text parts")
            turns.append({"role": item["role"], "content": content})
        return turns

    def response_format(self) -> dict | None:
        """``text.format`` as the chat's ``response_format`` (None: plain text)."""
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise ValueError("text.format is an object with a type")
        if not fmt or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "schema"), "schema": fmt.get("schema")}}
        raise ValueError(f"text.format type {fmt.get('type')!r} is not supported (text, json_object, json_schema)")


def chat_body(body: dict) -> tuple[ResponsesRequest, dict]:
    """The request, and the chat completions request that serves it (ValueError or pydantic's
    ValidationError: a 400)."""
    req = ResponsesRequest.model_validate(body)
    chat: dict = {"messages": req.messages(), "stream": req.stream}
    for name, value in (("model", req.model), ("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("user", req.user), ("response_format", req.response_format())):
        if value is not None:
            chat[name] = value
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    return req, chat


def _shell(req: ResponsesRequest, rid: str, model: str, created: int, status: str) -> dict:
    """A response object's fields but its output and usage."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "error": None, "incomplete_details": None, "instructions": req.instructions, "metadata": req.metadata or {},
            "max_output_tokens": req.max_output_tokens, "parallel_tool_calls": False, "previous_response_id": None,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "tool_choice": "none", "tools": [], "store": False,
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "user": req.user,
            "output": [], "usage": None}


def _message(msg_id: str, text: str, done: bool, finish_reason: str | None = None) -> dict:
    status = "in_progress" if not done else "incomplete" if finish_reason == "length" else "completed"
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if done else []}


def _usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _finish(out: dict, finish_reason: str | None) -> dict:
    """A response completed, or incomplete at its output's limit."""
    if finish_reason == "length":
        out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        out["status"] = "completed"
    return out


def response(answer: dict, req: ResponsesRequest, model: str) -> dict:
    """A chat completion as a response object: one message of one output text."""
    choice = answer["choices"][0]
    key = answer["id"].split("-", 1)[-1]
    out = _shell(req, "resp_" + key, model, answer["created"], "completed")
    out["output"] = [_message("msg_" + key, choice["message"]["content"] or "", True, choice["finish_reason"])]
    out["usage"] = _usage(answer["usage"])
    return _finish(out, choice["finish_reason"])


def _event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"


async def events(chunks: AsyncIterator, req: ResponsesRequest, model: str, key: str) -> AsyncIterator[str]:
    """The chat stream's server-sent events as the Responses API's: created, in progress, the
    message added, its text part added, a delta for each piece of text, the text, part and
    message done, then completed (or incomplete at the output's limit) with the usage. An error
    of the chat stream ends it with ``error`` and ``response.failed``."""
    seq = itertools.count()
    rid, msg_id, created = "resp_" + key, "msg_" + key, int(time.time())
    shell = _shell(req, rid, model, created, "in_progress")
    yield _event({"type": "response.created", "sequence_number": next(seq), "response": shell})
    yield _event({"type": "response.in_progress", "sequence_number": next(seq), "response": shell})
    where = {"item_id": msg_id, "output_index": 0}
    yield _event({"type": "response.output_item.added", "sequence_number": next(seq), "output_index": 0,
                  "item": _message(msg_id, "", False)})
    part = {"type": "output_text", "text": "", "annotations": []}
    yield _event({"type": "response.content_part.added", "sequence_number": next(seq), **where, "content_index": 0,
                  "part": part})
    texts: list[str] = []
    finish, usage = None, None
    parsed = chunks_of(chunks)
    try:
        async for chunk in parsed:
            if "error" in chunk:
                message = chunk["error"].get("message", "the stream failed")
                yield _event({"type": "error", "sequence_number": next(seq), "code": "server_error",
                              "message": message, "param": None})
                failed = {**shell, "status": "failed", "error": {"code": "server_error", "message": message}}
                yield _event({"type": "response.failed", "sequence_number": next(seq), "response": failed})
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    texts.append(text)
                    yield _event({"type": "response.output_text.delta", "sequence_number": next(seq), **where,
                                  "content_index": 0, "delta": text, "logprobs": []})
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
    finally:
        await parsed.aclose()
    text = "".join(texts)
    yield _event({"type": "response.output_text.done", "sequence_number": next(seq), **where, "content_index": 0,
                  "text": text, "logprobs": []})
    yield _event({"type": "response.content_part.done", "sequence_number": next(seq), **where, "content_index": 0,
                  "part": {**part, "text": text}})
    item = _message(msg_id, text, True, finish)
    yield _event({"type": "response.output_item.done", "sequence_number": next(seq), "output_index": 0, "item": item})
    out = _finish({**shell, "output": [item], "usage": _usage(usage) if usage else None}, finish)
    yield _event({"type": f"response.{out['status']}", "sequence_number": next(seq), "response": out})
