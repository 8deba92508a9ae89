"""Bad settings and unsupported models: a clear H2OError, never a crash deep inside."""

import pytest
import torch
import transformers

from h2okv import H2OCache, H2OError
from h2okv.core.budget import DEFAULT_BUDGET_FLOOR, BudgetSpec
from h2okv.core.compat import cache_arg


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "h2o", "heavy": 0, "recent": 5}, "at least 1 slot in each of heavy= and recent="),
        ({"policy": "h2o", "heavy": -3, "recent": 5}, "positive"),
        ({"policy": "h2o", "heavy_ratio": 0.0, "recent_ratio": 0.1}, "(0, 1]"),
        ({"policy": "h2o", "heavy_ratio": 1.5, "recent_ratio": 0.1}, "(0, 1]"),
        ({"policy": "h2o", "heavy_ratio": -0.1, "recent_ratio": 0.1}, "(0, 1]"),
        ({"policy": "h2o", "heavy": 5, "recent": 5, "heavy_ratio": 0.1}, "not both"),
        ({"policy": "nope"}, "unknown policy"),
        ({"policy": "full", "heavy": 4, "recent": 4}, "keeps every token"),
        ({"policy": "h2o", "heavy": 4, "recent": 4, "chunk_size": 0}, "chunk_size"),
        ({"policy": "snapkv:window=0"}, "window must be >= 1"),
        ({"policy": "snapkv:-3"}, "window must be >= 1"),
        ({"policy": "snapkv:kernel=4"}, "odd number"),
        ({"policy": "snapkv:window=abc"}, "is not a int"),
        ({"policy": "snapkv:size=3"}, "has no option 'size'"),
        ({"policy": "h2o:window=3"}, "has no option 'window'"),
        ({"policy": "tova", "heavy": 0, "recent": 5}, "at least 1 slot in each of heavy= and recent="),
        ({"policy": "h2o-mean", "heavy_ratio": 0.1, "recent_ratio": 0.0}, "(0, 1]"),
    ],
)
def test_bad_settings(llama, kwargs, message):
    with pytest.raises(H2OError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        H2OCache(llama, **kwargs)


def test_default_budget_is_papers_twenty_percent(llama):
    cache = H2OCache(llama, budget_floor=0)  # the floor would raise 20 slots of this short prompt
    llama(torch.randint(2, 90, (1, 100)), **cache_arg(cache))
    assert cache.budget() == [20]
    assert H2OCache(llama).spec == BudgetSpec(heavy_ratio=0.1, recent_ratio=0.1, floor=DEFAULT_BUDGET_FLOOR)


def test_encoder_decoder_rejected():
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    model = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(H2OError, match="encoder-decoder"):
        H2OCache(model, heavy=2, recent=2)


def test_non_attention_model_rejected():
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4)
    model = transformers.MambaForCausalLM(config)
    with pytest.raises(H2OError, match="MambaForCausalLM"):
        H2OCache(model, heavy=2, recent=2)


def test_crop_refused(llama):
    cache = H2OCache(llama, heavy=2, recent=2)
    llama(torch.randint(2, 90, (1, 10)), **cache_arg(cache))
    with pytest.raises(H2OError, match="cannot be cropped"):
        cache.crop(-1)
