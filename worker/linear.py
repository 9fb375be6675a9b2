"""Dense projections: oneDNN on CPU where torch ships it, `F.linear` everywhere else.

On this project's reference CPU (AMD, AVX-512), torch's default fp32 GEMM path (MKL) reaches about
40% of the cores' FLOP/s, and less at the small row counts of a decode step; oneDNN's
`_linear_pointwise` reaches 2-3x that on the same weights. One to three rows (that many sequences
decoding) go to the C GEMV kernel where it builds, which streams weights faster than either. The results
agree with `F.linear` to float rounding; the backend is chosen once per model.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# Up to this many rows, the C GEMV (one pass over the weights) beats oneDNN on the reference CPU,
# in fp32 and bf16 alike; from 4 rows on oneDNN's blocking wins.
GEMV_MAX_ROWS = 3

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def padded_rows(m: int) -> int:
    """m rounded up to a bucket: a multiple of max(8, 2^floor(log2 m) / 8), so at most 1/8 is padding
    once m >= 64, and a run of steps sees a few dozen distinct row counts instead of every one."""
    step = max(8, (1 << (m.bit_length() - 1)) // 8)
    return -(-m // step) * step


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x: [T, K], weight: [N, K] -> [T, N]
    m = x.shape[0]
    if m == 0:
        return F.linear(x, weight, bias)
    # oneDNN builds (JIT-compiles) a kernel for every new row count, which costs more than the
    # product itself at these sizes; padding to a bucket lets the primitive cache hit
    padded = padded_rows(m)
    if padded != m:
        xp = x.new_zeros((padded, x.shape[1]))
        xp[:m] = x
        return torch.ops.mkldnn._linear_pointwise(xp, weight, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def select_linear(device: torch.device, dtype: torch.dtype, backend: str = "auto") -> LinearFn:
    """backend: "auto" (oneDNN where available), "onednn" (required) or "torch" (`F.linear`)."""
    if backend not in ("auto", "onednn", "torch"):
        raise ValueError(f"linear_backend must be 'auto', 'onednn' or 'torch', not {backend!r}")
    usable = onednn_available(device, dtype)
    if backend == "onednn" and not usable:
        raise ValueError(f"linear_backend 'onednn' needs a CPU torch build with oneDNN and fp32/bf16, "
                         f"not {device.type}/{dtype}")
    if backend == "torch" or not usable:
        return F.linear
    from kvstrata.worker.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        return _onednn_linear

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= GEMV_MAX_ROWS and weight.dtype == x.dtype:
            return kernels.gemv(x, weight, bias)
        return _onednn_linear(x, weight, bias)

    return linear
