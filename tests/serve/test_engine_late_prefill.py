"""``serve --prefill late`` and the policies of issue 16 in the engine: every sequence's tokens
equal its tokens generated alone with a late-prefill cache; a late prompt is fed in one call."""

import pytest
import torch

from h2okv import H2OCache, H2OError
from h2okv.core.compat import cache_arg
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.eviction import EvictionDefaults
from serve_cases import CHUNK, prompt, submit_in_two

CASES = [  # (prompt length, policy, heavy, recent, new tokens)
    (40, "knorm", 6, 2, 14),
    (23, "tova:heads=shared", 5, 2, 12),
    (70, "h2o", 8, 4, 10),
    (9, "knorm", 10, 10, 8),  # budget larger than the prompt
    (45, "snapkv:window=4,heads=shared", 6, 3, 12),
    (30, "full", None, None, 9),
]


def alone(model, ids, policy, heavy, recent, steps, prefill):
    budget = {} if heavy is None else {"heavy": heavy, "recent": recent}
    cache = H2OCache(model, policy=policy, chunk_size=CHUNK, prefill=prefill, **budget)
    out = model.generate(torch.tensor([ids]), **cache_arg(cache), max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=257)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("schedule", ["budget", "serial"])
def test_late_prefill_engine_equals_alone(model_tok, schedule, monkeypatch):
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=16, schedule=schedule, step_tokens=3 * CHUNK),
                    prefill="late")
    calls = []
    prefill = engine.executor.prefill
    monkeypatch.setattr(engine.executor, "prefill", lambda parts: calls.append(parts) or prefill(parts))
    requests = [GenerationRequest(prompt(n, i), steps, policy, heavy, recent, temperature=0.0, ignore_eos=True)
                for i, (n, policy, heavy, recent, steps) in enumerate(CASES)]
    # the later ones join while the first decode: submitted while the engine waits at its 4th decode
    # step (the first rows hold at most 4 of their 10+ tokens), not after a sleep a machine's speed moves
    engine.start()
    try:
        handles = submit_in_two(engine, requests, 3, "decode", calls=4)
        for (n, policy, heavy, recent, steps), handle, i in zip(CASES, handles, range(len(CASES)), strict=True):
            _, done = handle.result_blocking()
            assert done.kind == "done"
            assert done.token_ids == alone(model, prompt(n, i), policy, heavy, recent, steps, "late"), policy
    finally:
        engine.stop()
    fed = [len(ids) for parts in calls for _, ids, _ in parts]
    assert sorted(fed) == sorted(n for n, *_ in CASES)  # each prompt whole, in one call
    assert engine.stats.kv_bytes == 0


def test_late_prefill_reserves_the_prompt(model_tok):
    model, tok = model_tok
    req = GenerationRequest(prompt(200, 0), 10, "h2o", 8, 8)
    late = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK), prefill="late").reservation(req)
    chunked = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK)).reservation(req)
    assert late.prefill_peak == 200 and chunked.prefill_peak == 16 + CHUNK


def test_bad_prefill_mode_is_refused(model_tok):
    with pytest.raises(H2OError, match="prefill must be one of chunked, late"):
        EvictionDefaults.from_options(prefill="early")
    with pytest.raises(ValueError, match="prefill must be one of"):
        Engine(*model_tok, prefill="early")
