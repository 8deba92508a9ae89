"""``prefill="streamed"`` (``core/streamed.py``): a prompt read through the model in pieces, each
ranked by the prompt's last tokens read on top as a probe. Exact when nothing is evicted, within
budget + one piece while it reads, positions right, and refused in one line where it cannot run."""

import pytest
import torch
from transformers import DynamicCache

from h2okv import CacheSettings, H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.streamed import read_streamed, streamed_tokens
from h2okv.errors import H2OError
from h2okv.generation import generate
from h2okv.policies.pooling import pool_in_order
from h2okv.tools.tiny import random_ids, tiny_model

POLICY = "snapkv:kernel=5,pool=max"  # window 32
pytestmark = pytest.mark.filterwarnings("ignore:h2okv. a budget of")


def model_and_ids(n=300, batch=2, seed=1):
    return tiny_model("qwen2", max_position_embeddings=1024), random_ids(n, batch=batch, seed=seed)


def greedy(model, ids, cache, new=5):
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=1, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores)


def test_the_pieces_read_are_whole_chunks_before_the_last_piece_and_the_window():
    assert streamed_tokens(300, 64, 32) == 256  # 268 of context: four whole pieces, 12 + 32 left
    assert streamed_tokens(288, 64, 32) == 192  # 256 of context: the last whole piece is left too
    assert streamed_tokens(96, 64, 32) == 0  # one piece: nothing to stream


def test_nothing_evicted_equals_a_full_cache():
    """A budget above the prompt and its answer evicts nothing: the pieces attend exactly as one
    call does, the probes leave nothing behind, so the logits are a full cache's."""
    model, ids = model_and_ids()
    cache = H2OCache(model, policy=POLICY, budget=400, prefill="streamed", chunk_size=64)
    with torch.inference_mode():
        assert read_streamed(model, cache, ids) == 256
        assert cache.get_seq_length() == 256  # the probes' tokens were read and not counted
    tokens, scores = greedy(model, ids, cache)
    full_tokens, full_scores = greedy(model, ids, DynamicCache(config=model.config))
    assert torch.equal(tokens, full_tokens)
    torch.testing.assert_close(scores, full_scores, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == ids.shape[1] + 4  # every position after the prompt, the last token unread


def test_it_holds_the_budget_plus_one_piece_and_keeps_the_budget():
    model, ids = model_and_ids(n=500)
    cache = H2OCache(model, policy=POLICY, budget=40, prefill="streamed", chunk_size=64)
    with torch.inference_mode():
        read_streamed(model, cache, ids)
    for layer in cache.layers:
        assert layer.peak_capacity <= 40 + 64
        assert int(layer.valid.sum(-1).max()) <= 40  # each probe evicted down to the budget
    greedy(model, ids, cache)
    assert max(cache.stats()["peak_capacity"]) <= 40 + 64
    assert all(int(layer.valid.sum(-1).max()) <= 40 for layer in cache.layers)


def test_a_fraction_is_of_the_whole_prompt_not_a_piece():
    model, ids = model_and_ids(n=500, batch=1)
    cache = H2OCache(model, policy=POLICY, budget=0.2, budget_floor=0, prefill="streamed", chunk_size=64)
    with torch.inference_mode():
        read_streamed(model, cache, ids)
    assert cache.budget() == [100]


def test_the_probe_ranks_what_it_attends_to():
    """A probe that repeats a piece's tokens pays them the most attention (its keys match): of two
    pieces, the kept slots lean towards the one the prompt's end repeats."""
    model = tiny_model("qwen2", max_position_embeddings=1024)
    first, second = random_ids(128, seed=5), random_ids(128, seed=6)
    filler = random_ids(40, seed=7)
    ids = torch.cat([first, second, filler, first[:, :32]], dim=1)  # the window repeats the first piece's start
    cache = H2OCache(model, policy="snapkv", budget=48, prefill="streamed", chunk_size=128)
    with torch.inference_mode():
        assert read_streamed(model, cache, ids) == 256
    layer = cache.layers[-1]
    kept = layer.ordinal[layer.valid]
    assert int((kept < 32).sum()) > int(((kept >= 128) & (kept < 160)).sum())


def test_generate_reads_a_streamed_prompt():
    model, _ = model_and_ids()
    from h2okv.tools.tiny import word_tokenizer

    tok = word_tokenizer()
    prompt = " ".join(f"w{i % 50}" for i in range(400))
    result = generate(model, tok, prompt, CacheSettings.build(POLICY, budget=48, prefill="streamed", chunk_size=64),
                      max_new_tokens=4, ignore_eos=True)
    assert result.new_tokens == 4
    assert max(result.stats["peak_capacity"]) <= 48 + 64


def test_pool_in_order_pools_neighbours_in_prompt_order_only_among_live_slots():
    scores = torch.tensor([[[0.0, 5.0, 1.0, 0.0, 2.0]]])
    ordinal = torch.tensor([[[30, 10, 20, 99, 40]]])  # prompt order: slot 1, 2, 0, 4; slot 3 is free
    valid = torch.tensor([[[True, True, True, False, True]]])
    pooled = pool_in_order(scores, ordinal, valid, 3, "max")
    assert pooled.tolist() == [[[2.0, 5.0, 5.0, 0.0, 2.0]]]
    mean = pool_in_order(scores, ordinal, valid, 3, "avg")
    torch.testing.assert_close(mean, torch.tensor([[[1.0, 3.0, 2.0, 0.0, 1.0]]]))


@pytest.mark.parametrize(("keywords", "message"), [
    ({"policy": "h2o"}, "observation window"),
    ({"policy": POLICY, "head_budgets": "adaptive"}, "uniform head budgets"),
    ({"policy": POLICY, "positions": "rolling"}, "true positions"),
])
def test_settings_it_cannot_run_are_refused_in_one_line(keywords, message):
    with pytest.raises(H2OError, match=message) as err:
        CacheSettings.build(budget=0.2, prefill="streamed", **keywords)
    assert "\n" not in str(err.value)


def test_other_prefill_modes_read_nothing_ahead():
    model, ids = model_and_ids()
    cache = H2OCache(model, policy=POLICY, budget=0.2, prefill="chunked", chunk_size=64)
    assert read_streamed(model, cache, ids) == 0
    assert cache.get_seq_length() == 0


def test_model_generate_streams_the_prompt_by_itself():
    """Drop-in: the cache's hook streams the prompt's call, the same as ``read_streamed`` first."""
    model, ids = model_and_ids(n=400)
    dropped_cache = H2OCache(model, policy=POLICY, budget=40, prefill="streamed", chunk_size=64)
    dropped, _ = greedy(model, ids, dropped_cache)
    assert max(dropped_cache.stats()["peak_capacity"]) <= 40 + 64

    cache = H2OCache(model, policy=POLICY, budget=40, prefill="streamed", chunk_size=64)
    with torch.inference_mode():
        read_streamed(model, cache, ids)
    explicit, _ = greedy(model, ids, cache)
    assert torch.equal(dropped, explicit)

    one_call = H2OCache(model, policy=POLICY, budget=40, prefill="chunked", chunk_size=64)
    greedy(model, ids, one_call)
    assert max(one_call.stats()["peak_capacity"]) <= 40 + 64  # chunked bounds the K/V too, not the activations


def test_a_padded_batch_is_read_in_one_call():
    model, ids = model_and_ids(n=300)
    mask = torch.ones_like(ids)
    mask[0, :10] = 0
    cache = H2OCache(model, policy=POLICY, budget=40, prefill="streamed", chunk_size=64)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=2, do_sample=False,
                       pad_token_id=1)
    assert cache.get_seq_length() == ids.shape[1] + 1
