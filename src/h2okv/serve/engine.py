"""The continuous-batching engine: one background thread owns the model and runs, per iteration,

1. drop cancelled requests and end the ones past their deadline (their slots are free from this
   step on);
2. admit waiting requests (``scheduler.py`` decides how many: in arrival order, while their KV
   reservation fits under ``kv_memory`` (``memory.py``) and the batch has room);
3. prefill, in chunks of at most ``prefill_chunk`` tokens, round after round as the scheduler
   plans them. With ``schedule="budget"`` (the default) the prompts share forwards (one per
   policy per round) within ``step_tokens`` a step; ``schedule="serial"`` runs one chunk of the
   oldest prompt per step, alone. A finished prefill samples the first token and joins the decode
   batch of its policy (``batch.py``);
4. one decode step for every decode batch: each row feeds its last token at its own position. A
   decode row therefore waits at most one step's prefill budget between two tokens.

The engine decides nothing itself: it builds the scheduler's state, asks it for the plan, runs the
plan through its ``Executor`` (``executor.py``: plain data, so the same calls replayed elsewhere
rebuild the same caches) and hands each row's logits to the request's ``Output`` (``outputs.py``:
sampling, EOS, stop strings, logprobs), which says what the client is told.

Each sequence keeps its own budget, policy settings and positions. Sequences with the same policy
decode in one forward; different policies are different batches (the cache holds one policy).
An exception in one request's work fails that request alone. A request is checked before it is
queued (``check_request``: token ids in the vocabulary, a policy spec and budget the cache accepts,
sampling settings in range), so no input can poison a shared forward; should a shared prefill
forward fail all the same, its rows are tried one by one (``_isolate``): those that fail alone
fail, the others start their prompts over, and the engine keeps serving. A failing decode forward
fails that batch's requests. Errors are ``ServeError``s by kind (``errors.py``).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from h2okv.core.budget import BudgetSpec
from h2okv.core.held import ranks_by_question
from h2okv.core.positions import check_positions
from h2okv.core.reconstruction import prompt_probes
from h2okv.errors import H2OError
from h2okv.policies import make_policy, policy_class
from h2okv.serve.errors import ErrorKind, ServeError
from h2okv.serve.eviction import EVERY_POLICY
from h2okv.serve.executor import Executor
from h2okv.serve.memory import Reservation, per_sequence_slots, prefill_chunks, reservation
from h2okv.serve.outputs import Output, choose, eos_ids
from h2okv.serve.prefix import Entry, PrefixIndex, block_checkpoints
from h2okv.serve.sampling import GREEDY_BELOW, INVALID, argmax_ids
from h2okv.serve.scheduler import SCHEDULES, Scheduler, SchedulerState, SeqState
from h2okv.serve.text import plain_decoder
from h2okv.serve.types import EngineStats, Event, GenerationRequest, Handle, Observer, TextEnd

log = logging.getLogger("h2okv.serve")

PUBLISH_EVERY_S = 0.1  # the stats that take a pass over every row are refreshed this often (and on any change)


def freeze_heap() -> None:
    """Once per process, when its first engine starts: collect, then move every object alive (the
    model, the tokenizer, the libraries) out of the garbage collector's sight. A full collection
    scanned them all, in whichever engine step it fell: 0.2 s in tools/measure/engine_overhead.py's
    process, 0.4 s with the test suite's modules loaded, once every few hundred steps of a 64-row
    batch (a hundred times a decode step's forward on the tests' tiny model). It now scans what
    came since; later objects are collected as before."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.collect()
        gc.freeze()


_heap_frozen = False

__all__ = ["SCHEDULES", "Engine", "EngineOptions", "GenerationRequest"]


def ranked_length(request: GenerationRequest) -> int:
    """How many of the prompt's first tokens a policy ranked by reconstruction ranks: its cacheable
    prefix (a document compressed before the question that follows, as ``read_context`` does, so
    the state saved there is the question-agnostic one), else the whole prompt."""
    cut = request.cache_prefix
    return cut if cut is not None and 2 <= cut < len(request.prompt_ids) else len(request.prompt_ids)


class Sequence:
    """One request inside the engine: its prompt chunks, its executor uid, its output."""

    def __init__(self, request: GenerationRequest, handle: Handle, reservation: Reservation, uid: int,
                 chunk: int, output: Output):
        self.request = request
        self.handle = handle
        self.reservation = reservation
        self.output = output
        self.chunk = chunk
        self.chunks = prefill_chunks(len(request.prompt_ids), chunk)
        self.next_chunk = 0
        self.resume: int | None = None  # the prefix store's entry its prefill starts from
        self.resume_length: int | None = None  # ... cut to its first tokens (a full state, see prefix.py)
        self.checkpoints: frozenset[int] = frozenset()  # prompt lengths where its state is saved
        self.held_until: int | None = None  # its history held whole up to here, then its budget (_look_up)
        self.restarts = 0  # times its prefill started over after a shared forward failed
        self.uid = uid  # the executor's name for this sequence
        self.done = False
        self.decoding = False  # a row of its policy's decode batch (DecodeRows)
        self.submitted = time.monotonic()
        self.deadline = None if request.timeout is None else self.submitted + request.timeout
        self.last_token_at: float | None = None  # its first token's time (a decode row's later ones: its batch's)
        self.evicted_counted = 0  # tokens evicted so far, as already added to the engine's counter
        self.probe: list[list[int]] | None = None  # a policy ranked by reconstruction: its probe calls
        self.spans: list[tuple[int, int, int]] | None = None  # ... and their spans (kvzip:local=1)
        self.ranked = len(request.prompt_ids)  # ... and the prompt's first tokens they rank
        self.policy = policy = make_policy(request.policy)  # built once, asked here and by the engine
        self.tail = policy.slots_above_budget  # kvzip: tokens read after the ranking kept on top
        self.evicts = policy.evicts
        self.policy_name = policy.name  # the store's metrics label: names are few, specs with options are not
        self._fed: SeqState | None = None  # its state once its prompt is fed (``state``)

    @property
    def generated(self) -> list[int]:
        return self.output.generated

    @property
    def tokens_fed(self) -> int:
        if self.generated:
            return len(self.request.prompt_ids) + len(self.generated) - 1
        return self.chunks[self.next_chunk - 1][1] if self.next_chunk else 0

    def state(self) -> SeqState:
        """What the scheduler knows of it (asked several times a step: once its prompt is fed, the
        answer no longer changes and is kept)."""
        if self._fed is not None:
            return self._fed
        width = 0
        if self.next_chunk < len(self.chunks):
            start, stop = self.chunks[self.next_chunk]
            width = stop - start
        state = SeqState(self.uid, self.request.policy, self.reservation, width, self.next_chunk > 0)
        if self.next_chunk == len(self.chunks) > 0:  # fed: a prefill starts over only part-way (_isolate)
            self._fed = state
        return state


class DecodeRows:
    """The engine's side of one policy's decode batch (the executor's ``DecodeBatch``: the same
    rows in the same order): its sequences and, in lists parallel to them, what a step feeds,
    counts and hands on, so that a step's bookkeeping is a few operations over whole lists
    (``Engine._decoded``), not attribute lookups and calls per row. Rebuilt when rows leave."""

    def __init__(self):
        self.seqs: list[Sequence] = []
        self.uids: list[int] = []
        self.feed: list[int] = []  # each row's last token: what it feeds next ...
        self.positions: list[int] = []  # ... at this position
        self.left: list[int] = []  # the tokens each row may still generate (max_tokens)
        self.generated: list[list[int]] = []  # each row's Output.generated (the same lists)
        self.handles: tuple[Handle, ...] = ()  # a tuple: a step's ids go to them as they are (Handle.send)
        self.outputs: list[Output] = []
        self.special: list[int] = []  # rows whose outputs are not plain: their text is decoded in the step
        self.heeds_eos: list[bool] = []  # rows that EOS ends (not ignore_eos)
        self.sampled = False  # a row samples (else every row's choice is its argmax)
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop of every row's handle, if one
        self.stamp = 0.0  # when the batch's last step chose its rows' tokens
        self.fresh: dict[int, float] = {}  # uid -> its first token's time, rows not stepped since joining
        self.dropped = False  # a row finished since the rows were built (Engine._compact)
        self._states: tuple[SeqState, ...] | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, fresh: bool = True) -> None:
        """``seq`` (prefilled, its first token chosen) becomes the last row; ``fresh``: its last
        token is its first (the gap to its next one is counted from that one's time)."""
        out, req = seq.output, seq.request
        if not out.plain:
            self.special.append(len(self.seqs))
        self.sampled = self.sampled or req.temperature >= GREEDY_BELOW
        self.heeds_eos.append(not req.ignore_eos)
        loop = seq.handle.loop
        self.loop = loop if not self.seqs or (self.loop is loop) else None
        seq.decoding = True
        self.seqs.append(seq)
        self.uids.append(seq.uid)
        # a new list: the last step's, sent to the handles as it is, must not grow (Handle.send)
        self.feed = [*self.feed, out.generated[-1]]
        self.positions.append(len(req.prompt_ids) + len(out.generated) - 1)
        self.left.append(req.max_tokens - len(out.generated))
        self.generated.append(out.generated)
        self.handles = (*self.handles, seq.handle)
        self.outputs.append(out)
        if fresh:
            self.fresh[seq.uid] = seq.last_token_at
        self._states = None

    def running(self) -> DecodeRows:
        """The rows that have not finished, in order (``dropped`` rows gone): each list cut at once."""
        keep = [i for i, seq in enumerate(self.seqs) if not seq.done]
        rows = DecodeRows()
        for name in ("seqs", "uids", "feed", "positions", "left", "generated", "outputs", "heeds_eos"):
            column = getattr(self, name)
            setattr(rows, name, [column[i] for i in keep])
        rows.handles = tuple(self.handles[i] for i in keep)
        special = set(self.special)
        rows.special = [j for j, i in enumerate(keep) if i in special]
        rows.sampled = self.sampled and any(seq.request.temperature >= GREEDY_BELOW for seq in rows.seqs)
        loops = {handle.loop for handle in rows.handles}
        rows.loop = loops.pop() if len(loops) == 1 else None
        rows.stamp = self.stamp
        uids = set(rows.uids)
        rows.fresh = {uid: first for uid, first in self.fresh.items() if uid in uids}
        return rows

    def states(self) -> tuple[SeqState, ...]:
        """What the scheduler sees of the rows (a decode row's state no longer changes: kept)."""
        if self._states is None:
            self._states = tuple(seq.state() for seq in self.seqs)
        return self._states


@dataclass(frozen=True)
class EngineOptions:
    """How an engine admits, batches and schedules requests: ``h2okv serve``'s flags of the same
    names (``--chunk-size`` is ``prefill_chunk``, ``--prefix-cache-memory`` ``prefix_memory``). The
    cache settings that come with the server's eviction settings (the prefill mode, a recipe's head
    split) are ``Engine``'s own arguments."""

    kv_memory: int | None = None  # bytes of KV cache the running requests may reserve; None: no limit
    max_batch: int = 32  # sequences running at once (prefilling or decoding)
    max_queue: int = 256  # requests waiting for admission; past it, submissions are refused
    prefill_chunk: int = 128  # prompt tokens a sequence feeds per prefill forward
    schedule: str = "budget"  # SCHEDULES: prompts share forwards within step_tokens, or one at a time
    step_tokens: int = 512  # prompt tokens (pads included) one engine step may prefill
    positions: str = "true"  # every cache's position scheme (H2OCache(positions=...))
    prefix_memory: int = 0  # bytes of the prefix store; 0: off

    def validate(self) -> None:
        if self.max_batch < 1 or self.max_queue < 0 or self.prefill_chunk < 1 or self.step_tokens < 1:
            raise ValueError("max_batch, prefill_chunk and step_tokens must be >= 1, max_queue >= 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")


class Engine:
    """``prefill`` and ``cache_options``: every request's prefill mode and the extra ``H2OCache``
    keywords by policy spec (``EvictionDefaults.prefill`` / ``cache_options()``). ``executor``: one
    that is not a plain ``Executor`` of ``model`` (``serve --tp``: ``tp.Leader``)."""

    def __init__(self, model, tokenizer, options: EngineOptions | None = None, *, prefill: str = "chunked",
                 cache_options: dict[str, dict] | None = None, observer: Observer | None = None, executor=None):
        options = options or EngineOptions()
        options.validate()
        self.options = options
        self.observer = observer or Observer()
        # every model run and cache change goes through the executor (plain-data calls, see executor.py);
        # ``serve --tp`` passes one that also sends each call to the other ranks (tp.py)
        self.executor = executor if executor is not None else \
            Executor(model, options.prefill_chunk, prefill, options.positions, cache_options)
        # late prefill ranks a prompt once, at the end of the call that feeds it: so it is fed whole
        self.whole_prompts = prefill == "late"
        self.cache_options = dict(cache_options or {})
        self.tokenizer = tokenizer
        # tokenizer.decode(ids, skip_special_tokens=True), fast (text.py): what the requests' Outputs
        # detokenize with, under tokenizer_lock, which the engine takes once a step for all its rows
        self.detokenize = plain_decoder(tokenizer)
        self.device = model.device
        self.slot_bytes = self.executor.slot_bytes()
        # a float window (``float_window``) and centered keys' means are bytes per sequence: admitted
        # as that many slots more
        self.sequence_slots = per_sequence_slots(model, **self.cache_options.get(EVERY_POLICY, {}))
        self.scheduler = Scheduler(options.schedule, options.kv_memory, self.slot_bytes, options.max_batch,
                                   options.step_tokens)
        # HF fast tokenizers are not safe to share across threads; reentrant: a plain request's handle
        # without an event loop decodes its text on the engine's thread, at once (Handle._take)
        self.tokenizer_lock = threading.RLock()
        self.eos_ids = eos_ids(model, tokenizer)
        # the embedding's rows (the config's count: a tensor-parallel embedding holds a shard of them)
        self.vocab = getattr(model.config.get_text_config(), "vocab_size", None) or \
            model.get_input_embeddings().num_embeddings
        self.uids = itertools.count()
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._prefilling: list[Sequence] = []
        self._batches: dict[str, DecodeRows] = {}  # policy -> its decode rows, as the executor's
        self._timed: set[Sequence] = set()  # the admitted sequences with a deadline (_end_expired)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._busy = False
        self._cancels = False  # a handle was cancelled since _drop_cancelled last looked (wake)
        self._forward_s = 0.0  # this step's seconds in the executor's forward calls (_forward)
        self._published_rows, self._published_at = 0, 0.0  # when _publish last counted every row
        self.stats = EngineStats()
        # the prefix store: saved states, resumed by prompts that start with their tokens; its
        # blocks are the prefill's chunks, so a prompt resumed at a block reads the chunks a cold read does
        self.prefixes = PrefixIndex(options.prefix_memory, block=options.prefill_chunk) if options.prefix_memory \
            else None
        self.queue_times: deque[float] = deque(maxlen=10_000)  # seconds waited by the latest admissions

    # -- client side (any thread) ----------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        """``ids``' text, from any thread."""
        with self.tokenizer_lock:
            return self.detokenize(ids)

    def reservation(self, request: GenerationRequest) -> Reservation:
        budget = request.budget
        if budget is not None:  # kvzip keeps up to ``tail`` tokens read after its ranking on top of it
            budget += make_policy(request.policy).slots_above_budget
        return reservation(len(request.prompt_ids), request.max_tokens, budget, self.chunk_for(request),
                           self.sequence_slots)

    def reads_question(self, request: GenerationRequest) -> bool:
        """Does this request's policy rank its prompt with the question in view? A late prefill
        (every query's attention, the question's among them) or a policy that ranks a call before
        chunking it (``ranks_upfront``: ``snapkv``, the ``bounded`` recipe, by the call's last
        queries). Such a prompt is read in one call and never cut where its cacheable prefix ends:
        read in pieces, the document would be ranked before the question exists (measured, served
        chat over a ~1,300-token document, 0.5B, 20%: 0/12 under both, full 12/12). ``kvzip``
        ranks by reconstruction and is question-agnostic by design: it keeps its cut."""
        cls = policy_class(request.policy)
        return cls.evicts and not cls.ranks_by_reconstruction and (self.whole_prompts or cls.ranks_upfront)

    def chunk_for(self, request: GenerationRequest) -> int:
        """The prefill chunk of ``request``: the whole prompt under late prefill or for a policy
        ranked by reconstruction (its peak is then the prompt, as ``reservation`` counts it), else
        ``prefill_chunk``."""
        whole = self.whole_prompts or policy_class(request.policy).ranks_by_reconstruction
        return max(1, len(request.prompt_ids)) if whole else self.options.prefill_chunk

    def check_fits(self, request: GenerationRequest) -> None:
        """Raise an ``INVALID_REQUEST`` ``ServeError`` for a request that could never fit under
        ``kv_memory``."""
        res = self.reservation(request)
        need = self.scheduler.alone_bytes(res)
        if self.options.kv_memory is not None and need > self.options.kv_memory:
            raise ServeError(
                ErrorKind.INVALID_REQUEST,
                f"this request needs {need} bytes of KV cache ({res.slots} slots per layer/head), more than "
                f"the server's --kv-memory {self.options.kv_memory}; lower max_tokens or use an evicting policy",
                param="max_tokens", code="kv_memory_exceeded",
            )

    def check_request(self, request: GenerationRequest) -> None:
        """Raise an ``INVALID_REQUEST`` ``ServeError`` for a request whose row could break a forward
        it shares with others (or its own sampling): checked before it joins any."""
        def invalid(message: str, param: str | None = None):
            return ServeError(ErrorKind.INVALID_REQUEST, message, param=param)

        if not request.prompt_ids or any(not 0 <= t < self.vocab for t in request.prompt_ids):
            raise invalid(f"prompt token ids must be in [0, {self.vocab}) and not empty", "prompt")
        if request.max_tokens < 1:
            raise invalid("max_tokens must be >= 1", "max_tokens")
        if not (0.0 <= request.temperature < float("inf") and 0.0 < request.top_p <= 1.0):
            raise invalid("temperature must be finite and >= 0, top_p in (0, 1]", "temperature")
        try:
            policy = make_policy(request.policy)
            if policy.evicts != (request.heavy is not None):
                raise H2OError(f"policy {policy.name!r} and the budget heavy={request.heavy} do not go together")
            if request.heavy is not None:
                if not (0 <= request.heavy < 1 << 31 and 0 <= request.recent < 1 << 31):
                    raise H2OError(f"budget out of range: heavy={request.heavy}, recent={request.recent}")
                BudgetSpec.build(policy, request.heavy, request.recent, None, None)
            if policy.ranks_by_reconstruction and len(request.prompt_ids) < 2:
                raise H2OError(f"policy {policy.spec!r} ranks all but the prompt's last token by reconstruction: "
                               f"it needs at least 2 prompt tokens")
            check_positions(policy, self.options.positions)
        except (H2OError, ValueError, TypeError) as exc:
            raise invalid(f"h2o: {exc}", "h2o") from None

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> Handle:
        """Queue a request; raises ``ServeError`` (``INVALID_REQUEST``: never fits; ``OVERLOADED``:
        queue full; ``UNAVAILABLE``: not running or draining)."""
        return self.submit_many([request], loop)[0]

    def submit_many(self, requests: list[GenerationRequest], loop: asyncio.AbstractEventLoop | None = None,
                    ) -> list[Handle]:
        """Queue several requests (the ``n`` choices of one API call) all or none."""
        for request in requests:
            self.check_request(request)
            self.check_fits(request)
        seqs = [self._sequence(request, loop) for request in requests]
        with self._cond:
            if self._draining:
                raise ServeError(ErrorKind.UNAVAILABLE, "the server is shutting down", code="shutting_down")
            if self._stopping or self._thread is None:
                raise ServeError(ErrorKind.UNAVAILABLE, "the engine is not running", code="engine_stopped")
            if len(self._waiting) + len(seqs) > self.options.max_queue:
                raise ServeError(ErrorKind.OVERLOADED,
                                 f"server busy: {len(self._waiting)} requests already waiting (--max-queue)",
                                 code="queue_full")
            self._waiting.extend(seqs)
            self.stats.waiting = len(self._waiting)
            self._cond.notify()
        return [seq.handle for seq in seqs]

    def _sequence(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None) -> Sequence:
        output = Output(request, self.detokenize, self.device)
        # a plain request's text is decoded by its handle, out of the engine's step (outputs.py)
        handle = Handle(self, loop, output.text if output.plain else None, self.tokenizer_lock)
        # a question-aware policy reads its prompt in one call (its cache still evicts chunk by chunk)
        call = len(request.prompt_ids) if self.reads_question(request) else self.chunk_for(request)
        seq = Sequence(request, handle, self.reservation(request), next(self.uids), max(1, call), output)
        policy = seq.policy
        if policy.ranks_by_reconstruction:  # built here, where the tokenizer is
            seq.ranked = ranked_length(request)
            seq.probe = []  # past kvzip's probe_upto: no probe calls, the question's attention ranks
            # the cache holds all but the ranked part's last token when it is ranked (prompt_probes)
            if policy.runs_probe(seq.ranked - 1):
                with self.tokenizer_lock:
                    plan = prompt_probes(self.tokenizer, request.prompt_ids[:seq.ranked])
                seq.probe = plan.calls
                if policy.local:  # each call scored on the part of the prompt it repeats
                    seq.spans = plan.spans
        return seq

    def wake(self) -> None:
        """A handle was cancelled (``Handle.cancel``): it is dropped at the next step."""
        with self._cond:
            self._cancels = True
            self._cond.notify()

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        freeze_heap()
        self._thread = threading.Thread(target=self._run, name="h2okv-engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Stop admitting: new submissions get ``UNAVAILABLE``; what was submitted runs to its end."""
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
                started, self._forward_s = time.perf_counter(), 0.0
                try:
                    self._iteration()
                except Exception:  # a bug in the bookkeeping: fail what is running, keep serving
                    log.exception("engine iteration failed")
                    for seq in self._active():
                        self._fail(seq, "internal error in the engine")
                    self._prefilling, self._batches = [], {}
                    self.executor.reset()
                    if self.prefixes is not None:
                        self.prefixes.clear()  # the executor's saved states went with the reset
                self._publish()
                self.stats.steps.add(time.perf_counter() - started, self._forward_s)
                self._busy = False
            self._shutdown()

    def _forward(self, call, *args):
        """``call(*args)``, one of the executor's forward calls (``prefill``, ``decode``), its time
        counted as the step's forward (``EngineStats.steps``)."""
        start = time.perf_counter()
        try:
            out = call(*args)
            if self.device.type == "cuda":  # a CUDA forward returns before it has run: wait, to count it
                torch.cuda.synchronize(self.device)
            return out
        finally:
            self._forward_s += time.perf_counter() - start

    def _iteration(self) -> None:
        self._drop_cancelled()
        self._end_expired()
        self._admit()
        if self._prefilling:
            self._prefill_step()
        decoded = 0
        for policy in self.scheduler.decode(self._scheduler_state()):
            decoded += len(self._batches[policy])
            self._decode_step(policy)
        self.stats.batch_size = decoded
        self.stats.batch_size_max = max(self.stats.batch_size_max, decoded)

    def _scheduler_state(self, waiting=(), spent: int = 0) -> SchedulerState:
        batches = list(self._batches.values())
        decoding = batches[0].states() if len(batches) == 1 else tuple(s for rows in batches for s in rows.states())
        return SchedulerState(waiting=tuple(s.state() for s in waiting),
                              prefilling=tuple(s.state() for s in self._prefilling), decoding=decoding, spent=spent)

    def _active(self) -> list[Sequence]:
        return self._prefilling + [s for rows in self._batches.values() for s in rows.seqs]

    def _running(self) -> int:
        return len(self._prefilling) + sum(len(rows) for rows in self._batches.values())

    def _drop_cancelled(self) -> None:
        with self._cond:
            if not self._cancels:  # no handle was cancelled since the last look: no row to check
                return
            self._cancels = False
            for seq in [s for s in self._waiting if s.handle.cancelled.is_set()]:
                self._waiting.remove(seq)
                self._finish(seq, Event("cancelled"), "cancelled")
        for seq in [s for s in self._prefilling if s.handle.cancelled.is_set()]:
            self._prefilling.remove(seq)
            self._finish(seq, Event("cancelled"), "cancelled")
        for policy, rows in list(self._batches.items()):
            for seq in rows.seqs:
                if seq.handle.cancelled.is_set():
                    self._finish(seq, Event("cancelled"), "cancelled")
            self._compact(policy)

    def _end_expired(self) -> None:
        """Requests past their deadline end now, with what they generated so far."""
        now = time.monotonic()
        with self._cond:
            expired = [s for s in self._waiting if s.deadline is not None and now > s.deadline]
            for seq in expired:
                self._waiting.remove(seq)
        if self._timed:  # else no running sequence has a deadline: no pass over the rows
            expired += [s for s in self._active() if s.deadline is not None and now > s.deadline]
        for seq in expired:
            if seq in self._prefilling:
                self._prefilling.remove(seq)
            with self.tokenizer_lock:  # its last text is decoded
                event = seq.output.end("timeout")
            self._finish(seq, event, "timeout")
        if expired:
            for policy in list(self._batches):
                self._compact(policy)

    def _admit(self) -> None:
        with self._cond:
            if not self._waiting:  # the usual step: no state to build, no question to ask
                return
            # no more than the batch has room for can be admitted: the scheduler sees only those
            room = max(0, self.options.max_batch - self._running())
            count = self.scheduler.admit(self._scheduler_state(itertools.islice(self._waiting, room)))
            for _ in range(count):
                seq = self._waiting.popleft()
                self._prefilling.append(seq)
                if seq.deadline is not None:
                    self._timed.add(seq)
                waited = time.monotonic() - seq.submitted
                self.queue_times.append(waited)
                self.observer.queued(waited)

    def _prefill_step(self) -> None:
        """The step's prefill: the scheduler's rounds (``scheduler.py``), each run as planned, until
        it plans no more."""
        spent = 0
        while True:
            plan = self.scheduler.prefill_round(self._scheduler_state(spent=spent))
            if not plan.forwards:
                return
            spent += plan.tokens
            by_uid = {seq.uid: seq for seq in self._prefilling}
            for uids in plan.forwards:
                self._prefill_forward([by_uid[uid] for uid in uids])

    def _prefill_forward(self, seqs: list[Sequence]) -> None:
        """One forward: the next chunk of each of ``seqs`` (one policy). Prompts that end here
        sample their first token and join their policy's decode batch."""
        parts = []
        try:
            for seq in seqs:
                req = seq.request
                if seq.next_chunk == 0:
                    self._look_up(seq)
                    self._open(seq)
                start, stop = seq.chunks[seq.next_chunk]
                parts.append((seq.uid, req.prompt_ids[start:stop], start))
            logits = self._forward(self.executor.prefill, parts)
        except Exception as exc:  # these requests' failure (the shared forward's), not the engine's
            log.exception("prefill failed")
            for seq in self._isolate(seqs):
                self._prefilling.remove(seq)
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
            return
        ended = []
        for seq in seqs:
            seq.next_chunk += 1
            fed = seq.chunks[seq.next_chunk - 1][1]
            if fed in seq.checkpoints:
                self._store(seq, seq.request.prompt_ids[:fed])
            if fed == seq.held_until:  # its history, held whole, saved so: the question ranks it
                self._store(seq, seq.request.prompt_ids[:fed], self._namespace(seq.request, held=True))
                self.executor.set_budget(seq.uid)
            if seq.next_chunk < len(seq.chunks):
                continue
            self._prefilling.remove(seq)
            ended.append(seq)
        if ended:
            self._advance_rows(ended, torch.stack([logits[seq.uid] for seq in ended]))
        joining = [seq for seq in ended if not seq.done]
        if joining:  # together: one copy of the batch (executor.join_many)
            self.executor.join_many([seq.uid for seq in joining], max(seq.reservation.slots for seq in joining))
            rows = self._batches.setdefault(joining[0].request.policy, DecodeRows())
            for seq in joining:
                rows.add(seq)

    def _open(self, seq: Sequence) -> None:
        """Open ``seq`` in the executor as ``_look_up`` planned it; a history held whole and resumed
        in full takes its budget at once (the question is its next call)."""
        req = seq.request
        # positional, as every executor call: plain data a recorder or a TP follower replays
        self.executor.open(seq.uid, req.policy, req.heavy, req.recent, req.seed or 0, seq.probe, seq.resume,
                           seq.resume_length, seq.held_until is not None, seq.spans)
        if seq.held_until is not None and seq.chunks[0][0] == seq.held_until:
            self.executor.set_budget(seq.uid)

    def _isolate(self, seqs: list[Sequence]) -> list[Sequence]:
        """After a shared prefill forward over ``seqs`` failed (the executor dropped their caches):
        the ones to fail. Each row replays its prompt so far, up to the chunk that failed, alone; a
        row that fails alone is to blame, the others start their prompts over (and a row whose
        forwards fail a second time is failed too: the failure is not one row's)."""
        for seq in seqs:
            self.executor.close(seq.uid)
        if len(seqs) == 1:
            return seqs
        to_fail = []
        for seq in seqs:  # one at a time: a replay is the only row of its policy's prefill group
            if seq.restarts or not self._replays_alone(seq):
                to_fail.append(seq)
            else:
                seq.next_chunk, seq.restarts = 0, seq.restarts + 1
        return to_fail

    def _replays_alone(self, seq: Sequence) -> bool:
        req = seq.request
        try:
            self._open(seq)
            for start, stop in seq.chunks[:seq.next_chunk + 1]:
                self._forward(self.executor.prefill, [(seq.uid, req.prompt_ids[start:stop], start)])
                if stop == seq.held_until:
                    self.executor.set_budget(seq.uid)
            return True
        except Exception:
            log.exception("prefill of request %d alone failed", seq.uid)
            return False
        finally:
            self.executor.close(seq.uid)

    def _decode_step(self, policy: str) -> None:
        rows = self._batches[policy]
        try:  # each row feeds its last token at its position (DecodeRows keeps both, for the whole batch)
            logits = self._forward(self.executor.decode, policy, rows.uids, rows.feed, rows.positions)
        except Exception as exc:
            log.exception("decode step failed")
            for seq in rows.seqs:
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
            self._compact(policy)
            return
        self._decoded(rows, logits)
        self._compact(policy)

    def _compact(self, policy: str) -> None:
        rows = self._batches.get(policy)
        if rows is None or not rows.dropped:
            return
        rows = rows.running()
        self.executor.keep(policy, rows.uids, max((s.reservation.slots for s in rows.seqs), default=0))
        if rows:
            self._batches[policy] = rows
        else:
            del self._batches[policy]

    def _decoded(self, rows: DecodeRows, logits: torch.Tensor) -> None:
        """A decode step's tokens (row ``i`` of ``logits`` ``[rows, vocab]`` is ``rows.seqs[i]``'s),
        chosen for all rows at once (one copy to the host). A plain row whose token ends nothing
        (most rows, most steps) only records it and hands it to its handle, whose side decodes
        its text (``types.Handle``): list operations over the whole batch, and one wake-up of the
        batch's event loop. The other rows (stop strings or logprobs: their text decides and is
        decoded here; a token that ends its row: EOS, ``max_tokens``; a sampled NaN) go through
        ``_advance`` one by one, as every row did."""
        try:
            tokens = choose(rows.outputs, logits) if rows.sampled else argmax_ids(logits)
        except Exception as exc:  # the step's sampling as a whole, not one row's
            log.exception("sampling failed")
            for seq in rows.seqs:
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
            return
        now = time.monotonic()  # when the rows' tokens arrive: all at once
        fresh, count = rows.fresh, len(tokens)
        gaps = [(now - first, 1) for first in fresh.values()]
        if count > len(fresh):  # the rest got their last tokens together, at the batch's last step
            gaps.append((now - rows.stamp, count - len(fresh)))
        fresh.clear()
        rows.stamp = now
        self.observer.inter_token_runs(gaps)
        left = rows.left = [k - 1 for k in rows.left]
        rows.feed, rows.positions = tokens, [p + 1 for p in rows.positions]
        look = rows.special
        eos = self.eos_ids
        if 0 in left or (rows.sampled and INVALID in tokens) or (not eos.isdisjoint(tokens) and any(rows.heeds_eos)):
            look = sorted({*look, *(i for i, (t, k, heeds) in enumerate(zip(tokens, left, rows.heeds_eos, strict=True))
                                    if k == 0 or t == INVALID or (heeds and t in eos))})
        if not look:  # the usual step: every row plain, going on
            for generated, token in zip(rows.generated, tokens, strict=True):
                generated.append(token)
            self.stats.generated_tokens += count
            self._send(rows, rows.handles, tokens)
            return
        skip = set(look)
        handles, ids = [], []
        for i, (generated, handle, token) in enumerate(zip(rows.generated, rows.handles, tokens, strict=True)):
            if i not in skip:
                generated.append(token)
                handles.append(handle)
                ids.append(token)
        self.stats.generated_tokens += count - len(look)
        seqs, items = rows.seqs, []
        with self.tokenizer_lock:  # the rows' text that is decoded here (Output.emit)
            for i in look:
                seq = seqs[i]
                # a row's logits only for its logprobs: a view per row per step costs more than its text
                self._advance(seq, tokens[i], logits[i] if seq.request.top_logprobs is not None else None, items)
        self._send(rows, tuple(handles), ids)
        Handle.push_all(items)

    @staticmethod
    def _send(rows: DecodeRows, handles: tuple[Handle, ...], ids: list[int]) -> None:
        """Plain rows' token ids to their handles: in one wake-up of the batch's event loop when its
        rows share one (``Handle.send``: no pass over the rows, no object per row: in a run whose
        client reads late they pile up, and tuples per row made the garbage collector run every
        few steps), else by ``Handle.push_all``."""
        if rows.loop is not None:
            Handle.send(rows.loop, handles, ids)
        else:
            Handle.push_all(list(zip(handles, ids, strict=True)))

    def _advance_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """The first token of each of ``seqs``, whose prompts ended in one prefill forward (row
        ``i`` of ``logits`` ``[rows, vocab]`` is ``seqs[i]``'s), chosen for all rows at once, then
        each row's item, sent together (``Handle.push_all``); a row that fails fails alone."""
        try:
            tokens = choose([seq.output for seq in seqs], logits)
        except Exception as exc:  # the step's sampling as a whole, not one row's
            log.exception("sampling failed")
            for seq in seqs:
                self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}")
            return
        now = time.monotonic()  # when the rows' tokens arrive: all at once
        items = []
        with self.tokenizer_lock:  # the rows' text that is decoded here (Output.emit)
            for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
                if self._advance(seq, token, logits[i] if seq.request.top_logprobs is not None else None, items):
                    self.observer.first_token(now - seq.submitted)
                    seq.last_token_at = now
        Handle.push_all(items)

    def _advance(self, seq: Sequence, token: int, logits: torch.Tensor | None, items: list) -> bool:
        """Record ``token``, the next token of ``seq`` (chosen from its ``logits``), and add what
        its handle is to get to ``items`` (``outputs.py``; the final one ends the request here).
        False: the row failed."""
        try:
            seq.output.record(token)
            self.stats.generated_tokens += 1
            item = seq.output.emit(token, self.eos_ids, logits)
        except Exception as exc:
            log.exception("token step failed")
            self._fail(seq, f"generation failed: {type(exc).__name__}: {exc}", items=items)
            return False
        if item is None:
            return True
        if type(item) is not int and item.final:
            self._finish(seq, item, "completed", items)
        else:
            items.append((seq.handle, item))
        return True

    # -- the prefix store ------------------------------------------------------------------------------
    @staticmethod
    def _namespace(request: GenerationRequest, held: bool = False) -> tuple:
        """What two requests must share for one to resume the other's state. A resumed sequence
        keeps the budget the saved state was built with (a conversation's first turn fixes it). A
        history ``held`` whole evicted nothing: any budget of its policy resumes it."""
        if held:
            return request.cache_key, request.policy, "held whole"
        budget = request.budget_label if request.budget_label is not None else (request.heavy, request.recent)
        return request.cache_key, request.policy, budget

    def held_history(self, request: GenerationRequest) -> int | None:
        """Where the history ends that this request holds whole while it reads it, else None.

        A policy that ranks a call by its last queries (``snapkv``, the ``bounded`` recipe) keeps
        what the question asks for. Resuming the state a chat's previous turn kept would answer
        the new question from what the last one needed (measured: the library guide's document,
        0.5B, 20%: one of four answers right, full four). So with the prefix store on, such a
        request reads its history (every message before the last user message) evicting
        nothing, saves it whole in the store, then reads the question with its budget: the
        question ranks the whole history, as if the prompt were read in one call, and a later
        turn resumes the history instead of reading it again. The sequence holds its history
        whole while it is prefilled (what ``reservation`` counts: the prompt); it decodes at its
        budget. Only a history whose K/V fits in half the store, a question of two tokens or
        more, and heads on their rows' budgets (no cache-wide or adaptive split)."""
        cut, prompt = request.cache_prefix, len(request.prompt_ids)
        if self.prefixes is None or request.heavy is None or cut is None or not 2 <= cut <= prompt - 2:
            return None
        cls = policy_class(request.policy)
        if not ranks_by_question(cls) or self.whole_prompts:
            return None
        if self.cache_options.get(request.policy, {}).get("head_budgets", "uniform") != "uniform":
            return None  # the server's extra keywords for the policy's caches: a recipe's head split
        return cut if cut * self.slot_bytes <= self.prefixes.capacity // 2 else None

    def _look_up(self, seq: Sequence) -> None:
        """At a prompt's first prefill: resume the longest saved state the store holds for it, if
        any (``PrefixIndex.lookup``), and read only the rest (in chunks, on its own copy). Its
        state is saved at its checkpoints (``_store``): where its cacheable prefix ends (a chunk
        ends there) and, for an evicting policy read in chunks, at block boundaries before that
        (``block_checkpoints``): its state after a chunk depends on no later token. A late prefill
        or a ranking by reconstruction reads the prompt (its ranked part) in one call, and so has
        no state part-way through it; a full cache needs none (any prefix of its final state
        resumes). A prompt ranked by reconstruction reads its ranked part in one chunk
        (``Sequence.ranked``), the rest after."""
        req, prompt = seq.request, seq.request.prompt_ids
        seq.held_until = self.held_history(req)
        if seq.held_until is not None:
            self._look_up_held(seq)
            return
        hit = None if self.prefixes is None else self.prefixes.lookup(self._namespace(req), prompt, seq.policy_name)
        done = 0
        if hit is not None:
            done = hit.length
            seq.resume, seq.probe, seq.spans = hit.entry.id, None, None  # ranked when it was saved
            seq.resume_length = done if done < len(hit.entry.ids) else None
            seq.output.cached_tokens = done
        cut = req.cache_prefix
        if seq.probe is not None:
            cut = seq.ranked
        elif cut is None or not done < cut < len(prompt) or self.reads_question(req):
            cut = len(prompt)
        saves = set()
        if self.prefixes is not None:
            if cut < len(prompt):
                saves.add(cut)
            chunked = seq.chunk < len(prompt) and not policy_class(req.policy).ranks_by_reconstruction
            if seq.evicts and chunked:
                saves.update(block_checkpoints(done, cut, self.options.prefill_chunk))
        seq.checkpoints = frozenset(saves)
        pieces = [(done, cut), (cut, len(prompt))] if cut < len(prompt) else [(done, len(prompt))]
        seq.chunks = [(lo + a, lo + b) for lo, hi in pieces for a, b in prefill_chunks(hi - lo, seq.chunk)]

    def _look_up_held(self, seq: Sequence) -> None:
        """``_look_up`` for a history held whole (``held_history``): resume the longest history
        saved whole that this one starts with, read the rest of the history (nothing evicted),
        then the question, each in one call; the engine saves the history and sets the budget
        between the two (``_prefill_forward``)."""
        req, prompt, cut = seq.request, seq.request.prompt_ids, seq.held_until
        # a saved history that runs past this one's end would hold part of the question whole
        hit = self.prefixes.lookup(self._namespace(req, held=True), prompt[:cut + 1], seq.policy_name)
        done = 0
        if hit is not None:
            done = hit.length
            seq.resume = hit.entry.id
            seq.output.cached_tokens = done
        seq.checkpoints = frozenset()
        seq.chunks = [(done, cut)] if done < cut else []
        seq.chunks.append((cut, len(prompt)))

    def _store(self, seq: Sequence, ids: list[int], namespace: tuple | None = None) -> None:
        """``seq``'s state now, having fed ``ids``, into the prefix store (under ``namespace``, the
        request's by default): at a checkpoint of its prompt, or completed (its prompt and answer
        as fed). A state the store resumes already (``PrefixIndex.holds``) is not copied again."""
        namespace = self._namespace(seq.request) if namespace is None else namespace
        ids = tuple(ids)
        if self.prefixes.holds(namespace, ids, truncatable=not seq.evicts):
            return
        entry = self.prefixes.reserve()
        try:
            size = self.executor.save(entry, seq.uid)
        except Exception:  # the store is an optimisation: the request itself goes on
            log.exception("saving request %d's state failed", seq.uid)
            return
        for gone in self.prefixes.add(Entry(entry, namespace, ids, size, truncatable=not seq.evicts)):
            self.executor.forget(gone)

    def _fail(self, seq: Sequence, message: str, kind: ErrorKind = ErrorKind.INTERNAL, items: list | None = None,
              ) -> None:
        self._finish(seq, Event("error", error=ServeError(kind, message)), "failed", items)

    def _finish(self, seq: Sequence, event: Event | TextEnd, outcome: str, items: list | None = None) -> None:
        """End ``seq`` with its final ``event``: pushed now, or added to the step's ``items``."""
        if seq.done:
            return
        seq.done = True
        self._timed.discard(seq)
        self._count_evicted(seq)  # its last steps, fed since the last publish (a finished row is not active)
        # a history held whole was saved at its end; the next turn resumes that, not this state
        if outcome == "completed" and self.prefixes is not None and seq.generated and seq.decoding \
                and seq.held_until is None:
            self._store(seq, seq.request.prompt_ids + seq.generated[:-1])
        if seq.decoding:  # a decode row is dropped by _compact, with the rest of its batch
            self._batches[seq.request.policy].dropped = True
        else:
            self.executor.close(seq.uid)
        self.stats.finished[outcome] += 1
        if items is None:
            seq.handle.push(event)
        else:
            items.append((seq.handle, event))

    def _count_evicted(self, seq) -> None:
        """Add what ``seq`` evicted since it was last counted: an evicting cache holds its budget (and
        a kvzip row the first ``tail`` tokens read after its ranking), so every token fed beyond
        that was evicted."""
        budget = seq.request.budget
        fed = seq.tokens_fed
        held = None if budget is None else budget + min(seq.tail, max(0, fed - seq.ranked))
        evicted = 0 if held is None else max(0, fed - held)
        self.stats.evicted_tokens += evicted - seq.evicted_counted
        seq.evicted_counted = evicted

    def _publish(self) -> None:
        running = self._running()
        kv = self.executor.kv_bytes()
        s = self.stats
        s.running = running
        with self._cond:
            s.waiting = len(self._waiting)
        s.kv_bytes = kv
        s.kv_bytes_peak = max(s.kv_bytes_peak, kv)
        if self.prefixes is not None:
            s.prefix_hits, s.prefix_misses = self.prefixes.hits, self.prefixes.misses
            s.prefix_entries, s.prefix_bytes = len(self.prefixes), self.prefixes.bytes
        # the figures that take a pass over every row: when the rows change, else at most every
        # PUBLISH_EVERY_S (each step, 64 rows cost a tenth of a decode step's forward; a finished row
        # is counted by _finish)
        now = time.monotonic()
        if running == self._published_rows and now < self._published_at + PUBLISH_EVERY_S:
            return
        self._published_rows, self._published_at = running, now
        active = self._active()
        for seq in active:
            self._count_evicted(seq)
        s.full_kv_bytes = sum(seq.tokens_fed for seq in active) * self.slot_bytes
        s.reserved_bytes = self.scheduler.footprint(self._scheduler_state()) * self.slot_bytes if active else 0

    def _shutdown(self) -> None:
        with self._cond:
            pending = list(self._waiting) + self._active()
            self._waiting.clear()
        for seq in pending:
            self._fail(seq, "the server is shutting down", kind=ErrorKind.UNAVAILABLE)
        self._prefilling, self._batches = [], {}
        self.executor.reset()
        if self.prefixes is not None:
            self.prefixes.clear()  # a restart starts with an empty store
        self._publish()
