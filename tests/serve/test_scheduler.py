"""The scheduler as a pure function: plain-data state in, plain-data plan out. No threads, no
model, no server: every state is built by hand and every plan checked to the token."""

import pytest

from h2okv.serve.memory import Reservation, prefill_chunks
from h2okv.serve.scheduler import PrefillRound, Scheduler, SchedulerState, SeqState, padded_tokens


def seq(uid, policy="h2o", slots=10, extra=5, width=16, started=False):
    """A sequence holding ``slots`` while decoding and ``extra`` more while prefilling."""
    return SeqState(uid, policy, Reservation(slots, slots + extra, slots + extra), width, started)


def state(waiting=(), prefilling=(), decoding=(), spent=0):
    return SchedulerState(tuple(waiting), tuple(prefilling), tuple(decoding), spent)


# -- admission -----------------------------------------------------------------------------------
def test_admission_stops_at_the_memory_cap():
    """Each admitted request adds its decode slots; one overshoot (the largest) is kept in reserve:
    k requests of 10 + 5 slots need 10k + 5."""
    waiting = [seq(i) for i in range(5)]
    assert Scheduler(kv_memory=35).admit(state(waiting)) == 3
    assert Scheduler(kv_memory=34).admit(state(waiting)) == 2
    assert Scheduler(kv_memory=35, slot_bytes=2).admit(state(waiting)) == 1  # 15 slots = 30 bytes
    assert Scheduler(kv_memory=None).admit(state(waiting)) == 5


def test_admission_counts_what_is_running():
    running = [seq(10, started=True), seq(11, started=True)]
    decoding = [seq(12, width=0, started=True)]
    # running: 3 rows x 10 + 2 started overshoots x 5 = 40; a new one: +10 rows, +5 reserve
    assert Scheduler(kv_memory=55).admit(state([seq(0)], running, decoding)) == 1
    assert Scheduler(kv_memory=54).admit(state([seq(0)], running, decoding)) == 0


def test_admission_is_fifo_a_blocked_request_blocks_the_ones_behind():
    waiting = [seq(0), seq(1, slots=30), seq(2)]
    scheduler = Scheduler(kv_memory=40)
    # the big one needs 10 + 30 + 5 = 45 > 40; the small one behind it (25) would fit, but waits
    assert scheduler.admit(state(waiting)) == 1
    assert scheduler.admit(state([waiting[0], waiting[2]])) == 2


def test_a_decode_batch_costs_rows_times_its_widest_row():
    """Rows of one policy share a capacity: a 20-slot row joining a 10-slot row costs 2 x 20."""
    decoding = [seq(1, slots=10, width=0, started=True)]
    scheduler = Scheduler(kv_memory=45)
    assert scheduler.footprint(state(decoding=decoding), extra=(seq(0, slots=20),)) == 2 * 20 + 5
    assert scheduler.admit(state([seq(0, slots=20)], decoding=decoding)) == 1
    # another policy is another batch: 10 + 20 + 5
    assert scheduler.footprint(state(decoding=decoding), extra=(seq(0, "local", slots=20),)) == 35
    assert Scheduler(kv_memory=44).admit(state([seq(0, slots=20)], decoding=decoding)) == 0


def test_admission_stops_at_max_batch():
    waiting = [seq(i) for i in range(6)]
    active = state(waiting, prefilling=[seq(10)], decoding=[seq(11, width=0, started=True)])
    assert Scheduler(max_batch=4).admit(active) == 2
    assert Scheduler(max_batch=2).admit(active) == 0
    assert Scheduler(max_batch=64).admit(active) == 6


def test_admission_keeps_the_reserve_that_lets_the_oldest_prompt_start():
    """Liveness under a tight cap. G is prefilling, X (a big overshoot) waits to start. Admitting Y
    would fit without the reserve, but then X could never start (the oldest blocks the rest: a
    livelock); with the reserve, Y waits and X starts as soon as G's group drains."""
    g, x = seq(0, started=True), seq(1, extra=20)
    y = seq(2, slots=15, extra=0)
    scheduler = Scheduler(kv_memory=50)
    before = state([y], prefilling=[g, x])
    assert scheduler.footprint(before, extra=(y,), reserve=False) == 3 * 15 + 5 <= 50  # fits without
    assert scheduler.footprint(before, extra=(y,)) == 3 * 15 + 5 + 20 > 50
    assert scheduler.admit(before) == 0
    # G's prompt is fed: it decodes now; X starts (2 rows x 10 + its 20 over = 40)
    after = state([y], prefilling=[x], decoding=[seq(0, width=0, started=True)])
    assert scheduler.prefill_round(after).forwards == ((1,),)
    # had Y been admitted, X could not start: 3 x 15 + 20 > 50
    stuck = state(prefilling=[x, y], decoding=[seq(0, width=0, started=True)])
    assert scheduler.prefill_round(stuck) == PrefillRound()


def test_serial_admission_counts_one_overshoot():
    """Serial prefill runs one prompt at a time, alone: the largest overshoot of a prompt prefilled
    alone counts once, not per prompt (and not its overshoot in a shared group)."""
    def alone_peak(uid, extra):
        return SeqState(uid, "h2o", Reservation(10, 10 + extra, 30), 16, False)

    prefilling = [alone_peak(0, 5), alone_peak(1, 8)]
    scheduler = Scheduler("serial", kv_memory=10**6)
    assert scheduler.footprint(state(prefilling=prefilling)) == 2 * 10 + 8
    assert scheduler.footprint(state(prefilling=prefilling), extra=(alone_peak(2, 3),)) == 3 * 10 + 8
    assert Scheduler("budget").footprint(state(prefilling=prefilling)) == 2 * 10 + 20
    assert Scheduler("serial", kv_memory=2 * 10 + 8).admit(state(prefilling[1:], prefilling[:1])) == 1


def test_a_request_alone_is_judged_by_its_schedule_overshoot():
    res = Reservation(slots=21, prefill_peak=36, shared_peak=40)
    assert Scheduler("serial", slot_bytes=2).alone_bytes(res) == (21 + 15) * 2
    assert Scheduler("budget", slot_bytes=2).alone_bytes(res) == (21 + 19) * 2


# -- shared prefill (budget schedule) ----------------------------------------------------------------
def test_started_prompts_then_the_oldest_new_ones_within_step_tokens():
    a = seq(0, width=16, started=True)
    b, c, d = seq(1, width=16), seq(2, "full", width=8), seq(3, width=16)
    plan = Scheduler(step_tokens=48).prefill_round(state(prefilling=[a, b, c, d]))
    # h2o: 2 rows x 16, full: 1 x 8 = 40; D would make it 3 x 16 + 8 = 56 > 48
    assert plan == PrefillRound(((0, 1), (2,)), 40)


def test_rows_are_padded_to_the_longest_chunk_of_their_policy():
    assert padded_tokens([seq(0, width=16), seq(1, width=4), seq(2, "full", width=4)]) == 2 * 16 + 4
    plan = Scheduler(step_tokens=32).prefill_round(state(prefilling=[seq(0, width=16), seq(1, width=4)]))
    assert plan == PrefillRound(((0, 1),), 32)
    # with only 31 tokens the short prompt does not fit beside the long one (2 x 16 > 31)
    assert Scheduler(step_tokens=31).prefill_round(state(prefilling=[seq(0, width=16), seq(1, width=4)])) \
        == PrefillRound(((0,),), 16)


def test_new_prompts_join_oldest_first_without_skipping():
    a = seq(0, width=16, started=True)
    b, c = seq(1, width=16), seq(2, "full", width=4)
    # B does not fit (2 x 16 > 24); C would (16 + 4), but it is behind B
    assert Scheduler(step_tokens=24).prefill_round(state(prefilling=[a, b, c])).forwards == ((0,),)
    # forwards keep the order of first appearance: the started prompts' policy first
    z = seq(5, "local", width=8, started=True)
    plan = Scheduler(step_tokens=64).prefill_round(state(prefilling=[z, a, b, c]))
    assert plan.forwards == ((5,), (0, 1), (2,))


def test_new_prompts_start_only_within_the_memory_cap():
    """A prompt starts if the footprint with it started (each started prompt's overshoot, no
    reserve) fits: 2 rows x 10 + 5 per started prompt."""
    prefilling = [seq(0), seq(1), seq(2)]
    assert Scheduler(kv_memory=35, step_tokens=512).prefill_round(state(prefilling=prefilling)).forwards == ((0,),)
    assert Scheduler(kv_memory=40, step_tokens=512).prefill_round(state(prefilling=prefilling)).forwards == ((0, 1),)
    assert Scheduler(kv_memory=45, step_tokens=512).prefill_round(state(prefilling=prefilling)).forwards \
        == ((0, 1, 2),)


def test_a_step_ends_when_its_tokens_are_spent():
    prefilling = [seq(0, width=16, started=True), seq(1, width=16, started=True)]
    scheduler = Scheduler(step_tokens=64)
    assert scheduler.prefill_round(state(prefilling=prefilling, spent=32)) == PrefillRound(((0, 1),), 32)
    assert scheduler.prefill_round(state(prefilling=prefilling, spent=40)) == PrefillRound()  # 32 > 24 left
    assert scheduler.prefill_round(state(prefilling=prefilling, spent=64)) == PrefillRound()
    assert scheduler.prefill_round(state()) == PrefillRound()


def test_no_livelock_when_step_tokens_is_below_a_chunk():
    """A step's first round always runs: the started group even when it is wider than the step,
    and the oldest new prompt alone whatever its chunk; later rounds of the step run nothing."""
    group = [seq(0, width=16, started=True), seq(1, width=16, started=True), seq(2, width=16)]
    scheduler = Scheduler(step_tokens=8)
    assert scheduler.prefill_round(state(prefilling=group)) == PrefillRound(((0, 1),), 32)
    assert scheduler.prefill_round(state(prefilling=group, spent=32)) == PrefillRound()
    assert scheduler.prefill_round(state(prefilling=[seq(3, width=16)])) == PrefillRound(((3,),), 16)


# -- serial ------------------------------------------------------------------------------------------
def test_serial_runs_one_chunk_of_the_oldest_prompt_once_a_step():
    prefilling = [seq(0, width=16, started=True), seq(1, "full", width=4), seq(2, width=16)]
    scheduler = Scheduler("serial", step_tokens=512)
    assert scheduler.prefill_round(state(prefilling=prefilling)) == PrefillRound(((0,),), 16)
    assert scheduler.prefill_round(state(prefilling=prefilling, spent=16)) == PrefillRound()
    assert Scheduler("serial", step_tokens=4).prefill_round(state(prefilling=prefilling)).forwards == ((0,),)


# -- decode ------------------------------------------------------------------------------------------
def test_every_decode_batch_steps_in_batch_order():
    decoding = [seq(0, "tova", width=0), seq(1, "tova", width=0), seq(2, "h2o", width=0), seq(3, "full", width=0)]
    assert Scheduler().decode(state(decoding=decoding)) == ["tova", "h2o", "full"]
    assert Scheduler().decode(state(prefilling=[seq(4)])) == []


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule"):
        Scheduler("round-robin")


# -- whole steps -------------------------------------------------------------------------------------
def simulate(scheduler: Scheduler, prompts: list[int], chunk: int, max_steps: int = 100) -> tuple[dict, list]:
    """Run the scheduler's plans on bookkeeping alone (the engine's loop without a model): returns
    the step at which each prompt got its first token, and the prompt tokens computed per step."""
    chunks = {uid: prefill_chunks(n, chunk) for uid, n in enumerate(prompts)}
    fed = dict.fromkeys(chunks, 0)
    waiting, prefilling, decoding = list(chunks), [], []
    first_token, per_step = {}, []

    def view(uid):
        width = 0 if fed[uid] == len(chunks[uid]) else chunks[uid][fed[uid]][1] - chunks[uid][fed[uid]][0]
        return SeqState(uid, "h2o", Reservation(10, 15, 15), width, fed[uid] > 0)

    def now(spent=0, queue=()):
        return SchedulerState(tuple(map(view, queue)), tuple(map(view, prefilling)), tuple(map(view, decoding)),
                              spent)

    for step in range(max_steps):
        admitted = scheduler.admit(now(queue=waiting))
        prefilling += waiting[:admitted]
        del waiting[:admitted]
        spent = 0
        while (plan := scheduler.prefill_round(now(spent))).forwards:
            spent += plan.tokens
            for uid in (u for forward in plan.forwards for u in forward):
                fed[uid] += 1
                if fed[uid] == len(chunks[uid]):
                    prefilling.remove(uid)
                    decoding.append(uid)
                    first_token[uid] = step
        per_step.append(spent)
        if len(first_token) == len(prompts):
            return first_token, per_step
    raise AssertionError(f"not every prompt started in {max_steps} steps: {first_token}")


def test_a_short_prompt_starts_beside_a_long_one():
    """As the engine test: budget schedule, 4 chunks a step. Step 0 shares the long prompt's first
    chunk with the short prompt (2 rows x 16), then runs its chunks 2 and 3; 4 chunks a step after
    that, so its 12 chunks end in step 3. Serial: one chunk a step, the short prompt waits."""
    first, per_step = simulate(Scheduler(step_tokens=64), [12 * 16, 8], 16)
    assert first == {1: 0, 0: 3} and per_step == [64, 64, 64, 16]
    first, per_step = simulate(Scheduler("serial", step_tokens=16), [12 * 16, 8], 16)
    assert first == {0: 11, 1: 12} and per_step == [16] * 12 + [8]


def test_every_prompt_starts_under_a_tight_cap():
    """Many prompts of several chunks under a cap that lets only a few prefill at once: every one
    gets its first token, and no step computes more than step_tokens (a group's first round aside)."""
    scheduler = Scheduler(kv_memory=10 * 10 + 3 * 5, max_batch=10, step_tokens=48)
    first, per_step = simulate(scheduler, [40, 70, 23, 90, 16, 55, 31, 64], 16)
    assert len(first) == 8 and max(per_step) <= 48
