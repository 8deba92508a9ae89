"""H2OCache inside real (tiny, random-weight) transformers models."""

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.generation import pad_rows
from h2okv.tools.tiny import BudgetWatch, random_ids, tiny_model


def greedy_with_scores(model, ids, cache=None, attention_mask=None, steps=12):
    out = model.generate(
        ids, attention_mask=attention_mask, **cache_arg(cache), max_new_tokens=steps, min_new_tokens=steps,
        do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("chunk", [1, 7, 512])
def test_exact_when_budget_covers_everything(arch_model, chunk):
    """Budget >= total length: logits match a plain DynamicCache (fp32, 1e-4), tokens identical."""
    _, model = arch_model
    ids = random_ids(30, batch=2)
    ref_tokens, ref_logits = greedy_with_scores(model, ids, DynamicCache(config=model.config))
    cache = H2OCache(model, policy="h2o", heavy=100, recent=100, chunk_size=chunk)
    tokens, logits = greedy_with_scores(model, ids, cache)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert cache.get_seq_length() == 30 + 12 - 1


# snapkv with spans: the max pool and ChunkKV's blocks keep every guarantee of the plain ranking
NEW_POLICIES = ["tova", "h2o-sink", "h2o-mean", "snapkv", "expected", "snapkv:kernel=5,pool=max", "snapkv:kernel=1,chunk=4",
                "h2o:decay=0.9", "rkv", "rkv:weight=0.5", "rkv:kernel=3"]


@pytest.mark.parametrize("policy", ["full", "local", "sink", "random", *NEW_POLICIES])
def test_other_policies_exact_without_eviction(llama, policy):
    ids = random_ids(25)
    ref_tokens, ref_logits = greedy_with_scores(llama, ids)
    budget = {} if policy == "full" else {"heavy": 50, "recent": 50}
    tokens, logits = greedy_with_scores(llama, ids, H2OCache(llama, policy=policy, **budget))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


def test_model_still_works_without_h2o_cache(llama):
    ids = random_ids(20)
    before = llama(ids).logits
    H2OCache(llama, heavy=2, recent=2)
    llama.generate(ids, **cache_arg(H2OCache(llama, heavy=2, recent=2)), max_new_tokens=3, pad_token_id=0)
    torch.testing.assert_close(llama(ids).logits, before, atol=1e-5, rtol=0)
    llama.generate(ids, max_new_tokens=3, pad_token_id=0)  # plain generation still fine


@pytest.mark.parametrize("arch, policy", [("llama", "h2o"), ("opt", "h2o"), ("gpt_neox", "h2o"),
                                          *[("qwen2", p) for p in NEW_POLICIES]])
def test_budget_respected_every_step(arch, policy):
    model = tiny_model(arch)
    ids = random_ids(40, batch=2)
    cache = H2OCache(model, policy=policy, heavy=5, recent=3, chunk_size=16)
    watch = BudgetWatch(cache)
    model.generate(ids, **cache_arg(cache), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                   logits_processor=LogitsProcessorList([watch]), pad_token_id=0)
    assert len(watch.history) == 20
    for stats in watch.history:
        assert max(stats["slots"]) <= 8
        assert max(stats["capacity"]) <= 9  # budget + the slot the next token is written into
    final = cache.stats()
    assert final["tokens_seen"] == 59
    assert final["kv_bytes"] < final["full_kv_bytes"] * 9 / 59 + 1


def test_chunked_prefill_memory_bounded(llama):
    """KV memory during prefill stays <= budget + chunk, and the buffer shrinks to budget + 1 after."""
    ids = random_ids(300)
    cache = H2OCache(llama, policy="h2o", heavy=20, recent=20, chunk_size=64)
    llama(ids, **cache_arg(cache))
    for layer in cache.layers:
        assert layer.peak_capacity <= 40 + 64
        assert layer.capacity == 41
        assert int(layer.valid.sum(-1).max()) == 40
    one_chunk = H2OCache(llama, policy="h2o", heavy=20, recent=20, chunk_size=300)
    llama(ids, **cache_arg(one_chunk))
    assert one_chunk.layers[0].peak_capacity == 300


def test_positions_true_after_eviction():
    """`local` with budget W-1 is exactly a sliding window of W: compare with Mistral's own
    sliding-window attention on a plain cache. Any position error after eviction (RoPE) shows."""
    window = 9
    plain = tiny_model("mistral", sliding_window=window)
    ours = tiny_model("mistral", sliding_window=None)
    ours.load_state_dict(plain.state_dict())
    ids = random_ids(20)
    ref_tokens, ref_logits = greedy_with_scores(plain, ids, DynamicCache(config=plain.config), steps=25)
    cache = H2OCache(ours, policy="local", heavy=0, recent=window - 1, chunk_size=1)
    tokens, logits = greedy_with_scores(ours, ids, cache, steps=25)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert cache.get_seq_length() == 20 + 25 - 1


def test_model_sliding_window_honoured():
    """A model with its own sliding window keeps it under H2OCache (budget larger than the window)."""
    model = tiny_model("mistral", sliding_window=6)
    ids = random_ids(20)
    ref_tokens, ref_logits = greedy_with_scores(model, ids, DynamicCache(config=model.config), steps=10)
    tokens, logits = greedy_with_scores(model, ids, H2OCache(model, policy="full", chunk_size=5), steps=10)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "budget",
    # the ratio budget without the floor: each row resolves its own few slots from its own length
    [{"heavy": 4, "recent": 3}, {"heavy_ratio": 0.2, "recent_ratio": 0.2, "budget_floor": 0}],
    ids=["absolute", "ratio"],
)
@pytest.mark.parametrize("chunk, policy", [(1, "h2o"), (8, "h2o"), (512, "h2o"),
                                           *[(8, p) for p in NEW_POLICIES], (512, "snapkv")])
def test_batch_equals_single(llama, budget, chunk, policy):
    """Left-padded batch of different lengths: each row equals its batch-of-one run."""
    lengths = [30, 17, 24]
    seqs = [random_ids(n, seed=10 + i)[0].tolist() for i, n in enumerate(lengths)]
    ids, mask = pad_rows(seqs, pad_id=0)
    cache = H2OCache(llama, policy=policy, chunk_size=chunk, **budget)
    tokens, logits = greedy_with_scores(llama, ids, cache, attention_mask=mask, steps=15)
    for i, s in enumerate(seqs):
        single = H2OCache(llama, policy=policy, chunk_size=chunk, **budget)
        ref_tokens, ref_logits = greedy_with_scores(llama, torch.tensor([s]), single, steps=15)
        assert tokens[i, ids.shape[1]:].tolist() == ref_tokens[0, len(s):].tolist()
        torch.testing.assert_close(logits[i], ref_logits[0], atol=1e-4, rtol=0)
        if "heavy_ratio" in budget:
            assert cache.budget()[i] == single.budget()[0] == 2 * max(1, int(0.2 * len(s)))


def test_padding_never_kept(llama):
    seqs = [random_ids(12, seed=1)[0].tolist(), random_ids(4, seed=2)[0].tolist()]
    ids, mask = pad_rows(seqs, pad_id=0)
    cache = H2OCache(llama, policy="h2o", heavy=50, recent=50)
    llama.generate(ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=3, min_new_tokens=3,
                   do_sample=False, pad_token_id=0)
    for layer in cache.layers:
        live = layer.valid.sum(-1)  # [B, H]
        assert live[0].tolist() == [12 + 2] * live.shape[1]
        assert live[1].tolist() == [4 + 2] * live.shape[1]


def test_ratio_budget_from_prompt_length(llama):
    cache = H2OCache(llama, policy="h2o", heavy_ratio=0.1, recent_ratio=0.1, budget_floor=0)
    llama(random_ids(205), **cache_arg(cache))
    assert cache.budget() == [40]  # 20 + 20 of 205 tokens
    tiny = H2OCache(llama, policy="h2o", heavy_ratio=0.01, recent_ratio=0.01, budget_floor=0)
    llama(random_ids(30), **cache_arg(tiny))
    assert tiny.budget() == [2]  # at least one slot each


def test_bfloat16_runs_within_budget():
    model = tiny_model("qwen2").to(torch.bfloat16)
    ids = random_ids(30)
    cache = H2OCache(model, policy="h2o", heavy=4, recent=4)
    out = model.generate(ids, **cache_arg(cache), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 35
    assert cache.layers[0].keys.dtype == torch.bfloat16
    assert cache.layers[0].score.dtype == torch.float32
    assert max(cache.stats()["slots"]) == 8


@pytest.mark.parametrize("policy", ["h2o", *NEW_POLICIES])
def test_kv_heads_never_expanded(policy):
    model = tiny_model("llama")  # 4 query heads, 2 KV heads
    cache = H2OCache(model, policy=policy, heavy=3, recent=3)
    model.generate(random_ids(20), **cache_arg(cache), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert cache.layers[0].keys.shape[1] == 2
    assert max(cache.stats()["slots"]) == 6


def test_beam_and_batch_reordering(llama):
    ids = random_ids(20)
    cache = H2OCache(llama, policy="h2o", heavy=4, recent=4)
    out = llama.generate(ids, **cache_arg(cache), max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 26)
    assert cache.layers[0].keys.shape[0] == 2


def test_row_selection_keeps_budgets_in_step(llama):
    """Dropping a row (as generate and the server do) keeps per-row budgets and decoding right."""
    seqs = [random_ids(30, seed=1)[0].tolist(), random_ids(12, seed=2)[0].tolist()]
    ids, mask = pad_rows(seqs, pad_id=0)
    cache = H2OCache(llama, policy="h2o", heavy_ratio=0.2, recent_ratio=0.2, budget_floor=0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate derives from a left-padded mask
    llama(ids, attention_mask=mask, position_ids=positions, **cache_arg(cache))
    assert cache.budget() == [12, 4]
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.budget() == [4]
    assert cache.max_budget == 4
    # the remaining row decodes exactly like the same sequence alone
    alone = H2OCache(llama, policy="h2o", heavy_ratio=0.2, recent_ratio=0.2, budget_floor=0)
    llama(torch.tensor([seqs[1]]), **cache_arg(alone))
    token = torch.tensor([[5]])
    a = llama(token, **cache_arg(cache), position_ids=torch.tensor([[12]])).logits
    b = llama(token, **cache_arg(alone), position_ids=torch.tensor([[12]])).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert int(cache.layers[0].valid.sum(-1).max()) == 4
