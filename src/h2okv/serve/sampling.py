"""Next-token choice per request: greedy at temperature 0, else temperature + nucleus (top-p) sampling
with the request's own seeded generator (so ``seed`` reproduces a completion whatever the batch).

Temperatures below ``GREEDY_BELOW`` (1e-5, vLLM's ``_SAMPLING_EPS``) are greedy: dividing logits by
1e-40 overflows float32 to inf and the softmax to NaN, and any temperature that small already puts
all the probability on the argmax (a logit gap of 0.001 becomes a factor e^100)."""

from __future__ import annotations

import secrets

import torch

GREEDY_BELOW = 1e-5


def make_generator(seed: int | None, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else secrets.randbits(63))
    return gen


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token id from ``logits`` ``[vocab]``."""
    if temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        drop[0] = False  # even for a top_p that float32 rounds to 0 (5e-324)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
