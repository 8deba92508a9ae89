"""The serving engine without HTTP: batched decoding is exact, admission follows KV memory, failures
and cancellations stay with their request. Tiny random models (byte-level tokenizer)."""

import threading
import time

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.serve.batch import DecodeBatch
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.errors import ErrorKind, ServeError
from h2okv.serve.memory import footprint_slots, prefill_chunks, reservation
from h2okv.serve.sampling import INVALID
from h2okv.serve.text import TextStream
from serve_cases import CHUNK, alone, prompt, submit_in_two

# a request of this many tokens ends only when cancelled (or timed out): no machine decodes 10**6
# tokens while a test looks (1,500 could end early on a fast machine)
NEVER_ENDS = 10**6


@pytest.fixture
def engine(model_tok):
    model, tok = model_tok
    eng = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=16))
    eng.start()
    yield eng
    eng.stop()


# prompt lengths are never 1 mod CHUNK, so the engine's chunks are exactly generate's
CASES = [  # (prompt length, policy, heavy, recent, new tokens)
    (40, "h2o", 6, 6, 20),
    (23, "h2o", 4, 5, 12),
    (70, "h2o", 8, 8, 25),
    (9, "h2o", 10, 10, 18),  # budget larger than the prompt: no eviction yet
    (55, "local", 0, 12, 16),
    (34, "sink", 3, 9, 14),
    (30, "full", None, None, 15),
    (61, "full", None, None, 9),
    # the policies beyond vanilla h2o batch the same way (snapkv's look-back window covers one
    # forward call, so its prompt fits one chunk here, as in generate)
    (45, "h2o-mean", 6, 6, 15),
    (38, "tova", 5, 7, 14),
    (50, "h2o-sink", 6, 6, 12),
    (14, "snapkv:window=4", 4, 4, 12),
    (13, "expected:future=32", 4, 4, 12),  # issue 16's question-agnostic scorer, ranked like snapkv
]


@pytest.mark.parametrize("schedule,step_tokens", [("budget", 3 * CHUNK), ("serial", CHUNK)])
def test_batched_greedy_equals_alone(model_tok, schedule, step_tokens):
    """Mixed lengths, budgets, policies and join times in one engine, with either prefill schedule:
    every sequence's tokens equal its tokens generated alone (batch of one, model.generate)."""
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=16, schedule=schedule,
                                                step_tokens=step_tokens))
    engine.start()
    try:
        _check_batched_equals_alone(engine, model)
    finally:
        engine.stop()


def _check_batched_equals_alone(engine, model):
    requests = [GenerationRequest(prompt(n, i), steps, policy, heavy, recent, temperature=0.0, ignore_eos=True)
                for i, (n, policy, heavy, recent, steps) in enumerate(CASES)]
    # the first four arrive together; the later ones join while the first are mid-decode: submitted
    # while the engine waits at its 4th decode step (the first rows hold at most 4 of their 12+ tokens).
    # A sleep put them anywhere: after the first had finished on a fast machine
    handles = submit_in_two(engine, requests, 4, "decode", calls=4)
    for (n, policy, heavy, recent, steps), handle, i in zip(CASES, handles, range(len(CASES)), strict=True):
        _, done = handle.result_blocking()
        assert done.kind == "done" and done.finish_reason == "length"
        assert done.token_ids == alone(model, prompt(n, i), policy, heavy, recent, steps), (policy, n)
    assert engine.stats.batch_size_max >= 3  # really batched, not one at a time
    assert engine.stats.kv_bytes == 0 and engine.stats.running == 0


@pytest.mark.parametrize("schedule", ["budget", "serial"])
def test_prefill_schedules(model_tok, monkeypatch, schedule):
    """A short prompt behind a long one. Budget schedule: the short prompt starts beside the long
    one's first chunk (one shared forward) and gets its first token in the first step; then the long
    prompt feeds one chunk per forward, several forwards a step, and no step computes more than
    ``step_tokens`` prompt tokens (pads included). Serial schedule: one chunk per step, the short
    prompt waits for the long one."""
    model, tok = model_tok
    step_tokens = 4 * CHUNK
    eng = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, schedule=schedule, step_tokens=step_tokens))
    first_token_step, per_step, steps, partial, rows = {}, [0], [0], [], []
    advance, prefill, iteration = eng._advance, eng.executor.prefill, eng._iteration

    def record_advance(seq, *args):
        if not seq.generated:
            first_token_step[len(seq.request.prompt_ids)] = steps[0]
        return advance(seq, *args)

    def record_prefill(parts):
        per_step[-1] += len(parts) * max(len(ids) for _, ids, _ in parts)
        rows.append(len(parts))
        out = prefill(parts)
        partial.append(len(eng.executor.prefilling("h2o")))
        return out

    def record_iteration():
        iteration()
        per_step.append(0)
        steps[0] += 1

    monkeypatch.setattr(eng, "_advance", record_advance)
    monkeypatch.setattr(eng.executor, "prefill", record_prefill)
    monkeypatch.setattr(eng, "_iteration", record_iteration)
    eng.start()
    try:
        long, short = eng.submit_many([
            GenerationRequest(prompt(12 * CHUNK, 1), 3, "h2o", 4, 4, temperature=0.0, ignore_eos=True),
            GenerationRequest(prompt(CHUNK // 2, 2), 3, "h2o", 4, 4, temperature=0.0, ignore_eos=True),
        ])
        for handle in (long, short):
            assert handle.result_blocking()[1].finish_reason == "length"
    finally:
        eng.stop()
    if schedule == "budget":
        assert max(per_step) <= step_tokens
        assert first_token_step[CHUNK // 2] == 0 and max(rows) == 2 and max(partial) == 2
        # step 0: the long prompt's chunks 1 to 3 (the first shared with the short prompt: 2 rows x 16
        # tokens), then 4 chunks a step: its 12 chunks end in step 3
        assert per_step[0] == step_tokens and first_token_step[12 * CHUNK] == 3
    else:
        assert max(per_step) <= CHUNK and max(rows) == 1 and max(partial) <= 1
        assert first_token_step[12 * CHUNK] == 11 and first_token_step[CHUNK // 2] >= 12


def _recording_prefill(engine, calls):
    """Record each prefill forward's chunk lengths (one call per policy per step)."""
    prefill = engine.executor.prefill

    def record(parts):
        calls.append([len(ids) for _, ids, _ in parts])
        return prefill(parts)

    engine.executor.prefill = record


@pytest.mark.parametrize("policy,heavy,recent", [("full", None, None), ("h2o", 5, 5), ("tova", 4, 6)])
def test_shared_prefill_greedy_equals_alone(model_tok, policy, heavy, recent):
    """Prompts of different lengths, several chunks each, some arriving later, share prefill forwards
    (budget schedule): every greedy completion equals the prompt generated alone (batch of one)."""
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=16, step_tokens=4 * CHUNK))
    calls = []
    _recording_prefill(engine, calls)
    # never 1 mod CHUNK: the engine's chunks are generate's; and greedy paths without EOS (the reference's
    # min_new_tokens forbids EOS while ignore_eos lets the engine pick it: tova on a 9-token prompt does)
    lengths = [70, 23, 52, 19, 40, 87, 30]
    requests = [GenerationRequest(prompt(n, 40 + i), 10 + i, policy,
                                  *((None, None) if heavy is None else (heavy + i % 3, recent + i % 2)),
                                  temperature=0.0, ignore_eos=True) for i, n in enumerate(lengths)]
    # the last three arrive while the first four are part-way through their prompts: submitted while
    # the engine waits at its second prefill forward (not after a sleep, which a machine's speed moves)
    engine.start()
    try:
        handles = submit_in_two(engine, requests, 4, "prefill", calls=2)
        for i, (n, handle) in enumerate(zip(lengths, handles, strict=True)):
            done = handle.result_blocking()[1]
            budget = (None, None) if heavy is None else (heavy + i % 3, recent + i % 2)
            assert done.token_ids == alone(model, prompt(n, 40 + i), policy, *budget, 10 + i), (n, policy)
    finally:
        engine.stop()
    assert any(len(c) >= 3 and len(set(c)) > 1 for c in calls)  # shared, with padding
    assert engine.stats.kv_bytes == 0


def test_kv_cap_holds_at_every_step_with_shared_prefill(model_tok):
    """Under a tight --kv-memory, with prompts of several chunks sharing prefill forwards while other
    rows decode, the KV buffers never exceed the cap: after every executor call, and inside each
    prefill forward (where a group's rows briefly hold their budget plus a whole chunk)."""
    model, tok = model_tok
    probe = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK))
    limit = 100 * probe.slot_bytes
    # 6 rows of 9 slots decode; 3 prompts (15 slots over that each) can share a prefill forward
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, kv_memory=limit, max_batch=6, step_tokens=4 * CHUNK))
    ex = engine.executor
    after, inside, calls = [], [], []
    _recording_prefill(engine, calls)
    for name in ("prefill", "join", "decode", "keep", "close"):
        method = getattr(ex, name)

        def watched(*args, _method=method, _name=name):
            for group in ex._groups.values():  # peak_capacity: the largest capacity since reset here
                for layer in group.cache.layers:
                    layer.peak_capacity = layer.capacity
            result = _method(*args)
            after.append(ex.kv_bytes())
            if _name == "prefill":
                decode = sum(batch.kv_bytes() for batch in ex._batches.values())
                groups = sum(len(g.uids) * max(layer.peak_capacity for layer in g.cache.layers)
                             for g in ex._groups.values())
                inside.append(decode + groups * probe.slot_bytes)
            return result
        setattr(ex, name, watched)
    cases = [("h2o", 4, 4), ("h2o", 3, 5), ("h2o", 5, 3), ("h2o", 2, 6)]  # 9 slots each
    engine.start()
    try:
        handles = engine.submit_many([GenerationRequest(prompt(80 + 7 * (i % 3), i), 30 + i % 7, *cases[i % 4],
                                                        temperature=0.0, ignore_eos=True) for i in range(24)])
        for h in handles:
            assert h.result_blocking()[1].kind == "done"
    finally:
        engine.stop()
    assert max(after) <= limit and max(inside) <= limit
    assert max(len(c) for c in calls) == 3 and engine.stats.batch_size_max >= 3
    assert engine.stats.kv_bytes == 0


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_request_ended_mid_shared_prefill_frees_its_row(model_tok, how):
    """A prompt ended (cancelled, or past its deadline) between two chunks of a shared prefill leaves
    its group at the next step; the others finish exactly as alone."""
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=8, step_tokens=4 * CHUNK))
    lengths = [90, 75, 60]
    groups, victim = [], {}
    prefill = engine.executor.prefill

    def record(parts):
        out = prefill(parts)
        groups.append(engine.executor.prefilling("h2o"))
        if len(groups) == 2:  # the victim is part-way through its prompt now
            seq = next(s for s in engine._prefilling if len(s.request.prompt_ids) == 75)
            victim["uid"] = seq.uid
            if how == "cancel":
                seq.handle.cancel()
            else:
                seq.deadline = time.monotonic() - 1  # past, whatever the clock's resolution
        return out

    engine.executor.prefill = record
    engine.start()
    try:
        # a deadline far off, which the victim's then passes (its clock moved; the others' never)
        handles = engine.submit_many([GenerationRequest(prompt(n, 60 + i), 8, "h2o", 5, 5, temperature=0.0,
                                                        ignore_eos=True, timeout=600.0) for i, n in enumerate(lengths)])
        results = [h.result_blocking()[1] for h in handles]
    finally:
        engine.stop()
    assert results[1].kind == ("cancelled" if how == "cancel" else "done")
    if how == "timeout":
        assert results[1].finish_reason == "timeout" and results[1].token_ids == []
    assert victim["uid"] in groups[1] and all(victim["uid"] not in g for g in groups[2:])
    assert len(groups[2]) == 2  # the others went on sharing
    for i in (0, 2):
        assert results[i].token_ids == alone(model, prompt(lengths[i], 60 + i), "h2o", 5, 5, 8)
    assert engine.stats.kv_bytes == 0 and engine.stats.running == 0


def test_decode_batch_rows_keep_their_state(model_tok):
    """Adding rows pads capacity without touching live slots; dropping rows keeps the others intact."""
    model, _ = model_tok
    batch = DecodeBatch("h2o")
    caches = []
    for i, n in enumerate((12, 30, 20)):
        cache = H2OCache(model, policy="h2o", heavy=3 + i, recent=4, chunk_size=CHUNK)
        model(torch.tensor([prompt(n, i)]), **cache_arg(cache))
        caches.append((n, [(layer.keys.clone(), layer.valid.clone()) for layer in cache.layers]))
        batch.add([i], cache, 3 + i + 4 + 1)
    assert batch.capacity == 10 and all(layer.capacity == 10 for layer in batch.cache.layers)
    assert batch.cache.row_budgets.heavy.tolist() == [3, 4, 5]
    batch.keep([0, 2], 9)
    assert batch.cache.row_budgets.heavy.tolist() == [3, 5]
    assert batch.capacity == 10  # never below the largest kept budget + 1 (5 + 4 + 1): no step has to grow it
    for row, original in ((0, caches[0][1]), (1, caches[2][1])):
        for layer, (keys, valid) in zip(batch.cache.layers, original, strict=True):
            live = layer.read("keys")[row][layer.read("valid")[row]]  # uneven budgets may run flat
            assert torch.equal(live, keys[0][valid[0]])  # same live keys, same (live-first) order
    batch.keep([], 0)
    assert batch.cache is None and batch.kv_bytes() == 0


def test_joined_rows_evict_exactly_as_alone(model_tok):
    """Deterministic version of the engine test: rows with smaller budgets, and one whose prompt is
    shorter than its budget, join a batch whose first row is already at its budget; every decode
    step keeps the same tokens per (layer, head) as each row run alone."""
    model, _ = model_tok
    rows = [(40, 6, 6), (23, 4, 5), (9, 10, 10)]  # (prompt, heavy, recent)

    def prefilled(i):
        n, heavy, recent = rows[i]
        cache = H2OCache(model, policy="h2o", heavy=heavy, recent=recent, chunk_size=CHUNK)
        ids = prompt(n, i)
        for start, stop in prefill_chunks(n, CHUNK):
            logits = model(torch.tensor([ids[start:stop]]), position_ids=torch.arange(start, stop)[None],
                           **cache_arg(cache)).logits
        return cache, int(logits[0, -1].argmax())

    batch, alone_caches, last = DecodeBatch("h2o"), [], []
    for i, (n, heavy, recent) in enumerate(rows):
        cache, token = prefilled(i)
        alone_caches.append(prefilled(i)[0])
        batch.add([i], cache, min(heavy + recent + 1, n + 8))
        last.append(token)
    for step in range(6):
        positions = torch.tensor([[n + step] for n, _, _ in rows])
        batched = model(torch.tensor([[t] for t in last]), position_ids=positions,
                        **cache_arg(batch.cache)).logits[:, -1]
        for i, cache in enumerate(alone_caches):
            single = model(torch.tensor([[last[i]]]), position_ids=positions[i:i + 1], **cache_arg(cache)).logits
            torch.testing.assert_close(batched[i], single[0, -1], atol=1e-4, rtol=0)
            for mine, theirs in zip(batch.cache.layers, cache.layers, strict=True):
                kept = [sorted(mine.ordinal[i, h][mine.valid[i, h]].tolist()) for h in range(mine.valid.shape[1])]
                assert kept == [sorted(theirs.ordinal[0, h][theirs.valid[0, h]].tolist())
                                for h in range(theirs.valid.shape[1])], (i, step)
        last = batched.argmax(-1).tolist()


def test_fit_capacity_refuses_to_drop_live_slots(model_tok):
    model, _ = model_tok
    cache = H2OCache(model, policy="full")
    model(torch.tensor([prompt(10, 0)]), **cache_arg(cache))
    with pytest.raises(RuntimeError):
        cache.fit_capacity(9)


def test_admission_by_kv_memory(model_tok):
    """At the same kv_memory an evicting policy runs several times more requests at once than full."""
    model, tok = model_tok
    n, steps = 48, 24
    probe = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK))
    full = reservation(n, steps, None, CHUNK)
    limit = (2 * full.slots + full.prefill_extra) * probe.slot_bytes  # exactly two full requests
    seen = {}
    for policy, heavy, recent in (("full", None, None), ("h2o", 4, 4)):
        eng = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, kv_memory=limit, max_batch=64))
        eng.start()
        try:
            # all twelve wait at once (one by one, a slow submitter could see each end before the next)
            handles = eng.submit_many([GenerationRequest(prompt(n, i), steps, policy, heavy, recent, temperature=0.0,
                                                         ignore_eos=True) for i in range(12)])
            for h in handles:
                assert h.result_blocking()[1].kind == "done"
            seen[policy] = eng.stats
        finally:
            eng.stop()
        assert seen[policy].kv_bytes_peak <= limit  # the limit holds for the buffers really allocated
        assert seen[policy].kv_bytes == 0
    assert seen["full"].batch_size_max == 2
    assert seen["h2o"].batch_size_max >= 3 * seen["full"].batch_size_max


def test_request_that_can_never_fit_is_rejected(model_tok):
    model, tok = model_tok
    eng = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, kv_memory=10_000))
    eng.start()
    try:
        with pytest.raises(ServeError, match="kv-memory") as info:
            eng.submit(GenerationRequest(prompt(200, 0), 50, "full"))
        assert info.value.kind is ErrorKind.INVALID_REQUEST and info.value.code == "kv_memory_exceeded"
    finally:
        eng.stop()


def test_cancel_frees_slots_and_others_continue(engine):
    long = engine.submit(GenerationRequest(prompt(30, 1), NEVER_ENDS, "h2o", 4, 4, temperature=0.0, ignore_eos=True))
    short = engine.submit(GenerationRequest(prompt(30, 2), 20, "h2o", 4, 4, temperature=0.0, ignore_eos=True))
    assert long.next_blocking(timeout=60).kind == "text"  # it is running
    long.cancel()
    _, last = long.result_blocking()
    assert last.kind == "cancelled"
    assert short.result_blocking()[1].finish_reason == "length"
    deadline = time.monotonic() + 60  # a safety net: the stats are published at the iteration's end
    while engine.stats.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats.running == 0 and engine.stats.kv_bytes == 0
    assert engine.stats.finished["cancelled"] == 1


def test_error_in_one_sequence_fails_only_it(engine, monkeypatch):
    import h2okv.serve.outputs as outputs_module

    real = outputs_module.sample_batch

    def flaky(logits, temperatures, top_ps, generators):  # the poisoned request's row samples NaN
        tokens = real(logits, temperatures, top_ps, generators)
        return [INVALID if t == 0.5 else token for t, token in zip(temperatures, tokens, strict=True)]

    monkeypatch.setattr(outputs_module, "sample_batch", flaky)
    good = [engine.submit(GenerationRequest(prompt(20, i), 10, "h2o", 3, 3, temperature=0.0)) for i in range(3)]
    bad = engine.submit(GenerationRequest(prompt(20, 9), 10, "h2o", 3, 3, temperature=0.5))
    _, event = bad.result_blocking()
    assert event.kind == "error" and event.error.kind is ErrorKind.INTERNAL and "nan" in event.error.message
    assert all(h.result_blocking()[1].kind == "done" for h in good)
    assert engine.alive


POISON = 257  # a token id no other test prompt holds (prompt() draws from 0..255)


def test_poisoned_row_in_a_shared_prefill_fails_alone(model_tok, monkeypatch):
    """A forward shared by four prompts fails because of one of them (here: a fault injected for
    any forward that feeds the POISON token, standing for an input no check caught): that one
    fails, the other three start over and generate exactly what they generate alone."""
    model, tok = model_tok
    eng = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=16, step_tokens=4096))
    real = eng.executor.prefill
    forwards = {"shared_failed": 0}

    def poisoned(parts):
        if any(POISON in ids for _, ids, _ in parts):
            forwards["shared_failed"] += len(parts) > 1
            real(parts)  # the real forward runs (and half-writes the group's cache) before the failure
            raise RuntimeError("poisoned row")
        return real(parts)

    monkeypatch.setattr(eng.executor, "prefill", poisoned)
    eng.start()
    try:
        requests = [GenerationRequest(prompt(40 + 7 * i, 100 + i), 12, "h2o", 5, 5, temperature=0.0,
                                      ignore_eos=True) for i in range(3)]
        by_itself = [eng.submit(r).result_blocking()[1].token_ids for r in requests]
        # queued at once, so the four start in one shared forward (one by one, the first three could
        # finish their prompts before the poisoned one arrived)
        *good, bad = eng.submit_many([*requests, GenerationRequest([POISON] * 45, 12, "h2o", 5, 5, temperature=0.0)])
        _, event = bad.result_blocking()
        assert event.kind == "error" and "poisoned row" in event.error.message
        for handle, expected in zip(good, by_itself, strict=True):
            _, done = handle.result_blocking()
            assert done.kind == "done" and done.token_ids == expected
        assert forwards["shared_failed"] >= 1  # the four did share the forward that failed
        deadline = time.monotonic() + 60  # a safety net: the stats are published at the iteration's end
        while eng.stats.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.stats.kv_bytes == 0 and eng.alive
    finally:
        eng.stop()


def test_request_that_could_break_a_shared_forward_is_refused(engine):
    for request, param in [(GenerationRequest([1, 2, 10**6], 4, "h2o", 3, 3), "prompt"),
                           (GenerationRequest([1, 2, 3], 4, "h2o", 10**30, 3), "h2o"),
                           (GenerationRequest([1, 2, 3], 4, "snapkv:window=0", 3, 3), "h2o"),
                           (GenerationRequest([1, 2, 3], 4, "h2o", 3, 3, temperature=float("nan")), "temperature")]:
        with pytest.raises(ServeError) as info:
            engine.submit(request)
        assert info.value.kind is ErrorKind.INVALID_REQUEST and info.value.param == param


def test_sampling_is_reproducible_with_a_seed(engine):
    def run(seed):
        req = GenerationRequest(prompt(25, 3), 16, "h2o", 4, 4, temperature=1.0, top_p=0.9, seed=seed,
                                ignore_eos=True)
        return engine.submit(req).result_blocking()[1].token_ids

    a, b, c = run(7), run(7), run(8)
    assert a == b and a != c


def test_stop_sequences_and_incremental_text():
    table = {1: "ab", 2: "c", 3: "\xe2", 4: "\x82\xac", 5: "END", 6: "x"}

    def decode(ids):  # bytes per id, decoded like a byte-level tokenizer
        return "".join(table[i] for i in ids).encode("latin-1").decode("utf-8", errors="replace")

    stream, sent = TextStream(decode, ["EN", "cab"]), []

    def push(token):
        piece, stopped = stream.push(token)
        sent.append(piece)
        return piece, stopped

    assert push(1) == ("ab", False)
    assert push(2) == ("", False)  # "c" could start "cab": held back
    assert push(6) == ("cx", False)
    assert push(3) == ("", False)  # half a euro sign: held back
    assert push(4) == ("\u20ac", False)
    assert push(5) == ("", True) and "".join(sent) == "abcx\u20ac" and stream.flush() == ""


def test_prefill_chunks_and_reservations():
    assert prefill_chunks(33, 16) == [(0, 16), (16, 31), (31, 33)]  # no lone 1-token tail
    assert prefill_chunks(1, 16) == [(0, 1)]
    assert prefill_chunks(32, 16) == [(0, 16), (16, 32)]
    assert reservation(100, 20, None, 16).slots == 120
    h2o = reservation(100, 20, 20, 16)
    assert (h2o.slots, h2o.prefill_peak, h2o.prefill_extra) == (21, 36, 15)
    assert reservation(5, 3, 20, 16).slots == 8  # short request: its whole length, not the budget
    assert footprint_slots({"h2o": [h2o, reservation(100, 20, 40, 16)]}, [h2o]) == 2 * 41 + 15
    assert footprint_slots({"h2o": [h2o, h2o]}, [h2o, h2o]) == 2 * 21 + 15  # serial: one prompt prefills at a time
    # shared: a started prompt's row spans min(held, budget) + chunk = 20 + 16 slots, 15 over its 21
    assert (h2o.shared_peak, h2o.shared_extra) == (36, 15)
    assert footprint_slots({"h2o": [h2o, h2o, h2o]}, [h2o], {"h2o": [h2o, h2o]}) == 3 * 21 + 2 * 15 + 15
    full = reservation(40, 4, None, 16)  # chunks 16, 16, 8: at most 32 held + a 16-token step
    assert (full.shared_peak, full.shared_extra) == (48, 4)


def test_engine_survives_concurrent_submitters(engine):
    results, errors = [], []

    def client(i):
        try:
            req = GenerationRequest(prompt(10 + i, i), 6, "h2o", 2, 2, temperature=0.0)
            results.append(engine.submit(req).result_blocking()[1].kind)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # a safety net, above result_blocking's own 60 s
    assert not errors and results == ["done"] * 12
