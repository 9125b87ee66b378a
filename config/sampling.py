"""Per-request decoding parameters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import _Strict


#: Temperatures below this are greedy decoding (as in vLLM): dividing logits by a temperature near
#: 0 overflows float32 (1e-40 gives inf - inf = NaN), and the law it approaches is the argmax anyway.
GREEDY_BELOW = 1e-5
#: a request's stop strings: at most this many, each at most this many characters (the stop check
#: and the detokenizer keep this much text per request and search it at every step)
MAX_STOPS = 4
MAX_STOP_CHARS = 256
#: the most alternatives a request's ``logprobs`` may ask for at each position (the target's
#: distribution is kept sparsely, ``engine.record_top_k`` ids a row: 16 by default)
MAX_TOP_LOGPROBS = 16
#: bounds on a request's token-keyed parameters (each is checked per step over these many ids)
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64


#: the stages of the warp after the logits processors, by llama.cpp's names (its ``samplers``)
SAMPLER_STAGES = ("temperature", "min_p", "top_k", "top_p", "top_n_sigma", "typ_p", "xtc")
#: the order the OpenAI-compatible endpoints apply them in: vLLM's for its four (the temperature
#: before the cut-offs), then llama.cpp's extra samplers
DEFAULT_ORDER = SAMPLER_STAGES
#: llama-server's default order (its own ``/completion``): the cut-offs on the model's own
#: distribution, the temperature last
LLAMA_ORDER = ("top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


#: the longest grammar a request may send (a JSON schema as text, a regular expression, a Lark or
#: GBNF grammar): it compiles when the request is queued
MAX_GRAMMAR_CHARS = 65_536


class Grammar(_Strict):
    """Structured output: the text must follow this grammar (compiled by llguidance)."""

    kind: Literal["json", "regex", "lark", "gbnf", "choice"]
    #: "json": the schema as JSON text; "choice": a JSON list of the strings, one of which is the text
    source: str = Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)


class SamplingParams(_Strict):
    """Per-request decoding parameters (OpenAI-compatible names).

    temperature 0 (or below ``GREEDY_BELOW`` = 1e-5) is greedy. top_k 0 and top_p 1 disable those
    filters; both are applied identically to the target's and the draft's distributions. Values
    must be finite; integers must be integers (``strict``: no 1.5 or True for max_tokens).
    """

    max_tokens: int = Field(default=128, gt=0, strict=True)
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0, strict=True)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(default=None, strict=True, ge=-(2**63), lt=2**64)  # torch.Generator's range
    ignore_eos: bool = False
    #: None: no log-probabilities; n: each output token's log-probability under the target (its
    #: distribution at temperature 1, as the model gives it) and the n most likely tokens' there
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    #: keep only tokens whose probability is at least ``min_p`` times the most likely one's (after
    #: temperature; vLLM's and llama.cpp's min-p); 0 disables it
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    #: OpenAI's penalties on the logits, over the tokens generated so far: ``frequency_penalty``
    #: times each token's count and ``presence_penalty`` once for each token that occurred
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    #: vLLM's (and Hugging Face's) repetition penalty over the prompt's and the output's tokens: a
    #: positive logit is divided by it, a negative one multiplied; 1 disables it (0.01 to 10: a logit
    #: divided by a smaller one overflows)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=10.0, allow_inf_nan=False)
    #: None: the three penalties count as above (vLLM's and OpenAI's). n: llama.cpp's counting,
    #: every penalty over the last n tokens of prompt and output alike (its ``repeat_last_n``); -1:
    #: all of them; 0: no penalties at all
    penalty_last_n: int | None = Field(default=None, ge=-1, strict=True)
    #: token id -> a value added to its logit (OpenAI's -100..100; -100 bans it, 100 forces it)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    #: the end-of-sequence tokens and ``stop_token_ids`` cannot be generated before this many
    #: output tokens (vLLM's min_tokens; stop strings still end the output)
    min_tokens: int = Field(default=0, ge=0, strict=True)
    #: more token ids that end the output, kept in it (vLLM's stop_token_ids)
    stop_token_ids: list[int] = Field(default_factory=list)
    #: structured output: only text the grammar accepts, ending where it is complete
    grammar: Grammar | None = None
    #: llama.cpp's samplers beyond OpenAI's (each off at its default). Locally typical sampling:
    #: keep the tokens whose surprise is closest to the distribution's entropy, up to this mass
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    #: keep the logits within n standard deviations of the largest (<= 0: off)
    top_n_sigma: float = Field(default=-1.0, le=100.0, allow_inf_nan=False)
    #: exclude top choices: with this probability, every token at least ``xtc_threshold`` likely but
    #: the least likely of them is dropped (a threshold above 0.5 turns it off, as in llama.cpp)
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=1.0, allow_inf_nan=False)
    #: dynamic temperature: the temperature moves within +- this range with the normalised entropy
    #: of the distribution (raised to ``dynatemp_exponent``)
    dynatemp_range: float = Field(default=0.0, ge=0.0, le=10.0, allow_inf_nan=False)
    dynatemp_exponent: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    #: the fewest tokens top-p, min-p, typical-p and XTC keep (0: no floor)
    min_keep: int = Field(default=0, ge=0, le=1 << 20, strict=True)
    #: the samplers in the order they apply (llama.cpp's ``samplers``; a stage left out is not
    #: applied); None: :data:`DEFAULT_ORDER`. "penalties" (applied before the warp, by the
    #: processors) and "dry" (never on here) may be named and are no stage of the warp
    samplers: tuple[Literal["temperature", "min_p", "top_k", "top_p", "top_n_sigma", "typ_p", "xtc", "penalties",
                            "dry"], ...] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[int, float]) -> dict[int, float]:
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has at most {MAX_LOGIT_BIAS} entries")
        if any(t < 0 for t in v):
            raise ValueError("logit_bias keys are token ids (>= 0)")
        if any(not (-100.0 <= b <= 100.0) for b in v.values()):  # also refuses NaN
            raise ValueError("logit_bias values are between -100 and 100")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids are token ids (>= 0)")
        return v

    @model_validator(mode="after")
    def _min_below_max(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) is more than max_tokens ({self.max_tokens})")
        if self.grammar is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("structured output ends where its grammar is complete: it takes no ignore_eos or min_tokens")
        if self.samplers is not None and len(set(self.samplers)) != len(self.samplers):
            raise ValueError(f"samplers names each stage at most once, got {list(self.samplers)}")
        if self.greedy and self.xtc_on:
            raise ValueError("xtc_probability draws at random: it needs a temperature above 0")
        return self

    @property
    def order(self) -> tuple[str, ...]:
        """The warp's stages in the order they apply."""
        return DEFAULT_ORDER if self.samplers is None else tuple(n for n in self.samplers if n in SAMPLER_STAGES)

    @property
    def chain(self) -> tuple[str, ...]:
        """Every sampler in its order, as llama.cpp names them (what a request's settings report)."""
        return ("penalties", *DEFAULT_ORDER) if self.samplers is None else self.samplers

    @property
    def xtc_on(self) -> bool:
        """Whether XTC can change the law (llama.cpp's: a probability, a threshold up to 0.5)."""
        return self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5 and "xtc" in self.order

    @property
    def greedy_rows(self) -> bool:
        """Whether greedy decoding needs the target's whole rows: a cut-off before the temperature
        that can drop the most likely token (typical-p; the others always keep it)."""
        order = self.order  # greedy: the temperature is in it
        return self.greedy and self.typical_p < 1.0 and "typ_p" in order and order.index("typ_p") < order.index("temperature")

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits are changed before a token is chosen (penalties, biases,
        min_tokens, a grammar): verification then needs the target's whole rows, greedy or not."""
        return bool(self.penalised or self.logit_bias or self.min_tokens or self.grammar is not None)

    @property
    def penalised(self) -> bool:
        """Whether a penalty changes the logits (llama.cpp's ``repeat_last_n`` 0 turns them all off)."""
        return (bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)
                and self.penalty_last_n != 0)

    def token_ids(self) -> list[int]:
        """The token ids the request names (checked against the vocabulary when it is queued)."""
        return [*self.logit_bias, *self.stop_token_ids]

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        if len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return v

    @property
    def greedy(self) -> bool:
        """The most likely token each time: a temperature below :data:`GREEDY_BELOW`, fixed (no
        dynamic range) and applied (in :attr:`order`)."""
        return self.temperature < GREEDY_BELOW and not self.dynatemp_range and "temperature" in self.order
