"""A question-aware policy in the server (``snapkv``, the ``bounded`` recipe, or any policy under
``--prefill late``) ranks a chat's document with the question after it in view, as the library does.
Before, a served chat read the system document first and ranked it without the question: 0/12
hidden numbers under ``bounded`` and under late ``snapkv`` on the 0.5B, where full found 12/12.
Without the prefix store the prompt is read in one call. With it, a policy that ranks a call by its
last queries holds the history whole (``Engine.held_history``): the history is read evicting
nothing and saved whole, then the question ranks all of it; each later turn resumes the history
saved whole, never the state the previous question kept."""


from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from serve_cases import CHUNK, alone, prompt, settle

SNAPKV = "snapkv:window=4,kernel=3,pool=max"


def served(model_tok, request, prefill="chunked", store=0):
    engine = Engine(*model_tok, EngineOptions(prefill_chunk=CHUNK, prefix_memory=store), prefill=prefill)
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


def test_a_chat_document_is_ranked_with_its_question_in_one_call(model_tok):
    doc, question = prompt(70, 1), prompt(9, 2)
    request = GenerationRequest(doc + question, 6, SNAPKV, 8, 4, temperature=0.0, ignore_eos=True,
                                cache_prefix=len(doc))
    tokens, calls, _ = served(model_tok, request)
    # what the library gives reading document and question in one generate call
    assert tokens == alone(model_tok[0], doc + question, SNAPKV, 8, 4, 6)
    assert len(calls) == 1  # one prefill call of the whole prompt, not the document then the question


def test_with_the_store_each_turn_ranks_the_whole_history_it_resumes(model_tok):
    """Turn 1 reads the document evicting nothing, saves it whole, then reads the question: the
    tokens of the library reading the whole prompt in one chunk (every query of the question sees
    the whole document; the question, longer than the window, ranks it with the same queries).
    Turn 2 resumes that document, reads turn 1 and the answer whole, saves that history, and its
    question ranks all of it: again the one-chunk read of its whole prompt. No state a question
    kept is saved."""
    model = model_tok[0]
    doc, first, second = prompt(70, 1), prompt(9, 2), prompt(11, 3)
    engine = Engine(*model_tok, EngineOptions(prefill_chunk=CHUNK, prefix_memory=64 << 20))
    calls = []
    real = engine.executor.prefill
    engine.executor.prefill = lambda parts: calls.append([(len(ids), start) for _, ids, start in parts]) or real(parts)
    engine.start()
    try:
        turn = GenerationRequest(doc + first, 6, SNAPKV, 8, 4, temperature=0.0, ignore_eos=True, cache_prefix=len(doc))
        _, done = engine.submit(turn).result_blocking()
        answer = done.token_ids
        history = doc + first + answer
        turn2 = GenerationRequest(history + second, 6, SNAPKV, 8, 4, temperature=0.0, ignore_eos=True,
                                  cache_prefix=len(history))
        _, done2 = engine.submit(turn2).result_blocking()
        settle(engine)
        saved = sorted(len(entry.ids) for entry in engine.prefixes)
    finally:
        engine.stop()
    assert answer == alone(model, doc + first, SNAPKV, 8, 4, 6, chunk=len(doc + first))
    assert done2.token_ids == alone(model, history + second, SNAPKV, 8, 4, 6, chunk=len(history + second))
    assert calls == [[(70, 0)], [(9, 70)], [(9 + 6, 70)], [(11, 85)]]  # turn 2 read only what turn 1 had not
    assert saved == [70, 85]  # the two histories, whole
    assert (engine.stats.prefix_hits, engine.stats.prefix_misses) == (1, 1)


def test_a_question_agnostic_policy_still_reads_in_chunks_and_cuts_at_the_prefix(model_tok):
    doc, question = prompt(70, 3), prompt(9, 4)
    request = GenerationRequest(doc + question, 4, "h2o", 8, 4, temperature=0.0, ignore_eos=True,
                                cache_prefix=len(doc))
    _, calls, _ = served(model_tok, request)
    assert len(calls) > 2  # chunk by chunk, as before


def test_a_second_conversation_resumes_the_document_held_whole_and_ranks_it_for_its_own_question(model_tok):
    """Two conversations open with the same document: the second resumes the document saved whole
    (the saved history is exactly its own), its budget is set before anything is read, and its
    question ranks the whole document: the library's one-chunk read of its prompt."""
    model = model_tok[0]
    doc, first, other = prompt(70, 1), prompt(9, 2), prompt(12, 4)
    engine = Engine(*model_tok, EngineOptions(prefill_chunk=CHUNK, prefix_memory=64 << 20))
    engine.start()
    try:
        for question in (first, other):
            request = GenerationRequest(doc + question, 6, SNAPKV, 8, 4, temperature=0.0, ignore_eos=True,
                                        cache_prefix=len(doc))
            _, done = engine.submit(request).result_blocking()
        settle(engine)
        hits, cached = engine.stats.prefix_hits, done.usage["prompt_tokens_details"]["cached_tokens"]
    finally:
        engine.stop()
    assert (hits, cached) == (1, 70)
    assert done.token_ids == alone(model, doc + other, SNAPKV, 8, 4, 6, chunk=len(doc + other))
