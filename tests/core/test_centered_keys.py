"""Centered keys (``center_keys``, ``quant.KeyCenter``): each key coded less its channel's mean
turned to its position. The coding is exact to its own rules (codes, means, ordinals), every path
equals an unquantized cache fed the keys as the centered codes give them back, a row's mean is its
own, and a key bias that 4 plain bits lose is kept."""

import functools

import pytest
import torch

from generate_greedy import greedy
from h2okv import H2OCache
from h2okv.byte_budget import Geometry, budget_for_bytes
from h2okv.core.kernels import use_kernels
from h2okv.core.quant import KeyCenter, SlotCodec, SlotCoding
from h2okv.core.rope import RopeRotation
from h2okv.errors import H2OError
from h2okv.tools.tiny import random_ids, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:h2okv. a budget of")


def center_of(model) -> KeyCenter:
    return KeyCenter(tuple(RopeRotation.from_model(model).inv_freq.tolist()))


def test_a_mean_is_turned_as_the_model_s_rope_turns_a_key():
    model = tiny_model("qwen2", layers=1, max_position_embeddings=1024)
    rope, center = RopeRotation.from_model(model), center_of(model)
    freq = center.frequencies("cpu")
    mean = torch.randn(2, 3, 16)
    ordinal = torch.randint(0, 900, (2, 3, 7))
    want = mean[:, :, None, :].expand(2, 3, 7, 16).contiguous()
    rope.rotate_(want, ordinal)
    # float32 angles (``KeyCenter.frequencies``): ordinal 900's rounding, ~1e-4 of a radian
    torch.testing.assert_close(center.offset((mean, freq), ordinal), want, atol=1e-3, rtol=1e-3)
    turned = center.turn(want, ordinal, freq, -1.0)  # and back: the mean at every position
    torch.testing.assert_close(turned, mean[:, :, None, :].expand_as(turned), atol=1e-3, rtol=1e-3)


def test_a_row_s_mean_is_its_first_real_tokens_before_their_turn():
    model = tiny_model("qwen2", layers=1, max_position_embeddings=1024)
    center = KeyCenter(center_of(model).inv_freq, first=4)
    freq = center.frequencies("cpu")
    before = torch.randn(2, 2, 6, 16)
    ordinal = torch.tensor([[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]])  # row 1: two pads first
    keys = center.turn(before, ordinal.clamp_min(0)[:, None, :].expand(2, 2, 6), freq)
    mean = center.mean_of(keys, ordinal, freq)
    assert mean.dtype == torch.float16
    torch.testing.assert_close(mean[0].float(), before[0, :, :4].mean(1), atol=2e-3, rtol=2e-3)  # tokens past 4 left out
    torch.testing.assert_close(mean[1].float(), before[1, :, 2:].mean(1), atol=2e-3, rtol=2e-3)  # pads left out


def biased_keys(center: KeyCenter, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with one channel pair 40x the others before the turn (a key bias), turned to 0..n-1."""
    before = torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(0))
    before[..., 3] += 40.0
    before[..., 11] -= 25.0
    ordinal = torch.arange(n).expand(1, 2, n)
    return center.turn(before, ordinal, center.frequencies("cpu")), ordinal


def test_centered_4_bit_keys_keep_what_plain_4_bits_lose_to_a_key_bias():
    model = tiny_model("qwen2", layers=1, max_position_embeddings=1024)
    center = center_of(model)
    keys, ordinal = biased_keys(center)
    plain = SlotCoding(SlotCodec(4, 16), SlotCodec(4, 16))
    centered = SlotCoding(SlotCodec(4, 16), SlotCodec(4, 16), center=center)
    freq = center.frequencies("cpu")
    mean = (center.mean_of(keys, ordinal[:, 0], freq), freq)  # a layer's centering
    plain_error = (plain.decode_keys(plain.encode_keys(keys, None, ordinal), None, ordinal, torch.float32) - keys).abs()
    parts = centered.encode_keys(keys, mean, ordinal)
    back = centered.decode_keys(parts, mean, ordinal, torch.float32)
    centered_error = (back - keys).abs()
    assert float(centered_error.mean()) < float(plain_error.mean()) / 5
    # one fit gives the same codes and values; coding the values again gives the same codes
    one_fit_parts, one_fit = centered.encode_and_decode_keys(keys, mean, ordinal)
    assert all(torch.equal(a, b) for a, b in zip(one_fit_parts, parts, strict=True)) and torch.equal(one_fit, back)
    assert all(torch.equal(a, b) for a, b in zip(centered.encode_keys(back, mean, ordinal), parts, strict=True))


def centered_reference(cache: H2OCache, coding: SlotCoding) -> H2OCache:
    """``cache`` (unquantized) fed every call's keys as centered slots give them back: each row's
    mean from its first call, each token turned by its ordinal (a batch with no padding)."""
    for layer in cache.layers:
        attend, means = layer.attend, {}

        def fed(query, key, value, *args, _attend=attend, _layer=layer, _means=means, **kwargs):
            n_real = _layer.n_real[:, None] if _layer.is_initialized and _layer.n_real is not None else 0
            ordinal = (n_real + torch.arange(key.shape[2])).expand(key.shape[0], key.shape[2])
            freq = coding.center.frequencies(key.device)
            if "mean" not in _means:
                _means["mean"] = coding.center.mean_of(key, ordinal, freq)
            turned = ordinal[:, None, :].expand(key.shape[:3])
            _, key = coding.encode_and_decode_keys(key, (_means["mean"], freq), turned)
            return _attend(query, key, coding.values.roundtrip(value), *args, **kwargs)

        layer.attend = functools.partial(fed)
    return cache


@pytest.mark.parametrize("settings", [
    {"policy": "h2o", "budget": 24},  # chunked prefill, the filling and the at-budget decode steps
    {"policy": "h2o", "budget": 24, "chunk_size": 1},  # the per-token scan (slots stored whole again)
    {"policy": "snapkv:kernel=5", "budget": 24, "prefill": "late"},  # a whole call ranked up front
    {"policy": "rkv", "budget": 24},  # ranks by the held keys
    {"recipe": "bounded", "budget": 24, "chunk_size": 32},  # streamed: pieces, probes
    {"policy": "full"},
])
@pytest.mark.parametrize("kernels", ["eager", "native"])
def test_every_path_equals_an_unquantized_cache_fed_the_centered_keys(settings, kernels):
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024, initializer_range=0.3)  # GQA
    ids = random_ids(90, batch=2, seed=3)
    with use_kernels(kernels):
        quantized = H2OCache(model, kv_bits=4, kv_group=8, center_keys=True, **settings)
        tokens, scores = greedy(model, ids, quantized)
    coding = quantized.layers[0].coding
    assert coding.center is not None and coding.center.first == min(256, settings.get("chunk_size", 512))
    with use_kernels("eager"):
        reference = centered_reference(H2OCache(model, **settings), coding)
        ref_tokens, ref_scores = greedy(model, ids, reference)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(quantized.layers, reference.layers, strict=True):
        assert torch.equal(mine.valid, theirs.valid) and torch.equal(mine.ordinal, theirs.ordinal)
        held, ref = mine.kv()[0], theirs.kv()[0]
        torch.testing.assert_close(held[mine.valid], ref[theirs.valid], atol=1e-5, rtol=1e-5)


def test_a_padded_batch_gives_each_row_its_answer_alone_and_its_own_mean():
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024, initializer_range=0.3)
    ids = random_ids(60, batch=2, seed=4)
    mask = torch.ones_like(ids)
    ids[1, :12], mask[1, :12] = 1, 0  # row 1 is 12 tokens shorter, left-padded
    settings = {"policy": "h2o", "budget": 16, "kv_bits": 4, "kv_group": 8, "center_keys": True}
    batch = H2OCache(model, **settings)
    tokens, _ = greedy(model, ids, batch, mask=mask)
    for row in range(2):
        alone = ids[row:row + 1, int((mask[row] == 0).sum()):]
        cache = H2OCache(model, **settings)
        own, _ = greedy(model, alone, cache)
        assert torch.equal(tokens[row], own[0])
        assert torch.equal(batch.layers[1].key_center[row], cache.layers[1].key_center[0])


def test_rows_carry_their_mean_and_a_new_row_takes_its_own():
    model = tiny_model("qwen2", layers=1, max_position_embeddings=1024)
    ids = random_ids(40, batch=2, seed=5)
    cache = H2OCache(model, policy="h2o", budget=16, kv_bits=4, kv_group=8, center_keys=True)
    greedy(model, ids, cache, new=2)
    layer = cache.layers[0]
    before = layer.kv()[0].clone(), layer.key_center.clone()
    assert not bool((before[1][0] == before[1][1]).all())  # two prompts, two means
    cache.select_rows([1, 0])
    assert torch.equal(layer.key_center, before[1].flip(0)) and torch.equal(layer.kv()[0], before[0].flip(0))
    layer.add_empty_rows(layer.heavy[:1], layer.recent[:1], layer.sinks[:1])
    assert layer.center_pending and not bool(layer.key_center[2].any())


def test_the_bytes_count_the_means_and_a_byte_budget_leaves_room_for_them():
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024)  # head dimension 16, 2 KV heads
    ids = random_ids(80, batch=2, seed=5)
    plain = H2OCache(model, policy="h2o", budget=20, kv_bits=4, kv_group=8)
    centered = H2OCache(model, policy="h2o", budget=20, kv_bits=4, kv_group=8, center_keys=True)
    greedy(model, ids, plain)
    greedy(model, ids, centered)
    assert centered.layers[0].kv_bytes() == plain.layers[0].kv_bytes() + 2 * 2 * 16 * 2  # rows x heads x D x float16
    assert "keys centered" in centered.summary()
    geometry = Geometry(layers=24, kv_heads=2, key_dim=64, value_dim=64)
    asked = 2_000_000
    slots = budget_for_bytes(asked, geometry, 4, 4, 32)
    fewer = budget_for_bytes(asked, geometry, 4, 4, 32, center=True)
    slot = geometry.slot_bytes(4, 4, 32)
    assert fewer <= slots and 48 * ((fewer + 1) * slot + 64 * 2) <= asked


@pytest.mark.parametrize(("model_kind", "settings", "message"), [
    ("qwen2", {"center_keys": True}, "center_keys= centers the keys of quantized slots: give kv_bits= too"),
    ("opt", {"kv_bits": 4, "center_keys": True}, "center_keys turns each key's channel mean to its position"),
])
def test_settings_it_cannot_run_are_refused_in_one_line(model_kind, settings, message):
    model = tiny_model(model_kind, layers=1, max_position_embeddings=1024)
    with pytest.raises(H2OError, match=message):
        H2OCache(model, **{"policy": "h2o", "budget": 16, **settings})


def test_a_budget_in_bytes_centers_the_keys_where_the_model_has_rope():
    ids = random_ids(80, batch=1, seed=6)
    for kind, centered in (("qwen2", True), ("opt", False)):  # OPT has learned positions: nothing to turn
        model = tiny_model(kind, layers=1, max_position_embeddings=1024)
        cache = H2OCache(model, policy="h2o", bytes=0.3)
        greedy(model, ids, cache, new=2)
        assert cache.settings.center_keys is centered and cache.stats()["center_keys"] is centered
        assert (cache.layers[0].key_center is not None) is centered
    model = tiny_model("qwen2", layers=1, max_position_embeddings=1024)
    assert H2OCache(model, policy="h2o", bytes=0.3, center_keys=False).settings.center_keys is False
    assert H2OCache(model, policy="h2o", budget=0.3, kv_bits=4).settings.center_keys is None  # bits given: as given
