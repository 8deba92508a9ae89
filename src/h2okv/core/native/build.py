"""Build and load ``kernels.c`` once per machine: the system C compiler, ctypes, no headers.

The library is compiled at first use into ``<cache root>/kernels/`` under a name that hashes the
source, the compiler, its flags and the CPU (``-march=native``), so an edit, another compiler or
another machine sharing the cache gets its own build. Where no compiler is found or the build
fails, ``library()`` returns None after one warning and the core runs its eager path. Build time
is kept in ``build_info()`` (what the bench reports as the first-call cost); both live in the
core's ``RUNTIME`` (``core/runtime.py``), which ``reset()`` clears.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from h2okv.core.runtime import RUNTIME
from h2okv.paths import cache_root

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c11", "-shared", "-fPIC")
_I64, _F32P, _I64P, _U8P = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
SIGNATURES = MappingProxyType({  # read-only: a table, not state
    "scan_block": (_F32P, _F32P, _U8P, _F32P, _I64P) + (_I64,) * 10 + (ctypes.c_int,) * 3 + (_F32P,),
    "decode_dense": (_F32P,) * 6 + (_I64P, _U8P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _F32P) + (_I64,) * 6
    + (ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float, _F32P, _F32P),
})


@dataclass
class BuildInfo:
    path: str | None = None
    seconds: float = 0.0  # compile time of this process's build (0 when a cached build was loaded)
    cached: bool = False
    error: str | None = None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _target(cc: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cc.encode(), " ".join(FLAGS).encode(), _cpu_id().encode(),
                 platform.machine().encode()):
        key.update(part)
    return cache_root() / "kernels" / f"h2okv-kernels-{key.hexdigest()[:16]}.so"


def _build(cc: str, target: Path) -> float:
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # a private name first, then an atomic rename: concurrent builds never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
            raise OSError(f"{Path(cc).name} failed: {lines[0]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return time.perf_counter() - start


def library():
    """The loaded kernels (``ctypes.CDLL``), or None where they cannot be built (warned once)."""
    if RUNTIME.native_build is not None:
        return RUNTIME.native_library
    cc = _compiler()
    try:
        if cc is None:
            raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH")
        target = _target(cc)
        cached = target.is_file()
        seconds = 0.0 if cached else _build(cc, target)
        lib = ctypes.CDLL(str(target))
        for name, args in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
        RUNTIME.native_build, RUNTIME.native_library = BuildInfo(str(target), seconds, cached), lib
    except OSError as exc:
        RUNTIME.native_build, RUNTIME.native_library = BuildInfo(error=str(exc)), None
        warnings.warn(f"h2okv: native CPU kernels unavailable ({exc}); using the eager path", stacklevel=2)
    return RUNTIME.native_library


def build_info() -> BuildInfo | None:
    """How the library was built or why it could not be (None: not tried yet)."""
    return RUNTIME.native_build


def reset() -> None:
    """Forget the loaded library (tests: build again under another compiler or cache root)."""
    RUNTIME.native_build, RUNTIME.native_library = None, None
