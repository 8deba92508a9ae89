"""The issue-16 options through the commands: ``eval retrieval --prefill/--recent-share``,
``bench --policies knorm``, the new flags' one-line errors."""

import json

import pytest

import h2okv.models
from char_tokenizers import CharTokenizer
from h2okv.cli import main
from h2okv.eval.retrieval import Cell, summary_table
from h2okv.tools.tiny import tiny_model


def test_retrieval_runs_late_prefill_with_a_recent_share(tmp_path, monkeypatch, capsys):
    model = tiny_model("llama", seed=3)
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, CharTokenizer()))
    out = tmp_path / "r.json"
    argv = ["eval", "retrieval", "--contexts", "300", "--depths", "0,1", "--trials", "1",
            "--policies", "knorm,tova:heads=shared", "--budgets", "0.2", "--max-new-tokens", "2",
            "--prefill", "late", "--recent-share", "0.05", "--json", str(out), "--plot", ""]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert {(r["policy"], r["prefill"], r["recent_share"]) for r in rows} == {
        ("knorm", "late", 0.05), ("tova:heads=shared", "late", 0.05)}
    table = summary_table([Cell(**r) for r in rows])
    assert "knorm late r0.05" in table and "tova:heads=shared late r0.05" in capsys.readouterr().out


def test_retrieval_shares_slots_among_heads(tmp_path, monkeypatch, capsys):
    """--head-budgets adaptive reaches the cache (its rows and labels say so); a policy that cannot
    take it fails before the grid with one line."""
    model = tiny_model("llama", seed=3)
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, CharTokenizer()))
    out = tmp_path / "r.json"
    argv = ["eval", "retrieval", "--contexts", "300", "--depths", "0,1", "--trials", "1", "--policies",
            "snapkv:window=1", "--budgets", "0.2", "--max-new-tokens", "2", "--head-budgets", "adaptive",
            "--json", str(out), "--plot", ""]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert {r["head_budgets"] for r in rows} == {"adaptive"}
    assert "snapkv:window=1 adaptive" in capsys.readouterr().out
    argv[argv.index("snapkv:window=1")] = "tova"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use prefill=late" in err[0]


def test_policy_lists_take_policies_with_several_options():
    from h2okv.cli.args import parse_policies

    assert parse_policies("h2o,snapkv:window=1,kernel=1,heads=shared,knorm") == [
        "h2o", "snapkv:window=1,kernel=1,heads=shared", "knorm"]
    with pytest.raises(h2okv.H2OError, match="has no option 'span'"):
        parse_policies("h2o,snapkv:window=1,span=2")


def test_cells_of_older_files_still_load():
    old = {"policy": "h2o", "budget": 0.2, "context": 300, "depth": 0.0, "trials": 1, "correct": 0, "accuracy": 0.0,
           "needle_kept": 0.5, "haystack": "filler", "chunk_size": 512, "answers": ["x"]}
    assert Cell(**old).config == "h2o"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "retrieval", "--prefill", "early"], "argument --prefill: invalid choice"),
        (["eval", "retrieval", "--recent-share", "1.5"], "argument --recent-share: must be a share in [0, 1]"),
        (["eval", "retrieval", "--recent-share", "x"], "argument --recent-share: expected a share in [0, 1]"),
        (["eval", "retrieval", "--policies", "tova:heads=some"], "heads must be own or shared"),
        (["serve", "--prefill", "early"], "argument --prefill: invalid choice"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err


def test_bench_times_the_new_policies(tmp_path):
    out = tmp_path / "p.json"
    assert main(["bench", "--model", "tiny:llama", "--policies", "knorm,tova:heads=shared", "--context", "64",
                 "--steps", "3", "--scoring-tokens", "48", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["decode"]) == {"knorm", "tova:heads=shared", "reference"}
    assert all(r["kept_tokens"] == 12 for r in result["decode"].values())


def test_bench_times_adaptive_heads_and_reports_their_bytes(tmp_path, capsys):
    """bench --policies --head-budgets adaptive: the studied caches share their slots among heads
    (late prefill for h2o); the KV bytes after the prompt are those of the slots allocated."""
    out = tmp_path / "p.json"
    argv = ["bench", "--model", "tiny:qwen2", "--policies", "h2o,snapkv", "--context", "64", "--steps", "3",
            "--scoring-tokens", "48", "--no-progress", "--prefill", "late", "--head-budgets", "adaptive",
            "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["shape"] == {"recent_share": 0.5, "prefill": "late", "head_budgets": "adaptive"}
    decode = result["decode"]
    assert all(r["kept_tokens"] == 12 for r in decode.values())
    # one slot of a layer: K and V x 2 KV heads x 16 dims x 4 bytes; uniform: 2 layers x 13 slots
    # (budget 12 + the decode slot); adaptive: each layer's largest head budget + 1, never less
    slot = 2 * 2 * 16 * 4
    for policy in ("h2o", "snapkv"):
        kv = decode[policy]["kv_bytes_after_prompt"]
        assert kv % slot == 0 and 2 * 13 * slot <= kv <= 2 * 65 * slot
    assert "head_budgets adaptive" in out.with_suffix(".md").read_text()
    assert main(["bench", "--model", "tiny:llama", "--head-budgets", "adaptive", "--json", str(out)]) == 2
    assert "shape the caches of the --policies study only" in capsys.readouterr().err
