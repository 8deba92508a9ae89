"""No subnormal float reaches the attention or the slot state.

A subnormal operand can make a CPU's arithmetic many times slower (microcode assists on many x86
cores) unless the process flushes them (``torch.set_flush_denormal``), a flag a library should not
flip for its users. Nothing in the core makes one from ordinary activations: free slots are zeros
(``storage.py``), masked logits are ``-inf`` (so their probability is exactly 0), and scores only
add probabilities. These tests hold that on Gemma-3's layer mix (sliding-window and global layers,
one KV head), where the issue that asked for them saw a slow attention (issue 38, item 8); the
real Gemma-3-270M is checked in ``test_core_gemma3.py``.
"""

import pytest
import torch

import h2okv.core.layer as layer_mod
import h2okv.core.step as step_mod
from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.kernels import use_kernels
from h2okv.tools.tiny import random_ids, tiny_model


def count_subnormal(t) -> int:
    if not torch.is_tensor(t) or not t.is_floating_point():
        return 0
    return int(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).sum())


def slot_subnormals(cache) -> dict:
    """``{(layer, tensor): count}`` of subnormals in every layer's slot tensors (free slots included)."""
    found = {}
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            continue
        held = layer.ragged if layer.ragged is not None else layer  # a flat layer is read as it is
        for name in ("keys", "values", "score"):
            n = count_subnormal(getattr(held, name))
            if n:
                found[(i, name)] = n
    return found


class SubnormalSpy:
    """Wraps the steps and the slot attention: counts subnormals in what enters them (query, new
    keys/values, the slot buffers attended over) and what the attention hands back (output, mass),
    and in every layer's slot state after each step."""

    def __init__(self, monkeypatch, cache):
        self.cache, self.found, self.calls = cache, {}, {"decode_step": 0, "chunk_step": 0, "slot_attention": 0}
        for mod, name in ((layer_mod, "decode_step"), (layer_mod, "chunk_step"), (step_mod, "slot_attention")):
            monkeypatch.setattr(mod, name, self._wrap(name, getattr(mod, name)))

    def _note(self, where, tensors):
        for i, t in enumerate(tensors):
            n = count_subnormal(t)
            if n:
                self.found[(where, i)] = self.found.get((where, i), 0) + n

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            self.calls[name] += 1
            self._note(name, args)
            out = fn(*args, **kwargs)
            self._note(name + " returned", out if isinstance(out, tuple) else (out,))
            if name != "slot_attention":
                for key, n in slot_subnormals(self.cache).items():
                    self.found[("slots after " + name, key)] = n
            return out
        return spy


@pytest.mark.parametrize("kernels", ["eager", "auto"])
def test_no_subnormal_in_attention_or_slots_while_decoding(monkeypatch, kernels):
    """Tiny Gemma-3, a prompt past its window, evicting to 8 + 8 slots for 24 decode steps."""
    model = tiny_model("gemma3")
    cache = H2OCache(model, policy="h2o", heavy=8, recent=8)
    spy = SubnormalSpy(monkeypatch, cache)
    with use_kernels(kernels):
        model.generate(random_ids(20, batch=2), **cache_arg(cache), max_new_tokens=24, min_new_tokens=24,
                       do_sample=False, pad_token_id=0)
    assert spy.calls["decode_step"] > 0 and spy.calls["chunk_step"] > 0 and spy.calls["slot_attention"] > 0
    assert max(cache.stats()["slots"]) == 16
    assert spy.found == {}
    assert slot_subnormals(cache) == {}


def test_the_check_sees_a_subnormal_in_the_slots(monkeypatch):
    """The spy is not vacuous: one subnormal value in a slot is reported at the next step."""
    model = tiny_model("gemma3")
    cache = H2OCache(model, policy="h2o", heavy=8, recent=8)
    ids = random_ids(20)
    out = model(ids, **cache_arg(cache))
    cache.layers[1].values[0, 0, 0, 0] = 1e-40  # the global layer's first slot
    spy = SubnormalSpy(monkeypatch, cache)
    with use_kernels("eager"):
        model(out.logits[:, -1:].argmax(-1), **cache_arg(cache))
    assert ("slots after decode_step", (1, "values")) in spy.found
    assert ("slot_attention", 2) in spy.found  # the values it attended over
