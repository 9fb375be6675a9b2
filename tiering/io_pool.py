"""The NVMe tier's IO on C threads (worker/csrc/io_pool.c): its slot writes and its loads' reads.

With Python IO threads, every IO ends in a thread that needs the GIL (and a core) before it can
start the next one, and every burst starts by waking one. Here the caller submits each run of
slots and goes on; C threads run one IO after another without the GIL, and one Python thread, the
reaper, waits for finished IOs without the GIL and runs each one's callback with its status (0, or
an errno).

    submit(fd, write, offset, buffers, done) -> C queue -> C threads: pwritev / preadv
                                                        -> reaper thread: done(errno)

The buffers must stay alive and unchanged until `done` runs (the callback's closure is a good place
to hold them). `close` lets every submitted IO finish and every callback run, then frees the pool.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import threading
from collections.abc import Callable

from kvstrata.tiering.disk_io import request_short_slice

log = logging.getLogger(__name__)

_REAP_BATCH = 64  # finished IOs taken per reap call
_REAP_WAIT_S = 1.0  # how long one reap call waits; the reaper goes round again on a timeout


class IoPool:
    def __init__(self, lib, num_threads: int, slice_us: int = 0, name: str = "kvstrata-io"):
        """num_threads C threads (1..64), each asking the scheduler for a slice of slice_us
        microseconds as it starts (0: none; see disk_io.request_short_slice)."""
        if not 1 <= num_threads <= 64:
            raise ValueError(f"num_threads must be in 1..64, got {num_threads}")
        self._lib = lib
        self._pool = lib.kvs_io_pool_new(num_threads, slice_us)
        if not self._pool:
            raise OSError(errno.EAGAIN, "could not start the IO pool's threads")
        self._callbacks: dict[int, Callable[[int], None]] = {}
        self._tags = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._slice_us = slice_us
        self.reaper_short_slice = False  # whether the reaper was granted the slice too (it asks as it starts)
        self.io_seconds = 0.0  # the IOs' own time in their syscalls, summed (the reaper adds it up)
        self._final_busy = (0.0, 0.0)  # busy_seconds (read, write) as the pool was freed
        self._reaper = threading.Thread(target=self._reap, name=f"{name}-reaper", daemon=True)
        self._reaper.start()

    @property
    def short_slice_threads(self) -> int:
        """Threads granted their short slice so far (they ask as they start)."""
        with self._lock:
            return 0 if self._pool is None else self._lib.kvs_io_pool_short_slice_threads(self._pool)

    def busy_seconds(self, write: bool) -> float:
        """Seconds during which at least one IO of this kind (a write, or a read) was in its syscall:
        the time the pool kept the disk busy with it, across its threads. Unlike io_seconds, two IOs
        at once count once; unlike a clock around submit and callback, the waits for a thread, the
        reaper and the GIL are left out (compare with a raw syscall's time)."""
        with self._lock:
            if self._pool is None:
                return self._final_busy[int(write)]
            return self._lib.kvs_io_pool_busy_seconds(self._pool, int(write))

    def submit(self, fd: int, write: bool, offset: int, buffers: list[tuple[int, int]],
               done: Callable[[int], None], crcs: ctypes.Array | None = None,
               crc_span: tuple[int, int] = (0, 0)) -> None:
        """Queue one pwritev (write) or preadv at fd's offset over buffers [(address, length)];
        done(0 or an errno) runs on the reaper thread once it ends. OSError if it cannot be queued
        (the pool is closed, or out of memory): then done never runs.

        For a read, crcs (a ctypes array of one uint32 per buffer) receives on the IO thread, once
        the whole read succeeded, each buffer's CRC-32 (zlib's) of its bytes crc_span = (offset,
        length); a buffer shorter than the span keeps its value. Keep crcs alive until done runs."""
        n = len(buffers)
        if crcs is not None and (write or len(crcs) != n):
            raise ValueError(f"crcs: one per buffer of a read, got {len(crcs)} for {n} buffers"
                             + (" of a write" if write else ""))
        bases = (ctypes.c_int64 * n)(*(a for a, _ in buffers))
        lens = (ctypes.c_int64 * n)(*(m for _, m in buffers))
        with self._lock:
            if self._closed:
                raise OSError(errno.ESHUTDOWN, "the IO pool is closed")
            tag = next(self._tags)
            self._callbacks[tag] = done
            rc = self._lib.kvs_io_submit(self._pool, tag, fd, int(write), offset, n, bases, lens, crcs, *crc_span)
            if rc:
                del self._callbacks[tag]
        if rc:
            raise OSError(rc, f"could not queue an IO: {errno.errorcode.get(rc, rc)}")

    def close(self) -> None:
        """Let every submitted IO finish and its callback run, then free the pool. Idempotent; from
        a callback, it returns at once and the reaper frees the pool as it leaves."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._lib.kvs_io_pool_close(self._pool)
        if self._reaper is not threading.current_thread():
            self._reaper.join()

    def _reap(self) -> None:
        # the reaper, like the C threads, wakes while forward passes hold both cores: with the default
        # slice, a finished IO's callback waited up to 4-7 ms for a core in the chat of `kvstrata bench tiering`
        self.reaper_short_slice = self._slice_us > 0 and request_short_slice(self._slice_us)
        tags = (ctypes.c_int64 * _REAP_BATCH)()
        errs = (ctypes.c_int32 * _REAP_BATCH)()
        times = (ctypes.c_double * (2 * _REAP_BATCH))()
        try:
            while (n := self._lib.kvs_io_reap(self._pool, _REAP_BATCH, tags, errs, times, _REAP_WAIT_S)) >= 0:
                for i in range(n):  # (the reap waits without the GIL)
                    with self._lock:
                        done = self._callbacks.pop(tags[i])
                    self.io_seconds += times[2 * i + 1] - times[2 * i]
                    try:
                        done(errs[i])
                    except Exception:  # noqa: BLE001 - one callback's bug must not stop the others'
                        log.exception("an IO completion callback failed")
        finally:  # -1: closed, every IO reaped, the C threads gone (else a bug above, logged as it leaves)
            with self._lock:
                self._closed = True
                self._final_busy = tuple(self._lib.kvs_io_pool_busy_seconds(self._pool, w) for w in (0, 1))
            self._lib.kvs_io_pool_free(self._pool)  # closes first, and joins the C threads
            with self._lock:
                self._pool = None


def nvme_pool(c_io: bool | None, kernels, num_threads: int, slice_us: int) -> IoPool | None:
    """The NVMe tier's C IO threads, or None for its Python IO threads. kernels: the
    C kernels where they stage blocks for the tier (slot_stage.py), else None. c_io None takes
    KVSTRATA_NVME_C_IO (default 1) where there are kernels; True requires them (ValueError)."""
    if c_io is None:
        env = os.environ.get("KVSTRATA_NVME_C_IO", "1")
        if env not in ("0", "1"):
            raise ValueError(f"KVSTRATA_NVME_C_IO must be 0 or 1, got {env!r}")
        c_io = env == "1" and kernels is not None
    if not c_io:
        return None
    if kernels is None:
        raise ValueError("c_io=True needs the C kernels (with their fast CRC-32) and a 4096-byte block header")
    return IoPool(kernels._lib, num_threads, slice_us, name="kvstrata-nvme-io")
