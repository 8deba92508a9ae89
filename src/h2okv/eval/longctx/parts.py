"""The pieces every long-context family builds its prompts with (``tasks.py``'s RULER families and
``qa.py``'s real questions): the per-sample random stream, needles inserted at depths, a haystack
stretch, the question parts evened to one length, and one prompt per question over one context.
A module of its own so both family modules import it and neither imports the other."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from h2okv.errors import H2OError
from h2okv.eval.longctx.prompt import Frame, LongPrompt

DEPTHS = [round(100 * i / 39) / 100 for i in range(40)]  # RULER's 40 needle depths
ANSWER_TOKENS = {"numbers": 12, "words": 16, "uuids": 36}  # generation length per expected value


def sample_rng(seed: int, task: str, context: int, sample: int) -> random.Random:
    return random.Random(f"{seed}/{task}/{context}/{sample}")


def insert_at_depths(hay: list[int], breaks: list[int], segments: list[list[int]], depths: list[float]):
    """``hay`` with each segment inserted at the break nearest its depth (segments in depth order);
    ``(ids, spans)`` with the segments' ``[start, stop)`` in the result."""
    ids, spans, last = [], [], 0
    for segment, depth in sorted(zip(segments, depths, strict=True), key=lambda pair: pair[1]):
        cut = max(last, min(breaks, key=lambda b: abs(b - depth * len(hay))))
        ids += hay[last:cut]
        spans.append((len(ids), len(ids) + len(segment)))
        ids += segment
        last = cut
    return ids + hay[last:], spans


def largest_fitting(low: int, high: int, length_of, budget: int) -> int:
    """The largest ``n`` in [low, high] with ``length_of(n) <= budget`` (``length_of`` increasing)."""
    if length_of(low) > budget:
        raise H2OError(f"a context of {budget} body tokens is too short for this task")
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if length_of(mid) <= budget else (low, mid - 1)
    return low


def padded(frame: Frame, body: list[int], length: int) -> list[int]:
    """``body`` with line breaks after it up to ``length`` tokens (list tasks' last few tokens)."""
    newline = frame.encode("\n")
    return body + (newline * length)[: length - len(body)]


def haystack_stretch(rng, hay, length: int):
    offset = rng.randint(0, min(hay.slack(length), 20000)) if hay.slack(length) else 0
    return hay.take(length, offset)


def join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


@dataclass(frozen=True)
class Asked:
    """One question over a context: its ids, the answer prefix's, what the answer must name."""

    question: list[int]
    prefix: list[int]
    references: list[str]
    max_new_tokens: int


def even_questions(frame: Frame, asked: list[Asked]) -> list[Asked]:
    """``asked`` with line breaks in front of the shorter questions: every question part the same
    length, so each prompt over the shared context is exactly the context's length."""
    longest = max(len(a.question) + len(a.prefix) for a in asked)
    newline = frame.encode("\n")
    return [replace(a, question=(newline * longest)[: longest - len(a.question) - len(a.prefix)] + a.question)
            for a in asked]


def hay_length(frame: Frame, context: int, instruction: list[int], asked: Asked, segments: list[list[int]]) -> int:
    """Haystack tokens left once the frame, the (evened) question and the inserted segments fit."""
    left = frame.body_length(context, instruction, asked.question, asked.prefix) - sum(map(len, segments))
    if left < 32:
        raise H2OError(f"context {context} is too short for {len(segments)} inserted needles or statements")
    return left


def over_one_context(name: str, frame: Frame, context: int, sample: int, metric: str, instruction: list[int],
                     body: list[int], spans, asked: list[Asked]) -> list[LongPrompt]:
    """One prompt per question, all over the same instruction and body."""
    prompts = []
    for index, a in enumerate(asked):
        ids, q = frame.assemble(instruction, body, a.question, a.prefix)
        shift = q - len(body)
        prompts.append(LongPrompt(name, context, sample, ids, q, a.references, metric, a.max_new_tokens,
                                  [(x + shift, y + shift) for x, y in spans], index))
    return prompts


def needle_depths(rng, count: int) -> list[float]:
    # RULER's 40 depths, each used once; more needles than that (many questions) draw freely
    return sorted(rng.sample(DEPTHS, count) if count <= len(DEPTHS) else [rng.random() for _ in range(count)])


class ManyQuestions:
    """A family that plants the items of N questions in one context (``build_many``); its one
    question form is ``build_many``'s with N = 1, so both forms draw the same texts."""

    many_questions = True

    def build(self, name: str, frame: Frame, haystacks, context: int, sample: int, seed: int) -> LongPrompt:
        return self.build_many(name, frame, haystacks, context, sample, seed, 1)[0]
