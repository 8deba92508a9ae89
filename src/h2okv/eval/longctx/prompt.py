"""A long-context prompt as token ids of an exact length, and the frame around a task's body.

Every prompt is ``[chat head] instruction body question [chat tail] answer-prefix`` as RULER lays
it out (the answer prefix after the assistant's turn starts, so the model answers at once). The
parts are tokenised one by one and concatenated, so lengths add up and a task can size its body to
make the whole prompt exactly ``context`` tokens. ``ids[:question]`` is what a question-agnostic
run reads and compresses before it sees the question (instruction and body).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h2okv.chat import chat_frame, encode_text
from h2okv.errors import H2OError


@dataclass
class LongPrompt:
    task: str
    context: int
    sample: int
    ids: list[int]
    question: int  # ids[:question] is the context part, ids[question:] the question part
    references: list[str]
    metric: str
    max_new_tokens: int
    evidence: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) of inserted needles
    index: int = 0  # which question over this context (several per context: build_question_sets)


class Frame:
    """Encodes text and knows the chat template's head and tail ids (empty without a template)."""

    def __init__(self, tokenizer, chat: bool = True):
        self.tokenizer = tokenizer
        self.chat = bool(chat and getattr(tokenizer, "chat_template", None))
        head, tail = chat_frame(tokenizer) if self.chat else ("", "")
        self.head, self.tail = self.encode(head), self.encode(tail)

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def body_length(self, context: int, instruction: list[int], question: list[int], prefix: list[int]) -> int:
        """Tokens left for the body; a one-line error when the frame alone does not fit."""
        fixed = len(self.head) + len(instruction) + len(question) + len(self.tail) + len(prefix)
        if context - fixed < 32:
            raise H2OError(f"context {context} is too short: the prompt's fixed parts alone take {fixed} tokens")
        return context - fixed

    def assemble(self, instruction: list[int], body: list[int], question: list[int], prefix: list[int]):
        """``(ids, question_start)``."""
        context_part = self.head + instruction + body
        return context_part + question + self.tail + prefix, len(context_part)
