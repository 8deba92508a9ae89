"""A document and its questions as text or chat messages: the token ids ``read_context`` and
``ask`` read, and the checks of their arguments.

With a chat template the document is a conversation: text is one user message, or give the
messages yourself (the document as a system message, or as the first user message). The context
is the template's rendering of those messages, closed; a question is the rest of the whole
conversation's rendering (its user turn, closed, and the assistant turn's opening), so context +
question is exactly ``apply_chat_template(messages + [question], add_generation_prompt=True)``:
the model reads what it reads in a chat. Without a template, text is tokenized as it is, and token
ids are read as they are in every case (a question over ids is text as it is, or ids).
"""

from __future__ import annotations

import warnings

import torch

from h2okv.chat import encode_text, history_length
from h2okv.errors import H2OError

# text alone is one user message: every template takes one (some have no system role), and on the
# guide's document SmolLM2-135M under the document recipe at 0.2 named the reading room's colour
# from a user message and not from a system message
DOCUMENT_ROLE = "user"
READ_USAGE = "read_context(model, tokenizer, cache, context)"
ASK_USAGE = "ask(model, tokenizer, cache, context, questions)"


class Document:
    """A context as the ``[rows, tokens]`` ids to read, and how a question over it is tokenized."""

    def __init__(self, tokenizer, context, caller: str):
        self.tokenizer = tokenizer
        self.messages = None  # the conversation questions continue (None: questions as they are)
        if isinstance(context, str) or is_messages(context):
            if tokenizer is None:
                raise H2OError(f"{caller} needs the tokenizer to read a context given as text or chat messages")
            self.ids = torch.tensor([self.encode(context, caller)])
        else:
            self.ids = token_ids(context, caller)
        if self.ids.shape[1] < 1:
            raise H2OError(f"{caller}: the context has no tokens")

    def encode(self, context, caller: str) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            if not isinstance(context, str):
                raise H2OError(f"{caller}: chat messages need a tokenizer with a chat template; give the context as text")
            return encode_text(self.tokenizer, context)
        self.messages = [{"role": DOCUMENT_ROLE, "content": context}] if isinstance(context, str) else list(context)
        return render(self.tokenizer, self.messages)

    def question(self, question, caller: str) -> list[int]:
        """A question's ids: token ids as they are; text through the chat template (the rest of the
        conversation after the context), or as it is when the context was token ids or plain text."""
        if not isinstance(question, str):
            if not isinstance(question, (list, tuple, torch.Tensor)) or not all(is_int(t) for t in question):
                raise H2OError(f"{caller}: each question must be text or a list of token ids, "
                               f"got {type_name(question)}")
            return [int(t) for t in question]
        if self.messages is None:
            return encode_text(self.tokenizer, question)
        messages = self.messages + [{"role": "user", "content": question}]
        whole = render(self.tokenizer, messages, generation=True)
        context = self.ids[0].tolist()
        if history_length(self.tokenizer, messages, whole) != len(context):
            raise H2OError(f"{caller}: the chat template renders the context otherwise once a question follows; "
                           f"give the context and the questions as token ids")
        return whole[len(context):]


def render(tokenizer, messages: list[dict], generation: bool = False) -> list[int]:
    """``messages``' ids through the chat template (a template that refuses them: a one-line error)."""
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, return_dict=True)
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and the template's own raise_exception
        raise H2OError(f"the chat template refused the messages: {exc}") from None
    return list(out["input_ids"])


def token_ids(context, caller: str) -> torch.Tensor:
    """``context`` as ``[rows, tokens]`` ids (a tensor, a list of ids or a list of rows of ids)."""
    if not isinstance(context, (torch.Tensor, list, tuple)):
        raise H2OError(f"{caller}: context must be text, chat messages or token ids, got {type_name(context)}")
    try:
        ids = torch.as_tensor(context, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError):
        raise H2OError(f"{caller}: context must be text, chat messages or token ids (rows of one length), "
                       f"got a {type_name(context)} of other things") from None
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if ids.dim() != 2:
        raise H2OError(f"{caller} needs token ids of shape [rows, tokens], got {tuple(ids.shape)}")
    return ids


def is_messages(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) for m in value)


def is_int(value) -> bool:
    return isinstance(value, int) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def is_cache(value) -> bool:
    from transformers import Cache

    return isinstance(value, Cache)


def type_name(value) -> str:
    return type(value).__name__


def check_arguments(caller: str, tokenizer, cache, usage: str) -> None:
    """The tokenizer and the cache in their places, each of its kind: a one-line error naming the
    argument otherwise (``usage`` is the call's shape, e.g. ``ask(model, tokenizer, cache, ...)``)."""
    if is_cache(tokenizer) and not is_cache(cache) and cache is not None:
        raise H2OError(f"{caller}: the tokenizer and the cache are swapped: {usage}")
    if is_cache(tokenizer):
        raise H2OError(f"{caller}: tokenizer must be a tokenizer, got {type_name(tokenizer)}: {usage}")
    if not hasattr(cache, "policy") or not hasattr(cache, "take_rows"):
        raise H2OError(f"{caller}: cache must be an H2OCache, got {type_name(cache)}: {usage}")


def read_arguments(tokenizer, cache, context) -> tuple:
    """``read_context``'s ``(tokenizer, cache, Document)``. The order before was ``(model, cache,
    context, tokenizer)``: a cache where the tokenizer goes and a context where the cache goes is
    that order, read with a DeprecationWarning for one release."""
    if is_cache(tokenizer) and isinstance(cache, (str, list, tuple, torch.Tensor)):
        warnings.warn(f"read_context(model, cache, context, tokenizer) is deprecated: call {READ_USAGE}, "
                      f"the order ask takes", DeprecationWarning, stacklevel=3)
        tokenizer, cache, context = context, tokenizer, cache
    check_arguments("read_context", tokenizer, cache, READ_USAGE)
    if context is None:
        raise H2OError(f"read_context needs the context: {READ_USAGE}")
    return tokenizer, cache, Document(tokenizer, context, "read_context")
