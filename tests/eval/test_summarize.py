"""``h2okv eval summarize`` on a tiny random Llama and a temporary JSONL (offline)."""

import json
import random

import pytest
import torch

from h2okv import H2OError
from h2okv.cli import main as cli_main
from h2okv.eval import summarize as S
from h2okv.tools.tiny import tiny_model, word_tokenizer, words


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: the intra-op pool only adds waiting on a shared machine
    yield
    torch.set_num_threads(before)


def make_records(n=6, seed=0):
    rng = random.Random(seed)
    return [{"id": f"r{i}", "document": words(rng, rng.randint(15, 30)), "summary": words(rng, 4)} for i in range(n)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_rouge_matches_rouge_score_directly():
    from rouge_score import rouge_scorer

    preds = ["the cat sat on the mat", "a quick brown fox jumps"]
    refs = ["the cat was sitting on the mat", "the quick brown fox jumped over the dog"]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    expected = {k: sum(scorer.score(r, p)[k].fmeasure for p, r in zip(preds, refs)) / 2 for k in S.ROUGE_TYPES}
    got = S.rouge_scores(preds, refs)
    assert {k: got[k] for k in S.ROUGE_TYPES} == pytest.approx(expected, abs=1e-12)
    # standard error of the mean over the two items: |a - b| / 2 for n = 2
    for k in S.ROUGE_TYPES:
        a, b = (scorer.score(r, p)[k].fmeasure for p, r in zip(preds, refs))
        assert got[f"{k}_stderr"] == pytest.approx(abs(a - b) / 2)
    # and by hand for one pair: "the cat sat on the mat" vs "the cat was sitting on the mat" (stemmed:
    # sitting -> sit, sat stays): unigram overlap the, cat, on, the, mat = 5; P = 5/6, R = 5/7
    one = S.rouge_scores(preds[:1], refs[:1])
    assert one["rouge1"] == pytest.approx(2 * (5 / 6) * (5 / 7) / (5 / 6 + 5 / 7))
    same = S.rouge_scores(["same words here"], ["same words here"])
    assert {k: same[k] for k in S.ROUGE_TYPES} == pytest.approx(dict.fromkeys(S.ROUGE_TYPES, 1.0))
    assert same["rouge1_stderr"] is None  # one item: no standard error


def test_fidelity_to_full_outputs():
    got = S.fidelity(["-----", "", "a b", "x"], ["-----", "", "a c", "y"])
    assert got["same_as_full"] == 0.5
    assert got["rougeL_vs_full"] == pytest.approx((1 + 1 + 0.5 + 0) / 4)


def test_prompt_is_k_shot_without_the_test_item():
    records = make_records(6)
    for index in range(6):
        prompt, shots = S.build_prompt(records, index, shots=3, seed=0)
        assert len(shots) == 3 and index not in shots and len(set(shots)) == 3
        assert records[index]["summary"] not in prompt  # the answer never leaks in
        assert prompt.endswith(f"Article: {records[index]['document']}\nSummary:")
        for j in shots:
            assert f"Article: {records[j]['document']}\nSummary: {records[j]['summary']}\n\n" in prompt
        assert prompt.count("Article:") == 4
        assert S.build_prompt(records, index, shots=3, seed=0) == (prompt, shots)  # deterministic
    assert S.build_prompt(records, 0, shots=0)[1] == []
    with pytest.raises(H2OError, match="needs at least 7 records"):
        S.build_prompt(records, 0, shots=6)


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"document": "a b", "summary": "a"}\n\n{"document": "c d", "summary": \n')
    with pytest.raises(H2OError, match=r"bad.jsonl:3: not valid JSON"):
        S.read_jsonl(path)
    path.write_text('{"document": "a b", "summary": "a"}\n{"document": "c d"}\n')
    with pytest.raises(H2OError, match=r"bad.jsonl:2: missing or empty string field 'summary'"):
        S.read_jsonl(path)
    with pytest.raises(H2OError, match="data file not found"):
        S.read_jsonl(tmp_path / "nope.jsonl")


def test_malformed_jsonl_cli_is_one_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"document": "a b", "summary": "a"}\nnot json\n')
    assert cli_main(["eval", "summarize", "--data", str(path), "--json", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error: ") and "bad.jsonl:2" in err and len(err.splitlines()) == 1


def test_summarize_policies_budget_and_scores():
    model, tok = tiny_model("llama"), word_tokenizer()
    records = make_records(5)
    spec = S.SummarizeSpec(["full", "h2o"], budget=0.2, shots=1, limit=3, max_new_tokens=6, batch_size=2)
    out = S.summarize_policies(model, tok, records, spec)
    full, h2o = out["results"]["full"], out["results"]["h2o"]
    assert full["items"] == h2o["items"] == 3
    assert len(out["samples"]) == 3 and all(s["id"] not in s["shots"] for s in out["samples"])
    for sample in out["samples"]:
        for text in sample["predictions"].values():
            assert "\n" not in text and len(text.split()) <= 6
    # the scores are the ROUGE of what was generated
    refs = [records[i]["summary"] for i in range(3)]
    assert full["rouge1"] == pytest.approx(S.rouge_scores([s["predictions"]["full"] for s in out["samples"]], refs)["rouge1"])
    # h2o kept 20% of each prompt (10% + 10%, rounded down per part); full kept the whole prompt
    assert h2o["mean_kv_slots"] < 0.25 * out["mean_prompt_tokens"]
    assert full["mean_kv_slots"] == pytest.approx(out["mean_prompt_tokens"])
    # fidelity to full: full against itself is perfect; h2o is scored against full's outputs
    assert full["rougeL_vs_full"] == pytest.approx(1.0)
    assert full["same_as_full"] == 1.0
    same = sum(s["predictions"]["h2o"] == s["predictions"]["full"] for s in out["samples"]) / 3
    assert h2o["same_as_full"] == pytest.approx(same)


def test_summarize_command_writes_json_and_plot(tiny_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", make_records(5))
    out = tmp_path / "res" / "sum.json"
    code = cli_main(["eval", "summarize", "--data", str(data), "--shots", "2", "--policies", "full,local",
                     "--limit", "2", "--max-new-tokens", "4", "--model", str(tiny_dir), "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"full", "local"}
    assert all(0.0 <= report["results"][p][k] <= 1.0 for p in ("full", "local") for k in S.ROUGE_TYPES)
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ROUGE-1" in capsys.readouterr().out


def test_hub_dataset_offline_is_one_line(tmp_path, monkeypatch, capsys):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'EdinburghNLP/xsum' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert cli_main(["eval", "summarize", "--dataset", "xsum", "--limit", "2", "--json", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h2okv: error: could not download dataset 'xsum'") and len(err.splitlines()) == 1


def test_offline_package_set_is_well_formed():
    records = S.installed_package_summaries()
    assert len(records) >= 5
    assert records == sorted(records, key=lambda r: r["id"].lower())
    for r in records:
        assert 60 <= len(r["document"].split()) <= 150
        assert 5 <= len(r["summary"].split()) <= 30
        assert r["summary"].rstrip(".").lower() not in r["document"].lower()
        assert "](" not in r["document"] and "```" not in r["document"]


def request_records(n=6, seed=0):
    """Records in the H2O reference code's request format (as in ../shared/data/xsum_0shot.jsonl)."""
    rng = random.Random(seed)
    return [{"article": f"###\nArticle: {words(rng, rng.randint(15, 30))} item{i}\n\nSummarize the above article in 1 sentence.\n",
             "summary_gt": f"summary{i} {words(rng, 4)}", "stop": ["###"], "max_tokens": 7, "temperature": 0.3}
            for i in range(n)]


def test_request_format_k_shot_prompt_never_includes_the_item(tmp_path):
    raw = request_records(8)
    records = S.read_jsonl(write_jsonl(tmp_path / "x.jsonl", raw))
    assert [r["summary"] for r in records] == [r["summary_gt"] for r in raw]
    assert S.generation_stops(records) == (["###"], True)
    for index in range(len(records)):
        prompt, shots = S.build_prompt(records, index, shots=3, seed=1)
        assert index not in shots and len(set(shots)) == 3
        assert f"item{index}\n" in prompt and prompt.count(f"item{index}\n") == 1  # its article, once: its own
        assert f"summary{index} " not in prompt  # its answer never leaks in
        assert prompt.endswith(raw[index]["article"])  # ends with its own 0-shot prompt, nothing after
        assert prompt.count("###\nArticle:") == 4  # 3 examples + the item, each opened by the stop marker
        for j in shots:  # each example: its prompt, then its reference summary, then a blank line
            assert raw[j]["article"] + raw[j]["summary_gt"] + "\n\n" in prompt


def test_request_format_bad_fields_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"article": "###\nArticle: a\n", "summary_gt": "s"}) + "\n"
                    + json.dumps({"article": "###\nArticle: b\n", "summary_gt": "s", "stop": [""]}) + "\n")
    with pytest.raises(H2OError, match=r"bad.jsonl:2: 'stop' must be a list of non-empty strings"):
        S.read_jsonl(path)


def test_request_format_generation_uses_the_records_settings(tiny_dir, tmp_path):
    data = write_jsonl(tmp_path / "r.jsonl", request_records(4))
    out = tmp_path / "r.json"
    assert cli_main(["eval", "summarize", "--data", str(data), "--shots", "1", "--policies", "full,h2o", "--limit", "2",
                     "--model", str(tiny_dir), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for sample in report["samples"]:
        for text in sample["predictions"].values():
            assert len(text.split()) <= 7  # the records' max_tokens (one word per token here)


def test_chat_prompts_go_through_the_chat_template(tiny_dir, tmp_path, capsys):
    tok = word_tokenizer()
    text = "w10 w11 w12"
    assert S.prompt_ids(tok, text) == tok(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(H2OError, match="--chat needs a tokenizer with a chat template"):
        S.prompt_ids(tok, text, chat=True)
    tok.chat_template = ("{% for m in messages %}w5 {{ m['content'] }} w6 {% endfor %}"
                         "{% if add_generation_prompt %}w7{% endif %}")
    wrapped = tok("w5 w10 w11 w12 w6 w7", add_special_tokens=False)["input_ids"]
    assert S.prompt_ids(tok, text, chat=True) == wrapped
    # every prompt of a run is wrapped: one user turn holding the whole k-shot prompt
    records = make_records(4)
    spec = S.SummarizeSpec(["full"], budget=0.2, shots=1, limit=2, max_new_tokens=3, chat=True)
    out = S.summarize_policies(tiny_model("llama"), tok, records, spec)
    for i, sample in enumerate(out["samples"]):
        prompt, _ = S.build_prompt(records, i, 1)
        assert sample["prompt_tokens"] == len(tok(prompt, add_special_tokens=False)["input_ids"]) + 3
    # the command: a tokenizer without a template is a one-line error
    data = write_jsonl(tmp_path / "d.jsonl", make_records(3))
    code = cli_main(["eval", "summarize", "--data", str(data), "--chat", "--limit", "1", "--model", str(tiny_dir),
                     "--json", str(tmp_path / "o.json")])
    assert code == 2 and "--chat needs a tokenizer with a chat template" in capsys.readouterr().err


def test_readme_badges_inside_a_line_leave_no_link_syntax():
    """A badge wrapped in a link mid-line ([![alt](img)](url)) once left "alt](" in the document (the
    GPU image's statsmodels README): images go first, then the links they emptied."""
    readme = ("Intro text [![PyPI Version](https://img.shields.io/v.svg)](https://pypi.org/p) and "
              "[![Build Status](https://ci/badge.svg)](https://ci/p) then [the docs](https://d.org) end.\n"
              "Plain ![logo](logo.svg) prose.")
    cleaned = S._clean_readme(readme)
    assert cleaned == "Intro text and then the docs end. Plain prose."


def test_readme_badge_whose_alt_text_wraps_onto_the_next_line_leaves_no_link_syntax():
    """A badge row wrapped inside an alt text ("[![PyPI" / "Version](img)](url)"): the first line is
    dropped as a badge line, so images must go before the text is split into lines."""
    readme = ("[![PyPI\nVersion](https://img.shields.io/v.svg)](https://pypi.org/p) [![Build\n"
              "Status](https://ci/badge.svg)](https://ci/p)\n\nAbout it\n========\n\nProse [the docs](https://d.org).")
    assert S._clean_readme(readme) == "About it Prose the docs."
