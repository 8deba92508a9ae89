"""What issue 16 added to the core: late prefill, ``knorm``, head-shared ranking, the recent share.

Each against ``h2okv.core.reference`` (the per-token loop, extended with ``late``, ``key_scores`` and
shared heads), plus the shared guarantees: the budget at every step, exact with a budget >= the
length, batch == batch-of-one, GQA without expanding K/V, one-line errors.
"""

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList

from core_cases import MODEL, leaning_qkv, run_calls
from h2okv import H2OCache, H2OError
from h2okv.core.budget import BudgetSpec, fraction_keywords
from h2okv.core.compat import cache_arg
from h2okv.generation import new_cache, pad_rows
from h2okv.policies import make_policy
from h2okv.tools.tiny import BudgetWatch, random_ids, tiny_model

# the policies issue 16 adds, and the existing ranking policies with their heads shared
NEW_SPECS = ["knorm", "knorm:heads=shared", "h2o:heads=shared", "tova:heads=shared",
             "snapkv:window=5,kernel=3,heads=shared", "h2o-mean:heads=shared"]
LATE_SPECS = ["h2o", "tova", "h2o-sink", "h2o-mean", "snapkv:window=5,kernel=3", "local", "sink", *NEW_SPECS]


CALLS = {
    "prompt": [(0, 30)],
    "prompt+decode": [(0, 18)] + [(t, t + 1) for t in range(18, 30)],
    "two calls+decode": [(0, 12), (12, 22)] + [(t, t + 1) for t in range(22, 30)],
}


@pytest.mark.parametrize("calls", CALLS)
@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("spec", NEW_SPECS)
def test_new_policies_match_the_reference(spec, chunk, calls):
    """Chunked prefill (the general step, the per-token scan) and decode: same kept sets and
    outputs as the loop, for knorm and the head-shared ranking policies."""
    q, k, v = leaning_qkv(21)
    out, kept, _ = run_calls(spec, q, k, v, 5, 4, CALLS[calls], chunk)
    ref_out, ref_kept = reference_of(spec, q, k, v, 5, 4, CALLS[calls], chunk)
    assert kept == ref_kept
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)


def reference_of(spec, q, k, v, heavy, recent, calls, chunk, late=False):
    from h2okv.core.reference import reference

    return reference(q[0], k[0], v[0], spec, heavy, recent, calls, chunk=chunk, scale=k.shape[-1] ** -0.5, late=late)


@pytest.mark.parametrize("calls", CALLS)
@pytest.mark.parametrize("spec", LATE_SPECS)
def test_late_prefill_matches_the_reference(spec, calls):
    """Late prefill: each call read whole, ranked once at its end; decode steps as usual."""
    q, k, v = leaning_qkv(5)
    out, kept, layer = run_calls(spec, q, k, v, 5, 4, CALLS[calls], chunk=4, prefill="late")
    ref_out, ref_kept = reference_of(spec, q, k, v, 5, 4, CALLS[calls], chunk=4, late=True)
    assert kept == ref_kept
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)
    assert layer.peak_capacity <= 9 + max(c1 - c0 for c0, c1 in CALLS[calls])


def test_late_prefill_is_a_full_prefill_then_one_ranking():
    """The prompt's logits are a full cache's; the kept set is one ranking after the whole prompt:
    for knorm, the lowest-norm keys of the full cache outside the recent window; for h2o, the
    largest attention mass over the whole prompt (the reference with one chunk of everything)."""
    model = tiny_model("qwen2")  # GQA: 4 query heads on 2 KV heads
    ids = random_ids(48, batch=1, seed=4)
    plain = DynamicCache(config=model.config)
    want = model(ids, **cache_arg(plain)).logits
    heavy, recent = 7, 3
    for spec in ("knorm", "h2o", "tova:heads=shared", "snapkv"):
        cache = H2OCache(model, policy=spec, heavy=heavy, recent=recent, chunk_size=8, prefill="late")
        got = model(ids, **cache_arg(cache)).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        if spec == "knorm":
            assert torch.equal(got, want)  # no attention mass needed: the very kernel a full cache runs
            for layer, full_keys in zip(cache.layers, (plain.layers[i].keys for i in range(len(cache.layers))),
                                        strict=True):
                score = cache.policy.key_scores(full_keys)[0]  # [H, n]: -norm (rounded, so ties happen)
                for h in range(score.shape[0]):
                    kept = layer.ordinal[0, h][layer.valid[0, h]].tolist()
                    assert set(range(48 - recent, 48)) <= set(kept)
                    # the heavy part holds the highest scores (lowest norms) outside the window
                    heavy_kept = sorted(score[h, j].item() for j in kept if j < 48 - recent)
                    assert heavy_kept == sorted(score[h, :48 - recent].topk(heavy).values.tolist())
        assert cache.stats()["prefill"] == "late"
        assert max(cache.stats()["peak_capacity"]) == 48  # the call, while a layer runs
        assert max(cache.stats()["capacity"]) == heavy + recent + 1  # then the budget + 1


@pytest.mark.parametrize("spec", ["knorm", "tova:heads=shared", "h2o", "snapkv"])
@pytest.mark.parametrize("prefill", ["chunked", "late"])
def test_budget_kept_every_step_and_exact_when_it_covers_all(spec, prefill):
    model = tiny_model("qwen2")
    ids = random_ids(40, batch=2)
    cache = H2OCache(model, policy=spec, heavy=5, recent=3, chunk_size=16, prefill=prefill)
    watch = BudgetWatch(cache)
    model.generate(ids, **cache_arg(cache), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                   logits_processor=LogitsProcessorList([watch]), pad_token_id=0)
    assert all(max(s["slots"]) <= 8 and max(s["capacity"]) <= 9 for s in watch.history)
    assert cache.layers[0].keys.shape[1] == 2  # KV heads, never expanded to the 4 query heads
    plain = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True)
    roomy = H2OCache(model, policy=spec, heavy=60, recent=60, chunk_size=16, prefill=prefill)
    ours = model.generate(ids, **cache_arg(roomy), max_new_tokens=10, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    assert torch.equal(ours.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(plain.logits), atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec, prefill", [("knorm", "chunked"), ("knorm", "late"), ("tova:heads=shared", "late"),
                                           ("h2o", "late"), ("tova", "late"), ("snapkv:heads=shared", "chunked")])
def test_batch_equals_single(llama, spec, prefill):
    """Left-padded rows of different lengths: each row equals its batch-of-one run (late prefill
    included: a row whose real tokens end in an early block keeps its last query's scores)."""
    seqs = [random_ids(n, seed=10 + i)[0].tolist() for i, n in enumerate([30, 17, 24])]
    ids, mask = pad_rows(seqs, pad_id=0)
    budget = {"heavy_ratio": 0.2, "recent_ratio": 0.1}
    out = llama.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True,
                         **cache_arg(H2OCache(llama, policy=spec, chunk_size=8, prefill=prefill, **budget)))
    for i, s in enumerate(seqs):
        alone = llama.generate(torch.tensor([s]), max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True,
                               **cache_arg(H2OCache(llama, policy=spec, chunk_size=8, prefill=prefill, **budget)))
        assert out.sequences[i, ids.shape[1]:].tolist() == alone.sequences[0, len(s):].tolist()
        torch.testing.assert_close(torch.stack(out.logits)[:, i], torch.stack(alone.logits)[:, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("prefill", ["chunked", "late"])
def test_shared_heads_keep_one_aligned_set_per_layer(prefill):
    """heads=shared: every KV head of a layer holds the same tokens in the same slots (so the mean
    over the head axis at slot level is the mean per token), through padding, chunks and decode."""
    model = tiny_model("qwen2")
    seqs = [random_ids(n, seed=n)[0].tolist() for n in (37, 22)]
    ids, mask = pad_rows(seqs, pad_id=0)
    differ = []  # the control: with its own heads, some policy's heads keep different tokens
    for spec in ("tova:heads=shared", "h2o:heads=shared", "knorm:heads=shared"):
        cache = H2OCache(model, policy=spec, heavy=6, recent=2, chunk_size=8, prefill=prefill)
        model.generate(ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=6, do_sample=False,
                       pad_token_id=0)
        for layer in cache.layers:
            assert torch.equal(layer.valid, layer.valid[:, :1].expand_as(layer.valid))
            live = layer.ordinal.masked_fill(~layer.valid, -1)
            assert torch.equal(live, live[:, :1].expand_as(live))
        unshared = H2OCache(model, policy=spec.split(":")[0], heavy=6, recent=2, chunk_size=8, prefill=prefill)
        model.generate(ids, attention_mask=mask, **cache_arg(unshared), max_new_tokens=6, do_sample=False,
                       pad_token_id=0)
        differ += [not torch.equal(lay.ordinal.masked_fill(~lay.valid, -1)[:, 0],
                                   lay.ordinal.masked_fill(~lay.valid, -1)[:, 1]) for lay in unshared.layers]
    assert any(differ)


def test_recent_share_splits_a_fraction():
    assert BudgetSpec.from_fraction(0.2) == BudgetSpec(heavy_ratio=0.1, recent_ratio=0.1)  # the paper's split, unchanged
    spec = BudgetSpec.from_fraction(0.2, recent_share=0.05)
    assert spec.resolve(2048) == (int(0.19 * 2048), int(0.01 * 2048))
    assert fraction_keywords("knorm", 0.2, 0.0) == {"heavy_ratio": 0.2, "recent_ratio": 0.0}
    assert fraction_keywords("full", 0.2, 0.05) == {}
    cache = new_cache(MODEL, "knorm", 0.2, recent_share=0.0)
    MODEL(random_ids(50), **cache_arg(cache))
    assert cache.budget() == [10]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: H2OCache(MODEL, policy="h2o", prefill="early"), "prefill must be one of chunked, late"),
        (lambda: make_policy("tova:heads=all"), "heads must be own or shared"),
        (lambda: make_policy("knorm:window=3"), "has no option 'window'"),
        (lambda: make_policy("local:heads=shared"), "has no option 'heads'"),
        (lambda: BudgetSpec.from_fraction(0.2, 1.5), "recent_share= must be a number in [0, 1]"),
        (lambda: BudgetSpec.from_fraction(0.2, float("nan")), "recent_share= must be a number in [0, 1]"),
        (lambda: new_cache(MODEL, "h2o", 0.2, recent_share=0.0), "recent_share= 0.0 leaves h2o no recent slots"),
    ],
)
def test_bad_options_are_one_line_errors(make, message):
    with pytest.raises(H2OError, match=None) as err:
        make()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_policy_specs_name_their_options():
    # a heads choice names itself, even where the policy's first option is another (h2o's decay)
    assert make_policy("h2o:shared").spec == "h2o:heads=shared"
    assert make_policy("h2o-sink:own").spec == "h2o-sink"
    assert make_policy("h2o:0.9").spec == "h2o:decay=0.9"
    assert make_policy("h2o:decay=0.9,heads=shared").spec == "h2o:decay=0.9,heads=shared"
    assert make_policy("snapkv:16,heads=shared").spec == "snapkv:window=16,kernel=7,heads=shared"
    assert make_policy("knorm").spec == "knorm"
    assert make_policy("tova:heads=own").spec == "tova"
