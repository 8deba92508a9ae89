"""``probe_attention`` (``core/reconstruction.py``) against the attention written out densely: the
output a prefill call would give, and each live slot's largest probability over the queries of
its KV head's group, in blocks of any size, with every slot live (the probe's usual case, where
only the probe's own tokens are masked) and with dead slots."""

from types import SimpleNamespace

import pytest
import torch

from h2okv.core import reconstruction
from h2okv.core.reconstruction import probe_attention, probe_block_bytes


class Held:
    """The parts of a cache layer a probe reads."""

    def __init__(self, keys, values, valid):
        self.keys, self.values, self.valid = keys, values, valid
        self.capacity = keys.shape[2]
        self.ordinal = torch.arange(self.capacity).expand(valid.shape)
        self.config = SimpleNamespace(policy=SimpleNamespace(sink_tokens=4))

    def kv(self):
        return self.keys, self.values


def dense(layer, query, key_new, value_new, scaling):
    b, hq, n, _ = query.shape
    hkv, cap = key_new.shape[1], layer.capacity
    g = hq // hkv
    keys = torch.cat([layer.keys, key_new], 2).repeat_interleave(g, 1)
    values = torch.cat([layer.values, value_new], 2).repeat_interleave(g, 1)
    allowed = torch.cat([layer.valid.repeat_interleave(g, 1)[:, :, None].expand(b, hq, n, cap),
                         torch.ones(n, n, dtype=torch.bool).tril().expand(b, hq, n, n)], -1)
    probs = torch.softmax((query @ keys.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf")), -1)
    best = probs[..., :cap].amax(dim=2).view(b, hkv, g, cap).amax(dim=2)
    return probs @ values, best


@pytest.mark.parametrize("dead", [False, True])
@pytest.mark.parametrize("block_bytes", [1, 2**20])
def test_probe_attention_equals_the_dense_attention(monkeypatch, dead, block_bytes):
    torch.manual_seed(0)
    b, hq, hkv, cap, n, d = 2, 6, 2, 11, 7, 8
    valid = torch.ones(b, hkv, cap, dtype=torch.bool)
    if dead:
        valid[0, 1, 3] = valid[1, 0, :5] = False
    layer = Held(torch.randn(b, hkv, cap, d), torch.randn(b, hkv, cap, d), valid)
    query, key_new, value_new = torch.randn(b, hq, n, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    monkeypatch.setattr(reconstruction, "CPU_PROBE_BLOCK_BYTES", block_bytes)
    out, best = probe_attention(layer, query, key_new, value_new, d ** -0.5, 512)
    want_out, want_best = dense(layer, query, key_new, value_new, d ** -0.5)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(best, want_best)
    assert (best[~valid] == 0).all()  # a dead slot earns nothing


def test_a_cpu_probe_block_is_the_smaller_one():
    assert probe_block_bytes(torch.device("cpu")) == min(reconstruction.PROBE_BLOCK_BYTES,
                                                         reconstruction.CPU_PROBE_BLOCK_BYTES)
    assert probe_block_bytes(torch.device("cuda")) == reconstruction.PROBE_BLOCK_BYTES
