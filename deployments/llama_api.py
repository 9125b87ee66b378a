"""llama-server's own completion API (``POST /completion``), answered in its shapes: one object
per result (an array for several), or server-sent events of partial objects ending with the
final one (``stop: true``) and no ``[DONE]``. Pure functions of what the ingress collected; the
request side is :class:`deployments.protocol.LlamaCompletionRequest`.

Its timings are the ingress's clock: ``prompt_ms`` from the request's arrival to its first
output text (routing and the queue included), ``predicted_ms`` from there to the end.
"""

from __future__ import annotations

from config import SamplingParams

from .openai_api import finite
from .protocol import Done, Outcome


def stop_type(end: Done) -> tuple[str, str]:
    """llama.cpp's ``stop_type`` and ``stopping_word``: ``limit`` at max_tokens, ``word`` at a
    stop string (the word), ``eos`` at the end of sequence (or a stop token, or a grammar's end)."""
    if end.finish_reason == "length":
        return "limit", ""
    if isinstance(end.stop_reason, str):
        return "word", end.stop_reason
    return "eos", ""


def predicted(o: Outcome) -> list[int]:
    """The tokens llama-server counts as predicted: the output's, and the end of sequence that
    ended it (not output text, but sampled, scored and counted there)."""
    assert o.end is not None
    return o.tokens + ([o.end.eos_token] if o.end.eos_token is not None else [])


def result_probabilities(decode, o: Outcome) -> list[dict] | None:
    """A result's ``completion_probabilities``: its output tokens' and, when it ended there, the
    end of sequence's (None: not asked)."""
    assert o.end is not None
    if o.logprobs is None:
        return None
    ended = [o.end.eos_logprob] if o.end.eos_logprob is not None else []
    return probabilities(decode, predicted(o), o.logprobs + ended)  # (an end without its entry is left out)


def probabilities(decode, tokens: list[int], lps: list) -> list[dict]:
    """llama.cpp's ``completion_probabilities``: each output token with its log-probability and the
    most likely tokens' (``decode``: token ids to text, special tokens as empty text, as
    llama-server renders them unless started with ``--special``)."""
    def entry(t: int, lp: float) -> dict:
        text = decode([t])
        return {"id": t, "token": text, "bytes": list(text.encode("utf-8", "replace")), "logprob": finite(lp)}

    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]} for t, (lp, top) in zip(tokens, lps)]


def pieces(ids: list[int], raw: list[bytes]) -> list[dict]:
    """``/tokenize``'s ``with_pieces``: each id with its piece, the text where its bytes are whole
    UTF-8, else the bytes (a piece of a character)."""
    def piece(b: bytes) -> str | list[int]:
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return list(b)

    return [{"id": i, "piece": piece(b)} for i, b in zip(ids, raw)]


def timings(o: Outcome, t0: float) -> dict:
    """llama.cpp's ``timings`` of one result, with its drafts' counts (``draft_n``, ``draft_n_accepted``).
    Of a result still running (no end yet: ``timings_per_token``), the timings so far, up to
    ``o.finished``, with its prompt's cached positions as its first chunk said them."""
    usage = o.end.usage if o.end is not None else {}
    eos = o.end is not None and o.end.eos_token is not None
    end = o.finished if o.finished is not None else t0
    first = o.first if o.first is not None else end
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) if o.end is not None else o.cached
    prompt_n, predicted_n = o.prompt_tokens - cached, usage.get("completion_tokens", len(o.tokens)) + eos
    prompt_ms, predicted_ms = 1e3 * (first - t0), 1e3 * (end - first)
    out = {"cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
           "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
           "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
           "predicted_n": predicted_n, "predicted_ms": predicted_ms,
           "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
           "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0}
    spec = usage.get("speculative", {})
    if spec.get("proposed"):
        out["draft_n"], out["draft_n_accepted"] = spec["proposed"], spec["accepted"]
    return out


#: llama.cpp's samplers this server does not serve, as a request's settings show them: off (a
#: request that turns one on is refused)
OFF_SAMPLERS = {"mirostat": 0, "dry_multiplier": 0.0, "n_keep": 0, "n_discard": 0, "post_sampling_probs": False}
#: the settings of those samplers, and of llama-server's chat and reasoning options, as it reports
#: them when they are off: they have no effect (llama-server's defaults)
OFF_SETTINGS = {"mirostat_tau": 5.0, "mirostat_eta": 0.1, "dry_base": 1.75,
                "dry_allowed_length": 2, "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n", ":", "\"", "*"],
                "adaptive_target": -1.0, "adaptive_decay": 0.9, "backend_sampling": False,
                "chat_format": "Content-only", "reasoning_format": "none", "reasoning_in_content": False,
                "generation_prompt": "", "grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": [], "lora": []}


def generation_settings(params: SamplingParams, model: str, stream: bool, timings_per_token: bool = False) -> dict:
    """What the result was generated with, under llama.cpp's names."""
    return {"model": model, "n_predict": params.max_tokens, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "seed": params.seed if params.seed is not None else -1, "stop": list(params.stop),
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "repeat_penalty": params.repetition_penalty,
            "repeat_last_n": 64 if params.penalty_last_n is None else params.penalty_last_n, "ignore_eos": params.ignore_eos, "n_probs": params.logprobs or 0,
            "logit_bias": [[t, b] for t, b in params.logit_bias.items()], "stream": stream, "timings_per_token": timings_per_token,
            "grammar": params.grammar.source if params.grammar is not None else "",
            "typical_p": params.typical_p, "top_n_sigma": params.top_n_sigma, "xtc_probability": params.xtc_probability,
            "xtc_threshold": params.xtc_threshold, "dynatemp_range": params.dynatemp_range,
            "dynatemp_exponent": params.dynatemp_exponent, "min_keep": params.min_keep,
            "samplers": list(params.chain), **OFF_SAMPLERS, **OFF_SETTINGS}  # their order, llama.cpp's names


def partial(o: Outcome, content: str, tokens: list[int], return_tokens: bool, probs: list[dict] | None,
            predicted_n: int | None = None) -> dict:
    """A streamed chunk: new text (and its token ids, when asked); ``predicted_n``: the tokens
    predicted so far, when not the output's (the end of sequence's own chunk)."""
    out = {"index": o.index, "content": content, "tokens": tokens if return_tokens else [], "stop": False,
           "id_slot": -1, "tokens_predicted": len(o.tokens) if predicted_n is None else predicted_n,
           "tokens_evaluated": o.prompt_tokens}
    if probs is not None:
        out["completion_probabilities"] = probs
    return out


def final(o: Outcome, prompt: str, settings: dict, t0: float, return_tokens: bool, model: str, stream: bool,
          probs: list[dict] | None = None) -> dict:
    """The result (or a stream's last event, whose text and tokens the chunks before carried).
    Its counts are llama-server's: the end of sequence that ended it is predicted, and the cache
    holds every token but the last predicted (sampled, never fed)."""
    assert o.end is not None
    kind, word = stop_type(o.end)
    tokens = predicted(o)
    out = {"index": o.index, "content": "" if stream else o.text,
           "tokens": tokens if return_tokens and not stream else [], "id_slot": -1, "stop": True, "model": model,
           "tokens_predicted": len(tokens), "tokens_evaluated": o.prompt_tokens,
           "generation_settings": settings, "prompt": prompt, "has_new_line": "\n" in o.text, "truncated": False,
           "stop_type": kind, "stopping_word": word, "tokens_cached": o.prompt_tokens + max(len(tokens) - 1, 0),
           "timings": timings(o, t0), "speculative": o.end.usage.get("speculative")}
    if probs is not None and not stream:
        out["completion_probabilities"] = probs
    return out
