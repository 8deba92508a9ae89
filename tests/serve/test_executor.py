"""The executor boundary: the engine runs the model and changes caches only through plain-data calls,
and replaying those calls on a second executor reproduces every logit (what a tensor-parallel
follower relies on)."""

import pickle

import pytest
import torch

from h2okv.core.compat import cache_arg
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest
from h2okv.serve.executor import Executor
from h2okv.tools.tiny_chat import tiny_chat_model

CHUNK = 16
CALLS = ("open", "prefill", "join", "join_many", "decode", "keep", "close", "reset")


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
    engine = Engine(model, tok, EngineOptions(prefill_chunk=CHUNK, max_batch=8, step_tokens=3 * CHUNK))
    engine.executor = Recorder(model, CHUNK)
    engine.start()
    try:
        cases = [(40, "h2o", 5, 5, 12), (23, "full", None, None, 9), (70, "tova", 6, 6, 15), (9, "h2o", 3, 4, 20),
                 (33, "h2o", 4, 4, 1), (45, "kvzip", 5, 3, 10), (30, "kvzip", 4, 4, 8)]
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
    assert {name for name, _, _ in log} >= {"open", "prefill", "join_many", "decode", "keep", "close"}
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


def _kept(cache_layer, row):
    """Per KV head: the ordinals kept and their scores, by ordinal (slot order does not matter)."""
    heads = []
    valid, ordinal, score = (cache_layer.read(name) for name in ("valid", "ordinal", "score"))  # either layout
    for h in range(valid.shape[1]):
        live = valid[row, h]
        ordinals = ordinal[row, h][live]
        order = ordinals.argsort()
        heads.append((ordinals[order].tolist(), score[row, h][live][order]))
    return heads


@pytest.mark.parametrize("policy,heavy,recent", [("h2o", 5, 6), ("tova", 4, 7), ("full", None, None),
                                                 ("h2o-sink", 6, 6)])
def test_shared_forward_rows_evolve_as_alone(model_tok, policy, heavy, recent):
    """Prompts of different lengths and budgets, starting at different calls, prefilled in shared
    forwards (left-padded): after every call each row keeps the same tokens with the same scores as
    the prompt prefilled alone, and its last logits match; pads are never live."""
    model, _ = model_tok
    lengths = [70, 23, 52, 9, 40]
    starts = [0, 0, 1, 2, 2]  # the call at which each prompt starts
    budgets = [(heavy, recent) if heavy is None else (heavy + i % 3, recent + i % 2) for i in range(len(lengths))]
    shared = Executor(model, CHUNK)
    alone = {uid: Executor(model, CHUNK) for uid in range(len(lengths))}  # one prompt each
    from h2okv.serve.memory import prefill_chunks
    chunks = {uid: prefill_chunks(n, CHUNK) for uid, n in enumerate(lengths)}
    ids = {uid: prompt(n, uid) for uid, n in enumerate(lengths)}
    for uid, (h, r) in enumerate(budgets):
        shared.open(uid, policy, h, r, 0)
        alone[uid].open(uid, policy, h, r, 0)
    widths, joined = set(), []
    with torch.inference_mode():
        for call in range(12):
            parts = [(uid, ids[uid][a:b], a) for uid in chunks
                     if starts[uid] <= call and call - starts[uid] < len(chunks[uid])
                     for a, b in [chunks[uid][call - starts[uid]]]]
            if not parts:
                break
            widths.add(tuple(len(p[1]) for p in parts))
            got = shared.prefill(parts)
            for uid, chunk_ids, first in parts:
                want = alone[uid].prefill([(uid, chunk_ids, first)])[uid]
                torch.testing.assert_close(got[uid], want, atol=1e-4, rtol=0)
                group = shared._groups[policy]
                row = group.uids.index(uid)
                single = alone[uid]._groups[policy].cache
                for mine, theirs in zip(group.cache.layers, single.layers, strict=True):
                    for (o1, s1), (o2, s2) in zip(_kept(mine, row), _kept(theirs, 0), strict=True):
                        assert o1 == o2, (uid, call)
                        torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-4)
            for uid in [u for u in chunks if call - starts[u] == len(chunks[u]) - 1]:  # finished prompts leave
                shared.join(uid, 200)
                joined.append(uid)
    assert any(len(set(w)) > 1 and len(w) >= 3 for w in widths)  # really shared and really padded
    assert shared.prefilling(policy) == [] and shared.rows(policy) == joined


@pytest.mark.parametrize("policy", ["h2o", "full"])
def test_rows_joined_together_decode_as_rows_joined_one_by_one(model_tok, policy):
    """``join_many`` (the rows of prompts that end in one forward, in any order, beside a prompt that
    goes on) leaves the caches ``join`` one by one leaves: every later logit is the same, and a
    follower's ``keep``, whose uids arrive as new int objects, finds its rows by value."""
    model, _ = model_tok
    lengths = {1000: 16, 1001: 40, 1002: 12, 1003: 16}  # uids past 256: ints that are not cached objects
    ids = {uid: prompt(n, uid) for uid, n in lengths.items()}
    together, one_by_one = Executor(model, CHUNK), Executor(model, CHUNK)
    heavy = {uid: None if policy == "full" else 3 + uid % 3 for uid in lengths}
    order = [1002, 1000, 1003]  # not the group's order; 1001 is part-way through its prompt
    with torch.inference_mode():
        for ex in (together, one_by_one):
            for uid in lengths:
                ex.open(uid, policy, heavy[uid], heavy[uid], 0)
            ex.prefill([(uid, ids[uid][:CHUNK], 0) for uid in lengths])
        together.join_many(order, 60)
        for uid in order:
            one_by_one.join(uid, 60)
        assert together.rows(policy) == one_by_one.rows(policy) == order
        assert together.prefilling(policy) == one_by_one.prefilling(policy) == [1001]
        fed = {uid: ids[uid][-1] for uid in order}
        for step in range(3):
            for ex in (together, one_by_one):
                ex.prefill([(1001, ids[1001][CHUNK + 8 * step:CHUNK + 8 * step + 8], CHUNK + 8 * step)])
            args = (policy, order, [fed[u] for u in order], [lengths[u] + step for u in order])
            logits = together.decode(*args)
            assert torch.equal(logits, one_by_one.decode(*args))
            fed = dict(zip(order, logits.argmax(-1).tolist(), strict=True))
        kept = [int(str(uid)) for uid in (1002, 1003)]  # as a tensor-parallel follower unpickles them
        for ex in (together, one_by_one):
            ex.keep(policy, kept, 60)
        args = (policy, kept, [fed[u] for u in kept], [lengths[u] + 3 for u in kept])
        assert torch.equal(together.decode(*args), one_by_one.decode(*args))
        assert together.kv_bytes() == one_by_one.kv_bytes()
        for bad in ([1001, 1001], [7]):  # twice, never opened
            with pytest.raises(ValueError, match="not distinct open"):
                together.join_many(bad, 60)
    assert together.rows(policy) == kept and together.prefilling(policy) == [1001]


def test_a_group_row_must_take_part_in_each_call(model_tok):
    model, _ = model_tok
    ex = Executor(model, CHUNK)
    for uid in (1, 2):
        ex.open(uid, "h2o", 3, 3, 0)
    with torch.inference_mode():
        ex.prefill([(1, prompt(16, 1), 0), (2, prompt(16, 2), 0)])
        with pytest.raises(ValueError, match="must take part"):
            ex.prefill([(1, prompt(8, 3), 16)])
        before = ex.kv_bytes()
        ex.close(2)  # a prompt part-way through leaves: its row is freed
        assert ex.prefilling("h2o") == [1] and ex.kv_bytes() < before
        ex.prefill([(1, prompt(8, 3), 16)])
        ex.close(1)
    assert ex.kv_bytes() == 0


def test_core_row_operations_for_groups(model_tok):
    """take_rows copies (the source is unchanged and independent), add_rows gives empty rows their own
    budgets, trim cuts free tail slots without moving a live one."""
    from h2okv import H2OCache

    model, _ = model_tok
    cache = H2OCache(model, policy="h2o", heavy=3, recent=3, chunk_size=CHUNK)
    cache.add_rows([(3, 3), (2, 5)])  # a fresh cache: fixes the rows of its first call
    with torch.inference_mode():
        model(torch.tensor([prompt(20, 1), prompt(20, 2)]), **cache_arg(cache))
        assert cache.budget() == [6, 7]
        keys = [layer.read("keys").clone() for layer in cache.layers]  # rows of uneven budgets: held flat
        twin = cache.take_rows([1])
        assert twin.budget() == [7] and cache.budget() == [6, 7]
        for layer, mine, before in zip(twin.layers, cache.layers, keys, strict=True):
            assert torch.equal(layer.keys[0], before[1])
            layer.keys.zero_()
            assert torch.equal(mine.read("keys"), before)  # the source kept its own tensors
        cache.add_rows([(4, 4)])
        assert cache.budget() == [6, 7, 8] and all(int(layer.valid[2].sum()) == 0 for layer in cache.layers)
        layer = cache.layers[0]
        layer.resize(layer.capacity + 10)  # free slots at the tail
        live = [layer.ordinal[layer.valid].tolist() for layer in cache.layers]
        where = [layer.valid.nonzero().tolist() for layer in cache.layers]
        cache.trim()
        assert [layer.ordinal[layer.valid].tolist() for layer in cache.layers] == live
        assert [layer.valid.nonzero().tolist() for layer in cache.layers] == where  # nothing moved
        assert all(bool(layer.valid[..., -1].any()) for layer in cache.layers)  # the tail is cut to the last live
