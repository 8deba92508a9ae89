"""Policy ``kvzip`` in the server: a prompt ranked by reconstruction is read whole, alone, ranked by
the probe the engine builds with its tokenizer, and then decodes in its policy's batch. Every served
sequence equals the one ``eval longctx`` generates (all but the last prompt token read,
``h2okv.reconstruct``, then ``generate``), its budget is kept, and what cannot run is refused with
a one-line 4xx or CLI error."""

import pytest
import torch

from h2okv import H2OCache, reconstruct
from h2okv.chat import chat_frame, encode_text
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.errors import ErrorKind, ServeError
from h2okv.serve.eviction import EvictionDefaults
from h2okv.serve.executor import Executor
from h2okv.tools.tiny_chat import tiny_chat_model
from serve_cases import CHUNK, alone, prompt


@pytest.fixture(scope="module")
def model_tok():
    return tiny_chat_model(layers=3, initializer_range=0.3, num_attention_heads=4, num_key_value_heads=2)


def chat_prompt(tok, n: int, seed: int) -> list[int]:
    """A chat-template prompt of about ``n`` tokens: the probe repeats it from the template's head on."""
    head, tail = (encode_text(tok, part) for part in chat_frame(tok))
    return head + prompt(n, seed) + tail


def kvzip_alone(model, tok, ids, heavy, recent, steps, start=0, policy="kvzip", chunk_size=2048):
    """Reference: ``eval longctx``'s order (``generate_answers``), one sequence."""
    cache = H2OCache(model, policy=policy, heavy=heavy, recent=recent, prefill="late")
    context = torch.tensor([ids[:-1]])
    with torch.inference_mode():
        model(input_ids=context, **cache_arg(cache), use_cache=True)
        reconstruct(model, cache, context, tok, start=start, chunk_size=chunk_size)
        out = model.generate(torch.tensor([ids]), **cache_arg(cache), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=257)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("schedule", ["budget", "serial"])
def test_served_kvzip_equals_eval_order_beside_other_policies(model_tok, schedule):
    model, tok = model_tok
    head = len(encode_text(tok, chat_frame(tok)[0]))
    cases = [  # (ids, policy, heavy, recent, steps, the probe's start)
        (prompt(60, 1), "kvzip", 8, 4, 12, 0),
        (chat_prompt(tok, 45, 2), "kvzip", 6, 2, 10, head),
        (prompt(35, 3), "h2o", 6, 6, 10, None),
        (prompt(9, 4), "kvzip", 12, 4, 8, 0),  # budget above the prompt: nothing evicted
        (prompt(50, 5), "kvzip", 4, 4, 14, 0),
        # past probe_upto: no probe built or read, the question's attention ranks
        (prompt(56, 6), "kvzip:question=4,probe_upto=30,question_kernel=3", 8, 4, 10, 0),
    ]
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=8, schedule=schedule,
                                                step_tokens=3 * CHUNK))
    engine.start()
    try:
        handles = [engine.submit(GenerationRequest(ids, steps, policy, heavy, recent, temperature=0.0,
                                                   ignore_eos=True))
                   for ids, policy, heavy, recent, steps, _ in cases]
        for (ids, policy, heavy, recent, steps, start), handle in zip(cases, handles, strict=True):
            _, done = handle.result_blocking()
            assert done.kind == "done"
            want = (kvzip_alone(model, tok, ids, heavy, recent, steps, start, policy) if policy.startswith("kvzip")
                    else alone(model, ids, policy, heavy, recent, steps))
            assert done.token_ids == want, (len(ids), policy)
    finally:
        engine.stop()
    assert engine.stats.kv_bytes == 0


@pytest.mark.parametrize("tail", [0, 4])
def test_executor_ranks_then_keeps_the_budget(model_tok, tail):
    """The prompt is read whole, evicted to its budget by the probe, and stays there while decoding;
    with a tail, the tokens read after the ranking are kept on top of it, up to the tail."""
    model, tok = model_tok
    ids, heavy, recent = prompt(48, 7), 6, 3
    executor = Executor(model, CHUNK)
    from h2okv.core.reconstruction import prompt_probes

    policy = f"kvzip:tail={tail}"
    executor.open(0, policy, heavy, recent, 0, probe=prompt_probes(tok, ids).calls)
    with torch.inference_mode():
        logits = executor.prefill([(0, ids, 0)])[0]
        cache = executor._ranked[0]
        for layer in cache.layers:
            assert (layer.valid.sum(-1) <= heavy + recent + 1).all()
        executor.join(0, heavy + recent + tail + 1)
        token = int(logits.argmax())
        for step in range(6):
            out = executor.decode(policy, [0], [token], [len(ids) + step])
            token = int(out[0].argmax())
            for layer in executor._batches[policy].cache.layers:
                # the last prompt token and the steps so far are read after the ranking
                assert (layer.valid.sum(-1) <= heavy + recent + min(tail, step + 2)).all()
    assert token == kvzip_alone(model, tok, ids, heavy, recent, 7, policy=policy)[-1]


def test_served_local_scores_equal_reconstruct_over_several_chunks(model_tok, monkeypatch):
    """``kvzip:local=1`` served: the engine hands the executor each probe call's span, and the
    answers equal ``reconstruct``'s with the same chunks (20 tokens here, so a prompt has several;
    a plain ``kvzip`` beside it, whose answers differ, shows the spans matter)."""
    import functools

    import h2okv.serve.engine as engine_module
    from h2okv.core.reconstruction import prompt_probes

    model, tok = model_tok
    monkeypatch.setattr(engine_module, "prompt_probes", functools.partial(prompt_probes, chunk_size=20))
    head = len(encode_text(tok, chat_frame(tok)[0]))
    cases = [(chat_prompt(tok, 70, 11), head), (prompt(64, 12), 0)]
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=4))
    engine.start()
    try:
        handles = [engine.submit(GenerationRequest(ids, 10, "kvzip:local=1", 8, 4, temperature=0.0, ignore_eos=True))
                   for ids, _ in cases]
        for (ids, start), handle in zip(cases, handles, strict=True):
            _, done = handle.result_blocking()
            assert done.token_ids == kvzip_alone(model, tok, ids, 8, 4, 10, start, "kvzip:local=1", chunk_size=20)
            assert done.token_ids != kvzip_alone(model, tok, ids, 8, 4, 10, start, "kvzip", chunk_size=20)
    finally:
        engine.stop()
    seq = engine._sequence(GenerationRequest(prompt(64, 12), 4, "kvzip:local=1", 8, 4), None)
    assert seq.spans == [(0, 0, 20), (0, 20, 40), (0, 40, 60), (0, 60, 63)] and len(seq.probe) == 4
    assert engine._sequence(GenerationRequest(prompt(64, 12), 4, "kvzip", 8, 4), None).spans is None
    executor = Executor(model, CHUNK)
    with pytest.raises(ValueError, match="one span per probe call"):
        executor.open(1, "kvzip:local=1", 8, 4, 0, [[1, 2, 3]], None, None, False, [(0, 0, 2), (0, 2, 4)])


def test_no_probe_is_built_past_probe_upto(model_tok):
    """The engine builds a request's probe calls only where its policy reads them: the cache holds
    all but the prompt's last token when it is ranked, so a 31-token prompt under ``probe_upto=30``
    is probed and a 32-token one is not; ``reconstruct`` then needs no tokenizer."""
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK))
    policy = "kvzip:question=4,probe_upto=30"
    short = engine._sequence(GenerationRequest(prompt(31, 0), 4, policy, 8, 4), None)
    long = engine._sequence(GenerationRequest(prompt(32, 0), 4, policy, 8, 4), None)
    assert short.probe and long.probe == []
    cache = H2OCache(model, policy=policy, heavy=8, recent=4, prefill="late")
    context = torch.tensor([prompt(32, 0)])
    with torch.inference_mode():
        model(input_ids=context, **cache_arg(cache), use_cache=True)
        reconstruct(model, cache, context, None)
    assert all((layer.valid.sum(-1) <= 8 + 4).all() for layer in cache.layers)
    cache = H2OCache(model, policy=policy, heavy=8, recent=4, prefill="late")
    with torch.inference_mode():
        model(input_ids=context[:, :30], **cache_arg(cache), use_cache=True)
        with pytest.raises(H2OError, match="builds the probe of this 30-token prompt with the tokenizer"):
            reconstruct(model, cache, context[:, :30], None)


def test_reservation_counts_the_whole_prompt(model_tok):
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK))
    res = engine.reservation(GenerationRequest(prompt(200, 0), 10, "kvzip:tail=0", 8, 8))
    assert res.prefill_peak == 200 and res.slots == 17  # read whole; then budget + 1
    # by default what is read after the ranking is kept on top, up to the tail: here the whole request
    assert engine.reservation(GenerationRequest(prompt(200, 0), 10, "kvzip", 8, 8)).slots == 210
    assert engine.reservation(GenerationRequest(prompt(200, 0), 10, "kvzip:tail=5", 8, 8)).slots == 22


def test_kvzip_refusals_are_one_line(model_tok):
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK))
    with pytest.raises(ServeError, match="at least 2 prompt tokens") as err:
        engine.check_request(GenerationRequest([5], 4, "kvzip", 8, 8))
    assert err.value.kind == ErrorKind.INVALID_REQUEST
    rolling = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, positions="rolling"))
    with pytest.raises(ServeError, match="positions=rolling would count"):
        rolling.check_request(GenerationRequest(prompt(20, 0), 4, "kvzip", 8, 8))
    executor = Executor(model, CHUNK)
    with pytest.raises(ValueError, match="probe calls go with"):
        executor.open(1, "kvzip", 8, 8, 0)
    with pytest.raises(ValueError, match="probe calls go with"):
        executor.open(2, "h2o", 8, 8, 0, probe=[[1, 2]])
    executor.open(3, "kvzip", 8, 8, 0, probe=[[1, 2, 3]])
    with pytest.raises(ValueError, match="fed whole"):
        executor.prefill([(3, prompt(20, 0), 5)])
    # the server's defaults resolve a per-request kvzip like any other policy
    assert EvictionDefaults.from_options(policy="h2o", heavy=8, recent=8).resolve(100, policy="kvzip") == ("kvzip", 8, 8)


def test_a_two_token_prompt_is_held_whole_not_a_500(model_tok):
    """Its head is one token, read as a decode step, so nothing waits for the probe: the executor
    then skips the ranking (a fuzzed ``[0, 0]`` got a 500 once ``document`` became the default)."""
    model, tok = model_tok
    executor = Executor(model, CHUNK)
    executor.open(1, "kvzip", 8, 8, 0, probe=[[1, 2, 3]])
    logits = executor.prefill([(1, [0, 0], 0)])[1]
    cache = H2OCache(model, policy="kvzip", heavy=8, recent=8, prefill="late")
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([[0, 0]]), **cache_arg(cache)).logits[0, -1]
    torch.testing.assert_close(logits, expected)


def test_cli_refuses_kvzip_with_rolling_positions(capsys, monkeypatch):
    import h2okv.models
    from h2okv.cli import main

    monkeypatch.setattr(h2okv.models, "load_model", lambda *a, **k: pytest.fail("refused before loading"))
    assert main(["serve", "--policy", "kvzip", "--positions", "rolling"]) == 2
    err = capsys.readouterr().err
    assert "--positions true" in err and err.count("\n") == 1


def kvzip_document(model, tok, ids, cut, heavy, recent, steps, **options):
    """Reference for a prompt whose first ``cut`` tokens are its cacheable prefix (a document): the
    document ranked as a prompt of its own (all but its last token read, ``reconstruct``, the last
    token), then the rest read on the ranked cache in one call, then ``generate``."""
    cache = H2OCache(model, policy="kvzip", heavy=heavy, recent=recent, prefill="late", **options)
    head = torch.tensor([ids[:cut - 1]])
    with torch.inference_mode():
        model(input_ids=head, **cache_arg(cache), use_cache=True)
        reconstruct(model, cache, head, tok, start=0)
        model(input_ids=torch.tensor([ids[cut - 1:cut]]), position_ids=torch.tensor([[cut - 1]]),
              **cache_arg(cache), use_cache=True)
        out = model.generate(torch.tensor([ids]), **cache_arg(cache), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=257)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("options", [{}, {"head_budgets": "layers", "head_floor": 0.0}])
def test_a_cacheable_prefix_is_ranked_before_the_question_and_resumed(model_tok, options):
    """A kvzip request with a cacheable prefix ranks only it (the question is read after, on the
    ranked cache: the ``document`` recipe), with the recipe's head split; the prefix store keeps that
    question-agnostic state, and a second question over the same document resumes it. Both answers
    equal the library's order, store or no store."""
    model, tok = model_tok
    doc, qa, qb = prompt(50, 11), prompt(8, 12), prompt(10, 13)
    wants = [kvzip_document(model, tok, doc + q, len(doc), 6, 2, 7, **options) for q in (qa, qb)]
    for store in (0, 64 << 20):
        engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, prefix_memory=store),
                        cache_options={"kvzip": options} if options else None)
        engine.start()
        try:
            for question, want in zip((qa, qb), wants, strict=True):
                request = GenerationRequest(doc + question, 7, "kvzip", 6, 2, temperature=0.0, ignore_eos=True,
                                            cache_prefix=len(doc))
                _, done = engine.submit(request).result_blocking()
                assert done.token_ids == want, (store, options)
        finally:
            engine.stop()
        if store:  # the first read the document and stored it; the second resumed it
            assert (engine.prefixes.hits, engine.prefixes.misses) == (1, 1)


@pytest.mark.parametrize("policy, evicted", [("kvzip", 60 - 12), ("kvzip:tail=0", 60 + 10 - 1 - 12)])
def test_the_eviction_counter_counts_what_the_tail_keeps_as_kept(model_tok, policy, evicted):
    """A 60-token prompt ranked down to 8 + 4 slots, then 10 tokens: with the tail, the 9 fed after
    the ranking are kept on top, so only the prompt's 48 count as evicted; with tail=0, 57."""
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK))
    engine.start()
    try:
        _, done = engine.submit(GenerationRequest(prompt(60, 8), 10, policy, 8, 4, temperature=0.0,
                                                  ignore_eos=True)).result_blocking()
        assert done.kind == "done"
    finally:
        engine.stop()
    assert engine.stats.evicted_tokens == evicted
