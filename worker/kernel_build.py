"""Building the C kernels (csrc/) into one shared object with the system C compiler.

The object is built once per source, header, flags, compiler and CPU into the kvstrata cache
directory, under a hash of all of them, atomically (written aside, then renamed), so concurrent
workers are safe and an edit to any file is never served by a stale build.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstrata.worker.gguf_loader import cache_root

# the longest compiles first, so that the parallel build's last job is a short one
_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("gemm.c", "dense_decode.c", "prefill_attention.c", "paged_attention.c", "kv_write.c",
                         "norm.c", "rope.c", "layer.c", "block_copy.c", "crc32.c", "argmax.c", "bf16_ops.c",
                         "int8_head.c", "amx_gemm.c", "io_pool.c", "sample.c", "greedy_head.c")]
# part of the build's identity, not compiled alone
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("vec.h", "kv_rows.h", "thread_slot.h")]
# -std=c11 alone turns floating-point contraction off; the kernels are written for fused multiply-adds
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=fast", "-fopenmp", "-std=c11", "-shared", "-fPIC"]


def find_compiler() -> str | None:
    """$CC (default cc), else gcc; None when neither is here."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cpu_signature() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def build(compiler: str) -> Path:
    """The shared object for this machine, compiled unless the cache holds it (CalledProcessError on
    a failed compile)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [p.read_bytes() for p in _SOURCES + _HEADERS] + [" ".join(_FLAGS).encode(), version.encode(),
                                                  _cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"kvstrata-cpu-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        _compile(compiler, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile(compiler: str, out: str) -> None:
    """Each source to an object, as many at once as there are cores, then one link into `out` (on 2
    cores 10 s instead of 16 for one compiler call over all of them)."""
    compile_flags = [f for f in _FLAGS if f != "-shared"]
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as objects_dir:
        objects = [os.path.join(objects_dir, f"{i}-{src.stem}.o") for i, src in enumerate(_SOURCES)]

        def one(i: int) -> None:
            subprocess.run([compiler, *compile_flags, "-c", str(_SOURCES[i]), "-o", objects[i]], capture_output=True,
                           text=True, check=True)

        with ThreadPoolExecutor(max_workers=max(1, min(len(_SOURCES), _usable_cores()))) as pool:
            for job in [pool.submit(one, i) for i in range(len(_SOURCES))]:
                job.result()  # the first failed compile's CalledProcessError, once all have ended
        subprocess.run([compiler, *_FLAGS, *objects, "-o", out, "-lm"], capture_output=True, text=True, check=True)


def _usable_cores() -> int:
    """The cores this process may run on (a container's CPU set, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
