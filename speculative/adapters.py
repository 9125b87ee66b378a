"""Low-rank adapters (LoRA) on a draft's projections: what online learning changes, kept apart from
the base weights it does not.

A draft served on the int4 fast path is a packed copy of its float weights: 4-bit groups of 32
whose step is (max - min) / 15 of the group. A learner's update far below that step is rounded
away when the copy is packed again, so the served draft can stay where it started however many
versions the learner publishes. With adapters, the base stays packed once and never moves, and
what is learned is ``y = W x + B (A x)`` with A ([r, in]) and B ([out, r]) in float32, added in
float32 after the packed product: every learned change reaches the proposals, and a version is
only the adapters (1.3 MB for SmolLM2's two-layer draft at rank 16, against 142 MB for the
whole draft).

:class:`LoRALinear` is an ``nn.Linear`` (the base weight and bias where they were, so the fast and
lean paths and checkpoints read them as before) with two more parameters, ``lora_A`` and
``lora_B``. B starts at zero: a fresh adapter is the base draft exactly. Its weight and bias are the
base linear's own tensors, so adapter learners of many domains share one base (:func:`share_base`).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from transformers import PreTrainedModel

#: the projections of a Llama layer that take adapters
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a rank-r update: y = x W^T + b + (x A^T) B^T (the learning rate sets its size)."""

    def __init__(self, base: nn.Linear, rank: int, seed: int = 0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        # the base's own tensors (a tied head keeps sharing the embeddings): adapters never change
        # them, so drafts of several domains can hold one base between them (:func:`share_base`)
        self.weight, self.bias = base.weight, base.bias
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(rank, base.in_features, generator=gen) / base.in_features**0.5  # [r, in]
        self.lora_A = nn.Parameter(a.to(base.weight.device, base.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device, dtype=base.weight.dtype))
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.lora_A.t() @ self.lora_B.t()

    def delta(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in], B [out, r]) in float32: the update as the packed paths add it."""
        return self.lora_A.detach().float(), self.lora_B.detach().float()


def add_adapters(model: nn.Module, rank: int, targets: tuple[str, ...] = TARGETS, head: bool = True) -> nn.Module:
    """Put a rank-``rank`` adapter on every ``targets`` projection of ``model``'s decoder layers and,
    with ``head``, on its output head (where most of what a small draft learns lands), in place (a
    linear that has one already keeps it). Returns the model."""
    if rank < 1:
        raise ValueError(f"an adapter needs a rank of at least 1, not {rank}")
    lm_head = getattr(model, "lm_head", None)
    if head and isinstance(lm_head, nn.Linear) and not isinstance(lm_head, LoRALinear):
        model.lm_head = LoRALinear(lm_head, rank, seed=10_000)  # the (possibly tied) weight, frozen
    layers: nn.ModuleList = model.model.layers  # type: ignore[union-attr,assignment]  # a Llama-style decoder
    for li, layer in enumerate(layers):
        for parent in (layer.self_attn, layer.mlp):
            for name in targets:
                lin = getattr(parent, name, None)
                if isinstance(lin, nn.Linear) and not isinstance(lin, LoRALinear):
                    setattr(parent, name, LoRALinear(lin, rank, seed=li * 16 + TARGETS.index(name)))
    return model


def takes_adapters(model: nn.Module) -> bool:
    """Whether :func:`add_adapters` knows ``model``'s layout (a Llama-style decoder: ``model.layers``;
    the feature draft is not one)."""
    return isinstance(getattr(getattr(model, "model", None), "layers", None), nn.ModuleList)


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def adapter_rank(model: nn.Module) -> int:
    """The rank of ``model``'s adapters; 0 when it has none."""
    return next((m.rank for m in model.modules() if isinstance(m, LoRALinear)), 0)


def ensure_adapters(model: nn.Module, state: dict) -> bool:
    """Give ``model`` adapters of the rank ``state``'s adapter tensors have, when it has none (a
    served draft receiving its first adapter version). Returns True when it added them."""
    a = next((v for k, v in state.items() if k.endswith(".lora_A")), None)
    if a is None or has_adapters(model):
        return False
    add_adapters(model, int(a.shape[0]), head=any(k.startswith("lm_head.") for k in state))
    return True


def is_adapter_key(name: str) -> bool:
    return name.endswith(".lora_A") or name.endswith(".lora_B")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by state-dict name (what a learner publishes)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters, trainable; every other parameter of ``model`` frozen."""
    params = []
    for name, p in model.named_parameters():
        train = is_adapter_key(name)
        p.requires_grad_(train)
        if train:
            params.append(p)
    return params


def load_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """New weights for ``model``: an adapter learner's version (adapters only, added to a model that
    has none yet) goes into its adapters; any other state is a whole draft (:func:`load_whole`)."""
    if state and all(is_adapter_key(k) for k in state):
        ensure_adapters(model, state)
        missing = set(state) - set(model.state_dict())
        if missing:
            raise KeyError(f"adapters this model does not have: {sorted(missing)[:3]}")
        model.load_state_dict(state, strict=False)
        return
    load_whole(model, state)


def load_whole(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a whole draft's weights into ``model`` (strictly: every key, no other). Copies of the
    state's tensors take the parameters' places (nothing is written in place, so a base shared
    with other models stays theirs; a tied head is tied again). A model with adapters that is given
    a state without any (an operator's draft, say) becomes exactly those weights: its adapters are
    zeroed (B = 0)."""
    adapted = has_adapters(model) and not any(is_adapter_key(k) for k in state)
    if adapted:
        want = {k for k in model.state_dict() if not is_adapter_key(k)}
        if set(state) != want:  # checked before anything is written
            raise KeyError(f"a whole draft's state needs {len(want)} keys: missing {sorted(want - set(state))[:3]}, "
                           f"unexpected {sorted(set(state) - want)[:3]}")
    have = model.state_dict()
    # copies, not views of a caller's (or the object store's) memory, on each weight's device and in its dtype
    # (a learner's state is float32 on the CPU; a draft served on a GPU keeps its weights there)
    own = {k: torch.as_tensor(v).detach().to(**({"device": have[k].device, "dtype": have[k].dtype} if k in have else {}),
                                              copy=True) for k, v in state.items()}
    model.load_state_dict(own, strict=not adapted, assign=True)
    if isinstance(model, PreTrainedModel) and model.config.tie_word_embeddings:
        model.tie_weights()
    if adapted:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, LoRALinear):
                    m.lora_B.zero_()


def base_fingerprint(model: nn.Module, samples: int = 4096) -> str:
    """A short id of ``model``'s base (every tensor but the adapters): names, shapes, dtypes and an
    evenly strided sample of each tensor's values, hashed. Two bases of the same shapes but other
    values (a truncated target against a distilled draft) differ; adapters saved on one are not
    loaded on the other. Milliseconds, not a pass over every weight."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if is_adapter_key(name):
            continue
        flat = t.detach().reshape(-1)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(flat[:: max(1, flat.numel() // samples)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def base_memo(model: nn.Module) -> dict[int, torch.Tensor]:
    """``copy.deepcopy``'s memo that makes a copy of anything holding ``model`` share its base
    tensors (every one but the adapters') instead of copying them."""
    from itertools import chain

    return {id(t): t for name, t in chain(model.named_parameters(), model.named_buffers()) if not is_adapter_key(name)}


def share_base(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that owns its adapters (copied) and shares every other tensor with it
    (the same storage, not a copy): what one more domain's adapter learner costs is its adapters
    and their optimiser state, not another draft."""
    import copy

    return copy.deepcopy(model, base_memo(model))


def fused_delta(linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The adapters of linears fused into one product (their outputs stacked, as the fast path
    fuses q/k/v and gate/up): (A [sum r, in], B [sum out, sum r], block-diagonal), or None when
    none has an adapter. A linear without one contributes zero rows."""
    if not any(isinstance(lin, LoRALinear) for lin in linears):
        return None
    assert all(isinstance(lin, nn.Linear) for lin in linears)
    lins = cast(tuple[nn.Linear, ...], linears)
    dev = lins[0].weight.device
    parts = [lin.delta() if isinstance(lin, LoRALinear) else
             (torch.zeros(0, lin.in_features, device=dev), torch.zeros(lin.out_features, 0, device=dev)) for lin in lins]
    a = torch.cat([p[0] for p in parts])  # [sum r, in]
    b = torch.block_diag(*[p[1] for p in parts])  # [sum out, sum r]
    return a.contiguous(), b.contiguous()
