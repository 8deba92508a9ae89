"""Real questions over real text as long-context tasks, built like the RULER families (``tasks.py``):
prompts of an exact token length, every draw from the sample's rng, and N questions over one shared
context (``--questions-per-context N``).

- ``qa_squad`` (RULER's QA task, on SQuAD): N gold paragraphs (the article's title on the first
  line), each at a random depth among other SQuAD paragraphs up to the length; each question asks
  of one of them. Graded by SQuAD's F1 (``metric.qa_f1``).
- ``qa_drop``: the same over DROP's passages and questions (counting, arithmetic, dates), graded by
  DROP's F1 (``metric.drop_f1``: numbers normalised).
- ``qa_coqa``: one CoQA story at a random depth among other stories, and N turns of its
  conversation, graded by F1 (``metric.qa_f1``). CoQA's questions lean on the turns before them
  ("Where did she live?"); asked bare, many have no referent. Each question therefore carries the
  (up to) three turns before it with the answers the conversation went on with, as CoQA gives its
  history: enough for the pronouns and ellipses, which point back a turn or two, while the whole
  history would grow the question part to hundreds of tokens for late turns, and every question of
  a context is padded to the longest. Every story is headed by a random five-letter name and the
  question names the gold one: other stories sit beside it, and a name gives nothing of the story
  away (its first words could hold an answer).
- ``facts``: N facts planted at random depths in the run's ``--haystack``, one per question, of
  five forms in turn: a person's name, a number, a date, a phrase of three words, and a figure
  stated twice, first "reported as X", later "first reported as X; the corrected figure is Y",
  where the answer is Y. Graded by F1 (``metric.qa_f1``).

Every prompt asks for a few words after the answer prefix " Answer:"; the metric grades the
answer's first line. Documents and stories are whole, the last distractor cut to fit the length. A
gold text is one of at most half the room the context leaves, over N (``short_enough``): the long
DROP passages and CoQA stories are asked at longer contexts, and N gold texts always fit.

Splits: a data set's texts (paragraphs, passages, stories) are halved in file order, every other
one, and a run's seed picks a half by its parity, gold and distractors alike: dev (seed 0) and test
(seed 1) never share a question nor a text. A half holds ~400 SQuAD paragraphs, ~200 DROP passages,
~250 CoQA stories: distractors for about 32k tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from h2okv.errors import H2OError
from h2okv.eval import qa_data
from h2okv.eval.longctx.parts import (
    Asked,
    ManyQuestions,
    even_questions,
    haystack_stretch,
    insert_at_depths,
    needle_depths,
    over_one_context,
    sample_rng,
)
from h2okv.eval.longctx.prompt import Frame, LongPrompt
from h2okv.eval.longctx.words import distinct, english_words, variable_names

FEW_WORDS = "Answer in a few words, with no explanation."
PREFIX = " Answer:"


def half(items: list, seed: int, text=lambda item: item.text) -> list:
    """The items whose text is every other distinct text, from the first or the second by ``seed``'s parity."""
    order = {t: i for i, t in enumerate(dict.fromkeys(map(text, items)))}
    return [item for item in items if order[text(item)] % 2 == seed % 2]


def documents(frame: Frame, texts: list[str], length: int, name: str) -> tuple[list[int], list[int]]:
    """``length`` ids of whole ``texts`` in order, the last one cut, and where each text starts."""
    ids, breaks = [], [0]
    for text in texts:
        if len(ids) >= length:
            break
        ids += frame.encode(text)
        breaks.append(len(ids))
    if len(ids) < length:
        raise H2OError(f"{name}: {length} tokens of distractors wanted, the data's half holds {len(ids)}; "
                       "use a shorter context")
    return ids[:length], [b for b in breaks if b < length] + [length]


def short_enough(frame: Frame, context: int, instruction: str, texts: list[str], questions: int) -> list[str]:
    """The ``texts`` that may be gold: at most half the room a context leaves, shared by ``questions``
    (a long DROP passage or CoQA story goes to longer contexts; N of them always fit with room to spare)."""
    room = frame.body_length(context, frame.encode(instruction), [], []) // (2 * questions)
    return [t for t in texts if len(frame.encode(t)) <= room]


def ask(frame: Frame, lead: str, question: str, answers, max_new_tokens: int):# tasks.py registers this module's families

    return Asked(frame.encode(f"{lead}Question: {question}"), frame.encode(PREFIX), list(answers), max_new_tokens)


def planted(name: str, frame: Frame, context: int, sample: int, metric: str, rng, instruction: str, asked: list,
            segments: list[str], fill) -> list[LongPrompt]:
    """The prompts of ``asked`` over one context: ``segments`` at random depths in ``fill(length)``
    (``(ids, breaks)`` of the tokens the frame, the questions and the segments leave)."""

    asked = even_questions(frame, asked)
    instruction_ids, segment_ids = frame.encode(instruction), [frame.encode(s) for s in segments]
    planted_tokens = sum(map(len, segment_ids))
    left = frame.body_length(context, instruction_ids, asked[0].question, asked[0].prefix) - planted_tokens
    if left < 32:
        raise H2OError(f"{name}: context {context} is too short for {len(segments)} planted text(s) of {planted_tokens} "
                       "tokens and the question(s)")
    hay, breaks = fill(left)
    body, spans = insert_at_depths(hay, breaks, segment_ids, needle_depths(rng, len(segment_ids)))
    return over_one_context(name, frame, context, sample, metric, instruction_ids, body, spans, asked)


@dataclass(frozen=True)
class Passages(ManyQuestions):
    """Gold texts among the data's other texts, a question on each (``qa_squad``, ``qa_drop``)."""

    data: str  # "squad" | "drop"
    metric: str
    max_new_tokens: int = 16

    def build_many(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int,
                   questions: int) -> list[LongPrompt]:
        rng = sample_rng(seed, name, context, sample)
        items = half(qa_data.squad_questions() if self.data == "squad" else qa_data.drop_questions(), seed)
        by_text: dict[str, list] = {}
        for item in items:
            by_text.setdefault(item.text, []).append(item)
        instruction = f"Answer the question based on the given documents. {FEW_WORDS}\n\nThe following are given documents.\n\n"
        fitting = short_enough(frame, context, instruction, list(by_text), questions)
        if questions > len(fitting):
            raise H2OError(f"{name}: context {context} is too short for {questions} question(s): {len(fitting)} of the "
                           "data's texts are short enough")
        gold = rng.sample(fitting, questions)
        chosen = [rng.choice(by_text[text]) for text in gold]
        lead = f"\n\nAnswer the question based on the given documents. {FEW_WORDS}\n\n"
        asked = [ask(frame, lead, item.question, item.answers, self.max_new_tokens) for item in chosen]
        golden = set(gold)
        others = [document(t) for t in by_text if t not in golden]
        rng.shuffle(others)
        return planted(name, frame, context, sample, self.metric, rng, instruction, asked, [document(t) for t in gold],
                       lambda length: documents(frame, others, length, name))


def document(text: str) -> str:
    return f"Document:\n{text}\n\n"


def story(name: str, text: str) -> str:
    return f"Story {name}:\n{text}\n\n"


@dataclass(frozen=True)
class Conversations(ManyQuestions):
    """One CoQA story among other stories, N turns of its conversation asked (``qa_coqa``)."""

    metric: str = "qa_f1"
    max_new_tokens: int = 16
    history: int = 3  # turns before each question given with it

    def build_many(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int,
                   questions: int) -> list[LongPrompt]:
        rng = sample_rng(seed, name, context, sample)
        stories = half(qa_data.coqa_conversations(), seed, lambda c: c.story)
        instruction = f"Read the following stories, each under its name. I will ask you about one of them. {FEW_WORDS}\n\n"
        fitting = set(short_enough(frame, context, instruction, [c.story for c in stories], 1))
        candidates = [c for c in stories if len(c.turns) >= questions and c.story in fitting]
        if not candidates:
            raise H2OError(f"{name}: no story of the data's half short enough for context {context} has {questions} questions")
        gold = rng.choice(candidates)
        turns = [gold.turns[i] for i in sorted(rng.sample(range(len(gold.turns)), questions))]
        names = variable_names(rng, len(stories))
        lead = f"\n\nAnswer the question about story {names[0]}. {FEW_WORDS}\n\n"
        asked = [ask(frame, lead + self.before(turn), turn.question, turn.answers, self.max_new_tokens) for turn in turns]
        others = [story(n, c.story) for n, c in zip(names[1:], [c for c in stories if c is not gold], strict=True)]
        rng.shuffle(others)
        return planted(name, frame, context, sample, self.metric, rng, instruction, asked, [story(names[0], gold.story)],
                       lambda length: documents(frame, others, length, name))

    def before(self, turn: qa_data.Turn) -> str:
        recent = turn.history[max(0, len(turn.history) - self.history) :] if self.history else ()
        return "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in recent)


FIRST_NAMES = ("Edith", "Tomas", "Marguerite", "Idris", "Helena", "Osric", "Priya", "Anselm", "Lucia", "Bram",
               "Ingrid", "Casimir", "Noor", "Ewan", "Solveig", "Dario")
LAST_NAMES = ("Calloway", "Brandt", "Okafor", "Lindqvist", "Marchetti", "Halloran", "Vasquez", "Thornbury",
              "Achterberg", "Kowalski", "Devereux", "Nakamura", "Pemberton", "Szabo", "Rourke", "Fairweather")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
PLACE_STARTS = ("Ash", "Bel", "Cor", "Dun", "El", "Fal", "Gar", "Hol", "Kel", "Lor", "Mar", "Nor", "Or", "Pen", "Ros", "Tal", "Vel", "Wen")
PLACE_ENDS = ("bury", "dale", "ford", "gate", "haven", "holm", "mere", "moor", "mouth", "ridge", "stead", "wick")
ROLES = ("harbour master", "head librarian", "chief engineer", "town archivist", "school principal", "bridge warden")


@dataclass(frozen=True)
class Fact:
    statements: list[str]  # planted in this order
    question: str
    answers: list[str]


def name_fact(rng, place: str) -> Fact:
    role, person = rng.choice(ROLES), f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    return Fact([f" The {role} of {place} is {person}. "], f"Who is the {role} of {place}?", [person])


def number_fact(rng, place: str) -> Fact:
    meters = str(rng.randint(120, 9899))
    return Fact([f" The old stone bridge at {place} is {meters} meters long. "],
                f"How long is the old stone bridge at {place}, in meters?", [meters, f"{meters} meters"])


def date_fact(rng, place: str) -> Fact:
    date = f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(1700, 1999)}"
    return Fact([f" The first library of {place} opened on {date}. "], f"On what date did the first library of {place} open?", [date])


def phrase_fact(rng, place: str) -> Fact:
    phrase = " ".join(rng.sample(english_words(), 3))
    return Fact([f" The motto carved above the gate of {place} reads: {phrase}. "],
                f"What does the motto carved above the gate of {place} read?", [phrase])


def corrected_fact(rng, place: str) -> Fact:
    first, corrected = distinct(lambda: str(rng.randint(12000, 98999)), 2)
    return Fact([f" The population of {place} was reported as {first} people. ",
                 f" The population of {place} was first reported as {first} people; the corrected figure is {corrected} people. "],
                f"What is the population of {place}?", [corrected, f"{corrected} people"])


FACT_FORMS = (name_fact, number_fact, date_fact, phrase_fact, corrected_fact)


@dataclass(frozen=True)
class Facts(ManyQuestions):
    """N facts of the five forms, in turn from a random one, planted in the run's haystack (``facts``)."""

    metric: str = "qa_f1"
    max_new_tokens: int = 16

    def build_many(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int,
                   questions: int) -> list[LongPrompt]:
        rng = sample_rng(seed, name, context, sample)
        first = rng.randrange(len(FACT_FORMS))
        places = distinct(lambda: rng.choice(PLACE_STARTS) + rng.choice(PLACE_ENDS), questions)
        facts = [FACT_FORMS[(first + i) % len(FACT_FORMS)](rng, place) for i, place in enumerate(places)]
        # shuffled positions, each fact's statements in their own order (the correction after the first report)
        owners = [i for i, fact in enumerate(facts) for _ in fact.statements]
        rng.shuffle(owners)
        pending = [iter(fact.statements) for fact in facts]
        statements = [next(pending[i]) for i in owners]
        lead = f"\n\nAnswer the question based on the text above. {FEW_WORDS}\n\n"
        asked = [ask(frame, lead, f.question, f.answers, self.max_new_tokens) for f in facts]
        instruction = ("Some facts are stated within the following text; where a fact is corrected later in the text, "
                       "the correction holds. Read it carefully: I will ask you about them afterwards.\n")
        return planted(name, frame, context, sample, self.metric, rng, instruction, asked, statements,
                       lambda length: haystack_stretch(rng, haystacks("essay"), length))


QA_TASKS = {
    "qa_squad": Passages("squad", "qa_f1"),
    "qa_drop": Passages("drop", "drop_f1"),
    "qa_coqa": Conversations(),
    "facts": Facts(),
}
