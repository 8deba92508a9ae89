"""A chat template's frame around one user message, and plain-text encoding (no torch: the CLI's
long-context task list imports it at start)."""

from __future__ import annotations

from h2okv.errors import H2OError

_MARK = "\u2063H2OKV-BODY\u2063"  # a string no chat template contains


def chat_frame(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after one user message (with the assistant's turn)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], add_generation_prompt=True,
                                         tokenize=False)
    head, found, tail = text.partition(_MARK)
    if not found:
        raise H2OError("the chat template changed the message text; run with --no-chat")
    return head, tail


def encode_text(tokenizer, text: str) -> list[int]:
    """``text``'s ids with no special tokens added (none for an empty text)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
