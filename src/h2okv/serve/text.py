"""Incremental detokenisation with stop sequences: which text of a growing generation is safe to send.

Each step decodes only the tail of the generated ids, with the prefix and read offsets of vLLM's and
HF TGI's ``decode_token``: ``ids[prefix_offset:read_offset]`` is the last settled text's ids, kept
as context (a tokenizer may decode a token differently at the start of a text, e.g. SentencePiece
drops a leading space), and the new text is ``decode(ids[prefix_offset:])`` past
``decode(ids[prefix_offset:read_offset])``. Token boundaries do not align with characters (a
byte-level token can end in the middle of a UTF-8 character), so new text that ends in U+FFFD is
not settled until a later token completes it; then the offsets move up and the cost of a step does
not grow with the generation's length. Text that could still become a stop sequence is held back
until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode = decode
        self.stops = stops
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to the context text
        self.read_offset = 0  # the ids before it are settled text
        self.context = ""  # decode(ids[prefix_offset:read_offset])
        self.held = ""  # settled text not sent yet: it could be the start of a stop sequence
        self.sent: list[str] = []  # the pieces handed out
        self.stopped = False

    @property
    def text(self) -> str:
        """The text so far (cut at a stop sequence), less an incomplete character at its end."""
        return "".join(self.sent) + self.held

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token; returns (text safe to send now, whether a stop sequence ended it)."""
        self.ids.append(token_id)
        tail = self._tail()
        # nothing before the held text can start a stop (it was held back otherwise), so held + the
        # new tail is all there is to search; the tail is searched even while it ends in U+FFFD,
        # as a stop may come before an incomplete character in one token
        pending = self.held + tail
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held, self.stopped = "", True
            return self._send(pending[:min(hits)]), True
        if not tail or tail.endswith(REPLACEMENT):
            return "", False  # nothing new, or a character still incomplete: the tail is read again
        self._settle()
        end = len(pending) - self._stop_prefix_len(pending)
        self.held = pending[end:]
        return self._send(pending[:end]), False

    def flush(self) -> str:
        """The rest of the text, at the end of the generation (an incomplete character as U+FFFD)."""
        if self.stopped:
            return ""
        rest = self.held + (self._tail() if self.read_offset < len(self.ids) else "")
        self._settle()
        self.held = ""
        return self._send(rest)

    def _tail(self) -> str:
        """The text of the ids past ``read_offset``, decoded after their context."""
        return self.decode(self.ids[self.prefix_offset:])[len(self.context):]

    def _settle(self) -> None:
        """The ids up to now are settled: the newest of them are the next step's context."""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.context = self.decode(self.ids[self.prefix_offset:self.read_offset])

    def _send(self, piece: str) -> str:
        if piece:
            self.sent.append(piece)
        return piece

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
