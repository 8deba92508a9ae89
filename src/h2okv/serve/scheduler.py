"""The scheduler: a pure function of the engine's state (plain data in, a plain-data plan out).

No threads, no model, no torch: the engine (``engine.py``) builds a ``SchedulerState`` from its
sequences, asks, and carries the answer out. One engine step asks three questions:

1. ``admit(state)``: how many of the oldest waiting requests enter now. In arrival order, while the
   batch has room (``max_batch``) and the KV footprint with them admitted stays within
   ``kv_memory`` (``memory.py``); the first that does not fit stops admission (FIFO, no skipping).
2. ``prefill_round(state)``: the prefill forwards of one round, asked again after each round
   has run (its forwards change the state: prompts advance a chunk, finished ones leave, failed
   ones are gone) until it answers no forwards. ``state.spent``: the prompt tokens, pads
   included, that the step's earlier rounds computed.
   - ``"serial"``: one chunk of the oldest prompt, alone, once a step.
   - ``"budget"``: every started prompt (a prefill group needs all its rows in each forward)
     plus the oldest prompts not started yet, while the padded size (per policy: rows x longest
     next chunk) stays within what is left of ``step_tokens`` and the footprint with them started
     within ``kv_memory``; one forward per policy. Rounds go on until ``step_tokens`` is spent.
     Liveness: a step's first round always runs its started prompts, and the oldest prompt
     starts alone whatever its chunk costs, so a ``step_tokens`` below one chunk still advances.
3. ``decode(state)``: the policies whose decode batches step now (every batch with rows).

Forwards and rows are named by sequence ``uid``s, in the order they run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter

from h2okv.serve.memory import Reservation, footprint_slots

SCHEDULES = ("budget", "serial")
_policy = attrgetter("policy")


@dataclass(frozen=True)
class SeqState:
    """One sequence as the scheduler sees it."""

    uid: int
    policy: str
    reservation: Reservation
    next_width: int = 0  # tokens of its next prefill chunk (0 once its prompt is fed)
    started: bool = False  # it has fed at least one chunk of its prompt


@dataclass(frozen=True)
class SchedulerState:
    waiting: tuple[SeqState, ...] = ()  # submitted, not admitted yet; oldest first
    prefilling: tuple[SeqState, ...] = ()  # admitted, prompt not fully fed; oldest first
    decoding: tuple[SeqState, ...] = ()  # the decode rows, batch after batch
    spent: int = 0  # prompt tokens (pads included) this step's earlier prefill rounds computed

    @property
    def active(self) -> tuple[SeqState, ...]:
        return self.prefilling + self.decoding


@dataclass(frozen=True)
class PrefillRound:
    forwards: tuple[tuple[int, ...], ...] = ()  # uids per forward (one policy each), in order
    tokens: int = 0  # what these forwards compute: per forward, rows x the longest chunk


@dataclass(frozen=True)
class Scheduler:
    schedule: str = "budget"
    kv_memory: int | None = None  # bytes; None: no limit
    slot_bytes: int = 1  # bytes of one KV slot (one token, every layer and KV head)
    max_batch: int = 32
    step_tokens: int = 512

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")

    # -- the plan ------------------------------------------------------------------------------
    def admit(self, state: SchedulerState) -> int:
        """How many of ``state.waiting`` (a prefix: the oldest) to admit into prefill now."""
        admitted: list[SeqState] = []
        for seq in state.waiting:
            with_admitted = replace(state, prefilling=state.prefilling + tuple(admitted))
            if len(with_admitted.active) >= self.max_batch or not self._fits(with_admitted, seq):
                break
            admitted.append(seq)
        return len(admitted)

    def prefill_round(self, state: SchedulerState) -> PrefillRound:
        """The next round of prefill forwards of this step; no forwards: the step's prefill is over."""
        if not state.prefilling or state.spent >= self.step_tokens:
            return PrefillRound()
        if self.schedule == "serial":
            chosen = [] if state.spent else [state.prefilling[0]]
        else:
            chosen = self._shared_round(state, self.step_tokens - state.spent, first=state.spent == 0)
        forwards: dict[str, list[int]] = {}
        for seq in chosen:
            forwards.setdefault(seq.policy, []).append(seq.uid)
        return PrefillRound(tuple(tuple(uids) for uids in forwards.values()), padded_tokens(chosen))

    def decode(self, state: SchedulerState) -> list[str]:
        """The policies whose decode batches step now, in batch order."""
        return list(dict.fromkeys(map(_policy, state.decoding)))  # (map: no Python frame per row, each step)

    # -- memory ---------------------------------------------------------------------------------
    def footprint(self, state: SchedulerState, extra: tuple[SeqState, ...] = (),
                  started: list[SeqState] | None = None, reserve: bool = True) -> int:
        """Slots held at worst (``memory.py``) with ``extra`` admitted and, for the shared schedule,
        ``started`` (default: the prompts part-way through) in the prefill groups; ``reserve``: plus
        the largest overshoot of the prompts not started (what admission keeps free so that the
        oldest of them can start once the groups drain)."""
        rows: dict[str, list[Reservation]] = {}
        for seq in state.active + tuple(extra):
            rows.setdefault(seq.policy, []).append(seq.reservation)
        prefilling = state.prefilling + tuple(extra)
        if self.schedule == "serial":
            return footprint_slots(rows, [s.reservation for s in prefilling])
        if started is None:
            started = [s for s in state.prefilling if s.started]
        groups: dict[str, list[Reservation]] = {}
        for seq in started:
            groups.setdefault(seq.policy, []).append(seq.reservation)
        uids = {s.uid for s in started}
        unstarted = [s.reservation for s in prefilling if s.uid not in uids] if reserve else []
        return footprint_slots(rows, unstarted, groups)

    def alone_bytes(self, reservation: Reservation) -> int:
        """Bytes a request holds at worst with nothing else running: above ``kv_memory`` it can never
        be admitted."""
        extra = reservation.prefill_extra if self.schedule == "serial" else reservation.shared_extra
        return (reservation.slots + extra) * self.slot_bytes

    def _within_memory(self, slots: int) -> bool:
        return self.kv_memory is None or slots * self.slot_bytes <= self.kv_memory

    def _fits(self, state: SchedulerState, candidate: SeqState) -> bool:
        return self.kv_memory is None or self._within_memory(self.footprint(state, extra=(candidate,)))

    def _shared_round(self, state: SchedulerState, room: int, first: bool) -> list[SeqState]:
        """The sequences of one shared round: every started prompt (when they started their padded
        size fitted the budget, and a started prompt's later chunks are never longer than its
        first), then the oldest prompts not started yet, while the padded size stays within ``room``
        and the KV footprint with them started within ``kv_memory``. Empty if the started ones alone
        exceed ``room`` (except in a step's ``first`` round)."""
        chosen = [s for s in state.prefilling if s.started]
        if chosen and not first and padded_tokens(chosen) > room:
            return []
        for seq in state.prefilling:
            if seq.started:
                continue
            if chosen and padded_tokens(chosen + [seq]) > room:
                break
            # no reserve for the prompts after it: they start once the groups drain (see memory.py)
            if (self.kv_memory is not None
                    and not self._within_memory(self.footprint(state, started=chosen + [seq], reserve=False))):
                break
            chosen.append(seq)
        return chosen


def padded_tokens(seqs: list[SeqState]) -> int:
    """Tokens a round's prefill forwards compute: per policy, rows x the longest next chunk."""
    width: dict[str, int] = {}
    rows: dict[str, int] = {}
    for seq in seqs:
        width[seq.policy] = max(width.get(seq.policy, 0), seq.next_width)
        rows[seq.policy] = rows.get(seq.policy, 0) + 1
    return sum(rows[p] * width[p] for p in rows)
