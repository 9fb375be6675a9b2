"""Greedy decoding's LM head for float32 models on CPU, from a bf16 copy of the head.

Greedy rows need each row's argmax, not its float32 logits. The head is multiplied in bf16 first
(half the bytes of the float32 head; twice the multiply-adds a cycle where the CPU has bf16 dot
products or AMX tiles), which bounds every logit; only the tokens the bound leaves get their
float32 logit, computed as the float32 head computes it, so the answer is the token the float32
logits give, bit for bit (csrc/greedy_head.c has the bound).

The copy costs the head's size in bf16 (56.6 MB for SmolLM2). KVSTRATA_GREEDY_HEAD=0 turns it off.

Where the CPU multiplies bf16 no faster than float32 (bf16 widened to float32, as on AVX2 cores),
the copy only saves bytes: it wins while the head streams from memory (few rows) and loses once
the products set the pace, so `tune` finds at load up to how many rows it wins (see there).
"""

from __future__ import annotations

import ctypes
import os
import time

import torch

from kvstrata.worker.cpu_kernels import CpuKernels, PackedWeight
from kvstrata.worker.huge_pages import empty_on_huge_pages

ENV = "KVSTRATA_GREEDY_HEAD"
ROWS_ENV = "KVSTRATA_GREEDY_HEAD_ROWS"
_TUNE_ROWS = (4, 8, 12, 16, 24, 32, 48, 64)  # the row counts tune times, in order, until the copy loses
_MAX_ROWS = 64  # rows per bf16 product: the approximate logits' buffer is kept, [_MAX_ROWS, V] at most


def wanted() -> bool:
    """KVSTRATA_GREEDY_HEAD: 1 (the default) or 0; anything else is an error naming it."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, not {value!r}")
    return value == "1"


def available(kernels: CpuKernels) -> bool:
    """Whether this build can give the float32 head's bits: its float32 products are fused
    multiply-add chains, which the check computes as fmaf does."""
    kernels._lib.kvs_greedy_head_exact.restype = ctypes.c_int
    return bool(kernels._lib.kvs_greedy_head_exact())


class GreedyHead:
    def __init__(self, kernels: CpuKernels, head: torch.Tensor, packed: PackedWeight, kept: bool = False):
        """head: the float32 head [V, K] (its row norms are taken here); packed: the same head as the
        float32 GEMM packed it. The float32 logits left to compute read the head's rows: from `head`
        itself where the caller keeps it anyway (kept: a tied embedding), else from the packed copy
        (the same values, a read every group's width of floats)."""
        if head.dtype != torch.float32 or packed.data.dtype != torch.float32 or head.shape != (packed.n, packed.k):
            raise ValueError("GreedyHead needs a float32 head and its packed float32 copy")
        lib = self._lib = kernels._lib
        if not available(kernels):
            raise ValueError("this build's float32 products are not fused multiply-add chains (see csrc/greedy_head.c)")
        lib.kvs_greedy_head.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
        lib.kvs_greedy_head.restype = ctypes.c_int64
        self.packed = packed
        self.head_rows = head.contiguous() if kept else None
        bf16 = head.bfloat16()
        self.bf16 = kernels.pack(bf16, out=empty_on_huge_pages(kernels.packed_numel(bf16), torch.bfloat16))
        # each row's norm from above: a float32 sum of K squares is within about K 2^-24 of its value
        # (its root within half that), which the raise covers twice over, with the last rounding
        k = head.shape[1]
        self.norms = (torch.linalg.vector_norm(head, dim=1) * (1 + k * 2 ** -23 + 2 ** -20)).contiguous()
        self._approx: torch.Tensor | None = None  # [rows, V] approximate logits, kept between steps
        self.checked = 0  # float32 logits computed so far, over every row (for tests and benchmarks)
        self.max_rows: int | None = None  # the most rows `tokens` takes (None: any number); see tune
        self._kernels = kernels

    @property
    def nbytes(self) -> int:
        """Memory the bf16 copy and the norms take."""
        return self.bf16.data.numel() * 2 + self.norms.numel() * 4

    def tokens(self, x: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor | None:
        """The greedy token of each row of x [N, K] (float32, the head's input after the final norm):
        int64 [N], the first index of each row's largest float32 logit; None where a row holds a
        non-finite value (the caller then takes the float32 logits and torch's rules). values (float32
        [N], optional) receives those logits."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.packed.k:
            raise ValueError(f"GreedyHead.tokens needs float32 rows [N, {self.packed.k}]")
        if not self.takes(x.shape[0]):
            return None  # the float32 head is as fast here (see tune)
        x = x.contiguous()
        n, v, k = x.shape[0], self.packed.n, self.packed.k
        if values is not None and (values.dtype != torch.float32 or values.shape != (n,) or not values.is_contiguous()):
            raise ValueError(f"GreedyHead.tokens: values must be a dense float32 [{n}]")
        out = torch.empty(n, dtype=torch.int64)
        checked = torch.zeros(n, dtype=torch.int64)
        for r0 in range(0, n, _MAX_ROWS):
            rows = min(_MAX_ROWS, n - r0)
            approx = self._approx_buffer(rows)
            xr = x[r0:r0 + rows]
            self._lib.kvs_gemm_bf16(xr.data_ptr(), self.bf16.data.data_ptr(), None, approx.data_ptr(), rows, v, k)
            head = None if self.head_rows is None else self.head_rows.data_ptr()
            if self._lib.kvs_greedy_head(xr.data_ptr(), approx.data_ptr(), self.packed.data.data_ptr(), head,
                                         self.norms.data_ptr(), rows, v, k, out[r0:].data_ptr(),
                                         None if values is None else values[r0:].data_ptr(), checked[r0:].data_ptr()):
                return None
        self.checked += int(checked.sum())
        return out

    def takes(self, rows: int) -> bool:
        """Whether `tokens` takes a call of `rows` rows (max_rows)."""
        return self.max_rows is None or rows <= self.max_rows

    def tune(self, rounds: int = 3) -> int | None:
        """Sets and returns max_rows, once at load. With bf16 dot products or AMX tiles the copy is
        multiplied faster than the float32 head as well as read in half the bytes, and takes any
        number of rows (on a Zen 4 EPYC 1.8x faster at 32 rows). Otherwise it times both ways, the
        float32 head and its argmax against `tokens`, alternating, at 4, 8, 12, 16, 24, 32, 48 and 64
        rows in turn until the float32 head's median is the lower, and keeps the last count at which
        the copy won (None if it won at all of them, 0 if at none). On a 2-core Zen 3 EPYC (AVX2),
        over five timings, the copy ran 1.5-2.2x faster at 1-4 rows, 0.92-1.65x at 8, 0.87-1.27x
        at 12 and 0.87-1.04x at 16-32. The tokens are the same bits either way. KVSTRATA_GREEDY_HEAD_ROWS (a whole number) sets it
        without timing."""
        env = os.environ.get(ROWS_ENV)
        if env is not None:
            if not env.isdigit():
                raise ValueError(f"{ROWS_ENV} must be a whole number of rows, not {env!r}")
            self.max_rows = int(env)
        elif self._kernels.amx or self._kernels.bf16_dot:
            self.max_rows = None
        else:
            self._kernels.tune_wide_copy([self.bf16])  # how its blocks of 16 rows and more widen (once a process)
            checked = self.checked
            self.max_rows = None
            last = 0
            for rows in _TUNE_ROWS:
                head, copy = self._time_both(rows, rounds)
                if copy >= head:
                    self.max_rows = last
                    break
                last = rows
            self.checked = checked
        return self.max_rows

    def _time_both(self, rows: int, rounds: int) -> tuple[float, float]:
        """Median seconds of the float32 head with its argmax, and of `tokens`, at `rows` random rows,
        alternating; the first round only brings both to the same state."""
        x = torch.randn(rows, self.packed.k, generator=torch.Generator().manual_seed(rows))
        times: tuple[list[float], list[float]] = ([], [])
        ways = (lambda: self._kernels.argmax(self._kernels.gemm(x, self.packed, None)), lambda: self.tokens(x))
        for r in range(rounds + 1):
            for i in ((0, 1) if r % 2 else (1, 0)):
                t0 = time.perf_counter()
                ways[i]()
                if r:
                    times[i].append(time.perf_counter() - t0)
        return tuple(sorted(ts)[len(ts) // 2] for ts in times)

    def _approx_buffer(self, rows: int) -> torch.Tensor:
        """[rows, V] float32 from one buffer kept for the largest row count so far: a fresh one each
        step would fault its pages in again (about 5 us a page on the VMs measured)."""
        if self._approx is None or self._approx.shape[0] < rows:
            self._approx = torch.empty((rows, self.packed.n), dtype=torch.float32)
        return self._approx[:rows]
