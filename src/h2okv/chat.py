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


def history_length(tokenizer, messages: list[dict], prompt_ids: list[int]) -> int | None:
    """How many of ``prompt_ids`` (``messages`` through the chat template) are the conversation's
    history: every message before the last user message, as the template renders them alone. None
    when there is none, or the prompt does not start with exactly those tokens (a template that
    renders earlier turns otherwise once a later one follows, or wants a user turn last)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
    if last_user == 0:
        return None
    try:
        ids = list(tokenizer.apply_chat_template(messages[:last_user], return_dict=True)["input_ids"])
    except Exception:  # noqa: BLE001 - a template that refuses the history: no prefix point
        return None
    return len(ids) if 0 < len(ids) < len(prompt_ids) and list(prompt_ids[:len(ids)]) == ids else None
