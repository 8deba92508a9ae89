"""The prefix store (``serve/prefix.py``; ``Engine(prefix_memory=...)``, ``serve --prefix-cache-memory``):
a finished request's compressed state is kept, and a later prompt that starts with its tokens
resumes from a copy and reads only the rest, with exactly the tokens of a cache that read the two
pieces in two calls; namespaces, LRU under the byte budget, misses."""

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.prefix import Entry, PrefixIndex
from serve_cases import CHUNK, prompt, settle


@pytest.fixture
def engine(model_tok):
    model, tok = model_tok
    eng = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=8, prefix_memory=64 << 20))
    eng.start()
    yield eng
    eng.stop()


def run(engine, ids, policy="h2o", heavy=6, recent=6, steps=10, key=None):
    """One request to its end, and the engine's iteration published (its stats count it)."""
    request = GenerationRequest(ids, steps, policy, heavy, recent, temperature=0.0, ignore_eos=True, cache_key=key)
    _, done = engine.submit(request).result_blocking()
    assert done.kind == "done"
    settle(engine)
    return done.token_ids


def two_calls(model, first, answer_steps, rest, steps, policy, heavy, recent):
    """The library's reference: one cache reads ``first`` and answers it, then reads ``rest``."""
    budget = {} if heavy is None else {"heavy": heavy, "recent": recent}
    cache = H2OCache(model, policy=policy, chunk_size=CHUNK, **budget)
    out = model.generate(torch.tensor([first]), **cache_arg(cache), max_new_tokens=answer_steps,
                         min_new_tokens=answer_steps, do_sample=False, pad_token_id=257)
    ids = torch.cat([out, torch.tensor([rest])], dim=1)
    more = model.generate(ids, **cache_arg(cache), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          pad_token_id=257)
    return out[0, len(first):].tolist(), more[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("policy, heavy, recent", [("h2o", 6, 6), ("tova", 5, 7), ("full", None, None)])
def test_the_next_turn_resumes_and_equals_a_two_call_read(model_tok, engine, policy, heavy, recent):
    model, _ = model_tok
    first, question = prompt(40, 1), prompt(12, 2)
    answer = run(engine, first, policy, heavy, recent, steps=10)
    assert engine.stats.prefix_entries == 1 and engine.stats.prefix_misses == 1
    second = run(engine, first + answer + question, policy, heavy, recent, steps=8)
    assert engine.stats.prefix_hits == 1  # it read 13 tokens, not 62
    want_answer, want_second = two_calls(model, first, 10, question, 8, policy, heavy, recent)
    assert answer == want_answer
    assert second == want_second


def test_no_reuse_across_keys_policies_budgets_or_an_edited_history(engine):
    first = prompt(30, 3)
    answer = run(engine, first, key="alice")
    follow = first + answer + prompt(5, 4)
    run(engine, follow, key="bob")  # another API key
    run(engine, follow, policy="tova", key="alice")  # another policy
    run(engine, follow, heavy=5, key="alice")  # another budget
    edited = list(follow)
    edited[3] = (edited[3] + 1) % 256
    run(engine, edited, key="alice")  # the history changed under the stored state
    assert engine.stats.prefix_hits == 0
    run(engine, follow, key="alice")
    assert engine.stats.prefix_hits == 1


def test_a_fraction_budget_hits_across_turns_and_keeps_the_first_turns_budget(engine):
    """The API resolves a fraction to slots per prompt: turns of one conversation ask alike (the
    same ``budget_label``) with other slot counts, and the resumed turn goes on with the budget its
    state was built with."""
    first = prompt(40, 6)
    one = GenerationRequest(first, 6, "h2o", 4, 4, temperature=0.0, ignore_eos=True, budget_label="0.2")
    _, done = engine.submit(one).result_blocking()
    follow = first + done.token_ids + prompt(20, 7)
    two = GenerationRequest(follow, 6, "h2o", 6, 6, temperature=0.0, ignore_eos=True, budget_label="0.2")
    _, again = engine.submit(two).result_blocking()
    assert again.kind == "done" and engine.executor.saved_bytes() > 0
    settle(engine)
    assert engine.stats.prefix_hits == 1
    other = GenerationRequest(follow, 2, "h2o", 4, 4, temperature=0.0, ignore_eos=True, budget_label="0.3")
    engine.submit(other).result_blocking()
    settle(engine)
    assert (engine.stats.prefix_hits, engine.stats.prefix_misses) == (1, 2)  # asked for another budget: a miss


def test_a_restart_loses_the_store_cleanly(model_tok):
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, prefix_memory=64 << 20))
    engine.start()
    first = prompt(20, 5)
    answer = run(engine, first)
    assert engine.stats.prefix_entries == 1 and engine.executor.saved_bytes() > 0
    engine.stop()
    assert engine.stats.prefix_entries == 0 and engine.executor.saved_bytes() == 0
    engine.start()
    run(engine, first + answer + [7])
    assert engine.stats.prefix_hits == 0
    engine.stop()


def test_lru_under_the_byte_budget():
    index = PrefixIndex(capacity=100)
    ns = ("key", "h2o", 6, 6)
    a, b, c = (Entry(index.reserve(), ns, ids, 40) for ids in ((1, 2), (1, 2, 3), (5,)))
    assert index.add(a) == [] and index.add(b) == []
    assert index.match(ns, [1, 2, 9]) is a  # a used: b is now the least recent
    assert index.add(c) == [b.id]  # 120 > 100 bytes: the least recently used goes
    assert index.match(ns, [1, 2, 3, 4]) is a  # the longest kept prefix wins
    assert index.match(ns, [1, 2]) is None  # a proper prefix only: a token must be left to read
    big = Entry(index.reserve(), ns, (8,), 101)
    assert index.add(big) == [big.id]  # larger than the whole store: not kept
    assert index.bytes == 80 and (index.hits, index.misses) == (2, 1)
    assert index.evicted == 1  # b (big was never kept)


def test_a_shared_document_is_read_once_for_every_conversation(model_tok, engine):
    """Two conversations open with the same long document: the first saves its state at the end of
    its cacheable prefix (the document), the second resumes it and reads only its own question,
    with the tokens of a cache that read the document, then the question."""
    model, _ = model_tok
    doc, qa, qb = prompt(40, 8), prompt(9, 9), prompt(12, 10)
    for question, steps in ((qa, 6), (qb, 8)):
        request = GenerationRequest(doc + question, steps, "h2o", 6, 6, temperature=0.0, ignore_eos=True,
                                    cache_prefix=len(doc))
        _, done = engine.submit(request).result_blocking()
        settle(engine)
    assert (engine.stats.prefix_hits, engine.stats.prefix_misses) == (1, 1)
    assert engine.stats.prefix_entries == 3  # the document (once), and each conversation's end
    cache = H2OCache(model, policy="h2o", heavy=6, recent=6, chunk_size=CHUNK)
    model(input_ids=torch.tensor([doc]), **cache_arg(cache))
    ids = torch.tensor([doc + qb])
    want = model.generate(ids, **cache_arg(cache), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          pad_token_id=257)
    assert done.token_ids == want[0, ids.shape[1]:].tolist()


def test_chat_turns_over_http_resume_the_history(model_tok):
    """Through the OpenAI API: a chat's history before its last user message is its cacheable
    prefix, and the next turn (history + answer + a new question) resumes the saved conversation."""
    import openai

    from h2okv.bench.serve import scrape
    from h2okv.serve import create_app, running_server

    model, tok = model_tok
    app = create_app(model, tok, model_name="tiny", options=EngineOptions(prefill_chunk=CHUNK, prefix_memory=64 << 20))
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        system = {"role": "system", "content": "Read this: " + "lorem ipsum dolor sit amet " * 6}
        history = [system, {"role": "user", "content": "first question?"}]
        first = client.chat.completions.create(model="tiny", messages=history, max_tokens=6, temperature=0)
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "and the second?"}]
        second = client.chat.completions.create(model="tiny", messages=history, max_tokens=6, temperature=0)
        assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens  # OpenAI's field
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        other = [system, {"role": "user", "content": "a question of another conversation"}]
        client.chat.completions.create(model="tiny", messages=other, max_tokens=4, temperature=0)
        settle(app.state.engine)  # the iteration that ended the last answer is published: /metrics counts it
        metrics = scrape(url)
    # turn 2 resumed turn 1's history (its system-message prefix, at least), the other conversation the system message
    assert metrics["h2okv_prefix_cache_hits_total"] == 2
    assert metrics["h2okv_prefix_cache_bytes"] > 0 and metrics["h2okv_prefix_cache_entries"] >= 3
    assert metrics["h2okv_prefix_cache_evictions_total"] == 0  # 64 MiB hold them all


def test_resumed_turns_decoding_in_one_batch_equal_their_two_call_reads(model_tok, engine):
    """Three conversations' next turns arrive together: each resumes its own saved state, they
    decode as rows of one batch, and each answer is its own two-call read."""
    model, _ = model_tok
    firsts = [prompt(30 + 7 * i, 20 + i) for i in range(3)]
    answers = [run(engine, first, "h2o", 5, 5, steps=6) for first in firsts]
    follows = [first + answer + prompt(9 + i, 30 + i) for i, (first, answer) in enumerate(zip(firsts, answers))]
    # queued at once, so the three are admitted together (one by one, a slow submitter could see the
    # first end before the last arrived: no batch of three)
    handles = engine.submit_many([GenerationRequest(ids, 7, "h2o", 5, 5, temperature=0.0, ignore_eos=True)
                                  for ids in follows])
    seconds = [handle.result_blocking()[1].token_ids for handle in handles]
    settle(engine)
    assert engine.stats.prefix_hits == 3 and engine.stats.batch_size_max == 3  # one batch of the three
    for first, follow, second in zip(firsts, follows, seconds, strict=True):
        _, want_second = two_calls(model, first, 6, follow[len(first) + 6:], 7, "h2o", 5, 5)
        assert second == want_second
