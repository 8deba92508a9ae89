"""``snapkv`` (Li et al. 2024): the prompt's last ``window`` queries pick which prompt tokens stay.

At the end of a prompt the question usually sits in its last tokens, and what those queries attend
to is what the answer will need. So a multi-token forward call is ranked, before it is chunked,
by the attention its last ``window`` real queries pay to every key they can see (each window
query over the kept old slots and the call's own tokens up to itself: one ``[window x keys]``
softmax per layer, never ``prompt x prompt``), smoothed over neighbouring positions with an
average pool of ``kernel`` tokens as SnapKV does (a needle is several tokens). These scores are
fixed before the first chunk runs, so evicting the lowest chunk by chunk keeps the same set as
ranking once at the end. After the prompt, decode steps add their attention mass as in ``h2o``
(with ``decay`` below 1, older mass fades: the window keeps moving as the answer is written).
``pool=max`` smooths by the largest neighbour instead of the mean: a token next to a chosen one
ranks with it, so a value of many tokens (a UUID) is kept whole rather than in pieces.
``chunk=C`` (ChunkKV, Liu et al. 2025) then gives every token of each aligned block of ``C`` tokens
(counted from the call's first token) the block's mean score: a block is kept or evicted as one
span, as kvpress's ``ChunkKVPress`` keeps whole chunks. ``words=1`` then raises every token of a
word (a run with no whitespace) to at least the word's best unpooled score (``core/words.py``): a
UUID is kept whole however far it reaches past the kernel.

A forward call of a single token is a decode step. ``chunk_size=1`` (token-by-token scoring,
``eval ppl``) means "read as if decoded", so there is no prompt boundary and ``snapkv`` is ``h2o``
there. When a prompt arrives in several forward calls (the server's prefill chunks), each call's
window ranks the kept old slots and the call's tokens; the last call's window has the final say
over everything still kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from h2okv.policies.base import heads_option, option
from h2okv.policies.h2o import HeavyHitters, decay_option
from h2okv.policies.pooling import pool_in_order
from h2okv.policies.window import window_probs

TIE_BREAK = 1e-3  # of a token's own score, added to its block's mean (``chunk``)


@dataclass(eq=False)
class SnapKVPolicy(HeavyHitters):
    name = "snapkv"
    ranks_upfront = True
    streams = True
    window: int = option(32, check=lambda v: v >= 1, must_be=">= 1")
    kernel: int = option(7, check=lambda v: v >= 1 and v % 2 == 1, must_be="an odd number >= 1")
    # max: a token takes its best neighbour's mass, so a chosen token keeps the whole span around it
    # (a value of many tokens, a UUID); avg (SnapKV's): smoothed
    pool: str = option("avg", choices=("avg", "max"), shown=False)
    # ChunkKV: whole blocks of this many tokens share one score (0: token by token)
    chunk: int = option(0, check=lambda v: v >= 0, must_be=">= 0", shown=False)
    decay: float = decay_option()  # decode steps re-rank by the latest queries: SnapKV's window, kept moving
    # 1: after the pool, every token of a word (no whitespace inside) ranks at least at the word's
    # best unpooled score, so a value longer than the kernel reaches (a UUID: ~34) stays whole
    words: int = option(0, choices=(0, 1), shown=False)
    heads: str = heads_option()

    def smooth_held(self, scores: torch.Tensor, ordinal: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``scores`` ``[B, H, cap]`` of the held slots (a streamed probe's mass), pooled as a call's
        tokens are (``kernel``, ``pool``) but over the live slots in prompt order: after an
        eviction the slots are out of order (``policies/pooling.py``). A thousandth of each slot's
        own mass breaks the ties the pool makes (a kept span shares its best token's score): a
        row's choice among equals must not depend on how many slots the batch's widest row evicts
        at once (``topk`` of another ``k`` picks other equals), so a row alone keeps what it keeps
        in a batch."""
        return pool_in_order(scores, ordinal, valid, self.kernel, self.pool) + TIE_BREAK * scores

    def prefill_scores(self, query, key_new, old_keys, old_valid, new_real, scaling, value_new=None, old_values=None,
                       old_in_order=None):
        """``(old [B, Hkv, cap], new [B, Hkv, n])``: the window's attention mass per slot / new token
        (``prefill_mass``), pooled (``pool_call``)."""
        old, new = self.prefill_mass(query, key_new, old_keys, old_valid, new_real, scaling)
        return self.pool_call(old, new, new_real, old_in_order)

    def prefill_mass(self, query, key_new, old_keys, old_valid, new_real, scaling):
        """``(old [B, Hkv, cap], new [B, Hkv, n])``: the mass the window's queries pay each slot and
        new token, before any pool (``words=1`` reads it: core/words.py).

        ``query`` ``[B, Hq, n, D]`` and ``key_new`` ``[B, Hkv, n, D]`` hold each row's real tokens
        first; ``new_real`` ``[B]`` counts them; ``old_valid`` ``[B, Hkv, cap]`` marks live old slots.
        """
        cap = old_keys.shape[2]
        probs, counts = window_probs(query, key_new, old_keys, old_valid, new_real, scaling, self.window)
        mass = (probs * counts[:, None, None, :, None]).sum(dim=(2, 3))  # [B, Hkv, cap + n]
        return mass[..., :cap], mass[..., cap:]

    def pool_call(self, old, new, new_real, old_in_order=None):
        """The call's mass smoothed over ``kernel`` neighbours (``pool``), across the call's start
        where the old slots are its row's first tokens in order (``old_in_order``), then ChunkKV's
        blocks (``chunk``)."""
        n = new.shape[-1]
        if self.kernel > 1 and n > 1:
            if old_in_order is None or not bool((old_in_order > 0).any()):
                new = self.smooth(new, new_real)
            else:  # nothing evicted yet: the old slots are the tokens before the call, in order
                old, new = self.smooth_across(old, new, old_in_order, new_real)
        if self.chunk > 1 and n > 1:
            new = self.chunk_mean(new, new_real)
        return old, new

    def chunk_mean(self, new, new_real):
        """Each aligned block of ``chunk`` real tokens takes its mean score (a row's last block may
        be shorter: the mean of what it holds); pads stay 0, so a padded row is ranked as alone.
        A thousandth of each token's own score breaks the ties inside a block (the block's weakest
        token goes first when only part of it fits): equal keys would leave the choice to the
        slot layout, and a padded batch would then keep other tokens than its rows alone."""
        b, hkv, n = new.shape
        c = self.chunk
        real = torch.arange(n, device=new.device)[None, :] < new_real[:, None]  # [B, n]
        blocks = -(-n // c)
        padded = F.pad(new.masked_fill(~real[:, None], 0.0), (0, blocks * c - n)).view(b, hkv, blocks, c)
        counts = F.pad(real.float(), (0, blocks * c - n)).view(b, 1, blocks, c).sum(-1, keepdim=True)
        means = padded.sum(-1, keepdim=True) / counts.clamp(min=1.0)
        shared = means.expand(b, hkv, blocks, c).reshape(b, hkv, blocks * c)[..., :n]
        return (shared + TIE_BREAK * new).masked_fill(~real[:, None], 0.0)

    def smooth_across(self, old, new, held, new_real):
        """Pool the held old slots and the call's tokens as one sequence where a row's old slots
        ``0 .. held - 1`` are its first tokens in order (``held`` ``[B]``; -1: the row's call is
        pooled alone, its old slots as they are), so a span that straddles
        the call's start ranks as it would have read in one call: a history held whole and a
        question read on it keep a value of many tokens whole, as one call over both would."""
        old, new = old.clone(), new.clone()
        for b in range(old.shape[0]):
            h, r = int(held[b]), int(new_real[b])
            if h < 0:
                new[b:b + 1] = self.smooth(new[b:b + 1], new_real[b:b + 1])
                continue
            joined = torch.cat([old[b, :, :h], new[b, :, :r]], dim=-1)[None]
            pooled = self.smooth(joined, torch.tensor([h + r], device=joined.device))[0]
            old[b, :, :h], new[b, :, :r] = pooled[:, :h], pooled[:, h:]
        return old, new

    def smooth(self, new, new_real):
        """Each new token's mass averaged with its neighbours' (``pool=max``: the largest of them) in
        token order (the call's tokens are in order; old slots are not, unless nothing was evicted:
        ``smooth_across``), over the row's real tokens only: rows are pooled by their real length,
        so a padded row is pooled exactly as it would be alone (a pad's zero counted among a last
        token's neighbours would lower it). Named apart from the ``pool`` option it reads."""
        b, hkv, n = new.shape
        pooled = torch.zeros_like(new)  # a pad's score: it is never kept as a real token
        for length in new_real.unique().tolist():
            if length == 0:
                continue
            rows = (new_real == length).nonzero().flatten()
            part = new[rows, :, :length].reshape(-1, 1, length)
            if self.pool == "max":
                smoothed = F.max_pool1d(part, self.kernel, stride=1, padding=self.kernel // 2)
            else:
                smoothed = F.avg_pool1d(part, self.kernel, stride=1, padding=self.kernel // 2, count_include_pad=False)
            pooled[rows, :, :length] = smoothed.view(len(rows), hkv, length)
        return pooled
