"""Drop-in reconstruction: ``model.generate`` with a ``kvzip`` cache runs the ranking pass itself.

A policy that ranks by reconstruction (``kvzip``: the ``prompt`` and ``document`` recipes) holds
the prompt whole after its forward call until the reconstruction pass ranks it. ``H2OCache``
installs this pre-hook on its model (once per model) so that no separate call is needed:

- a cache's first call (the prompt) is remembered: its ids are the text the probe repeats;
- the next call that is not one of the pass's own probe calls finds the cache read and not ranked
  (``layer.probe.awaiting``): the hook runs the pass on the remembered ids (``rank_by_probes``), and
  the call (``generate``'s first decode step) then reads on top of the ranked cache.

Ranking when the next call arrives, not at the end of the prompt's own call, leaves every
explicit caller alone: ``read_context``, ``reconstruct`` and the server's ``rank_by_probes`` rank
between the two calls, so the hook finds the cache ranked and does nothing. A cache whose pass
has run (``ask``'s copies of a ranked context) is never ranked again.

Under drop-in the whole prompt is read and ranked, its last token included, and the first new
token comes from the prompt's own call (a full cache's logits); ``read_context(prompt[:-1])``
followed by ``generate`` ranks all but the last token and reads it on the ranked cache. A
``generate`` of one new token makes no second call: its cache stays read and unranked
(``summary()`` says so).

The probe needs the tokenizer: ``H2OCache(tokenizer=...)``, else the one saved in the model's
local folder (``name_or_path``), else a one-line error.
"""

from __future__ import annotations

import os

import torch

from h2okv.core.compat import passed_cache, without_grad
from h2okv.core.reconstruction import chat_head_length, probe_spans, probes, rank_by_probes
from h2okv.errors import H2OError

_HOOKED = "_h2okv_autorank_hook"
_FOLDER_TOKENIZER = "_h2okv_folder_tokenizer"  # on the model: (its folder, that folder's tokenizer or None)


def install_hook(model) -> None:
    """Once per model: a forward pre-hook that ranks a reconstruction cache before the call that
    follows its prompt (any other cache: nothing happens)."""
    if not getattr(model, _HOOKED, False):
        model.register_forward_pre_hook(_before_call, with_kwargs=True)
        setattr(model, _HOOKED, True)


def _before_call(model, args, kwargs):
    cache = passed_cache(kwargs)
    policy = getattr(cache, "policy", None)
    if policy is None or not policy.ranks_by_reconstruction or not hasattr(cache, "prompt_ids"):
        return None  # not an H2OCache ranked by reconstruction
    layers = cache.layers
    if any(layer.probe.best is not None for layer in layers):
        return None  # the pass's own probe calls
    if not layers[0].is_initialized:
        _remember_prompt(cache, args, kwargs)
    elif all(layer.probe.awaiting for layer in layers):
        _rank(model, cache)
    return None


def _remember_prompt(cache, args, kwargs) -> None:
    """The first call: keep its ids for the probe (refuse a padded batch now, before the prefill)."""
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.to(torch.bool).all()):
        raise H2OError(f"policy {cache.policy.spec!r} ranks the prompt by repeating it, which takes no padding: "
                       f"give every row a prompt of the same length (or one prompt per cache)")
    cache.prompt_ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


@torch.compiler.disable  # a compiled first decode step runs the pass eagerly, then its own graph
def _rank(model, cache) -> None:
    ids, cache.prompt_ids = cache.prompt_ids, None
    if ids is None or ids.shape[1] != cache.get_seq_length() or ids.shape[0] != cache.rows:
        raise H2OError(f"policy {cache.policy.spec!r} ranks the prompt by repeating its ids: read it in one call "
                       f"with input_ids, or rank it with h2okv.reconstruct(model, cache, prompt_ids, tokenizer)")
    if not cache.policy.runs_probe(ids.shape[1]):  # past kvzip's probe_upto: no probe, no tokenizer
        with without_grad(cache):
            rank_by_probes(model, cache, [])
        return
    tokenizer = cache_tokenizer(model, cache)
    start = chat_head_length(tokenizer, ids[0].tolist())
    with without_grad(cache):
        rank_by_probes(model, cache, probes(tokenizer, ids, start), probe_spans(ids.shape[1], start))


def known_tokenizer(model, cache):
    """The cache's ``tokenizer=``, else the tokenizer saved in the model's local folder (kept on
    the cache), else None."""
    if cache.tokenizer is None:
        cache.tokenizer = folder_tokenizer(model)
    return cache.tokenizer


def cache_tokenizer(model, cache):
    """``known_tokenizer``, else a one-line error."""
    if known_tokenizer(model, cache) is None:
        raise H2OError(f"policy {cache.policy.spec!r} ranks the prompt by repeating it and needs the tokenizer: "
                       f"pass H2OCache(model, ..., tokenizer=tokenizer), or rank it with "
                       f"h2okv.reconstruct(model, cache, prompt_ids, tokenizer)")
    return cache.tokenizer


def folder_tokenizer(model):
    """The tokenizer in the local folder the model was loaded from, or None (never a download);
    loaded once per model and folder (a server builds a cache per request)."""
    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    found = vars(model).get(_FOLDER_TOKENIZER)
    if found is None or found[0] != path:
        found = (path, _load_folder_tokenizer(path))
        setattr(model, _FOLDER_TOKENIZER, found)
    return found[1]


def _load_folder_tokenizer(path):
    if not path or not os.path.isdir(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):  # a folder with weights and no tokenizer
        return None
