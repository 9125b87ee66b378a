"""HTTP ingress: OpenAI-compatible completions and chat (JSON or server-sent events), models,
liveness and readiness. Transport only: parse and check the request, ask the router for a draft,
stream the draft replica's steps back in OpenAI's shapes, feed acceptance back to the router."""


import asyncio
import dataclasses
import functools
import json
import logging
import math
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from config import AppConfig, SamplingParams
from router.route import Route
from speculative.locate import TextVocab, light_vocab, model_card, token_bytes

from .loopback import bind_replica_grpc, replica_meter
from . import anthropic_api, llama_api, openai_api, responses_api
from .protocol import (Accepted, ChatRequest, Chunk, CompletionRequest, DetokenizeRequest, Done, GenerateRequest, LlamaCompletionRequest,
                       Outcome, Refused, TargetUnavailable, TemplateRequest, TokenizeRequest, error_body, new_id, now)
from .resume import resuming
from .tenants import Admission, Tenants, refuse_open

log = logging.getLogger("osd.ingress")

api = FastAPI(title="osd-serve", description="Online speculative decoding, OpenAI-compatible")

#: OpenAI's default max_tokens for /v1/completions
COMPLETION_DEFAULT_MAX_TOKENS = 16
ADMIN_BODY_BYTES = 64 << 10
#: the dashboard page and what it loads (vendored: the page needs no network beyond this server)
STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css", "dashboard.js": "text/javascript"}


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param), status_code=status)


def _refused(adm: Admission) -> JSONResponse:
    if adm.status == 401:
        return JSONResponse(error_body(adm.message, "invalid_request_error", code="invalid_api_key"), status_code=401)
    if adm.status == 403:
        return JSONResponse(error_body(adm.message, "invalid_request_error", code="forbidden"), status_code=403)
    return JSONResponse(error_body(adm.message, "rate_limit_error", code="rate_limit_exceeded"), status_code=429,
                        headers={"Retry-After": str(max(1, math.ceil(adm.retry_after)))})


class Timing:
    """One request's clock at the ingress: arrival, first output text, gaps between chunks."""

    def __init__(self, meter, tenant: str):
        self.meter, self.tenant = meter, tenant
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.meter.observe("osd_time_to_first_token_seconds", now - self.t0, tenant=self.tenant)
        else:
            self.meter.observe("osd_inter_token_latency_seconds", now - self.last, tenant=self.tenant)
        self.last = now

    def done(self, status: int, usage: dict | None = None) -> None:
        m, t = self.meter, self.tenant
        end = time.perf_counter()
        m.inc("osd_requests_total", tenant=t, status=str(status))
        if usage is not None:
            m.inc("osd_prompt_tokens_total", usage["prompt_tokens"], tenant=t, status=str(status))
            m.inc("osd_generation_tokens_total", usage["completion_tokens"], tenant=t, status=str(status))
            if self.first is not None and usage["completion_tokens"] > 1:
                m.observe("osd_time_per_output_token_seconds", (end - self.first) / (usage["completion_tokens"] - 1),
                          tenant=t)
        m.observe("osd_e2e_request_latency_seconds", end - self.t0, tenant=t)


class Recent:
    """Answers of fan-out calls (``/ready``, ``/v1/stats``) kept for ``ttl_s``: however often they
    are asked, each reaches the replicas at most once a ``ttl_s`` per key; callers that arrive while
    one is computed wait for it (one lock) instead of calling too. At most ``max_keys`` answers are
    kept (the oldest go first); a call that raises is not kept."""

    def __init__(self, ttl_s: float = 1.0, max_keys: int = 64, clock=time.monotonic):
        self.ttl_s, self.max_keys, self.clock = ttl_s, max_keys, clock
        self.answers: dict = {}  # key -> (time, answer), oldest first
        self._lock: asyncio.Lock | None = None

    def clear(self) -> None:
        self.answers.clear()

    async def get(self, key, compute):
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            hit = self.answers.get(key)
            if hit is not None and self.clock() - hit[0] < self.ttl_s:
                return hit[1]
            value = await compute()
            self.answers.pop(key, None)
            self.answers[key] = (self.clock(), value)
            while len(self.answers) > self.max_keys:
                self.answers.pop(next(iter(self.answers)))
            return value


class Settle:
    """Ends a streamed request's accounting (tenant slot and tokens, in-flight count, metrics)
    exactly once: from the stream's own ``finally``, or when the stream object is dropped without
    ever having run (the client left before its first byte, so its body never started)."""

    def __init__(self, fn):
        self.fn = fn
        self.settled = False

    def __call__(self, used: int, status: int, usage: dict | None) -> None:
        if not self.settled:
            self.settled = True
            self.fn(used, status, usage)


async def _json_body(request: Request, limit: int):
    """The request's JSON, or the error response: 413 past ``limit`` bytes (declared or sent;
    nothing past the limit is read), 400 for invalid UTF-8, invalid JSON or nesting too deep."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return _error(413, f"the body is larger than this server's limit of {limit} bytes")
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            return _error(413, f"the body is larger than this server's limit of {limit} bytes")
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except UnicodeDecodeError:
        return _error(400, "the body is not valid UTF-8")
    except RecursionError:
        return _error(400, "the body's JSON is nested too deeply")
    except json.JSONDecodeError as e:
        return _error(400, f"the body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")
    except ValueError:  # an integer of more than 4300 digits (Python's bound on converting it)
        return _error(400, "the body holds a number too long to read")


def _target_gone(e: BaseException) -> bool:
    """The target model's replica died and no replacement answered in time (from the pool, the
    exception arrives wrapped: Ray's error carries it as ``cause``)."""
    return isinstance(e, TargetUnavailable) or isinstance(getattr(e, "cause", None), TargetUnavailable)


def _unavailable_body(e: BaseException) -> dict:
    return error_body(str(getattr(e, "cause", e)), "server_error", code="target_unavailable")


def _stream_failure(e: Exception, rid: str) -> tuple[int, dict]:
    """A stream that failed after its status line: the status its metrics count and the error event
    it ends with (the target gone: retryable, as a 503 would be; anything else logged, a 500)."""
    if _target_gone(e):
        return 503, _unavailable_body(e)
    log.exception("stream %s failed", rid)
    return 500, error_body(f"generation failed: {e}", "server_error")


def _unavailable(e: BaseException) -> JSONResponse:
    return JSONResponse(_unavailable_body(e), status_code=503, headers={"Retry-After": str(TargetUnavailable.retry_after_s)})


def _anthropic(response: Response) -> JSONResponse:
    """An error response in Anthropic's shape (its status and headers kept)."""
    try:
        message = json.loads(bytes(response.body))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = "the request failed"
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(anthropic_api.error(response.status_code, message), status_code=response.status_code,
                        headers=headers)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    if param is None:  # a check of the whole request that names its parameter (protocol.UNSERVED)
        return err["msg"], (err.get("ctx") or {}).get("param")
    return f"{param}: {err['msg']}", param


class Ingress:
    """Undecorated: the deployment below adds Serve and FastAPI."""

    def __init__(self, cfg: AppConfig, router, pool, learner=None, tenants: Tenants | None = None, metrics=None,
                 http_host: str | None = None):
        """``http_host``: the host Serve's HTTP proxies bind (None: not served over HTTP); with no
        key configured and a host beyond loopback the ingress refuses to start
        (:func:`deployments.tenants.refuse_open`) unless ``auth.allow_open``."""
        self.cfg = cfg
        self.router = router
        self.pool = pool
        self.learner = learner
        self.metrics = metrics  # the Metrics deployment (None: metrics off)
        self.tenants = tenants if tenants is not None else Tenants(cfg.auth)
        refuse_open(cfg.auth, self.tenants.open, http_host)
        self.recent = Recent(1.0)  # /ready and /v1/stats: one fan-out a second at most
        self.meter = replica_meter("Ingress", cfg.metrics)
        self.running = 0
        self.slots: dict[int, _Slot] = {}  # the sequences streaming now, by slot id (llama-server's /slots)
        self._vocab = None  # token-id prompts as text, for the router: loaded on the first such prompt
        self._plain = None  # /tokenize's tokenizer that reads special tokens' text as text (parse_special false)
        if self.tenants.open:
            log.warning("no API keys configured: the server is open to every client that can reach it (HTTP host %s)",
                        http_host or "none")

    def _operator(self, request: Request) -> Admission:
        """Operator endpoints: the admin key (or anyone, on a server without keys)."""
        adm = self.tenants.identify(request.headers.get("authorization"))
        if adm.status == 200 and not (adm.admin or self.tenants.open):
            return Admission(adm.tenant, False, 403, "this endpoint needs the admin key")
        return adm

    async def drafts(self, request: Request):
        """Drafts per replica with their versions, and the router's acceptance per domain."""
        adm = self._operator(request)
        if adm.status != 200:
            return _refused(adm)
        versions = await self.pool.broadcast("versions").results_async()
        summary = await self.router.summary.remote()
        return {"replicas": versions, "acceptance": summary["acceptance"], "drafts": summary["drafts"],
                "clusters": summary["clusters"]}

    # -- observability -----------------------------------------------------------------------
    def telemetry(self) -> dict:
        self.meter.set("osd_requests_running", self.running)
        return self.meter.snapshot()

    async def prometheus(self, request: Request):
        """``/metrics``: the whole application's metrics (admin key, or anyone on an open server)."""
        adm = self._operator(request)
        if adm.status != 200:
            return _refused(adm)
        if self.metrics is None:
            return _error(404, "metrics are disabled on this server (metrics.enabled: false)")
        body = await self.metrics.scrape.remote()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def stats(self, request: Request):
        """``/v1/stats``: a tenant sees its own requests and acceptance; the admin key sees
        everything (``?tenant=`` scopes it), drafts, events and the learner included."""
        adm = self.tenants.identify(request.headers.get("authorization"))
        if adm.status != 200:
            return _refused(adm)
        if self.metrics is None:
            return _error(404, "metrics are disabled on this server (metrics.enabled: false)")
        admin = adm.admin or self.tenants.open
        tenant = request.query_params.get("tenant") if admin else adm.tenant
        return await self.recent.get(("stats", tenant or None, admin), lambda: self.metrics.stats.remote(tenant or None, admin))

    @staticmethod
    def dashboard_file(name: str):
        if name not in STATIC_FILES:
            return _error(404, f"no such file: {name}")
        return FileResponse(STATIC / name, media_type=STATIC_FILES[name])

    # -- health ------------------------------------------------------------------------------
    async def ready(self, timeout_s: float = 5.0) -> JSONResponse:
        """Ready when the router, a draft replica and, through it, the target answer within
        ``timeout_s`` each; otherwise 503 naming the part that did not (e.g. while the target
        replica restarts). The answer is kept for a second (``Recent``)."""
        body, status, headers = await self.recent.get(("ready", timeout_s), lambda: self._ready(timeout_s))
        return JSONResponse(body, status_code=status, headers=headers)

    async def _ready(self, timeout_s: float) -> tuple[dict, int, dict | None]:
        for part, call in (("router", lambda: self.router.summary.remote()), ("draft pool or target", lambda: self.pool.ready.remote())):
            try:
                await asyncio.wait_for(call(), timeout_s)
            except Exception as e:  # noqa: BLE001 - any failure means not ready
                why = "no answer within %.0f s" % timeout_s if isinstance(e, asyncio.TimeoutError) else str(getattr(e, "cause", e))
                return error_body(f"{part} not ready: {why}", "server_error", code="not_ready"), 503, {"Retry-After": "5"}
        return {"status": "ready"}, 200, None

    def models(self) -> dict:
        """``GET /v1/models``: the served name, with llama-server's ``meta`` (the model's vocabulary,
        trained context and width: what its clients read to size prompts)."""
        card = model_card(self.cfg.engine.model.name)
        meta = {"n_vocab": card["n_vocab"], "n_ctx_train": card["n_ctx"], "n_embd": card["n_embd"]}
        return {"object": "list", "data": [{"id": self.cfg.ingress.model_name, "object": "model", "created": 0,
                                            "owned_by": "osd-serve", "meta": meta}]}

    async def learner_call(self, request: Request, method: str, *args):
        """Operator calls on the learner: stats, pause, resume, rollback."""
        adm = self._operator(request)
        if adm.status != 200:
            return _refused(adm)
        if self.learner is None:
            return _error(404, "this application runs without a learner")
        try:
            return await getattr(self.learner, method).remote(*args)
        except Exception as e:  # noqa: BLE001 - a bad draft id or version comes back as a ValueError
            cause = getattr(e, "cause", e)
            if isinstance(cause, ValueError):
                return _error(400, str(cause))
            if isinstance(cause, TimeoutError):  # the learner thread did not let go in time (LearnerBusy)
                return JSONResponse(error_body(str(cause), "server_error", code="learner_busy"), status_code=503,
                                    headers={"Retry-After": "10"})
            raise

    async def delete_tenant(self, request: Request, tenant: str):
        """``DELETE /admin/tenants/{tenant}/records``: the learner's stored records of the tenant
        (queue, replay shards, held-back set), and on every draft pool replica the outputs it keeps
        and its suffix trees hold, so that no draft proposes the tenant's text again, and its
        prompts' blocks in the replicas' prefix caches."""
        adm = self._operator(request)
        if adm.status != 200:
            return _refused(adm)
        out = {"tenant": tenant}
        if self.learner is not None:
            out = await self.learner_call(request, "delete_tenant", tenant)
            if not isinstance(out, dict):
                return out
        replicas = await self.pool.broadcast("forget_tenant", tenant).results_async()
        out["pool"] = {"replicas": len(replicas), "kept": sum(r["kept"] for r in replicas),
                       "trees": sum(r["trees"] for r in replicas), "prefixes": sum(r.get("prefixes", 0) for r in replicas)}
        return out

    async def rollback(self, request: Request, draft_id: str):
        body = await _json_body(request, ADMIN_BODY_BYTES)
        if isinstance(body, JSONResponse):
            return body
        version = body.get("version") if isinstance(body, dict) else None
        if not isinstance(version, int) or isinstance(version, bool):
            return _error(400, 'the body must be {"version": <int>}', param="version")
        return await self.learner_call(request, "rollback", draft_id, version)

    async def configure_learner(self, request: Request):
        body = await _json_body(request, ADMIN_BODY_BYTES)
        if isinstance(body, JSONResponse):
            return body
        if not isinstance(body, dict) or not body:
            return _error(400, 'the body must be a JSON object of settings, e.g. {"lr": 0.0005}')
        return await self.learner_call(request, "configure", body)

    # -- generation --------------------------------------------------------------------------
    async def completion(self, request: Request, chat: bool, llama: bool = False, body: dict | None = None):
        """``/v1/chat/completions`` (``chat``), ``/v1/completions``, or llama-server's own
        ``/completion`` (``llama``: its names, defaults and shapes); ``body``: the request's, already
        read (Anthropic's messages, as a chat)."""
        if self.running >= self.cfg.ingress.max_in_flight:  # over capacity: shed, before any work
            Timing(self.meter, self.tenants.identify(request.headers.get("authorization")).tenant or "unauthenticated").done(503)
            return _overloaded(self.running)
        adm = self.tenants.admit(request.headers.get("authorization"))
        timing = Timing(self.meter, adm.tenant or "unauthenticated")
        if adm.status != 200:
            timing.done(adm.status)
            return _refused(adm)
        used, response, slots = 0, None, [1]  # slots: the request's sequences, held in flight (more for several choices)
        self.running += 1
        try:
            try:
                response, used = await self._completion(request, chat, adm, timing, slots, llama, body)
            except Exception as e:  # noqa: BLE001 - the target's absence is a 503; anything else a 500 in OpenAI's shape
                if _target_gone(e):
                    response, used = _unavailable(e), 0
                else:
                    log.exception("request failed")
                    response, used = _error(500, f"the server failed on this request ({type(e).__name__}); it is logged",
                                            "server_error"), 0
            return response
        finally:
            if used is not None:  # a stream settles its own account (and its metrics) when it ends
                # no response at all: the request was cancelled (its client went away), nginx's 499
                status = getattr(response, "status_code", 200 if isinstance(response, dict) else 499)
                usage = response["usage"] if isinstance(response, dict) else getattr(response, "usage", None)
                self._settle(adm.tenant, timing, used or 0, status, usage, slots[0])

    async def _completion(self, request: Request, chat: bool, adm: Admission, timing: Timing, slots: list[int],
                          llama: bool = False, body: dict | None = None):
        """(response, tokens to charge now; None when the streaming response charges them itself).
        ``slots[0]``: the sequences the request holds in flight, raised here for several choices."""
        tenant = adm.tenant
        if body is None:
            body = await _json_body(request, self.cfg.ingress.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body, 0
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object"), 0
        try:
            model = ChatRequest if chat else LlamaCompletionRequest if llama else CompletionRequest
            req = model.model_validate(body)
            default = COMPLETION_DEFAULT_MAX_TOKENS if model is CompletionRequest else self.cfg.ingress.default_max_tokens
            default = min(default, self.cfg.ingress.max_tokens_limit)  # a request that names none is never refused for it
            params = req.sampling(default)
            messages = req.chat() if chat else None
        except ValidationError as e:
            message, param = _validation_message(e)
            return _error(400, message, param=param), 0
        except ValueError as e:
            return _error(400, str(e)), 0
        if req.model not in (None, self.cfg.ingress.model_name):
            return _error(404, f"model {req.model!r} does not exist; GET /v1/models lists {self.cfg.ingress.model_name!r}",
                          param="model"), 0
        if params.max_tokens > self.cfg.ingress.max_tokens_limit:
            return _error(400, f"max_tokens {params.max_tokens} exceeds this server's limit of "
                               f"{self.cfg.ingress.max_tokens_limit}", param="max_tokens"), 0
        prompts: list = [None] if chat else req.prompts  # chat: its messages, one "prompt"
        count = len(prompts) * req.n
        if count > self.cfg.ingress.max_choices:
            return _error(400, f"the request asks for {count} choices (n = {req.n} for {len(prompts)} prompt(s)); this "
                               f"server serves at most {self.cfg.ingress.max_choices}", param="n"), 0
        if count > self.cfg.ingress.max_in_flight:  # could never be admitted: a 503 would ask to retry in vain
            return _error(400, f"the request asks for {count} choices; this server runs at most "
                               f"{self.cfg.ingress.max_in_flight} sequences at once", param="n"), 0
        texts = []  # (the text the router reads, the token ids of a token-id prompt)
        for p in prompts:
            ids = p if isinstance(p, list) else None
            text = req.last_user_text() if chat else self._decode(ids) if ids is not None else p
            chars = sum(len(m["content"]) for m in messages) if chat else len(text)
            if chars > self.cfg.ingress.max_prompt_chars:
                decoded = " (decoded from its token ids)" if ids is not None else ""
                return _error(400, f"the prompt{decoded} is longer than {self.cfg.ingress.max_prompt_chars} characters"), 0
            texts.append((text, ids))
        # every choice is a sequence in flight, for the server's capacity and the tenant's
        if self.running + count - 1 > self.cfg.ingress.max_in_flight:
            return _overloaded(self.running), 0
        more = self.tenants.admit_more(adm, count - 1)
        if more.status == 400:
            return _error(400, more.message, param="n"), 0
        if more.status != 200:
            return _refused(more), 0
        slots[0] += count - 1
        self.running += count - 1

        t_route = time.perf_counter()
        # isolated tenants: routed from the router's configuration only (named domains, never a
        # cluster or the bandit, which other tenants' traffic shapes), to drafts of their own
        # (``<draft>@<tenant>``: their own engines, suffix trees, k priors and training)
        isolated = self.tenants.isolated(tenant)
        route_of = self.router.route_private if isolated else self.router.route
        routes = await asyncio.gather(*(route_of.remote(text) for text, _ in texts))
        self.meter.observe("osd_router_latency_seconds", time.perf_counter() - t_route)
        rid = new_id("chatcmpl" if chat else "cmpl")
        choices = []
        for (text, ids), route in zip(texts, routes):
            self.meter.inc("osd_routes_total", reason=route.reason.split(":")[0], domain=route.domain)
            for j in range(req.n):
                i = len(choices)
                # echo with logprobs, or vLLM's prompt_logprobs: the prompt's own log-probabilities,
                # computed for its first choice (with the most likely tokens either asks for)
                echo_top = req.logprobs if not chat and req.echo and req.logprobs is not None else None
                asked = [k for k in (echo_top, req.prompt_logprobs) if k is not None]
                scored = max(asked) if asked and j == 0 else None
                gen = GenerateRequest(rid if count == 1 else f"{rid}-{i}", _nth_seed(params, j),
                                      prompt=None if chat or ids is not None else text, prompt_ids=ids, messages=messages,
                                      domain=route.domain, lang=route.lang, tenant=tenant, prompt_logprobs=scored)
                choices.append(_Choice(i, gen, route, f"{route.draft_id}@{tenant}" if isolated else route.draft_id,
                                       echo=text if not chat and req.echo else "", counts_prompt=j == 0,
                                       echo_top=echo_top, prompt_top=req.prompt_logprobs))
        refused = await self._open(choices, tenant)
        if isinstance(refused, Refused) and refused.status == 503:  # a replica is overloaded: retry later
            return JSONResponse(error_body(refused.error, "server_error", code="overloaded"), status_code=503,
                                headers={"Retry-After": str(max(1, math.ceil(refused.retry_after)))}), 0
        if refused is not None:
            return _error(400, refused.error), 0
        if req.stream:
            settle = Settle(lambda used, status, usage: self._settle(tenant, timing, used, status, usage, slots[0]))
            if isinstance(req, LlamaCompletionRequest):
                sse = self._llama_sse(choices, req, params, texts, timing, settle)
            else:
                sse = self._sse(choices, rid, chat, req.include_usage, timing, settle, req.timings_per_token)
            weakref.finalize(sse, _dropped, settle, choices)
            return StreamingResponse(sse, media_type="text/event-stream"), None
        if isinstance(req, LlamaCompletionRequest):
            answer = await self._llama_whole(choices, req, params, texts, timing)
            return answer, answer.usage["total_tokens"]
        body = await self._whole(choices, rid, chat, timing)
        return body, body["usage"]["total_tokens"]

    async def _open(self, choices: list["_Choice"], tenant: str) -> Refused | None:
        """Start every choice's sequence on its draft replica and read each one's header: the
        first refusal, after which none of them runs (a request refused as given, 400, says so
        before one refused for now, 503); else None, each choice's ``stream`` ready to read
        (resumed on another replica if its own dies)."""
        for c in choices:
            c.opened = self.pool.options(multiplexed_model_id=c.draft_id, stream=True).stream.remote(c.gen)
        try:
            firsts = await asyncio.gather(*(c.opened.__anext__() for c in choices), return_exceptions=True)
        except BaseException:  # cancelled: the client went away
            _cancel(choices)
            raise
        failed = [f for f in firsts if isinstance(f, BaseException)]
        refused = sorted((f for f in firsts if isinstance(f, Refused)), key=lambda r: r.status == 503)
        if failed or refused:
            _cancel(choices)
            if failed:
                raise failed[0]
            return refused[0]
        scores = None
        for c, first in zip(choices, firsts):
            assert isinstance(first, Accepted)
            if c.counts_prompt:  # a prompt's first choice: its scores, if asked, serve the prompt's other choices too
                scores = (first.prompt_ids, first.prompt_logprobs) if first.prompt_logprobs is not None else None
            c.prompt_tokens, c.prompt_scores = first.prompt_tokens, scores
            c.stream = self._in_slot(c, tenant, self._resuming(c, tenant))
        return None

    async def _in_slot(self, c: "_Choice", tenant: str, stream):
        """A choice's items, its sequence shown in a slot of ``/slots`` while they are read (the
        lowest free id; its output tokens counted as they come)."""
        slot = _Slot(min(set(range(len(self.slots) + 1)) - set(self.slots)), c, tenant)
        self.slots[slot.id] = slot
        try:
            async for item in stream:
                if isinstance(item, Chunk):
                    slot.decoded += len(item.tokens)
                    slot.cached = item.cached_tokens if item.cached_tokens is not None else slot.cached
                yield item
        finally:
            del self.slots[slot.id]
            await stream.aclose()

    async def slot_states(self, request: Request):
        """``GET /slots`` (llama-server's): a slot per sequence the server admits at once
        (``ingress.max_in_flight``), each busy one with its request, prompt and output counts and
        settings, never its text (the admin key, or anyone on a server without keys; this replica's
        sequences). ``?fail_on_no_slot=1``: a 503 while none is free, for load balancers."""
        adm = self._operator(request)
        if adm.status != 200:
            return _refused(adm)
        total = self.cfg.ingress.max_in_flight
        if request.query_params.get("fail_on_no_slot") and self.running >= total:
            return _error(503, "no slot available", "unavailable_error")
        n_ctx = model_card(self.cfg.engine.model.name)["n_ctx"]
        name = self.cfg.ingress.model_name
        return [self.slots[i].state(n_ctx, name) if i in self.slots else
                {"id": i, "n_ctx": n_ctx, "speculative": True, "is_processing": False}
                for i in range(max(total, max(self.slots, default=-1) + 1))]

    def _resuming(self, c: "_Choice", tenant: str):
        """The draft pool's items for one choice, resumed on another replica if its own dies (the
        stream opened there becomes the choice's ``opened``)."""
        def reopen(again: GenerateRequest):
            c.opened = self.pool.options(multiplexed_model_id=c.draft_id, stream=True).stream.remote(again)
            return c.opened

        def on_resume(n_sent: int, e: BaseException) -> None:
            log.warning("request %s: draft replica lost after %d tokens (%s); resuming on another replica",
                        c.gen.request_id, n_sent, type(e).__name__)
            self.meter.inc("osd_requests_resumed_total", tenant=tenant)

        return resuming(c.opened, c.gen, reopen, on_resume)

    def _vocabulary(self):
        if self._vocab is None:  # after the engine replicas have written the model's folder
            name = self.cfg.engine.model.name
            if (vocab := light_vocab(name)) is None:  # no tokenizer.json: the full tokenizer (imports torch)
                from speculative.models import load_tokenizer

                vocab = load_tokenizer(name)
            self._vocab = vocab
        return self._vocab

    async def tokenize(self, request: Request):
        """``POST /tokenize``: the token ids of a text, as ``/v1/completions`` reads a raw prompt
        (``{"tokens": [...], "count": n}``); any valid key."""
        got = await self._tool_body(request, TokenizeRequest)
        if isinstance(got, JSONResponse):
            return got
        if len(got.text) > self.cfg.ingress.max_prompt_chars:
            return _error(400, f"the text is longer than {self.cfg.ingress.max_prompt_chars} characters")
        if got.parse_special:
            ids = list(self._vocabulary().encode(got.text, add_special_tokens=got.adds_special))  # TextVocab's or transformers'
        elif (plain := self._plain_tokenizer()) is not None:  # special tokens' text as text
            ids = plain.encode(got.text, add_special_tokens=got.adds_special).ids
        else:
            return _error(400, "parse_special false needs the model's tokenizer.json", param="parse_special")
        if not got.with_pieces:
            return {"tokens": ids, "count": len(ids)}
        backend = self._backend()
        raw = token_bytes(backend, ids) if backend is not None else [self._vocabulary().decode([i]).encode() for i in ids]
        return {"tokens": llama_api.pieces(ids, raw), "count": len(ids)}

    def _backend(self):
        """The model's ``tokenizers.Tokenizer``, if it has one (a slow tokenizer has not)."""
        vocab = self._vocabulary()
        return vocab.backend if isinstance(vocab, TextVocab) else getattr(vocab, "backend_tokenizer", None)

    def _plain_tokenizer(self):
        """A copy of the model's tokenizer that reads special tokens' text as text."""
        if self._plain is None and (backend := self._backend()) is not None:
            from tokenizers import Tokenizer

            self._plain = Tokenizer.from_str(backend.to_str())
            self._plain.encode_special_tokens = True
        return self._plain

    async def detokenize(self, request: Request):
        """``POST /detokenize``: the text of token ids (``prompt`` for vLLM's clients, ``content``
        for llama.cpp's); ids past the vocabulary are a 400."""
        got = await self._tool_body(request, DetokenizeRequest)
        if isinstance(got, JSONResponse):
            return got
        vocab = self._vocabulary()
        bad = [t for t in got.tokens if t >= len(vocab)]
        if bad:
            return _error(400, f"token ids out of range [0, {len(vocab)}): {bad[:5]}", param="tokens")
        text = vocab.decode(got.tokens)
        return {"prompt": text, "content": text}

    async def _tool_body(self, request: Request, model):
        """The validated body of /tokenize or /detokenize, or the error response (401 without a
        valid key; the body bounded as a completion's)."""
        adm = self.tenants.identify(request.headers.get("authorization"))
        if adm.status != 200:
            return _refused(adm)
        body = await _json_body(request, self.cfg.ingress.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        try:
            return model.model_validate(body)
        except ValidationError as e:
            message, param = _validation_message(e)
            return _error(400, message, param=param)

    async def messages(self, request: Request, count_only: bool = False):
        """``POST /v1/messages`` (Anthropic's): the request served as a chat (admission, limits,
        routing and accounting as any chat's), answered as a message or its events; errors in
        Anthropic's shape. ``count_only``: ``/v1/messages/count_tokens``, the prompt's tokens."""
        body = await _json_body(request, self.cfg.ingress.max_body_bytes)
        if isinstance(body, JSONResponse):
            return _anthropic(body)
        if count_only and isinstance(body, dict):
            body = {"max_tokens": 1, **body}  # counting needs no output length
        try:
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            req, chat = anthropic_api.chat_body(body)
            messages = ChatRequest.model_validate({"messages": chat["messages"]}).chat() if count_only or req.stream else None
        except ValidationError as e:
            return _anthropic(_error(400, _validation_message(e)[0]))
        except ValueError as e:
            return _anthropic(_error(400, str(e)))
        input_tokens = 0
        if messages is not None:
            adm = self.tenants.identify(request.headers.get("authorization"))
            if adm.status != 200:
                return _anthropic(_refused(adm))
            text = await self.pool.apply_template.remote(messages)
            input_tokens = len(self._vocabulary().encode(text, add_special_tokens=False))
        if count_only:
            return {"input_tokens": input_tokens}
        response = await self.completion(request, chat=True, body=chat)
        model = self.cfg.ingress.model_name
        if isinstance(response, StreamingResponse):
            msg_id = new_id("msg")
            return StreamingResponse(anthropic_api.events(response.body_iterator, msg_id, model, input_tokens),
                                     media_type="text/event-stream")
        if isinstance(response, dict):
            return anthropic_api.message(response, model)
        return _anthropic(response)

    async def responses(self, request: Request):
        """``POST /v1/responses`` (OpenAI's Responses API): the request served as a chat (admission,
        limits, routing and accounting as any chat's), answered as a response object or its events."""
        body = await _json_body(request, self.cfg.ingress.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        try:
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            req, chat = responses_api.chat_body(body)
        except ValidationError as e:
            message, param = _validation_message(e)
            return _error(400, message, param=param)
        except ValueError as e:
            return _error(400, str(e))
        response = await self.completion(request, chat=True, body=chat)
        model = self.cfg.ingress.model_name
        if isinstance(response, StreamingResponse):
            key = new_id("resp").split("-", 1)[-1]
            return StreamingResponse(responses_api.events(response.body_iterator, req, model, key),
                                     media_type="text/event-stream")
        if isinstance(response, dict):
            return responses_api.response(response, req, model)
        return response

    async def apply_template(self, request: Request):
        """``POST /apply-template`` (llama-server's): a chat's text in the target's template, as a
        chat request's prompt is made (``{"prompt": text}``, for ``/completion``); any valid key."""
        got = await self._tool_body(request, TemplateRequest)
        if isinstance(got, JSONResponse):
            return got
        try:
            messages = got.chat()
        except ValueError as e:
            return _error(400, str(e), param="messages")
        if sum(len(m["content"]) for m in messages) > self.cfg.ingress.max_prompt_chars:
            return _error(400, f"the messages are longer than {self.cfg.ingress.max_prompt_chars} characters")
        return {"prompt": await self.pool.apply_template.remote(messages)}

    def props(self) -> dict:
        """``GET /props`` (llama-server's): the context, the chat template, the slots and the
        defaults of ``/completion``, for clients that read them before they ask."""
        card = model_card(self.cfg.engine.model.name)
        ingress, name = self.cfg.ingress, self.cfg.ingress.model_name
        params = LlamaCompletionRequest.model_validate({"prompt": "x"}).sampling(min(ingress.default_max_tokens,
                                                                                     ingress.max_tokens_limit))
        return {"default_generation_settings": {"n_ctx": card["n_ctx"], "params": llama_api.generation_settings(params, name, False)},
                "total_slots": ingress.max_in_flight, "model_alias": name, "model_path": name,
                "modalities": {"vision": False, "video": False, "audio": False}, "chat_template": card["chat_template"],
                "bos_token": card["bos_token"], "eos_token": card["eos_token"], "build_info": f"osd-serve {_version()}",
                "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True, "is_sleeping": False}

    def _decode(self, ids: list[int]) -> str:
        """A token-id prompt as text, for the router (ids outside the vocabulary are left out
        here; the draft replica refuses the request for them)."""
        vocab = self._vocabulary()
        return vocab.decode([i for i in ids if 0 <= i < len(vocab)])

    def _piece(self, ids: list[int]) -> str:
        """Token ids as output text: special tokens as nothing (llama-server's pieces); ids past the
        tokenizer's vocabulary (a model's padded rows) as nothing too."""
        vocab = self._vocabulary()
        return vocab.decode([i for i in ids if 0 <= i < len(vocab)], skip_special_tokens=True)

    def _logprobs(self, tokens: list[int], lps: list, chat: bool, offset: int = 0) -> dict:
        return openai_api.logprobs(self._vocabulary().decode, tokens, lps, chat, offset)

    @staticmethod
    def _echo_scores(c: "_Choice") -> tuple[list[int], list]:
        assert c.prompt_scores is not None and c.echo_top is not None
        return openai_api.echo_scores(*c.prompt_scores, c.echo_top)

    def _prompt_logprobs(self, c: "_Choice") -> list | None:
        if c.prompt_top is None or c.prompt_scores is None:
            return None
        return openai_api.prompt_logprobs(self._vocabulary().decode, *c.prompt_scores, c.prompt_top)

    def _observe(self, route, usage: dict) -> None:
        spec = usage["speculative"]
        if spec["draft_id"] != route.draft_id:  # an isolated tenant's own draft: not the router's to learn from
            return
        self.router.observe.remote(route, spec["accepted"], spec["proposed"])

    @staticmethod
    def _merged_usage(choices: list["_Choice"], usages: list[dict]) -> dict:
        return openai_api.merged_usage([c.counts_prompt for c in choices], usages)

    async def _collect(self, choices: list["_Choice"], timing: Timing) -> list[Outcome]:
        """Every choice's whole output, read together; if one fails (or the client goes away), the
        others are cancelled."""
        async def collect(c: _Choice) -> Outcome:
            o, parts = Outcome(c.index, c.prompt_tokens), [c.echo]
            if c.echo_top is not None:  # echo with logprobs: the prompt's tokens first, the first one unscored
                o.tokens, o.logprobs = self._echo_scores(c)
            try:
                async for item in c.stream:
                    if isinstance(item, Done):
                        o.end, c.done = item, True
                    else:
                        parts.append(item.text)
                        o.tokens += item.tokens
                        if item.logprobs is not None:
                            o.logprobs = (o.logprobs or []) + item.logprobs
                        if item.text:
                            timing.chunk()
                            o.first = timing.last if o.first is None else o.first
            finally:
                await c.stream.aclose()  # a cancelled request ends in the draft pool too
            o.text, o.finished = "".join(parts), time.perf_counter()
            assert o.end is not None
            self._observe(c.route, o.end.usage)
            return o

        try:
            return await _all([collect(c) for c in choices])
        except BaseException:  # a choice failed, or the client went away
            _cancel(choices)
            raise

    async def _whole(self, choices: list["_Choice"], rid: str, chat: bool, timing: Timing) -> dict:
        done = await self._collect(choices, timing)
        out = []
        for c, o in zip(choices, done):
            assert o.end is not None
            logprobs = None if o.logprobs is None else self._logprobs(o.tokens, o.logprobs, chat)
            end = {"logprobs": logprobs, "finish_reason": o.end.finish_reason, "stop_reason": o.end.stop_reason}
            if chat:
                out.append({"index": o.index, "message": {"role": "assistant", "content": o.text}, **end})
            else:
                out.append({"index": o.index, "text": o.text, **end})
                if c.prompt_top is not None:  # vLLM's: on each choice of a completion
                    out[-1]["prompt_logprobs"] = self._prompt_logprobs(c)
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": self.cfg.ingress.model_name, "system_fingerprint": _fingerprint(), "choices": out,
                "usage": self._merged_usage(choices, [o.end.usage for o in done if o.end is not None])}
        if len(done) == 1:  # llama-server's timings, which its OpenAI answers carry too
            body["timings"] = llama_api.timings(done[0], timing.t0)
        if chat and choices[0].prompt_top is not None:  # vLLM's: once, for the conversation all choices continue
            body["prompt_logprobs"] = self._prompt_logprobs(choices[0])
        return body

    async def _llama_whole(self, choices: list["_Choice"], req: LlamaCompletionRequest, params: SamplingParams,
                           texts: list, timing: Timing) -> "_Answer":
        """llama-server's answer: the result, or an array of results for several."""
        done = await self._collect(choices, timing)
        settings = llama_api.generation_settings(params, self.cfg.ingress.model_name, False, req.timings_per_token)
        results = [llama_api.final(o, texts[o.index // req.n][0], settings, timing.t0, req.return_tokens,
                                   self.cfg.ingress.model_name, False,
                                   llama_api.result_probabilities(self._piece, o))
                   for o in done]
        return _Answer(results[0] if len(results) == 1 else results,
                       self._merged_usage(choices, [o.end.usage for o in done if o.end is not None]))

    def _settle(self, tenant: str, timing: Timing, used: int, status: int, usage: dict | None, slots: int = 1) -> None:
        self.tenants.done(tenant, used, slots)
        self.running -= slots
        timing.done(status, usage)

    async def _sse(self, choices: list["_Choice"], rid: str, chat: bool, include_usage: bool, timing: Timing,
                   settle: Settle, per_token: bool = False):
        created, model = now(), self.cfg.ingress.model_name
        obj = "chat.completion.chunk" if chat else "text_completion"

        # per choice: (tokens, logprobs) not sent yet (a chunk's tokens whose text is held go with the
        # next text), and the completions' text_offset (characters of the tokens sent before)
        pending: dict[int, list] = {c.index: [] for c in choices}
        offset = dict.fromkeys(pending, 0)
        split = {c.index: _Pieces() for c in choices}  # a chunk a token, as each token's text comes

        def chunk(index: int, delta: str | None, finish: str | None, role: bool = False, stop=None,
                  prompt_lp: list | None = None, timings: dict | None = None) -> str:
            lp, held = None, pending[index]
            if held and not role:
                lp = self._logprobs([t for ts, _ in held for t in ts], [x for _, xs in held for x in xs], chat, offset[index])
                held.clear()
                if not chat and lp["tokens"]:
                    offset[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": index, "delta": d, "logprobs": lp, "finish_reason": finish, "stop_reason": stop}
            else:
                choice = {"index": index, "text": delta or "", "logprobs": lp, "finish_reason": finish, "stop_reason": stop}
            if prompt_lp is not None and not chat:
                choice["prompt_logprobs"] = prompt_lp
            body = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": _fingerprint(),
                    "choices": [choice]}
            if prompt_lp is not None and chat:
                body["prompt_logprobs"] = prompt_lp
            if include_usage:
                body["usage"] = None
            if timings is not None:
                body["timings"] = timings
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        used, usage, status = 0, None, 500
        ends: dict[int, dict] = {}
        timings = None  # llama-server's, of a single choice: on the usage chunk, or else on the last
        so_far = {c.index: Outcome(c.index, c.prompt_tokens) for c in choices}  # timings_per_token's tokens so far
        merged = _merged(choices)
        try:
            for c in choices:  # each choice's first chunk carries vLLM's prompt_logprobs, when asked
                if chat:
                    yield chunk(c.index, None, None, role=True, prompt_lp=self._prompt_logprobs(c))
                elif c.prompt_top is not None:
                    yield chunk(c.index, "", None, prompt_lp=self._prompt_logprobs(c))
                if c.echo:  # the prompt's text first (OpenAI's echo), with its tokens' log-probabilities if asked
                    if c.echo_top is not None:
                        pending[c.index].append(self._echo_scores(c))
                    yield chunk(c.index, c.echo, None)
            async for c, item in merged:
                if isinstance(item, Done):
                    c.done = True
                    toks, lps = split[c.index].rest()  # tokens no piece covered go with the end
                    if lps:
                        pending[c.index].append((toks, lps))
                    if len(choices) == 1:
                        timings = llama_api.timings(Outcome(c.index, c.prompt_tokens, end=item, first=timing.first,
                                                            finished=time.perf_counter()), timing.t0)
                    yield chunk(c.index, None if chat else "", item.finish_reason, stop=item.stop_reason,
                                timings=None if include_usage and not per_token else timings)
                    self._observe(c.route, item.usage)
                    ends[c.index] = item.usage
                else:
                    events = []
                    if per_token and item.cached_tokens is not None:
                        so_far[c.index].cached = item.cached_tokens
                    for text, toks, lps in split[c.index].take(item):
                        if item.logprobs is not None:
                            pending[c.index].append((toks, lps))
                        if per_token:  # timings_per_token's tokens so far
                            so_far[c.index].tokens += toks
                        if text:
                            timing.chunk()  # each text chunk is a gap the client sees (0 within a step)
                            running = None
                            if per_token and len(choices) == 1:  # llama-server's timings so far, on each chunk
                                o = dataclasses.replace(so_far[c.index], first=timing.first, finished=time.perf_counter())
                                running = llama_api.timings(o, timing.t0)
                            events.append(chunk(c.index, text, None, timings=running))
                    if events:  # one write: the proxy carries a step's tokens in one message
                        yield "".join(events)
            usage = self._merged_usage(choices, [ends[c.index] for c in choices])
            used, status = usage["total_tokens"], 200
            if include_usage:
                body = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": _fingerprint(),
                        "choices": [], "usage": usage}
                if timings is not None:
                    body["timings"] = timings
                yield f"data: {json.dumps(body)}\n\n"
        except (GeneratorExit, asyncio.CancelledError):  # the client went away mid-stream
            status = 499  # nginx's "client closed request", as the metrics' status
            raise
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            status, body = _stream_failure(e, rid)
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            settle(used, status, usage)
            await merged.aclose()
            _cancel(choices)  # ends the requests in the draft pool too, if they still run
        yield "data: [DONE]\n\n"


    async def _llama_sse(self, choices: list["_Choice"], req: LlamaCompletionRequest, params: SamplingParams,
                         texts: list, timing: Timing, settle: Settle):
        """llama-server's stream: a partial result for each new text, then each choice's final one."""
        model = self.cfg.ingress.model_name
        settings = llama_api.generation_settings(params, model, True, req.timings_per_token)
        outcomes = {c.index: Outcome(c.index, c.prompt_tokens) for c in choices}
        pending: dict[int, list] = {c.index: [[], []] for c in choices}  # tokens and logprobs not sent yet
        split = {c.index: _Pieces() for c in choices}  # a chunk a token, as each token's text comes

        def event(body: dict) -> str:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def partial(o: Outcome, *rest) -> str:
            body = llama_api.partial(o, *rest)
            if req.timings_per_token:  # llama-server's timings so far, on each chunk
                body["timings"] = llama_api.timings(dataclasses.replace(o, finished=time.perf_counter()), timing.t0)
            return event(body)

        used, usage, status = 0, None, 500
        merged = _merged(choices)
        try:
            async for c, item in merged:
                o = outcomes[c.index]
                if isinstance(item, Done):
                    c.done, o.end, o.finished = True, item, time.perf_counter()
                    self._observe(c.route, item.usage)
                    held = pending[c.index]
                    toks, lps = split[c.index].rest()  # tokens no piece covered go with the end
                    o.tokens += toks
                    held[0] += toks
                    held[1] += lps
                    if held[0]:  # tokens without text of their own (held by the detokeniser) go before the end
                        probs = llama_api.probabilities(self._piece, *held) if params.logprobs is not None else None
                        yield partial(o, "", held[0], req.return_tokens, probs)
                    if item.eos_token is not None:  # as llama-server: the end of sequence's own chunk, without text
                        lps = [item.eos_logprob] if item.eos_logprob is not None else []
                        probs = None if params.logprobs is None else llama_api.probabilities(self._piece, [item.eos_token] * len(lps), lps)
                        yield partial(o, "", [item.eos_token], req.return_tokens, probs, len(llama_api.predicted(o)))
                    yield event(llama_api.final(o, texts[c.index // req.n][0], settings, timing.t0, req.return_tokens,
                                                model, True))
                    continue
                events = []
                if item.cached_tokens is not None:  # the first chunk's: its timings' cache_n from now on
                    o.cached = item.cached_tokens
                for text, toks, lps in split[c.index].take(item):  # llama-server's: a chunk a token
                    o.tokens += toks
                    held = pending[c.index]
                    held[0] += toks
                    held[1] += lps
                    if not text:
                        continue
                    timing.chunk()  # each text chunk is a gap the client sees (0 within a step)
                    o.first = timing.last if o.first is None else o.first
                    probs = llama_api.probabilities(self._piece, *held) if params.logprobs is not None else None
                    events.append(partial(o, text, held[0], req.return_tokens, probs))
                    pending[c.index] = [[], []]
                if events:  # one write: the proxy carries a step's tokens in one message
                    yield "".join(events)
            usage = self._merged_usage(choices, [outcomes[c.index].end.usage for c in choices])  # type: ignore[union-attr]
            used, status = usage["total_tokens"], 200
        except (GeneratorExit, asyncio.CancelledError):  # the client went away mid-stream
            status = 499
            raise
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            status, body = _stream_failure(e, choices[0].gen.request_id)
            yield event(body)
        finally:
            settle(used, status, usage)
            await merged.aclose()
            _cancel(choices)


class _Pieces:
    """One choice's tokens (and log-probabilities, when asked) that no text has covered yet: each
    chunk's pieces (:class:`Chunk`) take theirs from the front, so a stream can send a token a chunk
    with that token's own text."""

    def __init__(self):
        self.tokens: list[int] = []
        self.logprobs: list = []

    def take(self, item: Chunk) -> list[tuple[str, list[int], list]]:
        """``(text, tokens, logprobs)`` for each piece of ``item``, oldest first (a chunk without
        pieces: its whole text, with every token not yet covered)."""
        self.tokens += item.tokens
        self.logprobs += item.logprobs or []
        pieces = item.pieces or (((item.text, len(self.tokens)),) if item.text else ())
        out = []
        for text, n in pieces:
            out.append((text, self.tokens[:n], self.logprobs[:n]))
            del self.tokens[:n], self.logprobs[:n]
        return out

    def rest(self) -> tuple[list[int], list]:
        """The tokens (and log-probabilities) still uncovered, taken."""
        rest = self.tokens, self.logprobs
        self.tokens, self.logprobs = [], []
        return rest


class _Answer(JSONResponse):
    """A JSON answer that is not OpenAI's (llama-server's), with the usage to account it by."""

    def __init__(self, content, usage: dict):
        super().__init__(content)
        self.usage = usage


@dataclass
class _Choice:
    """One choice of a response: the sequence that answers it, streamed from a draft replica."""

    index: int
    gen: GenerateRequest
    route: Route
    draft_id: str
    echo: str = ""  # the prompt's text before the completion's (OpenAI's echo)
    prompt_tokens: int = 0  # its prompt's length in tokens, once opened
    prompt_scores: tuple | None = None  # the prompt's token ids and their scores (lp, top, rank), when asked
    echo_top: int | None = None  # echo with logprobs: the most likely tokens a prompt position lists
    prompt_top: int | None = None  # vLLM's prompt_logprobs: the same
    counts_prompt: bool = True  # the first choice of its prompt: its prompt tokens count in the usage
    opened: Any = None  # its stream from a draft replica (the one it resumed on, if its first one died)
    stream: Any = None  # its items, once opened: ``opened``'s, resumed on another replica if that one dies
    done: bool = False  # its Done came


@dataclass
class _Slot:
    """A sequence streaming now, as ``/slots`` shows it."""

    id: int
    choice: _Choice
    tenant: str
    decoded: int = 0  # its output tokens so far
    cached: int = 0  # its prompt's tokens from the prefix cache

    #: settings that hold a request's own text (stop strings, a grammar, biased ids): not shown
    PRIVATE = ("stop", "grammar", "logit_bias")

    def state(self, n_ctx: int, model: str) -> dict:
        params = self.choice.gen.params
        settings = llama_api.generation_settings(params, model, False)
        return {"id": self.id, "id_task": self.choice.gen.request_id, "n_ctx": n_ctx, "speculative": True,
                "is_processing": True, "tenant": self.tenant, "draft": self.choice.draft_id,
                "n_prompt_tokens": self.choice.prompt_tokens, "n_prompt_tokens_cache": self.cached,
                "params": {k: v for k, v in settings.items() if k not in self.PRIVATE},
                "next_token": [{"has_next_token": True, "n_remain": params.max_tokens - self.decoded,
                                "n_decoded": self.decoded}]}


def _cancel(choices: list[_Choice]) -> None:
    """Cancel the sequences of the choices not done (a request that ends early: the client left,
    a choice failed or was refused), wherever their streams are: read or not, started or not."""
    for c in choices:
        if not c.done and c.opened is not None:
            c.opened.cancel()


def _nth_seed(params: SamplingParams, j: int) -> SamplingParams:
    """The sampling of a prompt's choice ``j``: a seeded request's choice j samples with seed + j
    (wrapped into the seed's range), so that choice 0 is what the request alone would return and
    the others differ from it, each reproducibly."""
    if j == 0 or params.seed is None:
        return params
    seed = params.seed + j
    return params.model_copy(update={"seed": seed - 2**64 if seed >= 2**64 else seed})


async def _all(coros: list) -> list:
    """The results of ``coros``, run together; if one fails, the others are cancelled."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _merged(choices: list[_Choice]):
    """(choice, item) from every choice's stream as the items come; closing it ends them all."""
    if len(choices) == 1:
        c = choices[0]
        try:
            async for item in c.stream:
                yield c, item
        finally:
            await c.stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            async for item in c.stream:
                await queue.put((c, item, None))
        except Exception as e:  # noqa: BLE001 - raised to the reader below
            await queue.put((c, None, e))
            return
        await queue.put((c, None, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        live = len(tasks)
        while live:
            c, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                live -= 1
            else:
                yield c, item
    finally:  # a pump cancelled while it reads cancels its stream (``resuming``)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _dropped(settle: Settle, choices: list[_Choice]) -> None:
    """A streamed response object is gone: if its body never ran (the client left before its first
    byte), its account is settled as 499 and its sequences are cancelled; a body that ran settled
    and ended them itself."""
    if not settle.settled:
        settle(0, 499, None)
        _cancel(choices)


def _overloaded(running: int) -> JSONResponse:
    return JSONResponse(error_body(f"the server is at capacity ({running} requests in flight); retry later",
                                   "server_overloaded", code="server_overloaded"),
                        status_code=503, headers={"Retry-After": "1"})


@functools.cache
def _fingerprint() -> str:
    """OpenAI's ``system_fingerprint``: the server's build."""
    return f"osd-serve-{_version()}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("osd-serve")
    except PackageNotFoundError:
        return "unknown"


def _body_schema(model) -> dict:
    """The OpenAPI request body of a route that reads its JSON itself (so that clients and
    fuzzers such as schemathesis see the fields): the model's JSON schema, definitions inlined."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxies bind (``http_options.host``), from the Serve controller; None
    outside a running Serve (one process, tests)."""
    import ray

    if not ray.is_initialized():
        return None
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else client.http_config.host


@serve.deployment(name="Ingress", max_ongoing_requests=128)
@serve.ingress(api)
class IngressDeployment(Ingress):
    def __init__(self, cfg: AppConfig, router, pool, learner=None, metrics=None):
        bind_replica_grpc(cfg.replica_grpc_host)
        super().__init__(cfg, router, pool, learner, metrics=metrics, http_host=serve_http_host())

    # llama-server's aliases (``/v1/health``, ``/models``, ``/chat/completions``), for clients whose
    # base URL leaves out /v1: the same handlers, outside the schema
    @api.get("/health")
    @api.get("/v1/health", include_in_schema=False)
    def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready_route(self):
        return await self.ready()

    @api.get("/v1/models")
    @api.get("/models", include_in_schema=False)
    def list_models(self, request: Request):
        adm = self.tenants.identify(request.headers.get("authorization"))
        return self.models() if adm.status == 200 else _refused(adm)

    @api.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize_route(self, request: Request):
        return await self.tokenize(request)

    @api.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize_route(self, request: Request):
        return await self.detokenize(request)

    # llama-server's: the chat template applied (for /completion), and what clients read of the server
    @api.post("/apply-template", openapi_extra=_body_schema(TemplateRequest))
    async def apply_template_route(self, request: Request):
        return await self.apply_template(request)

    @api.get("/props")
    def props_route(self, request: Request):
        adm = self.tenants.identify(request.headers.get("authorization"))
        return self.props() if adm.status == 200 else _refused(adm)

    @api.get("/slots")
    async def slots_route(self, request: Request):
        return await self.slot_states(request)

    @api.get("/metrics")
    async def metrics_route(self, request: Request):
        return await self.prometheus(request)

    @api.get("/v1/stats")
    async def stats_route(self, request: Request):
        return await self.stats(request)

    @api.get("/dashboard")
    def dashboard(self):
        return HTMLResponse((STATIC / "dashboard.html").read_text())

    @api.get("/dashboard/static/{name}")
    def dashboard_static(self, name: str):
        return self.dashboard_file(name)

    @api.get("/admin/drafts")
    async def admin_drafts(self, request: Request):
        return await self.drafts(request)

    @api.post("/admin/drafts/{draft_id}/rollback")
    async def admin_rollback(self, draft_id: str, request: Request):
        return await self.rollback(request, draft_id)

    @api.delete("/admin/tenants/{tenant}/records")
    async def admin_delete_tenant(self, tenant: str, request: Request):
        return await self.delete_tenant(request, tenant)

    @api.get("/admin/learner")
    async def admin_learner(self, request: Request):
        return await self.learner_call(request, "stats")

    @api.patch("/admin/learner")
    async def admin_configure_learner(self, request: Request):
        return await self.configure_learner(request)

    @api.post("/admin/learner/pause")
    async def admin_pause(self, request: Request):
        return await self.learner_call(request, "pause")

    @api.post("/admin/learner/resume")
    async def admin_resume(self, request: Request):
        return await self.learner_call(request, "resume")

    @api.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(self, request: Request):
        return await self.completion(request, chat=False)

    # llama-server's own completion API (its /completions is this one, not OpenAI's)
    @api.post("/completion", openapi_extra=_body_schema(LlamaCompletionRequest))
    @api.post("/completions", include_in_schema=False)
    async def llama_completion(self, request: Request):
        return await self.completion(request, chat=False, llama=True)

    # Anthropic's Messages API (llama-server's too), served as a chat
    @api.post("/v1/messages", openapi_extra=_body_schema(anthropic_api.MessagesRequest))
    async def messages_route(self, request: Request):
        return await self.messages(request)

    @api.post("/v1/messages/count_tokens", openapi_extra=_body_schema(anthropic_api.MessagesRequest))
    async def count_tokens_route(self, request: Request):
        return await self.messages(request, count_only=True)

    # OpenAI's Responses API (llama-server's too), served as a chat
    @api.post("/v1/responses", openapi_extra=_body_schema(responses_api.ResponsesRequest))
    @api.post("/responses", include_in_schema=False)
    async def responses_route(self, request: Request):
        return await self.responses(request)

    @api.post("/v1/chat/completions", openapi_extra=_body_schema(ChatRequest))
    @api.post("/chat/completions", include_in_schema=False)
    async def chat_completions(self, request: Request):
        return await self.completion(request, chat=True)


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return _error(500, f"internal error: {type(exc).__name__}", "server_error")
