"""``expected`` (Expected Attention, a question-agnostic scorer): its scores against the rule
written the way kvpress states it (pre-RoPE query statistics, the rotation averaged over absolute
future positions), and the cache's paths against the reference loop; the other shared
guarantees run with the other policies in test_cache_in_models.py."""

import pytest
import torch

from core_cases import MODEL, random_qkv
from h2okv import H2OCache, H2OError
from h2okv.core.compat import cache_arg
from h2okv.core.reference import reference
from h2okv.core.rope import RopeRotation
from h2okv.policies import make_policy
from h2okv.tools.tiny import random_ids, tiny_model

D = 16  # the tiny models' head size


def rotation(inv_freq: torch.Tensor, position: float) -> torch.Tensor:
    """RoPE's rotate-half matrix at ``position``, ``[D, D]`` float64."""
    half = inv_freq.numel()
    angle = position * inv_freq
    r = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    idx = torch.arange(half)
    r[idx, idx], r[idx + half, idx + half] = angle.cos(), angle.cos()
    r[idx, idx + half], r[idx + half, idx] = -angle.sin(), angle.sin()
    return r


def kvpress_rule(q_pre, keys, values, first_position, inv_freq, scale, future, sinks):
    """Expected attention for one KV head's group: ``q_pre`` ``[g, n, D]`` queries before RoPE of a
    call starting at ``first_position`` (the sequence's start when 0); ``keys``/``values`` ``[T, D]``."""
    n = q_pre.shape[1]
    start = sinks if first_position == 0 else 0
    sample = q_pre[:, start:].double()
    mu = sample.mean(1)  # [g, D]
    centered = sample - mu[:, None]
    cov = torch.einsum("gsi,gsj->gij", centered, centered) / sample.shape[1]
    last = first_position + n  # the next position
    r = torch.stack([rotation(inv_freq, p) for p in range(last, last + future)]).mean(0)
    mu, cov = mu @ r.T, r @ cov @ r.T
    k = keys.double()
    logits = scale * (k @ mu.T).T + 0.5 * scale**2 * torch.einsum("ti,gij,tj->gt", k, cov, k)
    return torch.softmax(logits, -1).mean(0) * values.double().norm(dim=-1)


@pytest.mark.parametrize("first_position, kept", [(0, []), (12, [0, 3, 5, 9])])
def test_expected_scores_state_the_rule(first_position, kept):
    """Queries handed over after RoPE, turned back inside the policy: the kvpress formula."""
    g_heads, n = 3, 20
    gen = torch.Generator().manual_seed(3)
    q_pre = torch.randn(g_heads, n, D, generator=gen)
    rope = RopeRotation(1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), D)
    q_post = q_pre.clone()[None]
    rope.rotate_(q_post, (first_position + torch.arange(n)).expand(1, g_heads, n))
    keys, values = torch.randn(1, 1, 40, D, generator=gen), torch.randn(1, 1, 40, D, generator=gen)
    policy = make_policy("expected:future=64,sinks=4")
    policy.rope = rope
    call = slice(first_position, first_position + n)
    old, new = policy.prefill_scores(
        q_post, keys[:, :, call], keys[:, :, kept], torch.ones(1, 1, len(kept), dtype=torch.bool), torch.tensor([n]),
        D**-0.5, value_new=values[:, :, call], old_values=values[:, :, kept])
    visible = kept + list(range(first_position, first_position + n))
    want = kvpress_rule(q_pre, keys[0, 0, visible], values[0, 0, visible], first_position, rope.inv_freq, D**-0.5,
                        64, 4)
    torch.testing.assert_close(torch.cat([old, new], -1)[0, 0].double(), want, atol=1e-5, rtol=1e-4)


def test_without_rope_the_mean_is_not_turned():
    """A model without RoPE (OPT): no rotation, the statistics as they are."""
    policy = make_policy("expected")
    policy.bind(tiny_model("opt"))
    assert policy.rope is None
    q, k, v = random_qkv(2, 2, 1, 10, D)
    old, new = policy.prefill_scores(q, k, k[:, :, :0], torch.ones(1, 1, 0, dtype=torch.bool), torch.tensor([10]), 0.25,
                                     value_new=v, old_values=v[:, :, :0])
    sample = q[0, :, 4:].double()
    mu, centered = sample.mean(1), sample - sample.mean(1, keepdim=True)
    cov = torch.einsum("gsi,gsj->gij", centered, centered) / 6
    logits = 0.25 * (k[0, 0].double() @ mu.T).T + 0.5 * 0.25**2 * torch.einsum("ti,gij,tj->gt", k[0, 0].double(), cov,
                                                                                 k[0, 0].double())
    want = torch.softmax(logits, -1).mean(0) * v[0, 0].double().norm(dim=-1)
    torch.testing.assert_close(new[0, 0].double(), want, atol=1e-5, rtol=1e-4)


CALLS = {
    "prompt": [(0, 30)],
    "prompt+decode": [(0, 18)] + [(t, t + 1) for t in range(18, 30)],
    "two calls+decode": [(0, 12), (12, 22)] + [(t, t + 1) for t in range(22, 30)],
}


@pytest.mark.parametrize("calls", CALLS)
@pytest.mark.parametrize("prefill, chunk", [("chunked", 4), ("chunked", 1), ("late", 4)])
def test_expected_matches_the_reference(calls, prefill, chunk):
    """Every path of the cache (chunks, the per-token scan, late prefill, decode) keeps what the
    loop keeps, with the same outputs and the sinks protected."""
    q, k, v = random_qkv(17, 6, 2, 30, D)
    policy = make_policy("expected:future=32,sinks=2")
    cache = H2OCache(MODEL, policy=policy, heavy=6, recent=3, chunk_size=chunk, prefill=prefill)
    assert policy.rope is not None
    layer = cache.layers[0]
    outs = []
    for c0, c1 in CALLS[calls]:
        sl = slice(c0, c1)
        layer.update(k[:, :, sl], v[:, :, sl])
        outs.append(layer.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], None, D**-0.5).transpose(1, 2))
        assert int(layer.valid.sum(-1).max()) <= 9
    ref_out, ref_kept = reference(q[0], k[0], v[0], policy, 6, 3, CALLS[calls], chunk=chunk, scale=D**-0.5,
                                  late=prefill == "late")
    kept = [sorted(layer.ordinal[0, h][layer.valid[0, h]].tolist()) for h in range(2)]
    assert kept == ref_kept
    assert all({0, 1} <= set(heads) for heads in kept)
    torch.testing.assert_close(torch.cat(outs, dim=2)[0], ref_out.float(), atol=1e-5, rtol=1e-5)


def test_partial_rotary_turns_only_the_rotated_share():
    """GPT-NeoX rotates a share of each head: only that share is turned; the rest is kept as is."""
    cache = H2OCache(tiny_model("gpt_neox"), policy="expected", heavy=4, recent=2)
    rope = cache.policy.rope
    assert (rope.rotary_dim, rope.head_dim) == (8, 16)
    x = torch.randn(3, 16)
    turned = cache.policy._turn(x)
    assert torch.equal(turned[:, 8:], x[:, 8:]) and not torch.allclose(turned[:, :8], x[:, :8])


def test_expected_generates_within_budget_and_adapts_heads():
    model = tiny_model("qwen2")
    ids = random_ids(50, batch=2, seed=8)
    for prefill in ("chunked", "late"):
        cache = H2OCache(model, policy="expected", heavy=8, recent=2, chunk_size=16, prefill=prefill,
                         head_budgets="adaptive")
        model.generate(ids, **cache_arg(cache), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert all(bool((lay.live_slots() <= lay.slot_budget()).all()) for lay in cache.layers)
        assert all(bool((lay.head_heavy.sum(-1) == 16).all()) for lay in cache.layers)


@pytest.mark.parametrize("spec, message", [("expected:future=0", "future must be >= 1"),
                                           ("expected:sinks=-1", "sinks must be >= 0"),
                                           ("expected:window=3", "has no option 'window'")])
def test_bad_options_are_one_line_errors(spec, message):
    with pytest.raises(H2OError) as err:
        H2OCache(MODEL, policy=spec, heavy=4, recent=2)
    assert message in str(err.value) and "\n" not in str(err.value)
