"""The runtime a model is served on, by ``ModelConfig.quantize``: the int4 / int8 fast path on a
CPU (:mod:`speculative.fast`), the lean bfloat16 path with CUDA graphs on a GPU
(:mod:`speculative.lean`), or Hugging Face eager (:class:`speculative.runner.ModelRunner`)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .fast import FastRunner
from .lean import LeanRunner
from .runner import ModelRunner
from .shape import FastPathError, llama_shape_problem, supports_fast_path


def resolve_quantize(quantize: str, model: PreTrainedModel) -> str:
    """The runtime a ``ModelConfig.quantize`` value means for ``model``: ``auto`` is int4 where the
    fast path runs (a Llama-style model on the CPU), ``lean`` for a Llama-style model on a CUDA
    device, else none; an explicit int4 / int8 / lean the model cannot run is refused with the reason."""
    why = supports_fast_path(model)
    if quantize == "auto":
        if not why:
            return "int4"
        on_cuda = next(model.parameters()).device.type == "cuda"
        return "lean" if on_cuda and not llama_shape_problem(model) else "none"
    if quantize in ("int4", "int8") and why:
        raise FastPathError(f"quantize={quantize!r}: {why}; use quantize: none")
    if quantize == "lean":
        shape = llama_shape_problem(model)
        if shape:
            raise FastPathError(f"quantize='lean': {shape}; use quantize: none")
    return quantize


def make_runner(model: PreTrainedModel, quantize: str = "none", vocab_map: torch.Tensor | None = None,
                name: str = "model", draft: bool = False, kv_tokens: int = 32768, kv_dtype: str = "float16",
                block_tokens: int = 16, compile: bool = False) -> ModelRunner:
    """The runner for ``model`` on the runtime ``quantize`` names (see :func:`resolve_quantize`).
    ``draft``: a draft's output head in the layers' bits too (the head is most of a small draft's
    cost; a target keeps 8 bits there, see :meth:`FastRunner._quantise`). ``kv_tokens`` positions
    of all sequences together fit the fast path's KV pool, in ``kv_dtype``. ``lean``: the bfloat16
    forward with CUDA graphs (:mod:`speculative.lean`; eager where there is no CUDA device);
    ``compile``: its layers fused by ``torch.compile`` first (the lean runtime only)."""
    mode = resolve_quantize(quantize, model)
    if mode == "none":
        return ModelRunner(model, vocab_map, name)
    if mode == "lean":
        return LeanRunner(model, vocab_map, name, kv_tokens=kv_tokens, kv_dtype=kv_dtype, block_tokens=block_tokens,
                          compile=compile)
    bits = 4 if mode == "int4" else 8
    return FastRunner(model, vocab_map, name, bits=bits, head_bits=bits if draft else 8, kv_tokens=kv_tokens,
                      kv_dtype=kv_dtype, block_tokens=block_tokens)


def runtime_of(runner: ModelRunner) -> str:
    """What a runner serves: ``int4`` / ``int8`` (fast path), ``lean-bf16`` (``-graphs`` with CUDA
    graphs, ``-compiled`` with its layers compiled) or ``eager-<dtype>``."""
    if isinstance(runner, FastRunner):
        return f"int{runner.bits}"
    if isinstance(runner, LeanRunner):
        return "lean-bf16" + ("-graphs" if runner.graphs else "") + ("-compiled" if runner.compiled else "")
    return "eager-" + str(next(runner.model.parameters()).dtype).removeprefix("torch.")


def own_threads(threads: int) -> None:
    """Give the calling thread ``threads`` torch intra-op threads: its own OpenMP team. torch first
    sets a thread's count from the process-wide one, once, on the thread's first parallel op; that
    happens here first, so it cannot undo this thread's count later.

    In a replica only one thread should run torch on several threads (then every other thread goes
    back to one): each thread that does gets an OpenMP team of its own, and once a process holds
    more team threads than cores libgomp cuts every team's spinning short, so each of a step's
    ~1,000 small parallel regions waits for a sleeping worker (on 2 cores, a 4-token step went from
    20 to 35 ms with a second team in the process)."""
    torch.get_num_threads()
    torch.set_num_threads(threads)
