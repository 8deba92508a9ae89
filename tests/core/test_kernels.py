"""The kernel paths (``h2okv.core.kernels``) against the eager path, fallbacks included.

- native (C, CPU): the scan's recurrence and the dense decode step equal eager on every policy
  whose rule the kernels know; an unknown rule, a missing compiler, or ``eager`` run eager.
- triton: under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) the kernels equal
  eager ``slot_attention`` (output and per-slot mass) for GQA and MHA, masks with free slots,
  padded rows and each score policy's query weights; a whole tiny model decodes the same.
"""

import math
import os
import warnings

import pytest
import torch

import h2okv.core.native.calls as native_calls
import h2okv.core.scan as scan_mod
from h2okv import H2OCache, H2OError
from h2okv.core import kernels
from h2okv.core.attention import slot_attention
from h2okv.core.budget import H2OBudgetWarning
from h2okv.core.compat import cache_arg
from h2okv.core.native import build
from h2okv.core.native.rules import c_decode_rule, native_rule
from h2okv.core.runtime import RUNTIME
from h2okv.core.scan import ScanPlan, ScanState, scan_block
from h2okv.core.step import last_real_query
from h2okv.policies import H2OPolicy, make_policy
from h2okv.tools.tiny import random_ids, tiny_model

SCORE_POLICIES = ["h2o", "tova", "h2o-sink", "h2o-mean", "snapkv"]
NATIVE_POLICIES = [*SCORE_POLICIES, "local", "sink"]
# rules only the C decode step knows: a decaying fold, rkv's rank from the keys
C_DECODE_POLICIES = ["h2o:decay=0.8", "snapkv:decay=0.9", "rkv", "rkv:weight=0.5,decay=0.7", "rkv:weight=0"]


def needs_native():
    if build.library() is None:
        pytest.skip(f"no native kernels here: {build.build_info().error}")


def scan_inputs(seed, b=2, hkv=2, g=3, blk=6, cap=5, n=20):
    """A scan call mid-way: ``cap`` old slots (one free), then new tokens; one block of queries."""
    gen = torch.Generator().manual_seed(seed)
    total = cap + n
    logits = torch.randn(b, hkv, g, blk, total, generator=gen) * 2
    bias = torch.full((b, hkv, total), -math.inf)
    bias[:, :, : cap - 1] = 0.0  # the last old slot is free
    ordinal = torch.cat([torch.randperm(cap, generator=gen).expand(b, hkv, cap),
                         (cap + torch.arange(n)).expand(b, hkv, n)], dim=2).contiguous()
    blocked = (ordinal < 2) | (bias[..., :] == -math.inf) & (torch.arange(total) < cap)
    score = torch.rand(b, hkv, total, generator=gen)
    return logits, ScanState(bias, blocked, score, ordinal)


def cut(state, width):
    """The state of the keys written so far (views, as ``token_scan`` passes them)."""
    return ScanState(*(t[..., :width] for t in (state.bias, state.blocked, state.score, state.ordinal)))


@pytest.mark.parametrize("policy", NATIVE_POLICIES)
def test_native_scan_block_equals_eager(policy):
    needs_native()
    pol = make_policy(policy)
    plan = ScanPlan(first_new=5, n0=5, recent=3, evict_from=2)
    for start in (0, 6):
        logits, state = scan_inputs(7 + start)
        width = plan.first_new + start + logits.shape[3]
        logits = logits[..., :width].contiguous()
        eager = ScanState(*(t.clone() for t in (state.bias, state.blocked, state.score, state.ordinal)))
        want = logits.clone()
        scan_block(want, cut(eager, width), plan, start, pol, 0)
        rule = native_calls.scan_rule(pol, logits, cut(state, width))
        assert rule is not None
        native_calls.scan_block(logits, cut(state, width), plan, start, pol, rule)
        torch.testing.assert_close(logits, want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state.score, eager.score, atol=1e-6, rtol=1e-5)
        assert torch.equal(state.bias, eager.bias) and torch.equal(state.blocked, eager.blocked)


def run_tiny(policy, kernels_name, arch="qwen2", chunk=1, batch=2, device="cpu", cuts=(25, 34, 44), scores=False,
             budget=(6, 5)):
    """Two scoring calls, then decode steps at the budget (up to ``cuts``); logits and kept sets
    (and, with ``scores``, each layer's live scores in slot order)."""
    model = tiny_model(arch).to(device)
    a, b, n = cuts
    ids = random_ids(n, batch=batch, seed=5).to(device)
    with kernels.use_kernels(kernels_name):
        cache = H2OCache(model, policy=policy, heavy=budget[0], recent=budget[1], chunk_size=chunk)
        logits = [model(ids[:, :a], **cache_arg(cache)).logits, model(ids[:, a:b], **cache_arg(cache)).logits]
        logits += [model(ids[:, t:t + 1], **cache_arg(cache)).logits for t in range(b, n)]
    kept = [[sorted(layer.ordinal[r, h][layer.valid[r, h]].tolist()) for r in range(batch)
             for h in range(layer.keys.shape[1])] for layer in cache.layers]
    if scores:
        live = [layer.score.masked_fill(~layer.valid, 0.0) for layer in cache.layers]
        return torch.cat(logits, dim=1), kept, live
    return torch.cat(logits, dim=1), kept


def counting(monkeypatch, module, name, calls=None):
    """Spy on ``module.name``: its calls are appended to ``calls`` (a new list unless given)."""
    calls = [] if calls is None else calls
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("policy", NATIVE_POLICIES)
def test_native_paths_equal_eager_on_a_model(policy, monkeypatch):
    """Per-token scoring (scan) then dense decode steps: the C kernels ran, same logits and kept sets."""
    needs_native()
    scans = counting(monkeypatch, native_calls, "scan_block")
    decodes = counting(monkeypatch, native_calls, "decode_dense")
    fast_logits, fast_kept = run_tiny(policy, "native")
    assert scans and len(decodes) == 2 * 10  # 2 layers x 10 decode steps
    n_scans = len(scans)
    slow_logits, slow_kept = run_tiny(policy, "eager")
    assert len(scans) == n_scans and len(decodes) == 20  # eager never called them
    torch.testing.assert_close(fast_logits, slow_logits, atol=1e-5, rtol=1e-5)
    assert fast_kept == slow_kept


@pytest.mark.parametrize("policy", C_DECODE_POLICIES)
def test_rules_only_the_c_decode_step_knows_equal_eager_on_a_model(policy, monkeypatch):
    """The per-token scan runs eager for these (no native scan), the decode steps at the budget in C:
    same logits, kept sets and live scores as eager on every step."""
    needs_native()
    scans = counting(monkeypatch, native_calls, "scan_block")
    decodes = counting(monkeypatch, native_calls, "decode_dense")
    fast = run_tiny(policy, "native", scores=True)
    assert not scans and len(decodes) == 2 * 10  # 2 layers x 10 decode steps
    slow = run_tiny(policy, "eager", scores=True)
    assert len(decodes) == 20
    torch.testing.assert_close(fast[0], slow[0], atol=1e-5, rtol=1e-5)
    assert fast[1] == slow[1]
    for a, b in zip(fast[2], slow[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_native_decode_after_a_chunked_prefill_mha_and_sinks(monkeypatch):
    """MHA (gpt_neox), sinks, rows of different lengths' budgets alike: decode runs natively."""
    needs_native()
    decodes = counting(monkeypatch, native_calls, "decode_dense")
    fast = run_tiny("h2o-sink", "native", arch="gpt_neox", chunk=4)
    assert decodes
    slow = run_tiny("h2o-sink", "eager", arch="gpt_neox", chunk=4)
    torch.testing.assert_close(fast[0], slow[0], atol=1e-5, rtol=1e-5)
    assert fast[1] == slow[1]


def test_native_decode_rows_of_different_lengths(monkeypatch):
    """Left-padded prompts of 20 and 13 real tokens, one absolute budget: rows decode at their own
    ordinals (n_real, window) in the C step, as in eager."""
    needs_native()
    decodes = counting(monkeypatch, native_calls, "decode_dense")
    model = tiny_model("llama")
    ids = random_ids(30, batch=2, seed=9)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :7] = 0

    def run(name):
        with kernels.use_kernels(name):
            cache = H2OCache(model, policy="h2o-mean", heavy=4, recent=4, chunk_size=8)
            logits = [model(ids[:, :20], attention_mask=mask, **cache_arg(cache)).logits[:, -1:]]
            logits += [model(ids[:, t:t + 1], **cache_arg(cache)).logits for t in range(20, 30)]
        layer = cache.layers[0]
        kept = [sorted(layer.ordinal[r, h][layer.valid[r, h]].tolist()) for r in range(2) for h in range(2)]
        return torch.cat(logits, dim=1), kept, layer.n_real.tolist()

    fast = run("native")
    assert decodes and fast[2] == [30, 23]
    slow = run("eager")
    torch.testing.assert_close(fast[0], slow[0], atol=1e-5, rtol=1e-5)
    assert fast[1:] == slow[1:]


def cache_dense_bytes(budgets, head_dim):
    """What the dense layout allocates: per layer, every (row, head) its widest head's budget + 1."""
    return sum(b.numel() * (int(b.max()) + 1) for b in budgets) * 2 * head_dim * 4


@pytest.mark.parametrize("shape", ["adaptive", "layers", "rows", "rows-rkv"])
def test_native_decode_of_uneven_budgets_equals_eager(shape, monkeypatch):
    """Heads (Ada-KV's split, kvzip's cache-wide split) or rows (two prompts, two budgets) of
    uneven budgets: the live slots are packed to the front once, and the C step then reads each
    (row, head)'s own budget + 1 slots. Same logits and kept sets as eager, which masks."""
    needs_native()
    from char_tokenizers import Tok
    from h2okv.core.reconstruction import reconstruct

    decodes = counting(monkeypatch, native_calls, "decode_dense")
    # a large init scale: peaked attention, so the heads' shares differ
    model = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    ids = random_ids(50, batch=2 if shape.startswith("rows") else 1, seed=11)

    def run(name):
        with kernels.use_kernels(name), torch.inference_mode():
            if shape.startswith("rows"):
                policy = "rkv:weight=0.3" if shape == "rows-rkv" else "h2o"  # rkv: each head's own keys only
                cache = H2OCache(model, policy=policy, heavy=6, recent=3, chunk_size=8)
                model(ids[:1, :30], **cache_arg(cache))
                other = H2OCache(model, policy=policy, heavy=9, recent=5, chunk_size=8)
                model(ids[1:, :30], **cache_arg(other))
                cache.append_rows(other)
            elif shape == "adaptive":
                cache = H2OCache(model, policy="h2o", heavy=8, recent=3, prefill="late", head_budgets="adaptive",
                                 head_floor=0.0)
                model(ids[:, :30], **cache_arg(cache))
            else:
                cache = H2OCache(model, policy="kvzip:tail=0", heavy=8, recent=3, prefill="late", head_budgets="layers",
                                 head_floor=0.0)
                model(ids[:, :30], **cache_arg(cache))
                reconstruct(model, cache, ids[:, :30], Tok())
            logits = [model(ids[:, t:t + 1], **cache_arg(cache)).logits for t in range(30, 50)]
        flat = [layer.ragged is not None for layer in cache.layers]
        # flat: each head holds its own budget + 1 slots of K and V, nothing more
        own = sum(int((layer.slot_budget() + 1).expand(layer.n_real.shape[0], 2).sum()) for layer in cache.layers)
        stats = cache.stats()  # read without bringing the dense layout back
        assert [layer.ragged is not None for layer in cache.layers] == flat
        assert stats["slots"] == [int(layer.slot_budget().max()) for layer in cache.layers]
        flat_bytes = stats["kv_bytes"]
        for layer in cache.layers:  # read the slots in their dense layout
            layer.to_dense()
        budgets = [layer.slot_budget().expand(layer.valid.shape[:2]) for layer in cache.layers]
        kept = [sorted(layer.ordinal[r, h][layer.valid[r, h]].tolist()) for layer in cache.layers
                for r in range(layer.valid.shape[0]) for h in range(layer.valid.shape[1])]
        return torch.cat(logits, dim=1), kept, budgets, flat, flat_bytes, own

    fast = run("native")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    uneven = [bool((b != b.flatten()[0]).any()) for b in fast[2]]
    assert fast[3] == uneven and any(uneven)  # a layer of uneven budgets decodes flat, a uniform one dense
    assert fast[4] == fast[5] * 2 * head_dim * 4  # float32 K and V: each head its own budget + 1 slots
    assert cache_dense_bytes(fast[2], head_dim) > fast[4]  # the dense layout: the widest head's for every head
    assert len(decodes) >= 2 * 15  # the C step ran on (almost) every step of both layers
    assert any(bool((b != b.flatten()[0]).any()) for b in fast[2])  # the budgets are uneven
    slow = run("eager")
    torch.testing.assert_close(fast[0], slow[0], atol=1e-5, rtol=1e-5)
    assert fast[1] == slow[1]


def test_a_head_that_keeps_every_token_goes_flat_once_the_layer_has_grown(monkeypatch):
    """kvzip's cache-wide split can give one head every token of a short prompt: its layer is then
    full (no free slot), so it stays dense until the first step grows it, then goes flat; stats()
    reads either, and the steps equal eager's."""
    needs_native()
    from char_tokenizers import Tok
    from h2okv.core.reconstruction import reconstruct

    model = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    ids = torch.randint(2, 90, (1, 16), generator=torch.Generator().manual_seed(0))

    def run(name):
        with kernels.use_kernels(name), torch.inference_mode():
            cache = H2OCache(model, policy="kvzip:tail=0", heavy=8, recent=1, prefill="late", head_budgets="layers",
                             head_floor=0.0)
            model(ids[:, :10], **cache_arg(cache))
            reconstruct(model, cache, ids[:, :10], Tok())
            full = [int(layer.slot_budget().max()) == layer.capacity for layer in cache.layers]
            before = cache.stats()
            logits = [model(ids[:, t:t + 1], **cache_arg(cache)).logits for t in range(10, 16)]
            flat = [layer.ragged is not None for layer in cache.layers]
            for layer in cache.layers:  # read the slots in their dense layout
                layer.to_dense()
            kept = [sorted(layer.ordinal[0, h][layer.valid[0, h]].tolist()) for layer in cache.layers for h in range(2)]
        return torch.cat(logits, dim=1), kept, full, flat, before

    fast = run("native")
    assert fast[2][0] and fast[3][0]  # layer 0: one head keeps all 10 tokens; flat once it has grown
    assert fast[4]["slots"][0] == 10
    slow = run("eager")
    torch.testing.assert_close(fast[0], slow[0], atol=1e-5, rtol=1e-5)
    assert fast[1] == slow[1]


def test_a_rule_the_kernels_do_not_know_runs_eager():
    class Halved(H2OPolicy):
        def decode_rule(self):
            return None  # a rule the kernels do not know (tests/policies/test_declared_rules.py)

        def accumulate(self, score, mass):
            score.add_(mass / 2)

    assert native_rule(Halved()) is None
    assert native_rule(make_policy("h2o")) is not None
    assert native_rule(make_policy("random")) is None  # its key draws numbers
    # rules added later in the core: a rank shared over heads, a starting score from the key
    assert native_rule(make_policy("h2o:heads=shared")) is None
    assert native_rule(make_policy("tova:heads=shared")) is None
    assert native_rule(make_policy("knorm")) is None
    # known to the C decode step (and the fused Triton step) only: the per-token scan runs them eager
    for spec in C_DECODE_POLICIES:
        assert native_rule(make_policy(spec)) is None and c_decode_rule(make_policy(spec)) is not None
    assert c_decode_rule(make_policy("rkv:heads=shared")) is None


@pytest.mark.parametrize("policy", ["knorm", "h2o:heads=shared"])
def test_policies_the_kernels_do_not_know_give_the_eager_result_under_native(policy):
    """Under the default kernels, a policy the C loops do not know decodes exactly as eager."""
    fast = run_tiny(policy, "native")
    slow = run_tiny(policy, "eager")
    torch.testing.assert_close(fast[0], slow[0], atol=0, rtol=0)
    assert fast[1] == slow[1]


def test_without_a_compiler_the_core_warns_once_and_runs_eager(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("H2OKV_CACHE", str(tmp_path))
    build.reset()
    try:
        with pytest.warns(UserWarning, match="native CPU kernels unavailable"):
            assert not kernels.native_on(torch.device("cpu"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not a second time
            warnings.simplefilter("ignore", H2OBudgetWarning)  # the tiny run's small budget: not what this checks
            assert not kernels.native_on(torch.device("cpu"))
            scans = []
            monkeypatch.setattr(scan_mod.native, "scan_block", lambda *a: scans.append(a))
            logits, kept = run_tiny("h2o", "native")
        assert not scans
        assert kernels.unavailable_reason("native", torch.device("cpu")).startswith("no C compiler")
    finally:
        build.reset()
    want_logits, want_kept = run_tiny("h2o", "eager")
    torch.testing.assert_close(logits, want_logits)
    assert kept == want_kept


def test_kernel_names_are_checked(monkeypatch):
    with pytest.raises(H2OError, match="unknown kernels"):
        kernels.set_kernels("fast")
    monkeypatch.setenv(kernels.ENV, "eager")
    assert kernels.get_kernels() == "eager"
    with kernels.use_kernels("native"):
        assert kernels.get_kernels() == "native"
    assert kernels.get_kernels() == "eager"
    assert kernels.unavailable_reason("triton", torch.device("cpu")) == "triton kernels need a CUDA device"
    assert not kernels.triton_on(torch.device("cpu"))


# -- triton, under the interpreter ---------------------------------------------------------------
@pytest.fixture
def interpreted():
    """The Triton kernels' entry point and the device they run on: CUDA, or CPU tensors under the
    interpreter (``TRITON_INTERPRET=1``, set by conftest.py before triton is imported)."""
    from h2okv.core.triton_attention import triton_available, triton_import_error, triton_slot_attention

    if not triton_available():
        pytest.skip(triton_import_error())
    if torch.cuda.is_available():
        return triton_slot_attention, "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1 (it must be set before triton is imported)")
    return triton_slot_attention, "cpu"


def attention_inputs(seed, b, hq, hkv, m, cap, d=16, dv=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, m, d, generator=gen)
    k = torch.randn(b, hkv, cap, d, generator=gen)
    v = torch.randn(b, hkv, cap, dv, generator=gen)
    return q, k, v


def check_against_eager(interpreted, q, k, v, allowed, weight):
    fn, device = interpreted
    q, k, v = q.to(device), k.to(device), v.to(device)
    allowed = None if allowed is None else allowed.to(device)
    weight = None if weight is None else weight.to(device)
    out, mass = fn(q, k, v, allowed, 0.3, weight)
    want_out, want_mass = slot_attention(q, k, v, allowed, 0.3, need_mass=True, query_weight=weight)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass, want_mass, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_triton_decode_kernel_equals_eager(interpreted, heads):
    hq, hkv = heads
    q, k, v = attention_inputs(1, 3, hq, hkv, 1, 70, d=8, dv=12)
    valid = torch.rand(3, hkv, 70, generator=torch.Generator().manual_seed(2)) > 0.3  # free slots
    valid[..., 5] = True
    check_against_eager(interpreted, q, k, v, None, None)  # dense: every slot
    check_against_eager(interpreted, q, k, v, valid[:, :, None, :], None)
    check_against_eager(interpreted, q, k, v, valid[:, :, None, :], torch.tensor([[True], [False], [True]]))  # a pad row


@pytest.mark.parametrize("heads", [(6, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("queries", ["all", "last", "padded"])
def test_triton_chunk_pair_equals_eager(interpreted, heads, queries):
    """Output + LSE, then the column sums: every score policy's query weighting."""
    hq, hkv = heads
    b, m, old = 2, 5, 40
    q, k, v = attention_inputs(3, b, hq, hkv, m, old + m)
    # a chunk step's mask: live old slots (some free) plus new tokens up to each query
    live = torch.rand(b, hkv, 1, old, generator=torch.Generator().manual_seed(4)) > 0.25
    causal = torch.arange(m)[None, :] <= torch.arange(m)[:, None]
    allowed = torch.cat([live.expand(b, hkv, m, old), causal.expand(b, hkv, m, m)], dim=-1)
    real = torch.tensor([[True] * m, [True] * 3 + [False] * 2])  # row 1 right-padded
    weight = {"all": None, "last": last_real_query(real), "padded": real}[queries]
    check_against_eager(interpreted, q, k, v, allowed, weight)
    check_against_eager(interpreted, q, k, v, None, weight)


@pytest.mark.parametrize("policy", SCORE_POLICIES)
def test_triton_path_decodes_a_tiny_model_like_eager(interpreted, policy, monkeypatch):
    """A whole model (chunked prefill, then decode) with the mass-returning attention in the kernels."""
    import h2okv.core.attention as attention
    import h2okv.core.triton_attention as triton_attention

    _, device = interpreted
    short = dict(chunk=4, device=device, cuts=(12, 16, 19), batch=1)  # the interpreter is slow: few launches
    want = run_tiny(policy, "eager", **short)
    calls = counting(monkeypatch, triton_attention, "triton_slot_attention")
    if device == "cpu":  # selected on CUDA only: forced here, the rest of the core stays eager
        monkeypatch.setattr(attention, "triton_on", lambda device: True)
    else:  # on CUDA a decode step at the budget is the fused Triton step; snapkv's prefill needs no mass
        import h2okv.core.triton_step as triton_step

        for name in ("decode_dense", "decode_general"):
            counting(monkeypatch, triton_step, name, calls)
    got = run_tiny(policy, "triton" if device == "cuda" else "eager", **short)
    assert calls
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert got[1] == want[1]


@pytest.mark.parametrize(
    "policy, budget, cuts",
    [*[(p, (6, 5), (12, 16, 21)) for p in NATIVE_POLICIES],
     # 82 slots: two key blocks of 64; a short recent window makes the second block's slots
     # candidates too, so the online softmax and the lowest rank cross a block edge
     ("h2o", (70, 11), (84, 88, 100)), ("h2o-mean", (70, 11), (84, 88, 100)), ("sink", (40, 40), (84, 88, 93)),
     # a budget of 20 over a 12-token prompt: rows fill up during decode (the general step: first
     # free slot, no eviction), then evict at their budget
     *[(p, (10, 10), (8, 12, 30)) for p in ("h2o", "tova", "h2o-mean", "sink")],
     # the C decode step's rules: a decaying fold, rkv's key from the live keys (its sums over
     # every live key span two key blocks at 82 slots; while filling up, over the live ones only)
     *[(p, (6, 5), (12, 16, 21)) for p in C_DECODE_POLICIES],
     ("rkv", (70, 11), (84, 88, 100)), ("rkv:decay=0.97", (10, 10), (8, 12, 30))],
)
def test_triton_fused_decode_step_equals_eager(interpreted, policy, budget, cuts, monkeypatch):
    """The at-budget decode step as one launch (core/triton_step.py): every rule the kernels know
    (add / replace / fade-and-add the mass; rank by score, score per query, ordinal, rkv's key;
    sinks) gives eager's logits and kept sets, for a batch of two."""
    import h2okv.core.decode as decode
    import h2okv.core.triton_step as triton_step

    _, device = interpreted
    short = dict(chunk=4, device=device, cuts=cuts, batch=2, budget=budget)  # the interpreter is slow: few launches
    want = run_tiny(policy, "eager", scores=True, **short)
    calls = counting(monkeypatch, triton_step, "decode_dense")
    general = counting(monkeypatch, triton_step, "decode_general")
    if device == "cpu":  # selected on CUDA only: forced here for the step, the attention stays eager
        monkeypatch.setattr(decode, "triton_on", lambda device: True)
    got = run_tiny(policy, "triton" if device == "cuda" else "eager", scores=True, **short)
    steps = cuts[2] - cuts[1]
    assert len(calls) + len(general) == 2 * steps  # 2 layers x every decode step, one launch each
    assert len(general) >= (2 * (budget[0] + budget[1] - cuts[1]) if budget[0] + budget[1] > cuts[1] else 0)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert got[1] == want[1]
    for got_score, want_score in zip(got[2], want[2]):
        torch.testing.assert_close(got_score, want_score, atol=1e-5, rtol=1e-5)


def test_fused_step_that_cannot_compile_warns_once_and_decodes_eager(monkeypatch):
    """Written after the only GPU lease: if the kernel fails to compile on some GPU, the first step
    says why in one warning and every step (that one too) runs eager, with eager's results."""
    import h2okv.core.decode as decode
    import h2okv.core.triton_kernels as triton_kernels

    class Uncompilable:
        launches = 0

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                Uncompilable.launches += 1
                raise RuntimeError("PassManager::run failed\nmore lines")
            return launch

    want = run_tiny("h2o", "eager", scores=True)
    monkeypatch.setattr(RUNTIME, "triton_step_failure", None)
    monkeypatch.setattr(triton_kernels, "decode_step_kernel", Uncompilable())
    monkeypatch.setattr(decode, "triton_on", lambda device: True)
    with pytest.warns(UserWarning, match=r"fused Triton decode step cannot run here \(RuntimeError: PassManager::run failed\)"):
        got = run_tiny("h2o", "eager", scores=True)
    assert Uncompilable.launches == 1  # tried once, then eager for good
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert got[1] == want[1]
