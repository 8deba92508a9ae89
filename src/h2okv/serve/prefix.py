"""The prefix store's index: which token-id prefixes have a saved (compressed) cache, and which to
forget first.

The engine keeps this index; the caches themselves live in the ``Executor`` (``save``/``forget``,
and ``open(..., resume=entry)``), so every call that changes one is an executor call a
tensor-parallel follower replays. An entry is a sequence's state after it has read ``ids``: a
finished request's prompt and answer (the tokens fed), or a checkpoint part-way through a prompt.
The namespace holds everything that makes two states incomparable: the API key that built it (no
state crosses keys), the policy spec and the budget (a state built under one is never resumed
under another).

What a new prompt resumes (``lookup``; the longest wins, at least one token is left to read,
whose logits start the answer):

- any entry whose ids are a prefix of the prompt, whole: a state compressed after its last token,
  with no look past it, is what a read of the prompt up to there gives;
- a *truncatable* entry (a cache that never evicts: ``full``) also on any prompt that shares its
  first ``t`` tokens, cut to ``t`` rounded down to a ``block``: a full cache's state after ``t``
  tokens is its first ``t`` entries. Found as vLLM's automatic prefix caching finds blocks: each
  entry's full blocks are keyed by a hash chained from the first block, so a prompt walks its own
  chain until it leaves every entry's. A truncatable entry replaces the truncatable entries that
  are prefixes of it, and resumes their lengths exactly too (``Entry.marks``).

Bounded: the entries' bytes (their caches' KV) stay under ``capacity``; the least recently used
goes first, and an entry larger than the whole capacity is not kept. The store has its own
memory budget, apart from the running requests' ``--kv-memory``: it never delays an admission.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass

# block checkpoints (``block_checkpoints``) start this many tokens in: a copy costs the state's
# bytes, and reading fewer tokens again costs a forward or two
CHECKPOINT_MIN = 256


@dataclass(frozen=True)
class Entry:
    id: int
    namespace: tuple
    ids: tuple[int, ...]
    bytes: int
    truncatable: bool = False  # a cache that never evicts: its first t entries are its state after t tokens
    marks: tuple[int, ...] = ()  # shorter lengths resumed exactly: the entries it replaced (see ``add``)


@dataclass(frozen=True)
class Hit:
    entry: Entry
    length: int  # the prompt's first tokens it resumes: len(entry.ids), or fewer (a truncatable entry cut)


def block_chain(ids, block: int, count: int) -> list[int]:
    """The chained hashes of ``ids``' first ``count`` blocks of ``block`` tokens: hash ``i`` stands
    for the whole prefix up to the end of block ``i``, not for that block alone."""
    chain, h = [], 0
    for i in range(count):
        h = hash((h, *ids[i * block:(i + 1) * block]))
        chain.append(h)
    return chain


def block_checkpoints(start: int, end: int, block: int) -> list[int]:
    """Where a prompt read in ``block``-token chunks from ``start`` saves its state on the way to
    ``end`` (its cacheable prefix's end, else the prompt's): the last block boundary before
    ``end`` and every power-of-two count of blocks, from ``CHECKPOINT_MIN`` tokens on. So a
    later prompt sharing ``D`` of its tokens resumes more than half of them (at most
    ``log2(end / CHECKPOINT_MIN) + 2`` states a prompt). Only a read on the block grid (``start``
    a multiple of ``block``) has chunks that end there."""
    if start % block or end <= block:
        return []
    marks = {(end - 1) // block * block}
    b = block
    while b < end:
        marks.add(b)
        b *= 2
    return sorted(m for m in marks if start < m < end and m >= CHECKPOINT_MIN)


class PrefixIndex:
    def __init__(self, capacity: int, block: int = 16):
        if capacity < 0:
            raise ValueError(f"the prefix store's capacity must be >= 0 bytes, got {capacity}")
        if block < 1:
            raise ValueError(f"the prefix store's block must be >= 1 token, got {block}")
        self.capacity = capacity
        self.block = block
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._chains: dict[tuple, dict[int, None]] = {}  # (namespace, chain hash) -> truncatable entries
        self._ids = itertools.count()
        self.hits = self.misses = 0
        # by the label ``lookup`` is given (the engine's: the policy's name); read by /metrics' thread
        self.hits_by: Counter[str] = Counter()
        self.misses_by: Counter[str] = Counter()
        self.tokens_by: Counter[str] = Counter()  # prompt tokens resumed, not read again
        self.evicted = 0  # entries dropped to stay under the capacity (least recently used first)

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        """The entries kept, least recently used first (a snapshot: the engine's thread may add more)."""
        return iter(list(self._entries.values()))

    def lookup(self, namespace: tuple, ids: list[int], label: str = "") -> Hit | None:
        """The longest resumable state of ``namespace`` for prompt ``ids`` (see the module
        docstring), its entry marked as used; None: a miss. Counted under ``label``."""
        best: Hit | None = None
        ids = tuple(ids)
        for entry in self._entries.values():  # whole entries, and the lengths truncatable ones replaced
            if entry.namespace != namespace:
                continue
            for n in (len(entry.ids), *entry.marks):
                if (best is None or n > best.length) and n < len(ids) and ids[:n] == entry.ids[:n]:
                    best = Hit(entry, n)
        depth, owners = 0, None
        for h in block_chain(ids, self.block, (len(ids) - 1) // self.block):  # a token is left to read
            if (namespace, h) not in self._chains:
                break
            depth, owners = depth + 1, self._chains[namespace, h]
        t = depth * self.block
        if owners and (best is None or t > best.length):
            entry = self._entries[next(reversed(owners))]  # the latest saved of those that share it
            if entry.ids[:t] == ids[:t]:  # a hash collision is a miss, never a wrong state
                best = Hit(entry, t)
        if best is None:
            self.misses += 1
            self.misses_by[label] += 1
            return None
        self.hits += 1
        self.hits_by[label] += 1
        self.tokens_by[label] += best.length
        self._entries.move_to_end(best.entry.id)
        return best

    def match(self, namespace: tuple, ids: list[int]) -> Entry | None:
        """``lookup``'s entry alone."""
        hit = self.lookup(namespace, ids)
        return None if hit is None else hit.entry

    def holds(self, namespace: tuple, ids: tuple[int, ...], truncatable: bool = False) -> bool:
        """Whether a kept entry of ``namespace`` resumes exactly ``ids`` (then marked as used): one
        of exactly those ids or, for a ``truncatable`` state, a truncatable entry that extends them
        (which resumes their length from now on, a mark). The engine then saves no second copy."""
        for entry in self._entries.values():
            if entry.namespace != namespace or entry.ids[:len(ids)] != ids:
                continue
            if len(entry.ids) == len(ids) or (truncatable and entry.truncatable):
                if len(entry.ids) > len(ids) and len(ids) not in entry.marks:
                    self._entries[entry.id] = dataclasses.replace(entry, marks=tuple(sorted((*entry.marks, len(ids)))))
                self._entries.move_to_end(entry.id)
                return True
        return False

    def reserve(self) -> int:
        """An id for an entry about to be saved (``add`` it with its size once it is)."""
        return next(self._ids)

    def add(self, entry: Entry) -> list[int]:
        """Keep ``entry``; returns the ids of the entries to forget: an existing entry of the same
        namespace and ids (replaced), the truncatable entries a truncatable ``entry`` extends
        (it resumes their lengths too), least recently used ones to stay under the capacity, or
        ``entry`` itself if it alone is over it."""
        if entry.bytes > self.capacity:
            return [entry.id]
        ns, n = entry.namespace, len(entry.ids)
        gone = [e for e in self._entries.values() if e.namespace == ns and (
            e.ids == entry.ids or (entry.truncatable and e.truncatable and len(e.ids) < n and entry.ids[:len(e.ids)] == e.ids))]
        if entry.truncatable:
            marks = {m for e in gone for m in (len(e.ids), *e.marks)} | set(entry.marks)
            entry = dataclasses.replace(entry, marks=tuple(sorted(marks - {n})))
        for old in gone:
            self._drop(old.id)
        self._entries[entry.id] = entry
        if entry.truncatable:
            for h in block_chain(entry.ids, self.block, n // self.block):
                self._chains.setdefault((ns, h), {})[entry.id] = None
        removed = [e.id for e in gone]
        while self.bytes > self.capacity:
            removed.append(self._drop(next(iter(self._entries))))
            self.evicted += 1
        return removed

    def clear(self) -> list[int]:
        gone = list(self._entries)
        self._entries.clear()
        self._chains.clear()
        return gone

    def _drop(self, entry_id: int) -> int:
        entry = self._entries.pop(entry_id)
        if entry.truncatable:
            for h in block_chain(entry.ids, self.block, len(entry.ids) // self.block):
                owners = self._chains.get((entry.namespace, h))
                if owners is not None:
                    owners.pop(entry_id, None)
                    if not owners:
                        del self._chains[entry.namespace, h]
        return entry_id
