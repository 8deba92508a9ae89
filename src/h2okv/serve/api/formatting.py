"""OpenAI's two logprobs formats, built from the engine's ``TokenLogprob`` entries.

- ``/v1/completions`` (legacy): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
  (one ``{token: logprob}`` dict per position) and ``text_offset`` (character offset of each token
  in the completion);
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.

Token strings are each token decoded alone, so a byte-level token that ends inside a UTF-8
character shows as U+FFFD, as in OpenAI's API (``bytes`` are those of that string).
"""

from __future__ import annotations

from collections.abc import Callable

from h2okv.serve.types import TokenLogprob


class CompletionLogprobs:
    """Builds the legacy format chunk by chunk, keeping the running ``text_offset``."""

    def __init__(self, token_text: Callable[[int], str]):
        self.token_text = token_text
        self.offset = 0

    def format(self, entries: list[TokenLogprob]) -> dict:
        tokens, offsets = [], []
        for entry in entries:
            text = self.token_text(entry.token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [self._top(e) for e in entries],
            "text_offset": offsets,
        }


    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        # keyed by text: tokens that decode alike (partial UTF-8) keep the likeliest one's logprob
        top: dict[str, float] = {}
        for token, logprob in entry.top:
            top.setdefault(self.token_text(token), logprob)
        return top


def chat_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str]) -> dict:
    def item(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def merge_completion_logprobs(parts: list[dict]) -> dict:
    """One legacy logprobs object from the per-event pieces of a non-streamed completion."""
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged
