"""KV memory accounting for admission: what a request will hold, in slots and bytes.

A slot is one token's keys and values in every layer and KV head, so its size in bytes is a property
of the model (measured once, see ``bytes_per_slot``). A request holds:

- while decoding: ``min(budget + 1, prompt + max_tokens)`` slots (``prompt + max_tokens`` for policy
  ``full``), since an evicting cache keeps ``budget`` tokens plus the one being written;
- while prefilling alone (``--schedule serial``): up to ``min(prompt, budget + chunk)`` slots, as
  every chunk is written before the eviction that follows it;
- while prefilling in a shared forward (``--schedule budget``): its row of the policy's prefill
  group, whose capacity is the largest ``held + width`` of the step, ``held`` being a row's tokens
  before the step and ``width`` the step's longest chunk (free slots are only ever taken from the
  front, so no row's live slot lies beyond that). Per row that is at most
  ``min(prompt - last chunk, budget) + chunk`` (``shared_peak``).

Rows of one decode batch share a capacity (the largest reservation among them), so a batch costs
``rows * max(slots)``. Every request in flight counts as a decode row of its policy from admission
on; what prefill holds on top of that is its overshoot (``*_extra`` = peak - slots). The serial
schedule finishes one prompt before starting the next, so one overshoot counts (the largest). The
shared schedule has a group of prompts part-way through per policy, costing ``rows * max(peak)``,
i.e. at most ``rows * max(extra)`` on top of their decode rows, plus the largest overshoot of the
admitted prompts not started yet (so the oldest of them can always start once the groups drain).
The engine admits a request only if that total, with the request added, stays under ``--kv-memory``,
and starts a prompt in a group only if the total with it started, without the reserve, still does.
Liveness: the decode term only grows by admissions, each of which kept the reserve for the oldest
prompt not started, so once the groups drain that prompt fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2okv.byte_budget import Geometry
from h2okv.core.cache import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.layer import GROWTH_MIN  # how much an empty layer grows on a 1-token write
from h2okv.settings import DEFAULT_KV_GROUP


def _measured_layers(model, coding: dict) -> list:
    """The layers of a one-sequence cache after a 2-token forward: what a slot and a window cost."""
    cache = H2OCache(model, policy="full", **coding)
    with torch.inference_mode():
        model(torch.zeros((1, 2), dtype=torch.long, device=model.device), **cache_arg(cache), use_cache=True)
    return [layer for layer in cache.layers if layer.is_initialized]


def bytes_per_slot(model, **coding) -> int:
    """Bytes of one token's K and V across all layers and KV heads, measured on a 2-token forward;
    ``coding``: ``kv_bits`` and ``kv_group`` of quantized slots (their codes and scales)."""
    return sum((layer.kv_bytes() - layer.window_bytes() - layer.center_bytes()) // layer.capacity
               for layer in _measured_layers(model, coding))


def per_sequence_slots(model, **coding) -> int:
    """What a sequence holds beside its slots, as the slots a request is admitted by: a float
    window's tokens at the model's width, and centered keys' means (a float16 key per layer and
    head), over a coded slot's bytes, rounded up. A ratio of one head's bytes, so it holds whatever
    share of the heads a tensor-parallel rank keeps, and it needs no forward (no collective)."""
    window, center = coding.get("float_window") or 0, bool(coding.get("center_keys"))
    if not window and not center:
        return 0
    geometry = Geometry.of(model.config)
    group = min(coding.get("kv_group", DEFAULT_KV_GROUP), geometry.key_dim)
    coded = geometry.slot_bytes(coding.get("key_bits") or coding["kv_bits"], coding["kv_bits"], group)
    return -(-geometry.beside_slot_bytes(window, center, model.dtype.itemsize) // coded)


def prefill_chunks(prompt_len: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, stop)`` chunks of at most ``chunk`` tokens, never a lone 1-token tail (a 1-token write
    into a growing cache over-allocates, which would break the bound above)."""
    bounds = []
    start = 0
    while start < prompt_len:
        stop = min(start + chunk, prompt_len)
        if prompt_len - stop == 1 and stop - start > 1:
            stop -= 1
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class Reservation:
    slots: int  # held while decoding
    prefill_peak: int  # held by its own cache at worst while prefilling alone
    shared_peak: int = 0  # its row's share of a prefill group's capacity at worst

    @property
    def prefill_extra(self) -> int:
        return max(0, self.prefill_peak - self.slots)

    @property
    def shared_extra(self) -> int:
        return max(0, self.shared_peak - self.slots)


def reservation(prompt_len: int, max_tokens: int, budget: int | None, chunk: int, window: int = 0) -> Reservation:
    """``budget``: heavy + recent slots, or None for policy ``full``; ``window``: slots' worth of
    bytes a sequence's float window holds beside its slots (held from its first call)."""
    total = prompt_len + max_tokens
    start, stop = prefill_chunks(prompt_len, chunk)[-1]
    held = prompt_len - (stop - start)  # at most, before any step of its prefill
    if budget is None:
        slots = total
        peak = prompt_len if prompt_len > 1 else GROWTH_MIN
        shared = held + chunk
    else:
        slots = min(budget + 1, total)
        peak = min(prompt_len, budget + chunk) if prompt_len > 1 else min(GROWTH_MIN, budget + 1)
        # a step whose rows all feed one token grows an empty cache by GROWTH_MIN (amortised growth)
        shared = min(held, budget) + chunk if prompt_len > 1 else max(chunk, min(GROWTH_MIN, budget + 1))
    return Reservation(slots + window, peak + window, max(peak, shared) + window)


def footprint_slots(batches: dict[str, list[Reservation]], prefilling: list[Reservation],
                    groups: dict[str, list[Reservation]] | None = None) -> int:
    """Slots the engine may hold: each policy batch at its widest row (``batches``: every request in
    flight), plus the prefill overshoot. ``groups`` None (serial schedule): one overshoot, the
    largest of ``prefilling``. Else (shared schedule): each policy's group of started prompts,
    ``rows * max(extra)``, plus the largest overshoot among ``prefilling`` (admitted, not started)."""
    decode = sum(len(rows) * max(r.slots for r in rows) for rows in batches.values() if rows)
    if groups is None:
        return decode + max((r.prefill_extra for r in prefilling), default=0)
    started = sum(len(rows) * max(r.shared_extra for r in rows) for rows in groups.values() if rows)
    return decode + started + max((r.shared_extra for r in prefilling), default=0)
