"""The hand-over from ``SlotLayer.update`` to the attention function that follows it.

transformers calls ``cache.update(k, v)`` and then the attention function; only the latter has the
query. ``update`` records ``(layer, key_states, value_states)`` here, per thread, and the attention
function checks that the key it receives is that same object. This module is the only thing the
cache and the attention function share, so neither imports the other's module at import time.
"""

from contextvars import ContextVar

PENDING: ContextVar[tuple | None] = ContextVar("h2okv_pending", default=None)
