"""``rkv`` (``policies/rkv.py``): R-KV's redundancy-aware key, ``weight * I - (1 - weight) * R``.

Its hook against the rule written out in plain Python; every path of the cache (the general step,
the per-token scan, the decode step, late prefill, head-adaptive shares) against the loop
(``core/reference.py``); what the rule is for (of two equal keys one goes before a distinct key of
the same importance); its option and where it is listed. The guarantees every policy keeps in a
real model (budget, exactness, batch == batch-of-one, GQA) are in tests/core/test_cache_in_models.py.
"""

import argparse
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core_cases import MODEL, PATH_CASES, leaning_qkv, random_qkv, run_calls, spy_on_path
from h2okv import H2OCache, H2OError
from h2okv.cli.args import add_budget_args
from h2okv.core import kernels
from h2okv.core.native.build import library
from h2okv.core.native.rules import c_decode_rule, native_rule
from h2okv.core.reference import reference
from h2okv.core.step import eviction_rank
from h2okv.policies import make_policy

SPECS = ["rkv", "rkv:weight=0.5", "rkv:heads=shared", "rkv:kernel=3", "rkv:copies=0.5"]


# -- the hook, against its rule ---------------------------------------------------------------------
def rule(score, keys, valid, weight, copies=0.0, ordinal=None):
    """The key of one (row, head)'s live slots, in plain Python: ``{slot: key}``. With ``copies``,
    each live key ``i`` finds its latest copy (the other live key of the largest ordinal whose
    cosine to it is above ``copies``), and that copy's sum leaves out ``cos(i, copy)``."""
    live = [i for i, ok in enumerate(valid) if ok]

    def cos(a, b):
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
        return dot / (na * nb)

    total = sum(score[i] for i in live)
    spared = set()  # (i, j): j is i's latest copy
    if copies > 0:
        for i in live:
            alike = [j for j in live if j != i and cos(keys[i], keys[j]) > copies]
            if alike:
                spared.add((i, max(alike, key=lambda j: ordinal[j])))
    r = {}
    for i in live:
        others = [0.0 if (j, i) in spared else cos(keys[i], keys[j]) for j in live if j != i]
        r[i] = sum(others) / len(others) if others else 0.0
    z = sum(math.exp(r[j]) for j in live)
    return {i: weight * (score[i] / total if total > 0 else 0.0) - (1 - weight) * math.exp(r[i]) / z for i in live}


@pytest.mark.parametrize("weight", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("copies", [0.0, 0.3, 0.6])
def test_the_key_states_its_rule(weight, dtype, copies):
    """Rows and heads with different live sets (one live slot, none at all, a zero score sum);
    what the free slots hold (stale keys and scores, however large: the buffers start at zero and
    hold only written keys, never NaN) changes nothing. Slots are not in token order (the latest
    copy is found by ordinal), and the keys share a direction, so some pairs are copies."""
    g = torch.Generator().manual_seed(3)
    b, h, cap, d = 2, 3, 9, 8
    score = torch.rand(b, h, cap, generator=g, dtype=torch.float64)
    keys = torch.randn(b, h, cap, d, generator=g, dtype=torch.float64) + torch.linspace(-1, 1, d, dtype=torch.float64)
    valid = torch.rand(b, h, cap, generator=g) < 0.6
    valid[0, 1] = False
    valid[0, 1, 4] = True  # one live slot
    valid[1, 2] = False  # none
    score[1, 0] = 0.0  # a zero sum
    garbage_keys = keys.clone()
    garbage_keys[~valid] = torch.tensor([1e30, -1e30, 1e15, 0.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    garbage_score = score.masked_fill(~valid, 1e30)
    policy = make_policy(f"rkv:weight={weight},copies={copies}")
    ordinal = torch.randperm(cap, generator=g).expand(b, h, cap)
    n_real = torch.full((b, 1, 1), cap)
    key = policy.eviction_key(garbage_score.to(dtype), ordinal, n_real, keys=garbage_keys.to(dtype), valid=valid)
    assert key.dtype == dtype and bool(key.isfinite().all())
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for bi in range(b):
        for hi in range(h):
            want = rule(score[bi, hi].tolist(), keys[bi, hi].tolist(), valid[bi, hi].tolist(), weight, copies,
                        ordinal[bi, hi].tolist())
            for slot, value in want.items():
                assert abs(float(key[bi, hi, slot]) - value) <= tol, (bi, hi, slot)


def pooled(importance: dict, ordinal: list[int], kernel: int) -> dict:
    """Each live slot's largest importance among the ``kernel`` live slots nearest it in token order."""
    in_order = sorted(importance, key=lambda slot: ordinal[slot])
    half = kernel // 2
    return {slot: max(importance[s] for s in in_order[max(0, a - half):a + half + 1])
            for a, slot in enumerate(in_order)}


@pytest.mark.parametrize("kernel", [3, 5])
def test_the_kernel_takes_the_largest_importance_of_the_nearest_live_slots_in_token_order(kernel):
    """Slots out of token order (slot order is not token order once slots are reused), free slots
    between them: a slot takes the largest importance of its kernel's live neighbours in token
    order; the redundancy is unchanged."""
    g = torch.Generator().manual_seed(8)
    cap, d = 10, 4
    score = torch.rand(1, 1, cap, generator=g, dtype=torch.float64)
    keys = torch.randn(1, 1, cap, d, generator=g, dtype=torch.float64)
    ordinal = torch.randperm(cap, generator=g).view(1, 1, cap)
    valid = torch.rand(1, 1, cap, generator=g) < 0.7
    valid[0, 0, :2] = True
    n_real = torch.full((1, 1, 1), cap)
    plain = make_policy("rkv:weight=1").eviction_key(score, ordinal, n_real, keys=keys, valid=valid)[0, 0]
    smooth = make_policy(f"rkv:weight=1,kernel={kernel}").eviction_key(score, ordinal, n_real, keys=keys, valid=valid)[0, 0]
    live = [i for i in range(cap) if valid[0, 0, i]]
    want = pooled({i: float(plain[i]) for i in live}, ordinal[0, 0].tolist(), kernel)
    assert {i: float(smooth[i]) for i in live} == pytest.approx(want, abs=1e-12)
    assert all(float(smooth[i]) == 0.0 for i in range(cap) if not valid[0, 0, i])
    # weight 0: redundancy alone, which the kernel does not touch
    redundancy = [make_policy(f"rkv:weight=0{k}").eviction_key(score, ordinal, n_real, keys=keys, valid=valid)
                  for k in ("", f",kernel={kernel}")]
    torch.testing.assert_close(*redundancy)


def test_a_digit_between_two_heavy_digits_stays_with_the_kernel():
    """A number of three tokens (ordinals 3-5) whose middle digit is read little, after three
    tokens read a little more; slots in another order than the tokens. Token by token the middle
    digit goes; with the kernel it ranks with its neighbours and one of the first tokens goes."""
    # slots:      d2    a     d3    b     d1    c     recent window
    ordinal = torch.tensor([[[4, 0, 5, 1, 3, 2, 6, 7]]])
    score = torch.tensor([[[0.02, 0.06, 0.30, 0.05, 0.30, 0.06, 0.4, 0.4]]], dtype=torch.float64)
    keys = torch.eye(8, dtype=torch.float64)[None, None]  # orthogonal: every key equally redundant
    valid = torch.ones(1, 1, 8, dtype=torch.bool)

    def victim(spec):
        rank = eviction_rank(make_policy(spec), 0, score, ordinal, torch.full((1, 1, 1), 8), ordinal >= 6, keys, valid)
        return int(rank.argmin(-1))

    assert victim("rkv") == 0  # d2
    assert victim("rkv:kernel=3") in (1, 3)  # a or b (0.06 each after pooling), not the number


def test_the_key_needs_the_keys():
    with pytest.raises(ValueError, match="keys= and valid="):
        make_policy("rkv").eviction_key(torch.rand(1, 1, 4), torch.arange(4), torch.tensor(4))


# -- what the rule is for -----------------------------------------------------------------------------
def duplicates_and_a_distinct_key(weight):
    """One (row, head): slot 0 a distinct key, slots 1 and 2 two copies of one key, all three of
    equal score; slots 3-4 the recent window (protected). The slot of the rule's victim."""
    basis = torch.eye(5)
    keys = torch.stack([basis[1], basis[0], basis[0], basis[2], basis[3]])[None, None]
    score = torch.tensor([[[0.2, 0.2, 0.2, 0.9, 0.5]]])
    ordinal = torch.arange(5).view(1, 1, 5)
    shielded = ordinal >= 3
    valid = torch.ones(1, 1, 5, dtype=torch.bool)
    rank = eviction_rank(make_policy(f"rkv:weight={weight}"), 0, score, ordinal, torch.full((1, 1, 1), 5), shielded,
                         keys, valid)
    return int(rank.argmin(-1)), rank


def test_a_duplicate_goes_before_a_distinct_key_of_equal_importance():
    """weight=0: ranked by redundancy alone, a copy goes (slot order alone would take slot 0)."""
    victim, rank = duplicates_and_a_distinct_key(0.0)
    assert victim in (1, 2)
    assert float(rank[0, 0, 1]) == float(rank[0, 0, 2]) < float(rank[0, 0, 0])
    # the default weight, equal importance: the same victim
    assert duplicates_and_a_distinct_key(0.1)[0] in (1, 2)


def test_copies_spare_the_latest_copy():
    """Three copies of one key, written at ordinals 4, 0 and 2 (slot order is not token order),
    beside two distinct keys, equal importance: without ``copies`` the copies tie; with it the
    newest (ordinal 4, slot 0) is the latest copy of both others and is spared twice, the middle one
    (ordinal 2) is the newest's latest copy and spared once, and the oldest goes first."""
    basis = torch.eye(4, dtype=torch.float64)
    keys = torch.stack([basis[0], basis[0], basis[0], basis[1], basis[2]])[None, None]
    score = torch.full((1, 1, 5), 0.2, dtype=torch.float64)
    ordinal = torch.tensor([[[4, 0, 2, 1, 3]]])
    valid = torch.ones(1, 1, 5, dtype=torch.bool)
    n_real = torch.full((1, 1, 1), 5)
    plain = make_policy("rkv:weight=0").eviction_key(score, ordinal, n_real, keys=keys, valid=valid)[0, 0]
    spared = make_policy("rkv:weight=0,copies=0.5").eviction_key(score, ordinal, n_real, keys=keys, valid=valid)[0, 0]
    assert float(plain[0]) == float(plain[1]) == float(plain[2])
    assert float(spared[1]) < float(spared[2]) < float(spared[0])
    assert int(spared.argmin()) == 1


def test_weight_one_ranks_as_h2o():
    g = torch.Generator().manual_seed(7)
    score, keys = torch.rand(2, 3, 11, generator=g), torch.randn(2, 3, 11, 8, generator=g)
    valid = torch.rand(2, 3, 11, generator=g) < 0.8
    ordinal, n_real = torch.arange(11).expand(2, 3, 11), torch.full((2, 1, 1), 11)
    shielded = ~valid
    ranks = [eviction_rank(make_policy(spec), 0, score, ordinal, n_real, shielded, keys, valid).argsort(stable=True)
             for spec in ("rkv:weight=1", "h2o")]
    assert torch.equal(*ranks)
    # and through the cache: the same kept tokens, prompt and decode steps
    q, k, v = leaning_qkv(4)
    calls = [(0, 18)] + [(t, t + 1) for t in range(18, 30)]
    assert run_calls("rkv:weight=1", q, k, v, 5, 4, calls, 4)[1] == run_calls("h2o", q, k, v, 5, 4, calls, 4)[1]


# -- every path of the cache against the loop ---------------------------------------------------------
@pytest.mark.parametrize("kernels_name", ["eager", "native"])
@pytest.mark.parametrize("path", PATH_CASES)
@pytest.mark.parametrize("spec", SPECS)
def test_each_path_matches_the_reference(path, spec, kernels_name, monkeypatch):
    """A spy proves the path ran; kept sets and outputs equal the loop's. Decode at the budget runs
    the tensor-op ``EagerStep``, or under the C kernels ``NativeStep`` (its own rkv ranks), except
    for a rank shared over heads or pooled over token order, which the C step does not know."""
    chunk, calls, runs = PATH_CASES[path]
    taken = spy_on_path(monkeypatch, path)
    q, k, v = leaning_qkv(21)
    with kernels.use_kernels(kernels_name):
        out, kept, layer = run_calls(spec, q, k, v, 5, 4, calls, chunk)
    assert len(taken) == runs
    ref_out, ref_kept = reference(q[0], k[0], v[0], spec, 5, 4, calls, chunk=chunk, scale=k.shape[-1] ** -0.5)
    assert kept == ref_kept
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)
    if path == "decode_step":
        in_c = kernels_name == "native" and library() is not None and c_decode_rule(make_policy(spec)) is not None
        assert set(taken) == {"NativeStep" if in_c else "EagerStep"}
        assert native_rule(layer.config.policy) is None  # the scan and Triton: never


@settings(max_examples=15, deadline=None)
@given(prompt=st.integers(1, 20), steps=st.integers(0, 8), heavy=st.integers(1, 6), recent=st.integers(1, 5),
       chunk=st.sampled_from([1, 2, 5, 64]), groups=st.sampled_from([1, 3]), weight=st.sampled_from([0.0, 0.1, 0.7]),
       seed=st.integers(0, 10_000))
def test_a_chunked_prompt_and_decode_steps_match_the_reference(prompt, steps, heavy, recent, chunk, groups, weight,
                                                               seed):
    spec = f"rkv:weight={weight}"
    n = prompt + steps
    q, k, v = random_qkv(seed, 2 * groups, 2, n, 8)
    calls = [(0, prompt)] + [(t, t + 1) for t in range(prompt, n)]
    out, kept, _ = run_calls(spec, q, k, v, heavy, recent, calls, chunk)
    ref_out, ref_kept = reference(q[0], k[0], v[0], spec, heavy, recent, calls, chunk=chunk, scale=8**-0.5)
    assert kept == ref_kept
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)


LATE_CALLS = {
    "prompt": [(0, 40)],
    "prompt+decode": [(0, 28)] + [(t, t + 1) for t in range(28, 40)],
    "two calls+decode": [(0, 16), (16, 30)] + [(t, t + 1) for t in range(30, 40)],
}


@pytest.mark.parametrize("calls", LATE_CALLS)
@pytest.mark.parametrize("adaptive", [None, 0.2], ids=["uniform", "adaptive"])
def test_late_prefill_and_head_shares_match_the_reference(calls, adaptive):
    """Each call read whole and ranked once (its excess freed together), with uniform heads or
    the heads' shares by the key (Ada-KV): the loop's kept sets and outputs."""
    q, k, v = leaning_qkv(8, hq=8, hkv=4, n=40, d=8)
    options = {} if adaptive is None else {"head_budgets": "adaptive", "head_floor": adaptive}
    out, kept, _ = run_calls("rkv", q, k, v, 8, 3, LATE_CALLS[calls], 6, prefill="late", **options)
    ref_out, ref_kept = reference(q[0], k[0], v[0], "rkv", 8, 3, LATE_CALLS[calls], chunk=6, scale=8**-0.5, late=True,
                                  adaptive=adaptive)
    assert kept == ref_kept
    torch.testing.assert_close(out, ref_out.float(), atol=1e-5, rtol=1e-5)
    if adaptive is not None:
        assert len({len(heads) for heads in kept}) > 1  # the shares really differ


# -- the option, and where rkv is listed ---------------------------------------------------------------
def test_the_weight_option():
    assert make_policy("rkv").weight == 0.1 and make_policy("rkv").spec == "rkv:weight=0.1"
    assert make_policy("rkv:weight=0.3").weight == 0.3 and make_policy("rkv:0.5").weight == 0.5
    assert make_policy("rkv:weight=0.3,heads=shared").shared_heads


def test_the_c_step_knows_rkv_but_not_its_kernel_nor_shared_heads():
    assert c_decode_rule(make_policy("rkv:weight=0.3,decay=0.9")) is not None
    assert c_decode_rule(make_policy("rkv:kernel=3")) is None and c_decode_rule(make_policy("rkv:heads=shared")) is None


@pytest.mark.parametrize("spec, message", [
    ("rkv:weight=1.5", "rkv weight must be in [0, 1], got 1.5"),
    ("rkv:weight=-0.1", "rkv weight must be in [0, 1], got -0.1"),
    ("rkv:weight=nan", "rkv weight must be in [0, 1], got nan"),
    ("rkv:weight=heavy", "policy 'rkv': option weight='heavy' is not a float"),
    ("rkv:lambda=0.1", "policy 'rkv' has no option 'lambda'; it has weight, decay, kernel, copies, heads"),
    ("rkv:kernel=4", "rkv kernel must be an odd number >= 1, got 4"),
])
def test_bad_options_are_one_line_errors(spec, message):
    for build in (lambda: make_policy(spec), lambda: H2OCache(MODEL, policy=spec, heavy=4, recent=4)):
        with pytest.raises(H2OError) as caught:
            build()
        assert str(caught.value) == message and "\n" not in str(caught.value)


def test_the_command_line_lists_rkv():
    parser = argparse.ArgumentParser()
    add_budget_args(parser)
    assert "snapkv, knorm, rkv, expected" in " ".join(parser.format_help().split())
    assert parser.parse_args(["--policy", "rkv:weight=0.3"]).policy == "rkv:weight=0.3"
