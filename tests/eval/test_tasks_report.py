"""``h2okv eval tasks-report``: JSON pieces of ``eval tasks`` merged into the table and figure."""

import json

import pytest

from h2okv.cli import main as cli_main
from h2okv.eval import tasks_report as R


def piece(path, budget, policies, task="copa", model=None, acc=0.6, items=100):
    results = {p: {"seconds": 1.0, "tasks": {task: {"items": items, "acc": acc - 0.1 * k, "acc_stderr": 0.05}}}
               for k, p in enumerate(policies)}
    data = {"settings": {"model": model, "budget": budget, "num_fewshot": 5}, "results": results,
            "offline_data": {task: {"evaluated_split": "validation"}}}
    path.write_text(json.dumps(data))
    return str(path)


def test_merge_table_and_figure(tmp_path, capsys):
    a = piece(tmp_path / "a.json", 0.2, ["full", "h2o", "local"])
    b = piece(tmp_path / "b.json", 0.5, ["full", "h2o"], acc=0.7)  # full again: the later piece wins
    c = piece(tmp_path / "c.json", 0.2, ["full", "h2o"], task="piqa", model="/m/Qwen.gguf", items=200)
    rows = R.merge([a, b, c])
    keys = {(r["model"], r["task"], r["policy"], r["budget"]) for r in rows}
    assert keys == {("smollm2", "copa", "full", 1.0), ("smollm2", "copa", "h2o", 0.2), ("smollm2", "copa", "local", 0.2),
                    ("smollm2", "copa", "h2o", 0.5), ("Qwen", "piqa", "full", 1.0), ("Qwen", "piqa", "h2o", 0.2)}
    full = next(r for r in rows if r["model"] == "smollm2" and r["policy"] == "full")
    assert full["metrics"]["acc"] == pytest.approx(0.7) and full["source"] == b and full["split"] == "validation"
    table = R.markdown_table(rows, budget=0.2)
    assert "| copa | 100 | acc | 0.700 ± 0.050 | 0.500 ± 0.050 | 0.400 ± 0.050 |" in table  # full, h2o, local
    assert "| piqa | 200 | acc | 0.600 ± 0.050 | 0.500 ± 0.050 |" in table
    out, png = tmp_path / "m.json", tmp_path / "f.png"
    assert cli_main(["eval", "tasks-report", a, b, c, "--json", str(out), "--png", str(png), "--markdown"]) == 0
    assert len(json.loads(out.read_text())["rows"]) == 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| copa |" in capsys.readouterr().out


def test_bad_pieces_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli_main(["eval", "tasks-report", str(bad)]) == 2
    assert "bad.json: not valid JSON" in capsys.readouterr().err
    assert cli_main(["eval", "tasks-report", str(tmp_path / "missing.json")]) == 2
    assert "piece not found" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text("{}")
    assert cli_main(["eval", "tasks-report", str(other)]) == 2
    assert "not an `h2okv eval tasks` or `eval summarize` result" in capsys.readouterr().err


def summary_piece(path, with_stderr: bool):
    """An `eval summarize` piece: two items, full and h2o."""
    refs = ["the cat sat on the mat", "a dog ran in the park"]
    preds = {"full": ["the cat sat", "a dog ran"], "h2o": ["the cat", "the park"]}
    from h2okv.eval.summarize import rouge_scores

    results = {}
    for policy, outs in preds.items():
        scores = rouge_scores(outs, refs)
        if not with_stderr:
            scores = {k: v for k, v in scores.items() if not k.endswith("_stderr")}
        results[policy] = {**scores, "items": 2, "seconds": 1.0}
    samples = [{"id": str(i), "reference": r, "predictions": {p: preds[p][i] for p in preds}} for i, r in enumerate(refs)]
    data = {"source": "/data/xsum_0shot.jsonl", "settings": {"eval_kind": "summarize", "shots": 0, "budget": 0.2,
                                                             "model": None},
            "results": results, "samples": samples}
    path.write_text(json.dumps(data))
    return str(path), results


@pytest.mark.parametrize("with_stderr", [True, False])
def test_summarize_pieces_join_the_table_with_stderr(tmp_path, with_stderr):
    path, results = summary_piece(tmp_path / "x.json", with_stderr)
    rows = R.merge([path, piece(tmp_path / "a.json", 0.2, ["full", "h2o"])])
    xsum = {r["policy"]: r for r in rows if r["task"] == "xsum"}
    assert set(xsum) == {"full", "h2o"} and xsum["h2o"]["budget"] == 0.2 and xsum["full"]["budget"] == 1.0
    assert xsum["h2o"]["shots"] == 0 and xsum["h2o"]["items"] == 2
    # the stderr is there whether the piece carried it or not (then computed from its samples)
    from h2okv.eval.summarize import rouge_scores

    want = rouge_scores(["the cat", "the park"], ["the cat sat on the mat", "a dog ran in the park"])
    assert xsum["h2o"]["metrics"]["rouge1_stderr"] == pytest.approx(want["rouge1_stderr"])
    table = R.markdown_table(rows, budget=0.2)
    full, h2o = xsum["full"]["metrics"], xsum["h2o"]["metrics"]
    assert (f"| xsum | 2 | rougeL | {full['rougeL']:.3f} ± {full['rougeL_stderr']:.3f} | "
            f"{h2o['rougeL']:.3f} ± {h2o['rougeL_stderr']:.3f} |") in table
    assert "0-shot" in table and "5-shot" in table  # the summaries get their own table
    # the accuracy figure ignores ROUGE rows
    assert R.plot_budget_sweep(rows, tmp_path / "f.png").exists()


def test_agreement_with_full_across_one_policy_pieces(tmp_path):
    """Policies run in separate processes still get agree_with_full from the per-item choices."""
    def one(name, policy, picked):
        data = {"settings": {"model": None, "budget": 0.2, "num_fewshot": 5},
                "results": {policy: {"tasks": {"piqa": {"items": len(picked), "acc": 0.5}}, "picked": {"piqa": picked}}}}
        (tmp_path / name).write_text(json.dumps(data))
        return str(tmp_path / name)

    full = one("full.json", "full", [0, 1, 1, 0])
    h2o = one("h2o.json", "h2o", [0, 1, 0, 0])
    short = one("local.json", "local", [0, 1])  # other items: no agreement claimed
    rows = {r["policy"]: r for r in R.merge([full, h2o, short])}
    assert rows["h2o"]["metrics"]["agree_with_full"] == pytest.approx(0.75)
    assert rows["full"]["metrics"]["agree_with_full"] == 1.0
    assert "agree_with_full" not in rows["local"]["metrics"]
    assert all("picked" not in r for r in rows.values())


def test_summaries_in_one_policy_pieces_are_paired_with_full(tmp_path):
    """Each policy in its own `eval summarize` piece: the merge pairs the articles by id and gives
    ROUGE-L against full's summaries and the paired ROUGE difference ± stderr."""
    from h2okv.eval.summarize import mean_and_stderr, rouge_per_item

    refs = ["the cat sat on the mat", "a dog ran in the park", "rain fell all day long"]
    outs = {"full": ["the cat sat on a mat", "a dog ran", "rain fell all day"],
            "h2o": ["the cat sat on a mat", "a dog", "snow fell"],
            "local": ["the cat", "a dog"]}  # other articles: nothing paired

    def one(policy):
        texts = outs[policy]
        samples = [{"id": str(i), "reference": refs[i], "predictions": {policy: t}} for i, t in enumerate(texts)]
        data = {"source": "/data/cnn_dailymail_0shot.jsonl",
                "settings": {"eval_kind": "summarize", "shots": 0, "budget": 0.2, "model": None},
                "results": {policy: {"rougeL": 0.5, "rougeL_stderr": 0.1, "items": len(texts)}}, "samples": samples}
        path = tmp_path / f"{policy}.json"
        path.write_text(json.dumps(data))
        return str(path)

    rows = {r["policy"]: r for r in R.merge([one("full"), one("h2o"), one("local")])}
    assert {r["task"] for r in rows.values()} == {"cnn_dailymail"}
    chat = json.loads((tmp_path / "h2o.json").read_text())
    chat["settings"]["chat"] = True  # prompts in the chat template: another row, never merged with these
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    assert [r["task"] for r in R.merge([str(tmp_path / "chat.json")])] == ["cnn_dailymail (chat)"]
    h2o = rows["h2o"]["metrics"]
    assert h2o["same_as_full"] == pytest.approx(1 / 3)
    mine, full = rouge_per_item(outs["h2o"], refs)["rougeL"], rouge_per_item(outs["full"], refs)["rougeL"]
    mean, err = mean_and_stderr([a - b for a, b in zip(mine, full)])
    assert mean < 0 and h2o["rougeL_minus_full"] == pytest.approx(mean) and h2o["rougeL_minus_full_stderr"] == pytest.approx(err)
    assert "rougeL_vs_full" not in rows["local"]["metrics"] and "rougeL_minus_full" not in rows["local"]["metrics"]
    assert "rougeL_minus_full" not in rows["full"]["metrics"]
    assert all("summaries" not in r for r in rows.values())
    table = R.markdown_table(list(rows.values()), budget=0.2)
    assert f"| cnn_dailymail | 2/3 | rougeL_minus_full | – | {mean:.3f} ± {err:.3f} | – |" in table
    png = tmp_path / "rouge.png"
    assert cli_main(["eval", "tasks-report", one("full"), one("h2o"), "--rouge-png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # no summarization piece: a one-line error, not an empty figure
    assert cli_main(["eval", "tasks-report", piece(tmp_path / "a.json", 0.2, ["full"]), "--rouge-png", str(png)]) == 2
