"""The HTTP side: an OpenAI-compatible FastAPI app over one Scheduler.

Routes: POST /v1/chat/completions, POST /v1/completions (whole, or streamed as server-sent
events), GET /v1/models, GET /health, GET /metrics (Prometheus text).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from selfspec.errors import SelfSpecError
from selfspec.server import protocol as wire
from selfspec.server.guard import LimitBody, RequireKey
from selfspec.server.protocol import APIError, ChatRequest, CompletionRequest, ErrorBody
from selfspec.server.scheduler import Job, Scheduler

if TYPE_CHECKING:
    from selfspec.engine import Engine

DISCONNECT_POLL_SECONDS = 0.5


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [str(p) for p in first.get("loc", []) if p != "body"]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid request')}", param


@dataclass
class Limits:
    """What one request may ask: ``max_tokens`` when it names none, ``max_tokens_cap`` the most
    it may name (None: the context window), ``body_bytes`` its body's size; ``api_key`` (None:
    open) the key every /v1 route needs."""

    max_tokens: int = 1024
    max_tokens_cap: int | None = None
    body_bytes: int = 1 << 20
    api_key: str | None = None


class Service:
    """What the routes need: the engine (for tokens and limits), the scheduler, the model name
    clients use and the limits."""

    def __init__(self, engine: Engine, scheduler: Scheduler, model_name: str, limits: Limits):
        self.engine, self.scheduler = engine, scheduler
        self.model_name, self.limits = model_name, limits

    def prompt_ids(self, request: ChatRequest | CompletionRequest) -> list[int]:
        if request.model != self.model_name:
            raise APIError(
                404,
                f"model '{request.model}' is not served here; this server serves "
                f"'{self.model_name}' (GET /v1/models)",
                "model",
                "model_not_found",
            )
        try:
            if isinstance(request, ChatRequest):
                if not request.messages:
                    raise APIError(400, "messages is empty: send at least one message", "messages")
                messages = [{"role": m.role, "content": m.text()} for m in request.messages]
                return self.engine.encode_messages(messages)
            return self.engine.encode(request.text())
        except SelfSpecError as exc:
            raise APIError(400, str(exc), "prompt") from None

    def job_config(self, request, prompt_len: int):
        from selfspec.runtime.sampling import Sampling

        window = self.engine.runner.context_window or (prompt_len + self.limits.max_tokens)
        if prompt_len >= window:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens, more than the model's context window of "
                f"{window}; shorten it",
                "messages" if isinstance(request, ChatRequest) else "prompt",
                "context_length_exceeded",
            )
        cap = self.limits.max_tokens_cap
        for name, value in request.token_limits().items():  # each one given, used or not
            if value < 1:
                raise APIError(400, f"{name} must be at least 1, got {value}", name)
            if cap is not None and value > cap:
                raise APIError(400, f"{name} {value} is over this server's limit of {cap}", name)
        limit = request.token_limit()
        if limit is not None and prompt_len + limit > window:
            raise APIError(
                400,
                f"the prompt's {prompt_len} tokens plus max_tokens {limit} exceed the model's "
                f"context window of {window}; lower max_tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        default = min(self.limits.max_tokens, cap or self.limits.max_tokens)
        tokens = limit if limit is not None else min(default, window - prompt_len)
        sampling = Sampling(temperature=request.temperature, top_p=request.top_p)
        return self.engine.decode_config(
            self.scheduler.drafter,
            max_new_tokens=tokens,
            sampling=sampling,
            seed=request.seed,
            stop_strings=request.stop_strings(),
        )


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="selfspec", docs_url=None, redoc_url=None)
    app.add_middleware(LimitBody, limit=service.limits.body_bytes)
    if service.limits.api_key:  # outermost: a request without the key is read no further
        app.add_middleware(RequireKey, key=service.limits.api_key)

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)  # FastAPI's own: an unreadable body, an unknown path
    async def http_error(_request, exc: HTTPException):
        error = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_name}

    @app.get("/v1/models")
    async def models():
        entry = {"id": service.model_name, "object": "model", "created": 0, "owned_by": "selfspec"}
        return {"object": "list", "data": [entry]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        trainer = service.scheduler.trainer
        text = service.scheduler.metrics.prometheus(trainer.gauges() if trainer else [])
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _complete(service, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(service, body, request, chat=False)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            error = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
            schema["components"]["schemas"].update(error.pop("$defs"))
            schema["components"]["schemas"]["ErrorBody"] = error
            app.openapi_schema = wire.describe(
                schema,
                service.model_name,
                service.limits.max_tokens_cap,
                keyed=service.limits.api_key is not None,
            )
        return app.openapi_schema

    app.openapi = openapi
    return app


async def _complete(service: Service, body, request: Request, chat: bool):
    prompt_ids = service.prompt_ids(body)
    config = service.job_config(body, len(prompt_ids))
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = Job(
        prompt_ids,
        config,
        lambda kind, data: loop.call_soon_threadsafe(events.put_nowait, (kind, data)),
    )
    service.scheduler.submit(job)
    rid = wire.new_id("chatcmpl" if chat else "cmpl")
    if body.stream:
        return StreamingResponse(
            _stream(service, job, events, rid, len(prompt_ids), chat, request),
            media_type="text/event-stream",
        )
    try:
        while True:
            kind, data = await _next_event(events, request, job)
            if kind == "error":
                raise APIError(500, str(data), kind="server_error")
            if kind == "done":
                text, finish, stats = data
                use = wire.usage(len(prompt_ids), stats)
                if chat:
                    return wire.chat_response(rid, service.model_name, text, finish, use)
                return wire.text_response(rid, service.model_name, text, finish, use)
    finally:
        job.cancelled.set()  # a no-op once done; frees the slot if the client left


async def _next_event(events: asyncio.Queue, request: Request, job: Job):
    while True:
        try:
            return await asyncio.wait_for(events.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                raise asyncio.CancelledError from None


async def _stream(service, job: Job, events, rid: str, prompt_len: int, chat: bool, request):
    model = service.model_name

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    try:
        if chat:
            yield sse(wire.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        while True:
            kind, data = await _next_event(events, request, job)
            if kind == "text":
                yield sse(
                    wire.chat_chunk(rid, model, {"content": data})
                    if chat
                    else wire.text_response(rid, model, data, None)
                )
            elif kind == "error":
                yield sse(APIError(500, str(data), kind="server_error").body())
                break
            else:
                _text, finish, stats = data
                use = wire.usage(prompt_len, stats)
                last = (
                    wire.chat_chunk(rid, model, {}, finish)
                    if chat
                    else wire.text_response(rid, model, "", finish)
                )
                last["usage"] = use
                yield sse(last)
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # the client went away (or the stream ended): free the slot
