"""Requests and stream items between a front end and a worker, as `kvstrata.v1` protobuf bytes:
SamplingParams <-> WorkerRequest, StreamItem <-> WorkerStreamItem, and refusals carried as an
error kind that the front end raises again as the same exception."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.cluster.engine_service import Delta, Draining, EngineFailed, Overloaded, StreamItem, Usage
from kvstrata.protos.v1 import cluster_pb2 as cpb
from kvstrata.protos.v1 import generation_pb2 as pb
from kvstrata.worker.sampling_params import SamplingParams

ENCODING_VERSION = 1
ERRORS: dict[str, type[Exception]] = {"invalid": ValueError, "overloaded": Overloaded, "draining": Draining,
                                      "failed": EngineFailed}


def encode_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
                   cache_salt: str, cache_pins: list[tuple[int, float]] | None, tenant: str) -> bytes:
    p = params
    sampling = cpb.WorkerSampling(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                  min_p=p.min_p, stop=list(p.stop_strings), stop_token_ids=p.stop_token_ids or [],
                                  n=p.n, ignore_eos=p.ignore_eos, priority=p.priority)
    if p.seed is not None:
        sampling.seed = p.seed
    if p.logprobs is not None:
        sampling.logprobs = p.logprobs
    if p.kv_eviction is not None:
        sampling.kv_eviction = p.kv_eviction.spec()
    msg = cpb.WorkerRequest(encoding_version=ENCODING_VERSION, request_id=request_id,
                            prompt_token_ids=prompt_token_ids, sampling=sampling, cache_salt=cache_salt,
                            cache_pins=[cpb.CachePin(num_tokens=n, ttl_seconds=t) for n, t in cache_pins or ()],
                            tenant=tenant)
    if prompt is not None:
        msg.prompt_text = prompt
    return msg.SerializeToString()


@dataclass(frozen=True, slots=True)
class WorkerCall:
    """A request as a worker receives it: EngineService.generate's arguments."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    cache_salt: str
    cache_pins: list[tuple[int, float]]
    tenant: str


def decode_request(data: bytes) -> WorkerCall:
    msg = cpb.WorkerRequest()
    msg.ParseFromString(data)
    if msg.encoding_version != ENCODING_VERSION:
        raise ValueError(f"worker request encoding version {msg.encoding_version}, expected {ENCODING_VERSION}")
    s = msg.sampling
    params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                            min_p=s.min_p, seed=s.seed if s.HasField("seed") else None, stop=list(s.stop) or None,
                            stop_token_ids=list(s.stop_token_ids) or None, n=s.n,
                            logprobs=s.logprobs if s.HasField("logprobs") else None, ignore_eos=s.ignore_eos,
                            priority=s.priority, kv_eviction=s.kv_eviction if s.HasField("kv_eviction") else None)
    text = msg.prompt_text if msg.HasField("prompt_text") else None
    pins = [(p.num_tokens, p.ttl_seconds) for p in msg.cache_pins]
    return WorkerCall(msg.request_id, list(msg.prompt_token_ids), params, text, msg.cache_salt, pins, msg.tenant)


def encode_item(item: StreamItem, worker_id: str) -> bytes:
    deltas = [pb.GenerateResponse(index=d.index, token_ids=d.token_ids, text=d.text, finish_reason=d.finish_reason or "",
                                  logprobs=[pb.TokenLogprobs(top=[pb.TokenLogprob(token_id=t, logprob=lp)
                                                                  for t, lp in step.items()]) for step in d.logprobs])
              for d in item.deltas]
    msg = cpb.WorkerStreamItem(deltas=deltas, worker_id=worker_id)
    if item.usage is not None:
        u = item.usage
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                    cached_tokens=u.cached_tokens, cache_write_tokens=u.cache_write_tokens))
    return msg.SerializeToString()


def encode_error(error: Exception, worker_id: str) -> bytes:
    kind = next((k for k, cls in ERRORS.items() if isinstance(error, cls)), "failed")
    return cpb.WorkerStreamItem(error_kind=kind, error=str(error), worker_id=worker_id).SerializeToString()


def decode_item(data: bytes) -> StreamItem:
    """The item, with `worker` set; raises the worker's refusal or failure as the same exception type."""
    msg = cpb.WorkerStreamItem()
    msg.ParseFromString(data)
    if msg.error_kind:
        raise ERRORS.get(msg.error_kind, EngineFailed)(msg.error)
    deltas = [Delta(d.index, list(d.token_ids), d.text, d.finish_reason or None,
                    [{t.token_id: t.logprob for t in step.top} for step in d.logprobs]) for d in msg.deltas]
    usage = None
    if msg.HasField("usage"):
        u = msg.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cache_write_tokens)
    return StreamItem(deltas, usage, worker=msg.worker_id)
