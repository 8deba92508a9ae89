"""No subnormal float reaches the attention or the slot state.

A subnormal operand can make a CPU's arithmetic many times slower (microcode assists on many x86
cores) unless the process flushes them (``torch.set_flush_denormal``), a flag a library should not
flip for its users. Nothing in the core makes one from ordinary activations: free slots are zeros
(``storage.py``), masked logits are ``-inf`` (so their probability is exactly 0), and scores only
add probabilities. These tests hold that on Gemma-3's layer mix (sliding-window and global layers,
one KV head), where the issue that asked for them saw a slow attention (issue 38, item 8); the
real Gemma-3-270M is checked in ``test_gemma3.py``.
"""

import pytest

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.kernels import use_kernels
from h2okv.tools.tiny import random_ids, tiny_model
from subnormal import SubnormalSpy, slot_subnormals


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
    with use_kernels("eager"):  # a layer's engine is chosen when its prompt has been read
        out = model(ids, **cache_arg(cache))
        cache.layers[1].values[0, 0, 0, 0] = 1e-40  # the global layer's first slot
        spy = SubnormalSpy(monkeypatch, cache)
        model(out.logits[:, -1:].argmax(-1), **cache_arg(cache))
    assert ("slots after decode_step", (1, "values")) in spy.found
    assert ("slot_attention", 2) in spy.found  # the values it attended over
