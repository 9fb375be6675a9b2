"""The KV cache storage formats by name (no torch here, so the CLI can list them without loading it)."""

KV_DTYPE_NAMES = ("auto", "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
INT4_V_GROUP = 16  # channels per int4 value scale, chosen by measurement (docs/benchmarks.md)


def int4_value_group(head_dim: int) -> int:
    """Channels per int4 value scale: INT4_V_GROUP, or the whole head when it does not divide it."""
    return INT4_V_GROUP if head_dim % INT4_V_GROUP == 0 else head_dim


def int4_row_extra_bytes(head_dim: int, block_size: int) -> int:
    """Scale bytes in each int4 row: room for the block's per-channel key step and minimum (two fp16
    per channel, spread over the block's rows) and for one token's value scales (fp16 per group)."""
    return 2 * max(-(-2 * head_dim // block_size), head_dim // int4_value_group(head_dim))
