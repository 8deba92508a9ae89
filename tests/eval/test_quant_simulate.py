"""tools/measure/quant_simulate.py: the key codings it compares read back what they claim to, so a
perplexity it prints is the coding's and not a mistake in the turn or the grouping."""

import pytest
import torch

from h2okv.core.quant import SlotCodec
from h2okv.core.rope import RopeRotation
from tool_scripts import load_tool


@pytest.fixture(scope="module")
def sim():
    module = load_tool("measure/quant_simulate.py")
    module.Coding.rope = RopeRotation(1.0 / 1e6 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64), 64)
    return module


def test_the_rotary_turn_is_qwens_and_turns_back(sim):
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    key = torch.randn(1, 2, 12, 64, generator=torch.Generator().manual_seed(0))
    angles = torch.arange(12.0)[:, None] * sim.Coding.rope.inv_freq.float()[None]
    table = torch.cat([angles, angles], -1)
    _, expected = apply_rotary_pos_emb(key, key, table.cos()[None], table.sin()[None])
    torch.testing.assert_close(sim.rotary(key, 1.0), expected)
    torch.testing.assert_close(sim.rotary(sim.rotary(key, -1.0), 1.0), key, atol=1e-5, rtol=0)


def test_the_hadamard_turn_is_orthonormal_and_a_power_of_two_is_required(sim):
    turn = sim.hadamard(64, "cpu")
    torch.testing.assert_close(turn @ turn.T, torch.eye(64), atol=1e-6, rtol=0)
    with pytest.raises(SystemExit, match="power-of-two"):
        sim.hadamard(48, "cpu")


def test_keys_coded_per_channel_keep_the_other_channels_beside_an_outlier(sim):
    """An outlier channel (50x) takes a per-token group's range; per channel it takes only its own."""
    key = torch.randn(1, 2, 70, 64, generator=torch.Generator().manual_seed(1))  # 70: a short last group
    key[..., 5] *= 50
    codec = SlotCodec(4, 32)
    others = torch.arange(64) != 5
    per_channel = (sim.channel_roundtrip(codec, key) - key)[..., others].abs().mean()
    per_token = (codec.roundtrip(key) - key)[..., others].abs().mean()
    assert sim.channel_roundtrip(codec, key).shape == key.shape
    assert per_channel < 0.1 < per_token / 3  # (the outlier widens only its own 32-channel group per token)


def test_centered_keys_do_not_code_a_channels_constant_offset(sim):
    """A constant offset before the turn (a key bias) costs a per-token code its levels; centered,
    the code sees only what varies, so a key of offset plus small noise comes back close."""
    gen = torch.Generator().manual_seed(2)
    before = 0.1 * torch.randn(1, 2, 300, 64, generator=gen) + 20 * torch.randn(1, 2, 1, 64, generator=gen)
    key = sim.rotary(before, 1.0)
    codec = SlotCodec(4, 32)
    plain = (codec.roundtrip(key) - key).abs().mean()
    for after in (False, True):
        centered = (sim.centered_roundtrip(codec, key, after=after) - key).abs().mean()
        assert centered < plain / 10
