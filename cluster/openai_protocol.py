"""The OpenAI-compatible wire format: request bodies, validated strictly (an unknown field or a value
of the wrong type is an error naming it), and OpenAI-style error responses."""

from __future__ import annotations

import re
from typing import Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class CommonRequest(_Strict):
    """Fields both endpoints share. null means the default, as in OpenAI's API."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions, as in vLLM
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # kvstrata's own: a token eviction policy spec, e.g. "streaming(sinks=4, window=252)" (lossy)
    kv_eviction: str | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


TTL_SECONDS = {"5m": 300, "1h": 3600}


class CacheControl(_Strict):
    """A prompt-cache breakpoint: the prompt up to here stays cached (in some tier) for `ttl`."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    cache_control: CacheControl | None = None

    def breakpoint_ttl(self) -> int | None:
        """TTL seconds of this message's breakpoint (its own or on one of its parts), if any."""
        marks = [self.cache_control]
        if isinstance(self.content, list):
            marks += [p.cache_control for p in self.content]
        ttls = [TTL_SECONDS[m.ttl] for m in marks if m is not None]
        return max(ttls) if ttls else None


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None


# -- errors --------------------------------------------------------------------------------------
_FIELD = re.compile(r"^([a-z_]+)(?:\[\d+\])?[ .:]")


def error_response(status: int, message: str, kind: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def bad_request(message: str) -> JSONResponse:
    m = _FIELD.match(message)
    return error_response(400, message, "invalid_request_error", m.group(1) if m else None)


def validation_error(exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}",
                      "invalid_request_error")
    if not loc:
        return error_response(400, f"request body: {err.get('msg')}", "invalid_request_error")
    # unions report the branch tried ('prompt.str'); keep the field path the user wrote
    path = ".".join(p for p in loc if p not in ("str", "list[str]", "list[int]", "list[list[int]]",
                                                  "list[TextPart]", "float", "int"))
    if err.get("type") == "extra_forbidden":
        return error_response(400, f"{path}: unknown or unsupported field", "invalid_request_error", loc[0])
    if err.get("type") == "missing":
        return error_response(400, f"{path} is required", "invalid_request_error", loc[0])
    return error_response(400, f"{path}: {err.get('msg')}", "invalid_request_error", loc[0])


def check_unicode(text: str, field_name: str) -> None:
    """JSON can carry lone surrogates (\\ud800), which are not text; refuse them by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field_name} holds an invalid character (a lone surrogate) at position {e.start}") from None
