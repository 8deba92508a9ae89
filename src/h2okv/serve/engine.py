"""The continuous-batching engine: one background thread owns the model and runs, per iteration,

1. drop cancelled requests and end the ones past their deadline (their slots are free from this
   step on);
2. admit waiting requests, in arrival order, while their KV reservation fits under ``kv_memory``
   (see ``memory.py``) and the batch has room;
3. prefill, in chunks of at most ``prefill_chunk`` tokens. With ``schedule="budget"`` (the default)
   the prompts share forwards: every prompt part-way through feeds its next chunk, and the oldest
   prompts not started yet join while the padded size (per policy, rows x longest chunk) stays
   within what is left of ``step_tokens``; all chunks of one policy run in ONE forward
   (``executor.py``); rounds of such forwards run until the step's budget is spent. A long prompt
   thus costs each forward one chunk, not its whole length: the prompts behind it start beside it.
   ``schedule="serial"`` runs one chunk of the oldest prompt per step, alone (the original
   behaviour, kept to compare). A finished prefill samples the first token and joins the decode
   batch of its policy (``batch.py``);
4. one decode step for every decode batch: each row feeds its last token at its own position. A
   decode row therefore waits at most one step's prefill budget between two tokens.

The engine never runs the model nor touches a cache itself: it calls its ``Executor``
(``executor.py``) with plain data (token ids, positions, integer sequence ids), so the same calls
replayed elsewhere rebuild the same caches.

Each sequence keeps its own budget, policy settings and positions. Sequences with the same policy
decode in one forward; different policies are different batches (the cache holds one policy).
An exception in one request's work fails that request; a failing batch forward fails that batch's
requests; the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from h2okv.serve.executor import Executor
from h2okv.serve.memory import Reservation, footprint_slots, prefill_chunks, reservation
from h2okv.serve.sampling import make_generator, sample
from h2okv.serve.schemas import APIError
from h2okv.serve.text import TextStream

log = logging.getLogger("h2okv.serve")


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
    error: APIError | None = None
    token_ids: list[int] | None = None  # "done": every generated id (EOS included)
    logprobs: list[TokenLogprob] | None = None  # the tokens generated since the previous event

    @property
    def final(self) -> bool:
        return self.kind != "text"


class Handle:
    """The client side of one request: a stream of ``Event``s, and ``cancel()``.

    With an asyncio ``loop`` the events arrive on an ``asyncio.Queue`` (``await handle.next()``),
    else on a thread-safe queue (``handle.next_blocking()``)."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop | None = None):
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue | queue.Queue = asyncio.Queue() if loop is not None else queue.Queue()
        self.cancelled = threading.Event()
        self.finished = threading.Event()

    def push(self, event: Event) -> None:
        if event.final:
            self.finished.set()
        if self._loop is None:
            self._queue.put(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the client's event loop is gone (server shut down)
            pass

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


class Sequence:
    def __init__(self, request: GenerationRequest, handle: Handle, reservation: Reservation, engine: Engine):
        self.request = request
        self.handle = handle
        self.reservation = reservation
        self.generated: list[int] = []
        self.chunks = prefill_chunks(len(request.prompt_ids), engine.prefill_chunk)
        self.next_chunk = 0
        self.uid = next(engine.uids)  # the executor's name for this sequence
        self.generator = make_generator(request.seed, engine.device)
        self.text = TextStream(engine.decode, request.stops)
        self.done = False
        self.submitted = time.monotonic()
        self.deadline = None if request.timeout is None else self.submitted + request.timeout
        self.last_token_at: float | None = None
        self.logprobs: list[TokenLogprob] = []  # not yet handed out
        self.evicted_counted = 0  # tokens evicted so far, as already added to the engine's counter

    @property
    def tokens_fed(self) -> int:
        if self.generated:
            return len(self.request.prompt_ids) + len(self.generated) - 1
        return self.chunks[self.next_chunk - 1][1] if self.next_chunk else 0


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


class Observer:
    """Where the engine reports per-request latencies (``metrics.py`` turns them into histograms).
    Called on the engine thread: implementations must be cheap and thread-safe."""

    def queued(self, seconds: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...


SCHEDULES = ("budget", "serial")


class Engine:
    def __init__(self, model, tokenizer, *, kv_memory: int | None = None, max_batch: int = 32,
                 max_queue: int = 256, prefill_chunk: int = 128, schedule: str = "budget",
                 step_tokens: int = 512, observer: Observer | None = None, executor=None):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1 or step_tokens < 1:
            raise ValueError("max_batch, prefill_chunk and step_tokens must be >= 1, max_queue >= 0")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.schedule = schedule
        self.step_tokens = step_tokens
        self.observer = observer or Observer()
        # every model run and cache change goes through the executor (plain-data calls, see executor.py);
        # ``serve --tp`` passes one that also sends each call to the other ranks (tp.py)
        self.executor = executor if executor is not None else Executor(model, prefill_chunk)
        self.tokenizer = tokenizer
        self.device = model.device
        self.kv_memory = kv_memory
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.slot_bytes = self.executor.slot_bytes()
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self.eos_ids = _eos_ids(model, tokenizer)
        self.uids = itertools.count()
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._prefilling: list[Sequence] = []
        self._batches: dict[str, list[Sequence]] = {}  # policy -> its decode rows, as the executor's
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._busy = False
        self.stats = EngineStats()
        self.queue_times: deque[float] = deque(maxlen=10_000)  # seconds waited by the latest admissions

    # -- client side (any thread) ----------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def reservation(self, request: GenerationRequest) -> Reservation:
        return reservation(len(request.prompt_ids), request.max_tokens, request.budget, self.prefill_chunk)

    def check_fits(self, request: GenerationRequest) -> None:
        """Raise a 400 ``APIError`` for a request that could never fit under ``kv_memory``."""
        res = self.reservation(request)
        extra = res.prefill_extra if self.schedule == "serial" else res.shared_extra
        need = (res.slots + extra) * self.slot_bytes
        if self.kv_memory is not None and need > self.kv_memory:
            raise APIError(
                400, f"this request needs {need} bytes of KV cache ({res.slots} slots per layer/head), more than "
                f"the server's --kv-memory {self.kv_memory}; lower max_tokens or use an evicting policy",
                param="max_tokens", code="kv_memory_exceeded",
            )

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> Handle:
        """Queue a request; raises ``APIError`` (400 never fits, 429 queue full, 503 not running or
        draining)."""
        self.check_fits(request)
        return self.submit_many([request], loop)[0]

    def submit_many(self, requests: list[GenerationRequest], loop: asyncio.AbstractEventLoop | None = None,
                    ) -> list[Handle]:
        """Queue several requests (the ``n`` choices of one API call) all or none."""
        for request in requests:
            self.check_fits(request)
        seqs = []
        for request in requests:
            seqs.append(Sequence(request, Handle(self, loop), self.reservation(request), self))
        with self._cond:
            if self._draining:
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if self._stopping or self._thread is None:
                raise APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
            if len(self._waiting) + len(seqs) > self.max_queue:
                raise APIError(429, f"server busy: {len(self._waiting)} requests already waiting (--max-queue)",
                               type="rate_limit_error", code="queue_full")
            self._waiting.extend(seqs)
            self.stats.waiting = len(self._waiting)
            self._cond.notify()
        return [seq.handle for seq in seqs]

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="h2okv-engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Stop admitting: new submissions get 503; what was submitted runs to its end."""
        with self._cond:
            self._draining = True
            self.stats.draining = True

    def idle(self) -> bool:
        """Nothing waiting or running (published at the end of each engine iteration)."""
        with self._cond:
            waiting = len(self._waiting)
        return waiting == 0 and self.stats.running == 0 and not self._busy

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    if self._stopping:
                        break
                    if not (self._waiting or self._prefilling or any(self._batches.values())):
                        self._cond.wait(timeout=0.5)
                        continue
                self._busy = True
                try:
                    self._iteration()
                except Exception:  # a bug in the bookkeeping: fail what is running, keep serving
                    log.exception("engine iteration failed")
                    for seq in self._active():
                        self._fail(seq, "internal error in the engine")
                    self._prefilling, self._batches = [], {}
                    self.executor.reset()
                self._publish()
                self._busy = False
            self._shutdown()

    def _iteration(self) -> None:
        self._drop_cancelled()
        self._end_expired()
        self._admit()
        if self._prefilling:
            self._prefill_step()
        decoded = 0
        for policy, rows in list(self._batches.items()):
            if rows:
                decoded += len(rows)
                self._decode_step(policy)
        self.stats.batch_size = decoded
        self.stats.batch_size_max = max(self.stats.batch_size_max, decoded)

    def _decoding(self, seq: Sequence) -> bool:
        return any(s is seq for s in self._batches.get(seq.request.policy, ()))

    def _active(self) -> list[Sequence]:
        return self._prefilling + [s for rows in self._batches.values() for s in rows]

    def _drop_cancelled(self) -> None:
        with self._cond:
            for seq in [s for s in self._waiting if s.handle.cancelled.is_set()]:
                self._waiting.remove(seq)
                self._finish(seq, Event("cancelled"), "cancelled")
        for seq in [s for s in self._prefilling if s.handle.cancelled.is_set()]:
            self._prefilling.remove(seq)
            self._finish(seq, Event("cancelled"), "cancelled")
        for policy, rows in list(self._batches.items()):
            for seq in rows:
                if seq.handle.cancelled.is_set():
                    self._finish(seq, Event("cancelled"), "cancelled")
            self._compact(policy)

    def _prefill_step(self) -> None:
        """Serial: one chunk of the oldest prompt. Budget: rounds of shared forwards (one per policy
        per round, see ``_prefill_plan``) until ``step_tokens`` prompt tokens, pads included, are
        spent; the first round always runs. Several rounds a step matter when ``kv_memory`` lets only
        a few prompts prefill at once: those then advance several chunks per step."""
        if self.schedule == "serial":
            self._prefill_forward([self._prefilling[0]])
            return
        spent = 0
        while self._prefilling and spent < self.step_tokens:
            forwards = self._prefill_plan(self.step_tokens - spent, first=spent == 0)
            if not forwards:
                return
            spent += sum(_padded_tokens(seqs) for seqs in forwards)
            for seqs in forwards:
                self._prefill_forward(seqs)

    def _prefill_plan(self, room: int, first: bool) -> list[list[Sequence]]:
        """One round of prefill forwards: lists of sequences, one list per forward (one policy each).

        Every started prompt (the executor needs all of a group's rows in each of its forwards; when
        they started their padded size fitted the budget, and a started prompt's later chunks are
        never longer than its first), then the oldest prompts not started yet, while the padded size
        stays within ``room`` and the KV footprint with them started within ``kv_memory``. Empty if
        the started ones alone exceed ``room`` (except in a step's ``first`` round)."""
        chosen = [s for s in self._prefilling if s.next_chunk > 0]
        if chosen and not first and _padded_tokens(chosen) > room:
            return []
        for seq in self._prefilling:
            if seq.next_chunk > 0:
                continue
            if chosen and _padded_tokens(chosen + [seq]) > room:
                break
            # no reserve for the prompts after it: they start once the groups drain (see memory.py)
            if (self.kv_memory is not None
                    and self._footprint(started=chosen + [seq], reserve=False) * self.slot_bytes > self.kv_memory):
                break
            chosen.append(seq)
        forwards: dict[str, list[Sequence]] = {}
        for seq in chosen:
            forwards.setdefault(seq.request.policy, []).append(seq)
        return list(forwards.values())

    def _end_expired(self) -> None:
        """Requests past their deadline end now, with what they generated so far."""
        now = time.monotonic()
        with self._cond:
            expired = [s for s in self._waiting if s.deadline is not None and now > s.deadline]
            for seq in expired:
                self._waiting.remove(seq)
        expired += [s for s in self._active() if s.deadline is not None and now > s.deadline]
        for seq in expired:
            if seq in self._prefilling:
                self._prefilling.remove(seq)
            self._complete(seq, seq.text.flush(), "timeout", outcome="timeout")
        if expired:
            for policy in list(self._batches):
                self._compact(policy)

    def _admit(self) -> None:
        with self._cond:
            while self._waiting:
                seq = self._waiting[0]
                if len(self._active()) >= self.max_batch or not self._fits(seq):
                    break
                self._waiting.popleft()
                self._prefilling.append(seq)
                waited = time.monotonic() - seq.submitted
                self.queue_times.append(waited)
                self.observer.queued(waited)

    def _fits(self, candidate: Sequence) -> bool:
        if self.kv_memory is None:
            return True
        return self._footprint([candidate]) * self.slot_bytes <= self.kv_memory

    def _footprint(self, extra: list[Sequence] = (), started: list[Sequence] | None = None,
                   reserve: bool = True) -> int:
        """Slots held at worst (``memory.py``) with ``extra`` admitted and, for the shared schedule,
        ``started`` (default: the prompts part-way through) in the prefill groups; ``reserve``: plus
        the largest overshoot of the prompts not started (what admission keeps free so that the
        oldest of them can start once the groups drain)."""
        rows: dict[str, list[Reservation]] = {}
        prefilling = self._prefilling + list(extra)
        for seq in self._active() + list(extra):
            rows.setdefault(seq.request.policy, []).append(seq.reservation)
        if self.schedule == "serial":
            return footprint_slots(rows, [s.reservation for s in prefilling])
        if started is None:
            started = [s for s in self._prefilling if s.next_chunk > 0]
        groups: dict[str, list[Reservation]] = {}
        for seq in started:
            groups.setdefault(seq.request.policy, []).append(seq.reservation)
        ids = {id(s) for s in started}
        unstarted = [s.reservation for s in prefilling if id(s) not in ids] if reserve else []
        return footprint_slots(rows, unstarted, groups)

    def _prefill_forward(self, seqs: list[Sequence]) -> None:
        """One forward: the next chunk of each of ``seqs`` (one policy). Prompts that end here
        sample their first token and join their policy's decode batch."""
        parts = []
        try:
            for seq in seqs:
                req = seq.request
                if seq.next_chunk == 0:
                    self.executor.open(seq.uid, req.policy, req.heavy, req.recent, req.seed or 0)
                start, stop = seq.chunks[seq.next_chunk]
                parts.append((seq.uid, req.prompt_ids[start:stop], start))
            logits = self.executor.prefill(parts)
        except Exception as exc:  # these requests' failure (the shared forward's), not the engine's
            log.exception("prefill failed")
            for seq in seqs:
                self._prefilling.remove(seq)
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
            return
        for seq in seqs:
            seq.next_chunk += 1
            if seq.next_chunk < len(seq.chunks):
                continue
            self._prefilling.remove(seq)
            try:
                self._advance(seq, logits[seq.uid])
            except Exception as exc:
                log.exception("token step failed")
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
            if not seq.done:
                self.executor.join(seq.uid, seq.reservation.slots)
                self._batches.setdefault(seq.request.policy, []).append(seq)

    def _decode_step(self, policy: str) -> None:
        rows = list(self._batches[policy])
        try:
            logits = self.executor.decode(policy, [s.uid for s in rows], [s.generated[-1] for s in rows],
                                          [s.tokens_fed for s in rows])
        except Exception as exc:
            log.exception("decode step failed")
            for seq in rows:
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
            self._compact(policy)
            return
        for i, seq in enumerate(rows):
            try:
                self._advance(seq, logits[i])
            except Exception as exc:
                log.exception("token step failed")
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
        self._compact(policy)

    def _compact(self, policy: str) -> None:
        rows = self._batches.get(policy, [])
        keep = [s for s in rows if not s.done]
        if len(keep) == len(rows):
            return
        self.executor.keep(policy, [s.uid for s in keep], max((s.reservation.slots for s in keep), default=0))
        if keep:
            self._batches[policy] = keep
        else:
            del self._batches[policy]

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Choose the next token of ``seq`` and tell its client."""
        req = seq.request
        token = sample(logits, req.temperature, req.top_p, seq.generator)
        seq.generated.append(token)
        self.stats.generated_tokens += 1
        now = time.monotonic()
        if seq.last_token_at is None:
            self.observer.first_token(now - seq.submitted)
        else:
            self.observer.inter_token(now - seq.last_token_at)
        seq.last_token_at = now
        if req.top_logprobs is not None:
            seq.logprobs.append(_logprob_of(logits, token, req.top_logprobs))
        if token in self.eos_ids and not req.ignore_eos:
            self._complete(seq, seq.text.flush(), "stop")
            return
        piece, stopped = seq.text.push(token)
        if stopped:
            self._complete(seq, piece, "stop")
        elif len(seq.generated) >= req.max_tokens:
            self._complete(seq, piece + seq.text.flush(), "length")
        elif piece:
            seq.handle.push(Event("text", piece, logprobs=_take(seq)))

    def _complete(self, seq: Sequence, text: str, reason: str, outcome: str = "completed") -> None:
        prompt = len(seq.request.prompt_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": len(seq.generated),
                 "total_tokens": prompt + len(seq.generated)}
        done = Event("done", text, finish_reason=reason, usage=usage, token_ids=list(seq.generated),
                     logprobs=_take(seq))
        self._finish(seq, done, outcome)

    def _fail(self, seq: Sequence, message: str, status: int = 500) -> None:
        error = APIError(status, message, type="server_error" if status >= 500 else "invalid_request_error")
        self._finish(seq, Event("error", error=error), "failed")

    def _finish(self, seq: Sequence, event: Event, outcome: str) -> None:
        if seq.done:
            return
        seq.done = True
        if not self._decoding(seq):  # a decode row is dropped by _compact, with the rest of its batch
            self.executor.close(seq.uid)
        self.stats.finished[outcome] += 1
        seq.handle.push(event)

    def _publish(self) -> None:
        active = self._active()
        kv = self.executor.kv_bytes()
        s = self.stats
        s.running = len(active)
        with self._cond:
            s.waiting = len(self._waiting)
        s.kv_bytes = kv
        s.kv_bytes_peak = max(s.kv_bytes_peak, kv)
        for seq in active:  # an evicting cache holds its budget; every token fed beyond it was evicted
            budget = seq.request.budget
            evicted = 0 if budget is None else max(0, seq.tokens_fed - budget)
            s.evicted_tokens += evicted - seq.evicted_counted
            seq.evicted_counted = evicted
        s.full_kv_bytes = sum(seq.tokens_fed for seq in active) * self.slot_bytes
        s.reserved_bytes = self._footprint() * self.slot_bytes if active else 0

    def _shutdown(self) -> None:
        with self._cond:
            pending = list(self._waiting) + self._active()
            self._waiting.clear()
        for seq in pending:
            self._fail(seq, "the server is shutting down", status=503)
        self._prefilling, self._batches = [], {}
        self.executor.reset()
        self._publish()


def _padded_tokens(seqs: list[Sequence]) -> int:
    """Tokens a step's prefill forwards compute: per policy, rows x the longest next chunk."""
    width: dict[str, int] = {}
    rows: dict[str, int] = {}
    for seq in seqs:
        start, stop = seq.chunks[seq.next_chunk]
        policy = seq.request.policy
        width[policy] = max(width.get(policy, 0), stop - start)
        rows[policy] = rows.get(policy, 0) + 1
    return sum(rows[p] * width[p] for p in rows)


def _logprob_of(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """Log-probabilities under the model's distribution (before temperature and top-p, as OpenAI's)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = []
    if k:
        values, ids = logp.topk(k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), top)


def _take(seq: Sequence) -> list[TokenLogprob] | None:
    if seq.request.top_logprobs is None:
        return None
    taken, seq.logprobs = seq.logprobs, []
    return taken


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
