"""The engine's public data: what a client submits (``GenerationRequest``), what it gets back
(``Event``s on a ``Handle``), and what the engine reports (``EngineStats``, ``Observer``)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from h2okv.serve.errors import ServeError


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    policy: str
    heavy: int | None = None  # absolute slots, resolved from ratios by the caller; None for "full"
    recent: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stops: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k likeliest
    timeout: float | None = None  # seconds from submission; then it ends with finish_reason "timeout"
    # who may reuse this request's saved state (the prefix store): requests of another key never do
    cache_key: str | None = None
    # the budget as asked (a fraction resolves to other slot counts for a longer prompt): requests
    # asking alike share saved states; None: the slot counts themselves
    budget_label: str | None = None
    # the prompt's first tokens to store a state after (the prefix store): a chat's history before
    # its last user message, a shared document; None: none
    cache_prefix: int | None = None

    @property
    def budget(self) -> int | None:
        return None if self.heavy is None else self.heavy + self.recent


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this step, likeliest first


@dataclass
class Event:
    kind: str  # "text" | "done" | "error" | "cancelled"
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    error: ServeError | None = None
    token_ids: list[int] | None = None  # "done": every generated id (EOS included)
    logprobs: list[TokenLogprob] | None = None  # the tokens generated since the previous event

    @property
    def final(self) -> bool:
        return self.kind != "text"


class TextEnd:
    """A plain request's final ``event`` as the engine sends it (``Output.finish``): its text is
    still to come, on the reading side (``Handle``): the text of ``ids`` (the last token, when the
    generation ends on ``max_tokens``), then whatever the request's text stream held back."""

    __slots__ = ("event", "ids")
    final = True

    def __init__(self, event: Event, ids: tuple[int, ...] = ()):
        self.event, self.ids = event, ids


class TextSource(Protocol):
    """What a ``Handle`` turns a plain request's token ids into text with (``text.TextStream``
    without stop strings)."""

    def push_plain(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class Waker(Protocol):
    def wake(self) -> None: ...


class Handle:
    """The client side of one request: a stream of ``Event``s, and ``cancel()``.

    With an asyncio ``loop`` the events arrive on an ``asyncio.Queue`` (``await handle.next()``),
    else on a thread-safe queue (``handle.next_blocking()``). ``engine``: woken on ``cancel()``.

    The engine pushes ``Event``s, or, for a plain request (no stop strings, no logprobs: ``text``
    given), its token ids and a ``TextEnd``: their text is decoded here, on the side that takes them
    in (the event loop's thread, else the engine's at once), under ``text_lock``, in the order they
    came. The events that reach the queue are the same either way: a text event for each token
    whose text is settled, then the final one with the rest; what the engine saves is the decoding
    and the stop-free text checks, out of its step (``push_all``)."""

    def __init__(self, engine: Waker, loop: asyncio.AbstractEventLoop | None = None,
                 text: TextSource | None = None, text_lock: threading.Lock | None = None):
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue | queue.Queue = asyncio.Queue() if loop is not None else queue.Queue()
        self._text = text
        self._text_lock = text_lock if text_lock is not None else threading.Lock()
        self.cancelled = threading.Event()
        self.finished = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def push(self, item: Event | TextEnd | int) -> None:
        Handle.push_all([(self, item)])

    @staticmethod
    def push_all(pushes: list[tuple[Handle, Event | TextEnd | int]]) -> None:
        """``handle.push(item)`` for each pair, in order, with one wake-up per event loop: each
        ``call_soon_threadsafe`` writes to the loop's self-pipe (a system call, and the loop's thread
        then wakes to take the GIL), which, once per row, cost a step of 64 rows more than its forward
        (``tools/measure/engine_overhead.py``). A handle without a loop takes its items at once."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, item in pushes:
            if type(item) is not int and item.final:
                handle.finished.set()
            loop = handle._loop
            if loop is None:
                handle._take(item)
            elif loop in by_loop:
                by_loop[loop].append((handle, item))
            else:
                by_loop[loop] = [(handle, item)]
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_take_each, items)
            except RuntimeError:  # that client's event loop is gone (server shut down)
                pass

    @staticmethod
    def send(loop: asyncio.AbstractEventLoop, handles: tuple[Handle, ...], ids: list[int]) -> None:
        """``ids[i]``, a plain request's token, to ``handles[i]``, every one of which takes its items
        on ``loop`` and decodes under one ``text_lock`` (one engine's): one wake-up, and no pass
        over the rows nor an object per row (the engine's usual step; neither sequence may change
        afterwards)."""
        try:
            loop.call_soon_threadsafe(_take_ids, handles, ids)
        except RuntimeError:  # that client's event loop is gone (server shut down)
            pass

    def _take(self, item: Event | TextEnd | int) -> None:
        """Queue what ``item`` gives the client (nothing, for a token whose text is held back)."""
        if type(item) is int:
            with self._text_lock:
                piece = self._text.push_plain(item)
            if not piece:
                return
            item = Event("text", piece)
        elif type(item) is TextEnd:
            with self._text_lock:
                text = "".join([self._text.push_plain(token) for token in item.ids]) + self._text.flush()
            item.event.text = text + item.event.text
            item = item.event
        self._queue.put_nowait(item)

    async def next(self) -> Event:
        return await self._queue.get()

    def next_blocking(self, timeout: float | None = None) -> Event:
        return self._queue.get(timeout=timeout)

    def cancel(self) -> None:
        """Free this request's slots at the next step boundary (no-op once finished)."""
        if not self.finished.is_set():
            self.cancelled.set()
            self._engine.wake()

    def result_blocking(self, timeout: float = 60.0) -> tuple[str, Event]:
        """Collect the whole text and the final event (for callers without asyncio)."""
        parts = []
        deadline = time.monotonic() + timeout
        while True:
            event = self.next_blocking(timeout=max(0.0, deadline - time.monotonic()))
            parts.append(event.text)
            if event.final:
                return "".join(parts), event


def _take_each(items: list[tuple[Handle, Event | TextEnd | int]]) -> None:
    for handle, item in items:
        handle._take(item)


def _take_ids(handles: tuple[Handle, ...], ids: list[int]) -> None:
    """``Handle._take`` of each id, written out (a step's worth of rows, on the client's thread):
    the handles of one ``send`` share their lock, taken once."""
    if not handles:
        return
    with handles[0]._text_lock:
        for handle, token in zip(handles, ids, strict=True):
            piece = handle._text.push_plain(token)
            if piece:
                handle._queue.put_nowait(Event("text", piece))


STEP_WINDOW = 10_000  # the latest steps whose times outside the forward the percentiles are over


@dataclass
class StepTimes:
    """Where the engine's steps' time goes: each step's wall time (one iteration of its loop, from
    dropping cancelled requests to publishing these stats) and the part of it spent in the executor's
    forward calls (``prefill``, ``decode``). The rest, outside the forward, is the engine's own work
    per step: scheduling, sampling, detokenizing, stop checks, routing events."""

    steps: int = 0
    seconds: float = 0.0
    forward_seconds: float = 0.0
    outside: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))  # seconds, the latest steps'

    def add(self, seconds: float, forward_seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.forward_seconds += forward_seconds
        self.outside.append(seconds - forward_seconds)

    def summary(self) -> dict:
        """Totals (seconds), the share of step time outside the forward, and the time outside it per
        step in milliseconds: the mean over all steps, p50 and p99 over the latest ``STEP_WINDOW``."""
        latest = sorted(self.outside)  # sorted() copies the deque without letting the engine thread in
        outside = self.seconds - self.forward_seconds

        def ms(q: float) -> float | None:
            return round(1e3 * latest[min(len(latest) - 1, int(q * len(latest)))], 4) if latest else None

        return {"steps": self.steps, "step_s": round(self.seconds, 4), "forward_s": round(self.forward_seconds, 4),
                "outside_share": round(outside / self.seconds, 4) if self.seconds else None,
                "outside_ms_mean": round(1e3 * outside / self.steps, 4) if self.steps else None,
                "outside_ms_p50": ms(0.5), "outside_ms_p99": ms(0.99)}


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_bytes: int = 0
    kv_bytes_peak: int = 0
    full_kv_bytes: int = 0
    reserved_bytes: int = 0
    batch_size: int = 0
    batch_size_max: int = 0
    generated_tokens: int = 0
    evicted_tokens: int = 0
    draining: bool = False
    finished: dict = field(default_factory=lambda: {"completed": 0, "cancelled": 0, "failed": 0, "timeout": 0})
    # the prefix store (``prefix.py``): prompts that resumed a saved state, prompts that found none,
    # the states kept and their bytes
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_entries: int = 0
    prefix_bytes: int = 0
    steps: StepTimes = field(default_factory=StepTimes)  # the engine's step times, inside and outside the forward


class Observer:
    """Where the engine reports per-request latencies (``api/metrics.py`` turns them into
    histograms). Called on the engine thread: implementations must be cheap and thread-safe."""

    def queued(self, seconds: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...

    def inter_token_runs(self, runs: list[tuple[float, int]]) -> None:
        """A step's gaps between two tokens of a request, as ``(seconds, rows)``: the rows of a
        decode batch that stepped together share one gap."""
        for seconds, rows in runs:
            for _ in range(rows):
                self.inter_token(seconds)
