"""Per-request decoding parameters."""

from __future__ import annotations


from pydantic import Field, field_validator

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
        return self.temperature < GREEDY_BELOW
