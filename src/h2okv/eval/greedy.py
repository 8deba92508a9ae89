"""Batched greedy decoding where every row stops on its own (EOS, a stop string or its length) and a
finished row stops costing compute: the cache drops it (``H2OCache.select_rows``) and the next
forward runs on the rows still going.

The prefill is ``generate``'s: left padding, positions counted over each row's real tokens, the
mask's diagonal marking pads (the core moves each row's real tokens first, so a row is read as if
alone). A decode step feeds one real token per row at its own position and no mask, as the server
does (``serve/batch.py``): each row's tokens equal its batch-of-one run for every policy (tested).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from h2okv.core.compat import cache_arg
from h2okv.generation import pad_rows

# a stop string is looked for in the decoded text of a row's last tokens only (it is short)
STOP_WINDOW = 16


@dataclass
class RowResult:
    token_ids: list[int]  # generated, without the EOS / stop string's tokens after the text
    finish: str  # "eos", "stop" or "length"
    kv_bytes: int  # the K/V this row's cache holds when it finishes (live slots, all layers)
    kv_slots: int  # the most live slots of any (layer, head) of this row when it finishes
    # kv_bytes were the unquantized slots 16-bit (quantized ones as they are): what a served cache
    # holds, where a CPU run's float32 would count float slots twice
    kv_bytes_16bit: int = 0


def row_kv(cache, row: int) -> tuple[int, int, int]:
    """``(bytes, most slots, bytes were float slots 16-bit)`` of live K/V of one row of ``cache``
    (an ``H2OCache``)."""
    total, most, total_16 = 0, 0, 0
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        heads = layer.live_slots()[row]  # [H]
        live = int(heads.sum())
        total += live * layer.bytes_per_slot()  # K and V of one head
        total_16 += live * layer.bytes_per_slot(float_itemsize=2)
        most = max(most, int(heads.max()))
    return total, most, total_16


def _keep_last(model) -> dict:
    # only the last position's logits are needed; older transformers lack the argument
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _stopped(tokens: list[int], stop: tuple[str, ...], decode) -> bool:
    return bool(stop) and any(s in decode(tokens[-STOP_WINDOW:]) for s in stop)


def greedy_rows(model, rows: list[list[int]], cache, max_new_tokens: int, eos_ids: set[int],
                stop: tuple[str, ...] = (), decode=None, pad_id: int = 0) -> list[RowResult]:
    """Greedy continuations of the prompts ``rows`` (token ids) in one batch through ``cache``.

    A row ends at a token of ``eos_ids`` (not kept), when the decoded text of its tokens contains
    one of ``stop`` (``decode`` turns ids into text; the caller cuts the text at the stop string),
    or after ``max_new_tokens``."""
    device = model.device
    ids, mask = pad_rows(rows, pad_id, device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    keep_last = _keep_last(model)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_arg(cache),
                       use_cache=True, **keep_last).logits[:, -1]
        active = list(range(len(rows)))  # batch row j is rows[active[j]]
        where = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
        out: list[list[int]] = [[] for _ in rows]
        results: dict[int, RowResult] = {}
        for _ in range(max_new_tokens):
            tokens = logits.argmax(-1)
            going = []
            for j, (row, token) in enumerate(zip(active, tokens.tolist(), strict=True)):
                finish = "eos" if token in eos_ids else None
                if finish is None:
                    out[row].append(token)
                    if _stopped(out[row], stop, decode):
                        finish = "stop"
                    elif len(out[row]) >= max_new_tokens:
                        finish = "length"
                if finish is None:
                    going.append(j)
                else:
                    results[row] = RowResult(out[row], finish, *row_kv(cache, j))
            if not going:
                break
            if len(going) < len(active):  # finished rows leave the batch: no more compute for them
                index = torch.tensor(going, dtype=torch.long, device=device)
                cache.select_rows(index)
                tokens, where = tokens.index_select(0, index), where.index_select(0, index)
                active = [active[j] for j in going]
            logits = model(input_ids=tokens[:, None], position_ids=where[:, None], **cache_arg(cache),
                           use_cache=True, **keep_last).logits[:, -1]
            where = where + 1
    return [results[row] for row in range(len(rows))]
