"""bench --recipes: each recipe's prefill, decode step, peak memory and KV held against the full
cache of the same repeat, on a tiny model (the numbers' sizes are the machine's; their shape is ours)."""

import pytest
import torch

from char_tokenizers import Tok
from h2okv.bench.recipe_costs import FULL, markdown, recipe_costs, summary
from h2okv.cli import main
from h2okv.tools.tiny import tiny_model


@pytest.fixture(scope="module")
def measured():
    model = tiny_model("llama", seed=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    ids = torch.randint(3, 60, (1, 200), generator=torch.Generator().manual_seed(0))
    rows = recipe_costs(model, Tok(), ["bounded", "document"], {200: ids}, budget=0.2, steps=3, repeats=2)
    return rows


def test_every_cache_reads_the_prompt_and_decodes_each_repeat(measured):
    assert [(r["recipe"], r["repeat"]) for r in measured] == [
        (name, repeat) for repeat in (0, 1) for name in (FULL, "bounded", "document")]
    for row in measured:
        assert row["prefill_s"] > 0 and row["decode_ms"] > 0 and row["peak_mib"] >= 0


def test_kv_held_is_counted_against_the_full_cache_of_the_same_tokens(measured):
    by = {(r["recipe"], r["repeat"]): r for r in measured}
    full = by[FULL, 0]
    assert full["kv_fraction"] == 1.0 and "prefill_x" not in full
    # the same tokens seen: the prompt and the decoded steps, whatever each cache kept of them
    assert {r["full_kv_bytes"] for r in measured} == {full["full_kv_bytes"]}
    bounded = by["bounded", 0]
    assert bounded["kv_fraction"] <= 0.25  # 20% of the prompt (no floor) plus a slot or two of rounding
    assert bounded["prefill_x"] == round(bounded["prefill_s"] / full["prefill_s"], 3)
    # kvzip keeps the tokens read after its ranking whole (its tail) on top of the budget
    assert by["document", 0]["kv_fraction"] > bounded["kv_fraction"]


def test_summary_is_the_median_over_repeats_and_the_report_names_each_recipe(measured):
    rows = summary(measured)
    assert {(r["recipe"], r["repeats"]) for r in rows} == {(FULL, 2), ("bounded", 2), ("document", 2)}
    report = markdown({"budget": 0.2, "steps": 3, "repeats": 2, "threads": "test", "summary": rows})
    assert "| bounded | 200 |" in report and "x)" in report and "| full | 200 |" in report


@pytest.mark.parametrize("argv, message", [
    (["--recipes", "fast"], "unknown recipe 'fast'"),
    (["--recipes", "bounded", "--recent-share", "0.3"], "shape the caches of the --policies study only"),
])
def test_bad_recipes_study_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
