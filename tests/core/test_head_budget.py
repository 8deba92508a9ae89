"""Head-adaptive budgets (Ada-KV, ``core/head_budget.py``): each layer's heavy slots shared out
among its KV heads by the policy's rank.

Against the loop (``reference.share_out``), plus the shared guarantees: the layer's total kept and
no head starved at every step, exact with a budget >= the length, batch == batch-of-one, GQA
without expanding K/V, the bytes reported being the slots allocated, one-line errors.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LogitsProcessorList

from core_cases import MODEL, leaning_qkv
from core_cases import run_calls as run_retrieve_calls
from h2okv import H2OCache, H2OError
from h2okv.core.compat import cache_arg
from h2okv.core.head_budget import allocate
from h2okv.core.reference import reference
from h2okv.generation import pad_rows
from h2okv.tools.tiny import random_ids, tiny_model

FLOOR = 0.2
CALLS = {
    "prompt": [(0, 40)],
    "prompt+decode": [(0, 28)] + [(t, t + 1) for t in range(28, 40)],
    "two calls+decode": [(0, 16), (16, 30)] + [(t, t + 1) for t in range(30, 40)],
}


def run_calls(spec, q, k, v, heavy, recent, calls, chunk, prefill):
    """One layer fed ``calls`` with adaptive heads; (outputs, kept per head, the layer)."""
    return run_retrieve_calls(spec, q, k, v, heavy, recent, calls, chunk, prefill, head_budgets="adaptive",
                              head_floor=FLOOR)


@pytest.mark.parametrize("calls", CALLS)
@pytest.mark.parametrize("spec, prefill", [("h2o", "late"), ("tova", "late"), ("h2o-sink", "late"),
                                           ("snapkv:window=5,kernel=3", "late"), ("snapkv:window=5,kernel=3", "chunked"),
                                           ("snapkv:window=1,kernel=1", "chunked")])
def test_adaptive_heads_match_the_reference(spec, prefill, calls):
    """Same kept tokens per head and the same outputs as the loop, and the heads really differ."""
    q, k, v = leaning_qkv(8, hq=8, hkv=4, n=40, d=8)
    out, kept, layer = run_calls(spec, q, k, v, 8, 3, CALLS[calls], chunk=6, prefill=prefill)
    ref_out, ref_kept = reference(q[0], k[0], v[0], spec, 8, 3, CALLS[calls], chunk=6, scale=k.shape[-1] ** -0.5,
                                  late=prefill == "late", adaptive=FLOOR)
    assert kept == ref_kept
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)
    assert int(layer.head_heavy.sum()) == 4 * 8


@pytest.mark.parametrize("spec, prefill", [("h2o", "late"), ("snapkv:window=5,kernel=3", "chunked")])
def test_the_shares_are_uneven(spec, prefill):
    """The cases above are not the uniform budget in disguise: heads keep different counts."""
    q, k, v = leaning_qkv(8, hq=8, hkv=4, n=40, d=8)
    _, kept, layer = run_calls(spec, q, k, v, 8, 3, CALLS["prompt"], chunk=6, prefill=prefill)
    assert len({len(heads) for heads in kept}) > 1
    assert layer.head_heavy[0].tolist() == [len(heads) - 3 for heads in kept]


def brute_allocate(key, candidate, heavy, sinks, floor, ceiling=0.0):
    """``allocate`` for one row as a loop: own best first, then the best of all heads (each head's
    own best ``ceil(ceiling * choice)`` at most, with a ceiling)."""
    heads = key.shape[0]
    choice = max(heavy - sinks, 0)
    picks, rest = [], []
    for h in range(heads):
        values = sorted((float(x) for x, c in zip(key[h], candidate[h], strict=True) if c), reverse=True)
        if ceiling:
            values = values[:math.ceil(choice * ceiling)]
        picks.append(min(int(choice * floor), len(values)))
        rest += [(-x, h) for x in values[picks[h]:]]
    for _, h in sorted(rest)[:max(0, min(heads * choice, sum(picks) + len(rest)) - sum(picks))]:
        picks[h] += 1
    spare = heads * choice - sum(picks)
    return [sinks + p + spare // heads + (h < spare % heads) for h, p in enumerate(picks)]


@settings(max_examples=80, deadline=None)
@given(heads=st.integers(1, 5), n=st.integers(0, 24), heavy=st.integers(1, 12), sinks=st.integers(0, 3),
       floor=st.sampled_from([0.0, 0.2, 0.5, 1.0]), ceiling=st.sampled_from([0.0, 1.0, 1.5, 3.0]),
       seed=st.integers(0, 2**16))
def test_allocation_keeps_the_total_and_feeds_every_head(heads, n, heavy, sinks, floor, ceiling, seed):
    """Each row's shares add up to heads x heavy; each head gets at least the sinks plus its floor
    (or all its candidates, when it has fewer), and with a ceiling chooses no more than its own
    best ceil(ceiling x choice) (spare slots spread evenly hold no token); a loop computes the same
    shares."""
    sinks = min(sinks, heavy)
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(2, heads, n, generator=g)
    candidate = torch.rand(2, heads, n, generator=g) < 0.8
    heavy_t, sinks_t = torch.tensor([heavy, heavy]), torch.tensor([sinks, sinks])
    shares = allocate(key, candidate, heavy_t, sinks_t, floor, ceiling)
    assert shares.sum(-1).tolist() == [heads * heavy] * 2
    floor_n = int((heavy - sinks) * floor)
    assert bool((shares >= sinks + torch.minimum(candidate.sum(-1), torch.tensor(floor_n))).all())
    for row in range(2):
        assert shares[row].tolist() == brute_allocate(key[row], candidate[row], heavy, sinks, floor, ceiling)


def test_a_ceiling_gives_what_a_head_would_have_hogged_to_the_next_best():
    """Head 0's candidates all outrank head 1's: with no ceiling it takes all 10 of the 12 it can;
    capped at 1.5 uniform choices (ceil(1.5 x 6) = 9) it takes 9 and head 1 the rest; at 1 every
    head takes its own choice, the uniform split."""
    key = torch.cat([torch.arange(10, 20.0)[None], torch.arange(0, 10.0)[None]])[None]  # [1, 2, 10]
    candidate = torch.ones(1, 2, 10, dtype=torch.bool)
    six, none = torch.tensor([6]), torch.tensor([0])
    assert allocate(key, candidate, six, none, 0.0).tolist() == [[10, 2]]
    assert allocate(key, candidate, six, none, 0.0, 1.5).tolist() == [[9, 3]]
    assert allocate(key, candidate, six, none, 0.0, 1.0).tolist() == [[6, 6]]


def test_a_head_that_needs_more_gets_more():
    """Head 0's candidates all outrank head 1's: with no floor head 0 takes every choice it can."""
    key = torch.cat([torch.arange(10, 20.0)[None], torch.arange(0, 10.0)[None]])[None]  # [1, 2, 10]
    candidate = torch.ones(1, 2, 10, dtype=torch.bool)
    one = torch.tensor([6])
    assert allocate(key, candidate, one, torch.tensor([0]), 0.0).tolist() == [[10, 2]]
    assert allocate(key, candidate, one, torch.tensor([0]), 0.5).tolist() == [[9, 3]]
    assert allocate(key, candidate, one, torch.tensor([1]), 1.0).tolist() == [[6, 6]]  # floor 1: uniform


class HeadWatch:
    """At every generated token: each (row, head) within its own budget, each layer's total kept."""

    def __init__(self, cache, heavy):
        self.cache, self.heavy, self.steps = cache, heavy, 0

    def __call__(self, input_ids, scores):
        for layer in self.cache.layers:
            live = layer.live_slots()  # read in either layout: a layer the C step holds flat stays flat
            assert bool((live <= layer.slot_budget()).all())
            assert bool((layer.head_heavy.sum(-1) == live.shape[1] * layer.heavy).all())
            assert bool((layer.head_heavy >= layer.sinks[:, None] + int(FLOOR * self.heavy)).all())
        self.steps += 1
        return scores


@pytest.mark.parametrize("spec, prefill", [("h2o", "late"), ("snapkv", "chunked"), ("knorm", "chunked"),
                                           ("tova", "late")])
def test_budgets_kept_every_step_and_exact_when_they_cover_all(spec, prefill):
    model = tiny_model("qwen2")  # GQA: 4 query heads on 2 KV heads
    ids = random_ids(50, batch=2, seed=6)
    cache = H2OCache(model, policy=spec, heavy=10, recent=3, chunk_size=16, prefill=prefill, head_budgets="adaptive")
    watch = HeadWatch(cache, 10)
    model.generate(ids, **cache_arg(cache), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                   logits_processor=LogitsProcessorList([watch]), pad_token_id=0)
    assert watch.steps == 12
    for layer in cache.layers:  # the dense layout (the C step holds uneven heads flat: test_kernels.py)
        layer.to_dense()
    assert cache.layers[0].keys.shape[1] == 2  # KV heads, never expanded to the query heads
    stats = cache.stats()
    assert stats["head_budgets"] == "adaptive"
    for layer, (low, high), capacity in zip(cache.layers, stats["head_budget_range"], stats["capacity"], strict=True):
        assert high == int(layer.slot_budget().max()) and low == int(layer.slot_budget().min())
        assert capacity == high + 1  # the layer's largest head budget, and the decode slot
    # the bytes reported are the slots allocated, head budgets uneven or not
    assert stats["kv_bytes"] == sum(2 * lay.keys.numel() * lay.keys.element_size() for lay in cache.layers)

    plain = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True)
    roomy = H2OCache(model, policy=spec, heavy=80, recent=80, chunk_size=16, prefill=prefill, head_budgets="adaptive")
    ours = model.generate(ids, **cache_arg(roomy), max_new_tokens=10, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(plain.logits), atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec, prefill", [("h2o", "late"), ("snapkv:heads=own", "chunked")])
def test_batch_equals_single(llama, spec, prefill):
    """Left-padded rows of different lengths: each row's shares and tokens are its own run's."""
    seqs = [random_ids(n, seed=30 + i)[0].tolist() for i, n in enumerate([34, 19, 27])]
    ids, mask = pad_rows(seqs, pad_id=0)
    options = {"heavy_ratio": 0.3, "recent_ratio": 0.1, "chunk_size": 8, "prefill": prefill, "head_budgets": "adaptive"}
    cache = H2OCache(llama, policy=spec, **options)
    out = llama.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **cache_arg(cache))
    for i, s in enumerate(seqs):
        alone_cache = H2OCache(llama, policy=spec, **options)
        alone = llama.generate(torch.tensor([s]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True, **cache_arg(alone_cache))
        assert out.sequences[i, ids.shape[1]:].tolist() == alone.sequences[0, len(s):].tolist()
        torch.testing.assert_close(torch.stack(out.logits)[:, i], torch.stack(alone.logits)[:, 0], atol=1e-4, rtol=0)
        for layer, lone in zip(cache.layers, alone_cache.layers, strict=True):
            assert torch.equal(layer.head_heavy[i], lone.head_heavy[0])


def test_rows_keep_their_shares():
    """take_rows / append_rows (the server's batching) carry each row's shares with it."""
    model = tiny_model("qwen2")
    a = H2OCache(model, policy="h2o", heavy=6, recent=2, prefill="late", head_budgets="adaptive")
    model(random_ids(30, batch=2, seed=1), **cache_arg(a))
    shares = [layer.head_heavy.clone() for layer in a.layers]
    b = a.take_rows([1])
    assert all(torch.equal(lay.head_heavy, s[1:]) for lay, s in zip(b.layers, shares, strict=True))
    a.append_rows(b)
    assert all(torch.equal(lay.head_heavy, torch.cat([s, s[1:]])) for lay, s in zip(a.layers, shares, strict=True))


def test_late_adaptive_prefill_is_a_full_prefill():
    model = tiny_model("qwen2")
    ids = random_ids(40, seed=2)
    want = model(ids, **cache_arg(DynamicCache(config=model.config))).logits
    cache = H2OCache(model, policy="h2o", heavy=6, recent=2, prefill="late", head_budgets="adaptive")
    torch.testing.assert_close(model(ids, **cache_arg(cache)).logits, want, atol=1e-5, rtol=0)
    assert max(cache.stats()["peak_capacity"]) == 40


@pytest.mark.parametrize("options, message", [
    ({"policy": "local", "prefill": "late", "head_budgets": "adaptive"}, "needs a ranking policy"),
    ({"policy": "random", "prefill": "late", "head_budgets": "adaptive"}, "needs a ranking policy"),
    ({"policy": "h2o:heads=shared", "prefill": "late", "head_budgets": "adaptive"}, "keeps one set per layer"),
    ({"policy": "h2o", "head_budgets": "adaptive"}, "use prefill=late"),
    ({"policy": "snapkv", "chunk_size": 1, "head_budgets": "adaptive"}, "chunk_size > 1"),
    ({"policy": "h2o", "head_budgets": "per-head"}, "head_budgets must be one of uniform, adaptive"),
    ({"policy": "h2o", "head_floor": 1.5}, "head_floor must be a number in [0, 1]"),
    ({"policy": "h2o", "head_floor": math.nan}, "head_floor must be a number in [0, 1]"),
    ({"policy": "kvzip:ceiling=2", "prefill": "late"}, "give head_budgets=layers"),
    ({"policy": "kvzip:ceiling=0.5", "prefill": "late", "head_budgets": "layers"}, "ceiling must be 0 (none)"),
])
def test_bad_head_budgets_are_one_line_errors(options, message):
    with pytest.raises(H2OError) as err:
        H2OCache(MODEL, heavy=4, recent=2, **options)
    assert message in str(err.value) and "\n" not in str(err.value)
