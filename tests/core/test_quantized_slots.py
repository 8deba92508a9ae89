"""Quantized slots (``kv_bits``, ``core/quant.py``): the codes, and a cache that stores its kept
keys and values in 8, 4 or 2 bits. Every path gives exactly what the same path gives an
unquantized cache fed the dequantized keys and values; the bytes held are the codes and scales."""

import copy
import functools
import os

import pytest
import torch

from generate_greedy import greedy
from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.decode import NativeStep
from h2okv.core.kernels import get_kernels, use_kernels
from h2okv.core.native import build
from h2okv.core.native import calls as native_calls
from h2okv.core.quant import SlotCodec
from h2okv.errors import H2OError
from h2okv.generation import summary_line
from h2okv.tools.tiny import random_ids, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:h2okv. a budget of")


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_code_is_the_nearest_level_and_coding_it_again_changes_nothing(bits, dtype):
    codec = SlotCodec(bits, group=16)
    for seed in range(20):
        x = torch.randn(3, 2, 17, 64, generator=torch.Generator().manual_seed(seed)) * (1 + seed)
        x[..., seed % 64] *= 30  # an outlier channel, as keys have
        x = x.to(dtype)
        codes, scale, low = codec.encode(x)
        assert codes.dtype == torch.uint8 and codes.shape[-1] == 64 * bits // 8
        assert scale.shape[-1] == low.shape[-1] == 4
        back = codec.roundtrip(x)
        grouped_error = (back.float() - x.float()).abs().reshape(3, 2, 17, 4, 16).amax(-1)
        # half a level, plus what float16's scale and low and the model's dtype round
        assert bool((grouped_error <= scale.float() * 0.5 * 1.01 + x.float().abs().amax() * 2 ** -7).all())
        again = codec.encode(back)
        assert all(torch.equal(a, b) for a, b in zip(again, (codes, scale, low), strict=True))
        assert torch.equal(codec.roundtrip(back), back)
        parts, decoded = codec.encode_and_decode(x)  # one fit: the same codes, the same values
        assert all(torch.equal(a, b) for a, b in zip(parts, (codes, scale, low), strict=True))
        assert decoded.dtype == dtype and torch.equal(decoded, codec.decode(codes, scale, low, dtype))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_codes_pack_and_unpack(bits):
    codec = SlotCodec(bits, group=8)
    codes = torch.randint(0, 1 << bits, (5, 16), dtype=torch.uint8)
    packed = codec.pack(codes)
    assert packed.shape == (5, 16 * bits // 8)
    assert torch.equal(codec.unpack(packed), codes)


def test_a_vector_s_bytes_are_its_codes_and_its_groups_scale_and_low():
    assert SlotCodec(8, 32).bytes_per_vector(64) == 64 + 2 * 2 * 2
    assert SlotCodec(4, 32).bytes_per_vector(64) == 32 + 8
    assert SlotCodec(2, 64).bytes_per_vector(128) == 32 + 8


def dequantized_reference(cache: H2OCache, keys: SlotCodec, values: SlotCodec) -> H2OCache:
    """``cache`` (unquantized) fed every call's keys and values as the slots would give them back."""
    for layer in cache.layers:
        attend = layer.attend

        def fed_roundtripped(query, key, value, *args, _attend=attend, **kwargs):
            return _attend(query, keys.roundtrip(key), values.roundtrip(value), *args, **kwargs)

        layer.attend = functools.partial(fed_roundtripped)
    return cache


@pytest.mark.parametrize("bits", [8, 4, 2, (8, 4)])  # (keys, values)
@pytest.mark.parametrize("settings", [
    {"policy": "h2o", "budget": 24},  # chunked prefill, the filling and the at-budget decode steps
    {"policy": "h2o", "budget": 24, "chunk_size": 1},  # the per-token scan
    {"policy": "snapkv:kernel=5", "budget": 24, "prefill": "late"},  # a whole call ranked up front
    {"policy": "rkv", "budget": 24},  # ranks by the held keys
    {"policy": "knorm", "budget": 24},  # a written token's score from its key
    {"policy": "tova", "budget": 24, "head_budgets": "adaptive", "prefill": "late"},  # uneven heads
    {"recipe": "bounded", "budget": 24, "chunk_size": 32},  # streamed: pieces, probes
    {"policy": "full"},
])
def test_every_path_equals_an_unquantized_cache_fed_the_dequantized_values(bits, settings):
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024, initializer_range=0.3)  # GQA
    ids = random_ids(90, batch=2, seed=3)
    key_bits, value_bits = bits if isinstance(bits, tuple) else (bits, bits)
    with use_kernels("eager"):  # the reference's decode steps in the tensor ops the quantized ones run
        quantized = H2OCache(model, kv_bits=value_bits, key_bits=key_bits, kv_group=8, **settings)
        tokens, scores = greedy(model, ids, quantized)
        reference = dequantized_reference(H2OCache(model, **settings), SlotCodec(key_bits, 8), SlotCodec(value_bits, 8))
        ref_tokens, ref_scores = greedy(model, ids, reference)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(scores, ref_scores)
    for mine, theirs in zip(quantized.layers, reference.layers, strict=True):
        # the same slots kept, holding the keys and values the reference holds
        assert torch.equal(mine.valid, theirs.valid) and torch.equal(mine.ordinal, theirs.ordinal)
        for held, ref in zip(mine.kv(), theirs.kv(), strict=True):
            assert torch.equal(held[mine.valid], ref[theirs.valid])


def test_a_padded_batch_gives_each_row_its_answer_alone():
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024, initializer_range=0.3)
    ids = random_ids(60, batch=2, seed=4)
    mask = torch.ones_like(ids)
    ids[1, :12], mask[1, :12] = 1, 0  # row 1 is 12 tokens shorter, left-padded
    tokens, _ = greedy(model, ids, H2OCache(model, policy="h2o", budget=16, kv_bits=4, kv_group=8), mask=mask)
    for row in range(2):
        alone = ids[row:row + 1, int((mask[row] == 0).sum()):]
        own, _ = greedy(model, alone, H2OCache(model, policy="h2o", budget=16, kv_bits=4, kv_group=8))
        assert torch.equal(tokens[row], own[0])


def test_the_bytes_held_are_the_codes_and_scales():
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024)  # head dimension 16
    ids = random_ids(80, batch=2, seed=5)
    full = H2OCache(model, policy="h2o", budget=20)
    quantized = H2OCache(model, policy="h2o", budget=20, kv_bits=4, kv_group=8)
    greedy(model, ids, full)
    greedy(model, ids, quantized)
    layer, float_layer = quantized.layers[0], full.layers[0]
    assert layer.bytes_per_slot() == 2 * (16 // 2 + 2 * 2 * 2)  # K and V: 8 bytes of codes, 2 groups x 4
    assert float_layer.bytes_per_slot() == 2 * 16 * 4
    slots = layer.valid.shape[0] * layer.valid.shape[1] * layer.capacity
    assert layer.kv_bytes() == slots * layer.bytes_per_slot()
    assert layer.full_kv_bytes() == float_layer.full_kv_bytes()  # against the model's dtype
    stats = quantized.stats()
    assert stats["kv_bits"] == 4 and stats["settings"]["kv_bits"] == 4
    # against a 16-bit full cache, not the float32 the CPU runs in: 4-bit codes are not 8x smaller
    assert stats["full_kv_bytes_16bit"] * 2 == stats["full_kv_bytes"]
    assert stats["kv_share_16bit"] == pytest.approx(2 * stats["kv_share"])
    assert "4-bit slots" in quantized.summary() and "of a 16-bit full cache" in quantized.summary()
    keys_8 = H2OCache(model, policy="h2o", budget=20, kv_bits=4, key_bits=8, kv_group=8)
    greedy(model, ids, keys_8, new=2)
    assert keys_8.layers[0].bytes_per_slot() == (16 + 2 * 2 * 2) + (16 // 2 + 2 * 2 * 2)
    assert keys_8.layers[0].keys.shape[-1] == 16 and keys_8.layers[0].values.shape[-1] == 8
    assert "8-bit keys, 4-bit values" in keys_8.summary()
    assert "8-bit keys, 4-bit values: " in summary_line(keys_8.stats())  # generate's last line
    assert "16-bit" not in summary_line(full.stats())


def test_a_cache_of_another_coding_cannot_join():
    model = tiny_model("qwen2", layers=1, max_position_embeddings=1024)
    ids = random_ids(40, batch=1, seed=6)
    caches = [H2OCache(model, policy="h2o", budget=16, kv_bits=bits) for bits in (8, None)]
    for cache in caches:
        greedy(model, ids, cache, new=2)
    with pytest.raises(RuntimeError, match="other slot codings"):
        caches[0].layers[0].append_rows(caches[1].layers[0])


@pytest.mark.parametrize(("settings", "message"), [
    ({"kv_bits": 3}, "kv_bits must be one of 8, 4, 2"),
    ({"kv_bits": 8, "kv_group": 0}, "kv_group must be a whole number >= 1"),
    ({"kv_bits": 4, "positions": "rolling", "policy": "h2o-mean"}, "kv_bits takes true positions"),
    ({"kv_bits": 4, "kv_group": 6}, "kv_group 6 must divide the head dimension 16"),
    ({"key_bits": 8}, "give kv_bits"),
    ({"kv_bits": 4, "key_bits": 5}, "key_bits must be one of 8, 4, 2"),
])
def test_settings_it_cannot_run_are_refused_in_one_line(settings, message):
    model = tiny_model("qwen2", layers=1, max_position_embeddings=1024)
    with pytest.raises(H2OError, match=message):
        H2OCache(model, **{"policy": "h2o", "budget": 16, **settings})


@pytest.mark.parametrize("policy", ["h2o", "tova", "h2o-mean", "h2o:decay=0.8", "rkv"])
@pytest.mark.parametrize("coding", [{"kv_bits": 4}, {"kv_bits": 4, "key_bits": 8, "float_window": 6}])
def test_the_c_step_on_quantized_slots_equals_the_tensor_op_step(policy, coding, monkeypatch):
    """At the budget, a dense quantized layer steps in C over its dequantized copy: the same
    tokens, logits to float tolerance, kept sets and codes as the tensor-op step."""
    if build.library() is None:
        pytest.skip(f"no native kernels here: {build.build_info().error}")
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024, initializer_range=0.3)
    ids = random_ids(50, batch=2, seed=8)
    steps = []
    original = native_calls.decode_dense
    monkeypatch.setattr(native_calls, "decode_dense", lambda *a, **k: steps.append(1) or original(*a, **k))
    runs = {}
    for name in ("native", "eager"):
        with use_kernels(name):
            cache = H2OCache(model, policy=policy, budget=16, kv_group=8, **coding)
            runs[name] = (*greedy(model, ids, cache, new=8), cache)
        if name == "native":
            assert len(steps) >= 2 * 6 and isinstance(cache.layers[0].stepper, NativeStep)
    (tokens, scores, fast), (ref_tokens, ref_scores, slow) = runs["native"], runs["eager"]
    assert len(steps) >= 12  # eager never called it
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(fast.layers, slow.layers, strict=True):
        assert torch.equal(mine.valid, theirs.valid) and torch.equal(mine.ordinal, theirs.ordinal)
        # the prompt's codes are the same prefill's; a decoded token's key may differ from eager's
        # in its last float bits (the steps' sums), and a code with it at a level's edge
        prompt = mine.valid & (mine.ordinal < ids.shape[1])
        assert torch.equal(mine.keys[prompt], theirs.keys[prompt])


@pytest.mark.parametrize("policy, budget, cuts, centered", [("h2o", 16, (24, 30), False), ("rkv", 16, (24, 30), False),
                                                            ("h2o", 40, (24, 30), False),  # 40: rows fill up first (general)
                                                            ("h2o", 16, (24, 30), True)])  # centered keys (quant.KeyCenter)
def test_the_triton_step_on_quantized_slots_equals_the_tensor_op_step(policy, budget, cuts, centered, monkeypatch):
    """The fused Triton decode step (under the interpreter on a CPU) over a quantized layer's float
    copy, step by step from one state: eager's logits, kept sets and codes.

    Each step starts from a twin of the same cache. Compared over a whole run instead, the logits
    on an H200 drifted up to 3e-4 apart a few steps in: a GPU's kernels sum in another order than
    eager's, and a code taken from a key a last bit apart can flip at a level's edge (the likely
    cause); a step from one state is what the fused step must match."""
    import h2okv.core.decode as decode
    import h2okv.core.triton_step as triton_step
    from h2okv.core.triton_attention import triton_available, triton_import_error

    if not triton_available():
        pytest.skip(triton_import_error())
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024, initializer_range=0.3).to(device)
    ids = random_ids(cuts[1], batch=2, seed=9).to(device)
    launches = []
    for name in ("decode_dense", "decode_general"):
        original = getattr(triton_step, name)
        monkeypatch.setattr(triton_step, name, lambda *a, _f=original, **k: launches.append(1) or _f(*a, **k))
    if device == "cpu":  # selected on CUDA only: forced here for the step, the attention stays eager
        monkeypatch.setattr(decode, "triton_on", lambda device: get_kernels() == "triton")

    def step(cache, t, kernels):
        with use_kernels(kernels), torch.inference_mode():
            for layer in cache.layers:  # the stepper is chosen when the rows change: choose it under these kernels
                layer.changed()
            return model(ids[:, t:t + 1], **cache_arg(cache)).logits

    cache = H2OCache(model, policy=policy, budget=budget, kv_bits=4, key_bits=8, kv_group=8, float_window=4,
                     center_keys=centered)
    with use_kernels("eager"), torch.inference_mode():
        model(ids[:, :cuts[0]], **cache_arg(cache))
    for t in range(cuts[0], cuts[1]):
        twin = copy.deepcopy(cache)
        before = len(launches)
        want = step(twin, t, "eager")
        assert len(launches) == before  # eager never launched the fused step
        got = step(cache, t, "triton")
        assert len(launches) == before + 2  # one launch a layer
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(cache.layers, twin.layers, strict=True):
            assert torch.equal(mine.valid, theirs.valid) and torch.equal(mine.ordinal, theirs.ordinal)
            # codes written before this step are the same state's; the new token's key may differ
            # from eager's in its last float bits (the steps' sums), and a code with it at a level's edge
            old = mine.valid & (mine.ordinal < t)
            assert torch.equal(mine.keys[old], theirs.keys[old])


@pytest.mark.parametrize("kernels", ["eager", "native"])
def test_a_decode_step_codes_its_token_once(kernels, monkeypatch):
    """The token's codes that a step decodes to attend with are the ones it writes: two codings a
    layer (its key and its value), not four; and a tensor that is not the one decoded is coded anew."""
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024)
    ids = random_ids(40, batch=2, seed=3)
    cache = H2OCache(model, policy="h2o", budget=16, kv_bits=4, key_bits=8, kv_group=8)
    with use_kernels(kernels), torch.inference_mode():
        model(ids[:, :30], **cache_arg(cache))
        model(ids[:, 30:31], **cache_arg(cache))
        codings = []
        real = SlotCodec._fit
        monkeypatch.setattr(SlotCodec, "_fit", lambda self, x: codings.append(1) or real(self, x))
        model(ids[:, 31:32], **cache_arg(cache))
    assert len(codings) == 2 * len(cache.layers)
    layer = cache.layers[0]
    k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    parts = layer.coding.keys.encode(k), layer.coding.values.encode(v)
    layer.remember_codes(k, v, *parts)
    other = k.clone()
    slot = torch.zeros(2, 2, 1, dtype=torch.long)
    got = layer.codes_of(other, v, slot)  # not the remembered tensor: coded from what it holds
    assert all(torch.equal(a, b) for a, b in zip(got[0], layer.coding.keys.encode(other), strict=True))
    layer.remember_codes(k, v, *parts)
    remembered = layer.codes_of(k, v, slot)
    assert all(a is b for a, b in zip(remembered[0] + remembered[1], parts[0] + parts[1], strict=True))
    again = layer.codes_of(k, v, slot)  # the memory is spent by the first ask: coded anew, to equal codes
    assert again[0][0] is not parts[0][0] and torch.equal(again[0][0], parts[0][0])
