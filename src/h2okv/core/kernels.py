"""Which kernels the core runs, chosen once per process (or per ``use_kernels`` block). A layer
chooses its decode engine when its rows change (``decode.choose_stepper``): a cache follows the
kernels in force when it read its prompt.

- ``eager``: tensor ops only: the path every other one is tested against.
- ``native``: on CPU, the per-token scan's recurrence and the at-budget decode step as C loops
  (``core/native``), built at first use with the system compiler; eager where no compiler is
  found (one warning), for a tensor that is not float32, or for a policy whose rule the
  kernels do not know (``native/rules.py``).
- ``triton``: on CUDA, the mass-returning attention as Triton kernels (``core/triton_attention.py``);
  eager where Triton cannot be imported.
- ``auto`` (default): ``native`` on CPU, ``triton`` on CUDA.

Set with ``set_kernels``, ``use_kernels`` or ``$H2OKV_KERNELS``; ``h2okv bench --kernels`` compares them.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from h2okv.core.runtime import RUNTIME
from h2okv.errors import H2OError

KERNELS = ("auto", "eager", "native", "triton")
ENV = "H2OKV_KERNELS"


def check_kernels(name: str) -> str:
    if name not in KERNELS:
        raise H2OError(f"unknown kernels {name!r}; choose one of {', '.join(KERNELS)}")
    return name


def get_kernels() -> str:
    return RUNTIME.kernels or check_kernels(os.environ.get(ENV) or "auto")


def set_kernels(name: str | None) -> None:
    """Choose the kernels for this process (None: back to ``$H2OKV_KERNELS`` / auto)."""
    RUNTIME.kernels = None if name is None else check_kernels(name)


@contextmanager
def use_kernels(name: str):
    saved, RUNTIME.kernels = RUNTIME.kernels, check_kernels(name)
    try:
        yield
    finally:
        RUNTIME.kernels = saved


def native_on(device) -> bool:
    """Whether the native CPU kernels run for tensors on ``device`` (building them at first ask)."""
    if device.type != "cpu" or get_kernels() not in ("auto", "native"):
        return False
    from h2okv.core.native.build import library

    return library() is not None


def triton_on(device) -> bool:
    """Whether the Triton kernels run for tensors on ``device``."""
    if device.type != "cuda" or get_kernels() not in ("auto", "triton"):
        return False
    from h2okv.core.triton_attention import triton_available

    return triton_available()


def unavailable_reason(name: str, device) -> str | None:
    """Why ``name`` cannot run on ``device`` (None: it can). For reports such as the bench's."""
    check_kernels(name)
    if name == "native":
        if device.type != "cpu":
            return "native kernels are CPU only"
        from h2okv.core.native.build import build_info, library

        if library() is not None:
            return None
        info = build_info()  # recorded by the library() call just made
        return info.error if info else "not built"
    if name == "triton":
        if device.type != "cuda":
            return "triton kernels need a CUDA device"
        from h2okv.core.triton_attention import triton_available, triton_import_error

        return None if triton_available() else triton_import_error()
    return None
