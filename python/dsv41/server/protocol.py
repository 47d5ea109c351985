"""The OpenAI request bodies the server accepts, and its errors in OpenAI's shape.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p",
               "code": null}}

Unknown fields are refused (400 naming the field), as OpenAI does, rather than silently
ignored; fields OpenAI defines that this server cannot honour are accepted only at the
value that means "off" (e.g. presence_penalty 0). `cache_salt` (vLLM's name) picks the
tenant's cache namespace, as the X-Cache-Namespace header does.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["APIError", "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions",
           "MAX_N", "MAX_STOP", "MAX_TOP_LOGPROBS"]

MAX_N = 16                # choices per request
MAX_STOP = 4              # stop strings, as OpenAI
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 500: "internal_error",
             503: "overloaded_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's; accepted, usage is sent at the end only


class _Sampling(_Strict):
    """The fields completions and chat share."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, max_length=256)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v):
        if v != 0:
            raise ValueError("penalties are not supported by this server (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server")
        return v

    def check(self) -> None:
        """The rules between fields (a field's own rules are its validators): APIError
        naming the field."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: text, a list of token ids, or a list of either (one
    set of choices per prompt). `logprobs`: how many top alternatives (0 = the sampled
    token only)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported by this server")
        return v

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported by this server (only equal to n)",
                           param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")    # name, tool_call_id, ... reach the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `max_completion_tokens` is OpenAI's newer name for
    max_tokens; without either a reply may fill the model's context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
