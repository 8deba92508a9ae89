"""A layer's state says when it changed: every change of its rows, budgets or buffers goes through
its own methods and ends in ``changed()`` (``version`` moves, the decode stepper is chosen again),
the one place anything is derived; the cache's largest budget is its layers'."""

import ast
from pathlib import Path

import pytest
import torch

from char_tokenizers import CharTokenizer
from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.tools.tiny import tiny_model

SRC = Path(__file__).resolve().parents[2] / "src" / "h2okv"


def read(model, cache, length=48, rows=2, new=3):
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)
    return cache


def test_the_stepper_is_chosen_in_one_place_only():
    calls = [(path.name, node.lineno) for path in SRC.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "choose_stepper"]
    assert [name for name, _ in calls] == ["layer.py"], calls  # SlotLayer.changed
    refresh = [path.name for path in SRC.rglob("*.py") if ".refresh()" in path.read_text(encoding="utf-8")]
    assert refresh == []  # the old name is gone: nothing re-derives a layer's state behind its back


def test_every_change_moves_the_version_and_chooses_the_stepper_again(llama):
    cache = read(llama, H2OCache(llama, policy="h2o", budget=16))
    layer = cache.layers[0]
    seen = layer.version
    cache.select_rows([1, 0])
    assert layer.version > seen and layer.stepper is not None
    seen, stepper = layer.version, layer.stepper
    cache.set_budgets([(4, 4), (4, 4)])
    assert layer.version > seen and layer.stepper is not stepper and layer.over_budget
    seen = layer.version
    cache.fit_capacity(layer.capacity + 8)
    assert layer.version > seen and layer.capacity == cache.layers[-1].capacity
    seen = layer.version
    cache.set_compileable(True)
    assert layer.version > seen and type(layer.stepper).__name__ != type(stepper).__name__


@pytest.mark.parametrize("settings", [
    {"policy": "h2o", "budget": 16},
    {"policy": "snapkv", "budget": 16, "head_budgets": "adaptive"},
    {"recipe": "document", "budget": 0.3, "budget_floor": 0},
    {"recipe": "prompt", "budget": 0.3, "budget_floor": 0},
    {"recipe": "bounded", "budget": 0.3, "budget_floor": 0, "chunk_size": 64},
    {"recipe": "generation", "budget": 32},
    {"recipe": "stream", "budget": 32},
    {"policy": "full"},
])
def test_the_cache_s_largest_budget_is_its_layers(settings):
    model = tiny_model("qwen2", layers=3, max_position_embeddings=2048, initializer_range=0.3)  # GQA: 4 heads on 2
    cache = H2OCache(model, tokenizer=CharTokenizer(), **settings)
    read(model, cache, length=200, rows=1, new=4)
    budgets = [layer.max_budget for layer in cache.layers]
    assert cache.max_budget == max(budgets)
    for layer, budget in zip(cache.layers, budgets, strict=True):
        assert int(layer.live_slots().max()) <= budget  # what each layer holds is within its own
