"""The model's context window (the positions it was trained on, from its config) and the check
that a generation with true positions fits in it. The server (``serve/api/serving.py``) and
``generate`` read the window here; torch-free."""

from __future__ import annotations

from h2okv.vocabulary import SettingError

# where configs keep the window: Llama/Qwen/Gemma, GPT-2 style, and a few others
WINDOW_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def context_window(config) -> int | None:
    """The number of positions the model was trained on, or None when its config names none."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in WINDOW_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_fits(prompt_tokens: int, max_new_tokens: int, window: int | None) -> None:
    """A one-line error unless the prompt and the tokens to generate fit ``window`` (None: no
    limit). Past the window true positions leave the range the model was trained on, and it
    writes garbage: a prompt longer than the window is refused, and so is one that the
    ``max_new_tokens`` would take past it (as the server refuses ``max_tokens``). Rolling
    positions (the ``stream`` recipe) keep every position inside the window: callers with
    them skip this check."""
    if window is None:
        return
    if prompt_tokens >= window:
        raise SettingError("the prompt has {n} tokens and the model's window is {window} positions: shorten it, or "
                           "read past the window with rolling positions ({recipe:stream})", n=prompt_tokens,
                           window=window)
    if prompt_tokens + max_new_tokens > window:
        raise SettingError(f"the prompt's {{n}} tokens and {{max_new_tokens:{max_new_tokens}}} pass the model's window "
                           f"of {{window}} positions: give {{max_new_tokens:{window - prompt_tokens}}} or less, or go past the window "
                           f"with rolling positions ({{recipe:stream}})", n=prompt_tokens, window=window)
