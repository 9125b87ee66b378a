"""OpenAI's (and vLLM's) response shapes that are more than a dict literal: log-probabilities of
a choice or a chunk, a scored prompt, and a response's usage over several choices. Pure functions
of what the ingress collected (``decode``: token ids to text); the ingress frames them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Callable

Decode = Callable[[list[int]], str]


def no_tools(cls, v):
    """A request's ``tools`` (a pydantic validator): this server serves none."""
    if v:
        raise ValueError("tools are not supported by this server (send none)")
    return v


async def chunks_of(stream: AsyncIterator) -> AsyncIterator[dict]:
    """The chunks of a chat stream's server-sent events (``data: {chunk}`` ... ``data: [DONE]``),
    for the APIs served over it. Closed early (its reader's client left), it closes the stream at
    once, which settles the request and cancels its sequence."""
    buffer = ""
    try:
        async for raw in stream:
            buffer += raw.decode() if isinstance(raw, bytes) else raw
            while "\n\n" in buffer:
                line, buffer = buffer.split("\n\n", 1)
                data = line.removeprefix("data: ").strip()
                if data and data != "[DONE]":
                    yield json.loads(data)
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def finite(lp: float) -> float:
    """A log-probability for JSON: -inf (a token past the kept top k) as OpenAI writes it, -9999."""
    return lp if lp > -9999.0 else -9999.0


def logprobs(decode: Decode, tokens: list[int], lps: list, chat: bool, offset: int = 0) -> dict:
    """OpenAI's ``logprobs`` of a choice (or of one chunk's tokens): chat's ``content`` list, or the
    completions' legacy columns (``text_offset`` from ``offset``, the characters before). ``lps``:
    (logprob, [(id, logprob), ...]) per token; an echoed prompt's first token's is (None, None)."""
    text = [decode([t]) for t in tokens]

    def entry(i: int, t: str, lp: float | None) -> dict:  # with llama-server's "id"
        return {"id": i, "token": t, "logprob": None if lp is None else finite(lp), "bytes": list(t.encode("utf-8", "replace"))}

    content = [{**entry(i, t, lp), "top_logprobs": [entry(j, decode([j]), v) for j, v in top or []]}
               for i, t, (lp, top) in zip(tokens, text, lps)]
    if chat:
        return {"content": content, "refusal": None}
    offsets = []
    for t in text:
        offsets.append(offset)
        offset += len(t)
    # (an echoed prompt's first token has no log-probability: null, as OpenAI writes it); ``content``:
    # the same in chat's form, which llama-server answers completions with
    return {"tokens": text, "token_logprobs": [None if lp is None else finite(lp) for lp, _ in lps],
            "top_logprobs": [None if top is None else {decode([i]): finite(v) for i, v in top} for _, top in lps],
            "text_offset": offsets, "content": content}


def echo_scores(ids: list[int], scores: list, top_n: int) -> tuple[list[int], list]:
    """Echo with logprobs: the prompt's token ids and (logprob, top ``top_n``) of each, the first
    unscored. ``scores``: (logprob, top, rank) of each token after the first."""
    return list(ids), [(None, None), *((lp, top[:top_n]) for lp, top, _ in scores)]


def prompt_logprobs(decode: Decode, ids: list[int], scores: list, top_n: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None), its id's log-probability,
    rank and text, and the ``top_n`` most likely tokens' (ids as strings, JSON's keys)."""
    out: list = [None]
    for tok, (lp, top, rank) in zip(ids[1:], scores):
        entry = {str(tok): {"logprob": finite(lp), "rank": rank, "decoded_token": decode([tok])}}
        for r, (i, v) in enumerate(top[:top_n], 1):
            entry.setdefault(str(i), {"logprob": finite(v), "rank": r, "decoded_token": decode([i])})
        out.append(entry)
    return out


def usage(u: dict) -> dict:
    return {**u, "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def merged_usage(counts_prompt: list[bool], usages: list[dict]) -> dict:
    """A response's usage: each prompt's tokens once (``counts_prompt``: the choices whose prompt
    tokens count, each prompt's first), every choice's completion tokens; the speculative
    statistics of one choice as they are, of several summed with each choice's own under ``choices``."""
    if len(usages) == 1:
        return usage(usages[0])
    specs = [u["speculative"] for u in usages]
    proposed, accepted = sum(s["proposed"] for s in specs), sum(s["accepted"] for s in specs)
    firsts = [u for counts, u in zip(counts_prompt, usages) if counts]
    return usage({
        "prompt_tokens": sum(u["prompt_tokens"] for u in firsts),
        "completion_tokens": sum(u["completion_tokens"] for u in usages),
        "prompt_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)},
        "speculative": {"proposed": proposed, "accepted": accepted, "alpha": accepted / proposed if proposed else None,
                        "steps": sum(s["steps"] for s in specs), "choices": specs},
    })
