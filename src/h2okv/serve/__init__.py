"""``h2okv serve``: an OpenAI-compatible server whose decode batches grow with the KV memory H2O frees.

The runtime (no HTTP): ``engine.py`` (continuous batching in a background thread) asks
``scheduler.py`` (pure: state in, plan out) what to run, runs it through ``executor.py`` and turns
logits into events with ``outputs.py``; ``memory.py`` sizes what a request holds; ``types.py`` and
``errors.py`` are its public data. The HTTP layer is ``api/`` (``create_app``, ``serve_forever``).

The names below are imported on first use, so that importing the runtime does not import FastAPI.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "h2okv.serve.engine",
    "EngineOptions": "h2okv.serve.engine",
    "ServerLimits": "h2okv.serve.api.limits",
    "GenerationRequest": "h2okv.serve.types",
    "EvictionDefaults": "h2okv.serve.eviction",
    "create_app": "h2okv.serve.api.app",
    "running_server": "h2okv.serve.api.server",
    "serve_forever": "h2okv.serve.api.server",
}

__all__ = ["Engine", "EngineOptions", "EvictionDefaults", "GenerationRequest", "ServerLimits", "create_app",
           "running_server", "serve_forever"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'h2okv.serve' has no attribute {name!r}")
