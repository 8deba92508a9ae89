"""kvzip's tail on a cache-wide split (issue 58, "a budget means the bytes the user sees"): while
its heads fill the tail, a layer of uneven head budgets is held flat (``decode.TailFill``), each
head its live slots and a little room, not the widest head's width for every head; the logits and
the kept tokens are the dense layout's."""

import pytest
import torch

import h2okv.core.decode as decode_mod
from char_tokenizers import Tok
from h2okv import H2OCache
from h2okv.core import kernels
from h2okv.core.compat import cache_arg
from h2okv.core.native import build
from h2okv.core.reconstruction import reconstruct
from h2okv.tools.tiny import tiny_model

PROMPT, STEPS = 200, 12  # kvzip:tail=5 reaches its budget mid-way: dense again, then at-budget steps


def run(model, ids, spec, kernel):
    with kernels.use_kernels(kernel), torch.inference_mode():
        cache = H2OCache(model, policy=spec, heavy=40, recent=2, prefill="late", head_budgets="layers",
                         head_floor=0.0)
        model(ids[:, :PROMPT], **cache_arg(cache))
        reconstruct(model, cache, ids[:, :PROMPT], Tok())
        logits = [model(ids[:, t:t + 1], **cache_arg(cache)).logits for t in range(PROMPT, PROMPT + 3)]
        stats = cache.stats()  # 3 tokens into the tail
        live = sum(int(layer.live_slots().sum()) for layer in cache.layers)
        flat = [layer.ragged is not None for layer in cache.layers]
        logits += [model(ids[:, t:t + 1], **cache_arg(cache)).logits for t in range(PROMPT + 3, PROMPT + STEPS)]
        for layer in cache.layers:  # read the slots in their dense layout
            layer.to_dense()
        kept = [sorted(layer.ordinal[r, h][layer.valid[r, h]].tolist()) for layer in cache.layers
                for r in range(layer.valid.shape[0]) for h in range(layer.valid.shape[1])]
    return torch.cat(logits, dim=1), kept, stats, live, flat


@pytest.mark.filterwarnings("ignore::h2okv.core.budget.H2OBudgetWarning")  # a tiny budget on purpose
@pytest.mark.parametrize("kernel", ["eager", "native"])
@pytest.mark.parametrize("spec", ["kvzip", "kvzip:tail=5"])
def test_a_filling_tail_holds_its_live_tokens_and_decodes_as_the_dense_layout(monkeypatch, kernel, spec):
    if kernel == "native" and build.library() is None:
        pytest.skip(f"no native kernels here: {build.build_info().error}")
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=4, initializer_range=0.3)
    ids = torch.randint(2, 90, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    flat = run(model, ids, spec, kernel)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    slot = 2 * head_dim * 4  # K and V of one token of one head, float32
    heads = model.config.num_hidden_layers * model.config.num_key_value_heads
    # the live tokens and at most decode.TAIL_GROWTH (16) free slots a head (a tiny budget: the room shows)
    assert flat[2]["kv_bytes"] <= (flat[3] + heads * 16) * slot
    assert all(flat[4])  # every layer is flat while its tail fills
    monkeypatch.setattr(decode_mod, "tail_fills_flat", lambda layer, room: False)  # the dense layout
    dense = run(model, ids, spec, kernel)
    assert dense[2]["kv_bytes"] > flat[2]["kv_bytes"]  # the widest head's width for every head
    # the same sums in another order (a segment softmax): float rounding only
    torch.testing.assert_close(flat[0], dense[0], atol=1e-4, rtol=1e-4)
    assert flat[1] == dense[1]
    assert flat[3] == dense[3]
