"""The engine's per-token path, made cheap (``tools/measure/engine_overhead.py``) without changing
what it gives: the plain decoder decodes as ``tokenizer.decode`` does, a step's events reach every
event loop in one wake-up and in order, a plain request's text decoded by its handle gives the
events the engine's own decoding gives, stop strings still stop a row beside plain ones exactly,
and the inter-token histogram is exposed as Prometheus' own."""

import asyncio
import copy
import random
import threading

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from h2okv.serve.api.metrics import LATENCY_BUCKETS, StepHistogram
from h2okv.serve.engine import Engine, EngineOptions
from h2okv.serve.text import plain_decoder
from h2okv.serve.types import Event, GenerationRequest, Handle
from h2okv.tools.tiny_chat import tiny_tokenizer

NEVER = "\U0010fffe\U0010fffe"  # a stop string no generation here contains: its text is decoded in the step


def test_the_plain_decoder_decodes_as_the_tokenizer_does():
    tok = tiny_tokenizer()
    decode = plain_decoder(tok)
    rng = random.Random(0)
    for _ in range(300):  # byte-level ids: multi-byte characters cut anywhere, special tokens among them
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_with_a_decode_of_its_own_keeps_it():
    tok = copy.deepcopy(tiny_tokenizer())

    class Shouting(type(tok)):  # a model's tokenizer class that changes what decode gives
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    tok.__class__ = Shouting
    ids = tok.encode("shout", add_special_tokens=False)
    assert plain_decoder(tok)(ids) == "SHOUT"


class Waker:
    def wake(self) -> None: ...


def test_a_steps_events_reach_each_event_loop_in_one_wake_up_and_in_order():
    loops = [asyncio.new_event_loop() for _ in range(2)]
    wakeups = []
    for loop in loops:
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args, real=real, loop=loop: wakeups.append(loop) or real(*args)
    handles = [Handle(Waker(), loop) for loop in loops for _ in range(3)] + [Handle(Waker())]  # the last: no loop
    pushes = [(h, Event("text", f"{i}.{n}")) for n in range(2) for i, h in enumerate(handles)]
    pushes.append((handles[0], Event("done", "end")))
    try:
        Handle.push_all(pushes)
        assert sorted(map(id, wakeups)) == sorted(map(id, loops))  # one wake-up per loop for the whole step
        assert handles[0].finished.is_set() and not handles[1].finished.is_set()
        for i, handle in enumerate(handles[:-1]):
            loop = loops[i // 3]
            assert [loop.run_until_complete(handle.next()).text for _ in range(2)] == [f"{i}.0", f"{i}.1"]
        assert loops[0].run_until_complete(handles[0].next()).text == "end"
        assert [handles[-1].next_blocking(0).text for _ in range(2)] == ["6.0", "6.1"]
    finally:
        for loop in loops:
            loop.close()


def test_the_step_histogram_is_exposed_as_a_prometheus_histogram():
    values = [0.001, 0.005, 0.0051, 0.3, 1.0, 200.0]  # on a bound, just past one, past the last
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    histogram = StepHistogram("gap_seconds", "gaps")
    ours.register(histogram)
    histogram.observe_many(values[:2])
    histogram.observe_many(values[2:])
    reference = Histogram("gap_seconds", "gaps", buckets=LATENCY_BUCKETS, registry=theirs)
    for value in values:
        reference.observe(value)
    expected = [line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == expected


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


async def _read(handle: Handle) -> list[Event]:
    events = []
    while not events or not events[-1].final:
        events.append(await handle.next())
    return events


def _run(model_tok, requests: list[GenerationRequest], loop: str | None) -> list[list[Event]]:
    """Every event of each request, submitted at once to one engine (one decode batch), read from an
    event loop on a thread of its own as they come (``"thread"``, the server's way), from one that
    runs once the engine is done (``"late"``: every step's items wait), or without one."""
    model, tok = model_tok
    # 32 prompt tokens a step: prompts end, and rows join the batch, step after step while others decode
    engine = Engine(model, tok, EngineOptions(prefill_chunk=16, step_tokens=32, max_batch=len(requests)))
    engine.start()
    try:
        if loop is None:
            handles = engine.submit_many(requests)
            return [_drain(lambda h=h: h.next_blocking(timeout=60)) for h in handles]
        event_loop = asyncio.new_event_loop()
        errors = []  # a callback that raised (the engine's items are handed over in callbacks)
        event_loop.set_exception_handler(lambda _, context: errors.append(context))
        if loop == "late":
            try:
                handles = engine.submit_many(requests, event_loop)
                assert all(h.finished.wait(60) for h in handles)
                events = [event_loop.run_until_complete(_read(h)) for h in handles]
                assert errors == []
                return events
            finally:
                event_loop.close()
        thread = threading.Thread(target=event_loop.run_forever, daemon=True)
        thread.start()
        try:
            handles = engine.submit_many(requests, event_loop)
            events = [asyncio.run_coroutine_threadsafe(_read(h), event_loop).result(60) for h in handles]
            assert errors == []
            return events
        finally:
            event_loop.call_soon_threadsafe(event_loop.stop)
            thread.join(10)
            event_loop.close()
    finally:
        engine.stop()


def _drain(next_event) -> list[Event]:
    events = [next_event()]
    while not events[-1].final:
        events.append(next_event())
    return events


def _seen(events: list[Event]) -> list[tuple]:
    return [(e.kind, e.text, e.finish_reason, e.usage, e.token_ids) for e in events]


@pytest.mark.parametrize("loop", [None, "thread", "late"])
def test_a_plain_requests_text_decoded_by_its_handle_is_the_text_decoded_in_the_step(model_tok, loop):
    """The same greedy requests, plain (their handles decode their ids) and with a stop string that
    never matches (decoded in the engine's step, as every request was): the same events, one by
    one: text pieces (multi-byte characters cut across tokens among them), EOS and ``max_tokens``
    ends, usage and token ids."""
    # (prompt length, seed, max_tokens, ignore_eos, budget): the greedy answers to (7, 2) and (12, 6)
    # end in EOS after 19 and 11 tokens
    shapes = [(30, 0, 40, True, 6), (7, 2, 40, False, None), (50, 1, 1, True, 6), (12, 6, 60, False, None),
              (21, 3, 33, False, 5), (40, 4, 16, True, None)]
    plain = [GenerationRequest(_prompt(n, seed), steps, "full" if budget is None else "h2o", budget, budget,
                               temperature=0.0, ignore_eos=ignore) for n, seed, steps, ignore, budget in shapes]
    checked = [_with_stops(r, [NEVER]) for r in plain]
    # plain rows alone: their steps take the engine's usual path (every row plain, one send a step)
    mine, theirs = _run(model_tok, plain, loop), _run(model_tok, checked, None)
    assert [_seen(e) for e in mine] == [_seen(e) for e in theirs]
    reasons = {events[-1].finish_reason for events in mine}
    assert reasons == {"stop", "length"}  # an EOS came (ignore_eos off) and max_tokens ended others
    text = "".join(e.text for events in mine for e in events)
    assert any(127 < ord(c) != 0xFFFD for c in text)  # multi-byte characters, whole, cut across tokens


def _with_stops(request: GenerationRequest, stops: list[str]) -> GenerationRequest:
    return GenerationRequest(**{**request.__dict__, "stops": stops})


def test_a_stop_string_stops_its_row_exactly_beside_plain_rows(model_tok):
    """A row with a stop string, in one decode batch with plain rows: its text is the plain answer's
    cut before the stop's first occurrence, sent once (no piece lost or repeated), ``"stop"``, and
    its tokens end at the one that completed the stop; the plain rows answer as alone."""
    base = [GenerationRequest(_prompt(20 + 5 * i, 100 + i), 48, "h2o", 8, 8, temperature=0.0, ignore_eos=True)
            for i in range(4)]
    alone = _run(model_tok, base, loop=None)
    texts = ["".join(e.text for e in events) for events in alone]
    model, tok = model_tok
    stops = []
    for text in texts:  # a stop from the middle of each answer, at its first occurrence there
        stop = next(text[i:i + 3] for i in range(8, len(text) - 3) if text.find(text[i:i + 3]) == i
                    and "\ufffd" not in text[i:i + 3])
        stops.append(stop)
    mixed = base[:2] + [_with_stops(r, [stop]) for r, stop in zip(base[2:], stops[2:], strict=True)]
    runs = _run(model_tok, mixed, loop="thread")
    for i in (0, 1):
        assert _seen(runs[i]) == _seen(alone[i])
    for i in (2, 3):
        events, text, stop = runs[i], texts[i], stops[i]
        done = events[-1]
        assert "".join(e.text for e in events) == text[:text.find(stop)] and done.finish_reason == "stop"
        ids = done.token_ids
        assert ids == alone[i][-1].token_ids[:len(ids)] and stop in tok.decode(ids) \
            and stop not in tok.decode(ids[:-1])
        assert done.usage["completion_tokens"] == len(ids)
