"""HTTP ingress: OpenAI-compatible completions and chat (JSON or server-sent events), models,
liveness and readiness. Transport only: parse and check the request, ask the router for a draft,
stream the draft replica's steps back in OpenAI's shapes, feed acceptance back to the router."""


import json
import logging
import math

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve

from config import AppConfig

from .drafts import GenerateRequest
from .loopback import bind_replica_grpc
from .protocol import ChatRequest, CompletionRequest, error_body, new_id, now
from .tenants import Admission, Tenants

log = logging.getLogger("osd.ingress")

api = FastAPI(title="osd-serve", description="Online speculative decoding, OpenAI-compatible")

#: OpenAI's default max_tokens for /v1/completions
COMPLETION_DEFAULT_MAX_TOKENS = 16


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param), status_code=status)


def _refused(adm: Admission) -> JSONResponse:
    if adm.status == 401:
        return JSONResponse(error_body(adm.message, "invalid_request_error", code="invalid_api_key"), status_code=401)
    if adm.status == 403:
        return JSONResponse(error_body(adm.message, "invalid_request_error", code="forbidden"), status_code=403)
    return JSONResponse(error_body(adm.message, "rate_limit_error", code="rate_limit_exceeded"), status_code=429,
                        headers={"Retry-After": str(max(1, math.ceil(adm.retry_after)))})


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    return f"{param}: {err['msg']}" if param else err["msg"], param


class Ingress:
    """Undecorated: the deployment below adds Serve and FastAPI."""

    def __init__(self, cfg: AppConfig, router, pool, learner=None, tenants: Tenants | None = None):
        self.cfg = cfg
        self.router = router
        self.pool = pool
        self.learner = learner
        self.tenants = tenants if tenants is not None else Tenants(cfg.auth)
        if self.tenants.open:
            log.warning("no API keys configured: the server is open to every client that can reach it")

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

    # -- health ------------------------------------------------------------------------------
    async def ready(self) -> JSONResponse:
        try:
            await self.router.summary.remote()
        except Exception as e:  # noqa: BLE001 - any failure means not ready
            return _error(503, f"router not ready: {e}", "server_error")
        return JSONResponse({"status": "ready"})

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.cfg.ingress.model_name, "object": "model", "created": 0, "owned_by": "osd-serve"}]}

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
            raise

    async def rollback(self, request: Request, draft_id: str):
        try:
            body = await request.json()
            version = body["version"]
            if not isinstance(version, int) or isinstance(version, bool):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            return _error(400, 'the body must be {"version": <int>}', param="version")
        return await self.learner_call(request, "rollback", draft_id, version)

    # -- generation --------------------------------------------------------------------------
    async def completion(self, request: Request, chat: bool):
        adm = self.tenants.admit(request.headers.get("authorization"))
        if adm.status != 200:
            return _refused(adm)
        used = 0
        try:
            response, used = await self._completion(request, chat, adm.tenant)
            return response
        finally:
            if used is not None:  # a stream settles its own account when it ends
                self.tenants.done(adm.tenant, used or 0)

    async def _completion(self, request: Request, chat: bool, tenant: str):
        """(response, tokens to charge now; None when the streaming response charges them itself)."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not valid JSON"), 0
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object"), 0
        try:
            req = ChatRequest.model_validate(body) if chat else CompletionRequest.model_validate(body)
            default = self.cfg.ingress.default_max_tokens if chat else COMPLETION_DEFAULT_MAX_TOKENS
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
        text = req.last_user_text() if chat else req.prompt
        chars = sum(len(m["content"]) for m in messages) if chat else len(text)
        if chars > self.cfg.ingress.max_prompt_chars:
            return _error(400, f"the prompt is longer than {self.cfg.ingress.max_prompt_chars} characters"), 0

        route = await self.router.route.remote(text)
        rid = new_id("chatcmpl" if chat else "cmpl")
        gen = GenerateRequest(rid, params, prompt=None if chat else text, messages=messages,
                              domain=route.domain, lang=route.lang, tenant=tenant)
        stream = self.pool.options(multiplexed_model_id=route.draft_id, stream=True).stream.remote(gen)
        first = await stream.__anext__()
        if "error" in first:
            return _error(400, first["error"]), 0
        if req.stream:
            sse = self._sse(stream, rid, chat, route, req.include_usage, tenant)
            return StreamingResponse(sse, media_type="text/event-stream"), None
        body = await self._whole(stream, rid, chat, route)
        return body, body["usage"]["total_tokens"]

    def _observe(self, route, usage: dict) -> None:
        spec = usage["speculative"]
        self.router.observe.remote(route, spec["accepted"], spec["proposed"])

    @staticmethod
    def _usage(usage: dict) -> dict:
        return {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}

    async def _whole(self, stream, rid: str, chat: bool, route) -> dict:
        parts, end = [], None
        async for item in stream:
            if "finish_reason" in item:
                end = item
            else:
                parts.append(item["text"])
        self._observe(route, end["usage"])
        text, model = "".join(parts), self.cfg.ingress.model_name
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": end["finish_reason"]}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": end["finish_reason"]}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": now(), "model": model, "choices": [choice], "usage": self._usage(end["usage"])}

    async def _sse(self, stream, rid: str, chat: bool, route, include_usage: bool, tenant: str):
        created, model = now(), self.cfg.ingress.model_name
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        used = 0
        try:
            if chat:
                yield chunk(None, None, role=True)
            async for item in stream:
                if "finish_reason" in item:
                    yield chunk(None if chat else "", item["finish_reason"])
                    self._observe(route, item["usage"])
                    used = self._usage(item["usage"])["total_tokens"]
                    if include_usage:
                        body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                "usage": self._usage(item["usage"])}
                        yield f"data: {json.dumps(body)}\n\n"
                elif item["text"]:
                    yield chunk(item["text"], None)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            log.exception("stream %s failed", rid)
            yield f"data: {json.dumps(error_body(f'generation failed: {e}', 'server_error'))}\n\n"
        finally:
            self.tenants.done(tenant, used)
        yield "data: [DONE]\n\n"


@serve.deployment(name="Ingress", max_ongoing_requests=128)
@serve.ingress(api)
class IngressDeployment(Ingress):
    def __init__(self, cfg: AppConfig, router, pool, learner=None):
        bind_replica_grpc(cfg.replica_grpc_host)
        super().__init__(cfg, router, pool, learner)

    @api.get("/health")
    def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready_route(self):
        return await self.ready()

    @api.get("/v1/models")
    def list_models(self, request: Request):
        adm = self.tenants.identify(request.headers.get("authorization"))
        return self.models() if adm.status == 200 else _refused(adm)

    @api.get("/admin/drafts")
    async def admin_drafts(self, request: Request):
        return await self.drafts(request)

    @api.post("/admin/drafts/{draft_id}/rollback")
    async def admin_rollback(self, draft_id: str, request: Request):
        return await self.rollback(request, draft_id)

    @api.get("/admin/learner")
    async def admin_learner(self, request: Request):
        return await self.learner_call(request, "stats")

    @api.post("/admin/learner/pause")
    async def admin_pause(self, request: Request):
        return await self.learner_call(request, "pause")

    @api.post("/admin/learner/resume")
    async def admin_resume(self, request: Request):
        return await self.learner_call(request, "resume")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.completion(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.completion(request, chat=True)


@api.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return _error(500, f"internal error: {type(exc).__name__}", "server_error")
