"""Branch scoring (read each context once, then every continuation) equals scoring each alone."""

import random

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.budget import BudgetSpec
from h2okv.core.compat import cache_arg
from h2okv.eval.branch import branch_loglikelihoods
from h2okv.policies import make_policy
from h2okv.tools.tiny import VOCAB, tiny_model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny per-token ops: threads only add waiting
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def items(seed, n_items=4):
    """Multiple-choice rows: a few contexts of different lengths, 2-4 continuations of 1-5 tokens each."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n_items):
        context = [0] + [rng.randint(2, VOCAB - 3) for _ in range(rng.randint(10, 40))]
        for _ in range(rng.randint(2, 4)):
            rows.append((context, [rng.randint(2, VOCAB - 3) for _ in range(rng.randint(1, 5))]))
    rng.shuffle(rows)  # the choices of one item need not be neighbours
    return rows


def alone(model, context, continuation, policy, ratio):
    """One (context, continuation) in one forward call through its own cache, per-token eviction,
    with the absolute budget that ``ratio`` gives for this context's length."""
    cache = None
    if policy != "full":
        spec = BudgetSpec.build(make_policy(policy), None, None, ratio / 2, ratio / 2)
        heavy, recent = spec.resolve(len(context))
        cache = H2OCache(model, policy=policy, heavy=heavy, recent=recent, chunk_size=1)
    ids = torch.tensor([context + continuation[:-1]])
    logits = model(ids, **cache_arg(cache), use_cache=cache is not None).logits[0, len(context) - 1 :]
    lp = torch.log_softmax(logits.float(), -1)
    target = torch.tensor(continuation)
    return float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


@pytest.mark.parametrize("policy", ["full", "h2o", "local", "sink"])
def test_branch_scoring_equals_each_choice_alone(model, policy):
    rows = items(seed=1)
    ratio = 0.3
    if policy == "full":
        cache = H2OCache(model, policy="full")
    else:
        cache = H2OCache(model, policy=policy, heavy_ratio=ratio / 2, recent_ratio=ratio / 2, chunk_size=1)
    branched = branch_loglikelihoods(model, rows, cache, pad_id=1)
    for (lp, greedy), (context, continuation) in zip(branched, rows, strict=True):
        ref_lp, ref_greedy = alone(model, context, continuation, policy, ratio)
        assert lp == pytest.approx(ref_lp, abs=1e-4)
        assert greedy == ref_greedy
    if policy != "full":
        # each distinct context was read once: the cache holds one row per multi-token continuation
        assert cache.layers[0].keys.shape[0] == sum(len(c) > 1 for _, c in rows)
        # and its budget came from the context's length
        spec = BudgetSpec.build(make_policy(policy), None, None, ratio / 2, ratio / 2)
        assert cache.budget() == [sum(spec.resolve(len(ctx))) for ctx, c in rows if len(c) > 1]


def test_eviction_changes_the_scores(model):
    """The comparison above is not vacuous: a small budget does change the log-likelihoods."""
    rows = items(seed=2)
    full = branch_loglikelihoods(model, rows, H2OCache(model, policy="full"), pad_id=1)
    h2o = branch_loglikelihoods(model, rows, H2OCache(model, policy="h2o", heavy_ratio=0.1, recent_ratio=0.1,
                                                      chunk_size=1, budget_floor=0), pad_id=1)
    assert max(abs(a[0] - b[0]) for a, b in zip(full, h2o, strict=True)) > 1e-2


def test_single_token_continuations_need_no_second_pass(model):
    rows = [([0, 5, 6, 7, 8, 9, 10, 11], [c]) for c in (12, 13, 14)]
    cache = H2OCache(model, policy="h2o", heavy=2, recent=2, chunk_size=1)
    out = branch_loglikelihoods(model, rows, cache, pad_id=1)
    assert cache.layers[0].keys.shape[0] == 1  # one context, never repeated
    for (lp, _), (context, continuation) in zip(out, rows, strict=True):
        ref = H2OCache(model, policy="h2o", heavy=2, recent=2, chunk_size=1)
        logits = model(torch.tensor([context]), **cache_arg(ref), use_cache=True).logits[0, -1]
        assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[continuation[0]]), abs=1e-5)
