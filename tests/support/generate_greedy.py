"""Greedy generation through ``model.generate`` with a cache: the tokens and every step's scores,
what the quantized-slot tests compare bit for bit."""

import torch

from h2okv.core.compat import cache_arg


def greedy(model, ids, cache, mask=None, new=6):
    """``(new tokens [B, new], scores [new, B, vocab])`` of ``new`` greedy steps after ``ids``."""
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, **cache_arg(cache),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=1,
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores)
