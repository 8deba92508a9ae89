"""The one place that knows how transformers' own API moved across the 5.x releases we support.

transformers 5.24 renamed the cache argument of every model's ``forward`` and ``generate`` from
``past_key_values`` to ``cache``: the old name still works there with a ``FutureWarning``, and is
to go in 5.40. Releases before 5.24 know only the old name, and the new one would vanish into their
``**kwargs`` without a word (the model would run with a fresh cache, no eviction at all), so the name
is read off the installed library instead of guessed from its version string.
"""

from __future__ import annotations

import inspect
from functools import cache as _once


def config_head_dim(config) -> int:
    """A (text) config's attention head dimension: ``head_dim`` where the config names it (Gemma,
    Qwen3), else the hidden size over the query heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@_once
def cache_kwarg() -> str:
    """``"cache"`` where the installed transformers takes it, else ``"past_key_values"``."""
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_arg(cache) -> dict:
    """``model(ids, **cache_arg(cache))``: the cache under the name this transformers reads."""
    return {cache_kwarg(): cache}


def passed_cache(kwargs: dict):
    """The cache a model call was given, under either name: a forward hook sees the caller's
    spelling (``generate`` and the task heads pass the new name on, a user may write the old)."""
    return kwargs["cache"] if kwargs.get("cache") is not None else kwargs.get("past_key_values")


def without_grad(cache=None):
    """``torch.inference_mode()`` when the caller is in it, or when ``cache`` already holds tensors
    made in it; else ``torch.no_grad()``: what h2okv reads into a user's cache must stay updatable
    in the mode the user goes on in. A tensor made under inference mode cannot be updated in place
    outside it, and ``model.generate`` decodes under ``no_grad`` (a ``prompt``-recipe cache ranked in
    inference mode inside ``generate`` failed its next step); a prompt read under inference mode is
    ranked in it too."""
    import torch

    held = cache is not None and any(
        layer.is_initialized and layer.keys.is_inference() for layer in getattr(cache, "layers", ()))
    return torch.inference_mode() if torch.is_inference_mode_enabled() or held else torch.no_grad()
