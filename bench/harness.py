"""What the experiments share: serving a request while recording it for the learner, the learned
draft of an engine, a fixed k, and an engine factory over one loaded target. Below experiments.py,
mixture.py and overhead.py, which import it (and not each other)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch

from config import KPolicyConfig, SamplingParams
from learner.replay import LEARNED_SOURCES, RecordBuilder
from speculative.stats import SpecStats

#: every proposer source whose drafted steps count in a stream's alpha: the learned draft's
#: (token or feature) and the model-free ones
ANY_SOURCE = LEARNED_SOURCES + ("ngram", "suffix")
#: what ``serve_recorded(by_source=...)`` adds up per source
STEP_FIELDS = ("steps", "proposed", "accepted", "draft_s", "target_s")


def _draft_of(engine):
    """The learned draft's proposer (``.runner.model``, ``.runner.vocab_map``) of an engine."""
    prop = engine.proposer
    for cand in (getattr(prop, "draft", None), getattr(prop, "learned", None), prop):
        if cand is not None and hasattr(cand, "runner") and hasattr(cand, "load_state_dict"):
            return cand
    raise RuntimeError("the engine has no learned draft (DraftModelProposer)")


def _force_k(engine, k: int | None) -> None:
    """Fixed k for new requests (the k policy of a request is built from ``engine.cfg.k``)."""
    if k is not None:
        engine.cfg = engine.cfg.model_copy(update={"k": KPolicyConfig(k_max=max(k, 1), fixed_k=k)})


def _alpha(acc: int, prop: int) -> float | None:
    return acc / prop if prop else None


def rows_alpha(rows) -> float | None:
    """Summed accepted over summed proposed of per-request result rows (None: nothing proposed)."""
    return _alpha(sum(r["accepted"] for r in rows), sum(r["proposed"] for r in rows))


def _f(v) -> str:
    """A figure for a report: three decimals, "-" for none."""
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def serve_recorded(engine, prompt, params: SamplingParams, *, domain: str | None = None, draft_id: str = "draft",
                   probs_dtype: torch.dtype = torch.float32, sources: tuple[str, ...] = ("draft",),
                   stats: SpecStats | None = None, by_source: dict | None = None):
    """Serve one request (text or token ids) to the end in scope ``domain``; returns
    ``(ReplayRecord, accepted, proposed, Generation)`` with accepted / proposed counted over the
    steps that ``sources`` drafted (default: the learned draft's); ``stats``, when given, observes
    those same steps (rejections too). ``by_source``, when given, adds up every step by the source
    that drafted it ("none": a plain step; "prefill": the step that also scored the prompt):
    steps, tokens proposed and accepted, draft and target seconds."""
    b = RecordBuilder(probs_dtype=probs_dtype)
    counted = stats if stats is not None else SpecStats()
    before = (counted.accepted, counted.proposed)

    def on_step(res):
        b.add(res)
        if res.source in sources:
            counted.observe(res.proposed, res.accepted, len(res.emitted), res.draft_s, res.target_s)
        if by_source is not None:
            key = "prefill" if res.start == len(tokens) else res.source
            s = by_source.setdefault(key, dict.fromkeys(STEP_FIELDS, 0))
            for f, v in zip(STEP_FIELDS, (1, res.proposed, res.accepted, res.draft_s, res.target_s)):
                s[f] += v

    tokens = engine.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    gen = engine.generate(list(tokens), params, on_step=on_step, scope=domain)
    acc, prop = counted.accepted - before[0], counted.proposed - before[1]
    return b.finish(list(tokens) + gen.token_ids, len(tokens), domain=domain, draft_id=draft_id), acc, prop, gen


def real_engine_factory(args, texts: Sequence[str] = ()) -> Callable[[], Any]:
    """A factory over ONE loaded target: each call = a new engine with a fresh copy of the starting draft."""
    from config import DraftConfig, EngineConfig, ModelConfig
    from speculative.engine import SpeculativeEngine
    from drafts.build import build_engine
    from speculative.proposers import DraftModelProposer
    from speculative.runtime import make_runner

    model = ModelConfig(device=args.device, dtype=args.dtype, quantize=args.quantize, compile=getattr(args, "compile", False),
                        **({"name": args.target} if args.target else {}))
    ckpt = args.draft_checkpoint
    kind = getattr(args, "draft_kind", "truncated")
    if ckpt:
        from drafts.build import resolve_checkpoint  # "default" -> the cached general draft of that kind

        ckpt = str(resolve_checkpoint(ckpt, kind))
    layers = getattr(args, "feature_layers", []) if kind == "feature" else []
    cfg = EngineConfig(model=model, draft=DraftConfig(kind=kind, num_layers=args.draft_layers, head_vocab=args.head_vocab,
                                                      checkpoint=ckpt, feature_layers=layers,
                                                      adapter=getattr(args, "draft_adapter", None),
                                                      context_tokens=getattr(args, "draft_context", None)),
                       k=KPolicyConfig(k_max=max(args.k, 1), fixed_k=args.k))
    base = build_engine(cfg, texts=texts, calibrate=False)
    dp = _draft_of(base)
    start_model, keep = copy.deepcopy(dp.runner.model), dp.runner.vocab_map
    target, target_runner = base.target.model, base.target
    first = [base]

    def factory(start: str | None = None):
        """``start``: another saved draft (a domain's own) instead of the starting one, on the same target."""
        if start is not None:
            from drafts.build import build_proposer

            dcfg = cfg.draft.model_copy(update={"checkpoint": start})  # build_proposer resolves and checks it
            return SpeculativeEngine(target_runner, base.tokenizer, build_proposer(dcfg, target, base.tokenizer, texts,
                                                                                   quantize=model.quantize), cfg)
        if first:
            return first.pop()
        if kind == "feature":
            from speculative.feature import FeatureDraftProposer, FeatureRunner

            prop = FeatureDraftProposer(FeatureRunner(copy.deepcopy(start_model), keep, head_bits=dp.runner.head_bits),
                                        target.config.vocab_size)
        else:
            prop = DraftModelProposer(make_runner(copy.deepcopy(start_model), model.quantize, keep, name="draft", draft=True),
                                      target.config.vocab_size, cfg.draft.context_tokens)
        return SpeculativeEngine(target_runner, base.tokenizer, prop, cfg)  # one target runner: caches are per request id

    return factory


def unseen_by(records: Sequence[Any], checkpoint: str, kind: str = "truncated") -> list:
    """``records`` minus the prompts the saved draft ``checkpoint`` (a folder or "default" of ``kind``) was
    distilled on (its meta's ``trained_prompts``): a stream measures what the draft learns online,
    not what it memorised offline."""
    from drafts.build import SHIPPED_ADAPTER, prompt_digest, resolve_checkpoint, trained_prompts

    seen = trained_prompts(checkpoint if checkpoint == SHIPPED_ADAPTER else resolve_checkpoint(checkpoint, kind))
    return [r for r in records if prompt_digest(r.text) not in seen]
