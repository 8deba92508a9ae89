"""The prefix store resumes any shared prefix it can (``serve/prefix.py``): a ``full`` state cut
to the prompt's longest shared block prefix, an evicting chunked prefill's block checkpoints; and
what it must never do: cross an API key, policy or budget, or resume a late prefill mid-prompt.
Each resumed answer is checked against a cold read of the same prompt."""

import pytest
import torch

from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.executor import Executor
from h2okv.serve.prefix import Entry, PrefixIndex, block_checkpoints
from serve_cases import CHUNK, prompt, settle

DOC = 300  # a document past CHECKPOINT_MIN (256): an evicting prefill saves a block checkpoint at 256


def start(model_tok, prefill="chunked", **options):
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=8, **options), prefill=prefill)
    engine.start()
    return engine


@pytest.fixture
def store(model_tok):
    engine = start(model_tok, prefix_memory=64 << 20)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def cold(model_tok):
    """An engine without a store: every prompt read from its first token."""
    engine = start(model_tok)
    yield engine
    engine.stop()


def answer(engine, ids, policy="full", heavy=None, recent=None, steps=8, key=None):
    """``(token ids, logprobs, cached prompt tokens)`` of one greedy request, once the engine has
    published the iteration that ended it (its stats count it)."""
    request = GenerationRequest(ids, steps, policy, heavy, recent, temperature=0.0, ignore_eos=True, cache_key=key,
                                top_logprobs=1)
    handle = engine.submit(request)
    logprobs = []
    while True:
        event = handle.next_blocking(timeout=60)
        logprobs += [lp.logprob for lp in event.logprobs or ()]
        if event.final:
            break
    assert event.kind == "done"
    settle(engine)
    return event.token_ids, logprobs, event.usage["prompt_tokens_details"]["cached_tokens"]


def test_a_full_entry_resumes_the_longest_shared_block_prefix():
    index = PrefixIndex(capacity=1000, block=4)
    ns = ("key", "full", (None, None))
    entry = Entry(index.reserve(), ns, tuple(range(12)), 10, truncatable=True)
    assert index.add(entry) == []
    hit = index.lookup(ns, [*range(9), 99, 98], label="full")
    assert (hit.entry, hit.length) == (entry, 8)  # 9 shared tokens: two whole blocks
    assert index.lookup(ns, [*range(3), 99]) is None  # under one block
    assert index.lookup(("other", "full", (None, None)), list(range(20))) is None
    assert index.lookup(ns, list(range(8))).length == 4  # a token is left to read: 7, down to a block
    # an evicting state resumes only whole (it was compressed with no look past its end)
    evicting = PrefixIndex(capacity=1000, block=4)
    kept = Entry(evicting.reserve(), ns, tuple(range(12)), 10)
    evicting.add(kept)
    assert evicting.lookup(ns, [*range(9), 99]) is None
    assert evicting.lookup(ns, [*range(12), 99]).length == 12
    assert (index.hits_by["full"], index.tokens_by["full"]) == (1, 8)


def test_a_longer_full_entry_replaces_its_prefixes_and_resumes_their_lengths():
    index = PrefixIndex(capacity=1000, block=4)
    ns = ("key", "full", (None, None))
    turn = Entry(index.reserve(), ns, tuple(range(6)), 10, truncatable=True)
    index.add(turn)
    longer = Entry(index.reserve(), ns, tuple(range(14)), 20, truncatable=True)
    assert index.add(longer) == [turn.id] and index.bytes == 20
    hit = index.lookup(ns, [*range(6), 99])
    assert (hit.entry.id, hit.length) == (longer.id, 6)  # the replaced turn's length, exactly
    assert index.holds(ns, tuple(range(10)), truncatable=True)  # no copy of a prefix it holds
    assert index.lookup(ns, [*range(10), 99]).length == 10
    assert not index.holds(ns, tuple(range(10)))  # an evicting state of those ids is another state


def test_block_checkpoints():
    assert block_checkpoints(0, 1500, 16) == [256, 512, 1024, 1488]
    assert block_checkpoints(512, 1500, 16) == [1024, 1488]
    assert block_checkpoints(40, 1500, 16) == []  # a read off the block grid: no chunk ends there
    assert block_checkpoints(0, 200, 16) == []  # nothing from CHECKPOINT_MIN on


def test_full_resumes_a_shared_prefix_with_the_logits_of_a_cold_read(model_tok):
    """Executor level: a state saved after one prompt, cut to the block prefix another shares,
    then the rest read, gives bit for bit the logits of a cold read of the other prompt."""
    model, _ = model_tok
    doc = prompt(100, 1)
    first, second = doc + prompt(20, 2), doc + prompt(13, 3)
    ex = Executor(model, CHUNK)

    def read(uid, ids, start=0):
        for lo in range(start, len(ids), CHUNK):
            logits = ex.prefill([(uid, ids[lo:lo + CHUNK], lo)])[uid]
        return logits

    ex.open(0, "full", None, None, 0)
    read(0, first)
    ex.save(7, 0)
    ex.close(0)
    t = len(doc) // CHUNK * CHUNK
    ex.open(1, "full", None, None, 0, None, 7, t)
    resumed = read(1, second, t)
    ex.open(2, "full", None, None, 0)
    assert torch.equal(resumed, read(2, second))
    ex.open(3, "h2o", 6, 6, 0)
    read(3, doc)
    ex.save(8, 3)
    with pytest.raises(ValueError, match="never evicts"):
        ex.open(4, "h2o", 6, 6, 0, None, 8, t)  # a compressed state is no prefix's state: never cut


def test_full_completions_sharing_1500_tokens_report_them_cached_over_http(model_tok):
    """The target: two completions that share a 1,500-token prefix and differ after it; the second
    reports >= 1,000 cached prompt tokens with no cache_prefix given, and /metrics counts the hit
    under its policy."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from h2okv.serve import create_app, running_server

    model, tok = model_tok
    app = create_app(model, tok, model_name="tiny", options=EngineOptions(prefill_chunk=CHUNK, prefix_memory=256 << 20))
    doc = prompt(1500, 4)
    with running_server(app) as url:
        usages = []
        for question in (prompt(30, 5), prompt(25, 6)):
            body = {"model": "tiny", "prompt": doc + question, "max_tokens": 4, "temperature": 0,
                    "h2o": {"policy": "full"}}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            usages.append(reply.json()["usage"])
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 1000  # 1,488: the shared blocks
        settle(app.state.engine)  # the iteration that ended the second answer is published: /metrics counts it
        text = httpx.get(url + "/metrics", timeout=30).text
        samples = {(s.name, s.labels.get("policy")): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("h2okv_prefix_cache_hits_by_policy_total", "full")] == 1
    assert samples[("h2okv_prefix_cache_misses_by_policy_total", "full")] == 1
    assert samples[("h2okv_prefix_cache_cached_tokens_total", "full")] == 1488
    assert samples[("h2okv_prefix_cache_hits_total", None)] == 1  # the unlabelled total stays


def test_full_resumed_answer_equals_a_cold_read(model_tok, store, cold):
    doc = prompt(150, 7)
    answer(store, doc + prompt(20, 8))
    second = doc + prompt(15, 9)
    ids, logprobs, cached = answer(store, second)
    assert cached == 144  # 150 shared tokens: nine blocks of 16
    want_ids, want_logprobs, _ = answer(cold, second)
    assert (ids, logprobs) == (want_ids, want_logprobs)


def test_no_state_crosses_an_api_key_a_policy_or_a_budget(store):
    doc = prompt(DOC, 10)
    answer(store, doc + prompt(20, 11), key="alice")
    answer(store, doc + prompt(20, 12), key="bob")  # another key: a miss, though the blocks match
    answer(store, doc + prompt(20, 13), policy="h2o", heavy=8, recent=8, key="alice")  # another policy
    answer(store, doc + prompt(20, 14), policy="h2o", heavy=6, recent=6, key="alice")  # another budget
    index = store.prefixes
    assert index.hits == 0 and dict(index.misses_by) == {"full": 2, "h2o": 2}
    assert answer(store, doc + prompt(20, 15), key="alice")[2] == DOC // CHUNK * CHUNK
    assert answer(store, doc + prompt(20, 16), policy="h2o", heavy=8, recent=8, key="alice")[2] == 256
    assert dict(index.hits_by) == {"full": 1, "h2o": 1}
    assert dict(index.tokens_by) == {"full": DOC // CHUNK * CHUNK, "h2o": 256}


def test_an_evicting_chunked_prefill_resumes_a_block_checkpoint_as_a_cold_read(store, cold):
    """h2o's state after a chunk depends on no later token: the checkpoint saved at 256 tokens of
    one prompt is what a cold read of another prompt sharing them holds there, and the answer is
    the cold read's."""
    doc = prompt(DOC, 17)
    answer(store, doc + prompt(20, 18), "h2o", 8, 8)
    second = doc + prompt(11, 19)
    ids, logprobs, cached = answer(store, second, "h2o", 8, 8)
    assert cached == 256
    want_ids, want_logprobs, _ = answer(cold, second, "h2o", 8, 8)
    assert ids == want_ids
    assert logprobs == pytest.approx(want_logprobs, abs=1e-6)  # equal here; another slot layout may sum otherwise


def test_a_late_prefill_never_resumes_mid_prompt(model_tok):
    """A late prefill ranks the whole prompt at its end, looking at every token: it has no state
    part-way through a prompt to save. A full cache ranks nothing, so it still resumes blocks."""
    engine = start(model_tok, prefill="late", prefix_memory=64 << 20)
    try:
        doc = prompt(DOC, 20)
        for seed in (21, 22):
            assert answer(engine, doc + prompt(20, seed), "h2o", 8, 8)[2] == 0
        assert engine.prefixes.hits == 0 and len(engine.prefixes) == 2  # the two ends, no checkpoint
        answer(engine, doc + prompt(20, 23))
        assert answer(engine, doc + prompt(20, 24))[2] == DOC // CHUNK * CHUNK
    finally:
        engine.stop()
