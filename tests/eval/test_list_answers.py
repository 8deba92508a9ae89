"""tools/measure/list_answers.py: a word-list answer read as the task asks for it (its first N
distinct words) beside RULER's score, which counts the right words anywhere in the answer."""

import json

import pytest

from tool_scripts import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("measure/list_answers.py")


REFS = ["alpha", "beta", "gamma"]


def row(answer, score, task="fwe", policy="full", context=2048):
    return {"task": task, "context": context, "sample": 0, "question": "aware", "policy": policy, "budget": 0.2,
            "cache_options": {}, "metric": "string_match_all", "score": score, "answer": answer,
            "references": REFS, "haystack": "stories", "seed": 1}


def test_only_the_first_n_distinct_words_count_as_asked(tool):
    # a long copy of the list finds every word somewhere, but names only one among its first three
    assert tool.as_asked(" alpha, alpha, delta, omega, beta, gamma", REFS) == pytest.approx(1 / 3)
    # joiners are not items, repeats are one item, case is ignored
    assert tool.as_asked(' "Alpha", "alpha", "Beta", and "gamma".', REFS) == 1.0
    assert tool.as_asked("", REFS) == 0.0


def test_files_and_families_stay_apart_and_other_families_are_left_out(tool):
    long_copy = row(" alpha, delta, omega, beta, gamma, eta", 1.0)
    short = row(" alpha, beta, delta.", 2 / 3)
    lines = tool.summarize([("full", long_copy), ("recipe", short), ("recipe", row("x", 1.0, task="vt"))])
    assert [(x["file"], x["score"], round(x["as_asked"]), x["words"]) for x in lines] == [
        ("full", 100.0, 33, 6.0), ("recipe", pytest.approx(200 / 3), 67, 3.0)]


def test_command_line_prints_a_table_and_rejects_files_without_list_rows(tool, tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([row(" alpha, beta, gamma", 1.0)]))
    assert tool.main([str(good)]) == 0
    assert "| fwe | 2048 | full | good | 1 | 100 | 100 | 3 |" in capsys.readouterr().out
    other = tmp_path / "other.json"
    other.write_text(json.dumps([row("x", 1.0, task="vt")]))
    assert tool.main([str(other)]) == 2
    assert "no cwe or fwe rows" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"not": "rows"}))
    assert tool.main([str(broken)]) == 2
