"""OpenAI-compatible request and response shapes (the subset served), validated at the edge.

Unknown fields are ignored (clients send many); known fields are checked strictly; parameters
that would change the output and are not served (:data:`UNSERVED`: tools, beam search,
llama.cpp's extra samplers) are accepted at their defaults and refused otherwise, never
silently ignored. Every failure becomes OpenAI's error JSON with status 400
(``invalid_request_error``).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from config import Grammar, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, MAX_TOP_LOGPROBS, SamplingParams


MAX_PROMPT_IDS = 32_768
#: OpenAI's bound on ``n``; the server's own bound on choices a request (prompts x n) is
#: ``ingress.max_choices``
MAX_N = 128
#: prompts in one completions request (a batch), before ``ingress.max_choices``
MAX_PROMPTS = 128
#: bounds on what else a client sizes (the body is at most ``ingress.max_body_bytes`` and the text of
#: the prompt or the messages at most ``ingress.max_prompt_chars``): messages in a chat, content
#: parts in a message, and the length of short string fields
MAX_MESSAGES = 256
MAX_CONTENT_PARTS = 64
MAX_NAME_CHARS = 256


def unicode_text(v: str, what: str) -> str:
    """``v``, if it is text the tokenizer can read: JSON lets a string hold a lone surrogate
    (``"\\ud800"``), which is no Unicode character and cannot be encoded."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate at character {e.start})") from None
    return v


def _text_only(v) -> bool:
    return v is None or (isinstance(v, dict) and v.get("type") in (None, "text"))


#: OpenAI's (and vLLM's and llama.cpp's common) parameters that change what is generated and that
#: this server does not serve: each with the test of its default, which is accepted (clients send
#: defaults); any other value is refused rather than silently ignored
UNSERVED = {
    "best_of": lambda v: v is None or v == 1,
    "suffix": lambda v: not v,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "guided_grammar": lambda v: not v,  # vLLM's: its dialect depends on the backend
    "guided_decoding_backend": lambda v: not v,
    "structural_tag": lambda v: not v,
    # llama.cpp's samplers beyond those served (:data:`SAMPLER_NAMES`)
    "tfs_z": lambda v: v is None or v == 1,
    "mirostat": lambda v: not v,
    "dry_multiplier": lambda v: not v,
    "n_probs": lambda v: not v,
    # vLLM's
    "use_beam_search": lambda v: not v,
    "length_penalty": lambda v: v is None or v == 1,
    "bad_words": lambda v: not v,
    "allowed_token_ids": lambda v: v is None,
    "include_stop_str_in_output": lambda v: not v,
    "skip_special_tokens": lambda v: v is None or v is True,
    "spaces_between_special_tokens": lambda v: v is None or v is True,
    "truncate_prompt_tokens": lambda v: v is None,
}


#: llama.cpp's sampler names (and its aliases: kebab-case, no dash, ``nucleus``, ``temp``, ``typ``)
#: -> the warp's stage (``config.SAMPLER_STAGES``); "penalties" and "dry" are no stage of the warp
#: (the penalties apply before it; DRY is not served, and a list may name it while it is off)
SAMPLER_NAMES = {"temperature": "temperature", "temp": "temperature", "min_p": "min_p", "min-p": "min_p",
                 "minp": "min_p", "top_k": "top_k", "top-k": "top_k", "topk": "top_k", "top_p": "top_p",
                 "top-p": "top_p", "topp": "top_p", "nucleus": "top_p", "top_n_sigma": "top_n_sigma",
                 "top-n-sigma": "top_n_sigma", "topnsigma": "top_n_sigma", "typ_p": "typ_p", "typ-p": "typ_p",
                 "typp": "typ_p", "typ": "typ_p", "xtc": "xtc", "penalties": "penalties", "dry": "dry"}
#: llama.cpp's one-letter names (its ``--sampling-seq``)
SAMPLER_CHARS = {"t": "temperature", "m": "min_p", "k": "top_k", "p": "top_p", "s": "top_n_sigma", "y": "typ_p",
                 "x": "xtc", "e": "penalties", "d": "dry"}
#: llama.cpp's sampler settings, as ``config.SamplingParams`` names them too
LLAMA_SAMPLER_FIELDS = ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
                        "dynatemp_exponent", "min_keep")
#: llama-server's default ``samplers``, by its names
LLAMA_SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]


def sampler_list(v) -> list[str]:
    """llama.cpp's ``samplers`` (a list of names, or a string of its one-letter names) as the
    canonical names: an unknown name, or one this server does not serve (``infill``,
    ``adaptive_p``), is refused rather than skipped as llama.cpp skips it."""
    if isinstance(v, str):
        names = [SAMPLER_CHARS.get(c, c) for c in v]
    elif isinstance(v, list) and all(isinstance(n, str) for n in v):
        names = [SAMPLER_NAMES.get(n.lower(), n) for n in v]
    else:
        raise ValueError("samplers is a list of sampler names or a string of their letters")
    unknown = [n for n in names if n not in SAMPLER_CHARS.values()]
    if unknown:
        raise ValueError(f"samplers: {unknown[0]!r} is not a sampler this server serves "
                         f"(it serves {', '.join(sorted(set(SAMPLER_CHARS.values())))})")
    if len(set(names)) != len(names):
        raise ValueError("samplers names each sampler at most once")
    return names


def _schema_text(schema, where: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):  # RecursionError: nested past Python's bound
            raise ValueError(f"{where} is not valid JSON") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{where} is a JSON schema: an object")
    return json.dumps(schema)


def structured_output(data: dict) -> Grammar | None:
    """The grammar a request asks its text to follow, from any of the forms clients send:
    OpenAI's ``response_format`` (``json_object``, ``json_schema``; llama.cpp's ``json_object`` with a
    ``schema``), llama.cpp's ``json_schema`` and ``grammar`` (GBNF), vLLM's ``guided_json``,
    ``guided_regex`` and ``guided_choice``. At most one of them."""
    found: list[tuple[str, Grammar]] = []
    rf = data.get("response_format")
    if rf is not None and not _text_only(rf):
        if not isinstance(rf, dict):
            raise ValueError("response_format is an object with a type")
        kind = rf.get("type")
        if kind == "json_object":
            schema = rf.get("schema") or {"type": "object"}
            found.append(("response_format", Grammar(kind="json", source=_schema_text(schema, "response_format.schema"))))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError("response_format json_schema needs json_schema.schema")
            found.append(("response_format", Grammar(kind="json", source=_schema_text(spec["schema"], "json_schema.schema"))))
        else:
            raise ValueError(f"response_format type {kind!r} is not one of text, json_object, json_schema")
    for name, kind in (("json_schema", "json"), ("guided_json", "json"), ("grammar", "gbnf"), ("guided_regex", "regex"),
                       ("guided_choice", "choice")):
        v = data.get(name)
        if not v:
            continue
        if kind == "json":
            found.append((name, Grammar(kind="json", source=_schema_text(v, name))))
        elif name == "guided_choice":
            if not isinstance(v, list) or not all(isinstance(c, str) and c for c in v):
                raise ValueError("guided_choice is a non-empty list of non-empty strings")
            found.append((name, Grammar(kind="choice", source=json.dumps(v))))
        elif isinstance(v, str):
            found.append((name, Grammar(kind=kind, source=v)))
        else:
            raise ValueError(f"{name} is a string")
    if len(found) > 1:
        raise ValueError(f"one structured output at a time, not {' and '.join(n for n, _ in found)}")
    return found[0][1] if found else None


def _token_bias(v) -> dict[int, float]:
    """OpenAI's ``{"id": bias}`` (ids as strings), or llama.cpp's ``[[id, bias], ...]``."""
    if v is None:
        return {}
    pairs = v.items() if isinstance(v, dict) else v
    if not isinstance(pairs, (list, type({}.items()))):
        raise ValueError("logit_bias maps token ids to values between -100 and 100")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError("logit_bias maps token ids to values between -100 and 100")
        key, bias = pair
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int):
            raise ValueError(f"logit_bias keys are token ids, not {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ValueError(f"logit_bias values are numbers between -100 and 100, not {bias!r}")
        out[key] = float(bias)
    return out


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(default=None, gt=0, strict=True)
    max_completion_tokens: int | None = Field(default=None, gt=0, strict=True)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, strict=True)  # an extension (vLLM has it too)
    seed: int | None = Field(default=None, strict=True)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N, strict=True)  # choices for each prompt
    stream: bool = Field(default=False, strict=True)
    stream_options: dict | None = Field(default=None, max_length=8)
    #: llama-server's: each streamed chunk carries the timings so far
    timings_per_token: bool = Field(default=False, strict=True)
    user: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    ignore_eos: bool = Field(default=False, strict=True)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)  # vLLM's and llama.cpp's
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0, allow_inf_nan=False)  # vLLM's
    #: llama.cpp's penalties: its repeat penalty, and the last n tokens (prompt's and output's; -1:
    #: all, 0: no penalties) that it and the frequency and presence penalties count. Sent (or on
    #: llama-server's own endpoint, always), all three penalties count as llama.cpp's do
    repeat_penalty: float | None = Field(default=None, ge=0.01, le=10.0, allow_inf_nan=False)
    repeat_last_n: int | None = Field(default=None, ge=-1, le=1 << 20, strict=True)
    logit_bias: dict | list | None = None
    #: llama.cpp's samplers (``config.SamplingParams`` says what each does), and their order
    typical_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_n_sigma: float | None = Field(default=None, le=100.0, allow_inf_nan=False)
    xtc_probability: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    xtc_threshold: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    dynatemp_range: float | None = Field(default=None, ge=0.0, le=10.0, allow_inf_nan=False)
    dynatemp_exponent: float | None = Field(default=None, ge=0.0, le=100.0, allow_inf_nan=False)
    min_keep: int | None = Field(default=None, ge=0, le=1 << 20, strict=True)
    samplers: list[str] | str | None = Field(default=None, max_length=64)
    min_tokens: int | None = Field(default=None, ge=0, strict=True)  # vLLM's
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # vLLM's
    #: vLLM's: the prompt's own log-probabilities, each with its rank and this many most likely tokens'
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    #: structured output, from whichever of the fields clients use for it (:func:`structured_output`;
    #: not in the schema: clients send those fields, and llama.cpp's ``grammar`` is a string)
    grammar: SkipJsonSchema[Grammar | None] = None

    @model_validator(mode="before")
    @classmethod
    def _structured(cls, data):
        if isinstance(data, dict):
            data = {**data, "grammar": structured_output(data)}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        out = _token_bias(v)
        if len(out) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has at most {MAX_LOGIT_BIAS} entries")
        if any(t < 0 for t in out) or any(not -100.0 <= b <= 100.0 for b in out.values()):
            raise ValueError("logit_bias maps token ids (>= 0) to values between -100 and 100")
        return out

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and any(isinstance(t, bool) or t < 0 for t in v):
            raise ValueError("stop_token_ids are token ids (>= 0)")
        return v

    #: more of :data:`UNSERVED`, for one endpoint; and the names of it an endpoint serves
    also_unserved: ClassVar[dict] = {}
    served_here: ClassVar[frozenset] = frozenset()
    #: the endpoint's penalties count as llama.cpp's, whatever the request names
    llama_penalties: ClassVar[bool] = False
    #: the endpoint's ``samplers`` when a request sends none (None: ``config.DEFAULT_ORDER``)
    default_samplers: ClassVar[list[str] | None] = None

    @field_validator("samplers")
    @classmethod
    def _samplers(cls, v):
        return None if v is None else sampler_list(v)

    def warp_order(self) -> tuple[str, ...] | None:
        """The samplers in the order ``samplers`` names them, else the endpoint's default (None:
        ``config.DEFAULT_ORDER``)."""
        names = self.samplers if self.samplers is not None else self.default_samplers
        return None if names is None else tuple(names)

    def check_samplers(self, params: SamplingParams) -> None:
        """The penalties apply before the warp here: while a penalty is on, a ``samplers`` that
        names them after a stage of it, or leaves them out, would be served otherwise than asked."""
        names = self.warp_order()
        if names is None or not params.penalised:
            return
        if "penalties" not in names:
            raise ValueError("samplers leaves out 'penalties' while a penalty is on")
        stages = [i for i, n in enumerate(names) if n not in ("penalties", "dry")]
        if stages and names.index("penalties") > stages[0]:
            raise ValueError("samplers: 'penalties' apply before the other samplers here (name it first)")

    @model_validator(mode="after")
    def _one_repetition_penalty(self):
        if None not in (self.repeat_penalty, self.repetition_penalty) and self.repeat_penalty != self.repetition_penalty:
            raise ValueError("send one of repeat_penalty (llama.cpp's, over the last repeat_last_n tokens) "
                             "and repetition_penalty (vLLM's, over prompt and output)")
        return self

    def penalties(self) -> dict:
        """The penalty fields of :class:`SamplingParams`: vLLM's and OpenAI's counting, or
        llama.cpp's where the endpoint or the request's names say so (``repeat_last_n`` 64 unless
        sent, as llama-server's default)."""
        llama = self.llama_penalties or self.repeat_penalty is not None or self.repeat_last_n is not None
        repetition = self.repeat_penalty if self.repeat_penalty is not None else self.repetition_penalty
        return {"frequency_penalty": self.frequency_penalty or 0.0, "presence_penalty": self.presence_penalty or 0.0,
                "repetition_penalty": 1.0 if repetition is None else repetition,
                "penalty_last_n": (64 if self.repeat_last_n is None else self.repeat_last_n) if llama else None}

    @model_validator(mode="before")
    @classmethod
    def _served(cls, data):
        if isinstance(data, dict):
            for name, default in {**UNSERVED, **cls.also_unserved}.items():
                if name in data and name not in cls.served_here and not default(data[name]):
                    raise PydanticCustomError("unserved", "{param} is not supported by this server (send its default or leave it out)",
                                              {"param": name})
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return [unicode_text(s, "a stop sequence") for s in stops]

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """OpenAI defaults: temperature 1, top_p 1 (greedy with temperature 0)."""
        fields = dict(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=self.stop or [],
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=self.top_logprob_count(),
            min_p=self.min_p or 0.0,
            **self.penalties(),
            logit_bias=self.logit_bias or {},
            min_tokens=self.min_tokens or 0,
            stop_token_ids=self.stop_token_ids or [],
            grammar=self.grammar,
            samplers=self.warp_order(),
            **{name: v for name in LLAMA_SAMPLER_FIELDS if (v := getattr(self, name)) is not None},
        )
        params = SamplingParams(**fields)
        self.check_samplers(params)
        return params

    def top_logprob_count(self) -> int | None:
        """None: no log-probabilities asked; n: with the n most likely tokens at each position."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    #: one prompt (a string or token ids) or a batch of them (strings, or lists of token ids), each
    #: answered by ``n`` choices; a token id is checked against the vocabulary by the draft replica.
    #: Validated into a list of prompts, a batch of one for a single prompt.
    prompt: list[str] | list[list[int]] = Field(min_length=1, max_length=MAX_PROMPTS)
    #: each output token's log-probability and this many most likely tokens' (OpenAI's legacy form)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    #: the prompt's text before the completion's; with ``logprobs``, the prompt's tokens and their
    #: log-probabilities before the completion's (the first token's null)
    echo: bool | None = Field(default=None, strict=True)

    def top_logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v):
        """OpenAI's four forms (a string, strings, token ids, lists of token ids) as a list of prompts."""
        def ids(x) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
        if isinstance(v, str) or ids(v):
            v = [v]
        if not isinstance(v, list) or not v:
            raise ValueError("prompt is a string, a list of token ids, or a batch of either")
        if not (all(isinstance(p, str) for p in v) or all(ids(p) for p in v)):
            raise ValueError("a batch of prompts is all strings or all lists of token ids (none empty)")
        for p in v:
            if isinstance(p, str) and not p.strip():
                raise ValueError("prompt is empty")
            if isinstance(p, list) and len(p) > MAX_PROMPT_IDS:
                raise ValueError(f"a token-id prompt has at most {MAX_PROMPT_IDS} ids")
        return [unicode_text(p, "the prompt") if isinstance(p, str) else p for p in v]

    @property
    def prompts(self) -> list[str | list[int]]:
        return list(self.prompt)


#: llama-server's sampling defaults, for its own completion endpoint's requests that leave them out
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
#: llama.cpp's "random seed" (LLAMA_DEFAULT_SEED, and -1 as clients send it)
LLAMA_RANDOM_SEEDS = (-1, 0xFFFFFFFF)


class LlamaCompletionRequest(CompletionRequest):
    """llama-server's own ``POST /completion`` (and ``/completions``): its names (``n_predict``,
    ``n_probs``, ``n_cmpl``), its sampling defaults (:data:`LLAMA_DEFAULTS`) and its conventions
    (``n_predict`` -1: as long as the server allows, here its ``default_max_tokens``; seed -1: a
    random one; ``top_k`` <= 0 and a negative temperature: off and greedy). The rest is a
    completions request's; answered in llama-server's shapes (``deployments.llama_api``)."""

    also_unserved: ClassVar[dict] = {"post_sampling_probs": lambda v: not v, "echo": lambda v: not v,
                                     "prompt_logprobs": lambda v: v is None}
    served_here: ClassVar[frozenset] = frozenset({"n_probs"})
    llama_penalties: ClassVar[bool] = True
    default_samplers: ClassVar[list[str] | None] = LLAMA_SAMPLERS
    #: each response (and streamed chunk) carries its output token ids (llama.cpp's ``tokens``)
    return_tokens: bool = Field(default=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _llama_names(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, ours in (("n_predict", "max_tokens"), ("n_probs", "logprobs"), ("n_cmpl", "n")):
            if name in data:
                v = data.pop(name)
                data.setdefault(ours, v)
        if data.get("max_tokens") == -1:
            data["max_tokens"] = None
        if data.get("logprobs") == 0:
            data["logprobs"] = None
        for name, v in LLAMA_DEFAULTS.items():
            if data.get(name) is None:
                data[name] = v
        k, t = data["top_k"], data["temperature"]
        if isinstance(k, int) and not isinstance(k, bool) and k < 0:
            data["top_k"] = 0
        if isinstance(t, (int, float)) and not isinstance(t, bool) and t < 0:
            data["temperature"] = 0.0
        if data.get("seed") in LLAMA_RANDOM_SEEDS:
            data["seed"] = None
        return data


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict]

    @field_validator("content")
    @classmethod
    def _few_parts(cls, v):
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"a message has at most {MAX_CONTENT_PARTS} content parts")
        return unicode_text(v, "a message's content") if isinstance(v, str) else v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(unicode_text(part["text"], "a message's content"))
        return "".join(parts)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """A chat's messages as the template reads them (OpenAI's ``developer`` is a system turn)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


class ChatRequest(_Request):
    also_unserved: ClassVar[dict] = {"echo": lambda v: v is None or v is False}
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool | None = Field(default=None, strict=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict]:
        return chat_messages(self.messages)

    def last_user_text(self) -> str:
        users = [m.text() for m in self.messages if m.role == "user"]
        return users[-1] if users else self.messages[-1].text()


class TemplateRequest(BaseModel):
    """``POST /apply-template`` (llama-server's): a chat's messages, as a chat request sends them."""

    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)

    def chat(self) -> list[dict]:
        return chat_messages(self.messages)


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: vLLM's ``prompt`` or llama.cpp's ``content``, tokenized as
    ``/v1/completions`` tokenizes a raw prompt. Each server's options under its own names and
    defaults: special tokens added (``add_special_tokens``, vLLM's, default true; ``add_special``,
    llama-server's, default false), special tokens' text read as those tokens (llama-server's
    ``parse_special``, default true), and each id with its piece (llama-server's ``with_pieces``)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str | None = None
    content: str | None = None
    add_special_tokens: bool | None = Field(default=None, strict=True)
    add_special: bool | None = Field(default=None, strict=True)
    parse_special: bool = Field(default=True, strict=True)
    with_pieces: bool = Field(default=False, strict=True)

    @model_validator(mode="after")
    def _one_text(self):
        if (self.prompt is None) == (self.content is None):
            raise ValueError("send the text as prompt (or content), once")
        unicode_text(self.text, "the text")
        return self

    @property
    def adds_special(self) -> bool:
        """Whether the model's special tokens (a BOS) are added: as asked, else as the server whose
        name the text came under does (vLLM's ``prompt``: yes; llama-server's ``content``: no)."""
        for asked in (self.add_special, self.add_special_tokens):
            if asked is not None:
                return asked
        return self.content is None

    @property
    def text(self) -> str:
        return self.prompt if self.prompt is not None else self.content  # type: ignore[return-value]


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids to text (vLLM's and llama.cpp's ``tokens``)."""

    model_config = ConfigDict(extra="ignore")

    tokens: list[int] = Field(max_length=MAX_PROMPT_IDS)

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        if any(isinstance(t, bool) or t < 0 for t in v):
            raise ValueError("tokens are token ids (>= 0)")
        return v


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class TargetUnavailable(RuntimeError):
    """The target model is gone (its replica died) and no replacement answered in time: retryable."""

    retry_after_s = 5


@dataclass
class GenerateRequest:
    """What the ingress asks of a draft replica (the draft id travels as the multiplexed model id)."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None  # /v1/completions: raw text, no chat template
    prompt_ids: list[int] | None = None  # /v1/completions with a token-id prompt
    messages: list[dict] | None = None  # /v1/chat/completions
    domain: str = "unknown"
    lang: str = "und"
    tenant: str | None = None
    #: output token ids already sent to the client by a replica that died: continue after them
    resume: list[int] = field(default_factory=list)
    #: the prompt's own log-probabilities, with this many most likely tokens' at each position
    #: (OpenAI's echo with logprobs, vLLM's prompt_logprobs); None: not asked
    prompt_logprobs: int | None = None


# -- what a draft replica streams back for one request, in order: Refused; or Accepted, Chunk..., Done --
@dataclass(frozen=True)
class Refused:
    """The replica did not take the request: as given (400), or overloaded (503, retry after)."""

    error: str
    status: int = 400
    retry_after: float = 1.0


@dataclass(frozen=True)
class Accepted:
    """The request runs; its prompt's length in tokens. Asked for, the prompt's token ids and each
    one's log-probability after the first, the most likely tokens' there and its rank."""

    prompt_tokens: int
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int]] | None = None


@dataclass(frozen=True)
class Chunk:
    """New output: its text and token ids (one step's, or several held up to the stream interval),
    and each token's log-probability and the most likely tokens' when the request asked for them.

    ``pieces`` splits the text by token, for streams that send a token a chunk: ``(text, n)``, the
    text of the next ``n`` tokens of the request not yet covered, oldest first. A token's text is
    final only once the next one comes, so a chunk's pieces can cover tokens of the chunk before
    it, and its last tokens can wait for the next chunk's pieces (all are covered by the request's
    last chunk). Empty: the whole text goes with the chunk's tokens and those before it.

    ``cached_tokens``, on a request's first chunk (its prompt computed by then): how many of its
    prompt's positions came from the target's prefix cache (llama-server's ``cache_n``)."""

    text: str
    tokens: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    pieces: tuple[tuple[str, int], ...] = ()
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Done:
    """The request ended: why (``stop``, ``length``, ...) and its usage (tokens, speculative stats)."""

    finish_reason: str
    usage: dict
    #: what ended it at "stop": the stop string or stop token id matched; None at EOS
    stop_reason: str | int | None = None
    #: the end-of-sequence token that ended it (not an output token: llama-server's shapes count
    #: it, OpenAI's do not), and its log-probability entry as a chunk gives a token's when asked
    eos_token: int | None = None
    eos_logprob: tuple[float, list[tuple[int, float]]] | None = None


@dataclass
class Outcome:
    """One choice's output as the ingress collected it."""

    index: int
    prompt_tokens: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list | None = None  # (logprob, [(id, logprob), ...]) per token, when asked
    end: Done | None = None
    first: float | None = None  # perf_counter of the first output text
    finished: float | None = None
    cached: int = 0  # the prompt's positions from the prefix cache, as the first chunk said (the end's usage counts)
