"""Which models our own forwards run: a Llama-style decoder (``model.layers`` of q/k/v/o and
gate/up/down projections, silu, plain causal attention, ``lm_head``). Shared by the CPU fast path
(:mod:`speculative.fast`) and the GPU lean path (:mod:`speculative.lean`)."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel


class FastPathError(ValueError):
    """The model or device cannot run on the fast path; the message says why and what to use."""


def supports_fast_path(model: PreTrainedModel) -> str | None:
    """None when ``model`` can run on :class:`FastRunner`, else why not."""
    if str(next(model.parameters()).device) != "cpu":
        return "the int4 / int8 path runs on the CPU (on a GPU use quantize: lean, or none for Hugging Face eager)"
    return llama_shape_problem(model)


def llama_shape_problem(model: PreTrainedModel) -> str | None:
    """None when ``model`` has the Llama shape our own forwards implement (this one and
    :class:`speculative.lean.LeanRunner`), else why not."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a Llama-style decoder (model.layers + lm_head)"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        need = [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"), (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")]
        if any(not isinstance(getattr(m, n, None), nn.Linear) for m, n in need):
            return f"{type(model).__name__}: a layer lacks the Llama projections (q/k/v/o, gate/up/down)"
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (the fast path implements silu)"
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "attn_logit_softcapping", None):
        return "sliding-window or soft-capped attention is not implemented on the fast path"
    return None
