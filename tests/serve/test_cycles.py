"""Nothing the server's requests leave behind waits for Python's cyclic collector: a finished
request's cache and K/V buffers are freed by reference counting at once. (A cache and its layers
used to form a cycle, so every request's KV tensors lived until the next full collection and the
heap grew in between: issue 20's soak.) Tiny random models."""

import copy
import gc
import weakref

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.tools.tiny_chat import tiny_chat_model


@pytest.fixture(scope="module")
def model_tok():
    return tiny_chat_model(layers=2)


@pytest.fixture
def no_collector():
    """The cyclic collector off; what is collectable afterwards is kept in ``gc.garbage``."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        gc.collect()


def cyclic_garbage() -> list:
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    garbage = [o for o in gc.garbage if isinstance(o, (H2OCache, torch.Tensor))]
    gc.set_debug(0)
    gc.garbage.clear()
    return garbage


def test_a_cache_goes_with_its_last_reference(model_tok, no_collector):
    model, _ = model_tok
    cache = H2OCache(model, policy="h2o", heavy=4, recent=4, chunk_size=8)
    model(input_ids=torch.arange(20)[None], **cache_arg(cache), use_cache=True)
    twin = cache.take_rows([0])
    gone = weakref.ref(cache), weakref.ref(twin)
    del cache, twin
    assert [ref() for ref in gone] == [None, None]
    assert cyclic_garbage() == []


def test_copies_belong_to_their_own_cache(model_tok):
    model, _ = model_tok
    cache = H2OCache(model, policy="h2o", heavy=4, recent=4, chunk_size=8)
    model(input_ids=torch.arange(20)[None], **cache_arg(cache), use_cache=True)
    clone = copy.deepcopy(cache)
    assert all(layer.rows is clone.row_budgets for layer in clone.layers)
    assert all(layer.rows is cache.row_budgets for layer in cache.layers)
    twin = cache.take_rows([0])
    assert all(layer.rows is twin.row_budgets for layer in twin.layers)


def test_requests_of_every_outcome_leave_no_cyclic_garbage(model_tok, no_collector):
    model, tok = model_tok
    engine = Engine(model, tok, EngineOptions(prefill_chunk=8, max_batch=8))
    engine.start()
    try:
        kinds = [("h2o", 4, 4), ("local", 0, 8), ("full", None, None), ("sink", 2, 6)]
        handles = [engine.submit(GenerationRequest(prompt_ids=list(range(5 + 7 * i)), max_tokens=6, policy=p,
                                                   heavy=h, recent=r, ignore_eos=True, seed=i))
                   for i, (p, h, r) in enumerate(kinds)]
        for handle in handles:
            assert handle.result_blocking(60)[1].kind == "done"
        # 10**6 tokens: no machine ends these before the cancel or the 0.2 s timeout does (500 and
        # 1,000 could, on a fast one)
        cancelled = engine.submit(GenerationRequest(prompt_ids=list(range(30)), max_tokens=10**6, policy="h2o",
                                                    heavy=4, recent=4, ignore_eos=True))
        cancelled.next_blocking(60)
        cancelled.cancel()
        expired = engine.submit(GenerationRequest(prompt_ids=list(range(30)), max_tokens=10**6, policy="h2o",
                                                  heavy=4, recent=4, ignore_eos=True, timeout=0.2))
        assert {cancelled.result_blocking(60)[1].kind, expired.result_blocking(60)[1].finish_reason} == \
            {"cancelled", "timeout"}
    finally:
        engine.stop()
    del handles, cancelled, expired
    assert cyclic_garbage() == []
