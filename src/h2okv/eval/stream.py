"""A long stream scored in pieces: perplexity per window of tokens, far past the context window.

``eval ppl --window-tokens W`` reads the text in forward calls of ``W`` tokens into ONE cache
with a fixed number of slots (``heavy = recent = slots / 2``) and per-token eviction
(``chunk_size=1``), so every prediction sees what Algorithm 1 keeps, as in ``eval ppl``'s single
call, while the work per call stays bounded (the per-token scan's logits span the call's keys, so
one call over 64k tokens would be quadratic). The first token of a piece is predicted from the
previous piece's last logits, so no prediction is lost. Per window: perplexity, tokens/s of the
scoring and KV bytes; ``on_window`` gets each as it completes (long runs write JSON as they go).

``full`` keeps everything; with true positions it stops where the text leaves the model's
context (positions past it were never trained), and a rolling cache is refused for it: with
every token kept, no position scheme keeps the distances inside the window.

``reference_ppl`` is the yardstick for a long stream's windows: each window read with full
attention after the ``context_tokens`` before it, from a fresh cache at positions 0.. (what the
model does at that point of the text with the most context it was trained for). Texts differ in
difficulty from window to window; a stream that keeps up shows the same ups and downs as this.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from h2okv.bench.memory import cache_kv_bytes
from h2okv.core.cache import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.eval.plots import new_figure, policy_color, save_figure
from h2okv.eval.scoring import token_nll
from h2okv.policies import policy_class


@dataclass
class StreamWindow:
    end: int  # tokens read after this window
    ppl: float
    tokens_per_s: float  # per wall second
    kv_bytes: int
    # per second of this process's CPU time: the cost of the work itself, which stays comparable
    # across windows when other jobs share the machine (wall time does not)
    cpu_tokens_per_s: float


class Clock:
    """Wall and CPU seconds of one window's scoring, and the window built from them."""

    def __init__(self):
        self.began, self.began_cpu = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self.began
        self.cpu_seconds = time.process_time() - self.began_cpu

    def window(self, start: int, stop: int, nll: torch.Tensor, kv_bytes: int) -> StreamWindow:
        tokens = stop - start
        return StreamWindow(stop, math.exp(float(nll.double().mean())), round(tokens / self.seconds, 2), kv_bytes,
                            round(tokens / max(self.cpu_seconds, 1e-9), 2))


@dataclass
class StreamRun:
    policy: str
    slots: int | None
    positions: str
    tokens: int  # tokens asked for
    window_tokens: int
    windows: list[StreamWindow] = field(default_factory=list)
    stopped: str | None = None  # why the run ended before ``tokens`` (full: the context)

    def as_dict(self) -> dict:
        return asdict(self)


def stream_cache(model, policy: str, slots: int | None, positions: str, seed: int = 0) -> H2OCache:
    if not policy_class(policy).evicts:
        return H2OCache(model, policy=policy, positions=positions, seed=seed)
    half = slots // 2
    return H2OCache(model, policy=policy, heavy=slots - half, recent=half, chunk_size=1, positions=positions, seed=seed)


def stream_ppl(model, ids: torch.Tensor, policy: str, slots: int | None, positions: str = "true",
               window_tokens: int = 2048, seed: int = 0, on_window=None) -> StreamRun:
    """Score ``ids`` ``[N]`` in pieces of ``window_tokens``; see the module docstring."""
    total = int(ids.shape[-1])
    if not policy_class(policy).evicts and positions != "true":
        raise H2OError(f"{policy!r} keeps every token, so no position scheme keeps its distances inside the window")
    run = StreamRun(policy, slots, positions, total, window_tokens)
    context = model.config.get_text_config().max_position_embeddings
    cache = stream_cache(model, policy, slots, positions, seed)
    ids = ids.reshape(1, -1).to(model.device)
    last = None  # the previous piece's last logits: they predict this piece's first token
    with torch.inference_mode():
        for start in range(0, total, window_tokens):
            stop = min(start + window_tokens, total)
            if not policy_class(policy).evicts and positions == "true" and stop > context:
                run.stopped = f"the text leaves the model's context of {context} positions"
                break
            piece = ids[:, start:stop]
            clock = Clock()
            logits = model(piece, **cache_arg(cache), use_cache=True).logits
            clock.stop()
            nll = token_nll(logits, piece)
            if last is not None:
                first = torch.nn.functional.cross_entropy(last.float(), piece[:, 0], reduction="none")
                nll = torch.cat([first[:, None], nll], dim=1)
            last = logits[:, -1]
            run.windows.append(clock.window(start, stop, nll, cache.stats()["kv_bytes"]))
            if on_window is not None:
                on_window(run)
    return run


def reference_ppl(model, ids: torch.Tensor, context_tokens: int, window_tokens: int = 2048,
                  on_window=None) -> StreamRun:
    """Each window of ``ids`` scored with full attention over it and the ``context_tokens`` before
    it (fresh per window, read in calls of ``window_tokens``), see the module docstring."""
    limit = model.config.get_text_config().max_position_embeddings
    if context_tokens + window_tokens > limit:
        raise H2OError(f"--reference-context {context_tokens} + --window-tokens {window_tokens} exceed the model's "
                       f"context of {limit} positions")
    total = int(ids.shape[-1])
    run = StreamRun("full", None, f"sliding:{context_tokens}", total, window_tokens)
    ids = ids.reshape(1, -1).to(model.device)
    with torch.inference_mode():
        for start in range(0, total, window_tokens):
            stop, lo = min(start + window_tokens, total), max(0, start - context_tokens)
            clock = Clock()
            nll, kv_bytes = window_losses(model, ids, lo, start, stop, window_tokens)
            clock.stop()
            run.windows.append(clock.window(start, stop, nll, kv_bytes))
            if on_window is not None:
                on_window(run)
    return run


def window_losses(model, ids: torch.Tensor, lo: int, start: int, stop: int, call_tokens: int) -> torch.Tensor:
    """``(losses, KV bytes)``: the losses of tokens ``start..stop-1`` (token 0 has none) after reading
    ``ids[lo:stop]`` with full attention from a fresh cache, in calls of ``call_tokens`` (only the
    window's logits are kept), and the bytes that cache holds at the end."""
    cache, losses, previous = DynamicCache(config=model.config), [], None
    for at in range(lo, stop, call_tokens):
        end = min(at + call_tokens, stop)
        logits = model(ids[:, at:end], **cache_arg(cache), use_cache=True).logits[0].float()
        if end > start:
            first = max(at, start, 1)  # the first token this call predicts inside the window
            if first == at:  # the call's first token: predicted by the previous call's last logits
                losses.append(torch.nn.functional.cross_entropy(previous[None], ids[0, at:at + 1], reduction="none"))
                first += 1
            losses.append(torch.nn.functional.cross_entropy(logits[first - 1 - at:end - 1 - at], ids[0, first:end],
                                                            reduction="none"))
        previous = logits[-1]
    return torch.cat(losses), cache_kv_bytes(cache)


def plot_stream(runs: list[dict], path, title: str, context: int | None = None):
    """Perplexity per window vs tokens read, a line per (policy, slots, positions), log y. With a
    yardstick run (``reference_ppl``) a second panel shows each run's ratio to it, window by window:
    the text's own ups and downs cancel there, and what is left is the cache's cost."""
    reference = next((r for r in runs if r["positions"].startswith("sliding") and r["windows"]), None)
    fig, axes = new_figure(nrows=2 if reference else 1, width=7.5, height=4.6 if not reference else 3.6,
                           sharex=True)
    ax = axes[0][0]
    for run in runs:
        if run["windows"]:
            ax.plot(*_series(run, lambda w: w["ppl"]), **_style(run))
    ax.set_yscale("log")
    ax.set_ylabel("perplexity per window")
    ax.legend(fontsize=7, ncol=2)
    if reference:
        by_end = {w["end"]: w["ppl"] for w in reference["windows"]}
        ratio_ax = axes[1][0]
        for run in runs:
            if run is reference or not any(w["end"] in by_end for w in run["windows"]):
                continue
            inside = {**run, "windows": [w for w in run["windows"] if w["end"] in by_end]}
            ratio_ax.plot(*_series(inside, lambda w: w["ppl"] / by_end[w["end"]]), **_style(run))
        ratio_ax.axhline(1.0, color="black", linewidth=0.8)
        ratio_ax.set_ylim(0.9, 1.6)  # true positions leave the panel: the first panel shows them
        ratio_ax.set_ylabel(f"ratio to full attention\n({reference['positions']})")
    for row in axes:
        row[0].grid(True, alpha=0.3, which="both")
        if context:
            row[0].axvline(context / 1000, color="grey", linewidth=0.8)
    axes[-1][0].set_xlabel("tokens read (thousands); each point: the window ending there")
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def _series(run: dict, value) -> tuple[list[float], list[float]]:
    return [w["end"] / 1000 for w in run["windows"]], [value(w) for w in run["windows"]]


def _style(run: dict) -> dict:
    """Colour by policy, line by position scheme (sliding: the yardstick), marker by budget."""
    styles = {"true": ":", "rolling": "-", "rolling:shift": "-", "rolling:order": "--"}
    slots = "all" if run["slots"] is None else run["slots"]
    return {"linestyle": styles.get(run["positions"], "-."), "color": policy_color(run["policy"]),
            "marker": "." if (run["slots"] or 0) <= 512 else "x", "markersize": 4,
            "label": f"{run['policy']} {slots} {run['positions']}"}
