"""The model a benchmark measures: ``tiny:ARCH`` (a tiny random model, for tests and smoke runs)
or anything ``load_model`` takes. Shared by the bench command and the fresh process of the
prefill-memory probe (``probe.py``), which must load exactly the same model."""

from __future__ import annotations

from h2okv.errors import H2OError


def load_bench_model(name: str | None, device: str, dtype):
    """``tiny:ARCH`` builds a tiny random model (tests, smoke runs; no tokenizer); else ``load_model``."""
    if name and name.startswith("tiny:"):
        import torch

        from h2okv.models import _resolve_dtype
        from h2okv.tools.tiny import TINY_CONFIGS, tiny_model

        arch = name.split(":", 1)[1] or "llama"
        if arch not in TINY_CONFIGS:
            raise H2OError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(sorted(TINY_CONFIGS))}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise H2OError("--device cuda requested but no CUDA device is available")
        torch.set_grad_enabled(False)
        return tiny_model(arch).to(device=device, dtype=_resolve_dtype(dtype or "float32", device)), None
    from h2okv.models import load_model

    return load_model(name, device=device, dtype=dtype)
