"""RULER's metric, with no dependency beyond the standard library: ``tools/peer/run_kvpress.py``
runs in kvpress's own venv, where h2okv is not installed, and loads this very file by path, so the
two sides of a comparison are scored by one definition.

A sample's score is in [0, 1]; RULER reports the mean over samples x 100.

- ``string_match_all`` (every synthetic task): the share of the reference strings found in the
  prediction, case-insensitively;
- ``string_match_part`` (RULER's QA): 1 when any reference is found;
- ``qa_f1`` (``qa_squad``, ``qa_coqa``, ``facts``): SQuAD's token F1, the best over the gold
  answers, after SQuAD's normalisation (lowercase; punctuation and the articles a, an, the
  removed; whitespace collapsed); CoQA's official score averages leave-one-out maxima over its four
  references, we take the plain maximum as for SQuAD;
- ``drop_f1`` (``qa_drop``): the same F1 after DROP's number normalisation as well (thousands
  commas dropped, "17.0" and "17" one number; hyphens split words); a date is compared as its
  words, so "5 December 1921" and "December 5, 1921" are the same bag (F1 1, EM 0). DROP's alignment of
  several answer spans is left out: a multi-span answer is one bag of its spans' words.

``qa_recall`` (a chat's answer, ``bench/doc_chat.py``): the share of a gold answer's words found in
the answer, the best over the gold answers, after SQuAD's normalisation. A chat model answers in a
sentence ("India has 22 official languages." for "22"): F1 counts the sentence's other words against
it, recall asks whether the gold answer is there.

``qa_exact`` and ``drop_exact`` are the exact matches after the same normalisation (SQuAD's and
DROP's EM). A row's ``score`` is the F1: QA answers are free text, and F1 gives partial credit for
"23" against "23 years" where EM gives none.

The QA metrics grade the answer's first non-empty line only: the prompts ask for a few words, and a
model that goes on with an explanation on the next line is graded on its answer, not on the rest.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str) -> str:
    """RULER's post-processing: strip, and control characters become line breaks."""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    found = clean_prediction(prediction).lower()
    return sum(ref.lower() in found for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    found = clean_prediction(prediction).lower()
    return float(any(ref.lower() in found for ref in references))


def answer_line(prediction: str) -> str:
    """The first non-empty line of the cleaned prediction."""
    return next((line for line in clean_prediction(prediction).split("\n") if line.strip()), "")


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def squad_words(text: str) -> list[str]:
    """SQuAD's normalisation, as words: lowercase, no punctuation, no articles."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def as_number(word: str) -> str | None:
    if not any(c.isdigit() for c in word):  # "nan", "inf" are words
        return None
    try:
        value = float(word)
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def drop_words(text: str) -> list[str]:
    """DROP's normalisation: SQuAD's, but a number is read before punctuation goes ("1,507" and
    "1507.0" are 1507; "54.6" keeps its point), and hyphenated words are split."""
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.lower())
    words = []
    for word in re.split(r"[\s\-\u2013]+", text):
        number = as_number(word.strip(string.punctuation))
        words += [number] if number is not None else squad_words(word)
    return words


def token_f1(predicted: list[str], gold: list[str]) -> float:
    common = sum((Counter(predicted) & Counter(gold)).values())
    if not predicted or not gold:
        return float(predicted == gold)
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def best_f1(words, prediction: str, references: list[str]) -> float:
    answer = words(answer_line(prediction))
    return max(token_f1(answer, words(ref)) for ref in references)


def best_exact(words, prediction: str, references: list[str]) -> float:
    answer = words(answer_line(prediction))
    return float(any(answer == words(ref) for ref in references))


def qa_f1(prediction: str, references: list[str]) -> float:
    return best_f1(squad_words, prediction, references)


def qa_recall(prediction: str, references: list[str]) -> float:
    answer = Counter(squad_words(answer_line(prediction)))
    gold = [squad_words(ref) for ref in references]
    return max(sum((answer & Counter(words)).values()) / len(words) if words else float(not answer) for words in gold)


def qa_exact(prediction: str, references: list[str]) -> float:
    return best_exact(squad_words, prediction, references)


def drop_f1(prediction: str, references: list[str]) -> float:
    return best_f1(drop_words, prediction, references)


def drop_exact(prediction: str, references: list[str]) -> float:
    return best_exact(drop_words, prediction, references)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part, "qa_f1": qa_f1,
           "qa_recall": qa_recall, "qa_exact": qa_exact, "drop_f1": drop_f1, "drop_exact": drop_exact}


def score(metric: str, prediction: str, references: list[str]) -> float:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    if not references:
        raise ValueError("a sample needs at least one reference string")
    return METRICS[metric](prediction, references)
