"""The cache's paths against ``h2okv.core.reference``, the plain per-token loop of Algorithm 1.

The general step (``step.chunk_step``), the decode steppers at the budget (``decode.py``) and the
per-token scan (``scan.token_scan``) must keep the same tokens and give the same attention
outputs as the loop; each policy's hooks are checked against the rule it states.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import h2okv.core.layer as layer_mod
from core_cases import MODEL, PATH_CASES, leaning_qkv, random_qkv, run_calls, spy_on_path
from h2okv import H2OCache
from h2okv.core import kernels
from h2okv.core.compat import cache_arg
from h2okv.core.native.build import library
from h2okv.core.native.rules import c_decode_rule, native_rule
from h2okv.core.reference import reference
from h2okv.policies import make_policy
from h2okv.tools.tiny import random_ids, tiny_model


def run_layer(q, k, v, heavy, recent, chunk, scale, policy="h2o"):
    cache = H2OCache(MODEL, policy=policy, heavy=heavy, recent=recent, chunk_size=chunk)
    layer = cache.layers[0]
    b = q.shape[0]
    outs = []
    # the prompt as one forward call, chunked inside; then nothing else
    layer.update(k, v)
    out = layer.attend(q, k, v, None, scale)  # [B, n, Hq, D]
    outs.append(out)
    kept = []
    for bi in range(b):
        kept.append([sorted(layer.ordinal[bi, h][layer.valid[bi, h]].tolist()) for h in range(k.shape[1])])
    return out.transpose(1, 2), kept


# one chunked forward call: its length, budget, chunk size, GQA groups and random weights
CHUNKED_CASES = dict(
    n=st.integers(1, 24),
    heavy=st.integers(1, 6),
    recent=st.integers(1, 6),
    chunk=st.sampled_from([1, 2, 5, 64]),
    groups=st.sampled_from([1, 3]),
    seed=st.integers(0, 10_000),
)


@settings(max_examples=25, deadline=None)
@given(**CHUNKED_CASES)
def test_slot_layer_matches_reference_algorithm(n, heavy, recent, chunk, groups, seed):
    hkv, d = 2, 8
    q, k, v = random_qkv(seed, hkv * groups, hkv, n, d)
    scale = d**-0.5
    out, kept = run_layer(q, k, v, heavy, recent, chunk, scale)
    ref_out, ref_kept = reference(q[0], k[0], v[0], "h2o", heavy, recent, chunk=chunk, scale=scale)
    assert kept[0] == ref_kept
    torch.testing.assert_close(out[0], ref_out.float(), atol=1e-5, rtol=1e-5)



# -- every policy's rule, token by token ----------------------------------------------------------
# what each policy states, written out independently of its hooks (test_policy_hooks_state_their_rule)
SINKS = {"h2o-sink": 4, "sink": 4}


def split(policy, heavy, recent):
    if policy == "local":
        return 0, heavy + recent
    if policy == "sink":
        sinks = min(4, heavy + recent - 1)
        return sinks, heavy + recent - sinks
    return heavy, recent


def rank(policy, score, j, seen):
    """The policy's eviction key of token ``j`` once ``seen`` tokens have been read (lowest goes)."""
    if policy == "h2o-mean":
        return score[j] / (seen - j)  # divided by the number of queries that saw j
    if policy in ("local", "sink"):
        return j  # oldest first
    return score[j]


RULE_POLICIES = ["h2o", "tova", "h2o-sink", "h2o-mean", "snapkv", "local", "sink"]
# decode-time re-ranking (h2o.py's decay): the same paths, the scores faded before each call's mass
DECAY_POLICIES = ["h2o:decay=0.8", "snapkv:window=6,kernel=3,decay=0.9", "rkv:weight=0.5,decay=0.7"]


@settings(max_examples=12, deadline=None)
@given(**CHUNKED_CASES)
@pytest.mark.parametrize("policy", RULE_POLICIES)
def test_every_policy_matches_its_reference_rule(policy, n, heavy, recent, chunk, groups, seed):
    """One forward call, chunked inside: same kept sets and outputs as the policy's rule in a loop."""
    hkv, d = 2, 8
    q, k, v = random_qkv(seed, hkv * groups, hkv, n, d)
    scale = d**-0.5
    spec = "snapkv:window=5,kernel=3" if policy == "snapkv" else policy
    out, kept = run_layer(q, k, v, heavy, recent, chunk, scale, policy=spec)
    ref_out, ref_kept = reference(q[0], k[0], v[0], spec, heavy, recent, chunk=chunk, scale=scale)
    assert kept[0] == ref_kept
    torch.testing.assert_close(out[0], ref_out.float(), atol=1e-5, rtol=1e-5)


# each path, named, with a spy that proves it ran: a divergence in any one of them fails here
@pytest.mark.parametrize("kernels_name", ["eager", "native"])
@pytest.mark.parametrize("path", PATH_CASES)
@pytest.mark.parametrize("policy", RULE_POLICIES + DECAY_POLICIES)
def test_each_path_matches_the_reference(path, policy, kernels_name, monkeypatch):
    """Under the tensor ops and under the C kernels (the scan and the decode step where they know
    the policy's rule: the engine that ran is checked)."""
    chunk, calls, runs = PATH_CASES[path]
    taken = spy_on_path(monkeypatch, path)
    hq, hkv, n, d, heavy, recent = 6, 2, 30, 8, 5, 4
    # the first tokens draw little attention, so whether a path protects the sinks shows
    q, k, v = leaning_qkv(21, hq, hkv, n, d)
    spec = "snapkv:window=6,kernel=3" if policy == "snapkv" else policy
    with kernels.use_kernels(kernels_name):
        out, kept, _ = run_calls(spec, q, k, v, heavy, recent, calls, chunk)
    assert len(taken) == runs
    if path == "decode_step":
        in_c = kernels_name == "native" and library() is not None and c_decode_rule(make_policy(spec)) is not None
        assert set(taken) == {"NativeStep" if in_c else "EagerStep"}
    ref_out, ref_kept = reference(q[0], k[0], v[0], spec, heavy, recent, calls, chunk=chunk, scale=d**-0.5)
    assert kept == ref_kept
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", RULE_POLICIES)
def test_policy_hooks_state_their_rule(policy):
    """The hooks the reference (and the cache) call, against each policy's rule written out."""
    p = make_policy(policy)
    assert (p.split(5, 4).heavy, p.split(5, 4).recent) == split(policy, 5, 4)
    assert p.sink_tokens == SINKS.get(policy, 0)
    assert p.needs_scores == (policy not in ("local", "sink"))
    assert p.score_queries == ("last" if policy == "tova" else "all")
    g = torch.Generator().manual_seed(4)
    score, ordinal, seen = torch.rand(12, generator=g, dtype=torch.float64), torch.randperm(12, generator=g), 15
    by_token = dict(zip(ordinal.tolist(), score.tolist(), strict=True))
    expected = torch.tensor([float(rank(policy, by_token, j, seen)) for j in ordinal.tolist()], dtype=torch.float64)
    key = p.eviction_key(score, ordinal, torch.tensor(seen))
    assert torch.equal(key.argsort(), expected.argsort())
    folded, mass = score.clone(), torch.rand(12, generator=g, dtype=torch.float64)
    p.accumulate(folded, mass)
    torch.testing.assert_close(folded, mass if policy == "tova" else score + mass)


@pytest.mark.parametrize("spec", DECAY_POLICIES)
def test_decay_fades_the_score_before_each_call_adds_its_mass(spec):
    """The rule written out: score <- decay * score + mass (Algorithm 1's sum when decay is 1);
    it declares the fold "decay", which only the C decode step knows (not the scan, not Triton)."""
    p = make_policy(spec)
    g = torch.Generator().manual_seed(5)
    score, mass = torch.rand(2, 3, 9, generator=g), torch.rand(2, 3, 9, generator=g)
    folded = score.clone()
    p.accumulate(folded, mass)
    torch.testing.assert_close(folded, p.decay * score + mass)
    assert p.decode_rule().fold == "decay" and p.decay < 1 and make_policy(spec.split(":")[0]).decode_rule().fold == "add"
    assert native_rule(p) is None and c_decode_rule(p) is not None


def test_decay_lets_a_token_the_latest_queries_ignore_go_before_an_old_heavy_hitter_would():
    """Early queries read token 1, the later ones token 2, less sharply: with one heavy slot the
    sum keeps the early favourite 1; with decay the latest queries decide and 2 stays."""
    d, n = 4, 14
    k = torch.zeros(1, n, d)
    k[0, 1, 0] = k[0, 2, 1] = 6.0  # token 1 answers direction 0, token 2 direction 1
    q = torch.zeros(1, n, d)
    q[0, 2:5, 0] = 1.0  # three queries read token 1 hard
    q[0, 5:n, 1] = 0.45  # nine read token 2, less sharply: 2's total stays below 1's
    calls = [(t, t + 1) for t in range(n)]
    v = torch.randn(1, n, d)
    _, summed = reference(q, k, v, "h2o", 1, 6, calls)
    _, faded = reference(q, k, v, "h2o:decay=0.5", 1, 6, calls)
    assert summed[0] == [1, *range(8, n)]
    assert faded[0] == [2, *range(8, n)]


def snapkv_rule(q, k, kept, c0, c1, scale, window, kernel, pool="avg", chunk=0):
    """SnapKV for one KV head in plain Python: the call's last ``window`` queries over the kept
    tokens and the call up to themselves; the call's tokens averaged (or maxed) over ``kernel``
    neighbours, then, with ``chunk``, each aligned block of the call given its mean."""
    mass = {}
    for i in range(max(c0, c1 - window), c1):
        visible = kept + list(range(c0, i + 1))
        for qh in range(q.shape[0]):
            p = torch.softmax(torch.stack([q[qh, i] @ k[j] for j in visible]).double() * scale, 0)
            for a, j in enumerate(visible):
                mass[j] = mass.get(j, 0.0) + float(p[a])
    new = [mass.get(j, 0.0) for j in range(c0, c1)]
    half = kernel // 2
    around = [new[max(0, a - half):a + half + 1] for a in range(len(new))]
    smooth = [max(near) if pool == "max" else sum(near) / len(near) for near in around]
    if chunk > 1:
        blocks = [smooth[a:a + chunk] for a in range(0, len(smooth), chunk)]
        smooth = [sum(block) / len(block) + 1e-3 * own for block in blocks for own in block]
    return [mass.get(j, 0.0) for j in kept], smooth


@pytest.mark.parametrize("spans", [{}, {"pool": "max"}, {"chunk": 5}, {"pool": "max", "chunk": 4}],
                         ids=["avg", "max", "chunk", "max-chunk"])
@pytest.mark.parametrize("kept", [[], [0, 2, 5, 7]])
def test_snapkv_prefill_scores_state_its_rule(kept, spans):
    q, k, _ = random_qkv(9, 3, 1, 20, 8)
    policy = make_policy("snapkv:window=5,kernel=3" + "".join(f",{key}={value}" for key, value in spans.items()))
    old, new = policy.prefill_scores(q[:, :, 8:20], k[:, :, 8:20], k[:, :, kept], torch.ones(1, 1, len(kept), dtype=torch.bool),
                                     torch.tensor([12]), 8**-0.5)
    want_old, want_new = snapkv_rule(q[0], k[0, 0], kept, 8, 20, 8**-0.5, window=5, kernel=3, **spans)
    torch.testing.assert_close(old[0, 0].double(), torch.tensor(want_old, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new[0, 0].double(), torch.tensor(want_new, dtype=torch.float64), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", RULE_POLICIES + DECAY_POLICIES)
def test_every_policy_decodes_like_its_reference_rule(policy):
    """A chunked prompt in one call, then one token per call (generate's pattern)."""
    hq, hkv, n, d, heavy, recent, prompt = 6, 2, 36, 8, 5, 4, 20
    q, k, v = random_qkv(11, hq, hkv, n, d)
    spec = "snapkv:window=6,kernel=3" if policy == "snapkv" else policy
    cache = H2OCache(MODEL, policy=spec, heavy=heavy, recent=recent, chunk_size=4)
    layer = cache.layers[0]
    outs = []
    for c0, c1 in [(0, prompt)] + [(t, t + 1) for t in range(prompt, n)]:
        sl = slice(c0, c1)
        layer.update(k[:, :, sl], v[:, :, sl])
        outs.append(layer.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], None, d**-0.5).transpose(1, 2))
        total = make_policy(policy).split(heavy, recent).total
        assert int(layer.valid.sum(-1).max()) <= total
    out = torch.cat(outs, dim=2)
    calls = [(0, prompt)] + [(t, t + 1) for t in range(prompt, n)]
    ref_out, ref_kept = reference(q[0], k[0], v[0], spec, heavy, recent, calls, chunk=4, scale=d**-0.5)
    assert [sorted(layer.ordinal[0, h][layer.valid[0, h]].tolist()) for h in range(hkv)] == ref_kept
    torch.testing.assert_close(out[0], ref_out.float(), atol=1e-5, rtol=1e-5)


def test_decode_steps_match_reference_and_never_readmit():
    """Prompt then one token per call, like generate: same kept sets as the reference; an
    evicted token never comes back; the last `recent` tokens are always kept."""
    hq, hkv, n, d, heavy, recent = 6, 2, 30, 8, 3, 4
    q, k, v = random_qkv(7, hq, hkv, n, d)
    cache = H2OCache(MODEL, policy="h2o", heavy=heavy, recent=recent, chunk_size=4)
    layer = cache.layers[0]
    prompt = 10
    layer.update(k[:, :, :prompt], v[:, :, :prompt])
    layer.attend(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], None, d**-0.5)
    evicted = [set() for _ in range(hkv)]
    previous = [set(layer.ordinal[0, h][layer.valid[0, h]].tolist()) for h in range(hkv)]
    for t in range(prompt, n):
        sl = slice(t, t + 1)
        layer.update(k[:, :, sl], v[:, :, sl])
        layer.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], None, d**-0.5)
        assert layer.capacity == heavy + recent + 1  # in place: no growth once full
        for h in range(hkv):
            now = set(layer.ordinal[0, h][layer.valid[0, h]].tolist())
            assert len(now) == heavy + recent
            assert set(range(t + 1 - recent, t + 1)) <= now
            assert not (now & evicted[h]), "an evicted token came back"
            evicted[h] |= (previous[h] | {t}) - now
            previous[h] = now
    # the prompt prefix in chunks of 4 then single steps is the same as the reference with the
    # same chunking of the prompt followed by chunks of 1
    calls = [(0, prompt)] + [(t, t + 1) for t in range(prompt, n)]
    _, ref_kept = reference(q[0], k[0], v[0], "h2o", heavy, recent, calls, chunk=4, scale=d**-0.5)
    assert [sorted(p) for p in previous] == ref_kept


@pytest.mark.parametrize("policy", ["local", "sink"])
def test_window_policies_keep_expected_tokens(policy):
    n, d = 40, 8
    q, k, v = random_qkv(1, 2, 2, n, d)
    _, kept = run_layer(q, k, v, heavy=4, recent=6, chunk=3, scale=d**-0.5, policy=policy)
    if policy == "local":
        expected = list(range(n - 10, n))
    else:
        expected = [0, 1, 2, 3] + list(range(n - 6, n))
    assert kept[0] == [expected, expected]


def test_random_policy_is_seeded_and_respects_recent():
    n, d = 40, 8
    q, k, v = random_qkv(2, 2, 2, n, d)

    def kept(seed):
        cache = H2OCache(MODEL, policy="random", heavy=5, recent=5, chunk_size=1, seed=seed)
        layer = cache.layers[0]
        layer.update(k, v)
        layer.attend(q, k, v, None, d**-0.5)
        return [sorted(layer.ordinal[0, h][layer.valid[0, h]].tolist()) for h in range(2)]

    a, b, c = kept(0), kept(0), kept(1)
    assert a == b
    assert a != c
    for heads in (a, c):
        for s in heads:
            assert len(s) == 10 and s[-5:] == list(range(n - 5, n))


def test_scores_sum_to_queries_seen():
    """Every query hands out exactly one unit of probability per query head; kept + evicted
    mass therefore never exceeds n * group size, and kept mass is positive."""
    n, d = 12, 8
    q, k, v = random_qkv(3, 6, 2, n, d)
    cache = H2OCache(MODEL, policy="h2o", heavy=100, recent=100, chunk_size=5)
    layer = cache.layers[0]
    layer.update(k, v)
    layer.attend(q, k, v, None, d**-0.5)
    total = layer.score.sum(-1)  # nothing evicted: all mass is still on the slots
    assert torch.allclose(total, torch.full_like(total, n * 3.0), atol=1e-4)
    assert math.isclose(float(layer.score[layer.valid].min() > 0), 1.0)


def test_snapkv_window_reaches_earlier_chunks():
    """A needle in the first of many chunks that only the prompt's last queries look at: snapkv
    keeps it (its scores exist before the first chunk runs), h2o has evicted it long before, and
    the prefill never holds more than budget + chunk slots."""
    g = torch.Generator().manual_seed(5)
    n, d, needle, window = 64, 8, 20, 4
    # dims 0-3 carry the needle: no other key has them, only the question's queries ask for them;
    # dims 4-7 make tokens 0-2 the heavy hitters every query looks at
    k = torch.randn(1, 2, n, d, generator=g)
    k[:, :, :, :4] = 0.0
    k[:, :, needle, :4] = 3.0
    k[:, :, :3, 4:] = 2.0
    q = torch.randn(1, 2, n, d, generator=g)
    q[:, :, :, :4] = 0.0
    q[:, :, n - window:, :4] = 3.0
    q[:, :, :, 4:] = 1.0
    v = torch.randn(1, 2, n, d, generator=g)
    kept = {}
    for policy in ("snapkv:window=4,kernel=1", "h2o"):
        cache = H2OCache(MODEL, policy=policy, heavy=3, recent=4, chunk_size=8)
        layer = cache.layers[0]
        layer.update(k, v)
        layer.attend(q, k, v, None, d**-0.5)
        kept[policy] = [set(layer.ordinal[0, h][layer.valid[0, h]].tolist()) for h in range(2)]
        assert layer.peak_capacity <= 3 + 4 + 8
    assert all(needle in heads for heads in kept["snapkv:window=4,kernel=1"])
    assert not any(needle in heads for heads in kept["h2o"])


@pytest.mark.parametrize("policy", ["h2o", "tova", "h2o-sink", "h2o-mean", "snapkv", "local", "sink", "rkv"])
def test_token_scan_equals_slot_by_slot_steps(policy, monkeypatch):
    """Per-token eviction over whole calls (core/scan.py) against the same calls run slot by slot
    (chunk_step per token): same logits and kept tokens, through a second call that starts with
    live old slots inside the recent window, and decode steps after it."""
    model = tiny_model("qwen2")  # GQA: 4 query heads on 2 KV heads
    ids = random_ids(40, batch=2, seed=3)

    def run(scan):
        monkeypatch.setattr(layer_mod, "can_scan", layer_mod.can_scan if scan else (lambda *a: False))
        cache = H2OCache(model, policy=policy, heavy=6, recent=5, chunk_size=1)
        logits = [model(ids[:, :25], **cache_arg(cache)).logits,
                  model(ids[:, 25:36], **cache_arg(cache)).logits]
        for t in range(36, 40):
            logits.append(model(ids[:, t:t + 1], **cache_arg(cache)).logits)
        kept = [[sorted(layer.ordinal[r, h][layer.valid[r, h]].tolist()) for r in range(2) for h in range(2)]
                for layer in cache.layers]
        return torch.cat(logits, dim=1), kept, cache

    fast_logits, fast_kept, fast_cache = run(True)
    slow_logits, slow_kept, _ = run(False)
    torch.testing.assert_close(fast_logits, slow_logits, atol=1e-5, rtol=1e-5)
    assert fast_kept == slow_kept
    assert max(fast_cache.stats()["slots"]) == 11
    assert max(fast_cache.stats()["capacity"]) == 12
