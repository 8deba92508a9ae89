"""``h2okv serve --tp N``: rank 0 serves, the other ranks follow its executor calls.

Rank 0 runs HTTP, the scheduler and an ``Executor`` (``executor.py``): the engine's only way to
run the model or change a cache, whose calls take plain data (sequences named by integer uids).
Rank 0 wraps its executor in a ``Leader``, which broadcasts every call to the other ranks before
running it; each follower runs the calls it receives, in the same order, on its own executor
(``follow``). Every rank then holds the same sequences (for its own KV heads) and enters the same
forwards, whose collectives (the tp plan's all-reduces) pair up.

**Consistency.** Only the order of calls has to match. One lock makes "broadcast a call, run it"
atomic on rank 0, so nothing else rank 0 sends (a heartbeat, a stats gather, the stop message)
falls between a call and its forward's collectives. What the engine decides (admissions,
cancellations, disconnects, timeouts, failed requests) reaches the followers only as calls (drop
these rows, close that uid), so they do what rank 0 decided, whatever it was.

**Failures.**

- A call that raises on rank 0 fails its requests (the engine's usual handling). The follower
  meets the same exception for the same data (calls are deterministic) and goes on. Each message
  carries whether rank 0's previous call succeeded; a follower whose own outcome differs has
  diverged and fails at once rather than run different forwards (which would deadlock).
- A communication error (a rank died, or did not answer within ``--tp-timeout``) breaks the group:
  rank 0 stops serving and fails with one line, a follower fails with one line, and the launcher
  (``h2okv.parallel.launch``'s spawn, or torchrun) ends the others.
- An idle rank 0 sends a heartbeat every few seconds, so a follower waiting for the next call never
  reaches ``--tp-timeout`` while rank 0 lives, and learns within a heartbeat when it does not.

**Shutdown.** Rank 0 alone reacts to SIGTERM: it drains (``api/server.py``), then sends ``stop``; each
follower leaves its loop and every rank exits 0. Followers ignore SIGTERM and SIGINT (torchrun
sends SIGTERM to every rank; the stop comes from rank 0 once it has drained).
"""

from __future__ import annotations

import functools
import inspect
import logging
import signal
import threading
import time
import zlib
from collections.abc import Callable

import torch

from h2okv.parallel.launch import is_comm_error

log = logging.getLogger("h2okv.serve")

# message kinds: (kind, previous_call_ok, payload)
CALL, PING, STATS, STOP = "call", "ping", "stats", "stop"

# executor methods that only read this rank's caches: run on rank 0 alone. Every other method is
# broadcast (``slot_bytes`` too: it measures with a forward, whose collectives need every rank), so
# a method added to the executor later is replicated unless it is listed here.
LOCAL_ONLY = frozenset({"kv_bytes", "rows", "prefilling", "sequences", "saved_bytes", "saved_entries"})
# calls that change caches without running the model: once the group is gone (broken, or stopped
# while the engine still winds down) rank 0 runs them alone, so that the engine's cleanup (which
# the executor promises always succeeds) still frees rank 0's caches and ends every request with
# its final event. Any other call (a forward) then raises ``GroupBroken``: alone, it would wait in
# a collective for ranks that are gone.
CACHE_ONLY = frozenset({"open", "join", "join_many", "keep", "close", "reset", "forget"})


class GroupBroken(RuntimeError):
    """The tensor-parallel group can no longer run calls (a rank died, timed out or diverged)."""


def _is_comm_error(exc: BaseException) -> bool:
    """A failure of the group rather than of the call (``distributed.is_comm_error``)."""
    return isinstance(exc, GroupBroken) or is_comm_error(exc)


def heartbeat_seconds(timeout: float) -> float:
    """How often an idle rank 0 pings: well inside ``--tp-timeout``, at most every 5 s."""
    return max(0.05, min(5.0, timeout / 4))


class Channel:
    """Rank 0 -> every rank: messages broadcast on a gloo group (the default group on CPU; a gloo
    subgroup when the default is nccl, since pickled objects travel best through host memory)."""

    def __init__(self, heartbeat_s: float = 5.0):
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.heartbeat_s = heartbeat_s
        self.lock = threading.RLock()  # held from a call's broadcast to the end of its local run
        self.broken: BaseException | None = None
        self.previous_ok = True  # rank 0: did the last call succeed here (sent with the next message)
        self._closed = False
        self._last_sent = time.monotonic()
        self._stop_beat = threading.Event()
        self._beat: threading.Thread | None = None
        self._on_broken: list[Callable[[], None]] = []

    # -- rank 0 ------------------------------------------------------------------------------------
    def send(self, kind: str, payload=None) -> None:
        """Broadcast one message (hold ``lock``)."""
        if self.broken is not None:
            raise GroupBroken(f"the tensor-parallel group is broken: {self.broken}")
        if self._closed:
            raise GroupBroken("the tensor-parallel group was stopped")
        try:
            self._broadcast((kind, self.previous_ok, payload))
        except Exception as exc:
            self.fail(exc)
            raise
        self._last_sent = time.monotonic()

    def gather(self, local: dict) -> list[dict]:
        """Every rank's ``local`` dict, rank order (rank 0: hold ``lock``, after ``send(STATS)``)."""
        import torch.distributed as dist

        everyone: list = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, local, group=self.group)
        except Exception as exc:
            self.fail(exc)
            raise
        return everyone

    def on_broken(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the group breaks (at once if it already has)."""
        self._on_broken.append(callback)
        if self.broken is not None:
            callback()

    def fail(self, exc: BaseException) -> None:
        """Mark the group broken (once) and tell whoever must stop serving."""
        if self.broken is not None:
            return
        self.broken = exc
        for callback in self._on_broken:
            callback()

    def start_heartbeat(self) -> None:
        self._beat = threading.Thread(target=self._heartbeat, name="h2okv-tp-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop_beat.wait(self.heartbeat_s / 2):
            if time.monotonic() - self._last_sent < self.heartbeat_s:
                continue
            if not self.lock.acquire(blocking=False):  # a call is being sent or run: no need
                continue
            try:
                if self.broken is None and not self._closed:
                    self.send(PING)
            except Exception:  # recorded by send(); rank 0 stops serving
                return
            finally:
                self.lock.release()

    def close(self) -> None:
        """Stop the heartbeat and tell the followers to leave (rank 0; once)."""
        self._stop_beat.set()
        if self._beat is not None:
            self._beat.join()
        with self.lock:
            if self._closed or self.broken is not None:
                self._closed = True
                return
            try:
                self.send(STOP)
            finally:
                self._closed = True

    # -- followers ---------------------------------------------------------------------------------
    def receive(self) -> tuple:
        return self._broadcast(None)

    def _broadcast(self, message):
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class RankFigures:
    """What one rank holds, for ``/metrics``: KV bytes now and at their peak (sampled after every
    call), open sequences, and the prefix store's saved states (how many, their bytes, and a
    checksum of their entry ids: every rank of a healthy group holds the same entries)."""

    def __init__(self, executor, rank: int):
        self.executor, self.rank = executor, rank
        self.kv_bytes_peak = 0

    def after_call(self) -> None:
        self.kv_bytes_peak = max(self.kv_bytes_peak, self.executor.kv_bytes())

    def __call__(self) -> dict:
        saved = _saved_entries(self.executor)
        saved_bytes = getattr(self.executor, "saved_bytes", None)
        return {"rank": self.rank, "kv_bytes": self.executor.kv_bytes(), "kv_bytes_peak": self.kv_bytes_peak,
                "sequences": _open_sequences(self.executor), "saved_entries": len(saved),
                "saved_bytes": saved_bytes() if callable(saved_bytes) else 0,
                "saved_checksum": zlib.crc32(",".join(map(str, saved)).encode())}


def _open_sequences(executor) -> int:
    count = getattr(executor, "sequences", None)
    return count() if callable(count) else len(executor._specs)


def _saved_entries(executor) -> list[int]:
    """The ids of the saved states ``executor`` holds, sorted (none for an executor with no store)."""
    entries = getattr(executor, "saved_entries", None)
    return entries() if callable(entries) else []


class Leader:
    """Rank 0's executor: each call is broadcast to the followers, then run here. Read-only
    methods (``LOCAL_ONLY``) and attributes are rank 0's own."""

    def __init__(self, executor, channel: Channel, figures: RankFigures | None = None):
        self._executor = executor
        self._channel = channel
        self._figures = figures or RankFigures(executor, 0)

    def __getattr__(self, name: str):
        value = getattr(self._executor, name)
        if name.startswith("_") or name in LOCAL_ONLY or not inspect.ismethod(value):
            return value
        channel = self._channel

        @functools.wraps(value)
        def call(*args, **kwargs):
            with channel.lock:
                try:
                    channel.send(CALL, (name, args, kwargs))
                except Exception:
                    if name not in CACHE_ONLY:
                        raise
                    return value(*args, **kwargs)  # the group is gone: rank 0's own cleanup only
                try:
                    result = value(*args, **kwargs)
                except BaseException as exc:
                    channel.previous_ok = False
                    if _is_comm_error(exc):
                        channel.fail(exc)
                    raise
                channel.previous_ok = True
                self._figures.after_call()
                return result

        return call

    def rank_figures(self) -> list[dict]:
        """Every rank's ``RankFigures``, gathered between two calls (rank order)."""
        channel = self._channel
        with channel.lock:
            channel.send(STATS)
            return channel.gather(self._figures())


class RankCollector:
    """Prometheus gauges with one sample per rank (label ``rank``), gathered at scrape time."""

    def __init__(self, leader: Leader):
        self.leader = leader

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        try:
            ranks = self.leader.rank_figures()
        except Exception:  # the group stopped or broke (recorded by the channel): nothing to report
            return
        families = (
            ("h2okv_rank_kv_bytes_in_use", "Bytes of KV slot buffers this tensor-parallel rank holds", "kv_bytes"),
            ("h2okv_rank_kv_bytes_peak", "Most KV bytes this tensor-parallel rank held after any call",
             "kv_bytes_peak"),
            ("h2okv_rank_sequences", "Sequences open in this tensor-parallel rank's executor", "sequences"),
            ("h2okv_rank_prefix_cache_entries", "Saved states (prefix store) this tensor-parallel rank holds",
             "saved_entries"),
            ("h2okv_rank_prefix_cache_bytes", "Bytes of the saved states (prefix store) this tensor-parallel rank "
             "holds", "saved_bytes"),
            ("h2okv_rank_prefix_cache_checksum", "CRC-32 of the ids of the saved states this tensor-parallel rank "
             "holds: the same on every rank of a healthy group", "saved_checksum"),
        )
        for name, doc, key in families:
            family = GaugeMetricFamily(name, doc, labels=["rank"])
            for figures in ranks:
                family.add_metric([str(figures["rank"])], figures[key])
            yield family


def follow(executor, channel: Channel, figures: RankFigures) -> None:
    """A follower's life: run rank 0's calls on ``executor`` until ``stop``. Raises ``GroupBroken``
    when this rank's state diverged from rank 0's, and the communication error when rank 0 is gone."""
    previous = {sig: signal.signal(sig, _ignored) for sig in (signal.SIGTERM, signal.SIGINT)}  # rank 0 decides
    try:
        _follow(executor, channel, figures)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _follow(executor, channel: Channel, figures: RankFigures) -> None:
    ok = True
    last = None
    with torch.inference_mode():
        while True:
            kind, leader_ok, payload = channel.receive()
            if last is not None and leader_ok != ok:
                here, there = ("failed", "succeeded") if not ok else ("succeeded", "failed")
                raise GroupBroken(f"rank {channel.rank} diverged from rank 0: call {last}() {here} here "
                                  f"but {there} on rank 0")
            last = None
            if kind == STOP:
                return
            if kind == PING:
                continue
            if kind == STATS:
                channel.gather(figures())
                continue
            name, args, kwargs = payload
            last = name
            try:
                getattr(executor, name)(*args, **kwargs)
                ok = True
                figures.after_call()
            except Exception as exc:
                if _is_comm_error(exc):
                    raise
                ok = False  # rank 0 met it too (checked with the next message): its requests failed
                log.warning("call %s failed (as on rank 0, checked next): %s: %s", name, type(exc).__name__, exc)


def _ignored(sig, frame) -> None:
    log.info("rank follower: signal %s ignored (rank 0 drives the shutdown)", sig)
