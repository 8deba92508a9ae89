"""One context, many questions: read a context once, compressed, and answer each question from
its own copy of that state, the copies decoding as rows of one batch.

    cache = H2OCache(model, recipe="document", budget=0.2)         # compressed before any question
    read_context(model, tokenizer, cache, document)                 # read once (and ranked, for kvzip)
    answers = ask(model, tokenizer, cache, document, ["Who ...?", "When ...?"])

The context is text or chat messages (through the tokenizer's chat template, each question then
its own user turn: ``h2okv.documents``) or token ids, the same in both calls. Each answer is the one
a fresh cache gives reading the context and then that question in two calls (``read_context``,
then ``generate`` on context + question): every copy is the context's state
(``H2OCache.take_rows``), and the questions' padding sits between the context and each question,
where the cache treats it as no token at all (its rows keep their real tokens first) and the
positions skip it. ``cache`` itself is left as it was: ask again, with other questions.

``ask`` does not read the context itself: reading is the costly step (for ``kvzip`` a second
prefill), done once, on purpose, and a fresh cache is an error that names ``read_context``.
"""

from __future__ import annotations

import torch

from h2okv.core.compat import cache_arg
from h2okv.documents import ASK_USAGE, Document, check_arguments, type_name
from h2okv.errors import H2OError


def ask(model, tokenizer, cache, context, questions, max_new_tokens: int = 64, **generate_kwargs) -> list[str]:
    """Greedy answers to ``questions`` (a list of texts or of token-id lists) over the ``context``
    ``cache`` has read (``read_context(model, tokenizer, cache, context)``: the same text, chat
    messages or token ids). Over text or messages with a chat template each text question is a user
    turn; over token ids or without a template it is tokenized as it is. ``generate_kwargs`` go to
    ``model.generate``."""
    return [tokenizer.decode(ids, skip_special_tokens=True)
            for ids in ask_ids(model, tokenizer, cache, context, questions, max_new_tokens, **generate_kwargs)]


def ask_ids(model, tokenizer, cache, context, questions, max_new_tokens: int = 64, **generate_kwargs) -> list[list[int]]:
    """``ask``'s answers as token ids (up to the end-of-sequence token, which is kept)."""
    if tokenizer is None:
        raise H2OError(f"ask needs the tokenizer (it pads the questions and ends the answers): {ASK_USAGE}")
    check_arguments("ask", tokenizer, cache, ASK_USAGE)
    ids, mask = question_batch(tokenizer, cache, Document(tokenizer, context, "ask"), questions)
    copies = cache.take_rows([0] * ids.shape[0])  # the context's state, once per question
    settings = {"do_sample": False, "pad_token_id": pad_id(tokenizer), **generate_kwargs}
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=max_new_tokens, **cache_arg(copies), **settings)
    eos = settings.get("eos_token_id", model.generation_config.eos_token_id)
    eos = tokenizer.eos_token_id if eos is None else eos
    return [trim(row, eos) for row in out[:, ids.shape[1]:].tolist()]


def question_batch(tokenizer, cache, document: Document, questions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[Q, n + longest]``: the context, padding, each question."""
    context = document.ids
    if context.shape[0] != 1 or cache.rows != 1 or cache.get_seq_length() != context.shape[1]:
        raise H2OError(f"ask needs a cache of one row that has read the context's {context.shape[1]} tokens; "
                       f"it holds {cache.rows} row(s) of {cache.get_seq_length()} tokens (read_context first)")
    if not isinstance(questions, (list, tuple)) or not questions:
        got = f"an empty {type_name(questions)}" if isinstance(questions, (list, tuple)) else type_name(questions)
        raise H2OError(f"ask takes a non-empty list of questions (texts or token-id lists), got {got}")
    parts = [document.question(q, "ask") for q in questions]
    if not all(parts):
        raise H2OError("every question needs at least one token")
    longest = max(len(p) for p in parts)
    pad = pad_id(tokenizer)
    ids = [context[0].tolist() + [pad] * (longest - len(p)) + p for p in parts]
    mask = [[1] * context.shape[1] + [0] * (longest - len(p)) + [1] * len(p) for p in parts]
    return torch.tensor(ids), torch.tensor(mask)


def pad_id(tokenizer) -> int:
    """The id padding takes (masked where it sits): the tokenizer's pad, else its end of sequence, else 0."""
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    return 0


def trim(row: list[int], eos) -> list[int]:
    """A generated row up to and including its end-of-sequence token (the rest is padding)."""
    ends = eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    for i, token in enumerate(row):
        if token in ends:
            return row[:i + 1]
    return row
