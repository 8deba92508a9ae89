"""The prefix store's index: which token-id prefixes have a saved (compressed) cache, and which to
forget first.

The engine keeps this index; the caches themselves live in the ``Executor`` (``save``/``forget``,
and ``open(..., resume=entry)``), so every call that changes one is an executor call a
tensor-parallel follower replays. An entry is a sequence's state after it has read ``ids``: a
finished request's prompt and answer (the tokens fed). A later request whose prompt starts with an
entry's ids, in the same *namespace*, resumes from a copy of that state and prefills only the
rest; the longest match wins. The namespace holds everything that makes two states incomparable:
the API key that built it (no state crosses keys), the policy spec and the budget (a state built
under one is never resumed under another).

Bounded: the entries' bytes (their caches' KV) stay under ``capacity``; the least recently used
goes first, and an entry larger than the whole capacity is not kept. The store has its own
memory budget, apart from the running requests' ``--kv-memory``: it never delays an admission.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    id: int
    namespace: tuple
    ids: tuple[int, ...]
    bytes: int


class PrefixIndex:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"the prefix store's capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._ids = itertools.count()
        self.hits = self.misses = 0
        self.evicted = 0  # entries dropped to stay under the capacity (least recently used first)

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        """The entries kept, least recently used first (a snapshot: the engine's thread may add more)."""
        return iter(list(self._entries.values()))

    def match(self, namespace: tuple, ids: list[int]) -> Entry | None:
        """The entry of ``namespace`` whose ids are the longest proper prefix of ``ids`` (at least
        one token is left to read, whose logits start the answer), marked as used; None: a miss."""
        best = None
        for entry in self._entries.values():
            n = len(entry.ids)
            if entry.namespace == namespace and n < len(ids) and (best is None or n > len(best.ids)) \
                    and tuple(ids[:n]) == entry.ids:
                best = entry
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best.id)
        return best

    def reserve(self) -> int:
        """An id for an entry about to be saved (``add`` it with its size once it is)."""
        return next(self._ids)

    def add(self, entry: Entry) -> list[int]:
        """Keep ``entry`` (an existing entry of the same namespace and ids is replaced); returns the
        ids of the entries to forget (least recently used first, the new one itself if it alone is
        over the capacity, the replaced one)."""
        gone = [e.id for e in self._entries.values() if e.namespace == entry.namespace and e.ids == entry.ids]
        for old in gone:
            del self._entries[old]
        if entry.bytes > self.capacity:
            return [*gone, entry.id]
        self._entries[entry.id] = entry
        while self.bytes > self.capacity:
            oldest, _ = self._entries.popitem(last=False)
            gone.append(oldest)
            self.evicted += 1
        return gone

    def clear(self) -> list[int]:
        gone = list(self._entries)
        self._entries.clear()
        return gone
