"""Block identity: a chained SHA-256 that is the same in every process and on every machine.

    root  = sha256("kvstrata-block" | spec version | extra keys)
    h[0]  = sha256(root | tokens[0:B])
    h[i]  = sha256(h[i-1] | tokens[i*B:(i+1)*B])

Extra keys (tenant cache salt, model id, adapter id) enter the root, so two chains with different
salts never share a hash. Equal hashes mean equal KV; prefix sharing relies on nothing else.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

HASH_SPEC_VERSION = 1


@dataclass(frozen=True, slots=True)
class HashContext:
    """What, besides the tokens, decides a block's KV: fixed per model and per tenant."""

    model_id: str
    cache_salt: str = ""
    adapter_id: str = ""
    kv_dtype: str = "auto"

    def root(self) -> bytes:
        h = hashlib.sha256(b"kvstrata-block")
        h.update(HASH_SPEC_VERSION.to_bytes(4, "little"))
        for part in (self.model_id, self.cache_salt, self.adapter_id, self.kv_dtype):
            data = part.encode()
            h.update(len(data).to_bytes(4, "little"))
            h.update(data)
        return h.digest()


def hash_block(parent: bytes, token_ids: list[int] | np.ndarray) -> bytes:
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def hash_blocks(root: bytes, token_ids: list[int], block_size: int, start_block: int = 0,
                parent: bytes | None = None) -> list[bytes]:
    """Hashes of the full blocks of token_ids from start_block on; parent is block start_block-1's hash."""
    prev = root if parent is None else parent
    out = []
    end_block = len(token_ids) // block_size
    arr = np.asarray(token_ids[start_block * block_size : end_block * block_size], dtype=np.int64)
    for i in range(end_block - start_block):
        prev = hash_block(prev, arr[i * block_size : (i + 1) * block_size])
        out.append(prev)
    return out
