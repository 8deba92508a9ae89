"""A question-aware policy in the server (``snapkv``, the ``bounded`` recipe, or any policy under
``--prefill late``) reads a prompt in one call and is never cut where its cacheable prefix ends: the
document is ranked with the question after it in view, as the library does. Before, a served chat
read the system document first and ranked it without the question: 0/12 hidden numbers under
``bounded`` and under late ``snapkv`` on the 0.5B, where full found 12/12."""

import pytest

from h2okv.serve.engine import Engine, GenerationRequest
from serve_cases import CHUNK, alone, prompt

SNAPKV = "snapkv:window=4,kernel=3,pool=max"


def served(model_tok, request, prefill="chunked", store=0):
    engine = Engine(*model_tok, prefill_chunk=CHUNK, prefill=prefill, prefix_memory=store)
    calls = []
    real = engine.executor.prefill

    def recording(*args):
        calls.append(args)
        return real(*args)

    engine.executor.prefill = recording
    engine.start()
    try:
        _, done = engine.submit(request).result_blocking()
    finally:
        engine.stop()
    return done.token_ids, calls, engine


@pytest.mark.parametrize("store", [0, 64 << 20])
def test_a_chat_document_is_ranked_with_its_question_in_one_call(model_tok, store):
    doc, question = prompt(70, 1), prompt(9, 2)
    request = GenerationRequest(doc + question, 6, SNAPKV, 8, 4, temperature=0.0, ignore_eos=True,
                                cache_prefix=len(doc))
    tokens, calls, engine = served(model_tok, request, store=store)
    # what the library gives reading document and question in one generate call
    assert tokens == alone(model_tok[0], doc + question, SNAPKV, 8, 4, 6)
    assert len(calls) == 1  # one prefill call of the whole prompt, not the document then the question
    if store:  # nothing was saved where the document ends: that state would be the question's alone
        assert all(len(entry.ids) > len(doc + question) - 1 for entry in engine.prefixes)


def test_a_question_agnostic_policy_still_reads_in_chunks_and_cuts_at_the_prefix(model_tok):
    doc, question = prompt(70, 3), prompt(9, 4)
    request = GenerationRequest(doc + question, 4, "h2o", 8, 4, temperature=0.0, ignore_eos=True,
                                cache_prefix=len(doc))
    _, calls, _ = served(model_tok, request)
    assert len(calls) > 2  # chunk by chunk, as before
