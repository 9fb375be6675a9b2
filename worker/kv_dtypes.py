"""The KV cache storage formats by name (no torch here, so the CLI can list them without loading it)."""

KV_DTYPE_NAMES = ("auto", "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
INT4_MAX_V_GROUP = 16  # the most channels that share an int4 value scale (docs/benchmarks.md)


def int4_row_extra_bytes(head_dim: int, block_size: int) -> int:
    """Scale bytes in each int4 row: room for the block's per-channel key step and zero point (one
    byte each, spread over the block's rows) and for one token's value scales (one byte each, at
    least one per INT4_MAX_V_GROUP channels)."""
    return max(-(-2 * head_dim // block_size), -(-head_dim // INT4_MAX_V_GROUP))


def int4_value_group(head_dim: int, block_size: int) -> int:
    """Channels per int4 value scale: the fewest (a divisor of head_dim) whose scales fit in the row's
    extra bytes, so values use the room the keys' block parameters leave."""
    extra = int4_row_extra_bytes(head_dim, block_size)
    return next(g for g in range(1, head_dim + 1) if head_dim % g == 0 and head_dim // g <= extra)
