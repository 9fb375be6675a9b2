"""The OpenAI-compatible HTTP front end (FastAPI): /v1/completions and /v1/chat/completions, both
with `stream: true` as server-sent events, /v1/models, /health and /metrics. A thin layer over one
`EngineService`, like the gRPC front end.

Request bodies are validated strictly: an unknown field, a value of the wrong type or malformed JSON
is HTTP 400 with an OpenAI-style error body whose `param` names the field. Overload is 429, a
draining server 503, a missing or wrong API key 401 (http_errors.py maps each error to its answer).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstrata.cluster.engine_service import Delta, EngineFailed, EngineService, StreamItem, chat_cache_pins
from kvstrata.cluster.http_errors import BodyLimit, answer_errors
from kvstrata.cluster.http_runs import Runs, unless_disconnected
from kvstrata.cluster.metrics import CONTENT_TYPE, ServingMetrics
from kvstrata.cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CommonRequest,
    check_unicode,
    error_response,
)
from kvstrata.cluster.tenants import Tenant, TenantAuth, bearer_token
from kvstrata.worker.sampling_params import SamplingParams

WORKER_HEADER = "x-kvstrata-worker"  # in a cluster: the worker(s) that served the request
MAX_BODY_BYTES = 16 << 20  # as the gRPC message cap


@dataclass
class _Choice:
    """The output of one choice, accumulated for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None


class _Usage:
    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = self.written = 0

    def add(self, item: StreamItem) -> None:
        if item.usage is not None:
            self.prompt += item.usage.prompt_tokens
            self.completion += item.usage.completion_tokens
            self.cached += item.usage.cached_tokens
            self.written += item.usage.cache_write_tokens

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": self.cached, "cache_write_tokens": self.written}}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# -- the app -------------------------------------------------------------------------------------
class OpenAIServer:
    """Builds the FastAPI app over one EngineService. `model_names` are the names clients may ask for;
    the first is the one /v1/models and responses report."""

    def __init__(self, service: EngineService, model_names: list[str], auth: TenantAuth | None = None,
                 metrics: ServingMetrics | None = None):
        if not model_names:
            raise ValueError("model_names must name at least one model")
        self.service = service
        self.info = service.model_info
        self.tokenizer = service.model_info.tokenizer
        self.model_names = list(dict.fromkeys(model_names))
        self.auth = auth or TenantAuth()
        self.metrics = metrics or service.metrics
        self.app = self._build()

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    # -- helpers ---------------------------------------------------------------------------------
    def _tenant(self, request: Request) -> Tenant:
        host = request.client.host if request.client else None
        return self.auth.authenticate(bearer_token(request.headers.get("authorization")), host)

    def _check_model(self, name: str) -> JSONResponse | None:
        if name in self.model_names:
            return None
        return error_response(404, f"model {name!r} is not served here; available: {', '.join(self.model_names)}",
                      "not_found_error", "model")

    def _sampling(self, req: CommonRequest, max_tokens: int, logprobs: int | None,
                  max_tokens_field: str = "max_tokens", logprobs_field: str = "logprobs") -> SamplingParams:
        """ValueErrors name the field as the client wrote it (chat has max_completion_tokens, top_logprobs)."""
        if max_tokens > self.service.max_tokens_limit:
            raise ValueError(f"{max_tokens_field} must be at most {self.service.max_tokens_limit}, got {max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise ValueError(f"{name}: only 0 is supported")
        if req.logit_bias:
            raise ValueError("logit_bias: not supported")
        kw: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs, "ignore_eos": req.ignore_eos}
        for name in ("temperature", "top_p", "n", "seed", "top_k", "min_p", "stop", "stop_token_ids",
                     "kv_eviction"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            message = str(e)
            for name, field_name in (("max_tokens", max_tokens_field), ("logprobs", logprobs_field)):
                if message.startswith(name + " "):
                    message = field_name + message[len(name):]
            raise ValueError(message) from None

    def _token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    async def _run(self, request: Request, tenant: Tenant, req: CommonRequest,
                   prompts: list[tuple[list[int], str | None]], params: SamplingParams, prefix: str,
                   render: Callable[[list[_Choice], _Usage, str, int], dict[str, Any]],
                   chunk: Callable[[int, Delta, str, int], dict[str, Any]],
                   first_chunks: Callable[[str, int], list[dict[str, Any]]] | None = None,
                   cache_pins: list[tuple[int, float]] | None = None) -> Response:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        salt = self.auth.cache_salt(tenant.name)
        n = params.n
        runs = await unless_disconnected(request, Runs.start(self.service, prompts, params, salt, request_id,
                                                               cache_pins, tenant.name))
        served_by = {WORKER_HEADER: ",".join(runs.workers)} if runs.workers else {}
        if not req.stream:
            async def collect() -> Response:
                choices = [_Choice() for _ in range(len(prompts) * n)]
                usage = _Usage()
                async for k, item in runs.items():
                    for d in item.deltas:
                        c = choices[k * n + d.index]
                        c.text += d.text
                        c.token_ids += d.token_ids
                        c.logprobs += d.logprobs
                        c.finish_reason = d.finish_reason or c.finish_reason
                    usage.add(item)
                return JSONResponse(render(choices, usage, request_id, created), headers=served_by)

            try:
                return await unless_disconnected(request, collect())
            finally:
                await runs.aclose()

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        chunk_object = "chat.completion.chunk" if prefix == "chatcmpl" else "text_completion"

        async def events() -> AsyncIterator[bytes]:
            usage = _Usage()
            try:
                for obj in (first_chunks(request_id, created) if first_chunks else []):
                    yield _sse(obj)
                async for k, item in runs.items():
                    for d in item.deltas:
                        obj = chunk(k * n + d.index, d, request_id, created)
                        if include_usage:
                            obj["usage"] = None
                        yield _sse(obj)
                    usage.add(item)
                if include_usage:
                    yield _sse({"id": request_id, "object": chunk_object, "created": created,
                                "model": self.model_name, "choices": [], "usage": usage.to_json()})
            except Exception as e:  # after the headers: report in the stream
                code, kind = (503, "unavailable_error") if isinstance(e, EngineFailed) else (500, "server_error")
                yield _sse({"error": {"message": str(e), "type": kind, "param": None, "code": code}})
            finally:
                await runs.aclose()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **served_by})

    # -- endpoints -------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request, tenant: Tenant) -> Response:
        bad = self._check_model(req.model)
        if bad is not None:
            return bad
        if req.suffix:
            raise ValueError("suffix: not supported")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise ValueError("best_of: only best_of equal to n is supported")
        prompts = self._completion_prompts(req.prompt)
        if req.max_tokens is None:
            max_tokens = self.service.max_tokens_limit
        else:
            max_tokens = req.max_tokens
        params = self._sampling(req, max_tokens, req.logprobs)
        echoed: set[int] = set()
        n = params.n
        model = self.model_name

        def logprobs_json(ids: list[int], steps: list[dict[int, float]], offset: int) -> dict[str, Any] | None:
            if req.logprobs is None:
                return None
            toks = self._token_strings(ids)
            offsets = []
            for t in toks:
                offsets.append(offset)
                offset += len(t)
            return {"tokens": toks, "token_logprobs": [s.get(i) for i, s in zip(ids, steps)],
                    "top_logprobs": [{self._token_strings([t])[0]: lp for t, lp in s.items()} for s in steps],
                    "text_offset": offsets}

        def text_of(index: int, text: str) -> str:
            if req.echo and index not in echoed:  # by now the engine has validated the prompt
                echoed.add(index)
                ids, prompt_text = prompts[index // n]
                return (prompt_text if prompt_text is not None else self.tokenizer.decode(ids)) + text
            return text

        def render(choices: list[_Choice], usage: _Usage, rid: str, created: int) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": i, "text": text_of(i, c.text),
                                 "logprobs": logprobs_json(c.token_ids, c.logprobs, 0),
                                 "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
                    "usage": usage.to_json()}

        def chunk(index: int, d: Delta, rid: str, created: int) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text_of(index, d.text),
                                 "logprobs": logprobs_json(d.token_ids, d.logprobs, 0),
                                 "finish_reason": d.finish_reason}]}

        return await self._run(request, tenant, req, prompts, params, "cmpl", render, chunk)

    def _completion_prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        if all(isinstance(p, int) for p in prompt):
            return [(list(prompt), None)]
        out: list[tuple[list[int], str | None]] = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"prompt[{i}] is empty")
                check_unicode(p, f"prompt[{i}]")
                out.append((self.tokenizer.encode(p), p))
            else:
                if not p:
                    raise ValueError(f"prompt[{i}] is empty")
                out.append((list(p), None))
        if len(out) > 64:
            raise ValueError(f"prompt: at most 64 prompts per request, got {len(out)}")
        return out

    async def chat_completions(self, req: ChatCompletionRequest, request: Request, tenant: Tenant) -> Response:
        bad = self._check_model(req.model)
        if bad is not None:
            return bad
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise ValueError("max_completion_tokens: give max_tokens or max_completion_tokens, not both")
        messages = []
        for m in req.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else \
                "".join(p.text for p in m.content)
            check_unicode(content or "", "messages.content")
            check_unicode(m.role, "messages.role")
            messages.append({"role": m.role, "content": content or ""})
        if not messages:
            raise ValueError("messages is empty")
        text = self.tokenizer.apply_chat_template(messages)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        pins = chat_cache_pins(self.tokenizer, messages, [m.breakpoint_ttl() for m in req.messages], ids)
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        if max_tokens is None:  # as many as fit
            room = self.info.max_model_len - len(ids)
            max_tokens = max(1, min(self.service.max_tokens_limit, room))
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        params = self._sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                "max_tokens" if req.max_tokens is not None else "max_completion_tokens",
                                "top_logprobs")
        model = self.model_name
        top_n = req.top_logprobs or 0

        def entry(token_id: int, lp: float | None) -> dict[str, Any]:
            s = self._token_strings([token_id])[0]
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        def logprobs_json(ids: list[int], steps: list[dict[int, float]]) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            content = []
            for i, step in zip(ids, steps):
                top = sorted(step.items(), key=lambda kv: -kv[1])[:top_n]
                content.append({**entry(i, step.get(i)), "top_logprobs": [entry(t, lp) for t, lp in top]})
            return {"content": content}

        def render(choices: list[_Choice], usage: _Usage, rid: str, created: int) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                                 "logprobs": logprobs_json(c.token_ids, c.logprobs),
                                 "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
                    "usage": usage.to_json()}

        def chunk(index: int, d: Delta, rid: str, created: int) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": index, "delta": {"content": d.text} if d.text else {},
                                 "logprobs": logprobs_json(d.token_ids, d.logprobs),
                                 "finish_reason": d.finish_reason}]}

        def first_chunks(rid: str, created: int) -> list[dict[str, Any]]:
            return [{"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]} for i in range(params.n)]

        return await self._run(request, tenant, req, [(ids, text)], params, "chatcmpl", render, chunk,
                               first_chunks, pins)

    def models(self) -> dict[str, Any]:
        max_len = self.info.max_model_len
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvstrata",
                                            "root": self.info.model_id, "max_model_len": max_len}
                                           for name in self.model_names]}

    async def metrics_text(self) -> Response:
        if self.metrics is None:
            return Response("metrics are off\n", status_code=404, media_type="text/plain")
        self.metrics.update_engine(await self.service.cache_stats())
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def _build(self) -> FastAPI:
        app = FastAPI(title="kvstrata", version="1", summary="OpenAI-compatible API of a kvstrata server")
        app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
        answer_errors(app)

        # the key is checked (a dependency) before the body is validated
        tenant_dep = Depends(self._tenant)

        @app.post("/v1/completions")
        async def completions(req: CompletionRequest, request: Request, tenant: Tenant = tenant_dep) -> Response:
            return await self.completions(req, request, tenant)

        @app.post("/v1/chat/completions")
        async def chat_completions(req: ChatCompletionRequest, request: Request,
                                   tenant: Tenant = tenant_dep) -> Response:
            return await self.chat_completions(req, request, tenant)

        @app.get("/v1/models")
        async def models(tenant: Tenant = tenant_dep) -> dict[str, Any]:
            return self.models()

        @app.get("/health")
        async def health() -> Response:
            if self.service.draining:
                return JSONResponse({"status": "draining"}, status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics() -> Response:
            return await self.metrics_text()

        return app
