"""tools/measure/compare_rows.py: a re-run against its old rows on the same prompts: the paired
difference, the families that moved and every answer whose score changed."""

import json

import pytest

from tool_scripts import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("measure/compare_rows.py")


def row(task, sample, score, answer="", policy="snapkv:kernel=31,pool=max", context=8192):
    return {"task": task, "context": context, "sample": sample, "question": "aware", "policy": policy, "budget": 0.2,
            "cache_options": {}, "metric": "string_match_all", "score": score, "answer": answer,
            "references": [], "haystack": "stories", "seed": 1}


def write(path, rows):
    path.write_text(json.dumps(rows))
    return str(path)


def test_only_the_prompts_both_ran_are_paired_and_each_change_is_listed(tool, tmp_path, capsys):
    old = [row("a", 0, 1.0, " 1"), row("a", 1, 0.0, " 2"), row("b", 0, 1.0, " x"), row("b", 1, 1.0, " y")]
    # the re-run keeps a's second answer, loses none, and ran a third sample the old rows lack
    new = [row("a", 0, 1.0, " 1"), row("a", 1, 1.0, " 3"), row("b", 0, 1.0, " x"), row("b", 1, 1.0, " y"),
           row("b", 2, 0.0, " z")]
    assert tool.main([write(tmp_path / "old.json", old), write(tmp_path / "new.json", new)]) == 0
    out = capsys.readouterr().out
    # a's mean 50 -> 100 and b's unchanged: RULER's average of the differences is +25; the SE is
    # that of the four shared prompts' mean (differences 0, 100, 0, 0: sd 50, / 2)
    assert "on the 4 prompts both ran: +25.0 (SE 25.0)" in out
    assert "families that moved: a 50 -> 100" in out
    assert "answers whose score changed: 1 of 4" in out and "a sample 1 at 8192: 0.00 ' 2' -> 1.00 ' 3'" in out


def test_a_file_of_several_configurations_or_none_is_refused_in_one_line(tool, tmp_path, capsys):
    mixed = write(tmp_path / "mixed.json", [row("a", 0, 1.0), row("a", 0, 1.0, policy="full")])
    one = write(tmp_path / "one.json", [row("a", 0, 1.0)])
    assert tool.main([mixed, one]) == 2
    assert tool.main([str(tmp_path / "missing.json"), one]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"x": 1}]))
    assert tool.main([str(bad), one]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"compare_rows: {mixed} holds 2 configurations (one a file)",
                   f"compare_rows: no such file: {tmp_path / 'missing.json'}",
                   f"compare_rows: {bad} does not hold eval longctx rows"]
