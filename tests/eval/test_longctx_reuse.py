"""eval longctx --questions-per-context N: N questions over one context (generators: every answer in
the shared context, exact lengths, seeds, distinct keys), reuse's answers equal to a fresh two-call
read per question, clear errors, and the rows written, tabled, resumed and merged, on tiny models."""

import json

import pytest

import h2okv.models
from char_tokenizers import Chars
from h2okv.cli import main
from h2okv.errors import H2OError
from h2okv.eval.longctx.prompt import Frame
from h2okv.eval.longctx.qa import QA_TASKS
from h2okv.eval.longctx.reuse import reuse_answers
from h2okv.eval.longctx.runner import generate_answers, haystack_source
from h2okv.eval.longctx.tasks import TASKS, build_prompts, build_question_sets, check_questions
from h2okv.generation import new_cache
from h2okv.recipes import recipe_runs
from h2okv.tools.tiny import tiny_model

MANY = sorted(t for t in TASKS if TASKS[t].many_questions)
ESSAY = " ".join(f"Sentence {i} of the essay says something plain about topic {i % 7}." for i in range(400))


class EosChars(Chars):
    eos_token_id = None  # h2okv.ask reads it (a real tokenizer has one)


@pytest.fixture(scope="module")
def essay(tmp_path_factory):
    path = tmp_path_factory.mktemp("hay") / "essay.txt"
    path.write_text(ESSAY)
    return f"text:{path}"


def sets_of(tok, haystack, task, context, questions, samples=2, seed=0):
    return build_question_sets(Frame(tok, False), haystack_source(tok, haystack), task, context, samples, seed, questions)


def test_the_families_that_take_several_questions():
    assert MANY == sorted(set(TASKS) - {"cwe", "fwe"})


@pytest.mark.parametrize("task", [t for t in MANY if t not in QA_TASKS])  # real questions: test_longctx_qa.py
def test_n_questions_share_one_context_that_holds_every_answer(task, essay):
    tok = Chars()
    sets = sets_of(tok, essay, task, 1800, 3)
    assert sets == sets_of(tok, essay, task, 1800, 3)  # the seed decides everything
    assert sets != sets_of(tok, essay, task, 1800, 3, seed=1)
    for prompts in sets:
        assert [p.index for p in prompts] == [0, 1, 2] and {len(p.ids) for p in prompts} == {1800}
        context = prompts[0].ids[: prompts[0].question]
        assert all(p.ids[: p.question] == context for p in prompts)  # one context, N questions
        text = tok.decode(context)
        questions = [tok.decode(p.ids[p.question :]) for p in prompts]
        assert len(set(questions)) == 3
        refs = [set(p.references) for p in prompts]
        assert all(a.isdisjoint(b) for i, a in enumerate(refs) for b in refs[i + 1 :])  # distinct items asked
        for p, question in zip(prompts, questions, strict=True):
            assert p.references and all(ref in text for ref in p.references)
            assert not any(ref in question for ref in p.references if len(ref) > 5)
    assert sets[0][0].ids != sets[1][0].ids


def test_needles_of_every_question_with_their_keys_and_the_familys_distractors(essay):
    tok = Chars()
    (prompts,) = sets_of(tok, essay, "niah_multikey_1", 1800, 3, samples=1)
    needles = [tok.decode(prompts[0].ids[a:b]) for a, b in prompts[0].evidence]
    assert len(needles) == 3 + 3  # a key per question, and multikey's 3 distractors
    keys = []
    for p in prompts:
        (holder,) = [n for n in needles if p.references[0] in n]
        keys.append(holder.split(" for ")[1].split(" is:")[0])
        assert f"number for {keys[-1]} mentioned" in tok.decode(p.ids[p.question :])
    assert len(set(keys)) == 3
    assert "Some special magic numbers are hidden" in tok.decode(prompts[0].ids)


def test_one_question_per_context_is_the_plain_grid(essay):
    tok = Chars()
    for task in set(TASKS) - set(QA_TASKS):  # real questions: test_longctx_qa.py
        plain = build_prompts(Frame(tok, False), haystack_source(tok, essay), task, 1300, 2, 0)
        assert [s for (s,) in sets_of(tok, essay, task, 1300, 1)] == plain


def test_bad_question_counts_are_one_line_errors(essay):
    with pytest.raises(H2OError, match="must be >= 1, got 0"):
        check_questions(["vt"], 0)
    with pytest.raises(H2OError, match=r"cwe, fwe ask\(s\) one question .* work for niah_single_1, "):
        check_questions(["vt", "cwe", "fwe"], 2)
    check_questions(["cwe"], 1)
    with pytest.raises(H2OError, match="fwe ask"):
        sets_of(Chars(), essay, "fwe", 1300, 2)
    with pytest.raises(H2OError, match="too short for 20 inserted needles"):
        sets_of(Chars(), essay, "niah_multiquery", 1300, 5)


CONFIGS = {"h2o": ("h2o", {}), "document": tuple(recipe_runs(["document"])[0][:2])}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reuse_answers_equal_a_fresh_two_call_read_per_question(name, essay):
    """``read_context`` on the context, then ``generate`` on context + question into a fresh cache,
    per question, gives what reuse gives from one read shared by all the questions."""
    tok = EosChars()
    model = tiny_model("llama", seed=4, max_position_embeddings=2048)
    model.generation_config.eos_token_id = None
    policy, options = CONFIGS[name]
    (prompts,) = sets_of(tok, essay, "niah_single_2", 700, 3, samples=1)
    reused = reuse_answers(model, tok, prompts, new_cache(model, policy, 0.3, chunk_size=128, **options), 4)
    alone = [generate_answers(model, tok, [p], new_cache(model, policy, 0.3, chunk_size=128, **options), "agnostic", 4)[0]
             for p in prompts]
    assert reused == alone and len(reused) == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--questions-per-context", "0"], "must be a positive integer"),
        (["--tasks", "vt,cwe", "--questions-per-context", "2"], "cwe ask(s) one question of the whole text"),
        (["--tasks", "vt", "--questions-per-context", "2", "--fresh-process"], "leave out --questions-per-context"),
    ],
)
def test_cli_bad_question_counts_exit_2_in_one_line(argv, message, capsys):
    assert main(["eval", "longctx", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err.split("error:", 1)[-1]


def tokens_of(essay, task, sample):
    """``(context, question 0, question 1)`` token counts of the CLI test's question set."""
    prompts = sets_of(EosChars(), essay, task, 700, 2, samples=sample + 1)[sample]
    return (prompts[0].question, *(len(p.ids) - p.question for p in prompts))


def test_cli_rows_of_both_modes_resume_and_merge(tmp_path, monkeypatch, essay, capsys):
    model = tiny_model("llama", seed=3, max_position_embeddings=2048)
    model.generation_config.eos_token_id = None
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, EosChars()))
    calls = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(kw["input_ids"].shape) or generate(**kw))
    out = tmp_path / "r.json"
    argv = ["eval", "longctx", "--tasks", "niah_single_2,vt", "--contexts", "700", "--samples", "2", "--haystack", essay,
            "--max-new-tokens", "3", "--policies", "full,h2o", "--budgets", "0.3", "--questions-per-context", "2",
            "--json", str(out), "--plot", ""]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 * 2 * 2 * 2  # tasks x samples x configurations x modes x questions
    assert {(r["question"], r["questions"], r["question_index"]) for r in rows} == {
        (m, 2, i) for m in ("reuse", "fresh") for i in (0, 1)}
    for r in rows:  # reuse reads the context once and each question; fresh, both per question
        (context, first, second) = tokens_of(essay, r["task"], r["sample"])
        assert r["prefill_tokens"] == (context + first + second if r["question"] == "reuse" else 2 * 700)
    full = {(r["task"], r["sample"], r["question_index"], r["question"]): r["answer"] for r in rows if r["policy"] == "full"}
    assert all(full[k] == full[(*k[:3], "fresh")] for k in full if k[3] == "reuse")  # nothing evicted: one answer
    printed = capsys.readouterr().out
    assert "2 questions per context, reuse vs fresh" in printed and "tokens reuse" in printed and "average" in printed
    ran = len(calls)
    assert main(argv) == 0 and len(calls) == ran  # resumed: every cell skipped
    assert "32 rows already there" in capsys.readouterr().out
    merged, png = tmp_path / "m.json", tmp_path / "m.png"
    assert main(["eval", "longctx", "--merge", str(out), "--json", str(merged), "--plot", str(png)]) == 0
    assert json.loads(merged.read_text()) == rows and png.read_bytes()[:4] == b"\x89PNG"
    assert "tokens fresh" in capsys.readouterr().out


@pytest.mark.parametrize("question, mode", [("agnostic", "reuse"), ("aware", "fresh")])
def test_cli_question_picks_one_mode_of_several_questions(question, mode, tmp_path, monkeypatch, essay, capsys):
    """``--question`` with N questions a context runs one mode: agnostic the context read once for
    them (reuse), aware each question read with it (fresh); the same answers as both modes' run."""
    model = tiny_model("llama", seed=3, max_position_embeddings=2048)
    model.generation_config.eos_token_id = None
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, EosChars()))
    argv = ["eval", "longctx", "--tasks", "vt", "--contexts", "700", "--samples", "1", "--haystack", essay,
            "--max-new-tokens", "3", "--policies", "h2o", "--budgets", "0.3", "--questions-per-context", "2",
            "--plot", ""]
    both, one = tmp_path / "both.json", tmp_path / "one.json"
    assert main([*argv, "--json", str(both)]) == 0
    assert main([*argv, "--json", str(one), "--question", question]) == 0
    assert f"2 questions per context, {mode}," in capsys.readouterr().out
    rows = json.loads(one.read_text())
    assert {r["question"] for r in rows} == {mode} and len(rows) == 2
    untimed = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert untimed(rows) == untimed(r for r in json.loads(both.read_text()) if r["question"] == mode)
