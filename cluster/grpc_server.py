"""The gRPC front end: kvstrata.v1.Generation and Admin, grpc.health.v1 and server reflection, as a
thin layer over one `EngineService`. Messages are protobuf only; nothing on the wire is pickled.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from google.protobuf.message import DecodeError

from kvstrata.cluster.engine_service import Delta, Draining, EngineFailed, EngineService, Overloaded, chat_cache_pins
from kvstrata.cluster.tenants import PermissionDenied, Tenant, TenantAuth, Unauthenticated, bearer_token, grpc_peer_host
from kvstrata.protos.v1 import generation_pb2 as pb
from kvstrata.protos.v1 import generation_pb2_grpc as pb_grpc
from kvstrata.worker.sampling_params import SamplingParams

WORKER_METADATA = "x-kvstrata-worker"  # trailing metadata in a cluster: the worker that served the call

MAX_MESSAGE_BYTES = 16 << 20
SERVICE_NAMES = ("kvstrata.v1.Generation", "kvstrata.v1.Admin")


def sampling_params(opts: pb.SamplingOptions) -> SamplingParams:
    """SamplingOptions -> SamplingParams; unset fields keep SamplingParams' defaults. ValueError names the field."""
    kw: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "logprobs"):
        if opts.HasField(name):
            kw[name] = getattr(opts, name)
    if opts.stop:
        kw["stop"] = list(opts.stop)
    if opts.stop_token_ids:
        kw["stop_token_ids"] = list(opts.stop_token_ids)
    kw["ignore_eos"] = opts.ignore_eos
    if opts.HasField("kv_eviction"):
        kw["kv_eviction"] = opts.kv_eviction  # a spec; SamplingParams parses it
    return SamplingParams(**kw)


async def authenticate(auth: TenantAuth, context: grpc.aio.ServicerContext, admin: bool = False) -> Tenant:
    """The caller's tenant from its `authorization: Bearer KEY` metadata; aborts the call when refused."""
    metadata = {k: v for k, v in (context.invocation_metadata() or ())}
    try:
        tenant = auth.authenticate(bearer_token(metadata.get("authorization")), grpc_peer_host(context.peer()))
        if admin:
            auth.require_admin(tenant)
    except Unauthenticated as e:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
    except PermissionDenied as e:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
    return tenant


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, service: EngineService, auth: TenantAuth):
        self.service = service
        self.auth = auth
        self.info = service.model_info
        self.tokenizer = service.model_info.tokenizer

    def _prompt(self, request: pb.GenerateRequest) -> tuple[list[int], str | None]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise ValueError("prompt is required: set text, token_ids or chat")
        if kind == "text":
            if not request.text:
                raise ValueError("prompt.text is empty")
            return self.tokenizer.encode(request.text), request.text
        if kind == "token_ids":
            return list(request.token_ids.ids), None
        return self._chat(request.chat, "prompt.chat.messages")

    def _chat(self, chat: pb.ChatMessages, field: str) -> tuple[list[int], str]:
        """Chat messages through the model's template -> (token ids, templated text)."""
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        if not messages:
            raise ValueError(f"{field} is empty")
        text = self.tokenizer.apply_chat_template(messages)
        return self.tokenizer.encode(text, add_special_tokens=False), text

    def _cache_pins(self, request: pb.GenerateRequest, prompt_ids: list[int]) -> list[tuple[int, float]] | None:
        if request.WhichOneof("prompt") != "chat":
            return None
        msgs = request.chat.messages
        ttls = [m.cache_control.ttl_seconds if m.HasField("cache_control") else None for m in msgs]
        if all(t is None for t in ttls):
            return None
        for i, t in enumerate(ttls):
            if t is not None and not 0 < t <= 86400:
                raise ValueError(f"prompt.chat.messages[{i}].cache_control.ttl_seconds must be 1 to 86400, got {t}")
        messages = [{"role": m.role, "content": m.content} for m in msgs]
        return chat_cache_pins(self.tokenizer, messages, ttls, prompt_ids)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        tenant = await authenticate(self.auth, context)
        served_by = ""
        try:
            prompt_ids, text = self._prompt(request)
            params = sampling_params(request.sampling)
            rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
            salt = self.auth.cache_salt(tenant.name)
            pins = self._cache_pins(request, prompt_ids)
            async for item in self.service.generate(prompt_ids, params, request_id=rid, prompt=text, cache_salt=salt,
                                                    cache_pins=pins, tenant=tenant.name):
                if item.worker and not served_by:
                    served_by = item.worker
                    context.set_trailing_metadata(((WORKER_METADATA, served_by),))
                for d in item.deltas:
                    yield _response(d, rid)
                if item.usage is not None:
                    u = item.usage
                    yield pb.GenerateResponse(
                        request_id=rid,
                        usage=pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                       cached_tokens=u.cached_tokens, cache_write_tokens=u.cache_write_tokens))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (Draining, EngineFailed) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        await authenticate(self.auth, context)
        kind = request.WhichOneof("input")
        try:
            if kind == "text":
                ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
            elif kind == "chat":
                ids, _ = self._chat(request.chat, "input.chat.messages")
            else:
                raise ValueError("input is required: set text or chat")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids, tokens=[self.tokenizer.id_to_token(i) or "" for i in ids])

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await authenticate(self.auth, context)
        c = self.info.config
        return pb.ModelInfo(
            model_id=self.info.model_id, dtype=self.info.dtype,
            max_model_len=self.info.max_model_len, vocab_size=c.vocab_size,
            block_size=self.info.block_size, num_layers=c.num_layers, num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, max_tokens_limit=self.service.max_tokens_limit)


def _response(d: Delta, request_id: str) -> pb.GenerateResponse:
    logprobs = [pb.TokenLogprobs(top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in step.items()])
                for step in d.logprobs]
    return pb.GenerateResponse(request_id=request_id, index=d.index, token_ids=d.token_ids, text=d.text,
                               finish_reason=d.finish_reason or "", logprobs=logprobs)


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, service: EngineService, auth: TenantAuth,
                 health_servicer: health.aio.HealthServicer | None = None):
        self.service = service
        self.auth = auth
        self.health = health_servicer

    async def GetCacheStats(self, request: pb.GetCacheStatsRequest, context: grpc.aio.ServicerContext) -> pb.CacheStats:
        await authenticate(self.auth, context, admin=True)
        s = await self.service.cache_stats()
        return pb.CacheStats(**{f.name: s[f.name] for f in pb.CacheStats.DESCRIPTOR.fields})

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        await authenticate(self.auth, context, admin=True)
        in_flight = self.service.drain()
        if self.health is not None:
            await set_serving(self.health, False)
        return pb.DrainResponse(in_flight=in_flight)

    async def FlushCache(self, request: pb.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> pb.FlushCacheResponse:
        await authenticate(self.auth, context, admin=True)
        return pb.FlushCacheResponse(blocks_flushed=await self.service.flush_cache())


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, status)


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> grpc.ServerCredentials:
    """TLS from PEM files; with a client CA, clients must present a certificate it signed (mTLS)."""
    def read(path: str, what: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None

    ca = read(client_ca_file, "tls_client_ca") if client_ca_file else None
    return grpc.ssl_server_credentials([(read(key_file, "tls_key"), read(cert_file, "tls_cert"))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def _handlers(service_name: str, servicer: Any) -> grpc.GenericRpcHandler:
    """Like the generated add_*_to_server, but a request that does not parse is INVALID_ARGUMENT
    (grpc would answer UNKNOWN with no details, and log a traceback)."""
    descriptor = pb.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in descriptor.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(_guarded(getattr(servicer, method.name), method.server_streaming),
                                     request_deserializer=_lenient_parser(request_cls),
                                     response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


def _lenient_parser(cls: Any):
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError:
            return None  # refused by _guarded, with a status that says why
    return parse


def _guarded(behaviour: Any, streaming: bool) -> Any:
    message = "the request is not a valid protobuf message of the method's request type"
    if streaming:
        async def stream(request: Any, context: grpc.aio.ServicerContext):
            if request is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            async for response in behaviour(request, context):
                yield response
        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        return await behaviour(request, context)
    return unary


def build_server(service: EngineService, address: str, credentials: grpc.ServerCredentials | None = None,
                 auth: TenantAuth | None = None) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A started-on-demand grpc.aio server with every service registered; returns it, its health
    servicer and the bound port (useful with port 0). Without `auth`, the server is open to loopback."""
    auth = auth or TenantAuth()
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    server = grpc.aio.server(options=options)
    health_servicer = health.aio.HealthServicer()
    server.add_generic_rpc_handlers((
        _handlers("Generation", GenerationServicer(service, auth)),
        _handlers("Admin", AdminServicer(service, auth, health_servicer)),
    ))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    return server, health_servicer, port
