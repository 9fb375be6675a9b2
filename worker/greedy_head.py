"""Greedy decoding's LM head on CPU, from a smaller copy of the head (float32 models, and bf16 ones).

Greedy rows need each row's argmax, not its float32 logits. The head is multiplied in a copy of
fewer bytes first, which bounds every logit; only the tokens the bound leaves get their float32
logit, computed as the float32 head computes it, so the answer is the token the float32 logits
give, bit for bit (csrc/greedy_head.c has the bounds). The copy is either

- int8 (a quarter of the float32 head's bytes: 28.3 MB for SmolLM2), each row scaled by its largest
  value, the rows of x taken to 16 bits, multiplied with byte dot products (AVX-512 VNNI; from 4
  rows on AMX tiles where the CPU has them) or, on AVX2 cores, widened to 16 bits as it is read and
  multiplied with 16-bit multiply-adds (16 products an instruction, two float32 FMAs' worth), or
- bf16 (half the bytes: 56.6 MB), multiplied with the bf16 products (twice the multiply-adds a
  cycle where the CPU has bf16 dot products or AMX tiles).

int8 where the build has its products, else bf16; KVSTRATA_GREEDY_HEAD_COPY=int8 or bf16 chooses.
A bf16 model's calls choose, call by call, among the int8 copy with x's few largest values past a
byte, the copy with all of x at 16 bits and the model's own head, by the times of the calls
themselves (worker/head_choice.py): the tokens the bound leaves cost a bf16 model a group of its
GEMM each (a row of the head, where it keeps the rows), and how many it leaves depends on the rows.
Two byte dot products a quad of k (x's high and low bytes) make as many multiply-adds a cycle as
one bf16 dot product a pair, so the int8 copy gains where the head streams from memory: on a 2-core
Zen 4 EPYC, against the bf16 copy, 1.4-1.8x at 1 row and 1.2-1.5x at 4, even from 8 to 32 rows,
from half the memory. On AMX tiles its products cost next to nothing: on a 2-core Xeon with AMX,
float32 decode steps took 1.065x less time than with the bf16 copy (on the same tiles) at batch 1,
1.035x at 4 and 8, 1.026x at 16 and 1.013x at 32.
KVSTRATA_GREEDY_HEAD=0 turns the greedy head off.

Where the CPU multiplies bf16 no faster than float32 (bf16 widened to float32, as on AVX2 cores),
a bf16 copy (KVSTRATA_GREEDY_HEAD_COPY=bf16) only saves bytes: it wins while the head streams from
memory (few rows) and loses once the products set the pace, so `tune` finds at load up to how many
rows it wins (see there). The int8 copy's 16-bit products there run about 1.2x the float32 FMAs'
rate, so it takes any number of rows.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch

from kvstrata.worker.cpu_kernels import CpuKernels, PackedWeight
from kvstrata.worker.head_choice import HeadChoice
from kvstrata.worker.huge_pages import empty_on_huge_pages

ENV = "KVSTRATA_GREEDY_HEAD"
ROWS_ENV = "KVSTRATA_GREEDY_HEAD_ROWS"
COPY_ENV = "KVSTRATA_GREEDY_HEAD_COPY"
COPIES = ("int8", "bf16")
_INT8_COLS = 64  # columns padded to a whole number of the int8 copy's tiles (csrc/int8_head.c's Q_COLS: 64 or 16)
_TUNE_ROWS = (4, 8, 12, 16, 24, 32, 48, 64)  # the row counts tune times, in order, until the copy loses
_MAX_ROWS = 64  # rows per bf16 product: the approximate logits' buffer is kept, [_MAX_ROWS, V] at most
HI_DIMS = 8  # a float32 model's int8 copy: x's largest values past one byte (GreedyHead.hi_dims)
HI_DIMS_ALL = -1  # every value of x at 16 bits
# a bf16 model's ways to its tokens (worker/head_choice.py): the int8 copy with x's largest values past
# a byte, or all at 16 bits (where the build splits them: AVX-512 VNNI, AMX), and its own head
WAY_HI_DIMS = {"int8": HI_DIMS, "int8-16": HI_DIMS_ALL}
OWN_WAY = "own"


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


def int8_available(kernels: CpuKernels) -> bool:
    """Whether this build has the int8 copy's products (AVX-512 VNNI's byte dot products, or AVX2's
    16-bit multiply-adds)."""
    kernels._lib.kvs_int8_head_available.restype = ctypes.c_int
    return bool(kernels._lib.kvs_int8_head_available())


def int8_tile_cols(kernels: CpuKernels) -> int:
    """The columns of one tile of the int8 copy as this build packs it: 64 (AVX-512 VNNI) or 16."""
    kernels._lib.kvs_int8_head_tile_cols.restype = ctypes.c_int
    return int(kernels._lib.kvs_int8_head_tile_cols())


def chosen_copy(kernels: CpuKernels) -> str:
    """KVSTRATA_GREEDY_HEAD_COPY (int8 or bf16) where set, else int8 where this build multiplies it,
    else bf16. ValueError for another value, or int8 asked of a build without its products."""
    value = os.environ.get(COPY_ENV)
    if value is None:
        return "int8" if int8_available(kernels) else "bf16"
    if value not in COPIES:
        raise ValueError(f"{COPY_ENV} must be int8 or bf16, not {value!r}")
    if value == "int8" and not int8_available(kernels):
        raise ValueError(f"{COPY_ENV}=int8 needs AVX-512 VNNI or AVX2 in this build")
    return value


def _int8_copy(kernels: CpuKernels, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """The head [V, K] (float32) as csrc/int8_head.c's int8 copy (kvs_int8_head_pack): (packed tiles
    on huge pages, scale [C], rowsum [C], enorm [V]), C = V padded to whole tiles (the padding zero).
    Each row j: s_j = max |w_j| / 127, q_j = round(w_j / s_j) within +-127, its sum, and |w_j - s_j
    q_j| from above. One pass in C: in torch, in float64, it had taken 0.3-0.4 s at load for SmolLM2."""
    v, k = head.shape
    cols = -(-v // _INT8_COLS) * _INT8_COLS
    packed = empty_on_huge_pages(cols * 4 * ((k + 3) // 4), torch.int8).zero_()
    scale = torch.zeros(cols, dtype=torch.float32)
    rowsum = torch.zeros(cols, dtype=torch.int32)
    enorm = torch.empty(v, dtype=torch.float32)
    head = head.contiguous()
    kernels._lib.kvs_int8_head_pack(head.data_ptr(), v, k, packed.data_ptr(), scale.data_ptr(), rowsum.data_ptr(),
                                    enorm.data_ptr())
    return packed, scale, rowsum, enorm


class GreedyHead:
    def __init__(self, kernels: CpuKernels, head: torch.Tensor, packed: PackedWeight, kept: bool = False):
        """head: the head [V, K] (its row norms are taken here); packed: the same head as the model's
        GEMM packed it, float32 or, for a bf16 model, bf16 (which takes the int8 copy only: its
        logits are its GEMM's sums rounded to bf16, and the tokens the bound leaves are computed
        group by group by that GEMM, or from `head`'s rows, below). The float32 logits left to
        compute read the head's rows: from `head` itself where the caller keeps it anyway (kept: a
        tied embedding), else from the packed copy (the same values, a read every group's width of
        floats). A bf16 model's read `head`'s rows where kept and its GEMM runs off AMX tiles (on
        bf16 dot products or widened weights), the same sums as that GEMM's."""
        self.model_bf16 = packed.data.dtype == torch.bfloat16
        if head.shape != (packed.n, packed.k) or head.dtype != packed.data.dtype \
                or head.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("GreedyHead needs a float32 or bf16 head and its packed copy of the same dtype")
        lib = self._lib = kernels._lib
        if not available(kernels):
            raise ValueError("this build's float32 products are not fused multiply-add chains (see csrc/greedy_head.c)")
        lib.kvs_greedy_head.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3
        lib.kvs_greedy_head.restype = ctypes.c_int64
        lib.kvs_int8_head_approx.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3 \
            + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
        lib.kvs_int8_head_approx.restype = ctypes.c_int
        lib.kvs_int8_head_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4
        lib.kvs_int8_head_pack.restype = None
        self.packed = packed
        self.copy = chosen_copy(kernels)
        # the int8 copy's x: its hi_dims largest values past one byte, so that the rest multiply as one
        # (csrc/int8_head.c); a bf16 model's calls choose among its ways as they come (`choice`): each
        # token the bound leaves costs it a group of its GEMM or a row of the head, and how many it
        # leaves depends on the rows (a float32 model's cost a row each: HI_DIMS, measured on its rows)
        self.hi_dims = HI_DIMS_ALL if self.model_bf16 else HI_DIMS
        if self.model_bf16 and self.copy != "int8":
            raise ValueError("a bf16 model's greedy head needs the int8 copy")
        self.choice: HeadChoice | None = None
        if self.model_bf16:
            split = int8_tile_cols(kernels) == 64  # AVX2 builds keep every value at 16 bits
            self.choice = HeadChoice(("int8", "int8-16", OWN_WAY) if split else ("int8-16", OWN_WAY))
        # the head's rows in the model's dtype, where the caller keeps them anyway (a tied embedding): a
        # float32 model's logits left to check read them, and so do a bf16 model's where its GEMM runs
        # on bf16 dot products (csrc/greedy_head.c, dot_logits)
        self.head_rows = head.contiguous() if kept else None
        head = head.float()
        self.bf16: PackedWeight | None = None
        if self.copy == "int8":
            self.int8, self.int8_scale, self.int8_rowsum, self.int8_enorm = _int8_copy(kernels, head)
        else:
            bf16 = head.bfloat16()
            self.bf16 = kernels.pack(bf16, out=empty_on_huge_pages(kernels.packed_numel(bf16), torch.bfloat16))
        groups = -(-packed.n // kernels.gemm_group)
        self._group_elems = packed.data.numel() // groups  # a packed group's elements (a bf16 model's GEMM)
        # each row's norm from above: a float32 sum of K squares is within about K 2^-24 of its value
        # (its root within half that), which the raise covers twice over, with the last rounding
        k = head.shape[1]
        self.norms = (torch.linalg.vector_norm(head, dim=1) * (1 + k * 2 ** -23 + 2 ** -20)).contiguous()
        self._approx: torch.Tensor | None = None  # [rows, V] approximate logits, kept between steps
        self.checked = 0  # float32 logits computed so far, over every row (for tests and benchmarks)
        self.max_rows: int | None = None  # the most rows `tokens` takes (None: any number); see tune
        self.row_limit: int | None = None  # the most rows tune may allow (None: any number)
        self._kernels = kernels

    @property
    def nbytes(self) -> int:
        """Memory the copy and the norms take."""
        if self.bf16 is not None:
            return self.bf16.data.numel() * 2 + self.norms.numel() * 4
        return self.int8.numel() + 4 * (self.int8_scale.numel() + self.int8_rowsum.numel() + self.int8_enorm.numel()
                                        + self.norms.numel())

    def tokens(self, x: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor | None:
        """The greedy token of each row of x [N, K] (the head's input after the final norm, in the
        model's dtype): int64 [N], the first index of each row's largest logit (float32, or for a
        bf16 model its GEMM's logits rounded to bf16); None where a row holds a non-finite value (the
        caller then takes the logits and torch's rules). values (float32 [N], optional) receives
        those logits."""
        if x.dtype != self.packed.data.dtype or x.dim() != 2 or x.shape[1] != self.packed.k:
            raise ValueError(f"GreedyHead.tokens needs {self.packed.data.dtype} rows [N, {self.packed.k}]")
        n = x.shape[0]
        if values is not None and (values.dtype != torch.float32 or values.shape != (n,) or not values.is_contiguous()):
            raise ValueError(f"GreedyHead.tokens: values must be a dense float32 [{n}]")
        if not self.takes(n):
            return None  # the float32 head is as fast here (see tune)
        x = x.contiguous()
        if self.choice is None or n == 0:
            return self._copy_tokens(x, values, self.hi_dims)
        way = self.choice.pick(n)
        t0 = self.choice.clock()
        out = self._own_tokens(x, values) if way == OWN_WAY else self._copy_tokens(x, values, WAY_HI_DIMS[way])
        if out is not None:
            self.choice.record(n, way, self.choice.clock() - t0)
        return out

    def _own_tokens(self, x: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor | None:
        """A bf16 model's own head and its argmax: the logits and the tokens the caller would take
        without a greedy head (None where a row's logits hold a NaN, as there)."""
        logits = self._kernels.gemm(x, self.packed, None, to_float=True)
        out = self._kernels.argmax(logits)
        if out is not None and values is not None:
            values.copy_(logits.gather(1, out[:, None])[:, 0])
        return out

    def _copy_tokens(self, x: torch.Tensor, values: torch.Tensor | None, hi_dims: int) -> torch.Tensor | None:
        """`tokens` through the copy, x's hi_dims largest values past a byte (HI_DIMS_ALL: none)."""
        xb = x if self.model_bf16 else None  # a bf16 model's rows as its GEMM takes them
        x = x.float() if self.model_bf16 else x
        n, v, k = x.shape[0], self.packed.n, self.packed.k
        out = torch.empty(n, dtype=torch.int64)
        checked = torch.empty(n, dtype=torch.int64)  # each row's count, written by its pick
        # (slices and their pointers only past the first chunk: each tensor call counts at one row)
        out_p, checked_p, values_p = out.data_ptr(), checked.data_ptr(), None if values is None else values.data_ptr()
        for r0 in range(0, n, _MAX_ROWS):
            rows = min(_MAX_ROWS, n - r0)
            approx = self._approx_buffer(rows)
            xr = x if rows == n else x[r0:r0 + rows]
            head = None if self.head_rows is None else self.head_rows.data_ptr()
            tail = (rows, v, k, out_p + r0 * out.element_size(),
                    None if values is None else values_p + r0 * values.element_size(),
                    checked_p + r0 * checked.element_size())
            xnorms = self._approx_into(xr, approx, hi_dims)
            if xnorms is None:
                return None
            int8 = (None, None) if self.bf16 is not None else (xnorms.data_ptr(), self.int8_enorm.data_ptr())
            model_rows = (None, None, 0) if xb is None else (xb.data_ptr() + r0 * k * xb.element_size(),
                                                              self.packed.data.data_ptr(), self._group_elems)
            if self._lib.kvs_greedy_head(xr.data_ptr(), approx.data_ptr(), int8[0],
                                         None if xb is not None else self.packed.data.data_ptr(), head,
                                         self.norms.data_ptr(), int8[1], *model_rows, *tail):
                return None
        self.checked += sum(checked.tolist())
        return out

    def approx_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The copy's logits of x [N, K]: what the first pass bounds (for tests)."""
        x = x.float().contiguous()
        approx = torch.empty(x.shape[0], self.packed.n, dtype=torch.float32)
        if self._approx_into(x, approx, self.hi_dims) is None:
            raise MemoryError("no memory for the int8 copy's work")
        return approx

    def _approx_into(self, x: torch.Tensor, approx: torch.Tensor, hi_dims: int) -> torch.Tensor | None:
        """The copy's logits of x [rows, K] into approx [rows, V] (the int8 copy: x's hi_dims largest
        values past a byte); returns the int8 copy's row norms
        ([rows, 2]: |x| and |e_x|; an empty tensor for the bf16 copy), None without memory."""
        rows, v, k = x.shape[0], self.packed.n, self.packed.k
        if self.bf16 is not None:
            self._lib.kvs_gemm_bf16(x.data_ptr(), self.bf16.data.data_ptr(), None, approx.data_ptr(), rows, v, k)
            return torch.empty(0)
        xnorms = torch.empty(rows, 2, dtype=torch.float32)
        if self._lib.kvs_int8_head_approx(x.data_ptr(), rows, k, self.int8.data_ptr(), self.int8_scale.data_ptr(),
                                          self.int8_rowsum.data_ptr(), v, hi_dims, approx.data_ptr(),
                                          xnorms.data_ptr()):
            return None
        return xnorms

    def takes(self, rows: int) -> bool:
        """Whether `tokens` takes a call of `rows` rows (max_rows)."""
        return self.max_rows is None or rows <= self.max_rows

    def tune(self, rounds: int = 3) -> int | None:
        """Sets and returns max_rows, once at load. The int8 copy, and the bf16 copy with bf16 dot
        products or AMX tiles, are multiplied faster than the float32 head as well as read in fewer
        bytes, and take any number of rows (on a Zen 4 EPYC 1.7-1.8x faster at 32 rows). Otherwise it
        times both ways, the float32 head and its argmax against `tokens`, alternating, at 4, 8, 12,
        16, 24, 32, 48 and 64 rows in turn until the float32 head's median is the lower, and keeps the
        last count at which the copy won (None if it won at all of them, 0 if at none). On a 2-core
        Zen 3 EPYC (AVX2), over five timings, the copy ran 1.5-2.2x faster at 1-4 rows, 0.92-1.65x at
        8, 0.87-1.27x at 12 and 0.87-1.04x at 16-32. A bf16 model's head takes any rows its GEMM takes
        (row_limit), untimed here: its calls choose between the int8 copy and the model's own head as
        they come (`choice`, worker/head_choice.py), since the rows, not the host alone, decide. The
        tokens are the same bits either way. KVSTRATA_GREEDY_HEAD_ROWS (a whole number) sets it
        without timing."""
        env = os.environ.get(ROWS_ENV)
        if env is not None:
            if not env.isdigit():
                raise ValueError(f"{ROWS_ENV} must be a whole number of rows, not {env!r}")
            self.max_rows = int(env)
        elif self._kernels.amx or self._kernels.bf16_dot or self.copy == "int8":
            self.max_rows = None  # (a bf16 model's calls choose their way as they come: `choice`)
        else:
            if self.bf16 is not None:  # how its blocks of 16 rows and more widen (once a process)
                self._kernels.tune_wide_copy([self.bf16])
            checked = self.checked
            self.max_rows = None
            last = 0
            for rows in _TUNE_ROWS:
                if self.row_limit is not None and rows > self.row_limit:
                    self.max_rows = last
                    break
                head, copy = self._time_both(rows, rounds)
                if copy >= head:
                    self.max_rows = last
                    break
                last = rows
            self.checked = checked
        if self.row_limit is not None and (self.max_rows is None or self.max_rows > self.row_limit):
            self.max_rows = self.row_limit
        return self.max_rows

    def _time_both(self, rows: int, rounds: int) -> tuple[float, float]:
        """Median seconds of the float32 head with its argmax, and of `tokens`, at `rows` random rows,
        alternating; the first round only brings both to the same state."""
        x = torch.randn(rows, self.packed.k, generator=torch.Generator().manual_seed(rows)).to(self.packed.data.dtype)
        times: tuple[list[float], list[float]] = ([], [])
        ways = (lambda: self._kernels.argmax(self._kernels.gemm(x, self.packed, None, to_float=True)),
                lambda: self.tokens(x))
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
        return self._approx if self._approx.shape[0] == rows else self._approx[:rows]
