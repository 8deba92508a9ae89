"""``slot_attention`` without the mass: where every KV head sees the same slots it hands SDPA one
mask for all grouped heads (``heads_share``); the output is the per-head masked attention's."""

import pytest
import torch

from h2okv.core import attention
from h2okv.core.attention import heads_share, slot_attention


def masked_attention(query, keys, values, allowed, scaling):
    g = query.shape[1] // keys.shape[1]
    logits = query @ keys.repeat_interleave(g, 1).transpose(-1, -2) * scaling
    logits = logits.masked_fill(~allowed.repeat_interleave(g, 1), float("-inf"))
    return torch.softmax(logits, -1) @ values.repeat_interleave(g, 1)


@pytest.mark.parametrize("shared", [True, False])
def test_one_mask_for_every_head_gives_each_heads_attention(monkeypatch, shared):
    torch.manual_seed(0)
    b, hq, hkv, m, cap, d = 2, 6, 2, 5, 12, 8
    allowed = torch.rand(b, 1, m, cap).expand(b, hkv, m, cap) > 0.4
    allowed = allowed.clone()
    allowed[..., 0] = True  # every query sees a slot
    if not shared:
        allowed[1, 1, 2, 3] = ~allowed[1, 0, 2, 3]
    assert heads_share(allowed) is shared
    calls = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    query, keys, values = torch.randn(b, hq, m, d), torch.randn(b, hkv, cap, d), torch.randn(b, hkv, cap, d)
    out, mass = slot_attention(query, keys, values, allowed, 0.3, need_mass=False)
    assert mass is None
    assert calls[0].get("enable_gqa", False) is shared  # the shared mask took the grouped call
    torch.testing.assert_close(out, masked_attention(query, keys, values, allowed, 0.3))
