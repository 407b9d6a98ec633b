"""The OpenAI wire format: request bodies (validated by pydantic), error bodies, and response
bodies for chat and text completions, whole or as server-sent-event chunks."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


class APIError(Exception):
    """A request the server refuses: an OpenAI-style error body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """What every refused request gets (APIError.body()), as OpenAI's servers answer."""

    error: ErrorDetail


ERROR_STATUSES = {
    400: "a malformed or out-of-range request",
    401: "no API key, or not this server's (when it has one)",
    404: "a model this server does not serve",
    413: "a request body over the server's limit",
    503: "the queue is full or the server is shutting down; retry later",
}


def describe(schema: dict, model_name: str, max_tokens_cap: int | None, keyed: bool) -> dict:
    """The OpenAPI document as the server behaves: ``model`` names the one served model, token
    limits stop at the server's cap, /v1 routes need the bearer key when it has one, every
    refusal is an ErrorBody with the status it really has (FastAPI's 422 is answered as 400),
    and completions stream as server-sent events."""
    if keyed:
        schema["components"]["securitySchemes"] = {"key": {"type": "http", "scheme": "bearer"}}
    for name in ("ChatRequest", "CompletionRequest"):
        fields = schema["components"]["schemas"][name]["properties"]
        fields["model"]["enum"] = [model_name]
        for limit in ("max_tokens", "max_completion_tokens"):
            if limit in fields and max_tokens_cap is not None:
                fields[limit]["maximum"] = max_tokens_cap
    schema["components"]["schemas"].pop("HTTPValidationError", None)
    schema["components"]["schemas"].pop("ValidationError", None)
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)
            if not path.startswith("/v1"):
                continue
            if keyed:
                operation["security"] = [{"key": []}]
            statuses = list(ERROR_STATUSES) if "requestBody" in operation else [401]
            for status in statuses if keyed else [s for s in statuses if s != 401]:
                why = ERROR_STATUSES[status]
                content = {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
                }
                responses[str(status)] = {"description": why, "content": content}
            if "requestBody" in operation:
                event = {"type": "object", "properties": {"data": {"type": "string"}}}
                responses["200"]["content"]["text/event-stream"] = {"schema": event}
    return schema


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


def _whole(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON Schema has it: 2.0 is one, "2" and true are not (the models are strict).
Whole = Annotated[int, BeforeValidator(_whole)]
# Any integer seeds a request; torch's generators take 64 bits, so it is taken modulo 2**64.
Seed = Annotated[Whole, AfterValidator(lambda seed: seed % (1 << 64))]

# Bounds the server checks itself (for its own one-line messages), stated in the OpenAPI schema.
AT_LEAST_ONE = {"minimum": 1}
ONE_ITEM_OR_MORE = {"minItems": 1}
_TEXT = {"type": "string", "minLength": 1}
ONE_PROMPT = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 1}]}


class _Sampling(BaseModel):
    """Fields both endpoints share; unknown fields are ignored, as OpenAI servers do."""

    # strict: a field gets the JSON type its schema states ("stream": 0 is not a boolean)
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: Whole | None = Field(None, json_schema_extra=AT_LEAST_ONE)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool = False
    n: Whole = Field(1, ge=1, le=1)

    def token_limits(self) -> dict[str, int]:
        """The token limits the request names, by field."""
        raise NotImplementedError

    def token_limit(self) -> int | None:
        """The limit that applies: a chat's max_completion_tokens over its max_tokens."""
        limits = self.token_limits()
        return limits.get("max_completion_tokens", limits.get("max_tokens"))

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(json_schema_extra=ONE_ITEM_OR_MORE)
    max_completion_tokens: Whole | None = Field(None, json_schema_extra=AT_LEAST_ONE)

    def token_limits(self) -> dict[str, int]:
        limits = {
            "max_tokens": self.max_tokens,
            "max_completion_tokens": self.max_completion_tokens,
        }
        return {name: value for name, value in limits.items() if value is not None}


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(json_schema_extra=ONE_PROMPT)

    def token_limits(self) -> dict[str, int]:
        return {} if self.max_tokens is None else {"max_tokens": self.max_tokens}

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(400, "this server takes one prompt per request", "prompt")
            return self.prompt[0]
        return self.prompt


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, stats) -> dict:
    """OpenAI's usage block for a request decoded with ``stats`` (a DecodeStats), and selfspec's
    figures for it under ``selfspec`` (clients that ignore unknown fields are unaffected)."""
    completion_tokens = stats.new_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
        "selfspec": speculation(stats),
    }


def speculation(stats) -> dict:
    """One request's speculation: target passes (the prefill's included), draft tokens proposed
    and kept, tokens per pass after the prefill, and the same by kind of draft."""
    sources = {
        name: {"rounds": rounds, "drafted": drafted, "accepted": accepted}
        for name, (rounds, drafted, accepted) in stats.sources.items()
    }
    return {
        "target_passes": stats.target_passes + 1,
        "drafted_tokens": stats.drafted,
        "accepted_tokens": stats.accepted,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "by_draft_source": sources,
    }


def chat_response(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        ],
        "usage": use,
    }


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def text_response(rid: str, model: str, text: str, finish: str | None, use=None) -> dict:
    body = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
    }
    if use is not None:
        body["usage"] = use
    return body
