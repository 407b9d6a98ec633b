"""The OpenAI wire format: request bodies (validated by pydantic), error bodies, and response
bodies for chat and text completions, whole or as server-sent-event chunks."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class _Sampling(BaseModel):
    """Fields both endpoints share; unknown fields are ignored, as OpenAI servers do."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None

    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str]

    def token_limit(self) -> int | None:
        return self.max_tokens

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
