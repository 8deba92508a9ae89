"""Incremental detokenisation with stop sequences: which text of a growing generation is safe to send.

Each step decodes only the tail of the generated ids, with the prefix and read offsets of vLLM's and
HF TGI's ``decode_token``: ``ids[prefix_offset:read_offset]`` are settled ids kept as context (a
tokenizer may decode a token differently at the start of a text, e.g. SentencePiece drops a leading
space), and the new text is ``decode(ids[prefix_offset:])`` past the context's text. Token
boundaries do not align with characters (a byte-level token can end in the middle of a UTF-8
character), so new text that ends in U+FFFD is not settled until a later token completes it. The
step's decode is the next context's text too, so a step decodes once; after ``CONTEXT_IDS`` ids the
context starts again at the piece last settled, so the cost of a step does not grow with the
generation's length. Text that could still become a stop sequence is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence
CONTEXT_IDS = 4  # the most ids the context text is decoded from before it starts again (``_settle``)


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode = decode
        self.stops = stops
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to the context text
        self.read_offset = 0  # the ids before it are settled text
        self.context = ""  # decode(ids[prefix_offset:read_offset])
        self.held = ""  # settled text not sent yet: it could be the start of a stop sequence
        self.stopped = False

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one generated token; returns (text safe to send now, whether a stop sequence ended it)."""
        self.ids.append(token_id)
        text = self.decode(self.ids[self.prefix_offset:])
        tail = text[len(self.context):]
        if not self.stops:  # nothing is held back: the tail is sent once its characters are whole
            if not tail or tail.endswith(REPLACEMENT):
                return "", False
            self._settle(text)
            return tail, False
        # nothing before the held text can start a stop (it was held back otherwise), so held + the
        # new tail is all there is to search; the tail is searched even while it ends in U+FFFD,
        # as a stop may come before an incomplete character in one token
        pending = self.held + tail
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held, self.stopped = "", True
            return pending[:min(hits)], True
        if not tail or tail.endswith(REPLACEMENT):
            return "", False  # nothing new, or a character still incomplete: the tail is read again
        self._settle(text)
        end = len(pending) - self._stop_prefix_len(pending)
        self.held = pending[end:]
        return pending[:end], False

    def push_plain(self, token_id: int) -> str:
        """``push`` for a stream without stop strings, which never stops: only the text (the path a
        plain request's handle takes for every token, so written out: ``_settle`` inline)."""
        ids = self.ids
        ids.append(token_id)
        text = self.decode(ids[self.prefix_offset:])
        tail = text[len(self.context):]
        if not tail or tail.endswith(REPLACEMENT):
            return ""
        settled, self.read_offset = self.read_offset, len(ids)
        if self.read_offset - self.prefix_offset <= CONTEXT_IDS:
            self.context = text
        else:
            self.prefix_offset = settled
            self.context = self.decode(ids[settled:])
        return tail

    def flush(self) -> str:
        """The rest of the text, at the end of the generation (an incomplete character as U+FFFD)."""
        if self.stopped:
            return ""
        rest = self.held
        if self.read_offset < len(self.ids):
            text = self.decode(self.ids[self.prefix_offset:])
            rest += text[len(self.context):]
            self._settle(text)
        self.held = ""
        return rest

    def _settle(self, text: str) -> None:
        """The ids up to now are settled; ``text`` is theirs from ``prefix_offset``. It is the next
        step's context, so a step decodes once, until the context holds more than ``CONTEXT_IDS``
        ids: then it starts again at the piece just settled (one more decode, that step)."""
        settled, self.read_offset = self.read_offset, len(self.ids)
        if self.read_offset - self.prefix_offset <= CONTEXT_IDS:
            self.context = text
        else:
            self.prefix_offset = settled
            self.context = self.decode(self.ids[settled:])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best


def plain_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``, for the engine, which decodes
    every row's newest ids every step. Transformers' ``decode`` converts and checks its arguments
    first, several times the cost of decoding a few ids (measured: ~3.7 us a call against ~0.7 us
    for the Rust tokenizer's own), so a tokenizer whose ``decode`` is transformers' own and adds
    nothing to its Rust backend's (no clean-up of spaces) is decoded by that backend; any other
    keeps its ``decode``."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its own decode
        return partial(tokenizer.decode, skip_special_tokens=True)
    cls = type(tokenizer)
    plain = (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
             and cls._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces)
    if plain:
        decode = tokenizer.backend_tokenizer.decode
        # the bound method itself where skip_special_tokens defaults to True: a partial's keyword
        # costs ~0.3 us a call (~0.5 us the decode)
        signature = getattr(type(tokenizer.backend_tokenizer).decode, "__text_signature__", None) or ""
        return decode if "skip_special_tokens=True" in signature else partial(decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True)
