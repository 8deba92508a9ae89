"""The protocol of a policy whose prompt is ranked by a reconstruction pass (``kvzip``).

Such a policy holds a prompt whole until ``h2okv.reconstruct`` (``core/reconstruction.py``) has fed
the model a probe on top of it; the core then asks it the hooks below, and only then (it checks
``ranks_by_reconstruction`` first): the other policies have no probe and none of these members.
"""

from __future__ import annotations

import torch

from h2okv.policies.base import Policy


class ReconstructionPolicy(Policy):
    ranks_by_reconstruction = True
    #: tokens read after the ranking (the question, the answer) kept whole on top of the budget
    #: (``kvzip``'s ``tail`` option); 0: evicted back to the budget like any other
    tail: int = 0
    #: 1: that tail counts inside the budget, the ranking keeps ``tail`` fewer heavy slots
    tail_in_budget: int = 0
    #: the prompt's last queries whose attention joins the ranking (``question_scores``); 0: the
    #: reconstruction alone ranks
    question: int = 0
    #: 1: each probe chunk's scores are a softmax over the chunk it repeats (and the sinks and the
    #: prompt's chat head) only, not over every live slot (``kvzip``'s ``local``)
    local: int = 0

    @property
    def slots_above_budget(self) -> int:
        return 0 if self.tail_in_budget else self.tail

    def runs_probe(self, prompt_tokens: int) -> bool:
        """Whether a prompt of this many tokens is ranked by the probe (``kvzip``'s ``probe_upto``);
        else by the scores its own call set (the question's attention). Always, by default."""
        return True

    def smooth_probe(self, scores: torch.Tensor, ordinal: torch.Tensor, valid: torch.Tensor,
                     probed: bool = True) -> torch.Tensor:
        """The probe's per-slot scores ``[B, H, cap]``, reshaped before the one eviction (``kvzip``'s
        ``kernel``; ``probed`` False: no probe ran); as they are by default."""
        return scores

    def question_scores(self, query, key_new, old_keys, old_valid, new_real, scaling):
        """Scores the prompt starts at before the probe adds its own (``kvzip:question=W``): ``(old,
        new)`` as ``prefill_scores``; None by default (the probe alone ranks)."""
        return None
