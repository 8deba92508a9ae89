"""The eviction core: slot storage, the forward step, eviction, the decode fast path, the cache.

| module | job |
| --- | --- |
| ``reference.py`` | Algorithm 1 as a plain per-token loop: the spec the tests hold the fast paths to |
| ``attention.py`` | the registered attention function, the update -> attend hand-over, the mass-returning attention over slots, model preparation |
| ``layer.py`` | ``SlotLayer``: transformers' cache-layer protocol, routing a forward call, accounting |
| ``step.py`` | the eviction rule (once), the general step, the decode fast path |
| ``scan.py`` | per-token eviction over a whole call, the recurrence only |
| ``storage.py`` | one layer's slot buffers; resize/compaction and row operations |
| ``reconstruction.py`` | KVzip's reconstruction pass (``h2okv.reconstruct``, ``h2okv.read_context``) and the probe attention a layer runs in it |
| ``budget.py`` | ``BudgetSpec``: what the user asked for, resolved per row; a budget fraction's (and slot count's) split, once |
| ``cache.py`` | ``H2OCache`` and its public row operations |
"""

from h2okv.core.budget import BudgetSpec, fraction_budget, slot_budget

# the cache and its layers load transformers on first use: budget arithmetic (reports, argument
# checks) should not pay for it
_LAZY = {"DEFAULT_CHUNK": "h2okv.core.cache", "H2OCache": "h2okv.core.cache", "SlotLayer": "h2okv.core.layer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_CHUNK", "BudgetSpec", "H2OCache", "SlotLayer", "fraction_budget", "slot_budget"]
