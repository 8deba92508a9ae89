"""A float window of quantized slots (``float_window``, ``core/quant.py``): each query reads its own
last W tokens in the model's dtype, older ones from their codes. A window wider than the whole
sequence is an unquantized cache; a narrow one holds exactly the keys and values the model wrote for
its last W tokens and the codes of the rest, on every path, and a prompt read in pieces (as the
server reads it) gives what it gives read in one call."""

import pytest
import torch

from generate_greedy import greedy
from h2okv import H2OCache
from h2okv.core.kernels import use_kernels
from h2okv.core.quant import SlotCodec
from h2okv.errors import H2OError
from h2okv.tools.tiny import random_ids, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:h2okv. a budget of")

PATHS = [
    {"policy": "h2o", "budget": 24},  # chunked prefill, the filling and the at-budget decode steps
    {"policy": "h2o", "budget": 24, "chunk_size": 1},  # the per-token scan
    {"policy": "snapkv:kernel=5", "budget": 24, "prefill": "late"},  # a whole call ranked up front
    {"policy": "rkv", "budget": 24},  # ranks by the held keys
    {"recipe": "bounded", "budget": 24, "chunk_size": 32},  # streamed: pieces, probes
]


def model():
    return tiny_model("qwen2", layers=2, max_position_embeddings=1024, initializer_range=0.3)  # GQA


@pytest.mark.parametrize("settings", PATHS)
def test_a_window_wider_than_everything_is_an_unquantized_cache(settings):
    lm, ids = model(), random_ids(90, batch=2, seed=3)
    with use_kernels("eager"):
        windowed = H2OCache(lm, kv_bits=2, kv_group=8, float_window=128, **settings)
        tokens, scores = greedy(lm, ids, windowed)
        ref_tokens, ref_scores = greedy(lm, ids, H2OCache(lm, **settings))
    # a call attends over each slot twice, coded and float (storage.banded_kv): the same numbers
    # summed over a longer row, so equal to float rounding
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-5)
    coded, _ = greedy(lm, ids, H2OCache(lm, kv_bits=2, kv_group=8, **settings))
    assert not torch.equal(coded, tokens)  # 2-bit codes alone change the answer: the window is what kept it


def recorded(cache):
    """Wrap each layer's ``attend`` to keep every real token's key and value as the model wrote them,
    by (row, ordinal): ``{layer: {(row, ordinal): (key [H, D], value [H, D])}}``."""
    seen = {}
    for layer in cache.layers:
        book = seen.setdefault(layer.layer_idx, {})

        def attend(query, key, value, new_mask, *args, _layer=layer, _book=book, _attend=layer.attend, **kwargs):
            if _layer.probe.best is None and _layer.stream != "probe":  # probes are read, not kept
                start = _layer.n_real.clone() if _layer.is_initialized else torch.zeros(key.shape[0], dtype=torch.long)
                real = (torch.ones(key.shape[0], key.shape[2], dtype=torch.bool) if new_mask is None
                        else new_mask.to(torch.bool)[:, 0].diagonal(dim1=-2, dim2=-1))
                for row in range(key.shape[0]):
                    for j, token in enumerate(real[row].nonzero().flatten().tolist()):
                        _book[(row, int(start[row]) + j)] = (key[row, :, token].clone(), value[row, :, token].clone())
            return _attend(query, key, value, new_mask, *args, **kwargs)

        layer.attend = attend
    return seen


@pytest.mark.parametrize("settings", PATHS)
def test_the_last_w_tokens_read_back_as_written_and_older_ones_as_their_codes(settings):
    lm, window = model(), 8
    ids = random_ids(70, batch=2, seed=6)
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = 1, 0  # a left-padded row: its ordinals lag the other's
    codec = SlotCodec(4, 8)
    with use_kernels("eager"):
        cache = H2OCache(lm, kv_bits=4, kv_group=8, float_window=window, **settings)
        seen = recorded(cache)
        greedy(lm, ids, cache, mask=mask, new=5)
    checked = {"float": 0, "coded": 0}
    for layer in cache.layers:
        keys, values = layer.kv()
        for row in range(2):
            n = int(layer.n_real[row])
            for head in range(keys.shape[1]):
                for slot in layer.valid[row, head].nonzero().flatten().tolist():
                    ordinal = int(layer.ordinal[row, head, slot])
                    key, value = (part[head] for part in seen[layer.layer_idx][(row, ordinal)])
                    if ordinal >= n - window:
                        checked["float"] += 1
                        assert torch.equal(keys[row, head, slot], key) and torch.equal(values[row, head, slot], value)
                    else:  # a prompt token older than the window was coded as the call read it
                        checked["coded"] += 1
                        assert torch.equal(keys[row, head, slot], codec.roundtrip(key))
                        assert torch.equal(values[row, head, slot], codec.roundtrip(value))
    assert checked["float"] and checked["coded"]


def test_rows_alone_equal_rows_in_a_batch_and_row_operations_carry_the_window():
    lm = model()
    ids = random_ids(60, batch=2, seed=4)
    mask = torch.ones_like(ids)
    ids[1, :12], mask[1, :12] = 1, 0
    settings = {"policy": "h2o", "budget": 16, "kv_bits": 4, "kv_group": 8, "float_window": 6}
    tokens, _ = greedy(lm, ids, H2OCache(lm, **settings), mask=mask)
    for row in range(2):
        alone = ids[row:row + 1, int((mask[row] == 0).sum()):]
        own, _ = greedy(lm, alone, H2OCache(lm, **settings))
        assert torch.equal(tokens[row], own[0])
    cache = H2OCache(lm, **settings)
    greedy(lm, ids, cache, mask=mask, new=3)
    layer = cache.layers[0]
    before = layer.kv()
    cache.select_rows(torch.tensor([1, 0]))
    after = layer.kv()
    assert all(torch.equal(a[[1, 0]], b) for a, b in zip(before, after, strict=True))
    assert layer.window_ordinal.shape == (2, 6)


def test_the_window_is_counted_in_the_bytes_and_named():
    lm = model()  # head dimension 16, 2 KV heads, 2 layers
    ids = random_ids(80, batch=1, seed=5)
    plain = H2OCache(lm, policy="h2o", budget=24, kv_bits=4, kv_group=8)
    windowed = H2OCache(lm, policy="h2o", budget=24, kv_bits=4, kv_group=8, float_window=16)
    for cache in (plain, windowed):
        greedy(lm, ids, cache, new=2)
    extra = 2 * 2 * 16 * (16 + 16)  # layers x KV heads x window x (key + value channels)
    assert windowed.stats()["kv_bytes"] - plain.stats()["kv_bytes"] == extra * 4  # float32 here
    assert windowed.stats()["kv_bytes_16bit"] - plain.stats()["kv_bytes_16bit"] == extra * 2
    assert "the last 16 tokens also in float" in windowed.summary()


@pytest.mark.parametrize(("keywords", "message"), [
    ({"float_window": 8}, "give kv_bits= too"),
    ({"kv_bits": 4, "float_window": -1}, "float_window= must be a whole number"),
    ({"kv_bits": 4, "float_window": 2.5}, "float_window= must be a whole number"),
])
def test_a_wrong_window_is_a_one_line_error(keywords, message):
    with pytest.raises(H2OError, match=message):
        H2OCache(model(), policy="h2o", budget=16, **keywords)


def test_bytes_per_sequence_pay_for_the_window_first_and_a_fraction_cannot_hold_one():
    from h2okv.byte_budget import Geometry, budget_for_bytes
    from h2okv.settings import CacheSettings

    lm = model()
    geometry = Geometry.of(lm.config)
    asked = 64 * 1024
    plain = budget_for_bytes(asked, geometry, 8, 4, 8)
    windowed = budget_for_bytes(asked, geometry, 8, 4, 8, window=16)
    cost = geometry.layers * geometry.kv_heads * 16 * geometry.full_slot_bytes()
    slot = geometry.slot_bytes(8, 4, 8)
    assert windowed == (asked - cost) // (geometry.layers * geometry.kv_heads * slot) - 1 < plain
    settings = CacheSettings.build("h2o", bytes=asked, kv_bits=4, key_bits=8, kv_group=8, float_window=16,
                                   center_keys=False)
    assert settings.for_model(lm.config).budget == windowed
    # centered keys (a budget in bytes' default on a RoPE model) also pay for their means first
    centered = CacheSettings.build("h2o", bytes=asked, kv_bits=4, key_bits=8, kv_group=8, float_window=16)
    means = geometry.layers * geometry.kv_heads * geometry.key_dim * 2
    assert centered.for_model(lm.config).budget == (asked - cost - means) // (geometry.layers * geometry.kv_heads * slot) - 1
    with pytest.raises(H2OError, match="a float window holds 16 tokens"):
        CacheSettings.build("h2o", bytes=0.1, float_window=16)
    with pytest.raises(H2OError, match="beside a float window of 4096 tokens"):
        budget_for_bytes(asked, geometry, 8, 4, 8, window=4096)


@pytest.mark.parametrize("argv, message", [
    (["--float-window", "8"], "--float-window keeps the recent tokens of quantized slots in float: give --kv-bits"),
    (["--kv-bits", "4", "--float-window", "8", "--bytes", "0.1"], "give --bytes per sequence (e.g. 4MiB) with --float-window"),
])
def test_the_command_line_says_a_bad_window_in_one_line(argv, message, capsys):
    from h2okv.cli import main

    assert main(["generate", "--prompt", "Hi", "--max-new-tokens", "2", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and err.startswith("h2okv: error:")


def test_eval_commands_take_the_window_into_their_rows():
    from h2okv.eval.longctx.rows import coding_suffix
    from h2okv.eval.reasoning import Setup
    from h2okv.settings import coding_label

    assert coding_suffix({"kv_bits": 4, "key_bits": 8, "float_window": 32}) == " k8v4+f32"
    assert coding_label(4, 8, 32, 16) == "k8v4+f16"
    setup = Setup(model="m", task="gsm8k", style="chat", max_new_tokens=8, batch_size=1, seed=0, recent_share=0.5,
                  kv_bits=4, key_bits=8, float_window=16)
    assert setup.kv_label == "k8v4+f16" and setup.cache_options("rkv")["float_window"] == 16


# nothing evicted (eviction itself depends on the cut: per chunk or per token), so what the test sees
# is the window alone: on the chunked path, the per-token scan and the decode step
@pytest.mark.parametrize("settings", [{"policy": "full"}, {"policy": "h2o", "budget": 80, "chunk_size": 16},
                                      {"policy": "h2o", "budget": 80, "chunk_size": 1}])
def test_each_query_reads_its_own_last_w_tokens_however_the_prompt_is_cut_into_calls(settings):
    from h2okv.core.compat import cache_arg

    lm, ids = model(), random_ids(64, batch=1, seed=11)
    coding = {"kv_bits": 2, "kv_group": 8, "float_window": 8}
    results = []
    for cuts in ((0, 64), (0, 32, 48, 64), (0, 32, *range(33, 65))):  # one call; pieces; then token by token
        cache = H2OCache(lm, **coding, **settings)
        with use_kernels("eager"), torch.inference_mode():
            logits = [lm(ids[:, a:b], **cache_arg(cache)).logits[:, -1] for a, b in zip(cuts, cuts[1:])]
        results.append((logits[-1], cache.layers[-1].kv()[0], cache.layers[-1].valid))
    (one, keys, valid), *others = results
    for logits, other_keys, other_valid in others:
        torch.testing.assert_close(logits, one, atol=1e-4, rtol=1e-4)
        assert torch.equal(other_valid, valid)
        torch.testing.assert_close(other_keys[valid], keys[valid], atol=1e-4, rtol=1e-4)
