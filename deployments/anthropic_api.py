"""Anthropic's Messages API over the chat endpoint (llama-server answers it too).

``POST /v1/messages``: a request becomes a chat completions request (:func:`chat_body`), served as
any chat is, and its answer becomes a message (:func:`message`), its stream Anthropic's events
(:func:`events`), its error Anthropic's error shape (:func:`error`). ``POST
/v1/messages/count_tokens`` counts the prompt's tokens. Text only: tools, images, documents and
extended thinking would change the output and are refused with a 400, as on the other endpoints.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .openai_api import chunks_of, no_tools

#: an error's status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
#: the chat's finish reason -> the message's stop reason ("stop" at a stop sequence: "stop_sequence")
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


class MessagesRequest(BaseModel):
    """A Messages API request: what it may hold here (unknown fields are ignored, as Anthropic's
    optional headers' features are; the ones that would change the output are refused)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int = Field(gt=0, strict=True)  # required, as in Anthropic's API
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, strict=True)
    stop_sequences: list[str] | None = None
    stream: bool = Field(default=False, strict=True)
    metadata: dict | None = None
    tools: list | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None

    _no_tools = field_validator("tools")(no_tools)

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, v):
        if v and v.get("type") != "disabled":
            raise ValueError("extended thinking is not supported by this server (send none, or type disabled)")
        return v

    @field_validator("messages")
    @classmethod
    def _roles(cls, v):
        for m in v:
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or "content" not in m:
                raise ValueError("each message has a role (user or assistant) and a content")
        return v

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        if not all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in self.system):
            raise ValueError("system is a string or a list of text blocks")
        return "".join(b["text"] for b in self.system)


def chat_body(body: dict) -> tuple[MessagesRequest, dict]:
    """The request, and the chat completions request that serves it (ValueError or pydantic's
    ValidationError: a 400). Anthropic's temperature defaults to 1, as the chat endpoint's."""
    req = MessagesRequest.model_validate(body)
    system = req.system_text()
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": m["role"], "content": m["content"]} for m in req.messages]
    chat: dict = {"messages": messages, "max_tokens": req.max_tokens, "stream": req.stream}
    for name, value in (("model", req.model), ("temperature", req.temperature), ("top_p", req.top_p),
                        ("top_k", req.top_k), ("stop", req.stop_sequences)):
        if value is not None:
            chat[name] = value
    user = (req.metadata or {}).get("user_id")
    if isinstance(user, str):
        chat["user"] = user
    if req.stream:  # the output's tokens, for the last event
        chat["stream_options"] = {"include_usage": True}
    return req, chat


def stop_reason(finish_reason: str | None, stop: str | int | None) -> tuple[str | None, str | None]:
    """(the message's stop_reason, its stop_sequence) from a chat choice's finish_reason and
    stop_reason (vLLM's: the stop string met, or the stop token id)."""
    if finish_reason is None:
        return None, None
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def message(answer: dict, model: str) -> dict:
    """A chat completion as a message: its text as one text block, its stop reason and usage."""
    choice = answer["choices"][0]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    usage = answer["usage"]
    return {"id": "msg_" + answer["id"].split("-", 1)[-1], "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": choice["message"]["content"] or ""}],
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "cache_read_input_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}}


def error(status: int, message_text: str) -> dict:
    """Anthropic's error body."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message_text}}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def events(chunks: AsyncIterator, msg_id: str, model: str, input_tokens: int) -> AsyncIterator[str]:
    """The chat stream's server-sent events (``data: {chunk}``, then ``data: [DONE]``) as
    Anthropic's: message_start, one text block's start, deltas and stop, message_delta (the stop
    reason and usage), message_stop. An error event of the chat stream ends it as Anthropic's."""
    yield _event("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})
    yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})
    reason = sequence = None
    output = 0
    parsed = chunks_of(chunks)
    try:
        async for chunk in parsed:
            if "error" in chunk:
                message_text = chunk["error"].get("message", "the stream failed")
                yield _event("error", {"type": "error", "error": {"type": "api_error", "message": message_text}})
                return
            if chunk.get("usage"):
                output = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                         "delta": {"type": "text_delta", "text": text}})
                if choice.get("finish_reason") is not None:
                    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    finally:
        await parsed.aclose()
    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"input_tokens": input_tokens, "output_tokens": output}})
    yield _event("message_stop", {"type": "message_stop"})
