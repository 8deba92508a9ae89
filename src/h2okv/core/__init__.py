"""The eviction core: slot storage, the forward step, eviction, the decode fast path, the cache.

| module | job |
| --- | --- |
| ``storage.py`` | one layer's slot buffers; resize/compaction and row operations |
| ``step.py`` | the general step: write a chunk into free slots, attend, fold mass into scores |
| ``evict.py`` | candidates (recent window, sinks) and freeing the policy's lowest-ranked |
| ``decode.py`` | one-token steps once every row is at its budget, in the fewest ops |
| ``layer.py`` | ``SlotLayer``: transformers' cache-layer protocol, routing, accounting |
| ``budget.py`` | ``BudgetSpec``: what the user asked for, resolved per row |
| ``cache.py`` | ``H2OCache`` and its public row operations |
"""

from h2okv.core.budget import BudgetSpec
from h2okv.core.cache import DEFAULT_CHUNK, H2OCache
from h2okv.core.layer import SlotLayer

__all__ = ["DEFAULT_CHUNK", "BudgetSpec", "H2OCache", "SlotLayer"]
