"""Streamed prefill (``prefill="streamed"``): a long prompt read through the whole model in pieces,
each piece ranked by the prompt's own last tokens, so the peak memory is the budget plus one piece
whatever the prompt's length.

Why: a prompt read in one forward call holds every token's hidden states in each layer (about
30 KB a token on Qwen2.5-0.5B in float32) while the cache holds only its budget: at 16k tokens the
activations outweigh a 20% cache several times over. Chunking inside the call bounds the K/V, not
the activations. Reading the prompt in several calls bounds both, but a question-aware policy
(``snapkv``) then ranks each call by that call's own last queries, before the question exists.

How (the idea of FINCH, Corallo & Papotti 2024, "prompt-guided KV cache compression", and of
SnapKV's observation window): the prompt's last ``window`` tokens (the question, where a prompt
ends with one) are known before anything is read. ``read_streamed`` reads the rest in pieces of
``chunk_size`` tokens; after each piece it reads those last tokens on top of the cache as a probe
(attended like any call, never kept, positions not advanced), and every layer ranks what it
holds by the attention mass the probe's queries pay each slot (summed over the query heads of a
KV head's group, pooled over neighbours in prompt order as the policy pools), then evicts to its
budget. A layer therefore holds at most budget + piece slots, and each forward call at most a
piece's activations. The prompt's last piece and the probe's tokens themselves are left to the
caller's next call (``generate``'s prompt call), which reads them as a chunked prefill does.

Cost: one more forward of ``window`` tokens per piece (32 tokens per 512: about 6% more prefill).
What it changes: a piece is ranked by the probe's queries as they read a cache holding the kept
slots and that piece, not the whole prompt; the kept set is not the one-call ranking's.

Drop-in: ``H2OCache`` with ``prefill="streamed"`` installs a forward pre-hook on its model
(``install_hook``) that streams a prompt's first call before it runs and hands the model the rest:
``model.generate(ids, cache=cache)`` then holds budget + one piece too. A padded batch, a 4D mask
or embeddings instead of ids are read in one call, chunked, as ``prefill="chunked"`` reads them.
"""

from __future__ import annotations

import torch

from h2okv.core.compat import cache_arg, passed_cache, without_grad
from h2okv.errors import H2OError

_HOOKED = "_h2okv_streamed_hook"


def streamed_tokens(prompt_len: int, chunk_size: int, window: int) -> int:
    """How many of a prompt's first tokens ``read_streamed`` reads: whole pieces of ``chunk_size``
    before the last piece and the probe's ``window`` tokens (0 when there is one piece)."""
    context = prompt_len - window
    if context <= chunk_size:
        return 0
    return (context - 1) // chunk_size * chunk_size


def read_streamed(model, cache, ids: torch.Tensor) -> int:
    """Read all of ``ids`` ``[rows, n]`` (one length, no padding) but its last piece and probe
    window into ``cache`` (``prefill="streamed"``), piece by piece, each ranked by the probe;
    returns how many tokens were read (0: the prompt fits one piece, nothing was read). The caller
    then reads ``ids[:, returned:]`` (``model.generate`` given all of ``ids`` feeds only those).
    The budget is fixed by the whole prompt first, so a fraction is of the prompt, not of a piece."""
    if cache.prefill != "streamed" or cache.chunk_size < 2:  # chunk_size=1: read as if decoded, no pieces
        return 0
    ids = torch.as_tensor(ids)
    if ids.dim() != 2:
        raise H2OError(f"read_streamed takes [rows, tokens] ids, got shape {tuple(ids.shape)}")
    if cache.get_seq_length() != 0:
        raise H2OError("read_streamed reads a prompt into an empty cache; this one has read "
                       f"{cache.get_seq_length()} tokens")
    window = cache.policy.window  # a streaming policy's observation window (CacheSettings checked it)
    upto = streamed_tokens(ids.shape[1], cache.chunk_size, window)
    if upto == 0:
        return 0
    cache.row_budgets.for_call(torch.ones_like(ids, dtype=torch.bool), "cpu")
    probe = ids[:, -window:]
    with without_grad(cache):
        for start in range(0, upto, cache.chunk_size):
            for layer in cache.layers:
                layer.set_stream("hold")
            model(input_ids=ids[:, start:start + cache.chunk_size], **cache_arg(cache), use_cache=True,
                  logits_to_keep=1)
            for layer in cache.layers:
                layer.set_stream("probe")
            try:
                model(input_ids=probe, **cache_arg(cache), use_cache=True, logits_to_keep=1)
            finally:
                for layer in cache.layers:
                    layer.set_stream(None)
    return upto


def install_hook(model) -> None:
    """Once per model: a forward pre-hook that streams the prompt of a ``prefill="streamed"`` cache
    (any other cache, or any later call: nothing happens)."""
    if not getattr(model, _HOOKED, False):
        model.register_forward_pre_hook(_before_call, with_kwargs=True)
        setattr(model, _HOOKED, True)


def _before_call(model, args, kwargs):
    cache = passed_cache(kwargs)
    if getattr(cache, "prefill", None) != "streamed" or cache.get_seq_length() != 0:
        return None
    if any(layer.stream is not None for layer in cache.layers):
        return None  # read_streamed's own calls
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if args or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None  # positional arguments or embeddings: read in one call, chunked
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.all())):
        return None  # padding: read in one call, chunked
    upto = read_streamed(model, cache, ids)
    if upto == 0:
        return None
    kwargs = dict(kwargs, input_ids=ids[:, upto:])
    for name in ("position_ids", "cache_position"):  # what generate computed for the whole prompt
        if isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name] = kwargs[name][..., upto:]
    return args, kwargs
