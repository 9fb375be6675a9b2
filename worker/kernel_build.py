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
from pathlib import Path

from kvstrata.worker.gguf_loader import cache_root

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_attention.c", "dense_decode.c", "prefill_attention.c", "gemm.c", "norm.c", "rope.c",
                         "layer.c", "block_copy.c", "crc32.c", "argmax.c", "bf16_ops.c", "amx_gemm.c",
                         "kv_write.c")]
# part of the build's identity, not compiled alone
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("vec.h", "kv_rows.h")]
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
        subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                       check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
