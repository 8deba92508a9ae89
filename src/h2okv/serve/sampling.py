"""Next-token choice for a step's rows: greedy at temperature 0, else temperature + nucleus (top-p)
sampling with each request's own seeded generator (so ``seed`` reproduces a completion whatever the
batch).

Temperatures below ``GREEDY_BELOW`` (1e-5, vLLM's ``_SAMPLING_EPS``) are greedy: dividing logits by
1e-40 overflows float32 to inf and the softmax to NaN, and any temperature that small already puts
all the probability on the argmax (a logit gap of 0.001 becomes a factor e^100).

The whole step's choices stay on the device until one copy to the host (``.tolist()``): on a GPU,
a copy per row would wait for the device once per row per step."""

from __future__ import annotations

import secrets

import torch

GREEDY_BELOW = 1e-5
INVALID = -1  # the choice of a row whose distribution holds a NaN (an inf or NaN logit)


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of ``logits`` ``[rows, vocab]`` (the first, on a tie; a NaN wins, as in
    torch), on the host. Float32 logits on the CPU go through numpy: torch's argmax costs ~37 us for
    64 rows of the tests' 259-token vocabulary on one thread, numpy's ~6 us, once a decode step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def make_generator(seed: int | None, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else secrets.randbits(63))
    return gen


def sample_batch(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
                 generators: list[torch.Generator]) -> list[int]:
    """One token id per row of ``logits`` ``[rows, vocab]``, row ``i`` with ``temperatures[i]``,
    ``top_ps[i]`` and ``generators[i]``; ``INVALID`` for a sampled row whose probabilities hold a NaN."""
    chosen = logits.argmax(-1)  # the greedy rows' choice, in one op; sampled rows overwrite theirs
    for i, (temperature, top_p, generator) in enumerate(zip(temperatures, top_ps, generators, strict=True)):
        if temperature >= GREEDY_BELOW:
            # one row at a time: each draws from its own generator, and a row's arithmetic is the
            # same in any batch (a batched softmax or sort could round or order ties differently)
            chosen[i:i + 1] = _draw(logits[i], temperature, top_p, generator)
    return chosen.tolist()


def _draw(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """A token id ``[1]`` (on the device) sampled from ``logits`` ``[vocab]``."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p. The first token always stays: the mass
        # before it is exactly 0, and the floor keeps a top_p that float32 rounds to 0 (5e-324) above
        # it. (A comparison, not `drop[0] = False`: on a GPU, setting an element from a Python value
        # copies it from the host, the likely cause of the 4 waits a step, not 1, an H200 counted)
        drop = probs.cumsum(-1) - probs >= max(top_p, torch.finfo(torch.float32).tiny)
        probs = probs.masked_fill(drop, 0.0)
    # torch.multinomial's own draw for one sample (argmax of p / q, q ~ Exp(1)), so the same
    # generator gives the same token; written out because multinomial checks its input with a
    # host sync (older torch) or a device-side assert (newer: fatal to the CUDA context), where a
    # NaN here becomes INVALID and fails only its own request
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    choice = torch.argmax(probs / q, dim=-1, keepdim=True)
    if order is not None:
        choice = order.gather(0, choice)
    # a softmax gives [0, 1] or NaN, so NaN is the one bad input multinomial would reject
    return torch.where(probs.isnan().any(), INVALID, choice)
