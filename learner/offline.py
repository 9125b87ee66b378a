"""Offline distillation: train a draft by hand on the target's own greedy generations.

A script-level trainer (the online learner, fed by live ``StepResult`` rows, is separate):

1. :func:`collect_teacher_data` - one greedy generation of the target per prompt, then ONE
   teacher-forced target forward over ``prompt + output``; the target's distribution at every
   output position is kept as a sparse top-K summary (ids, probs, tail mass). Full ``[T, V]``
   logits never outlive the sample they belong to.
2. :func:`distill` - teacher-forced training of the draft on ``prompt + output`` with one of the
   sparse losses of :mod:`learner.losses`, on output positions (AdamW, gradient clipping,
   stops after ``cfg.seconds`` or ``cfg.epochs``); :func:`with_prompt_positions` extends a
   sample's rows over its prompt, from the target's features (``cfg.prompt_positions``).
3. :func:`train_draft` - workload -> split -> target + draft -> teacher data -> distil -> save.

Restricted heads (``keep_ids``): the draft's logits have ``len(keep_ids)`` columns, column j
being target id ``keep_ids[j]``. :func:`to_student_space` maps a sparse target into that index
space; target ids the head cannot emit fold into the tail bin.

Row t of a sample's sparse target is the target's distribution for the token at position
``prompt_len + t`` given ``tokens[:prompt_len + t]`` (temperature 1); with greedy outputs its
top-1 is the output token itself (up to float ties).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import random
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Sequence

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from config import layer_list
from config.learner import check_loss_name
from learner.losses import feature_regression, SparseDist, get_loss, sparse_from_logits
from speculative.adapters import adapter_parameters, add_adapters, has_adapters
from speculative.models import encode_prompt, eos_token_ids

__all__ = [
    "DistillConfig",
    "Sample",
    "collect_teacher_data",
    "served_greedy",
    "samples_for",
    "to_student_space",
    "student_logits_for",
    "draft_loss",
    "top1_agreement_on",
    "learning_rate",
    "distill",
    "continued_from",
    "train_draft",
    "with_prompt_positions",
    "save_samples",
    "load_samples",
    "main",
]

#: Logit given to the placeholder columns of :func:`to_student_space` (exp underflows to 0 in float32).
_PLACEHOLDER_LOGIT = -1.0e4


class DistillConfig(BaseModel):
    """Settings of one offline distillation run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss: Annotated[str, AfterValidator(check_loss_name)] = "forward_kl"
    #: extra keyword arguments of the loss (e.g. {"beta": 0.5} for jsd, {"temperature": 2.0})
    loss_options: dict[str, float] = Field(default_factory=dict)
    #: K of the sparse target kept per output position
    top_k: int = Field(default=64, ge=1)
    lr: float = Field(default=1e-3, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    #: max global gradient norm; 0 disables clipping
    grad_clip: float = Field(default=1.0, ge=0.0)
    #: linear learning-rate warm-up over the first steps
    warmup_steps: int = Field(default=10, ge=0)
    #: after the warm-up: ``constant``, or ``cosine``, down to 0 at the end of the run's budget
    #: (whichever of ``seconds``, ``max_steps`` and ``epochs`` it has spent the largest share of)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    #: ``bf16``: each step's forward runs under bfloat16 autocast (the weights, gradients and the
    #: optimiser stay float32; the losses upcast their inputs). About 1.25x the steps a second on a
    #: CPU with AVX-512 BF16 (and GPUs with bfloat16); likely slower where bfloat16 is emulated (AVX2; not measured).
    autocast: Literal["off", "bf16"] = "off"
    #: target greedy generation length per prompt
    max_tokens: int = Field(default=64, gt=0)
    #: prompts per target ``generate`` call while collecting (left-padded when > 1), or per batch of
    #: the served runtime's loop
    gen_batch_size: int = Field(default=8, ge=1)
    #: who writes the greedy outputs the draft learns from: ``hf``, the float model's ``generate``;
    #: ``served``, the runtime the server serves (``ModelConfig.quantize``: int4 on a CPU), its
    #: requests batched in one loop as a co-located replica runs them (1.8x the output tokens/s of
    #: ``hf`` on a 2-core CPU, and the outputs are the served target's). The distributions come from the float
    #: model's one forward either way.
    teacher_outputs: Literal["hf", "served"] = "hf"
    #: output positions per optimiser step (whole sequences are packed until this is reached)
    batch_positions: int = Field(default=512, ge=1)
    #: wall-clock budget of the training loop (evaluation not included)
    seconds: float = Field(default=300.0, gt=0.0)
    epochs: int = Field(default=3, ge=1)
    max_steps: int | None = Field(default=None, ge=1)
    seed: int = 0
    #: train the output head (for a tied head: the shared embedding matrix, see train_embeddings)
    train_head: bool = True
    #: train the input embeddings; a tied embedding/head matrix trains only if both flags are set
    train_embeddings: bool = True
    #: train on the prompt's positions as well (those after the chat template's shared prefix), with the
    #: target's distributions there read from its features: several times the positions per
    #: generated token (prompts are longer than outputs) at no extra generation; held-out agreement
    #: is still measured on output positions only
    prompt_positions: bool = False
    #: a feature draft: weight of EAGLE's feature loss (smooth L1 between the draft's predicted next
    #: feature and the target's, :func:`learner.losses.feature_regression`) added to ``loss``; 0: off
    feature_loss: float = Field(default=0.0, ge=0.0)
    #: > 0: train low-rank adapters of this rank (projections and head) on the frozen draft, and
    #: save the adapters alone (:func:`drafts.build.save_adapter`); 0: train the whole draft
    adapter_rank: int = Field(default=0, ge=0)
    log_every: int = Field(default=10, ge=1)


@dataclass
class Sample:
    """One prompt + the target's greedy output, with the target's sparse distribution per output position."""

    tokens: torch.Tensor  # [L] long, prompt + output
    prompt_len: int
    ids: torch.Tensor  # [T, K] int32 target token ids, T = L - prompt_len
    probs: torch.Tensor  # [T, K] float32, sorted descending per row
    tail: torch.Tensor  # [T] float32
    prompt: str = ""
    features: torch.Tensor | None = None  # [F, H] target features at positions 0..F-1 (feature drafts)
    #: [T] bool: the served draft proposed another token than the target's at this output position
    #: (online records; None offline)
    wrong: torch.Tensor | None = None

    @property
    def n_out(self) -> int:
        return int(self.tokens.shape[0]) - self.prompt_len

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :].tolist()

    def target(self) -> SparseDist:
        return SparseDist(ids=self.ids.long(), probs=self.probs, tail=self.tail)


# ---------------------------------------------------------------------------------------------
# Teacher data
# ---------------------------------------------------------------------------------------------


def _unwrap_target(engine_or_model: Any, tokenizer: PreTrainedTokenizerBase | None):
    """(target model, tokenizer) from a SpeculativeEngine or a bare model."""
    runner = getattr(engine_or_model, "target", None)
    if runner is not None and hasattr(runner, "model"):
        return runner.model, tokenizer if tokenizer is not None else engine_or_model.tokenizer
    return engine_or_model, tokenizer


@torch.inference_mode()
def _greedy_outputs(model: PreTrainedModel, prompts: list[list[int]], max_tokens: int, eos: set[int], pad_id: int) -> list[list[int]]:
    """Greedy outputs of ``model`` (up to and including the first EOS). Left-pads a batch."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, W]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, W]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=0,
        pad_token_id=pad_id,
        eos_token_id=sorted(eos) if eos else None,
        temperature=None,
        top_p=None,
        top_k=None,
    )  # [B, W + T]
    outputs = []
    for row in out[:, width:].tolist():
        cut = []
        for t in row:
            cut.append(t)
            if t in eos:
                break
        outputs.append(cut)
    return outputs


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Teacher data collected with the served runtime's loop interleaved with the float
    model's forwards grew by about 15 MB a prompt without it (23 GB after 1,472 prompts, though
    the samples held 0.3 MB each): glibc raises its mmap threshold after the first large frees,
    and the freed blocks stay in the heap."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)


def served_greedy(engine: Any, batch_size: int = 8) -> Callable[[list[list[int]], int], list[list[int]]]:
    """Greedy outputs written by ``engine`` (a :class:`speculative.engine.SpeculativeEngine`; its
    runtime, its proposer if any: the output is target-only's either way), ``batch_size`` requests
    stepped together: ``f(prompts, max_tokens) -> outputs``, each up to and including its first
    EOS, as :func:`_greedy_outputs` gives them."""
    from speculative.sampling import SamplingParams

    @torch.inference_mode()
    def outputs(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        done: list[list[int]] = []
        for b in range(0, len(prompts), batch_size):
            rids = [engine.add_request(list(p), params) for p in prompts[b : b + batch_size]]
            try:
                live = list(rids)
                while live:
                    engine.step_many(live)
                    live = [r for r in live if not engine.requests[r].finished]
                for r in rids:
                    st = engine.requests[r]
                    done.append(list(st.output) + ([st.eos_token] if st.eos_token is not None else []))
            finally:
                for r in rids:
                    engine.release(r)
        return done

    return outputs


@torch.inference_mode()
def _teacher_rows(model: PreTrainedModel, tokens: list[int], prompt_len: int, top_k: int,
                  features: bool = False, feature_layers: Sequence[int] = ()) -> tuple[SparseDist, torch.Tensor | None]:
    """One teacher-forced forward over ``tokens[:-1]``: the sparse top-k at the T output positions
    and, with ``features``, the target's features (its last hidden state after the final norm,
    what its head reads) at every input position, [L-1, H] float16, as verification returns them;
    with ``feature_layers``, those layers' outputs first, [L-1, (len(feature_layers) + 1) H]."""
    from speculative.runner import fused_features, layer_outputs

    device = next(model.parameters()).device
    n_out = len(tokens) - prompt_len
    ids = torch.tensor([tokens[:-1]], dtype=torch.long, device=device)  # [1, L-1]
    with layer_outputs(model, feature_layers if features else ()) as seen:
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]  # [L-1, H]
    logits = model.get_output_embeddings()(hidden[-n_out:])  # [T, V]
    feats = fused_features({i: x[0] for i, x in seen.items()}, hidden, feature_layers).to(torch.float16).cpu() if features else None
    return sparse_from_logits(logits.float().cpu(), min(top_k, logits.shape[-1])), feats


def samples_for(samples: Sequence[Sample], prompts: Sequence[str], top_k: int, features: int = 0,
                final: bool = False) -> list[Sample]:
    """The sample of each of ``prompts``, in their order, from teacher data collected for any
    superset of them (one file of every prompt serves a run on one domain's). ``features``: the
    feature width the run trains on (0: none needed); ``final``: that is the target's final
    feature alone, which is the last ``features`` columns of a fused feature too, so samples with
    fused features serve (cut to it). Raises ValueError when a prompt has no sample, or the samples
    hold another ``top_k``, no features or features of another width."""
    by_prompt = {s.prompt: s for s in samples}
    missing = [p for p in prompts if p not in by_prompt]
    if missing:
        raise ValueError(f"collected for other prompts ({len(missing)} of this run's missing, of {len(prompts)}; "
                         f"the first: {missing[0][:60]!r})")
    data = [by_prompt[p] for p in prompts]
    if any(s.ids.shape[1] != top_k for s in data):
        raise ValueError(f"collected with another top_k than {top_k}")
    if features:
        if any(s.features is None for s in data):
            raise ValueError("holds no target features (a feature draft needs them)")
        widths = sorted({int(s.features.shape[-1]) for s in data})
        if any(w != features and not (final and w % features == 0) for w in widths):
            raise ValueError(f"holds features of another width ({widths}) than the {features} this draft needs")
        if final:
            data = [dataclasses.replace(s, features=s.features[:, -features:]) for s in data]
    return data


def collect_teacher_data(
    engine_or_target_model: Any,
    tokenizer: PreTrainedTokenizerBase | None,
    prompts: Sequence[str] | Sequence[list[int]],
    max_tokens: int,
    top_k: int,
    chat_template: bool = True,
    batch_size: int = 1,
    log: Callable[[str], None] | None = None,
    features: bool = False,
    feature_layers: Sequence[int] = (),
    greedy: Callable[[list[list[int]], int], list[list[int]]] | None = None,
) -> list[Sample]:
    """One target greedy generation per prompt, then its sparse top-``top_k`` distribution at each output position
    (and, with ``features``, the target's features at every input position: what a feature draft trains on).
    ``greedy(prompts, max_tokens)`` writes the outputs (e.g. :func:`served_greedy`); default: the
    model's ``generate``, ``batch_size`` prompts a call.

    ``prompts`` are texts (encoded with ``tokenizer``, chat template applied when asked and
    available) or lists of token ids (used as given). ``engine_or_target_model`` is a
    :class:`speculative.engine.SpeculativeEngine` (its target and tokenizer are used) or a model.
    Prompts whose output is empty are skipped.
    """
    model, tokenizer = _unwrap_target(engine_or_target_model, tokenizer)
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    encoded: list[tuple[str, list[int]]] = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer")
            encoded.append((p, encode_prompt(tokenizer, p, chat_template)))
        else:
            encoded.append(("", [int(t) for t in p]))
    if any(not ids for _, ids in encoded):
        raise ValueError("empty prompt")
    eos = eos_token_ids(tokenizer, model)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = min(eos) if eos else 0
    was_training = model.training
    model.eval()
    samples: list[Sample] = []
    t0 = time.perf_counter()
    try:
        for b in range(0, len(encoded), batch_size):
            chunk = encoded[b : b + batch_size]
            if greedy is not None:
                outs = greedy([ids for _, ids in chunk], max_tokens)
            else:
                outs = _greedy_outputs(model, [ids for _, ids in chunk], max_tokens, eos, pad_id)
            for (text, ids), out in zip(chunk, outs):
                if not out:
                    continue
                tokens = ids + out
                sd, feats = _teacher_rows(model, tokens, len(ids), top_k, features, feature_layers)
                samples.append(
                    Sample(
                        tokens=torch.tensor(tokens, dtype=torch.long),
                        prompt_len=len(ids),
                        ids=sd.ids.to(torch.int32),
                        probs=sd.probs.float(),
                        tail=sd.tail.float(),
                        prompt=text,
                        features=feats,
                    )
                )
            _trim_heap()
            if log is not None:
                done = min(b + batch_size, len(encoded))
                log(f"teacher data: {done}/{len(encoded)} prompts, {time.perf_counter() - t0:.1f}s")
    finally:
        model.train(was_training)
    return samples


@torch.inference_mode()
def with_prompt_positions(samples: Sequence[Sample], head: torch.nn.Module, start: int) -> list[Sample]:
    """``samples`` that teach their prompts too: rows for positions ``start .. prompt_len - 1`` are
    prepended to the output rows, and ``prompt_len`` becomes ``start`` (the rows stay those of
    every position from ``prompt_len`` on, so every trainer reads them unchanged).

    Row t is the target's distribution of ``tokens[t]``: ``head`` (the target's output layer) over
    its final feature at t - 1 (the last H columns of a fused feature), which the samples carry (``collect_teacher_data(features=True)``); the
    output rows are kept as collected. ``start >= 1``; samples with a shorter prompt, or whose
    features stop before its end, are kept as they are."""
    if start < 1:
        raise ValueError(f"start must be >= 1 (row t reads the feature at t - 1), got {start}")
    out = []
    for s in samples:
        if s.features is None:
            raise ValueError("prompt positions are read from the target's features: collect with features=True")
        p0 = int(s.prompt_len)
        if p0 <= start or s.features.shape[0] < p0 - 1:
            out.append(s)
            continue
        final = s.features[start - 1 : p0 - 1, -head.weight.shape[1] :]  # the final features (after any fused layers')
        logits = head(final.to(head.weight.dtype))  # [p0 - start, V]
        sd = sparse_from_logits(logits.float().cpu(), int(s.ids.shape[1]))
        out.append(Sample(tokens=s.tokens, prompt_len=start, ids=torch.cat([sd.ids.to(s.ids.dtype), s.ids]),
                          probs=torch.cat([sd.probs.float(), s.probs]), tail=torch.cat([sd.tail.float(), s.tail]),
                          prompt=s.prompt, features=s.features,
                          wrong=None if s.wrong is None else torch.cat([torch.zeros(p0 - start, dtype=torch.bool), s.wrong])))
    return out


def shared_prefix_len(sequences: Sequence[torch.Tensor]) -> int:
    """Length of the token prefix every sequence starts with (a chat template's fixed system turn)."""
    if not sequences:
        return 0
    n = min(int(x.shape[0]) for x in sequences)
    first = sequences[0][:n]
    for x in sequences[1:]:
        diff = (x[:n] != first).nonzero()
        n = int(diff[0, 0]) if diff.numel() else n
        first = first[:n]
    return n


def save_samples(samples: list[Sample], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"tokens": s.tokens, "prompt_len": s.prompt_len, "ids": s.ids, "probs": s.probs, "tail": s.tail, "prompt": s.prompt,
         "features": s.features}
        for s in samples
    ]
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(rows, tmp)
    tmp.replace(path)


def extended_samples(cached: Sequence[Sample], new: Sequence[Sample], run_prompts: Sequence[str]) -> list[Sample]:
    """A teacher file's samples with ``new`` ones added, in the order a file is read by: the samples
    of other prompts first, then this run's, in ``run_prompts``' order (training, then held-out), so
    that the file's last samples are still the held-out ones of the run that wrote it."""
    by_prompt = {s.prompt: s for s in [*cached, *new]}
    ours = set(run_prompts)
    return [s for s in cached if s.prompt not in ours] + [by_prompt[p] for p in dict.fromkeys(run_prompts)]


def load_samples(path: str | Path) -> list[Sample]:
    return [Sample(**row) for row in torch.load(Path(path), weights_only=True)]


# ---------------------------------------------------------------------------------------------
# Restricted heads: target ids -> the student's column index
# ---------------------------------------------------------------------------------------------


def to_student_space(target: SparseDist, keep_ids: torch.Tensor, n_student: int | None = None) -> tuple[SparseDist, int]:
    """Map a sparse target over target ids into a restricted head's index space.

    Column j of the student is target id ``keep_ids[j]``. Named ids outside ``keep_ids`` fold
    into the tail bin (their probability is added to ``tail``). To keep the [N, K] shape with
    distinct ids per row, each folded column is renamed to a *placeholder* column
    ``n_student + r`` (r = its rank among the row's folded columns) with probability 0; the
    caller appends that many columns of a very negative logit to the student (see
    :func:`pad_placeholders`), which then carry no mass for either side and every loss equals
    the loss on (kept named ids + tail). Returns ``(mapped target, number of placeholder columns)``.

    The student's tail bin is the mass on kept ids not named in the row; with
    ``len(keep_ids) <= K`` it can be empty, so use a head larger than K.
    """
    keep_ids = keep_ids.to(torch.long).cpu()
    n_student = len(keep_ids) if n_student is None else n_student
    ids = target.ids.to(torch.long).cpu()  # [N, K]
    size = int(keep_ids.max().item()) + 1 if keep_ids.numel() else 1
    lookup = torch.full((size,), -1, dtype=torch.long)  # [size] target id -> student column or -1
    lookup[keep_ids] = torch.arange(len(keep_ids))
    col = torch.where(ids < size, lookup[ids.clamp(max=size - 1)], -1)  # [N, K]; ids past every kept id: dropped
    dropped = col < 0  # [N, K]
    probs = target.probs
    folded = (probs * dropped.to(probs.dtype)).sum(dim=-1)  # [N]
    rank = dropped.long().cumsum(dim=-1) - 1  # [N, K] rank among the row's dropped columns
    col = torch.where(dropped, n_student + rank, col)
    n_placeholder = int(dropped.sum(dim=-1).max().item()) if dropped.numel() else 0
    mapped = SparseDist(
        ids=col,
        probs=probs.masked_fill(dropped.to(probs.device), 0.0),
        tail=target.tail + folded.to(target.tail.device),
    )
    return mapped, n_placeholder


def pad_placeholders(student_logits: torch.Tensor, n_placeholder: int) -> torch.Tensor:
    """Append ``n_placeholder`` columns of a very negative logit: [N, V] -> [N, V + n_placeholder]."""
    if n_placeholder <= 0:
        return student_logits
    pad = student_logits.new_full((student_logits.shape[0], n_placeholder), _PLACEHOLDER_LOGIT)
    return torch.cat([student_logits, pad], dim=-1)


# ---------------------------------------------------------------------------------------------
# Student forward on output positions
# ---------------------------------------------------------------------------------------------


def _pad_id(model: PreTrainedModel) -> int:
    pid = getattr(model.config, "pad_token_id", None)
    return int(pid) if isinstance(pid, int) else 0


def student_logits_for(draft: PreTrainedModel, batch: Sequence[Sample]) -> torch.Tensor:
    """Teacher-forced draft logits at the output positions of ``batch``, rows in sample order: [sum T, V_draft].

    Sequences are right-padded; the decoder runs over every position (the prompt is the
    context), the head only over the output positions.
    """
    if getattr(draft, "uses_features", False):  # a feature-conditioned draft reads the target's features too
        return draft.teacher_forced_logits(batch)
    device = next(draft.parameters()).device
    lens = [int(s.tokens.shape[0]) - 1 for s in batch]  # inputs are tokens[:-1]
    width = max(lens)
    ids = torch.full((len(batch), width), _pad_id(draft), dtype=torch.long)  # [B, W]
    mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, W]
    rows, cols = [], []
    for i, s in enumerate(batch):
        ids[i, : lens[i]] = s.tokens[:-1]
        mask[i, : lens[i]] = 1
        pos = torch.arange(s.prompt_len - 1, lens[i])  # [T] positions whose next token is an output token
        rows.append(torch.full_like(pos, i))
        cols.append(pos)
    decoder = getattr(draft, draft.base_model_prefix)
    hidden = decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state  # [B, W, H]
    picked = hidden[torch.cat(rows).to(device), torch.cat(cols).to(device)]  # [sum T, H]
    return draft.get_output_embeddings()(picked)  # [sum T, V_draft]


def draft_loss(draft: PreTrainedModel, batch: Sequence[Sample], loss_fn: Callable, target: SparseDist, n_placeholder: int,
               feature_loss: float = 0.0, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The training loss of ``batch``: ``loss_fn`` of the draft's teacher-forced logits against
    ``target`` (student space, one row per selected position), plus, for a feature draft with
    ``feature_loss`` > 0, that weight times EAGLE's feature regression on the same rows (each
    pass's predicted features against the target's next ones). ``rows``: [N] bool over every
    output position of ``batch``, the ones trained on (None: all)."""
    pred = None
    if feature_loss > 0 and getattr(draft, "uses_features", False):
        logits, pred, feats, valid = draft.teacher_forced(batch)  # [(P,) N, V], [(P,) N, H], [N, H], [N]
    else:
        logits = student_logits_for(draft, batch)  # [(P,) N, V]
    if rows is not None:
        logits = logits[..., rows.to(logits.device), :]
    loss = passes_loss(loss_fn, logits, target, n_placeholder)
    if pred is not None:
        keep = valid if rows is None else valid & rows.to(valid.device)
        if bool(keep.any()):
            loss = loss + feature_loss * feature_regression(pred[..., keep, :], feats[keep]).mean()
    return loss


def passes_loss(loss_fn: Callable, logits: torch.Tensor, target: SparseDist, n_placeholder: int) -> torch.Tensor:
    """The mean loss of draft ``logits`` ([N, V_draft], or [passes, N, V_draft] for a feature draft
    in training: on the target's features, then on its own) against ``target`` (student space)."""
    if logits.dim() == 3:
        return torch.stack([loss_fn(pad_placeholders(lg, n_placeholder), target).mean() for lg in logits]).mean()
    return loss_fn(pad_placeholders(logits, n_placeholder), target).mean()


def _batch_target(batch: Sequence[Sample]) -> SparseDist:
    return SparseDist(
        ids=torch.cat([s.ids for s in batch]).long(),
        probs=torch.cat([s.probs for s in batch]),
        tail=torch.cat([s.tail for s in batch]),
    )


def _batches(samples: Sequence[Sample], positions: int, records: int | None = None) -> list[list[Sample]]:
    """Consecutive samples packed until their output positions reach ``positions`` (or their
    number ``records``)."""
    out, cur, n = [], [], 0
    for s in samples:
        cur.append(s)
        n += s.n_out
        if n >= positions or (records is not None and len(cur) >= records):
            out.append(cur)
            cur, n = [], 0
    if cur:
        out.append(cur)
    return out


@torch.no_grad()
def top1_hits_on(draft: PreTrainedModel, samples: Sequence[Sample], keep_ids: torch.Tensor | None = None, batch_positions: int = 512,
                 batch_records: int | None = None, between: Callable[[], None] | None = None) -> torch.Tensor:
    """Per output position (samples in order): the draft's teacher-forced argmax (mapped through
    ``keep_ids``) equals the target's most probable token. [sum T] bool. Batches of at most
    ``batch_positions`` output positions and ``batch_records`` samples (one sample: no padding);
    ``between`` (if given) is called before each batch and may block."""
    was_training = draft.training
    draft.eval()
    out = []
    try:
        for batch in _batches([s for s in samples if s.n_out > 0], batch_positions, batch_records):
            if between is not None:
                between()
            pred = student_logits_for(draft, batch).argmax(dim=-1).cpu()  # [N] draft columns
            if keep_ids is not None:
                pred = keep_ids.cpu()[pred]  # [N] target ids
            tgt = _batch_target(batch)
            best = tgt.probs.argmax(dim=-1, keepdim=True)
            out.append(pred == tgt.ids.gather(1, best).squeeze(1))  # [N]
    finally:
        draft.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


def top1_agreement_on(draft: PreTrainedModel, samples: Sequence[Sample], keep_ids: torch.Tensor | None = None, batch_positions: int = 512) -> float:
    """Mean of :func:`top1_hits_on`: in [0, 1]; nan without positions."""
    hits = top1_hits_on(draft, samples, keep_ids, batch_positions)
    return float(hits.float().mean()) if hits.numel() else float("nan")


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def set_trainable(draft: PreTrainedModel, cfg: Any) -> list[torch.nn.Parameter]:
    """Set ``requires_grad`` from ``cfg.train_head`` / ``cfg.train_embeddings`` (a tied matrix
    trains only when both are set; everything else always trains); returns the trainable parameters.
    A draft with adapters trains them alone."""
    if has_adapters(draft):
        return adapter_parameters(draft)
    head = draft.get_output_embeddings().weight
    emb = draft.get_input_embeddings().weight
    tied = head is emb
    for p in draft.parameters():
        p.requires_grad_(True)
    if tied:
        emb.requires_grad_(cfg.train_head and cfg.train_embeddings)
    else:
        head.requires_grad_(cfg.train_head)
        emb.requires_grad_(cfg.train_embeddings)
    return [p for p in draft.parameters() if p.requires_grad]


def learning_rate(cfg: DistillConfig, step: int, spent: float) -> float:
    """The rate of optimiser step ``step`` (0-based) once ``spent`` (in [0, 1]) of the run's budget
    is used: ``cfg.lr`` after a linear warm-up over ``cfg.warmup_steps``, then constant, or
    ``cosine``: ``cfg.lr * (1 + cos(pi * spent)) / 2``, 0 at the end of the budget."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.lr_schedule == "cosine":
        warm *= (1.0 + math.cos(math.pi * min(1.0, max(0.0, spent)))) / 2.0
    return cfg.lr * warm


def distill(
    draft: PreTrainedModel,
    samples: Sequence[Sample],
    cfg: DistillConfig = DistillConfig(),
    keep_ids: torch.Tensor | None = None,
    log: Callable[[str], None] | None = print,
    heldout: Sequence[Sample] | None = None,
) -> dict:
    """Train ``draft`` in place on ``samples`` (teacher-forced, loss on output positions only).

    AdamW at the rates of :func:`learning_rate` (a linear warm-up, then ``cfg.lr_schedule``),
    global-norm gradient clipping; stops after ``cfg.seconds`` of training, ``cfg.epochs`` passes
    or ``cfg.max_steps`` steps, whichever is first. Top-1 agreement is measured before and after on ``heldout`` (or on ``samples`` when
    no held-out set is given; ``agreement_on`` says which). Returns a JSON-serialisable history.
    """
    samples = [s for s in samples if s.n_out > 0]
    if not samples:
        raise ValueError("distill: no samples with output positions")
    n_head = draft.get_output_embeddings().weight.shape[0]
    if keep_ids is not None and len(keep_ids) != n_head:
        raise ValueError(f"keep_ids has {len(keep_ids)} ids but the draft head has {n_head} rows")
    loss_fn = get_loss(cfg.loss, **cfg.loss_options)
    eval_set = list(heldout) if heldout else samples
    agreement_on = "heldout" if heldout else "train"
    say = log or (lambda _m: None)

    before = top1_agreement_on(draft, eval_set, keep_ids, cfg.batch_positions)
    say(f"distill: {len(samples)} samples, {sum(s.n_out for s in samples)} positions; agreement({agreement_on}) before {before:.4f}")

    flags = [p.requires_grad for p in draft.parameters()]
    params = set_trainable(draft, cfg)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    keep_cpu = keep_ids.cpu() if keep_ids is not None else None
    device = next(draft.parameters()).device

    losses: list[float] = []
    steps = positions = epochs_done = 0
    stop_reason = "epochs"
    lr = 0.0
    per_run = len(_batches(samples, cfg.batch_positions)) * cfg.epochs  # steps the epochs allow
    if cfg.max_steps is not None:
        per_run = min(per_run, cfg.max_steps)
    draft.train()
    t0 = time.perf_counter()
    try:
        for epoch in range(cfg.epochs):
            order = list(samples)
            rng.shuffle(order)
            for batch in _batches(order, cfg.batch_positions):
                target = _batch_target(batch)
                n_ph = 0
                if keep_cpu is not None:
                    target, n_ph = to_student_space(target, keep_cpu)
                target = SparseDist(ids=target.ids.to(device), probs=target.probs.to(device), tail=target.tail.to(device))
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16"):
                    loss = draft_loss(draft, batch, loss_fn, target, n_ph, cfg.feature_loss)
                spent = max((time.perf_counter() - t0) / cfg.seconds, steps / per_run)
                lr = learning_rate(cfg, steps, spent)
                for g in opt.param_groups:
                    g["lr"] = lr
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                steps += 1
                positions += target.ids.shape[0]
                losses.append(float(loss.detach()))
                if steps % cfg.log_every == 0:
                    el = time.perf_counter() - t0
                    recent = losses[-cfg.log_every :]
                    say(f"step {steps} epoch {epoch} loss {sum(recent) / len(recent):.4f} ({steps / el:.2f} steps/s, {positions / el:.0f} pos/s)")
                if cfg.max_steps is not None and steps >= cfg.max_steps:
                    stop_reason = "max_steps"
                    break
                if time.perf_counter() - t0 >= cfg.seconds:
                    stop_reason = "seconds"
                    break
            else:
                epochs_done += 1
                continue
            break
    finally:
        seconds = time.perf_counter() - t0
        draft.eval()
        for p, flag in zip(draft.parameters(), flags):
            p.requires_grad_(flag)

    after = top1_agreement_on(draft, eval_set, keep_ids, cfg.batch_positions)
    say(f"distill: {steps} steps in {seconds:.1f}s ({stop_reason}); agreement({agreement_on}) {before:.4f} -> {after:.4f}")
    return {
        "steps": steps,
        "seconds": seconds,
        "steps_per_s": steps / seconds if seconds > 0 else float("nan"),
        "positions_per_s": positions / seconds if seconds > 0 else float("nan"),
        "epochs_done": epochs_done,
        "stop_reason": stop_reason,
        "loss_curve": losses,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "lr_last": lr,
        "agreement_on": agreement_on,
        "agreement_before": before,
        "agreement_after": after,
        "n_train_samples": len(samples),
        "n_train_positions": sum(s.n_out for s in samples),
        "n_eval_positions": sum(s.n_out for s in eval_set),
    }


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


def _outputs_by(cfg: DistillConfig, target: PreTrainedModel, tok: PreTrainedTokenizerBase, model_cfg: Any):
    """The writer of the teacher's greedy outputs ``cfg.teacher_outputs`` names (None: ``generate``)."""
    if cfg.teacher_outputs == "hf":
        return None
    from config import DraftConfig, EngineConfig
    from speculative.engine import SpeculativeEngine
    from speculative.runtime import make_runner

    engine = SpeculativeEngine(make_runner(target, model_cfg.quantize, name="target"), tok, None,
                               EngineConfig(model=model_cfg, draft=DraftConfig(proposers=[])))
    return served_greedy(engine, cfg.gen_batch_size)


def _split(records: list, holdout: float, seed: int) -> tuple[list, list]:
    order = list(records)
    random.Random(seed).shuffle(order)
    n_held = int(round(holdout * len(order)))
    if holdout > 0 and len(order) > 1:
        n_held = min(max(n_held, 1), len(order) - 1)
    return order[n_held:], order[:n_held]


def by_domain_in_turn(records: list) -> list:
    """``records`` taken one domain at a time in turn (each domain's own order kept), so that the
    first n of them hold every domain about equally until a domain runs out."""
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault(r.domain, []).append(r)
    return [r for row in itertools.zip_longest(*groups.values()) for r in row if r is not None]


def continued_from(adapter: str) -> dict:
    """The summary a run continuing saved adapters keeps of them: their name and their meta's
    account of how they were made (steps, seconds, agreement, settings, and what they continued in
    turn), without the list of their prompts (the new run's ``trained_prompts`` holds those)."""
    from drafts.build import read_meta

    return {"adapter": adapter, **{k: v for k, v in read_meta(adapter).items() if k != "trained_prompts"}}


def train_draft(
    workload: str | Path,
    domain: str | None,
    out: str | Path,
    draft_cfg: Any = None,
    cfg: DistillConfig = DistillConfig(),
    n_prompts: int = 60,
    holdout: float = 0.2,
    model_cfg: Any = None,
    num_threads: int | None = 2,
    teacher_cache: str | Path | None = None,
    log: Callable[[str], None] | None = print,
    exclude: str | Path | Sequence[str | Path] | None = None,
    balance_domains: bool = False,
    exclude_sources: Sequence[str] = (),
) -> dict:
    """Distil a draft for ``domain`` (None: all) of ``workload`` and save it at ``out``.

    The domain's records are split (seeded by ``cfg.seed``) into a held-out fraction
    ``holdout`` and a training part, of which the first ``n_prompts`` are used. The target is
    :class:`config.ModelConfig` (or ``model_cfg``), the draft ``draft_cfg`` (default: truncated,
    2 layers; ``kind="feature"``: a feature draft, and the teacher data then carries the target's
    features, on which it trains with its two passes); a restricted head keeps the frequent ids of
    the training prompts and the target's outputs on them. ``teacher_cache``: a file to reuse (or write) the collected teacher data;
    a file collected for more prompts serves any subset of them (e.g. one domain's), and a run
    with prompts the file lacks collects those alone and adds them (:func:`extended_samples`).
    ``exclude``: workload files (or one) whose texts must not be trained on (e.g. the benchmarks' prompts).
    ``balance_domains``: the ``n_prompts`` training prompts are drawn from each domain in turn
    (:func:`by_domain_in_turn`) rather than in the file's proportions. ``exclude_sources``: sources
    (the part of a record's ``source`` before ":") none of whose prompts are trained on, so that
    they stay sources the draft never saw.
    Returns a JSON-serialisable report; the same summary goes into the saved draft's meta.
    """
    from workloads import load_workload, without_prompts_of
    from config import DraftConfig, ModelConfig
    from drafts.build import (ADAPTER_META, adapter_base, adapter_folder, build_draft_model, prompt_digest, save_adapter,
                              save_draft, trained_prompts)
    from speculative.models import load_model

    say = log or (lambda _m: None)
    draft_cfg = draft_cfg if draft_cfg is not None else DraftConfig()
    model_cfg = model_cfg if model_cfg is not None else ModelConfig()
    if draft_cfg.adapter:  # refused before the teacher runs: continuing adapters trains them as they are
        rank = json.loads((adapter_folder(draft_cfg.adapter) / ADAPTER_META).read_text())["rank"]
        if cfg.adapter_rank != rank:
            raise ValueError(f"the adapters {draft_cfg.adapter} have rank {rank}: continue them with --adapter-rank {rank}")
    if num_threads:
        torch.set_num_threads(num_threads)
    torch.manual_seed(cfg.seed)

    records = [r for r in load_workload(workload) if domain is None or r.domain == domain]
    left_out = set(exclude_sources)
    records = [r for r in without_prompts_of(records, exclude) if r.source.split(":")[0] not in left_out]
    if not records:
        raise ValueError(f"no records of domain {domain!r} in {workload}")
    train_recs, held_recs = _split(records, holdout, cfg.seed)
    train_recs = (by_domain_in_turn(train_recs) if balance_domains else train_recs)[:n_prompts]
    train_prompts = [r.text for r in train_recs]
    held_prompts = [r.text for r in held_recs]

    t0 = time.perf_counter()
    target, tok = load_model(model_cfg)
    load_s = time.perf_counter() - t0

    cache = Path(teacher_cache) if teacher_cache else None
    # a feature draft trains on the target's features; prompt positions are read from them
    features = draft_cfg.kind == "feature" or cfg.prompt_positions
    t0 = time.perf_counter()
    run_prompts = train_prompts + held_prompts

    def collect(prompts: list[str], model: PreTrainedModel) -> list[Sample]:
        got = collect_teacher_data(
            model, tok, prompts, cfg.max_tokens, cfg.top_k, batch_size=cfg.gen_batch_size, log=say,
            features=features, feature_layers=draft_cfg.feature_layers, greedy=_outputs_by(cfg, model, tok, model_cfg),
        )
        if len(got) != len(prompts):
            raise RuntimeError("some prompts produced no output")  # keeps the train/held-out boundary simple
        return got

    if cache is not None and cache.exists():
        H = target.config.hidden_size
        need = (H * (len(draft_cfg.feature_layers) + 1) if draft_cfg.kind == "feature" else H) if features else 0
        cached = load_samples(cache)
        have = {s.prompt for s in cached}
        missing = [p for p in dict.fromkeys(run_prompts) if p not in have]
        if missing:  # a longer run over the same file: the teacher runs on its new prompts only
            say(f"teacher data: {len(cached)} samples in {cache}, collecting the {len(missing)} this run adds")
            cached = extended_samples(cached, collect(missing, target), run_prompts)
            save_samples(cached, cache)
        try:
            data = samples_for(cached, run_prompts, cfg.top_k, need, final=need == H)
        except ValueError as e:
            raise ValueError(f"teacher cache {cache}: {e}") from None
        train_s, held_s = data[: len(train_prompts)], data[len(train_prompts) :]
        say(f"teacher data: {len(data)} samples from {cache}")
    else:
        everything = collect(run_prompts, target)
        train_s, held_s = everything[: len(train_prompts)], everything[len(train_prompts) :]
        if cache is not None:
            save_samples(everything, cache)
    teacher_s = time.perf_counter() - t0
    teacher_tokens = sum(s.n_out for s in train_s + held_s)
    say(f"teacher data: {len(train_s)} train + {len(held_s)} held-out samples, {teacher_tokens} output tokens, {teacher_s:.1f}s")

    texts = train_prompts + [tok.decode(s.output, skip_special_tokens=True) for s in train_s]
    draft, keep = build_draft_model(draft_cfg, target, tok, texts)
    if cfg.adapter_rank:
        add_adapters(draft, cfg.adapter_rank)
    base = adapter_base(draft_cfg, target)
    if cfg.prompt_positions:  # after the shared prefix (and >= 2: a feature draft's first pair predicts position 2)
        start = max(2, shared_prefix_len([s.tokens[: s.prompt_len] for s in train_s]))
        train_s = with_prompt_positions(train_s, target.get_output_embeddings(), start)
        if draft_cfg.kind != "feature":
            train_s = [dataclasses.replace(s, features=None) for s in train_s]  # a token draft does not read them
    del target  # the teacher is no longer needed; free its memory before training
    coverage = None
    if keep is not None:
        kept = set(keep.tolist())
        top1 = [int(s.ids[t, 0]) for s in held_s for t in range(s.n_out)]
        coverage = sum(t in kept for t in top1) / len(top1) if top1 else None

    hist = distill(draft, train_s, cfg, keep_ids=keep, log=log, heldout=held_s or None)
    meta = {
        "domain": domain,
        "loss": cfg.loss,
        "steps": hist["steps"],
        "agreement_before": hist["agreement_before"],
        "agreement_after": hist["agreement_after"],
        "agreement_on": hist["agreement_on"],
        "seconds": hist["seconds"],
        "n_train_prompts": len(train_s),
        "n_train_positions": hist["n_train_positions"],
        # lets experiments keep to unseen prompts; a run continuing saved adapters lists theirs too
        "trained_prompts": list(dict.fromkeys([*(prompt_digest(p) for p in train_prompts),
                                               *(sorted(trained_prompts(draft_cfg.adapter)) if draft_cfg.adapter else [])])),
        "n_heldout_prompts": len(held_s),
        "train_domains": dict(collections.Counter(r.domain for r in train_recs)),
        "balance_domains": balance_domains,
        "excluded_sources": sorted(exclude_sources),
        "draft": draft_cfg.model_dump(),
        "distill": cfg.model_dump(),
        "target": model_cfg.name,
    }
    if draft_cfg.adapter:  # what it continued: the earlier run's own account, kept whole (stages nest)
        meta["continued_from"] = continued_from(draft_cfg.adapter)
    if cfg.adapter_rank:  # the adapters alone: a few MB, where a whole draft is 142 MB
        saved_bytes = save_adapter(draft, out, base, meta)
    else:
        save_draft(draft, out, keep, meta=meta)
        saved_bytes = None
    report = {
        **meta,
        "saved_bytes": saved_bytes,
        "out": str(out),
        "workload": str(workload),
        "target_load_s": load_s,
        "teacher_s": teacher_s,
        "teacher_tokens": teacher_tokens,
        "teacher_tokens_per_s": teacher_tokens / teacher_s if teacher_s > 0 else None,
        "steps_per_s": hist["steps_per_s"],
        "positions_per_s": hist["positions_per_s"],
        "stop_reason": hist["stop_reason"],
        "epochs_done": hist["epochs_done"],
        "loss_first": hist["loss_first"],
        "loss_last": hist["loss_last"],
        "loss_curve": hist["loss_curve"],
        "heldout_top1_in_head": coverage,
        "head_rows": int(draft.get_output_embeddings().weight.shape[0]),
    }
    return json.loads(json.dumps(report, default=str))


def parser() -> argparse.ArgumentParser:
    """``osd train-draft``'s options."""
    ap = argparse.ArgumentParser(prog="osd train-draft", description="Distil a draft offline from the target's greedy generations.")
    ap.add_argument("--workload", default=str(Path(__file__).resolve().parent.parent / "bench" / "data" / "workload.jsonl"))
    ap.add_argument("--domain", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", default="truncated", choices=["truncated", "fresh", "feature"],
                    help="feature: one decoder layer over the target's features (EAGLE-style), trained on them")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--feature-layers", type=layer_list, default=[],
                    help="--kind feature: target layers (0-based, comma-separated) fused with the final feature (EAGLE-3)")
    ap.add_argument("--head-vocab", type=int, default=None)
    ap.add_argument("--n-prompts", type=int, default=60)
    ap.add_argument("--holdout", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--teacher-cache", default=None)
    ap.add_argument("--loss", default="forward_kl")
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                    help="after the warm-up: constant, or cosine down to 0 at the end of the budget (--seconds)")
    ap.add_argument("--autocast", choices=["off", "bf16"], default="off",
                    help="bf16: each step's forward under bfloat16 autocast (about 1.25x the steps a second on a CPU "
                         "with AVX-512 BF16; bfloat16 is emulated on AVX2)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--teacher-outputs", choices=["hf", "served"], default="hf",
                    help="served: the greedy outputs written by the served runtime (int4 on a CPU), batched; "
                         "hf: by the float model's generate")
    ap.add_argument("--batch-positions", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--epochs", type=int, default=1000, help="upper bound; --seconds usually decides")
    ap.add_argument("--exclude", nargs="+", default=None, help="workload files whose prompts are never trained on")
    ap.add_argument("--exclude-sources", nargs="+", default=[], metavar="SOURCE",
                    help="sources (before ':' in a record's source) none of whose prompts are trained on")
    ap.add_argument("--balance-domains", action="store_true",
                    help="draw the training prompts from each domain in turn, not in the file's proportions")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--freeze-embeddings", action="store_true", help="keep the input embeddings as they start (EAGLE's practice)")
    ap.add_argument("--freeze-head", action="store_true", help="keep the output head as it starts")
    ap.add_argument("--prompt-positions", action=argparse.BooleanOptionalAction, default=False,
                    help="train on the prompts' positions too (the target's distributions there, read from its features)")
    ap.add_argument("--feature-loss", type=float, default=0.0,
                    help="--kind feature: weight of EAGLE's feature regression (smooth L1 to the target's next feature) added to the loss")
    ap.add_argument("--adapter-rank", type=int, default=0,
                    help="train rank-R adapters on the frozen draft and save them alone (0: the whole draft)")
    ap.add_argument("--init-adapter", default=None, metavar="NAME",
                    help="with --adapter-rank: start from these saved adapters (a folder, or 'shipped') instead of zero ones")
    ap.add_argument("--target", default=None, help="target model (default: the embedded one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``osd train-draft --domain code --out DIR`` (= ``python -m learner.offline``); prints the JSON report."""
    from config import DraftConfig

    a = parser().parse_args(argv)
    from config import ModelConfig

    model_cfg = ModelConfig(device=a.device, dtype=a.dtype, **({"name": a.target} if a.target else {}))
    report = train_draft(
        a.workload,
        a.domain,
        a.out,
        DraftConfig(kind=a.kind, num_layers=a.num_layers, head_vocab=a.head_vocab, feature_layers=a.feature_layers,
                    adapter=a.init_adapter),
        DistillConfig(
            loss=a.loss, top_k=a.top_k, lr=a.lr, max_tokens=a.max_tokens, batch_positions=a.batch_positions,
            seconds=a.seconds, epochs=a.epochs, seed=a.seed, teacher_outputs=a.teacher_outputs, lr_schedule=a.lr_schedule,
            autocast=a.autocast,
            train_embeddings=not a.freeze_embeddings, train_head=not a.freeze_head, prompt_positions=a.prompt_positions,
            feature_loss=a.feature_loss, adapter_rank=a.adapter_rank,
        ),
        n_prompts=a.n_prompts,
        holdout=a.holdout,
        num_threads=a.threads,
        teacher_cache=a.teacher_cache,
        exclude=a.exclude,
        balance_domains=a.balance_domains,
        exclude_sources=a.exclude_sources,
        model_cfg=model_cfg,
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
    report.pop("loss_curve", None)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
