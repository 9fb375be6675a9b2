from kvstrata.protos.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerSampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n", "logprobs", "ignore_eos", "priority", "kv_eviction")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KV_EVICTION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    logprobs: int
    ignore_eos: bool
    priority: int
    kv_eviction: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., priority: _Optional[int] = ..., kv_eviction: _Optional[str] = ...) -> None: ...

class CachePin(_message.Message):
    __slots__ = ("num_tokens", "ttl_seconds")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    ttl_seconds: float
    def __init__(self, num_tokens: _Optional[int] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class WorkerRequest(_message.Message):
    __slots__ = ("encoding_version", "request_id", "prompt_token_ids", "prompt_text", "sampling", "cache_salt", "cache_pins", "tenant")
    ENCODING_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CACHE_PINS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    encoding_version: int
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    sampling: WorkerSampling
    cache_salt: str
    cache_pins: _containers.RepeatedCompositeFieldContainer[CachePin]
    tenant: str
    def __init__(self, encoding_version: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., cache_salt: _Optional[str] = ..., cache_pins: _Optional[_Iterable[_Union[CachePin, _Mapping]]] = ..., tenant: _Optional[str] = ...) -> None: ...

class WorkerStreamItem(_message.Message):
    __slots__ = ("deltas", "usage", "error_kind", "error", "worker_id")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[_generation_pb2.GenerateResponse]
    usage: _generation_pb2.Usage
    error_kind: str
    error: str
    worker_id: str
    def __init__(self, deltas: _Optional[_Iterable[_Union[_generation_pb2.GenerateResponse, _Mapping]]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., error_kind: _Optional[str] = ..., error: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...
