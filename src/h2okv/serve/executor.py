"""The executor: the only thing in the server that runs the model or changes a KV cache.

The engine (``engine.py``) decides *what* to run: which requests are admitted, which prompt chunks
this step prefills, which rows decode, what token each row feeds next. The ``Executor`` holds the
model and every KV cache (one ``DecodeBatch`` per policy, the caches of prompts being prefilled)
and does it. Its calls take plain, picklable data only (ints, strs, lists of ints, tuples of
those) and return logits or nothing. A sequence is named by an integer ``uid`` the engine assigns.

**The rule:** every call is deterministic given its arguments and the calls made before it. No
call reads a clock, a random source (cache policies take their seed in ``open``), a request's
text or anything else the engine holds. So a second executor (a tensor-parallel follower) that
receives the same calls in the same order holds the same caches and computes the same logits;
sampling, stop strings, detokenisation, timeouts and cancellation stay in the engine, which turns
their outcome into the next calls (``close``/``keep``/``decode`` with the chosen ids).

A call that raises leaves the caches as they were before it, except ``prefill`` and ``decode``
whose failure leaves the sequences involved unusable: the engine then ``close``s them (``keep``
for a decode batch), which always succeeds.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..core import H2OCache
from .batch import DecodeBatch
from .memory import bytes_per_slot


@dataclass(frozen=True)
class SequenceSpec:
    """What an executor needs to build a sequence's cache (``heavy``/``recent`` None for ``full``)."""

    policy: str
    heavy: int | None
    recent: int | None
    seed: int


class Executor:
    """Owns ``model`` and the caches; see the module docstring for the determinism rule."""

    def __init__(self, model, prefill_chunk: int):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.model = model
        self.device = model.device
        self.prefill_chunk = prefill_chunk
        # only the last position's logits are needed; older transformers lack the argument
        self._keep_last = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        )
        self._specs: dict[int, SequenceSpec] = {}
        self._prefill: dict[int, H2OCache] = {}  # uid -> its own cache while its prompt is prefilled
        self._batches: dict[str, DecodeBatch] = {}  # policy -> the rows (uids) that decode together

    # -- facts about the model (no cache involved) -------------------------------------------------
    def slot_bytes(self) -> int:
        """Bytes of one token's K and V across all layers and KV heads (``memory.bytes_per_slot``)."""
        return bytes_per_slot(self.model)

    # -- sequences -----------------------------------------------------------------------------
    def open(self, uid: int, policy: str, heavy: int | None, recent: int | None, seed: int) -> None:
        """Register a sequence; its cache is built by its first ``prefill``."""
        if uid in self._specs:
            raise ValueError(f"sequence {uid} is already open")
        self._specs[uid] = SequenceSpec(policy, heavy, recent, int(seed))

    def prefill(self, parts: list[tuple[int, list[int], int]]) -> dict[int, torch.Tensor]:
        """Feed prompt chunks: ``parts`` is ``[(uid, token_ids, first_position), ...]``, each uid at
        most once, every token of a sequence's prompt exactly once over its calls, in order.
        Returns each uid's logits at its chunk's last token (``[vocab]``)."""
        uids = [uid for uid, _, _ in parts]
        if len(set(uids)) != len(uids):
            raise ValueError("a sequence appears twice in one prefill call")
        for uid in uids:
            if uid not in self._specs or self._joined(uid):
                raise ValueError(f"sequence {uid} is not open for prefill")
        out = {}
        for uid, ids, start in parts:
            out[uid] = self._prefill_alone(uid, ids, start)
        return out

    def join(self, uid: int, capacity: int) -> None:
        """The prefilled ``uid`` becomes the last row of its policy's decode batch, which then has
        ``max(capacity, current)`` slots per row."""
        cache = self._prefill.pop(uid)
        policy = self._specs[uid].policy
        self._batches.setdefault(policy, DecodeBatch(policy)).add(uid, cache, capacity)

    def decode(self, policy: str, uids: list[int], ids: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step of ``policy``'s batch: row ``i`` (``uids`` must be the batch's rows, in
        order) feeds token ``ids[i]`` at ``positions[i]``. Returns logits ``[rows, vocab]``."""
        batch = self._batches.get(policy)
        if batch is None or list(uids) != batch.rows:
            raise ValueError(f"decode rows {uids} are not the {policy!r} batch's rows")
        tokens = torch.tensor([[t] for t in ids], dtype=torch.long, device=self.device)
        where = torch.tensor([[p] for p in positions], dtype=torch.long, device=self.device)
        out = self.model(input_ids=tokens, position_ids=where, past_key_values=batch.cache, use_cache=True,
                         **self._keep_last)
        return out.logits[:, -1]

    def keep(self, policy: str, uids: list[int], capacity: int) -> None:
        """Keep only rows ``uids`` (a subset of the batch's rows, in order) of ``policy``'s batch, at
        ``capacity`` slots per row; the sequences dropped are closed."""
        batch = self._batches.get(policy)
        if batch is None:
            if uids:
                raise ValueError(f"no {policy!r} batch")
            return
        for uid in set(batch.rows) - set(uids):
            self._specs.pop(uid, None)
        batch.keep(list(uids), capacity)
        if not batch.rows:
            del self._batches[policy]

    def close(self, uid: int) -> None:
        """Forget a sequence that has not joined a decode batch (no-op for an unknown uid)."""
        if self._joined(uid):
            raise ValueError(f"sequence {uid} decodes: drop it with keep()")
        self._prefill.pop(uid, None)
        self._specs.pop(uid, None)

    def reset(self) -> None:
        """Drop every sequence and cache."""
        self._specs.clear()
        self._prefill.clear()
        self._batches.clear()

    # -- observation (does not change anything) ------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of K/V buffers allocated now, prefill caches and decode batches together."""
        total = sum(batch.kv_bytes() for batch in self._batches.values())
        return total + sum(layer.kv_bytes() for cache in self._prefill.values() for layer in cache.layers)

    def rows(self, policy: str) -> list[int]:
        batch = self._batches.get(policy)
        return [] if batch is None else list(batch.rows)

    # -- internals -----------------------------------------------------------------------------------
    def _joined(self, uid: int) -> bool:
        return any(uid in batch.rows for batch in self._batches.values())

    def _new_cache(self, spec: SequenceSpec) -> H2OCache:
        budget = {} if spec.heavy is None else {"heavy": spec.heavy, "recent": spec.recent}
        return H2OCache(self.model, policy=spec.policy, chunk_size=self.prefill_chunk, seed=spec.seed, **budget)

    def _prefill_alone(self, uid: int, ids: list[int], start: int) -> torch.Tensor:
        cache = self._prefill.get(uid)
        if cache is None:
            cache = self._prefill[uid] = self._new_cache(self._specs[uid])
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        out = self.model(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True,
                         **self._keep_last)
        return out.logits[0, -1]
