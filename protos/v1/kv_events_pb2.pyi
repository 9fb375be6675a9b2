from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    tier: Tier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: Tier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class TierChanged(_message.Message):
    __slots__ = ("block_hashes", "from_tier", "to_tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FROM_TIER_FIELD_NUMBER: _ClassVar[int]
    TO_TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    from_tier: Tier
    to_tier: Tier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., from_tier: _Optional[_Union[Tier, str]] = ..., to_tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "tier_changed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TIER_CHANGED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    tier_changed: TierChanged
    cleared: bool
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., tier_changed: _Optional[_Union[TierChanged, _Mapping]] = ..., cleared: _Optional[bool] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("encoding_version", "worker_id", "incarnation", "sequence", "hash_spec_version", "timestamp", "events")
    ENCODING_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    HASH_SPEC_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    encoding_version: int
    worker_id: str
    incarnation: str
    sequence: int
    hash_spec_version: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, encoding_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., sequence: _Optional[int] = ..., hash_spec_version: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class IndexEntry(_message.Message):
    __slots__ = ("encoding_version", "tiers", "parent_hash")
    ENCODING_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    encoding_version: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    parent_hash: bytes
    def __init__(self, encoding_version: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., parent_hash: _Optional[bytes] = ...) -> None: ...

class WorkerRecord(_message.Message):
    __slots__ = ("encoding_version", "worker_id", "incarnation", "hash_spec_version", "started_at")
    ENCODING_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HASH_SPEC_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    encoding_version: int
    worker_id: str
    incarnation: str
    hash_spec_version: int
    started_at: float
    def __init__(self, encoding_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., hash_spec_version: _Optional[int] = ..., started_at: _Optional[float] = ...) -> None: ...
