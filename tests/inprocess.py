"""The application's deployments composed in one process, without Ray: the undecorated classes
(`Ingress`, `DraftPool`, `RouterServer`, `LearnerServer`, `MetricsServer`) joined by handles that
call them the way Ray Serve's handles do. What this replaces is transport only, so that the
deployments' own logic can be tested (and mutation-tested) in seconds; the live tests in
tests/serve/ run the same classes under Ray Serve over HTTP.

Handle semantics kept from Serve:
- `handle.method.remote(*args)` starts the call at once and returns an awaitable (fire and forget
  is allowed: the call still runs);
- `handle.options(multiplexed_model_id=d, stream=True).method.remote(*args)` is an async
  iterator with `cancel()`; `serve.get_multiplexed_model_id()` is `MODEL_ID` here;
- `handle.broadcast(method, *args).results_async()` calls every replica;
- a replica's exception comes back as it was raised (Ray wraps it, with the original as `cause`;
  the ingress reads both).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import time

from ray.exceptions import RayActorError
from starlette.requests import Request

from config import AppConfig, SamplingParams
from deployments.drafts import DraftPool
from deployments.protocol import Chunk, GenerateRequest
from deployments.ingress import Ingress
from deployments.metrics import MetricsServer
from deployments.router import RouterServer
from deployments.tenants import digest
from router.router import GENERAL

def outside_serve() -> None:
    """`serve.batch` outside a replica: its queue reads the replica's config only for a warning
    (whether max_batch_size exceeds max_ongoing_requests); everything else of it runs as in Serve."""
    from ray.serve import batching

    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None


#: the draft id a streamed call was made with (Serve's multiplexed model id)
MODEL_ID: contextvars.ContextVar[str] = contextvars.ContextVar("model_id", default="")


class Stream:
    """What a streaming handle call returns: the replica's async generator, cancellable."""

    def __init__(self, agen):
        self.agen = agen
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True
        asyncio.ensure_future(self.agen.aclose())


class _Done:
    """The answer of a call that already ran (a synchronous method): awaitable, or dropped."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error

    def __await__(self):
        if self.error is not None:
            raise self.error
        return self.value
        yield  # a generator: awaitable without suspending


class _Method:
    def __init__(self, handle: "Handle", name: str, stream: bool, model_id: str):
        self.handle, self.name, self.stream, self.model_id = handle, name, stream, model_id

    def remote(self, *args, **kwargs):
        replica = self.handle.pick()
        self.handle.calls.append((self.name, self.model_id, args))
        token = MODEL_ID.set(self.model_id)
        try:
            if self.stream:
                stream = Stream(getattr(replica, self.name)(*args, **kwargs))
                self.handle.streams.append(stream)
                return stream
            try:
                out = getattr(replica, self.name)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - delivered to whoever awaits, as Serve does
                return _Done(error=e)
            return asyncio.ensure_future(out) if inspect.isawaitable(out) else _Done(out)
        finally:
            MODEL_ID.reset(token)


class _Broadcast:
    def __init__(self, handle: "Handle", name: str, args: tuple):
        self.handle, self.name, self.args = handle, name, args

    async def results_async(self) -> list:
        self.handle.calls.append((f"broadcast:{self.name}", "", self.args))
        out = []
        for replica in self.handle.replicas:
            r = getattr(replica, self.name)(*self.args)
            out.append(await r if inspect.isawaitable(r) else r)
        return out


class Handle:
    """A deployment handle over replicas in this process; calls go to the replicas in turn.
    `calls` records (method, multiplexed model id, args) of every call made through it, `streams`
    every stream it opened."""

    def __init__(self, *replicas, stream: bool = False, model_id: str = "", calls: list | None = None, turn: list | None = None,
                 streams: list | None = None):
        self.replicas = list(replicas)
        self._stream, self._model_id = stream, model_id
        self.calls = [] if calls is None else calls
        self.streams = [] if streams is None else streams
        self._turn = [0] if turn is None else turn

    def pick(self):
        r = self.replicas[self._turn[0] % len(self.replicas)]
        self._turn[0] += 1
        return r

    def options(self, multiplexed_model_id: str = "", stream: bool = False) -> "Handle":
        return Handle(*self.replicas, stream=stream, model_id=multiplexed_model_id, calls=self.calls, turn=self._turn,
                      streams=self.streams)

    def broadcast(self, name: str, *args) -> _Broadcast:
        return _Broadcast(self, name, args)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name, self._stream, self._model_id)


def request(body=None, key: str | None = None, query: str = "", raw: bytes | None = None,
            headers: dict | None = None, chunk: int | None = None) -> Request:
    """A Starlette request as the ingress receives it: `body` as JSON (or `raw` bytes), the bearer
    `key`, the query string; `chunk` sends the body in parts of that many bytes."""
    data = raw if raw is not None else b"" if body is None else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    if "content-length" not in hdrs:
        hdrs["content-length"] = str(len(data))
    parts = [data[i:i + chunk] for i in range(0, len(data), chunk)] if chunk and data else [data]
    sent = {"n": 0}

    async def receive():
        i = sent["n"]
        sent["n"] += 1
        if i < len(parts):
            return {"type": "http.request", "body": parts[i], "more_body": i < len(parts) - 1}
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": query.encode(),
             "headers": [(k.lower().encode(), str(v).encode()) for k, v in hdrs.items() if v is not None]}
    return Request(scope, receive)


async def answer(response) -> tuple[int, object, dict]:
    """(status, body, headers) of what an ingress method returned: a dict or list (200 JSON), a
    JSONResponse, a plain Response, or a StreamingResponse (its body: the list of SSE events, the
    `data: ` prefix cut, JSON decoded but for `[DONE]`)."""
    from starlette.responses import StreamingResponse

    if isinstance(response, (dict, list)):
        return 200, response, {}
    headers = dict(response.headers)
    if isinstance(response, StreamingResponse):
        text = "".join([part if isinstance(part, str) else part.decode() async for part in response.body_iterator])
        events = []
        for block in text.split("\n\n"):
            if block:
                assert block.startswith("data: "), block
                payload = block[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return response.status_code, events, headers
    body = response.body
    try:
        return response.status_code, json.loads(body), headers
    except ValueError:
        return response.status_code, body, headers


KEY, ADMIN, ISO, TINY = "sk-alice", "sk-ops", "sk-iso", "sk-tiny"
MODEL = "tiny-osd"


def save_tiny_model(path, make_llama, make_tokenizer) -> str:
    """The tests' tiny Llama and its character tokenizer as a model folder, as a served model is."""
    make_llama(3, seed=0).save_pretrained(path)
    tok = make_tokenizer()
    # a chat template of its characters, as a served model's tokenizer has one (raw completions skip it)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(path)
    outside_serve()
    return str(path)


def save_domain_draft(path, make_llama):
    """A saved draft unlike the configured 2-layer one, as ``osd distill --domain`` writes them: the
    tiny model's first layer, a head of ids 0..39. Returns those ids."""
    import torch

    from drafts.build import restrict_head, save_draft, truncated_draft

    keep = torch.arange(0, 40)
    save_draft(restrict_head(truncated_draft(make_llama(3, seed=0), 1), keep), path, keep)
    return keep


def domain_engine(folder: str, checkpoints: dict) -> dict:
    """``app_config``'s engine section with ``draft.domain_checkpoints`` (the section is replaced whole)."""
    return {"model": {"name": folder, "quantize": "none"}, "k": {"fixed_k": 3}, "chat_template": False,
            "draft": {"kind": "truncated", "num_layers": 2, "domain_checkpoints": checkpoints}}


def app_config(folder: str, quantize: str = "none", **over) -> AppConfig:
    """The co-located application on the tiny model: a truncated draft at k = 3, clusters routing,
    no learner, small limits, four tenants' keys; ``over`` merges into the top-level sections.
    ``quantize="int4"``: the lean runtime, with its pooled KV cache (Hugging Face eager has none)."""
    doc = {
        "placement": "colocated",
        "engine": {"model": {"name": folder, "quantize": quantize}, "draft": {"kind": "truncated", "num_layers": 2},
                   "k": {"fixed_k": 3}, "chat_template": False},
        "router": {"mode": "clusters"},
        "learner": {"enabled": False},
        "ingress": {"model_name": MODEL, "max_tokens_limit": 64, "max_prompt_chars": 200, "max_in_flight": 4,
                    "max_body_bytes": 2048},
        "auth": {"keys": [
            {"tenant": "alice", "key_sha256": digest(KEY)},
            {"tenant": "ops", "key_sha256": digest(ADMIN), "admin": True},
            {"tenant": "iso", "key_sha256": digest(ISO), "isolate_training": True},
            {"tenant": "tiny", "key_sha256": digest(TINY), "limits": {"requests_per_minute": 1}},
        ], "isolate_training": False},  # tenants share drafts but for iso (isolation is the default)
    }
    for k, v in over.items():
        doc[k] = {**doc[k], **v} if isinstance(v, dict) and isinstance(doc.get(k), dict) else v
    return AppConfig.model_validate(doc)


class LocalPool(DraftPool):
    """`DraftPoolDeployment.stream` without Serve's multiplexing: every draft it loads stays loaded.
    `fail_after`: the replica dies (RayActorError) after that many steps of a request, once."""

    def __init__(self, cfg: AppConfig, learner=None, fail_after: int | None = None, fail_with=None, target=None):
        super().__init__(cfg, target, learner)
        self.held: dict = {}
        self.fail_after, self.fail_with = fail_after, fail_with
        self.requests: list = []

    def stream(self, req):
        return self._run(req, MODEL_ID.get() or GENERAL)

    async def loaded(self, draft_id: str):
        """The engine of ``draft_id``, loaded once and held (as multiplexing holds a loaded model)."""
        if draft_id not in self.held:
            self.held[draft_id] = await self.engine_for(draft_id)
        return self.held[draft_id]

    async def serve(self, prompt: str = "Hello world", n: int = 10, draft_id: str = GENERAL,
                    request_id: str | None = None, **req) -> list:
        """One greedy request of ``n`` tokens (EOS ignored) through ``generate``: every item it streams."""
        gen = GenerateRequest(request_id or f"r-{time.monotonic_ns()}", SamplingParams(max_tokens=n, ignore_eos=True),
                              prompt=prompt, **req)
        return [item async for item in self.generate(gen, await self.loaded(draft_id), draft_id)]

    async def _run(self, req, draft_id):
        self.requests.append((draft_id, req))
        engine = await self.loaded(draft_id)
        steps = 0
        async for item in self.generate(req, engine, draft_id):
            if self.fail_after is not None and isinstance(item, Chunk):
                steps += 1
                if steps > self.fail_after:
                    self.fail_after = None
                    raise self.fail_with or RayActorError()
            yield item


class App:
    """The composed application in this process."""

    def __init__(self, cfg: AppConfig, pools: list | None = None, metrics: bool = False, learner=None):
        self.cfg = cfg
        self.router = RouterServer(cfg.router)
        self.pools = pools or [LocalPool(cfg)]
        self.pool = Handle(*self.pools)
        self.learner = learner
        self.metrics = MetricsServer(cfg.metrics) if metrics else None  # its handles: below
        self.ingress = Ingress(cfg, Handle(self.router), self.pool, None if learner is None else Handle(learner),
                               metrics=None if self.metrics is None else Handle(self.metrics))
        if self.metrics is not None:
            self.metrics.handles = {"Ingress": Handle(self.ingress), "DraftPool": self.pool, "Router": Handle(self.router)}

    async def post(self, body=None, chat: bool = False, key: str | None = KEY, llama: bool = False, **kw):
        """`body` greedy unless it says otherwise (OpenAI's default temperature is 1); ``llama``:
        llama-server's own /completion, whose bodies are sent as they are."""
        if isinstance(body, dict) and "max_tokens" in body:
            body = {"temperature": 0, **body}
        return await answer(await self.ingress.completion(request(body, key, **kw), chat=chat, llama=llama))




def counter(meter, name: str, **labels) -> float:
    fam = meter.caps.catalog[name]
    return meter._counters.get((name, tuple(str(labels[n]) for n in fam.labels)), 0.0)


def hist(meter, name: str, **labels) -> tuple[float, float]:
    """(observations, their sum)."""
    fam = meter.caps.catalog[name]
    h = meter._hists.get((name, tuple(str(labels[n]) for n in fam.labels)))
    return (0.0, 0.0) if h is None else (sum(h[:-1]), h[-1])


class Loop:
    """One event loop per test: `serve.batch` queues (the router's, the target's) stay bound to the
    loop of their first call, as in a replica, so each test builds its own app and runs it here."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        async def cancel(tasks):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.run_until_complete(cancel(asyncio.all_tasks(self.loop)))  # the batch queues' loops
        self.loop.close()
