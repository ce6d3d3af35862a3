"""Building the C++ kernels in `cpu_kernels/` and registering them as XLA FFI targets.

A kernel is compiled on first use with the system C++ compiler (`CXX`, else c++, g++, clang++)
for the CPU it runs on. The shared library is cached under `~/.cache/redjax/kernels` (override:
`REDJAX_KERNEL_DIR`), keyed by the source, the compiler and its flags, the jaxlib version and the
CPU, and published with an atomic rename so workers starting together never load a half-written
file. Without a compiler, or if the build fails, `register` returns False and the caller keeps
its XLA path. The first `register` of a process builds every kernel the cache lacks, one compiler
per core, since an engine on the CPU registers most of them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import jax

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "cpu_kernels"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++20", "-shared", "-fPIC", "-w")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def cpu_signature() -> str:
    """The CPU model and feature flags (Linux), or the platform's processor string."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(sorted({line.split(":", 1)[1].strip() for line in info
                                if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def build(source: Path) -> Path | None:
    """The shared library for `source`, compiled now unless the cache has it; None if it cannot be."""
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler found: %s is not built, the XLA path is used", source.name)
        return None
    # -march=native: a library built for one CPU must not be loaded on another sharing the cache
    stamp = " ".join((cxx, *FLAGS, jax.lib.__version__, cpu_signature()))
    # the kernel and every header it may include (all of cpu_kernels/*.h)
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(text + stamp.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("REDJAX_KERNEL_DIR") or Path.home() / ".cache" / "redjax" / "kernels")
    library = cache / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        partial = Path(tmp) / library.name
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{source.parent}", str(source), "-o", str(partial)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            log.warning("building %s failed, the XLA path is used:\n%s", source.name, result.stderr[-2000:])
            return None
        os.replace(partial, library)
    return library


@lru_cache(maxsize=1)
def build_all() -> int:
    """Build every kernel in `cpu_kernels/` at once, as many compilers as cores; -> how many are in
    the cache now. On a fresh 2-core machine one after another they took ~60 s of an engine's start
    (the attention kernel 23 s, the others 4-9 s each). Once per process; a failed build is logged
    and left to `build`, which tries again for the caller that needs it. x86-64 only: elsewhere
    the kernels with x86 intrinsics would fail, and each kernel is built when asked for."""
    if compiler() is None or platform.machine() not in ("x86_64", "AMD64"):
        return 0
    sources = sorted(KERNELS.glob("*.cc"))
    with ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        return sum(library is not None for library in pool.map(build, sources))


def register(source_name: str, symbol: str, target: str, permit: str | None = None) -> bool:
    """Build `cpu_kernels/<source_name>` and register its handler `symbol` as the CPU FFI target
    `target`; False if it cannot be built. `permit`: a function of the library to call first, which
    returns 0 where the kernel may run (the AMX kernel asks the OS for the tile state). Callers
    cache the answer (one registration per process)."""
    build_all()
    library = build(KERNELS / source_name)
    if library is None:
        return False
    try:  # a handler compiled only for some instruction sets (bfloat16 products) may be absent
        loaded = ctypes.CDLL(str(library))
        handler = getattr(loaded, symbol)
        permitted = permit is None or getattr(loaded, permit)() == 0
    except AttributeError:
        log.warning("%s has no %s for this CPU and compiler: the XLA path is used", source_name, symbol)
        return False
    if not permitted:
        log.warning("%s: the OS refused %s, so %s is not used", source_name, permit, symbol)
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return True
