"""tools/measure/ruler_bytes.py: RULER rows placed by the bytes their caches held, each kind told
apart, and the paired difference against one configuration on the prompts both ran."""

from pathlib import Path

import pytest

from h2okv.recipes import RECIPES
from tool_scripts import load_tool

TOOL = Path(__file__).resolve().parents[2] / "tools" / "measure" / "ruler_bytes.py"


@pytest.fixture(scope="module")
def tool():
    return load_tool("measure/ruler_bytes.py")


def row(policy, task, sample, score, recipe=None, **fields):
    return {"task": task, "context": 2048, "sample": sample, "question": "aware", "policy": policy, "budget": 0.2,
            "cache_options": fields.pop("cache_options", {}), "chunk_size": 512, "metric": "m", "score": score,
            "answer": "", "references": [], "haystack": "stories", "seed": 1, "model": "m", "max_new_tokens": 8,
            "seconds": 1.0, "recipe": recipe, **fields}


def test_each_kind_sits_at_its_bytes_and_is_compared_on_shared_prompts(tool):
    coded = {"kv_bits": 4, "key_bits": 8, "kv_group": 32}
    rows = [row("full", t, s, 1.0) for t in ("a", "b") for s in (0, 1)]
    # a float32 row holds twice a 16-bit cache's bytes; placed as a 16-bit model would hold it
    bounded = dict(RECIPES["bounded"].settings)  # the policy and options the recipe's rows record
    policy = bounded.pop("policy")
    rows += [row(policy, t, s, 0.5, recipe="bounded", cache_options=bounded, kv_fraction=0.2, kv_share_16bit=0.4)
             for t in ("a", "b") for s in (0, 1)]
    rows += [row(policy, t, s, 1.0 if s else 0.5, recipe="bounded", cache_options={**bounded, **coded},
                 kv_fraction=0.05, kv_share_16bit=0.1) for t in ("a", "b") for s in (0, 1)]
    rows += [row("kvpress-full", t, s, 0.0, cache_options={"backend": "quanto", "nbits": 2}, kv_share_16bit=0.19)
             for t in ("a", "b") for s in (0, 1)]
    entries = {e["config"]: e for e in tool.placed(rows, versus="recipe bounded k8v4 @ 0.2")}
    assert [e["kind"] for e in entries.values()] == list(tool.KINDS)
    assert entries["full"]["bytes"] == 1.0 and entries["recipe bounded @ 0.2"]["bytes"] == 0.2
    coded_entry = entries["recipe bounded k8v4 @ 0.2"]
    assert coded_entry["bytes"] == 0.1 and coded_entry["average"] == 75.0 and "versus" not in coded_entry
    # paired: the coded recipe scores 0.25 more a prompt than the float one, per task 25 points
    assert entries["recipe bounded @ 0.2"]["versus"] == pytest.approx(25.0)
    assert entries["recipe bounded @ 0.2"]["versus_se"] == pytest.approx(100 * (2 * (0.125 / 2)) ** 0.5 / 2)
    assert entries["kvpress-full [backend=quanto,nbits=2]"]["bytes"] == 0.19
