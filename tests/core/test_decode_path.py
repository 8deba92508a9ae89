"""One decode step at the budget, file by file, as docs/ARCHITECTURE.md walks it: transformers'
hook (``attention.py``) -> the layer (``layer.py``) -> its stepper (``decode.py``) -> the kernel
(``native/calls.py`` on CPU), and the feed-forward's slice check (``feed_forward.py``: one token
goes straight through). A profiler records every project function a step calls; if the walk
grows (a new hop, a per-call engine choice in another module), this fails."""

import sys
from pathlib import Path

import pytest
import torch

import h2okv
from h2okv import H2OCache
from h2okv.core import decode
from h2okv.core.compat import cache_arg
from h2okv.core.kernels import unavailable_reason, use_kernels
from h2okv.tools.tiny import random_ids, tiny_model

SRC = Path(h2okv.__file__).resolve().parent


def files_entered(fn) -> set[str]:
    """The project files (relative to ``src/h2okv``) whose Python functions ``fn()`` calls."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(SRC):
                seen.add(str(path.relative_to(SRC)))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def at_budget(kernels: str):
    model = tiny_model("llama")  # a fresh model: no other test's hooks on it
    cache = H2OCache(model, budget=16)
    with use_kernels(kernels):
        out = model(input_ids=random_ids(40, batch=2), **cache_arg(cache), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        model(input_ids=token, **cache_arg(cache), use_cache=True)  # the first step at the budget
    return model, cache, token


def test_a_decode_step_at_the_budget_enters_five_project_files():
    if unavailable_reason("native", torch.device("cpu")):
        pytest.skip("no C compiler: the CPU step is eager (test below)")
    model, cache, token = at_budget("native")
    assert all(isinstance(layer.stepper, decode.NativeStep) for layer in cache.layers)
    with use_kernels("native"), torch.inference_mode():
        kwargs = cache_arg(cache)
        entered = files_entered(lambda: model(input_ids=token, **kwargs, use_cache=True))
    assert entered == {"core/attention.py", "core/layer.py", "core/decode.py", "core/native/calls.py",
                       "core/feed_forward.py"}


def test_the_eager_step_adds_only_the_eviction_rule_and_the_policys_hooks():
    model, cache, token = at_budget("eager")
    assert all(isinstance(layer.stepper, decode.EagerStep) for layer in cache.layers)
    with use_kernels("eager"), torch.inference_mode():
        kwargs = cache_arg(cache)
        entered = files_entered(lambda: model(input_ids=token, **kwargs, use_cache=True))
    # storage.py: the slots' own write and read (``write_kv``, ``kv``: coded where they are quantized)
    assert entered == {"core/attention.py", "core/layer.py", "core/decode.py", "core/step.py", "core/storage.py",
                       "policies/base.py", "policies/h2o.py", "core/feed_forward.py"}
