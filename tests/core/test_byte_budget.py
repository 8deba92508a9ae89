"""A budget in bytes (``bytes=0.1``, ``budget="4MiB"``, ``h2okv.byte_budget``): the slots it buys,
their coding, and the bytes a cache then holds, measured against a full 16-bit cache."""

import pytest
import torch

from h2okv import CacheSettings, H2OCache, H2OError
from h2okv.byte_budget import Geometry, budget_for_bytes, parse_bytes_budget, vector_bytes
from h2okv.core.compat import cache_arg
from h2okv.core.quant import SlotCodec
from h2okv.recipes import BYTES_CODING
from h2okv.tools.tiny import random_ids, tiny_model, word_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:h2okv. a budget of")


@pytest.fixture(scope="module")
def model():
    # head dimension 32: a group of 32 channels is the whole head, as on the real models' 64
    return tiny_model("llama", num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)


def run(model, cache, n=600, new=8, seed=0):
    ids = random_ids(n, seed=seed)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)
    return cache.stats()


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group", [8, 16, 32])
def test_the_torch_free_arithmetic_is_the_codec_s(bits, group):
    for dim in (32, 64, 128):
        assert vector_bytes(dim, bits, group) == SlotCodec(bits, group).bytes_per_vector(dim)


@pytest.mark.parametrize("given, parsed", [(0.1, 0.1), (1.0, 1.0), (4194304, 4194304), ("4MiB", 4 << 20),
                                           ("512K", 512 << 10), (2048.0, 2048)])
def test_bytes_are_a_fraction_or_bytes_per_sequence(given, parsed):
    assert parse_bytes_budget(given) == parsed


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan"), float("inf"), 1, 0, True, "lots", "-4MiB"])
def test_bad_bytes_are_one_line_errors(bad):
    with pytest.raises(H2OError) as err:
        parse_bytes_budget(bad)
    assert "bytes=" in str(err.value) and "\n" not in str(err.value)


def test_a_byte_budget_fills_in_the_measured_coding_and_excludes_other_budgets():
    s = CacheSettings.build(budget="4MiB")
    assert s.bytes == 4 << 20 and s.budget is None
    assert (s.kv_bits, s.key_bits) == (BYTES_CODING["kv_bits"], BYTES_CODING["key_bits"])
    own = CacheSettings.build(bytes=0.1, kv_bits=8)
    assert (own.kv_bits, own.key_bits) == (8, None)  # bits given are kept
    for bad, message in (({"bytes": 0.1, "budget": 0.2}, "give either bytes= or budget="),
                         ({"bytes": 0.1, "heavy": 8, "recent": 8}, "give either bytes= or heavy=/recent="),
                         ({"budget": "1M", "bytes": 0.1}, "give either budget= in bytes or bytes="),
                         ({"policy": "full", "bytes": 0.1}, "keeps every token; do not give it bytes="),
                         ({"bytes": 0.1, "positions": "rolling"}, "kv_bits takes true positions")):
        with pytest.raises(H2OError, match=message):
            CacheSettings.build(**bad)
    with pytest.raises(H2OError, match="for_model"):
        s.budget_parts()  # no model, no slots
    # the bytes are a ceiling: no floor raises a short prompt's slots (unless one is given), and a
    # budget given later replaces them (one spelling)
    assert s.budget_floor == 0 and CacheSettings.build(bytes=0.1, budget_floor=64).budget_floor == 64
    again = CacheSettings.build(bytes=0.1).replace(budget=0.3)
    assert (again.bytes, again.budget) == (None, 0.3)


def test_a_fraction_of_bytes_buys_that_share_of_a_16_bit_cache(model):
    geometry = Geometry.of(model.config)
    share = geometry.slot_bytes(8, 4, 32) / geometry.full_slot_bytes()
    assert share == pytest.approx((8 + 4) / 32 + 2 * 4 / 128)  # codes, and a scale and low per 32 channels
    cache = H2OCache(model, bytes=0.1)
    assert cache.settings.budget == pytest.approx(0.1 / share)  # 22.9% of the tokens in 8/4 bits
    stats = run(model, cache)
    # a RoPE model's keys are centered by default: one 16-bit mean key per layer and KV head on top,
    # a share of 1 / (2 x tokens) of a full 16-bit cache
    assert stats["kv_coding"] == "8-bit keys, 4-bit values, keys centered" and stats["center_keys"]
    slack = 1 / (2 * stats["tokens_seen"])
    assert 0.09 <= stats["kv_share_16bit"] <= 0.1 + slack + 1e-9, stats["kv_share_16bit"]
    assert "bytes" in stats["settings"] and stats["settings"]["bytes"] == 0.1
    # a fraction beyond what every token costs keeps every token (coded), never more bytes
    everything = H2OCache(model, bytes=0.9, budget_floor=0)
    assert everything.settings.budget == 1.0
    # (the prompt's every token; the budget is the prompt's length, so 8 new tokens evict 8)
    assert 0.98 * share <= run(model, everything)["kv_share_16bit"] <= share


def test_bytes_per_sequence_buy_slots_per_layer_and_head(model):
    geometry = Geometry.of(model.config)
    slot = geometry.slot_bytes(8, 4, 32)
    # 64 slots, the next token's slot beside them, the centered keys' means (a 16-bit key per layer
    # and KV head: a RoPE model's keys are centered by default), and change
    means = geometry.layers * geometry.kv_heads * geometry.key_dim * 2
    asked = 65 * geometry.layers * geometry.kv_heads * slot + means + slot - 1
    cache = H2OCache(model, budget=f"{asked}B")
    assert cache.settings.budget == 64 and cache.settings.bytes == asked
    stats = run(model, cache)
    assert stats["kv_bytes"] <= asked and set(stats["budget"]) == {64}
    with pytest.raises(H2OError, match="holds 1 slot"):
        H2OCache(model, bytes=2 * geometry.layers * geometry.kv_heads * slot + means + 1)  # h2o needs a heavy and a recent slot
    assert budget_for_bytes(10 * geometry.layers * geometry.kv_heads * slot, geometry, 8, 4, 32) == 9
    windowed = H2OCache(model, budget=f"{asked}B", float_window=8)  # the window's 16-bit tokens come first
    stats = run(model, windowed)
    assert stats["kv_bytes_16bit"] <= asked and max(stats["budget"]) < 64


@pytest.mark.parametrize("recipe", ["bounded", "prompt", "document", "generation"])
def test_every_recipe_takes_a_budget_in_bytes(model, recipe):
    cache = H2OCache(model, recipe=recipe, bytes=0.1, budget_floor=0, tokenizer=word_tokenizer())
    stats = run(model, cache, n=400, new=4)
    assert cache.settings.kv_bits == 4 and cache.settings.key_bits == 8
    # kvzip's tail sits above its budget (its stated slack, RESULTS); the others hold the bytes asked
    slack = stats["above_budget_tokens"] / stats["tokens_seen"] * (stats["kv_share_16bit"] / stats["kv_share"])
    slack += 1 / (2 * stats["tokens_seen"]) if stats["center_keys"] else 0.0  # the means: a key a layer and head
    assert stats["kv_share_16bit"] <= 0.1 + slack + 1e-9, (recipe, stats["kv_share_16bit"])


def test_the_server_turns_its_bytes_into_slots_once_the_model_is_loaded(model):
    from h2okv.serve.eviction import EVERY_POLICY, EvictionDefaults
    from h2okv.vocabulary import SettingError, as_field

    geometry = Geometry.of(model.config)
    server = EvictionDefaults.from_options(recipe="bounded", budget="4MiB")  # checked before any model loads
    with pytest.raises(H2OError, match="for_model"):
        server.resolve(1000)
    served = server.for_model(model.config)
    policy, heavy, recent = served.resolve(1000)
    per_layer_head = geometry.layers * geometry.kv_heads
    means = per_layer_head * geometry.key_dim * 2  # centered keys' means, a 16-bit key a layer and head
    assert heavy + recent == ((4 << 20) - means) // (per_layer_head * geometry.slot_bytes(8, 4, 32)) - 1
    # every request's cache is coded as the bytes were counted, and admitted by a coded slot's bytes
    assert served.cache_options()[EVERY_POLICY] == {"kv_bits": 4, "kv_group": 32, "key_bits": 8, "center_keys": True}
    plain = EvictionDefaults.from_options(recipe="bounded", budget="4MiB", center_keys=False).for_model(model.config)
    assert plain.cache_options()[EVERY_POLICY] == {"kv_bits": 4, "kv_group": 32, "key_bits": 8}
    # a request's own budget is slots or a fraction: bytes are the server's to set (a 400 naming h2o.budget)
    with pytest.raises(SettingError) as err:
        served.resolve(1000, budget={"budget": "4MiB"})
    assert err.value.said(as_field).startswith("h2o.budget in bytes is the server's to set")


@pytest.mark.parametrize("argv, message", [
    (["--bytes", "0.1", "--budget", "0.2"], "give either --bytes or --budget, not both"),
    (["--bytes", "lots"], "--bytes must be a fraction"),
    (["--budget", "4KiB"], "holds 0 slot(s) per layer and KV head"),
    (["--policy", "full", "--bytes", "0.1"], "keeps every token; do not give it --bytes"),
])
def test_the_command_line_says_a_bad_byte_budget_in_one_line(argv, message, capsys):
    from h2okv.cli import main

    assert main(["generate", "--prompt", "Hi", "--max-new-tokens", "2", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (4KiB: after the model's loading bar)
    assert message in err and err.startswith("h2okv: error:")


@pytest.mark.parametrize("text, unit", [("4MiB", True), ("512k", True), ("100B", True), ("1.5 M", True),
                                        ("0.2", False), ("512", False), ("lots", False), ("MiB", False)])
def test_a_budget_with_a_byte_unit_is_bytes(text, unit):
    from h2okv.byte_budget import looks_like_bytes

    assert looks_like_bytes(text) is unit
