"""tools/measure/qa_table.py: real-question rows, several a document, as one table whose scores and
standard errors are per document (a document's questions share it: they are not separate draws)."""

import json

import pytest

from tool_scripts import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("measure/qa_table.py")


def row(task, sample, index, score, mode="reuse", policy="full", tokens=2200):
    return {"task": task, "context": 2048, "sample": sample, "question": mode, "policy": policy,
            "budget": 1.0 if policy == "full" else 0.2, "cache_options": {}, "metric": "qa_f1", "score": score,
            "answer": "", "references": [], "haystack": "stories", "seed": 1, "questions": 2,
            "question_index": index, "prefill_tokens": tokens, "seconds": 1.0}


def write(path, rows):
    path.write_text(json.dumps(rows))
    return str(path)


def table_lines(tool, tmp_path, capsys, rows):
    assert tool.main([write(tmp_path / "rows.json", rows)]) == 0
    return {tuple(cell.strip() for cell in line.strip("|").split("|")[:2]): line
            for line in capsys.readouterr().out.splitlines()[2:]}


def test_a_document_is_the_mean_of_its_answers_and_errors_are_over_documents(tool, tmp_path, capsys):
    # two documents of one task, two questions each: full answers 1, 1 | 1, 0 (documents 1.0, 0.5);
    # h2o answers 1, 0 | 0, 0 (documents 0.5, 0.0)
    full = [row("squad", 0, 0, 1.0), row("squad", 0, 1, 1.0), row("squad", 1, 0, 1.0), row("squad", 1, 1, 0.0)]
    h2o = [row("squad", 0, 0, 1.0, policy="h2o"), row("squad", 0, 1, 0.0, policy="h2o"),
           row("squad", 1, 0, 0.0, policy="h2o"), row("squad", 1, 1, 0.0, policy="h2o")]
    lines = table_lines(tool, tmp_path, capsys, full + h2o)
    cells = [c.strip() for c in lines["h2o", "reuse"].strip("|").split("|")]
    # columns: config, mode, context, documents, squad, average (SE), of full, paired (SE), tokens, s
    assert cells[3] == "2" and cells[4] == "25.0"
    # the documents' scores 0.5 and 0.0: sd 0.354, SE over 2 documents 25.0 (not over 4 answers)
    assert cells[5] == "25.0 (25.0)"
    assert cells[6] == "33%"  # 25 of full's 75
    # differences per document -0.5, -0.5: the mean -50, no spread
    assert cells[7] == "-50.0 (0.0)"
    assert lines["full", "reuse"].split("|")[6].strip() == "75.0 (25.0)"


def test_the_share_of_full_is_taken_on_the_documents_both_read(tool, tmp_path, capsys):
    # full read two tasks; a piece cut short read only the first, at full's score there
    full = [row("a", 0, i, 1.0) for i in (0, 1)] + [row("b", 0, i, 0.0) for i in (0, 1)]
    part = [row("a", 0, i, 1.0, policy="h2o") for i in (0, 1)]
    cells = [c.strip() for c in table_lines(tool, tmp_path, capsys, full + part)["h2o", "reuse"].strip("|").split("|")]
    assert cells[5] == "-" and cells[7] == "100%" and cells[8] == "+0.0"  # not 100 / 50 = 200% against full's two tasks


def test_modes_are_compared_with_full_in_the_same_mode_only(tool, tmp_path, capsys):
    rows = [row("a", s, i, 1.0, mode="fresh", tokens=8192) for s in (0, 1) for i in (0, 1)]
    rows += [row("a", s, i, 0.5, mode="reuse", policy="h2o") for s in (0, 1) for i in (0, 1)]
    lines = table_lines(tool, tmp_path, capsys, rows)
    cells = [c.strip() for c in lines["h2o", "reuse"].strip("|").split("|")]
    assert cells[6] == "-" and cells[7] == "-"  # full ran fresh only: nothing to pair the reuse rows with
    assert lines["full", "fresh"].split("|")[9].strip() == "8,192"


def test_missing_bad_or_one_question_files_are_refused_in_one_line(tool, tmp_path, capsys):
    one_question = dict(row("a", 0, 0, 1.0), questions=1)
    single = write(tmp_path / "single.json", [one_question])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"x": 1}]))
    assert tool.main([str(tmp_path / "missing.json")]) == 2
    assert tool.main([str(bad)]) == 2
    assert tool.main([single]) == 2
    twice = write(tmp_path / "twice.json", [row("a", 0, 0, 1.0), row("a", 0, 1, 0.0)])
    rerun = write(tmp_path / "rerun.json", [row("a", 0, 0, 0.0)])
    assert tool.main([twice, rerun]) == 2  # a re-run beside its first run would be averaged with it
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qa_table: no such file: {tmp_path / 'missing.json'}",
                   f"qa_table: {bad} does not hold eval longctx rows",
                   "qa_table: no rows of several questions a document (eval longctx --questions-per-context N)",
                   f"qa_table: {rerun} repeats 1 answers of an earlier file (one run a configuration: give the run "
                   "to report)"]


def test_eval_longctx_tables_take_a_peers_rows_without_prompt_tokens():
    """``eval longctx --merge`` over ours and kvpress's several-question rows: a peer's rows count no
    prompt tokens (it reads each question with its document), shown as '-' instead of a KeyError."""
    from h2okv.eval.longctx.report import tables

    peer = [{k: v for k, v in row("a", s, i, 1.0, mode="fresh", policy="kvpress-chunkkv-snapkv").items()
             if k != "prefill_tokens"} for s in (0, 1) for i in (0, 1)]
    ours = [row("a", s, i, 0.5, mode="fresh") for s in (0, 1) for i in (0, 1)]
    line = next(line for line in tables(peer + ours).splitlines() if "kvpress" in line)
    assert "100.0" in line and line.split()[-1] == "-"
