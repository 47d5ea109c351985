"""What the server accepts and how it refuses: the OpenAI request bodies, their checks, and
errors in OpenAI's shape.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p",
               "code": null}}

Bodies are validated strictly, as OpenAI does: a field of the wrong JSON type is refused
(400 naming it: "stream": "yes", "max_tokens": "5", "n": true), never coerced. Unknown
fields are refused too rather than silently ignored; fields OpenAI defines that this server
cannot honour are accepted only at the value that means "off" (e.g. presence_penalty 0).
`cache_salt` (vLLM's name) or the X-Cache-Namespace header salts the caller's cache
namespace (server/tenancy.py); `ignore_eos` (vLLM's) keeps sampling past the model's
end-of-sequence token.

Every 503 carries Retry-After (RETRY_AFTER_S), so clients back off instead of hammering.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["APIError", "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions",
           "MAX_N", "MAX_STOP", "MAX_TOP_LOGPROBS", "RETRY_AFTER_S", "validation_error",
           "check_model", "check_prompt", "send_error"]

MAX_N = 16                # choices per request
MAX_STOP = 4              # stop strings, as OpenAI
MAX_TOP_LOGPROBS = 20
RETRY_AFTER_S = 1         # what every 503 asks a client to wait


class APIError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status (and its headers: a
    503 always says Retry-After, a 401 WWW-Authenticate)."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             408: "invalid_request_error", 413: "invalid_request_error", 500: "internal_error",
             503: "overloaded_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    @property
    def headers(self) -> dict[str, str]:
        if self.status == 503:
            return {"Retry-After": str(RETRY_AFTER_S)}
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        return {}


async def send_error(send, err: APIError, *, close: bool = False) -> None:
    """Answers an ASGI request with `err` (for middleware, below the framework)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---- pydantic's errors as OpenAI's -----------------------------------------------------

_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
             "string_type": "a string", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object"}
_UNION_MEMBERS = ("str", "int", "list[int]", "list[str]", "list[list[int]]")


def _json_type(v) -> str:
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                    (list, "an array"), (dict, "an object")):
        if isinstance(v, t):
            return name
    return "null" if v is None else type(v).__name__


def _param(loc) -> tuple[str | None, bool]:
    """The field a pydantic error location names, and whether it went into a union member
    (pydantic names the member it tried, which is not a field)."""
    parts = [p for p in loc if p != "body"]
    if not parts:
        return None, False
    out = str(parts[0])
    for p in parts[1:]:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in _UNION_MEMBERS or "[" in str(p):
            return out, True
        else:
            out += f".{p}"
    return out, False


def validation_error(errors: list[dict]) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors as a 400 naming the field."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    kind = err.get("type", "")
    param, in_union = _param(err.get("loc", ()))
    if kind == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err.get('msg')}")
    if kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        msg = f"Missing required parameter: {param}"
    elif in_union:
        msg = f"Invalid type for '{param}': got {_json_type(err.get('input'))}"
    elif kind in _EXPECTED:
        msg = f"Invalid type for '{param}': expected {_EXPECTED[kind]}, but got {_json_type(err.get('input'))} instead."
    else:
        msg = f"Invalid value for {param}: {err.get('msg')}" if param else str(err.get("msg"))
    return APIError(400, msg, param=param)


# ---- checks that need the served model -------------------------------------------------

def check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{served}`).",
                       param="model", code="model_not_found")


def check_prompt(ids: list[int], max_new: int | None, param: str, *, vocab: int, max_context: int) -> int:
    """The checked max_new_tokens of one prompt (None: what the context leaves)."""
    if not ids:
        raise APIError(400, f"{param} must not be empty", param=param)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in {param} is outside the vocabulary [0, {vocab})", param=param)
    if len(ids) >= max_context or (max_new is not None and len(ids) + max_new > max_context):
        want = f" + {max_new} to generate" if max_new is not None else ""
        raise APIError(400, f"This model's maximum context length is {max_context} tokens. However, "
                       f"you requested {len(ids)}{want} ({len(ids)} in the {param}).",
                       param=param if max_new is None or len(ids) >= max_context else "max_tokens",
                       code="context_length_exceeded")
    return max_new if max_new is not None else max_context - len(ids)


# ---- bodies ----------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False

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
    model_config = ConfigDict(extra="allow", strict=True)    # name, tool_call_id, ... reach the template

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
