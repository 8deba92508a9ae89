"""The engine's per-token path, made cheap (``tools/measure/engine_overhead.py``) without changing
what it gives: the plain decoder decodes as ``tokenizer.decode`` does, a step's events reach every
event loop in one wake-up and in order, and the inter-token histogram is exposed as Prometheus' own."""

import asyncio
import copy
import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from h2okv.serve.api.metrics import LATENCY_BUCKETS, StepHistogram
from h2okv.serve.text import plain_decoder
from h2okv.serve.types import Event, Handle
from h2okv.tools.tiny_chat import tiny_tokenizer


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
