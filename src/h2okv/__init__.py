"""h2okv: H2O (Heavy-Hitter Oracle) KV-cache eviction for Hugging Face transformers, with real
memory savings, batching and grouped-query attention."""

from h2okv.errors import H2OError

__all__ = ["CacheSettings", "H2OCache", "H2OError", "POLICIES", "RECIPES", "ask", "load_model", "read_context",
           "reconstruct", "restore_model"]
__version__ = "0.1.0"

# the heavy parts (transformers) load on first use: ``import h2okv.parallel.ranks`` in a
# tensor-parallel rank, or the CLI's argument parsing, should not pay for them
_LAZY = {"H2OCache": ".core.cache", "load_model": ".models", "POLICIES": ".policies", "RECIPES": ".recipes",
         "reconstruct": ".core.reconstruction", "read_context": ".core.reconstruction", "ask": ".questions",
         "restore_model": ".core.attention", "CacheSettings": ".settings"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
