"""Draft pool deployment: the drafts as Ray Serve multiplexed models, each replica running the
speculative loop of its requests.

Why multiplexing rather than one deployment per draft: the router spawns and retires drafts at run
time (a busy domain with poor acceptance gets its own), and a deployment per draft would mean
redeploying the application for each. With ``@serve.multiplexed`` a request tagged with its
draft id lands on a replica that already holds that draft, replicas load drafts on demand and
unload the least recently used, and operators scale one deployment. Published weights reach every
replica through ``DeploymentHandle.broadcast`` and are installed between steps.

Transport only. Co-located (the default), a replica is an engine replica: the target and the drafts
it serves, with one :class:`speculative.scheduler.EngineLoop` stepping every request of every
draft together (one target forward a step); a request here is a queue of the loop's events. Split,
each request runs its own loop: the engine's ``propose`` (local draft), the Target deployment's
``verify`` (one hop a step, batched there) and the engine's ``accept``.

Suffix trees see the whole pool's traffic: each replica broadcasts the outputs it finished (every
``drafts.share_outputs_s``) to the others, whose engines of the same draft id take them in
(``SpeculativeEngine.add_served``); each replica also keeps the recent outputs of each draft id, so
that a draft loaded later (after an unload, or on a new replica) starts with them. Each kept
output carries its tenant, and the replica knows the tenant of every output its trees hold
(``owners``): deleting a tenant's records (``forget_tenant``) reaches both.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import logging
import math
import time
import uuid
import weakref
from dataclasses import replace

import torch
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from config import AppConfig
from drafts.build import build_proposer, domain_proposers
from drafts.outputs import KeptOutputs, PublishedWeights
from learner.replay import LEARNED_SOURCES, RecordBuilder
from config.draft_ids import GENERAL, start_domain
from speculative import RequestError, SpeculativeEngine, TargetRows, VerifyCall
from speculative.detokenize import Detokenizer, TokenPieces
from speculative.engine import check_context, time_verify
from speculative.runtime import make_runner, resolve_quantize
from speculative.kvcache import KVCacheFull, kv_bytes_per_token
from speculative.models import chat_text, encode_messages, encode_prompt, eos_token_ids, load_tokenizer, load_weights
from speculative.scheduler import EngineLoop, Failed, Finished, Overloaded, Sequence, Started, Step, calibrate_step_cost
from speculative.summary import score_chunk
from telemetry.engine import LoopGauges
from telemetry.spec import count_step

from .loopback import NodeInfo, bind_replica_grpc, replica_meter
from .protocol import Accepted, Chunk, Done, GenerateRequest, Refused, TargetUnavailable

log = logging.getLogger("osd.drafts")


class TargetView:
    """What an engine in a draft replica knows of the target: its vocabulary, context and EOS ids
    (from the config, no weights), how to drop a finished request's cache over there and, beside
    the engine loop's runner, how to start a request from a cached prompt prefix."""

    def __init__(self, model, release, attach=None):
        self.vocab_size = model.config.vocab_size
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.eos_ids = eos_token_ids(None, model)
        self.release = release
        self._attach = attach

    def attach_prefix(self, seq_id: str, tokens: list[int], salt: str | None = None) -> int:
        # co-located: the loop's runner (called on the loop's thread, at admission); split: the target
        # replica's cache starts empty for each sequence
        return self._attach(seq_id, tokens, salt) if self._attach is not None else 0

    def verify(self, calls):  # a draft replica verifies through its async verifier, never here
        raise RuntimeError("verification in a draft replica goes through DraftPool.verifier")


class RemoteVerifier:
    """Split placement: one hop to the Target deployment per speculative step.

    When the target replica dies, the call is retried until a replacement answers (it has no
    cache for the sequence and answers None: the caller sends it whole) or ``wait_s`` runs out
    (:class:`TargetUnavailable`, which the client sees as a retryable 503)."""

    def __init__(self, handle, wait_s: float = 60.0):
        self.handle = handle
        self.wait_s = wait_s

    async def verify(self, call: VerifyCall) -> TargetRows | None:
        deadline = None  # set by the first failure
        while True:
            try:
                if deadline is None:
                    return await self.handle.verify.remote(call)
                return await asyncio.wait_for(self.handle.verify.remote(call), max(0.001, deadline - time.monotonic()))
            except (RayActorError, ActorUnavailableError, asyncio.TimeoutError) as e:
                if deadline is None:
                    deadline = time.monotonic() + self.wait_s
                    log.warning("target replica lost (%s); waiting up to %.0f s for its replacement", type(e).__name__, self.wait_s)
                if time.monotonic() >= deadline:
                    raise TargetUnavailable(f"the target model is restarting ({type(e).__name__}); retry the request") from None
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def ready(self, timeout_s: float) -> None:
        await asyncio.wait_for(self.handle.stats.remote(), timeout_s)

    def release(self, seq_id: str) -> None:
        # fire and forget (the TTL catches a lost message), from an empty context: when the request
        # was cancelled (its client left), a call made in its context would be cancelled with it
        contextvars.Context().run(self.handle.release.remote, seq_id)


class DraftPool:
    """One replica of the draft pool (undecorated: tests build it directly)."""

    def __init__(self, cfg: AppConfig, target_handle=None, learner_handle=None):
        colocated = cfg.placement == "colocated"
        if colocated:  # the engine loop's thread alone runs torch on several threads (EngineLoop.start)
            torch.set_num_threads(1)
        elif cfg.engine.model.num_threads:
            torch.set_num_threads(cfg.engine.model.num_threads)
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.engine.model.name)
        target = load_weights(cfg.engine.model)  # the truncated draft is cut from it
        self.base = build_proposer(cfg.engine.draft, target, self.tokenizer, quantize=cfg.engine.model.quantize)
        # named domains' own starting drafts (d-sql starts from sql's): built now, while the target is here
        self.starts = domain_proposers(cfg.engine.draft, target, self.tokenizer, quantize=cfg.engine.model.quantize)
        self.meter = replica_meter("DraftPool", cfg.metrics)
        self.running = 0
        self.loop: EngineLoop | None = None  # co-located: the engine loop over this replica's target
        self.loop_gauges = LoopGauges()
        if colocated:
            runtime = resolve_quantize(cfg.engine.model.quantize, target)
            per_token = kv_bytes_per_token(target.config, runtime, cfg.loop.kv_dtype, cfg.engine.model.dtype)
            budget = cfg.loop.kv_cache_bytes // per_token
            k_max = cfg.engine.k.k_max
            # the pool: the budget, plus each running request's last partly used block, plus calibration's sequences
            slack = cfg.loop.block_tokens * cfg.loop.max_running + 8 * (64 + 2 * cfg.loop.block_tokens)
            runner = make_runner(target, cfg.engine.model.quantize, name="target", kv_tokens=budget + slack,
                                 kv_dtype=cfg.loop.kv_dtype, block_tokens=cfg.loop.block_tokens,
                                 compile=cfg.engine.model.compile)
            self.kv_bytes_per_token = per_token
            runner.prefix_caching = cfg.loop.prefix_cache
            if cfg.loop.prefix_cache_bytes is not None:
                runner.limit_prefix_cache(cfg.loop.prefix_cache_bytes // per_token)
            runner.drop_float_weights()  # the target never takes new weights: a packed copy is all it needs
            self.loop = EngineLoop(runner, cfg.loop, budget, k_max, on_step=self._count_forward)
            self.loop.start(name=f"engine-loop-{id(self):x}",
                            threads=cfg.target.num_threads or cfg.engine.model.num_threads)

            def prepare():  # on the loop's thread: CUDA graphs before the first request, then the target's costs
                runner.warmup(tuple(1 << i for i in range(cfg.loop.max_running.bit_length())))
                return time_verify(runner, k_max), calibrate_step_cost(runner) if cfg.loop.batch_k_cap else None

            self.verify_s, self.loop.step_cost = self.loop.call(prepare).result()
            self.verifier = None
            self.view = TargetView(target, runner.release, runner.attach_prefix)
        else:
            self.verifier = RemoteVerifier(target_handle, cfg.drafts.target_wait_s)
            self.verify_s = None  # asked of the target deployment when the first draft loads
            self.view = TargetView(target, self.verifier.release)
        self.learner = learner_handle  # finished requests' replay records go there (None: no learning)
        del target  # split: the weights live in the Target deployment only
        # drafts loaded in this replica; whoever loads them holds them (multiplexing's LRU cache)
        self.engines: weakref.WeakValueDictionary[str, SpeculativeEngine] = weakref.WeakValueDictionary()
        #: the published weights of the drafts loaded here, and of at most ``drafts_per_replica`` in
        #: all (another asks the learner when it loads)
        self.published = PublishedWeights(cfg.drafts.drafts_per_replica, lambda d: d in self.engines)
        # recent finished outputs by draft id, this replica's and the others', and whose they are
        # (bounded: beyond what the trees of every loaded draft and the kept outputs can hold)
        sx = cfg.engine.draft.suffix
        self.outputs = KeptOutputs(sx.max_requests, sx.max_scopes, sx.max_requests * sx.max_scopes * (cfg.drafts.drafts_per_replica + 1))
        self.peers = None  # the pool's handle, when outputs are shared (the deployment sets it)
        self.name = "replica"

    # -- drafts ----------------------------------------------------------------------------
    async def engine_for(self, draft_id: str) -> SpeculativeEngine:
        if self.verify_s is None:
            self.verify_s = await self.verifier.handle.verify_costs.remote()
        start = self.starts.get(start_domain(draft_id, self.starts), self.base)
        # the draft's weights, float and packed, are the start's own (new weights take their places,
        # never write into them): a draft id costs its adapters and caches, not another draft, and
        # the engine loop runs the drafts of one start in one forward (EngineLoop._propose)
        draft = start.draft if start is not None else None
        engine = SpeculativeEngine(self.view, self.tokenizer,
                                   copy.deepcopy(start, draft.runner.share_memo() if draft is not None else None),
                                   self.cfg.engine)
        weights = self.published.get(draft_id)
        if self.learner is not None and engine.learned_draft is not None and weights is None:
            # the newest weights (after a restart), or a new draft's fork of its parent's
            try:
                latest = await asyncio.wait_for(self.learner.latest.remote(draft_id), self.cfg.drafts.learner_wait_s)
            except (asyncio.TimeoutError, RayActorError, ActorUnavailableError) as e:  # serving never waits on learning
                log.warning("draft %r: no answer from the learner (%s); serving its starting weights", draft_id,
                            type(e).__name__)
                self.meter.inc("osd_draft_pool_learner_unanswered_total", draft=draft_id)
                latest = None
            weights = self.published.get(draft_id)  # a broadcast may have come meanwhile
            if latest is not None and self.published.offer(draft_id, *latest):
                weights = latest
        if weights is not None and engine.learned_draft is not None:
            engine.swap_draft(*weights)
        if engine.learns_from_traffic:  # what was served of this draft before it loaded here
            for rid, scope, ids, _ in self.outputs.of(draft_id):
                engine.add_served(rid, ids, scope)
        engine.calibrate(verify_s=self.verify_s)
        self.engines[draft_id] = engine
        return engine

    def load_weights(self, draft_id: str, state_ref: list, version: int) -> int:
        """A published update (``state_ref``: ``[ObjectRef]`` or ``[state dict]``): staged into
        the loaded engine (installed before its next step) and kept for later loads."""
        state = state_ref[0]
        if not isinstance(state, dict):
            import ray

            state = ray.get(state)
        if self.published.offer(draft_id, state, version):
            engine = self.engines.get(draft_id)
            if engine is not None and engine.learned_draft is not None:
                engine.stage_draft(state, version)
                if self.loop is not None:  # installed at the loop's next step boundary, requests running or not
                    self.loop.call(engine.install_staged)
        return self.published.version(draft_id)

    # -- outputs shared between replicas (suffix trees) -----------------------------------------
    async def add_served(self, origin: str, items: list) -> int:
        """Outputs another replica finished, ``(draft id, request id, scope, ids, tenant)``: into this
        replica's loaded engines of those drafts, and kept for drafts loaded later. A replica's own
        broadcast comes back to it and is ignored."""
        if origin == self.name:
            return 0
        for draft_id, rid, scope, ids, *rest in items:
            self.outputs.remember(draft_id, (rid, scope, ids, rest[0] if rest else None))
            engine = self.engines.get(draft_id)
            if engine is not None:
                await self._on_engine(lambda e=engine, r=rid, i=ids, s=scope: e.add_served(r, i, s))
        self.meter.inc("osd_draft_pool_outputs_shared_total", len(items), direction="received")
        return len(items)

    async def served_ids(self, draft_id: str) -> dict:
        """Request ids of the outputs this replica keeps for ``draft_id`` (its own and the others')
        and of those in its loaded engine's suffix trees (None when not loaded here); async: read
        on the loop that appends to them."""
        engine = self.engines.get(draft_id)
        trees = None if engine is None else await self._on_engine(lambda: sorted(engine.served_ids()))
        return {"kept": [item[0] for item in self.outputs.of(draft_id)], "trees": trees}

    async def forget_tenant(self, tenant: str) -> dict:
        """A tenant's records are deleted: its outputs leave this replica's kept outputs, its outbox
        and the suffix trees of its loaded engines (on the engine loop's thread, between two steps),
        so that no draft here proposes its text again, and its prompts' blocks leave the prefix
        cache. Returns how many left each."""
        kept, ids = self.outputs.forget_tenant(tenant)
        trees = 0
        for engine in list(self.engines.values()):
            if engine.learns_from_traffic:
                trees += await self._on_engine(lambda e=engine: e.forget_served(ids))
        prefixes = 0
        if self.loop is not None:  # its prompts' cached KV blocks
            prefixes = await self._on_engine(lambda: self.loop.forget_prefixes(tenant))
        return {"kept": kept, "trees": trees, "prefixes": prefixes}

    def apply_template(self, messages: list[dict]) -> str:
        """A chat's text in the target's template, as a chat request's prompt is made."""
        return chat_text(self.tokenizer, messages)

    async def _score_prompt(self, prompt: list[int], n: int) -> list:
        """The prompt's own log-probabilities (:func:`speculative.summary.prompt_logprobs`): one
        forward of the engine loop's runner over the prompt, every position's row, a prefill chunk
        between two steps at a time (the other requests go on in between), its KV positions held
        from the loop's budget meanwhile (none free: :class:`KVCacheFull`, a 503)."""
        loop = self.loop
        if loop is None:  # split placement: the target's weights are in another deployment
            raise RequestError("the prompt's log-probabilities (echo with logprobs) are served by the co-located "
                               "placement only")
        need, chunk, seq = len(prompt), self.cfg.loop.prefill_chunk, f"prompt-logprobs-{uuid.uuid4().hex}"
        if not await self._on_engine(lambda: loop.reserve(need)):
            raise KVCacheFull(f"scoring a prompt of {need} tokens needs that many KV positions; the running requests "
                              f"hold {loop.reserved} of {loop.budget_tokens}")
        out: list = []

        def step(start: int) -> list:
            t = time.perf_counter()
            try:
                return score_chunk(loop.target, seq, prompt, start, n, chunk)
            finally:
                self.meter.inc("osd_engine_prompt_scoring_seconds_total", time.perf_counter() - t)

        def release() -> None:
            loop.target.release(seq)
            loop.unreserve(need)

        try:
            for start in range(0, len(prompt) - 1, chunk):
                out += await self._on_engine(lambda s=start: step(s))
        finally:  # (not awaited: also when the client left meanwhile)
            loop.call(release)
        self.meter.inc("osd_engine_prompt_scored_tokens_total", len(out))
        return out

    async def _on_engine(self, fn):
        """``fn()`` where the engines run: on the engine loop's thread between two steps (co-located), else here."""
        if self.loop is None:
            return fn()
        return await asyncio.wrap_future(self.loop.call(fn))

    async def kept(self) -> list[tuple]:
        """Every output this replica keeps, ``(draft id, request id, scope, ids, tenant)``, oldest draft first."""
        return self.outputs.all()

    async def catch_up(self) -> int:
        """A replica just started (scaling out, or replacing one that died) takes in what the
        running replicas keep, so that its suffix trees do not start empty; returns how many."""
        if self.peers is None:
            return 0
        seen = {(item[0], item[1]) for item in self.outputs.all()}
        fresh = []
        for answer in await self.peers.broadcast("kept").results_async():
            for item in answer:
                if (item[0], item[1]) not in seen:
                    seen.add((item[0], item[1]))
                    fresh.append(item)
        return await self.add_served("peers", fresh) if fresh else 0

    async def share_served(self) -> int:
        """Send the outputs finished here since the last call to every replica of the pool."""
        if self.peers is None or not self.outputs.outbox:
            return 0
        batch = self.outputs.take_outbox()
        await self.peers.broadcast("add_served", self.name, batch).results_async()
        self.meter.inc("osd_draft_pool_outputs_shared_total", len(batch), direction="sent")
        return len(batch)

    async def ready(self, timeout_s: float = 3.0) -> bool:
        """This replica answers and so does the target it verifies with (split placement)."""
        if self.verifier is not None:
            await self.verifier.ready(timeout_s)
        return True

    def versions(self) -> dict[str, int]:
        return {d: e.draft_version for d, e in self.engines.items()}

    def telemetry(self) -> dict:
        self.meter.set("osd_draft_pool_requests_running", self.running)
        self.meter.set("osd_draft_pool_drafts_loaded", len(self.engines))
        if self.loop is not None:
            self.loop_gauges.update(self.meter, self.loop, self.kv_bytes_per_token)
        return self.meter.snapshot()

    def _count_forward(self, calls: int, tokens: int, seconds: float) -> None:
        """One target forward of the engine loop (called on its thread; the meter is thread-safe)."""
        m = self.meter
        m.inc("osd_target_batches_total")
        m.inc("osd_target_verify_calls_total", calls)
        m.inc("osd_target_verified_tokens_total", tokens)
        m.observe("osd_target_batch_size", calls)
        m.observe("osd_target_forward_seconds", seconds)
        if self.loop is not None and self.loop.last_decision is not None:  # a step several decoding requests shared
            m.inc("osd_engine_shared_steps_total", decision=self.loop.last_decision)

    def _count_step(self, res, labels: dict, waited_s: float) -> None:
        # the learned draft's version, or the model-free proposer that drafted ("ngram", "suffix")
        version = res.draft_version if res.source in LEARNED_SOURCES else res.source
        count_step(self.meter, labels, k=len(res.draft_tokens), accepted=res.accepted, emitted=len(res.emitted),
                   proposer=res.source, version=version, draft_s=res.draft_s, waited_s=waited_s, cost=res.cost)

    # -- one request ------------------------------------------------------------------------
    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.prompt_ids is not None:
            bad = [i for i in req.prompt_ids if not 0 <= i < len(self.tokenizer)]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {len(self.tokenizer)})")
            return list(req.prompt_ids)
        try:
            if req.messages is not None:
                return encode_messages(self.tokenizer, req.messages)
            return encode_prompt(self.tokenizer, req.prompt or "", chat_template=False)
        except (TypeError, ValueError) as e:  # text the tokenizer cannot read (the edge checks for it too)
            raise RequestError(f"the prompt cannot be tokenized ({e})") from None

    async def generate(self, req: GenerateRequest, engine: SpeculativeEngine, draft_id: str = GENERAL):
        """Stream one request: :class:`Accepted` (or :class:`Refused`: 503 with a retry time when the
        replica is overloaded), then a :class:`Chunk` per step, then :class:`Done`."""
        try:
            prompt = self._prompt_ids(req)
            scored = None
            if req.prompt_logprobs is not None:  # (a prompt past the model's context is refused first, as the engine would)
                check_context(len(prompt), req.params.max_tokens, self.view.max_positions)
                scored = await self._score_prompt(prompt, req.prompt_logprobs)
        except RequestError as e:
            yield Refused(str(e))
            return
        except KVCacheFull as e:  # the running requests hold the KV pool: retry later
            yield Refused(str(e), 503, 1.0)
            return
        if self.learner is not None:  # traffic: a learner sharing the machine keeps its rounds for the gaps
            contextvars.Context().run(self.learner.touch.remote)  # fire and forget, outside this request's context
        if engine.learns_from_traffic:  # its output joins the trees, even if it is cancelled: whose it is
            self.outputs.own(req.request_id, req.tenant)
        # scope: per-domain acceptance priors and suffix trees (an isolated tenant has its own engine)
        events = self._loop_events(req, engine, prompt) if self.loop is not None else self._own_events(req, engine, prompt)
        first = await events.__anext__()
        if isinstance(first, Failed):
            if isinstance(first.error, Overloaded):
                self.meter.inc("osd_engine_requests_overloaded_total")
                yield Refused(str(first.error), 503, first.error.retry_after_s)
            else:
                yield Refused(str(first.error))
            return
        output = list(req.resume)  # the output so far (resumed: what was sent before is context)
        # each token's own text (the text sent before, resumed: final text depends on the ids only)
        split = TokenPieces(Detokenizer(self.tokenizer, req.params.stop), output)
        labels = {"tenant": req.tenant or "anonymous", "domain": req.domain, "language": req.lang, "draft": draft_id}
        self.running += 1
        record = RecordBuilder() if self.learner is not None and engine.learned_draft is not None else None
        waited = 0.0  # seconds this request waited on verification (hop + batching + target compute)
        # the first text at once, then at most one chunk an interval; a step whose text is held
        # back (the detokeniser keeps the newest token until the next one shows it is final, so the
        # prefill's token alone has none) waits for text instead of starting the interval's clock
        interval, sent_at = self.cfg.drafts.stream_interval_s, -math.inf
        held_pieces: list[tuple[str, int]] = []
        held_tokens: list[int] = []
        held_lps: list | None = [] if req.params.logprobs is not None else None
        eos_lp = None  # the end of sequence's log-probability entry, when asked and it ended the request
        cached: int | None = None  # the prompt's cached positions, said once: on the first chunk
        sent_cached = False
        try:
            yield Accepted(first.prompt_tokens, prompt if scored is not None else None, scored)
            async for ev in events:
                if isinstance(ev, Failed):
                    raise ev.error
                if isinstance(ev, Finished):
                    st = ev.state
                    held_pieces += split.add(output, 0, finished=True)
                    if held_tokens or held_pieces:  # cut short (a stop, a cancellation) while held
                        yield _chunk(held_pieces, held_tokens, held_lps, None if sent_cached else st.cached_tokens)
                    break
                res, wait = ev.result, ev.waited
                if cached is None:  # the prompt is computed: from the cache, or by this first step
                    now_st = engine.requests.get(res.request_id)
                    cached = now_st.cached_tokens if now_st is not None else 0
                waited += wait
                self._count_step(res, labels, wait)
                if record is not None:
                    record.add(res)
                output += res.emitted
                held_pieces += split.add(output, len(res.emitted), res.finished)
                held_tokens += res.emitted
                if held_lps is not None:
                    held_lps += res.logprobs or []
                eos_lp = res.eos_logprob or eos_lp
                now = time.perf_counter()
                if res.finished or (now - sent_at >= interval and (interval == 0 or any(t for t, _ in held_pieces))):
                    yield _chunk(held_pieces, held_tokens, held_lps, None if sent_cached else cached)
                    held_pieces, held_tokens, sent_at, sent_cached = [], [], now, True
                    held_lps = [] if held_lps is not None else None
            s = st.stats
            if engine.learns_from_traffic and st.output:  # the other replicas' suffix trees learn it too
                self.outputs.finished(draft_id, req.request_id, req.domain, st.output, req.tenant, share=self.peers is not None)
            if record is not None and s.drafts:  # the draft proposed: its misses are signal
                self.learner.record.remote(record.finish(st.tokens, st.prompt_len, req.domain, req.tenant, draft_id))
            yield Done(
                st.finish_reason,
                {
                    "prompt_tokens": st.prompt_len,
                    "completion_tokens": len(st.output),
                    "prompt_tokens_details": {"cached_tokens": st.cached_tokens},
                    "speculative": {
                        "resumed_after": len(req.resume),  # output tokens decoded before a replica failed
                        "proposed": s.proposed,
                        "accepted": s.accepted,
                        "alpha": s.alpha,
                        "token_acceptance": s.token_acceptance,  # accepted / (accepted + rejected)
                        "mean_acceptance_length": s.mean_acceptance_length,
                        "mean_k": s.proposed / s.steps if s.steps else 0.0,
                        "steps": s.steps,
                        # per step: waiting for verification, and the target's compute within it
                        # (the rest is the hop, batching delay and other requests' rows)
                        "verify_wait_ms": 1e3 * waited / s.steps if s.steps else 0.0,
                        "target_ms": 1e3 * s.target_s / s.steps if s.steps else 0.0,
                        "domain": req.domain,
                        "language": req.lang,
                        "draft_id": draft_id,
                        "draft_version": engine.draft_version,
                    },
                },
                st.stop_reason,
                st.eos_token,
                eos_lp,
            )
        finally:
            self.running -= 1
            await events.aclose()

    async def _loop_events(self, req: GenerateRequest, engine: SpeculativeEngine, prompt: list[int]):
        """Co-located: the request joins the replica's engine loop; its events come back through a
        queue fed from the loop's thread. A consumer that stops (the client left) cancels it there."""
        queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        seq = Sequence(engine, req.request_id, prompt, req.params, lambda ev: aloop.call_soon_threadsafe(queue.put_nowait, ev),
                       scope=req.domain, resume=list(req.resume), cache_salt=req.tenant)
        self.loop.submit(seq)
        done, last = False, time.perf_counter()
        try:
            while not done:
                ev = await queue.get()
                done = isinstance(ev, (Finished, Failed))
                if isinstance(ev, Step):  # waited: since the previous step (the loop's whole step, all requests)
                    now = time.perf_counter()
                    ev.waited, last = now - last, now
                yield ev
        finally:
            if not done:
                self.loop.cancel(seq)

    async def _own_events(self, req: GenerateRequest, engine: SpeculativeEngine, prompt: list[int]):
        """Split: this request's own loop, with one hop to the Target deployment per step."""
        try:
            rid = engine.add_request(prompt, req.params, req.request_id, scope=req.domain)
        except RequestError as e:
            yield Failed(e)
            return
        st = engine.requests[rid]
        try:
            try:
                if req.resume:  # the same request after a replica failure: its output so far is context
                    engine.resume(rid, req.resume)
            except RequestError as e:
                yield Failed(e)
                return
            yield Started(st.prompt_len)
            while not st.finished:
                pending = engine.propose(rid)  # 1. draft (here)
                t0 = time.perf_counter()
                rows = await self.verifier.verify(pending.call)  # 2. verify (the target, batched)
                if rows is None:  # the target dropped this cache (TTL, LRU, restart): send it whole
                    whole = replace(pending.call, start=0, tokens=st.tokens[: pending.call.start] + pending.call.tokens)
                    rows = await self.verifier.verify(whole)
                ev = Step(engine.accept(pending, rows))  # 3. accept (here)
                ev.waited = time.perf_counter() - t0
                yield ev
            yield Finished(st)
        finally:
            engine.release(rid)


def _chunk(pieces: list[tuple[str, int]], tokens: list[int], logprobs: list | None, cached: int | None = None) -> Chunk:
    """What the steps held since the last chunk became: their text, each token's own piece, the ids
    (and on the first, the prompt's cached positions)."""
    return Chunk("".join(t for t, _ in pieces), tokens, logprobs, tuple(pieces), cached)


@serve.deployment(name="DraftPool", max_ongoing_requests=16)
class DraftPoolDeployment(DraftPool, NodeInfo):
    """The pool as a deployment: ``generate`` is called with ``multiplexed_model_id=draft_id``."""

    def __init__(self, cfg: AppConfig, target_handle=None, learner_handle=None):
        bind_replica_grpc(cfg.replica_grpc_host)
        super().__init__(cfg, target_handle, learner_handle)

        async def load(draft_id: str) -> SpeculativeEngine:  # a closure: the cap comes from config
            return await self.engine_for(draft_id)

        self._load = serve.multiplexed(max_num_models_per_replica=cfg.drafts.drafts_per_replica)(load)
        if learner_handle is not None:  # a learner sharing the machine keeps its rounds for the gaps in traffic
            self._touch_task = asyncio.get_running_loop().create_task(self._touch_while_running())
        # the general draft loads now, not on the first request (which would wait 0.6 s for it)
        self._preload_task = asyncio.get_running_loop().create_task(self._preload_general())
        if cfg.drafts.share_outputs_s > 0:
            ctx = serve.get_replica_context()
            self.name = ctx.replica_tag
            self.peers = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
            # Serve runs the constructor on the replica's event loop: the task lives there
            self._share_task = asyncio.get_running_loop().create_task(self._share_every())

    async def _preload_general(self, learner_wait_s: float = 120.0) -> None:
        """Load the general draft after the learner is up (a replica starting with the others would
        otherwise ask it before it answers, and serve the starting weights until its next publish)."""
        try:
            if self.learner is not None:  # its answer is kept: the load below does not ask again
                latest = await asyncio.wait_for(self.learner.latest.remote(GENERAL), learner_wait_s)
                if latest is not None:
                    self.published.offer(GENERAL, *latest)
            await self.preload(GENERAL)
        except Exception as e:  # noqa: BLE001 - the first request loads it instead
            log.warning("the general draft did not load at start (%s: %s); the first request loads it", type(e).__name__, e)

    async def _touch_while_running(self) -> None:
        """Every second while requests run here: tell the learner that traffic flows (fire and forget)."""
        while True:
            await asyncio.sleep(1.0)
            if self.running:
                self.learner.touch.remote()

    async def _share_every(self) -> None:
        try:
            n = await self.catch_up()
            log.info("took in %d outputs the running replicas keep", n)
        except Exception as e:  # noqa: BLE001 - the first replica (none running yet) has nothing to take in
            log.info("nothing taken in from the pool at start: %s", e)
        while True:
            await asyncio.sleep(self.cfg.drafts.share_outputs_s)
            try:
                await self.share_served()
            except Exception as e:  # noqa: BLE001 - a replica starting or gone: that batch is lost to it
                log.warning("sharing finished outputs with the pool: %s", e)

    async def preload(self, draft_id: str) -> int:
        """Load a draft now (e.g. after a restart, before traffic); returns the version it runs."""
        engine = await self._load(draft_id)
        return await self._on_engine(engine.install_staged)

    async def stream(self, req: GenerateRequest):
        draft_id = serve.get_multiplexed_model_id() or GENERAL
        engine = await self._load(draft_id)
        async for item in self.generate(req, engine, draft_id):
            yield item
