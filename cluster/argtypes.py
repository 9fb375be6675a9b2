"""argparse value types shared by the CLI subcommands: each rejects bad input with a one-line reason."""

from __future__ import annotations

import argparse
import math


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_number(text: str, allow_inf: bool = False) -> float:
    """A float > 0; finite unless allow_inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or (math.isinf(value) and not allow_inf):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a positive {'number or inf' if allow_inf else 'finite number'}, "
                                         f"got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def unit_interval(text: str) -> float:
    """A number in (0, 1], such as top_p."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def kv_dtype_list(text: str) -> tuple[str, ...]:
    """Comma-separated KV cache formats, e.g. auto,int8,int4."""
    from kvstrata.worker.kv_dtypes import KV_DTYPE_NAMES

    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in KV_DTYPE_NAMES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"kv dtypes must be among {', '.join(KV_DTYPE_NAMES)}, got {text!r}")
    return values
