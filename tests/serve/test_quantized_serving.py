"""``h2okv serve --kv-bits N``: every request's cache holds quantized slots (``core/quant.py``),
``full``'s too, its tokens are those of the same request generated alone with the same coding, and
the engine admits sequences by the coded bytes of a slot: more of them in the same KV memory."""

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.quant import SlotCodec
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.eviction import EVERY_POLICY, EvictionDefaults
from h2okv.serve.memory import bytes_per_slot
from serve_cases import CHUNK, prompt

CODING = {"kv_bits": 4, "kv_group": 8, "key_bits": 8}
CASES = [(40, "h2o", 6, 6, 12), (23, "tova", 4, 5, 10), (30, "full", None, None, 8)]


def alone_coded(model, ids, policy, heavy, recent, steps, coding):
    budget = {} if heavy is None else {"heavy": heavy, "recent": recent}
    cache = H2OCache(model, policy=policy, chunk_size=CHUNK, **budget, **coding)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), **cache_arg(cache), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=257)
    return out[0, len(ids):].tolist()


def test_the_server_s_coding_reaches_every_policy_s_cache():
    eviction = EvictionDefaults.from_options(policy="h2o", budget=16, **CODING)
    assert eviction.cache_options() == {EVERY_POLICY: CODING}
    assert eviction.describe()["kv_bits"] == 4
    assert EvictionDefaults.from_options(policy="h2o", budget=16).cache_options() == {}


@pytest.mark.parametrize("centered", [False, True])  # centered keys: each row's own mean, rows joining mid-run
def test_a_quantized_engine_gives_each_request_its_tokens_alone_and_admits_by_coded_bytes(model_tok, centered):
    model, tok = model_tok
    coding = {**CODING, "center_keys": True} if centered else CODING
    cache_options = EvictionDefaults.from_options(policy="h2o", budget=16, **coding).cache_options()
    float_bytes, coded_bytes = bytes_per_slot(model), bytes_per_slot(model, **CODING)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_slot = SlotCodec(8, 8).bytes_per_vector(head_dim) + SlotCodec(4, 8).bytes_per_vector(head_dim)
    assert coded_bytes == per_slot * config.num_key_value_heads * config.num_hidden_layers
    assert coded_bytes * 2 < float_bytes  # 8-bit keys, 4-bit values and their scales against float32

    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=8), cache_options=cache_options)
    assert engine.slot_bytes == coded_bytes
    # centered keys' means, a float16 key per layer and head, are admitted as slots per sequence
    assert engine.sequence_slots == (-(-2 * head_dim // per_slot) if centered else 0)
    engine.start()
    try:
        handles = [engine.submit(GenerationRequest(prompt(n, i), steps, policy, heavy, recent, temperature=0.0,
                                                   ignore_eos=True))
                   for i, (n, policy, heavy, recent, steps) in enumerate(CASES)]
        for (n, policy, heavy, recent, steps), handle, i in zip(CASES, handles, range(len(CASES)), strict=True):
            _, done = handle.result_blocking()
            assert done.token_ids == alone_coded(model, prompt(n, i), policy, heavy, recent, steps, coding), policy
    finally:
        engine.stop()


def most_running(model, tok, memory: int, cache_options: dict) -> int:
    """The largest batch an engine of ``memory`` bytes of KV ran 24 short h2o requests in."""
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=32, kv_memory=memory),
                    cache_options=cache_options)
    engine.start()
    try:
        handles = [engine.submit(GenerationRequest(prompt(20, i), 8, "h2o", 8, 8, temperature=0.0, ignore_eos=True))
                   for i in range(24)]
        for handle in handles:
            handle.result_blocking()
    finally:
        engine.stop()
    return engine.stats.batch_size_max


def test_the_same_kv_memory_admits_more_quantized_sequences(model_tok):
    model, tok = model_tok
    memory = 4 * 30 * bytes_per_slot(model)  # room for about four float sequences
    plain = most_running(model, tok, memory, {})
    coded = most_running(model, tok, memory, EvictionDefaults.from_options(policy="h2o", budget=16,
                                                                             **CODING).cache_options())
    assert 2 <= plain < 12  # the memory, not the requests, bounds the float batch
    assert coded >= 2 * plain  # 8-bit keys and 4-bit values (group 8) take under a third of float32's


def test_a_float_window_is_admitted_as_bytes_per_sequence_and_each_request_gets_its_tokens_alone(model_tok):
    model, tok = model_tok
    windowed = {**CODING, "float_window": 6}
    cache_options = EvictionDefaults.from_options(policy="h2o", budget=16, **windowed).cache_options()
    assert cache_options == {EVERY_POLICY: windowed}
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    window = config.num_hidden_layers * config.num_key_value_heads * 6 * 2 * head_dim * 4  # float32 keys and values
    held = H2OCache(model, policy="full", **windowed)
    with torch.inference_mode():
        model(torch.tensor([prompt(3, 0)]), **cache_arg(held))
    assert sum(layer.window_bytes() for layer in held.layers) == window  # what a sequence's window holds
    assert bytes_per_slot(model, **windowed) == bytes_per_slot(model, **CODING)  # a slot costs what it did
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=8), cache_options=cache_options)
    assert engine.sequence_slots == -(-window // engine.slot_bytes)  # counted from the config, no forward
    request = GenerationRequest(prompt(40, 0), 12, "h2o", 6, 6, temperature=0.0, ignore_eos=True)
    assert engine.reservation(request).slots == 13 + engine.sequence_slots  # budget + the next token's + the window
    engine.start()
    try:
        _, done = engine.submit(request).result_blocking()
    finally:
        engine.stop()
    cache = H2OCache(model, policy="h2o", heavy=6, recent=6, chunk_size=CHUNK, **windowed)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt(40, 0)]), **cache_arg(cache), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, pad_token_id=257)
    assert done.token_ids == out[0, 40:].tolist()
