"""Incremental detokenisation with stop sequences: which text of a growing generation is safe to send.

Text is re-decoded from all generated ids each step (token boundaries do not align with characters:
a byte-level token can end in the middle of a UTF-8 character), and text that could still become a
stop sequence is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode = decode
        self.stops = stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already handed out
        self.text = ""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token; returns (text safe to send now, whether a stop sequence ended it)."""
        self.ids.append(token_id)
        self.text = self.decode(self.ids)
        if self.stops:
            # only the tail since what was sent (plus a stop's length) can hold a new match
            start = max(0, self.sent - max(len(s) for s in self.stops))
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                end = min(hits)
                self.text = self.text[:end]
                return self._take(end), True
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == REPLACEMENT:
            end -= 1
        end -= self._stop_prefix_len(self.text[:end])
        return self._take(end), False

    def flush(self) -> str:
        """The rest of the text, at the end of the generation."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        piece = self.text[self.sent:end]
        self.sent = end
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
