"""``h2okv demo``: the cases it builds, the KV line it records and its command line, on a tiny model;
one integration test that the default model answers as the demo says."""

from __future__ import annotations

import pytest

import h2okv.models
from char_tokenizers import CharTokenizer
from h2okv.cli import demo as demo_cli
from h2okv.cli.main import main
from h2okv.demo_cases import (
    PASSKEY_CASES,
    RETRIEVAL_BUDGET,
    RETRIEVAL_CONFIGS,
    answer,
    long_generation,
    retrieval_cases,
)
from h2okv.tools.tiny import tiny_model

SHORT_CASES = ((300, 0.25, "62465"), (300, 0.6, "25164"))


def test_cases_have_the_requested_length_and_the_passkey_at_its_depth():
    tok = CharTokenizer()
    cases = retrieval_cases(tok)
    assert len(cases) == len(PASSKEY_CASES) >= 2
    for case, (tokens, depth, passkey) in zip(cases, PASSKEY_CASES):
        start, stop = case.needle
        assert len(case.ids) == tokens
        assert passkey in tok.decode(case.ids[start:stop])
        # the passkey is nowhere else: only the needle can answer
        assert passkey not in tok.decode(case.ids[:start]) + tok.decode(case.ids[stop:])
        assert abs(start / tokens - depth) < 0.1
        # the demo's point: a sliding window of the budget cannot hold the needle
        assert stop < (1 - RETRIEVAL_BUDGET) * tokens


def test_answers_are_judged_by_the_passkey():
    case = retrieval_cases(CharTokenizer(), SHORT_CASES)[0]
    assert case.is_right(" 62465.") and not case.is_right(" 6246 5") and not case.is_right("the pass key is")


def test_the_full_line_is_what_a_full_cache_holds():
    """Part two draws full's line from the recipe's own ``full_kv_bytes``: it must be the bytes an
    ``H2OCache(policy="full")`` holds after the same tokens."""
    model, tok = tiny_model("llama", seed=3), CharTokenizer()
    full = long_generation(model, tok, 60, every=10, cache_keywords={"policy": "full"})
    assert [kv for _, kv, _ in full.points] == [whole for _, _, whole in full.points]
    recipe = long_generation(model, tok, 60, every=10, cache_keywords={"recipe": "generation", "budget": 16})
    assert [seen for seen, _, _ in recipe.points] == [seen for seen, _, _ in full.points]
    assert [whole for _, _, whole in recipe.points] == [whole for _, _, whole in full.points]
    # flat once the budget is full, while full's grows with every token
    assert recipe.points[-1][1] == recipe.points[-3][1] < recipe.points[-1][2]
    assert full.points[-1][1] > full.points[-3][1]


def test_the_recipe_and_local_hold_the_same_fifth_of_full():
    """The comparison is fair: the recipe and the sliding window keep the same slots, to rounding (on
    the demo's 1k-token prompts 20% is above the budget floor of short prompts)."""
    model, tok = tiny_model("llama", seed=3), CharTokenizer()
    case = retrieval_cases(tok)[0]
    got = {config: answer(model, tok, case, config, keywords, max_new_tokens=3) for config, keywords in RETRIEVAL_CONFIGS}
    assert set(got) == {"full", "recipe bounded", "local"}
    # each part of a fractional budget rounds down: the recipe's small recent share may leave it a
    # slot or two below the window's, never above
    assert got["recipe bounded"].kv_bytes <= got["local"].kv_bytes
    assert got["recipe bounded"].kv_bytes == pytest.approx(got["local"].kv_bytes, rel=0.01)
    assert got["local"].kv_bytes / got["full"].kv_bytes == pytest.approx(RETRIEVAL_BUDGET, abs=0.01)
    assert "recipe bounded" in got["recipe bounded"].summary


def run_demo(monkeypatch, *argv):
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (tiny_model("llama", seed=3), CharTokenizer()))
    monkeypatch.setattr("h2okv.demo_cases.PASSKEY_CASES", SHORT_CASES)
    return main(["demo", "--new-tokens", "40", *argv])


def test_empty_plot_path_skips_the_picture(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_demo(monkeypatch, "--plot", "") == 0
    out = capsys.readouterr().out
    assert "Part 1" in out and "Part 2" in out and "done in" in out and "picture" not in out
    assert not (tmp_path / "results").exists()


def test_the_picture_is_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "out" / "demo.png"
    assert run_demo(monkeypatch, "--plot", str(path)) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert f"picture: {path}" in capsys.readouterr().out


def test_without_matplotlib_the_picture_is_skipped_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_cli, "has_matplotlib", lambda: False)
    path = tmp_path / "demo.png"
    assert run_demo(monkeypatch, "--plot", str(path)) == 0
    assert not path.exists()
    assert "picture skipped: matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--plot", "demo.jpg"], "--plot must end in .png"),
    (["--model", "qwen2.5-0.5b"], "run `make eval-data`"),
])
def test_bad_input_is_one_line_exit_2(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("H2OKV_CACHE", str(tmp_path))  # an empty cache: no model installed there
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.integration
def test_default_model_answers_as_the_demo_says(default_model):
    """Full and the bounded recipe find every passkey; the sliding window of the same size none
    (about 30 s on two shared CPU cores)."""
    model, tok = default_model
    for case in retrieval_cases(tok):
        got = {config: answer(model, tok, case, config, keywords) for config, keywords in RETRIEVAL_CONFIGS}
        assert got["full"].right and got["recipe bounded"].right, (case.title, got)
        assert not got["local"].right, (case.title, got["local"].text)
