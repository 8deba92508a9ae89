"""Row surgery on ``H2OCache``: the decode batch that sequences join and leave between steps.

An ``H2OCache`` already keeps everything that differs between sequences per row: slot buffers,
scores, ordinals (each row counts its own real tokens), valid flags and budgets (``heavy``/``recent``
per row). Only ``tokens_seen`` is per layer, and the engine never relies on it: it passes each row's
true position through ``position_ids`` and feeds one real token per row (no padding mask), so the
mask needs no offset. A sequence is therefore prefilled alone in its own batch-1 cache and then
concatenated into the batch of its policy; a finished one is dropped with ``index_select``.

Every row of a batch has the same slot capacity, sized to the largest row's reservation, so the
cache never grows during decode and the memory the engine admitted against is what it holds.
"""

from __future__ import annotations

import torch

from ..cache import H2OCache, SlotLayer

# per-slot tensors [B, H, capacity(, D)] and per-row vectors [B]
SLOT_TENSORS = ("keys", "values", "score", "ordinal", "valid")
ROW_VECTORS = ("n_real", "heavy", "recent")


def fit_capacity(layer: SlotLayer, capacity: int) -> None:
    """Give ``layer`` exactly ``capacity`` slots: pad with free slots, or move live slots to the
    front and cut (attention does not depend on slot order, so this changes no result)."""
    current = layer.capacity
    if current == capacity:
        return
    if current > capacity and not bool(layer.valid[..., capacity:].any()):
        # the usual case: every live slot already lies below ``capacity`` (a row's live slots stay
        # within its own reservation). Cut without moving anything, so each row keeps exactly the
        # slot layout it would have alone: same eviction tie-breaks, bit-identical generations.
        for name in SLOT_TENSORS:
            setattr(layer, name, getattr(layer, name)[:, :, :capacity].clone())  # clone: free the rest
        return
    if current > capacity:
        live = int(layer.valid.sum(-1).max()) if current else 0
        if live > capacity:
            raise RuntimeError(f"cannot fit {live} live slots into {capacity}")
        order = torch.argsort((~layer.valid).to(torch.int8), dim=-1, stable=True)[..., :capacity]
        for name in SLOT_TENSORS:
            tensor = getattr(layer, name)
            index = order if tensor.dim() == 3 else order[..., None].expand(-1, -1, -1, tensor.shape[-1])
            setattr(layer, name, tensor.gather(2, index))
        return
    for name in SLOT_TENSORS:
        old = getattr(layer, name)
        shape = list(old.shape)
        shape[2] = capacity
        new = old.new_zeros(shape)  # zeros: valid=False, i.e. free slots
        new[:, :, :current] = old
        setattr(layer, name, new)
    layer.peak_capacity = max(layer.peak_capacity, capacity)


def refresh_derived_state(cache: H2OCache) -> None:
    """Recompute what a ``SlotLayer`` derives from its rows (largest budget, fast-decode state)
    after rows joined or left by hand."""
    for layer in cache.layers:
        layer.rows_changed()


def _row_budgets(cache: H2OCache) -> tuple[torch.Tensor, torch.Tensor]:
    budgets = cache._row_budgets
    if budgets is None:  # pragma: no cover - a prefilled cache always has them
        raise RuntimeError("cache has not seen a forward call yet")
    return budgets


class DecodeBatch:
    """The sequences of one policy that decode together, one forward per step, and their cache.

    ``rows[i]`` is the caller's object for row ``i`` of the cache (the engine stores its sequences).
    """

    def __init__(self, policy: str):
        self.policy = policy
        self.cache: H2OCache | None = None
        self.rows: list = []
        self.capacity = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row, cache: H2OCache, capacity: int) -> None:
        """Append a prefilled batch-1 ``cache`` as a new row; every row then has ``max(capacity, ...)``
        slots. ``cache`` must not be used by the caller afterwards."""
        target = max(capacity, self.capacity)
        if self.cache is None:
            for layer in cache.layers:
                fit_capacity(layer, target)
            self.cache = cache
        else:
            for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
                fit_capacity(mine, target)
                fit_capacity(theirs, target)
                for name in SLOT_TENSORS + ROW_VECTORS:
                    setattr(mine, name, torch.cat([getattr(mine, name), getattr(theirs, name).to(mine.device)]))
                mine.tokens_seen = max(mine.tokens_seen, theirs.tokens_seen)
            (h0, r0), (h1, r1) = _row_budgets(self.cache), _row_budgets(cache)
            self.cache._row_budgets = (torch.cat([h0, h1]), torch.cat([r0, r1]))
        refresh_derived_state(self.cache)
        self.capacity = target
        self.rows.append(row)

    def keep(self, keep_rows: list, capacity: int) -> None:
        """Keep only ``keep_rows`` (a subset of ``rows``, in order); shrink to ``capacity`` slots."""
        if len(keep_rows) == len(self.rows):
            return
        if not keep_rows:
            self.cache, self.rows, self.capacity = None, [], 0
            return
        position = {id(r): i for i, r in enumerate(self.rows)}
        index = torch.tensor([position[id(r)] for r in keep_rows], dtype=torch.long)
        for layer in self.cache.layers:
            layer.batch_select_indices(index)
            fit_capacity(layer, capacity)
        heavy, recent = _row_budgets(self.cache)
        self.cache._row_budgets = (heavy.index_select(0, index), recent.index_select(0, index))
        refresh_derived_state(self.cache)
        self.rows = list(keep_rows)
        self.capacity = capacity

    def kv_bytes(self) -> int:
        return 0 if self.cache is None else sum(layer.kv_bytes() for layer in self.cache.layers)
