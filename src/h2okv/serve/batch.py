"""Row surgery on ``H2OCache``: the decode batch that sequences join and leave between steps.

An ``H2OCache`` already keeps everything that differs between sequences per row: slot buffers,
scores, ordinals (each row counts its own real tokens), valid flags and budgets (``heavy``/``recent``
per row). Only ``tokens_seen`` is per layer, and the engine never relies on it: it passes each row's
true position through ``position_ids`` and feeds one real token per row (no padding mask), so the
mask needs no offset. A sequence is prefilled in its policy's prefill group (``executor.py``); the
rows whose prompts end in the same forward are then copied out together (``H2OCache.take_rows``;
none is copied when the whole group ends) and appended to the batch of their policy at once
(``H2OCache.append_rows``: one copy of the batch, where one join a row copied it once a row); a
finished one is dropped (``H2OCache.select_rows``).

Every row of a batch has the same slot capacity, sized to the largest row's reservation (or to its widest
head's budget, under a cache-wide split: ``H2OCache.decode_capacity``), so the
cache never grows during decode and the memory the engine admitted against is what it holds.
"""

from __future__ import annotations

import torch

from h2okv.core.cache import H2OCache


class DecodeBatch:
    """The sequences of one policy that decode together, one forward per step, and their cache.

    ``rows[i]`` names row ``i`` of the cache (the executor's sequence uids).
    """

    def __init__(self, policy: str):
        self.policy = policy
        self.cache: H2OCache | None = None
        self.rows: list = []
        self.capacity = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list, cache: H2OCache, capacity: int) -> None:
        """Append a prefilled cache of ``len(rows)`` rows (one per entry of ``rows``, in order); every
        row then has ``max(capacity, ...)`` slots. ``cache`` must not be used by the caller afterwards."""
        # a head given more than the even share (a cache-wide split) keeps its slots
        target = max(capacity, self.capacity, cache.decode_capacity())
        cache.fit_capacity(target)
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.fit_capacity(target)
            self.cache.append_rows(cache)
        self.capacity = target
        self.rows.extend(rows)

    def keep(self, keep_rows: list, capacity: int) -> None:
        """Keep only ``keep_rows`` (a subset of ``rows``, in order); shrink to ``capacity`` slots."""
        if len(keep_rows) == len(self.rows):
            return
        if not keep_rows:
            self.cache, self.rows, self.capacity = None, [], 0
            return
        # by value: a tensor-parallel follower's uids are unpickled afresh with every call, so the
        # ints that name a row in keep() are not the objects join() stored (by id(), uid 257 and up
        # were not found)
        position = {r: i for i, r in enumerate(self.rows)}
        index = torch.tensor([position[r] for r in keep_rows], dtype=torch.long)
        self.cache.select_rows(index)
        capacity = max(capacity, self.cache.decode_capacity())
        self.cache.fit_capacity(capacity)
        self.rows = list(keep_rows)
        self.capacity = capacity

    def kv_bytes(self) -> int:
        return 0 if self.cache is None else sum(layer.kv_bytes() for layer in self.cache.layers)
