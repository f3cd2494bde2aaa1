"""Builds and loads Spindle's CPU kernels (the `*.c` files beside this one) on first use.

The C files are compiled into one library with the system C compiler (`cc -O3 -march=native -fopenmp`) into
`$SPINDLE_CACHE_DIR/cpu_kernels/` (default `~/.cache/spindle`), keyed by a hash of the source, the flags and
this CPU's feature flags, so a machine only builds once and a changed source rebuilds. The OpenMP runtime
is the one torch already loaded (same soname), so the kernels share torch's thread count.

Anything missing (no compiler, no AVX-512, `SPINDLE_CPU_KERNELS=0`) leaves `kernels()` None and callers use
their torch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("spindle.cpu_kernels")

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.c"))
HEADERS = sorted(HERE.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
REQUIRED_CPU_FLAGS = ("avx512f",)

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_LLAMA_DECODE_ARGS = [_P, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _INT, _F32,
                      _F32, _I64, _INT, _P]  # fmt: skip
SIGNATURES = {
    "spindle_pack_weight": ([_P, _P, _I64, _I64, _INT], None),
    "spindle_pack_gguf": ([_P, _P, _I64, _I64, _INT], None),
    "spindle_gemm_packed": ([_P, _P, _P, _I64, _I64, _I64, _INT, _INT, _INT], None),
    "spindle_paged_decode": (
        [_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _INT, _I64, _INT],
        ctypes.c_int,
    ),
    "spindle_llama_decode": (_LLAMA_DECODE_ARGS, ctypes.c_int),
    "spindle_prefill_attention": (
        [_P, _P, _P, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _INT],
        ctypes.c_int,
    ),
    "spindle_rms_norm": ([_P, _P, _P, _I64, _I64, _F32, _INT], None),
    "spindle_silu_mul": ([_P, _P, _I64, _I64, _INT], None),
}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    return Path(os.environ.get("SPINDLE_CACHE_DIR", Path.home() / ".cache" / "spindle")) / "cpu_kernels"


def _build(compiler: str, flags: set[str]) -> Path:
    text = b"".join(f.name.encode() + f.read_bytes() for f in SOURCES + HEADERS)
    digest = hashlib.sha256(text + " ".join(FLAGS + sorted(flags)).encode()).hexdigest()[:16]
    target = cache_dir() / f"spindle_cpu_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)], check=True, capture_output=True, text=True
        )
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    log.info("built CPU kernels into %s", target)
    return target


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (then use the torch path)."""
    if os.environ.get("SPINDLE_CPU_KERNELS", "1") == "0":
        return None
    flags = _cpu_flags()
    if missing := [f for f in REQUIRED_CPU_FLAGS if f not in flags]:
        log.info("CPU kernels off: this CPU lacks %s", ", ".join(missing))
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("CPU kernels off: no C compiler (cc/gcc) found; using the slower torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler, flags)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("CPU kernels off: building them failed: %s", detail.strip()[:500])
        return None
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib
