"""The engine's step times (``EngineStats.steps``): each step's wall time and the part of it in the
executor's forward calls, which ``/metrics``, ``serve-bench`` and ``tools/measure/engine_overhead.py``
report as the time the engine spends outside the model."""

import gc

from prometheus_client.parser import text_string_to_metric_families

from h2okv.serve.api.metrics import ServeMetrics
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.types import StepTimes


def test_step_times_add_up_and_rank_the_time_outside_the_forward():
    times = StepTimes()
    for total, forward in [(1.0, 0.9), (2.0, 1.0), (0.5, 0.5), (4.0, 0.0)]:
        times.add(total, forward)
    summary = times.summary()
    assert (summary["steps"], summary["step_s"], summary["forward_s"]) == (4, 7.5, 2.4)
    assert summary["outside_share"] == round(5.1 / 7.5, 4)
    assert summary["outside_ms_mean"] == 1275.0  # 5.1 s over 4 steps
    assert (summary["outside_ms_p50"], summary["outside_ms_p99"]) == (1000.0, 4000.0)
    assert StepTimes().summary()["outside_share"] is None  # no step yet: nothing to divide


def test_the_engine_times_every_step_and_the_forward_calls_inside_it(model_tok):
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=16))
    metrics = engine.observer = ServeMetrics(engine)
    decodes = []
    real = engine.executor.decode
    engine.executor.decode = lambda *args: decodes.append(args) or real(*args)
    engine.start()
    try:
        prompt = list(range(5, 40))
        _, done = engine.submit(GenerationRequest(prompt, 12, "full", temperature=0.0, ignore_eos=True)).result_blocking()
    finally:
        engine.stop()
    assert done.usage["completion_tokens"] == 12 and len(decodes) == 11  # the first token comes from the prefill
    # the figures a pass over every row publishes (at most every PUBLISH_EVERY_S) are back to 0 once idle
    stats = engine.stats
    assert (stats.running, stats.full_kv_bytes, stats.reserved_bytes, stats.kv_bytes) == (0, 0, 0, 0)
    assert gc.get_freeze_count() > 0  # what lived when the engine started is out of the collector's sight
    steps = engine.stats.steps
    assert steps.steps >= len(decodes) and len(steps.outside) == steps.steps
    assert 0 < steps.forward_seconds < steps.seconds and min(steps.outside) >= 0
    body, _ = metrics.render()
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert samples["h2okv_engine_steps_total"] == steps.steps
    assert 0 < samples["h2okv_engine_forward_seconds_total"] < samples["h2okv_engine_step_seconds_total"]
