"""What the core chose or loaded for this process, in one object with a reset.

The kernels in force (``set_kernels``/``use_kernels``), the native library once built or found
unbuildable, the fused Triton step once it failed to launch, and each prepared model config's
attention implementation before ``prepare_model``: state that outlives a cache, kept here rather
than in module globals of the modules that use it, so a test (or a user switching compilers)
forgets it all with ``RUNTIME.reset()``, and nothing else in ``core/`` holds mutable module state
(``tests/package/test_layout.py`` scans for it).

Imports nothing of the core: every module that reads this state may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Runtime:
    #: ``set_kernels``' choice (None: ``$H2OKV_KERNELS``, else auto) (``core/kernels.py``)
    kernels: str | None = None
    #: the native library's build (``native/build.BuildInfo``) once tried, and the loaded library
    #: (``ctypes.CDLL``; None where it cannot be built)
    native_build: object | None = None
    native_library: object | None = None
    #: why the fused Triton decode step could not launch here (then every step stays eager)
    triton_step_failure: str | None = None
    #: id(config) -> (weakref to the config, its attention implementation before ``prepare_model``)
    previous_attention: dict = field(default_factory=dict)

    def reset(self) -> None:
        """Forget every choice and load (the next use builds or chooses them again). The records of
        prepared models stay: they belong to live models and leave with them."""
        self.kernels = self.native_build = self.native_library = self.triton_step_failure = None


RUNTIME = Runtime()
