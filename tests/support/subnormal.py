"""Counting subnormal floats in the slot state and in what the steps and the slot attention see
(tests/core/test_subnormal.py, tests/core/test_gemma3.py)."""

import torch

import h2okv.core.decode as decode_mod
import h2okv.core.layer as layer_mod
import h2okv.core.step as step_mod
from decode_spy import spy_decode_steps


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
        spy_decode_steps(monkeypatch, lambda step: self._wrap("decode_step", step))
        for mod, name in ((layer_mod, "chunk_step"), (step_mod, "slot_attention"), (decode_mod, "slot_attention")):
            monkeypatch.setattr(mod, name, self._wrap(name.split(".")[-1], getattr(mod, name)))

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
