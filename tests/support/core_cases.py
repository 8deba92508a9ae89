"""Shared by the core's tests: the tiny Llama they run one layer of, seeded q/k/v, and one layer fed
a list of calls (held to ``h2okv.core.reference`` by tests/core/test_algorithm.py and
tests/core/test_late_prefill_knorm_shared_heads.py)."""

import torch

import h2okv.core.decode as decode_mod
import h2okv.core.layer as layer_mod
from h2okv import H2OCache
from h2okv.policies import make_policy
from h2okv.tools.tiny import tiny_model

MODEL = tiny_model("llama")


def random_qkv(seed: int, hq: int, hkv: int, n: int, d: int):
    """Queries ``[1, hq, n, d]``, keys and values ``[1, hkv, n, d]`` from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, n, d, generator=g)
    k = torch.randn(1, hkv, n, d, generator=g)
    v = torch.randn(1, hkv, n, d, generator=g)
    return q, k, v


def run_calls(spec, q, k, v, heavy, recent, calls, chunk, prefill="chunked", **options):
    """One layer fed ``calls`` (``options``: further ``H2OCache`` keywords); returns (outputs
    ``[Hq, n, D]``, kept per KV head, the layer). Every head's budget holds after every call."""
    cache = H2OCache(MODEL, policy=spec, heavy=heavy, recent=recent, chunk_size=chunk, prefill=prefill, **options)
    layer = cache.layers[0]
    outs = []
    for c0, c1 in calls:
        sl = slice(c0, c1)
        layer.update(k[:, :, sl], v[:, :, sl])
        outs.append(layer.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], None, k.shape[-1] ** -0.5).transpose(1, 2))
        budget = layer.slot_budget() if options else make_policy(spec).split(heavy, recent).total
        assert bool((layer.live_slots() <= budget).all())
    layer.to_dense()  # a layer the native step holds flat is read in its dense layout
    kept = [sorted(layer.ordinal[0, h][layer.valid[0, h]].tolist()) for h in range(k.shape[1])]
    return torch.cat(outs, dim=2)[0], kept, layer


def leaning_qkv(seed, hq=6, hkv=2, n=30, d=8):
    """Random q/k/v where the first tokens draw little attention (so sinks and recency show)."""
    q, k, v = random_qkv(seed, hq, hkv, n, d)
    lean = torch.full((d,), 0.7)
    q += lean
    k[:, :, :4] = 0.1 * k[:, :, :4] - 2 * lean
    return q, k, v


# each path of a layer, named: (chunk_size, forward calls, how many times it must run)
PATH_CASES = {
    # the general step of layer.py, one chunk at a time
    "chunk_step": (4, [(0, 30)], 8),
    # per-token calls; the second and third start with old slots inside the recent window
    "token_scan": (1, [(0, 13), (13, 20), (20, 30)], 3),
    # a chunked prompt, then one token per call with every row at its budget (the stepper's step)
    "decode_step": (4, [(0, 12)] + [(t, t + 1) for t in range(12, 30)], 18),
}
STEPPERS = (decode_mod.EagerStep, decode_mod.NativeStep, decode_mod.TritonStep)


def spy_on_path(monkeypatch, path: str) -> list[str]:
    """A list that records each run of ``path`` (``PATH_CASES``): the name of the layer.py function,
    or for ``decode_step`` the stepper class that ran it, whichever engine was chosen."""
    taken = []

    def spy_on(owner, name, label):
        original = getattr(owner, name)

        def spy(*args, **kwargs):
            taken.append(label)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)

    if path == "decode_step":
        for stepper in STEPPERS:
            spy_on(stepper, "decode", stepper.__name__)
    else:
        spy_on(layer_mod, path, path)
    return taken
