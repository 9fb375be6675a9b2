"""Dense projections: one backend per model, chosen at load, which may re-lay the weights out once.

On CPU, oneDNN and MKL come close to the cores' FLOP/s on large products but much less at the small
row counts of a decode step. So on CPU the weights are packed once into column groups (48 or 24
wide, by the CPU's vectors) and multiplied by a C kernel (`packed`, see csrc/gemm.c), which also
stays ahead of oneDNN at prefill-sized row counts in float32. In bf16, on a CPU with bf16
dot-product instructions or AMX tiles, oneDNN's kernels win from about 8 rows on, so bf16 keeps both
layouts there. oneDNN's weights are laid out for its kernels once, at load (`OneDNNLinear.prepare`).
oneDNN (`onednn`) and plain `F.linear` (`torch`) remain for machines without a C compiler and for
GPUs. Results agree with `F.linear` to float rounding.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "packed", "onednn", "torch")


class TorchLinear:
    name = "torch"

    def prepare(self, weight: torch.Tensor) -> Any:
        return weight

    def prepare_all(self, weights: list[torch.Tensor]) -> list[Any]:
        """A model's weights prepared together, in a step's reading order."""
        return [self.prepare(w) for w in weights]

    def __call__(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def to_float(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """The product in float32, holding the values of x's dtype that __call__ gives (logits)."""
        return self(x, weight, bias).float()


def padded_rows(m: int) -> int:
    """m rounded up to a bucket: a multiple of max(8, 2^floor(log2 m) / 8), so at most 1/8 is padding
    once m >= 64, and a run of steps sees a few dozen distinct row counts instead of every one."""
    step = max(8, (1 << (m.bit_length() - 1)) // 8)
    return -(-m // step) * step


class OneDNNLinear(TorchLinear):
    name = "onednn"

    def prepare(self, weight: torch.Tensor) -> Any:
        # laid out once for oneDNN's kernels; a plain weight is reordered on every call, which at a
        # decode step's row counts costs more than the product (bf16 on a 2-core Xeon with AMX, a
        # batch-32 step's projections and head: 34.7 -> 24.1 ms; the same bits)
        try:
            return torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        except (RuntimeError, AttributeError):
            return weight

    def __call__(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [T, K], weight: [N, K] -> [T, N]
        m = x.shape[0]
        if m == 0:  # (a laid-out weight has its logical shape but takes no plain torch op)
            return x.new_empty((0, weight.shape[0]))
        # oneDNN builds (JIT-compiles) a kernel for every new row count, which costs more than the
        # product itself at these sizes; padding to a bucket lets its primitive cache hit
        padded = padded_rows(m)
        if padded != m:
            xp = x.new_zeros((padded, x.shape[1]))
            xp[:m] = x
            return torch.ops.mkldnn._linear_pointwise(xp, weight, bias, "none", [], "")[:m]
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class PackedLinear:
    name = "packed"

    def __init__(self, kernels: Any):
        self.kernels = kernels

    def prepare(self, weight: torch.Tensor) -> Any:
        return self.kernels.pack(weight)

    def prepare_all(self, weights: list[torch.Tensor]) -> list[Any]:
        """Every weight packed straight into one buffer per dtype, in list order (a step's reading
        order), on huge pages where the host has them (see worker/huge_pages.py).

        Where a weight's memory lies mattered on a 2-core Xeon host: the same model's packed weights
        copied into one buffer after loading ran the random workload 5-7.5% faster, in lockstep with
        the weights as loaded (each packed into a fresh allocation between the load's temporaries), and
        plain clones of each weight made after loading 4-5% faster. Packing into the buffer directly,
        instead of packing each weight alone and then copying them all there, also took a SmolLM2
        load's packing from 0.72 s to 0.07 s on a Zen 5 EPYC.
        """
        from kvstrata.worker.huge_pages import empty_on_huge_pages

        sizes = [self.kernels.packed_numel(w) for w in weights]
        buffers, at = {}, {}
        for dtype in {w.dtype for w in weights}:
            buffers[dtype] = empty_on_huge_pages(sum(n for w, n in zip(weights, sizes) if w.dtype == dtype), dtype)
            at[dtype] = 0
        out = []
        for w, n in zip(weights, sizes):
            out.append(self.kernels.pack(w, out=buffers[w.dtype][at[w.dtype]:at[w.dtype] + n]))
            at[w.dtype] += n
        return out

    def __call__(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.gemm(x, weight, bias)

    def to_float(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.gemm(x, weight, bias, to_float=True)


class HybridLinear:
    """bf16: packed panels for a few rows (streaming the weights), oneDNN beyond, whose bf16 dot-product
    instructions do twice the FLOPs of the packed kernel's widen-and-FMA. Holds both layouts. Where
    the packed panels are AMX tiles (csrc/amx_gemm.c) or bf16 pairs for the same dot products
    (csrc/gemm.c), they stay at least as fast as oneDNN up to 64 rows (a decode step's products) and
    oneDNN takes prefill chunks."""

    name = "packed+onednn"

    def __init__(self, packed: PackedLinear, max_packed_rows: int = 8):
        self.packed = packed
        self.onednn = OneDNNLinear()
        self.max_packed_rows = max_packed_rows

    def prepare(self, weight: torch.Tensor) -> Any:
        return self.packed.prepare(weight), self.onednn.prepare(weight)

    def prepare_all(self, weights: list[torch.Tensor]) -> list[Any]:
        return list(zip(self.packed.prepare_all(weights), self.onednn.prepare_all(weights)))

    def __call__(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        backend, w = self._route(x, weight)
        return backend(x, w, bias)

    def to_float(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        backend, w = self._route(x, weight)
        return backend.to_float(x, w, bias)

    def _route(self, x: torch.Tensor, weight: Any) -> tuple[PackedLinear | OneDNNLinear, Any]:
        """The backend for x's row count, and the weight in its layout."""
        if x.shape[0] <= self.max_packed_rows:
            return self.packed, weight[0]
        return self.onednn, weight[1]


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype != torch.bfloat16 or _onednn_bf16_runs())
    )


@functools.cache
def _onednn_bf16_runs() -> bool:
    """Whether oneDNN has a bf16 inner product on this CPU: it needs AVX-512 (an AVX2-only CPU gets
    "could not create a primitive descriptor"). Tried once, on a tiny product."""
    try:
        x, w = torch.ones(8, 32, dtype=torch.bfloat16), torch.ones(16, 32, dtype=torch.bfloat16)
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def _cpu_has_bf16_products() -> bool:
    """Whether the CPU multiplies bf16 itself (AVX512-BF16 dot products or AMX tiles). Without them
    oneDNN's bf16 inner product widens in software and runs at about a third of the packed kernel's
    widen-and-FMA (a Cascade Lake Xeon: 50 against 140 GFLOP/s on a 2048-square product), so bf16
    stays on the packed panels at every row count."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def select_linear(device: torch.device, dtype: torch.dtype,
                  backend: str = "auto") -> TorchLinear | PackedLinear | HybridLinear:
    """backend: "auto" (packed, else oneDNN, else torch; in bf16 packed for few rows and oneDNN for
    many where the CPU multiplies bf16 itself), or one of "packed", "onednn", "torch" (required)."""
    if backend not in BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    cpu_16_32 = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if backend in ("auto", "packed") and cpu_16_32:
        from kvstrata.worker.cpu_kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
        if kernels is not None:
            if (dtype == torch.bfloat16 and backend == "auto" and _cpu_has_bf16_products()
                    and onednn_available(device, dtype)):
                return HybridLinear(PackedLinear(kernels), 64 if kernels.amx or kernels.bf16_dot else 8)
            return PackedLinear(kernels)
    if backend == "packed":
        raise ValueError(f"linear_backend 'packed' needs a CPU, fp32 or bf16, and a C compiler "
                         f"(not {device.type}/{dtype})")
    if backend == "onednn" and not onednn_available(device, dtype):
        raise ValueError(f"linear_backend 'onednn' needs a CPU torch build with oneDNN and fp32/bf16, "
                         f"not {device.type}/{dtype}")
    if backend in ("auto", "onednn") and onednn_available(device, dtype):
        return OneDNNLinear()
    return TorchLinear()
