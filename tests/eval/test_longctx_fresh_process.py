"""``eval longctx --fresh-process``: a batch read in a spawned process that loads the model itself
answers as the grid's own process does, reports its costs, marks its rows, and its errors reach
the caller as one line."""

import os
import random

import pytest

from h2okv.cli import main
from h2okv.errors import H2OError
from h2okv.eval.longctx.fresh_process import EXACT_MALLOC, ModelLoad, in_fresh_process
from h2okv.eval.longctx.prompt import LongPrompt
from h2okv.eval.longctx.runner import Config, GridSpec, run_config
from h2okv.models import load_model


def prompts(n: int, length: int = 120) -> list[LongPrompt]:
    rng = random.Random(5)
    return [LongPrompt(task="niah_single_2", context=length, sample=i, ids=[rng.randrange(2, 90) for _ in range(length)],
                       question=length - 10, references=["w7"], metric="string_match_all", max_new_tokens=4) for i in range(n)]


@pytest.fixture(scope="module")
def spec():
    return GridSpec(tasks=["niah_single_2"], contexts=[120], samples=2, policies=["h2o"], budgets=[0.3], batch=1,
                    chat=False)


def test_a_fresh_process_answers_as_this_one_and_marks_its_rows(tiny_dir, spec):
    config = Config("h2o", 0.3, {})
    model, tokenizer = load_model(str(tiny_dir))
    here = run_config(model, tokenizer, prompts(2), spec, config, {"model": "tiny"})
    fresh = run_config(model, tokenizer, prompts(2), spec, config, {"model": "tiny"},
                       fresh=ModelLoad(str(tiny_dir), threads=1))
    assert [r["answer"] for r in fresh] == [r["answer"] for r in here] and len(fresh) == 2
    assert all(r["peak_process"] == "fresh" for r in fresh) and not any("peak_process" in r for r in here)
    for row, mine in zip(fresh, here, strict=True):
        assert row["kv_fraction"] == mine["kv_fraction"] and row["settings"] == mine["settings"]
        assert row["peak_mib"] >= 0 and row["batch"] == 1
        # the answer's own time, not the child's start and model load
        assert row["seconds"] == pytest.approx(row["prefill_s"] + row["decode_s"], abs=2e-3)
    assert all(r["kv_fraction"] < 0.5 for r in fresh)  # the child evicted as this process does


def test_the_fresh_process_runs_malloc_so_its_rss_follows_live_memory_and_this_one_is_untouched():
    before = {name: os.environ.get(name) for name in EXACT_MALLOC}
    assert in_fresh_process(os.getenv, "MALLOC_MMAP_THRESHOLD_") == EXACT_MALLOC["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert in_fresh_process(os.getenv, "MALLOC_ARENA_MAX") == "1"
    assert in_fresh_process(os.getpid) != os.getpid()
    assert {name: os.environ.get(name) for name in EXACT_MALLOC} == before


def test_an_error_in_the_fresh_process_is_raised_here_as_one_line(tmp_path, tiny_dir, spec):
    model, tokenizer = load_model(str(tiny_dir))
    with pytest.raises(H2OError) as err:
        run_config(model, tokenizer, prompts(1), spec, Config("h2o", 0.3, {}), {},
                   fresh=ModelLoad(str(tmp_path / "no-such-model")))
    assert "\n" not in str(err.value)


def test_a_bug_in_the_fresh_process_is_raised_here_with_its_traceback():
    with pytest.raises(ValueError, match="invalid literal") as err:
        in_fresh_process(int, "not a number")
    assert any("in the fresh process" in note and "Traceback" in note for note in err.value.__notes__)


@pytest.mark.parametrize("extra, message", [
    (["--questions-per-context", "2", "--tasks", "niah_multikey_1"], "leave out --questions-per-context"),
    (["--export-prompts", "p.json"], "leave out --export-prompts"),
])
def test_fresh_process_refuses_what_it_does_not_read(extra, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "longctx", "--fresh-process", *extra]) == 2
    assert message in capsys.readouterr().err
