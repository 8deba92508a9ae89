"""``tools/measure/decode_ppl.py``: perplexity with the text fed one token a call, as generation
reads it, where a float window acts."""

import pytest
import torch

from h2okv import H2OCache
from h2okv.tools.tiny import random_ids, tiny_model
from tool_scripts import load_tool

decode_ppl = load_tool("measure/decode_ppl.py")


def test_a_configuration_names_its_policy_slots_and_coding():
    assert decode_ppl.parse_config("w=h2o:197:4:8:16") == {"label": "w", "policy": "h2o", "slots": 197, "kv_bits": 4,
                                                           "key_bits": 8, "float_window": 16}
    assert decode_ppl.parse_config("f=full:0:4") == {"label": "f", "policy": "full", "slots": None, "kv_bits": 4}
    with pytest.raises(SystemExit, match="label=policy:slots"):
        decode_ppl.parse_config("h2o:24")


class Bar:
    def update(self, n):
        pass


def test_one_token_a_call_gives_what_one_call_gives_a_full_cache():
    model = tiny_model("qwen2", layers=2, max_position_embeddings=1024, initializer_range=0.3)
    ids = random_ids(40, batch=1, seed=2)
    stepped = decode_ppl.decode_nll(model, ids, 16, decode_ppl.cache_of(model, {"policy": "full"}), Bar())
    with torch.inference_mode():
        logits = model(ids).logits[0, 15:-1]
    whole = torch.nn.functional.cross_entropy(logits.float(), ids[0, 16:], reduction="none")
    assert stepped.shape == (24,) and torch.allclose(stepped, whole, atol=1e-4)
    windowed = decode_ppl.cache_of(model, {"policy": "h2o", "slots": 12, "kv_bits": 4, "float_window": 4})
    assert isinstance(windowed, H2OCache) and windowed.settings.float_window == 4 and windowed.settings.budget == 12
