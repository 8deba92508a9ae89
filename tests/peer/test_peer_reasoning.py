"""``eval reasoning --export-prompts`` and the peer's reasoning mode (tools/peer/decoding_kvpress.py)
without kvpress: the export holds the very prompt ids ``eval reasoning`` feeds the model, and the
peer's decoding with no press reproduces h2okv's ``full`` rows, which ``reasoning-report`` grades
with our ``answers.py`` and merges beside ours."""

import json
from pathlib import Path

import pytest

from h2okv.errors import H2OError
from h2okv.eval.reasoning import EXPORT_FORMAT
from source_imports import top_level_imports
from tool_scripts import load_tool

# the peer runs in its own venv on transformers < 5.3, which knows the cache only as past_key_values
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

PEER = Path(__file__).resolve().parents[2] / "tools" / "peer" / "decoding_kvpress.py"
FIXTURE = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "oe_eval_tasks"


@pytest.fixture(scope="module")
def peer():
    return load_tool("peer/decoding_kvpress.py")


@pytest.fixture
def tiny_chat(monkeypatch):
    import h2okv.models
    from h2okv.tools.tiny_chat import tiny_chat_model

    pair = tiny_chat_model(layers=2, seed=3)
    monkeypatch.setattr(h2okv.models, "load_model", lambda *args, **kwargs: pair)
    monkeypatch.setenv("H2OKV_OE_EVAL_TASKS", str(FIXTURE))
    return pair


def record_prompts(model) -> list[list[int]]:
    """The multi-token reads (prompts, not decode steps) the model is fed from now on."""
    fed, inner = [], model.forward

    def recording(*args, **kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[-1] > 1:
            fed.extend(row.tolist() for row in ids)
        return inner(*args, **kwargs)

    model.forward = recording
    return fed


def test_peer_does_not_import_h2okv():
    """h2okv (and lm-eval) are not installed in the peer's venv."""
    imported = top_level_imports(PEER)
    assert not imported & {"h2okv", "lm_eval"} and {"torch", "transformers", "kvpress"} <= imported


def test_export_then_peer_rows_equal_ours_and_merge(tiny_chat, peer, tmp_path, capsys):
    from h2okv.cli import main

    model, tok = tiny_chat
    common = ["eval", "reasoning", "--limit", "3", "--max-new-tokens", "7", "--batch-size", "1", "--budgets", "24"]
    exported_path, ours_path, peer_path = tmp_path / "prompts.json", tmp_path / "ours.json", tmp_path / "peer.json"
    assert main([*common, "--export-prompts", str(exported_path)]) == 0
    exported = json.loads(exported_path.read_text())
    assert exported["format"] == EXPORT_FORMAT and exported["budgets"] == [24] and exported["eos_ids"]
    assert [p["id"] for p in exported["problems"]] == [0, 1, 2]
    assert [p["gold"] for p in exported["problems"]] == ["18", "3", "70000"]

    fed = record_prompts(model)
    assert main([*common, "--policies", "full", "--json", str(ours_path), "--keep-text"]) == 0
    assert fed == [p["prompt_ids"] for p in exported["problems"]]  # the export is what the model is fed

    fed.clear()
    piece = peer.run_reasoning(exported, ["full"], [], 1, load=None, models={"sdpa": (model, tok)}, out=str(peer_path))
    assert fed == [p["prompt_ids"] for p in exported["problems"]]
    ours = json.loads(ours_path.read_text())["rows"]
    assert [tuple(r) for r in piece["rows"]] == [tuple(r) for r in ours]  # the same fields, in the same order
    for mine, theirs in zip(ours, piece["rows"], strict=True):
        assert theirs["policy"] == "kvpress-full" and theirs["predicted"] is None and theirs["batch_size"] == 1
        same = ("id", "prompt_tokens", "new_tokens", "finish", "gold", "kv_bytes", "kv_slots", "text")
        assert {k: theirs[k] for k in same} == {k: mine[k] for k in same}

    fed.clear()  # resume: every problem is in the piece already
    assert peer.run_reasoning(exported, ["full"], [], 1, load=None, models={"sdpa": (model, tok)},
                              out=str(peer_path)) == piece == json.loads(peer_path.read_text())
    assert fed == []

    merged = tmp_path / "merged.json"
    assert main(["eval", "reasoning-report", str(ours_path), str(peer_path), "--json", str(merged)]) == 0
    summaries = {s["policy"]: s for s in json.loads(merged.read_text())["summaries"]}
    assert set(summaries) == {"full", "kvpress-full"}  # one table: same model, task and style
    for key in ("n", "accuracy", "mean_new_tokens", "mean_kv_bytes"):
        assert summaries["kvpress-full"][key] == summaries["full"][key]
    assert "kvpress-full" in capsys.readouterr().out


def test_report_grades_peer_rows_with_our_answers():
    from h2okv.eval.answers import extract_answer
    from h2okv.eval.reasoning_report import graded

    row = {"task": "gsm8k", "policy": "kvpress-decoding-tova", "id": 0, "gold": "18", "predicted": None,
           "correct": None, "text": "16 - 3 - 4 = 9 eggs, 9 * 2 = 18. \\boxed{18}"}
    assert graded(row)["predicted"] == extract_answer("gsm8k", row["text"]) == "18" and graded(row)["correct"] is True
    assert graded({**row, "text": "I think 17"})["correct"] is False
    ours = {**row, "predicted": "5", "correct": False}
    assert graded(ours) is ours  # a graded row is left as it is
    with pytest.raises(H2OError, match="neither a grade nor"):
        graded({**row, "text": None})


def test_slot_budgets_only(peer):
    assert peer.check_budgets([64, 128]) == [64, 128]
    for bad in ([0.25], [0], [True]):
        with pytest.raises(SystemExit, match="slot counts"):
            peer.check_budgets(bad)
    assert peer.policy_name("tova", 1) == "kvpress-decoding-tova"
    assert peer.policy_name("knorm", 16) == "kvpress-decoding-knorm-every16"
