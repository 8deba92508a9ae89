"""``slice_feed_forward``: a long call's feed-forward runs in slices of tokens, with the numbers of
one pass up to float rounding (the feed-forward acts on each token alone), and never holds more
than a slice."""

import pytest
import torch

from h2okv.core.feed_forward import slice_feed_forward
from h2okv.tools.tiny import TINY_CONFIGS, tiny_model


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_a_sliced_feed_forward_gives_the_same_logits_and_holds_one_slice(arch):
    whole, sliced = tiny_model(arch), tiny_model(arch)  # the same seed: the same weights
    if arch == "opt":  # its feed-forward is two layers of the decoder layer, no ``mlp`` module: left whole
        assert slice_feed_forward(sliced, tokens=8) == 0
        return
    assert slice_feed_forward(sliced, tokens=8) > 0
    assert slice_feed_forward(sliced, tokens=8) == 0  # idempotent
    widths = []
    for name, module in sliced.named_modules():
        if name.endswith(".mlp"):
            first = next(m for m in module.children() if isinstance(m, torch.nn.Linear))
            first.register_forward_pre_hook(lambda _m, args: widths.append(args[0].shape[1]))
    ids = torch.randint(3, sliced.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    want = whole(input_ids=ids, use_cache=False).logits
    got = sliced(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert widths and max(widths) == 8  # 37 tokens as 8 + 8 + 8 + 8 + 5
    assert sorted(set(widths)) == [5, 8]


def test_a_slice_is_at_least_one_token():
    with pytest.raises(ValueError, match=">= 1 token"):
        slice_feed_forward(tiny_model("llama"), tokens=0)
