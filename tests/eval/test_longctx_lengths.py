"""``eval longctx --merge ... --by-length``: each configuration against full on the same prompts at
each length, its lowest family, the median costs, and the plot of them against the length."""

import json

import pytest

from h2okv.cli import main
from h2okv.eval.longctx.lengths import by_length, length_table, paired_difference, plot_lengths, tick_labels
from h2okv.eval.longctx.rows import make_row
from h2okv.recipes import RECIPES


def row(policy, task, context, sample, score, recipe=None, device=None, dtype=None, options=None, model="m",
        **costs):
    """A row; a recipe's carries the policy and options the recipe stands for (as eval longctx
    writes them), overlaid with ``options``."""
    cache_options = {}
    if recipe:
        settings = dict(RECIPES[recipe].settings)
        policy, cache_options = settings.pop("policy"), settings
    cache_options.update(options or {})
    return make_row(task=task, context=context, sample=sample, question="aware", policy=policy,
                    budget=1.0 if policy == "full" else 0.2, cache_options=cache_options, recipe=recipe, chunk_size=512,
                    metric="string_match_all", score=score, answer="", references=[], haystack="stories", seed=1,
                    split="test", model=model, max_new_tokens=8, seconds=1.0, device=device, dtype=dtype, **costs)


def rows():
    out = []
    for context, full_prefill in ((2048, 10.0), (4096, 30.0)):
        for sample in range(2):
            out += [row("full", "a", context, sample, 1.0, prefill_s=full_prefill, peak_mib=100.0 * context / 2048,
                        kv_fraction=1.0),
                    row("full", "b", context, sample, 0.5, prefill_s=full_prefill, peak_mib=100.0 * context / 2048,
                        kv_fraction=1.0)]
    # the recipe: family b halves at 4096, and it ran a third sample there that full never ran
    for context in (2048, 4096):
        for sample in range(3 if context == 4096 else 2):
            missed = sample == 2  # the sample full never ran: both families wrong
            out += [row("snapkv", "a", context, sample, 0.0 if missed else 1.0, recipe="bounded", prefill_s=5.0,
                        peak_mib=50.0, kv_fraction=0.2),
                    row("snapkv", "b", context, sample, 0.0 if missed else 0.25 if context == 4096 else 0.5,
                        recipe="bounded", prefill_s=5.0, peak_mib=50.0, kv_fraction=0.2)]
    return out


def entry(summary, config, context):
    (found,) = [e for e in summary if (e["config"], e["context"]) == (config, context)]
    return found


def test_each_length_is_measured_against_full_on_the_same_prompts():
    summary = by_length(rows())
    assert [(e["config"], e["context"]) for e in summary] == [
        ("full", 2048), ("full", 4096), ("recipe bounded", 2048), ("recipe bounded", 4096)]
    same = entry(summary, "recipe bounded", 2048)
    assert same["average"] == pytest.approx(75.0) and same["of_full"] == pytest.approx(1.0)
    longer = entry(summary, "recipe bounded", 4096)
    assert longer["prompts"] == 6  # its own average counts the third sample: (66.7 + 16.7) / 2 ...
    assert longer["average"] == pytest.approx((200 / 3 + 50 / 3) / 2)
    # ... but against full only the cells full ran: (100 + 25) / 2 over (100 + 50) / 2
    assert longer["of_full"] == pytest.approx(62.5 / 75.0)
    assert longer["lowest"] == ("b", pytest.approx(0.5))
    # var(a) = var(1, 1, 0) = 1/3, var(b) = var(.25, .25, 0) = 1/48, 3 samples each, 2 tasks
    assert longer["se"] == pytest.approx(100 * ((1 / 3 + 1 / 48) / 3) ** 0.5 / 2)
    assert longer["prefill_x"] == pytest.approx(5.0 / 30.0) and longer["peak_mib"] == 50.0
    assert entry(summary, "full", 4096)["of_full"] is None


def test_a_recipe_row_that_departs_from_the_recipe_is_a_configuration_of_its_own():
    # the same prompts, the recipe streamed (its own setting) and read in one call: two lines,
    # where one label would have let one run's cells overwrite the other's
    out = [row("full", "a", 2048, 0, 1.0)]
    out += [row(None, "a", 2048, 0, 1.0, recipe="bounded"),
            row(None, "a", 2048, 0, 0.0, recipe="bounded", options={"prefill": "chunked"}),
            row(None, "a", 2048, 0, 0.5, recipe="bounded", options={"kv_bits": 4, "key_bits": 8, "kv_group": 32})]
    summary = by_length(out)
    assert entry(summary, "recipe bounded", 2048)["average"] == 100.0
    assert entry(summary, "recipe bounded [prefill=chunked]", 2048)["average"] == 0.0
    assert entry(summary, "recipe bounded k8v4", 2048)["average"] == 50.0  # bits are named, not a departure
    # a row written when the recipe stood for another policy names it
    old = row("snapkv:kernel=63,pool=max", "a", 2048, 0, 1.0, recipe=None)
    old.update(recipe="prompt", cache_options={"prefill": "late", "recent_share": 0.078})
    (line,) = [e["config"] for e in by_length([old])]
    assert line.startswith("recipe prompt [snapkv:kernel=63,pool=max ") and "recent_share=0.078" in line


def test_another_device_is_its_own_line_against_its_own_full():
    gpu = [{**r, "device": "cuda", "dtype": "bfloat16", "score": 0.0 if r["policy"] != "full" else r["score"]}
           for r in rows() if r["context"] == 2048]
    summary = by_length(rows() + gpu)
    on_gpu = entry(summary, "recipe bounded (cuda bfloat16)", 2048)
    assert on_gpu["of_full"] == 0.0 and entry(summary, "recipe bounded", 2048)["of_full"] == pytest.approx(1.0)
    assert entry(summary, "full (cuda bfloat16)", 2048)["prefill_x"] == 1.0


def test_another_model_is_its_own_line_against_its_own_full():
    # the 1.5B's rows at a length the 0.5B ran too: the same (task, sample) cells are other prompts
    # read by another model, so they neither merge into the 0.5B's lines nor are measured against its full
    large = [row("full", "a", 2048, 0, 0.5, model="/c/big"), row(None, "a", 2048, 0, 0.25, recipe="bounded", model="/c/big")]
    summary = by_length(rows() + large)
    assert entry(summary, "full", 2048)["average"] == 75.0  # the small model's, unchanged
    assert entry(summary, "full (big)", 2048)["average"] == 50.0
    assert entry(summary, "recipe bounded (big)", 2048)["of_full"] == pytest.approx(0.5)
    assert entry(summary, "recipe bounded", 2048)["of_full"] == pytest.approx(1.0)


def test_the_paired_difference_is_taken_on_the_prompts_both_ran():
    summary = by_length(rows())
    same = entry(summary, "recipe bounded", 2048)
    assert (same["paired"], same["paired_se"]) == (0.0, 0.0)
    # at 4096 family b lost half on both shared samples (-25 each), a nothing; the third sample,
    # which full never ran, does not count: RULER's average of the differences is -12.5, and the
    # SE is that of the four shared prompts' mean (sd 14.43 / 2)
    longer = entry(summary, "recipe bounded", 4096)
    assert longer["paired"] == pytest.approx(-12.5) and longer["paired_se"] == pytest.approx(25 / 3**0.5 / 2)
    assert entry(summary, "full", 2048)["paired"] is None  # full against itself: nothing to say
    assert paired_difference({("a", 0): 1.0}, {("b", 0): 1.0}) is None
    assert paired_difference({("a", 0): 1.0}, {("a", 0): 0.0}) == (100.0, None, 1)


def test_two_lengths_that_read_alike_are_labelled_once():
    assert tick_labels([512, 2048, 32640, 32768]) == ["512", "2k", "32k", ""]


def test_table_and_plot(tmp_path):
    summary = by_length(rows())
    table = length_table(summary, markdown=True).splitlines()
    assert table[0].startswith("| config | context |") and len(table) == 2 + len(summary)
    assert "| recipe bounded | 4096 | 6 | 41.7 | 17.2 | 83% | -12.5 (7.2) | b (50%) | 50 | 20% | 5.0 | 0.17 | - |" in table
    assert plot_lengths(summary, tmp_path / "lengths.png", "t").stat().st_size > 10_000


def test_cli_by_length(tmp_path, capsys):
    pieces = tmp_path / "rows.json"
    pieces.write_text(json.dumps(rows()))
    plot = tmp_path / "lengths.png"
    assert main(["eval", "longctx", "--merge", str(pieces), "--by-length", "--markdown", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "| recipe bounded | 2048 | 4 | 75.0 | 0.0 | 100% |" in out and plot.is_file()
    # --contexts keeps the rows of those lengths only (32,640 beside older 32,768-token rows)
    assert main(["eval", "longctx", "--merge", str(pieces), "--by-length", "--markdown", "--contexts", "4096",
                 "--plot", ""]) == 0
    out = capsys.readouterr().out
    assert "| recipe bounded | 4096 |" in out and "| 2048 |" not in out
    assert main(["eval", "longctx", "--merge", str(pieces), "--by-length", "--contexts", "512", "--plot", ""]) == 2
    assert "the files hold no rows of those --contexts" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--by-length"], "--by-length and --markdown read row files: give --merge FILE"),
    (["--merge", "x.json", "--markdown"], "--markdown is the --by-length table's form"),
])
def test_cli_by_length_errors_are_one_line(argv, message, capsys):
    assert main(["eval", "longctx", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error:") and message in err and "\n" not in err


def test_no_two_kinds_of_line_look_alike():
    from h2okv.eval.longctx.lengths import _color, _line

    configs = ["full", "recipe bounded", "recipe bounded [prefill=chunked]", "kvpress-chunkkv-snapkv",
               "openvino-h2o-sum [block_size=32]", "recipe bounded (cuda bfloat16)", "recipe document"]
    looks = {(str(_color(c)), str(_line(c))) for c in configs if c != "full"} | {("black", str(_line("full")))}
    assert len(looks) == len(configs)
    # a recipe run with an option of its own keeps its recipe's colour; peers take none of ours
    assert _color("recipe bounded [prefill=chunked]") == _color("recipe bounded")
    assert _color("openvino-h2o-sum [block_size=32]") not in {_color("recipe prompt"), _color("recipe document")}
