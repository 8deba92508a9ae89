"""The executor boundary: the engine runs the model and changes caches only through plain-data calls,
and replaying those calls on a second executor reproduces every logit (what a tensor-parallel
follower relies on)."""

import pickle

import pytest
import torch

from h2okv.serve.engine import Engine, GenerationRequest
from h2okv.serve.executor import Executor
from h2okv.serve.testing import tiny_chat_model

CHUNK = 16
CALLS = ("open", "prefill", "join", "decode", "keep", "close", "reset")


@pytest.fixture(scope="module")
def model_tok():
    return tiny_chat_model(layers=2, initializer_range=0.3)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


class Recorder(Executor):
    """An executor that logs each state-changing call (pickled: plain data only) and its result."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []
        for name in CALLS:
            setattr(self, name, self._recording(name, getattr(self, name)))

    def _recording(self, name, method):
        def call(*args):
            blob = pickle.dumps(args)  # raises if an argument is not plain data
            result = method(*args)
            self.log.append((name, blob, result))
            return result
        return call


def test_replaying_the_calls_reproduces_every_logit(model_tok):
    model, tok = model_tok
    engine = Engine(model, tok, prefill_chunk=CHUNK, max_batch=8, step_tokens=3 * CHUNK)
    engine.executor = Recorder(model, CHUNK)
    engine.start()
    try:
        cases = [(40, "h2o", 5, 5, 12), (23, "full", None, None, 9), (70, "tova", 6, 6, 15), (9, "h2o", 3, 4, 20),
                 (33, "h2o", 4, 4, 1)]
        handles = [engine.submit(GenerationRequest(prompt(n, i), steps, policy, heavy, recent, temperature=0.0,
                                                   ignore_eos=True)) for i, (n, policy, heavy, recent, steps)
                   in enumerate(cases)]
        victim = engine.submit(GenerationRequest(prompt(50, 9), 500, "h2o", 4, 4, ignore_eos=True))
        assert victim.next_blocking(timeout=30).kind == "text"
        victim.cancel()
        for h in handles + [victim]:
            h.result_blocking()
    finally:
        engine.stop()
    log = engine.executor.log
    assert {name for name, _, _ in log} >= {"open", "prefill", "join", "decode", "keep", "close"}
    follower = Executor(model, CHUNK)
    with torch.inference_mode():
        for name, blob, result in log:
            replayed = getattr(follower, name)(*pickle.loads(blob))
            if name == "decode":
                assert torch.equal(replayed, result)
            elif name == "prefill":
                assert replayed.keys() == result.keys()
                assert all(torch.equal(replayed[k], result[k]) for k in result)
    assert follower.kv_bytes() == engine.executor.kv_bytes() == 0


def test_calls_that_break_the_bookkeeping_are_refused(model_tok):
    model, _ = model_tok
    ex = Executor(model, CHUNK)
    with pytest.raises(ValueError):
        ex.prefill([(7, [1, 2, 3], 0)])  # never opened
    ex.open(7, "h2o", 2, 2, 0)
    with pytest.raises(ValueError):
        ex.open(7, "h2o", 2, 2, 0)
    with pytest.raises(ValueError):
        ex.prefill([(7, [1, 2], 0), (7, [3], 2)])
    with torch.inference_mode():
        ex.prefill([(7, [1, 2, 3, 4, 5], 0)])
        ex.join(7, 6)
        with pytest.raises(ValueError):
            ex.decode("h2o", [8], [1], [5])  # not the batch's rows
        with pytest.raises(ValueError):
            ex.close(7)  # a decode row leaves with keep()
        assert ex.decode("h2o", [7], [1], [5]).shape[0] == 1
        ex.keep("h2o", [], 0)
    assert ex.kv_bytes() == 0 and ex.rows("h2o") == []
