"""kvpress's ``DecodingPress`` on the problems exported by ``h2okv eval reasoning --export-prompts``.

``run_kvpress.py`` hands a reasoning export (format ``h2okv-reasoning-prompts/1``) to this module.
Like it, this runs in the peer's venv and imports no h2okv. For every scorer and slot budget, each
problem is decoded alone (kvpress compresses one sequence at a time), greedily, from the exported
prompt ids, until one of the exported EOS ids (not kept), a stop string, or ``max_new_tokens``:
what ``h2okv.eval.greedy.greedy_rows`` does for one row.

How the budget maps. h2okv's integer budget is the number of KV slots per layer and KV head, all
kinds of slot included (h2o: half heavy hitters, half recent; no sinks). ``DecodingPress`` keeps
``target_size`` tokens per layer, and its ``ScorerPress`` keeps that many positions in every KV
head (each head its own top scores): so ``target_size`` = our budget, with no sinks added. With
``compression_interval`` = 1 (the default here) the press compresses after every decode step, so
each step attends to at most ``budget + 1`` entries (the budget and the new token) as h2okv's cache
does; an interval N lets the cache grow to ``budget + N`` between compressions (a policy name
``...-every<N>``). ``DecodingPress`` leaves the prefill alone: a prompt longer than the budget is
cut to it at the first decode step (h2okv evicts it while reading the prompt).

Rows have the shape of ``eval reasoning``'s (``keep_text``) with ``predicted`` and ``correct``
null: ``h2okv eval reasoning-report`` grades them with h2okv's own ``answers.py`` (it needs
lm-eval, which this venv lacks). Each problem is one entry of ``batches`` (one sequence at a time).
The ``--json`` piece is rewritten after every problem; problems already in it are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

EXPORT_FORMAT = "h2okv-reasoning-prompts/1"
PIECE_FORMAT = "h2okv-reasoning/1"
# scorers DecodingPress can wrap here (a ScorerPress that scores from the keys or from the newest
# query alone: SnapKV needs a window of buffered queries longer than one compression interval)
# ("full": no press, once, no budget; the peer's own decoding checked against h2okv's full)
SCORERS = ["full", "knorm", "tova", "expected"]


def make_decoding_press(scorer: str, target_size: int | None, interval: int):
    if scorer == "full":
        return None
    import kvpress

    base = {"knorm": kvpress.KnormPress, "tova": kvpress.TOVAPress,
            "expected": kvpress.ExpectedAttentionPress}.get(scorer)
    if base is None:
        raise SystemExit(f"run_kvpress: unknown decoding scorer {scorer!r}; known: {', '.join(SCORERS)}")
    return kvpress.DecodingPress(base_press=base(), compression_interval=interval, target_size=target_size)


def policy_name(scorer: str, interval: int) -> str:
    if scorer == "full":
        return "kvpress-full"
    return f"kvpress-decoding-{scorer}" + ("" if interval == 1 else f"-every{interval}")


def cache_kv(cache) -> tuple[int, int, int, int]:
    """``(bytes, most slots, bytes in 16 bits, one token's bytes in a full 16-bit cache)`` of a
    DynamicCache: K and V of every layer (as ``greedy.row_kv`` and ``eval reasoning``'s rows)."""
    total, most, total_16, token_16 = 0, 0, 0, 0
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        total += 2 * keys.numel() * keys.element_size()
        total_16 += 2 * keys.numel() * 2
        token_16 += 2 * keys.shape[1] * keys.shape[-1] * 2
        most = max(most, keys.shape[-2])
    return total, most, total_16, token_16


def cut_at_stop(text: str, stop: list[str]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def decode_problem(model, tokenizer, press, problem: dict, max_new_tokens: int, eos_ids: set[int]) -> dict:
    """Greedy answer of one problem under ``press`` (None: no compression), with explicit
    positions (the compressed cache holds fewer entries than the tokens read)."""
    from transformers import DynamicCache

    cache, prompt, stop = DynamicCache(), problem["prompt_ids"], problem["stop"]
    with torch.inference_mode(), (press(model) if press is not None else contextlib.nullcontext()):
        logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, logits_to_keep=1).logits[0, -1]
        tokens, finish = greedy_tokens(
            logits, lambda token, step: model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                                              position_ids=torch.tensor([[len(prompt) + step]])).logits[0, -1],
            tokenizer, stop, max_new_tokens, eos_ids)
    kv_bytes, kv_slots, kv_bytes_16bit, token_16 = cache_kv(cache)
    full_16 = token_16 * (len(prompt) + len(tokens))  # a full 16-bit cache of the final length
    return {"token_ids": tokens, "finish": finish, "kv_bytes": kv_bytes, "kv_slots": kv_slots,
            "kv_bytes_16bit": kv_bytes_16bit, "kv_share_16bit": round(kv_bytes_16bit / full_16, 4) if full_16 else None,
            "text": cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop)}


def greedy_tokens(logits, next_logits, tokenizer, stop, max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], str]:
    """Greedy tokens from the prompt's last ``logits`` on: ``next_logits(token, step)`` feeds one
    token; ends at an EOS (not kept), a stop string, or ``max_new_tokens``. Both peers' loop
    (kvpress here, keys_values in run_keys_values.py), so they end exactly as h2okv does."""
    tokens = []
    for step in range(max_new_tokens):
        token = int(logits.argmax())
        if token in eos_ids:
            return tokens, "eos"
        tokens.append(token)
        if stop and any(s in tokenizer.decode(tokens, skip_special_tokens=True) for s in stop):
            return tokens, "stop"
        if len(tokens) >= max_new_tokens:
            break
        logits = next_logits(token, step)
    return tokens, "length"


def reasoning_row(setup: dict, problem: dict, result: dict, policy: str, budget: int) -> dict:
    """One row of ``eval reasoning``'s piece, ungraded (``reasoning_report.graded`` grades it)."""
    return {**setup, "policy": policy, "budget": budget, "id": problem["id"], "prompt_tokens": len(problem["prompt_ids"]),
            "new_tokens": len(result["token_ids"]), "finish": result["finish"], "predicted": None,
            "gold": problem["gold"], "correct": None, "kv_bytes": result["kv_bytes"], "kv_slots": result["kv_slots"],
            # a peer that cannot count its cache in 16 bits (OpenVINO's runtime holds its own) says None
            "kv_bytes_16bit": result.get("kv_bytes_16bit"), "kv_share_16bit": result.get("kv_share_16bit"),
            "text": result["text"],
            # what ran, as our rows record their CacheSettings: the peer's configuration by its label
            "settings": {"policy": policy, "budget": budget}}


def read_piece(out: str | None, setup: dict) -> dict:
    if out and Path(out).is_file():
        piece = json.loads(Path(out).read_text())
        if piece.get("format") != PIECE_FORMAT or piece.get("setup") != setup:
            raise SystemExit(f"run_kvpress: {out} is not a piece of this export's setup {setup}; use another --json")
        return piece
    return {"format": PIECE_FORMAT, "setup": setup, "rows": [], "batches": [], "peer": {}}


def check_budgets(budgets) -> list[int]:
    if bad := [b for b in budgets if not isinstance(b, int) or isinstance(b, bool) or b < 1]:
        raise SystemExit(f"run_kvpress: DecodingPress keeps a number of tokens; budgets {bad} are not slot counts")
    return list(budgets)


def run_reasoning(exported: dict, scorers: list[str], budgets: list[int], interval: int, load, models: dict,
                  out: str | None = None) -> dict:
    """Every scorer x budget on every problem of the export; returns the piece (written to ``out``
    after every problem, whose rows are kept and skipped on a second run)."""
    setup = {**exported["setup"], "batch_size": 1}  # one sequence at a time
    piece = read_piece(out, setup)
    done = {(r["policy"], r["budget"], r["id"]) for r in piece["rows"]}
    eos = set(exported["eos_ids"])
    for scorer in scorers:
        policy = policy_name(scorer, interval)
        for budget in ([None] if scorer == "full" else check_budgets(budgets)):
            todo = [p for p in exported["problems"] if (policy, budget, p["id"]) not in done]
            if not todo:
                continue
            if "sdpa" not in models:
                models["sdpa"] = load(exported["model_path"], "sdpa")
            model, tokenizer = models["sdpa"]
            press = make_decoding_press(scorer, budget, interval)
            piece["peer"][policy] = "no press" if press is None else (
                f"DecodingPress({type(press.base_press).__name__}(), compression_interval={interval}, "
                "target_size=<budget>)")
            for problem in todo:
                start, cpu_start = time.perf_counter(), time.process_time()
                result = decode_problem(model, tokenizer, press, problem, setup["max_new_tokens"], eos)
                row = reasoning_row(setup, problem, result, policy, budget)
                piece["rows"].append(row)
                piece["batches"].append({
                    "policy": policy, "budget": budget, "rows": 1, "new_tokens": row["new_tokens"],
                    "seconds": round(time.perf_counter() - start, 3),
                    "cpu_seconds": round(time.process_time() - cpu_start, 3),
                    "load_avg_1m": round(os.getloadavg()[0], 2)})
                if out:
                    Path(out).parent.mkdir(parents=True, exist_ok=True)
                    Path(out).write_text(json.dumps(piece, indent=1) + "\n")
                print(f"{policy} @ {budget}: problem {problem['id']}, {row['new_tokens']} tokens, {row['finish']}, "
                      f"{piece['batches'][-1]['seconds']:.0f} s", flush=True)
    return piece
