"""A document and its questions as text or chat messages (``h2okv.documents``): context + question
is the chat template's own rendering of the whole conversation, ``read_context`` and ``ask`` take
one argument order, and a wrong argument is a one-line error that names it."""

import warnings

import pytest
import torch
from transformers import DynamicCache

from h2okv import H2OCache, H2OError, ask, read_context
from h2okv.documents import Document
from h2okv.questions import ask_ids
from h2okv.tools.tiny import random_ids, tiny_model, word_tokenizer
from h2okv.tools.tiny_chat import tiny_chat_model

DOCUMENT = "The mill has three apple trees and a pond. The bench by the pond was painted blue in 1998."
QUESTIONS = ["How many apple trees are there?", "What colour is the bench?", "When?"]


def whole(tok, messages, question) -> list[int]:
    """The chat template's own ids for the conversation with ``question`` last, the assistant's turn open."""
    conversation = messages + [{"role": "user", "content": question}]
    return list(tok.apply_chat_template(conversation, add_generation_prompt=True, return_dict=True)["input_ids"])


def check_split(tok, context, messages):
    document = Document(tok, context, "test")
    assert document.ids.shape[0] == 1
    for question in QUESTIONS:
        assert document.ids[0].tolist() + document.question(question, "test") == whole(tok, messages, question)
    return document


def test_context_and_question_are_the_templates_whole_conversation():
    _, tok = tiny_chat_model()
    document = check_split(tok, DOCUMENT, [{"role": "user", "content": DOCUMENT}])  # text: one user message
    assert tok.decode(document.ids[0]).endswith(DOCUMENT + "<|im_end|>\n")  # the document's turn, closed
    system = [{"role": "system", "content": DOCUMENT}]
    check_split(tok, system, system)
    history = system + [{"role": "user", "content": "Read it."}, {"role": "assistant", "content": "Done."}]
    check_split(tok, history, history)


@pytest.mark.integration
def test_the_split_on_the_default_models_template(default_model):
    """SmolLM2's template adds its own system turn when none is given: it stays in the context."""
    tok = default_model[1]
    document = check_split(tok, DOCUMENT, [{"role": "user", "content": DOCUMENT}])
    assert tok.decode(document.ids[0]).startswith("<|im_start|>system\n")
    system = [{"role": "system", "content": DOCUMENT}]
    check_split(tok, system, system)


def test_text_reads_and_answers_as_the_template_ids_do():
    model, tok = tiny_chat_model(layers=1)
    messages = [{"role": "system", "content": DOCUMENT}]
    ids = Document(tok, messages, "test").ids
    settings = dict(recipe="document", budget=0.5, budget_floor=0)  # kvzip: ranked with the tokenizer
    by_text, by_ids = H2OCache(model, **settings), H2OCache(model, **settings)
    read_context(model, tok, by_text, messages)
    read_context(model, tok, by_ids, ids)
    assert by_text.stats() == by_ids.stats() and by_text.get_seq_length() == ids.shape[1]
    answers = ask_ids(model, tok, by_text, messages, QUESTIONS, max_new_tokens=4)
    questions = [whole(tok, messages, q)[ids.shape[1]:] for q in QUESTIONS]
    assert answers == ask_ids(model, tok, by_ids, ids, questions, max_new_tokens=4)


def test_plain_text_without_a_template_is_tokenized_as_it_is():
    model, tok = tiny_model("llama"), word_tokenizer()
    text = "w5 w6 w7 w8 w9 w10 w11 w12"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cache = H2OCache(model, budget=16)
    read_context(model, tok, cache, text)
    assert cache.get_seq_length() == len(ids)
    assert ask_ids(model, tok, cache, text, ["w20 w21"], max_new_tokens=3) == \
        ask_ids(model, tok, cache, ids, [[20, 21]], max_new_tokens=3)
    with pytest.raises(H2OError, match="chat messages need a tokenizer with a chat template"):
        read_context(model, tok, H2OCache(model, budget=16), [{"role": "user", "content": text}])


def test_the_old_read_context_order_still_reads_with_a_deprecation_warning():
    model, tok = tiny_model("llama"), word_tokenizer()
    context = random_ids(40, seed=2)
    settings = dict(recipe="document", budget=0.5, budget_floor=0)
    new, old = H2OCache(model, **settings), H2OCache(model, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new order is not deprecated
        read_context(model, tok, new, context)
    with pytest.warns(DeprecationWarning, match=r"read_context\(model, tokenizer, cache, context\)"):
        read_context(model, old, context, tok)
    assert old.stats() == new.stats()
    with pytest.warns(DeprecationWarning):  # no tokenizer: a policy that needs none
        read_context(model, H2OCache(model, budget=16), context)


def test_wrong_arguments_are_one_line_errors_that_name_them():
    model, tok = tiny_model("llama"), word_tokenizer()
    context = random_ids(20, seed=4)
    cache = H2OCache(model, budget=16)
    cases = [
        (lambda: read_context(model, tok, cache, 7), "context must be text, chat messages or token ids, got int"),
        (lambda: read_context(model, tok, cache, [[1, 2], [3]]), "context must be text, chat messages or token ids"),
        (lambda: read_context(model, cache, tok, context), "the tokenizer and the cache are swapped"),
        (lambda: read_context(model, tok, DynamicCache(), context), "cache must be an H2OCache, got DynamicCache"),
        (lambda: read_context(model, tok, cache), "read_context needs the context"),
        (lambda: read_context(model, None, cache, "w5 w6"), "needs the tokenizer to read a context given as text"),
        (lambda: ask(model, cache, tok, context, ["w5"]), "the tokenizer and the cache are swapped"),
        (lambda: ask(model, None, cache, context, ["w5"]), "ask needs the tokenizer"),
        (lambda: ask(model, tok, cache, 3.5, ["w5"]), "context must be text, chat messages or token ids, got float"),
        (lambda: ask(model, tok, cache, context, ["w5"]), "read_context first"),
    ]
    for call, message in cases:
        with pytest.raises(H2OError, match=message.replace("(", r"\(")) as err:
            call()
        assert "\n" not in str(err.value)
    read_context(model, tok, cache, context)
    for questions, message in (("w5", "list of questions .*got str"), ([], "got an empty list"),
                               ([5], "each question must be text or a list of token ids, got int"),
                               ([torch.tensor([5, 6]), "w7"], None)):
        if message is None:
            assert len(ask(model, tok, cache, context, questions, max_new_tokens=2)) == 2
            continue
        with pytest.raises(H2OError, match=message):
            ask(model, tok, cache, context, questions)
