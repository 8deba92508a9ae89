"""``kvzip`` (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction"; kvpress's ``KVzipPress``): a token is worth keeping if the model looks at it
while it repeats the prompt.

Question-agnostic: the ranking needs no question. After the prompt has been read whole (late
prefill, nothing evicted), ``h2okv.reconstruct`` feeds the model "repeat the previous context"
followed by the prompt itself, on top of the cache. Those probe tokens are read and never kept;
each cached token's score is the largest attention probability any probe query of its KV head's
group gives it (``core/reconstruction.py``), and each layer then evicts to its budget once. The
probe costs about one more prefill of the prompt. Decode steps afterwards add their attention mass
as in ``h2o``. The first four tokens are kept as attention sinks, as KVzip does.

``tail=N`` (default 256): once ranked, every (layer, KV head) gets ``N`` more slots, and the tokens
read after the ranking (the question, the answer) are kept whole until ``N`` of them have been read
(they are the recent window's); past that, the usual eviction goes on at the larger budget. KVzip
and kvpress compress the context only and keep the question and the answer whole. With
``head_budgets=layers`` the split leaves many heads nothing but their sinks and recent window
(Qwen2.5 0.5B, 2k prompt, 20%: 7-13 of 48 heads hold <= 8 slots), so with ``tail=0`` those heads
lose the question while it is read and the list being answered while it is written: RULER's
multi-value and multi-query needles then get one value of four (docs/RESULTS.md). The slots are
grown as tokens arrive: a cache that reads nothing after the ranking holds only its budget.

``tail_in_budget=1`` counts the tail inside the budget: the ranking keeps ``tail`` fewer heavy
slots (never fewer than the sinks) and the tail fills them, so the live tokens never pass the budget.
Not a default (recipes are chosen on measurements); at 20% of a 1,500-token prompt the ranking
then keeps about 50 of each head's 300 slots for the context. While its heads fill their tail, a
layer whose heads have uneven budgets (``head_budgets=layers``) is held flat, each head its own live
slots and a little room (``core/decode.py``: ``TailFill``): the dense layout would hold its widest
head's width for every head (issue 58: 39% of a full cache's KV at a 20% budget for 21% of its
tokens); heads at their budget are packed (``H2OCache.stats``: ``kv_share``, ``live_share``).

``kernel=K`` (odd, default 1: KVzip's own scores) gives each token the best score of the ``K``
tokens centred on it, in prompt order, before the ranking: a token next to a chosen one ranks with
it, so a value of many tokens (a number read digit by digit, a UUID) is kept whole or not at all.
Not a default: on the chat profile's 7-digit numbers (0.5B, 20%, through the prefix store) ``kernel=7``
answered 13 of 24 where KVzip's own scores answered 18 (docs/results/serve/chat-8conv-*.json): the
neighbours it keeps cost the budget other needles needed.

``question=W`` (default 0) is for a prompt that ends with its question (question aware): the
call's last ``W`` queries (the question) join the probe, so each token's score is the largest
probability the probe's queries *or the question's* give it. Reconstruction keeps what the model
needs to repeat the context (a whole UUID, a list it must count over); the question's attention
keeps what it asks about, and the question itself.

``question_share=F`` (default 0; needs ``question=W``): where the pass ranks, each head first keeps
its best ``F`` of the row's heavy slots by the question's attention alone (pooled over
``question_kernel`` tokens, and over words with ``words=1``, as past ``probe_upto``), then the rest
by the larger score as above. On the probe's scale a token the model repeats scores near 1, above
what a question gives almost any token, so without a share the question's window decides little:
on the dev split (0.5B, 2k, 20%) a several-questions needle's digits were kept in ~20% of the
(layer, head)s, as the filler was, where ``bounded``'s question ranking kept them in 55-89%.
Not a default: ``prompt`` with ``question_share=0.5`` kept those digits in 33-50% of the heads, and
on the dev split's 50 prompts scored 87.3 against 88.2 (paired -0.9, SE 1.7): several questions 70
-> 75, fwe 53 -> 60, but several values 95 -> 80 and cwe 64 -> 58, the share taken from the heads
the pass fills whole (``results/longctx/dev/prompt-qshare0.5-2k.json``).

``probe_upto=N`` (default 0: always) runs the reconstruction only for a prompt of at most ``N``
tokens; a longer one is ranked by the question's attention alone (``question=W``), each token then
taking the best score of the ``question_kernel`` tokens around it (odd, default 1), as ``snapkv``'s
pooling keeps a value of many tokens whole. The pass costs about one more prefill, and its probe
grows with the prompt; where it buys nothing measured, a long prompt skips it.

``local=1`` scores each probe chunk as KVzip's reference code does: a probe query's probabilities
for the score are a softmax over the chunk of the prompt it repeats, the first tokens (the sinks,
and a chat template's head) and the probe itself, where by default (0) they are the call's own
attention over every live slot. A long prompt's far chunks then no longer share each query's mass:
a token is scored against its own chunk, every chunk on one scale. The call's output (what the
model reads on) is the full attention either way. Prompts of one chunk (2,048 tokens) rank the
same. The server hands each probe call's span to its executor (``prompt_probes``' spans). Not a default:
`document` with it on the dev split at 6k scored 74.7 against 81.4 (paired -6.7, SE 5.8, 20 prompts;
several questions and a key lost), at 1.16x the prefill.

``ceiling=C`` (0, the default: none; else a number >= 1), with the cache-wide split
(``head_budgets=layers``): no (layer, KV head) takes more than its own best ``C`` times a uniform
head's share of the prompt, and what it would have taken goes to the next best of the others
(``core/head_budget.py``). Shared out whole, a head that copies the prompt keeps nearly all of it.
Not a default: `document` with ``ceiling=2.5`` on the dev split at 2k (the five families it is below
full in, 25 prompts) scored 59.2 against 69.0 (paired -13.9, SE 7.8): the capped heads are the ones
that keep a number's digits exact (a key's value answered ``3894865`` for ``3894861``).

A cache with this policy must be ranked by ``h2okv.reconstruct`` before it decodes: a forward call
after the prompt without one is a one-line error, never a silent full cache.
"""

from dataclasses import dataclass

import torch

from h2okv.errors import H2OError
from h2okv.policies.base import heads_option, option
from h2okv.policies.h2o import HeavyHitters
from h2okv.policies.pooling import pool_in_order
from h2okv.policies.reconstruction import ReconstructionPolicy
from h2okv.policies.window import window_probs

SINKS = 4


@dataclass(eq=False)
class KVzipPolicy(ReconstructionPolicy, HeavyHitters):
    """Ranked by the probe (``ReconstructionPolicy``), then decoded as ``h2o`` (its rule and hooks)."""

    name = "kvzip"
    sink_tokens = SINKS
    kernel: int = option(1, check=lambda v: v >= 1 and v % 2 == 1, must_be="an odd number >= 1", shown=False)
    tail: int = option(256, check=lambda v: v >= 0, must_be="an integer >= 0", shown=False)
    question: int = option(0, check=lambda v: v >= 0, must_be="an integer >= 0", shown=False)
    tail_in_budget: int = option(0, choices=(0, 1), shown=False)
    probe_upto: int = option(0, check=lambda v: v >= 0, must_be="an integer >= 0 (tokens; 0: always)", shown=False)
    question_kernel: int = option(1, check=lambda v: v >= 1 and v % 2 == 1, must_be="an odd number >= 1",
                                  shown=False)
    local: int = option(0, choices=(0, 1), shown=False)
    # 1: where the question's attention ranks alone (past probe_upto), every token of a word ranks at
    # least at the word's best unpooled score (core/words.py). Never over the pass: it scores each token
    # by how the model repeats it already, and spans only lift whole filler words into the budget (dev
    # 2k, `prompt`: 80.3 against 88.2, several values and questions lost; docs/RESULTS.md)
    words: int = option(0, choices=(0, 1), shown=False)
    ceiling: float = option(0.0, check=lambda v: v == 0 or v >= 1, must_be="0 (none) or a number >= 1", shown=False)
    # a share of each head's heavy slots the question's attention picks first, where the pass ranks
    # (its pool and word spans as past probe_upto); the pass ranks the rest. Why: on the probe's
    # scale every token the model repeats scores near 1, above any question's probability, so the
    # question changed almost nothing the pass kept (dev 2k: a needle's digits in 20% of the heads,
    # the filler's share; docs/RESULTS.md)
    question_share: float = option(0.0, check=lambda v: 0 <= v <= 1, must_be="a number in [0, 1]", shown=False)
    heads: str = heads_option()

    def __post_init__(self):
        super().__post_init__()
        if self.probe_upto and not self.question:
            raise H2OError(f"{self.name} probe_upto ranks a longer prompt by its question's attention alone: "
                           f"give question=W too")
        if self.question_share and not self.question:
            raise H2OError(f"{self.name} question_share reserves slots for the question's attention: give question=W too")
        if self.words and not self.probe_upto:
            raise H2OError(f"{self.name} words spans the question's attention past probe_upto, never the pass: "
                           f"give question=W and probe_upto=N too")

    def runs_probe(self, prompt_tokens: int) -> bool:
        """Whether a prompt of this many tokens is ranked by the reconstruction pass (``probe_upto``);
        else by the question's attention alone."""
        return not self.probe_upto or prompt_tokens <= self.probe_upto

    def question_scores(self, query, key_new, old_keys, old_valid, new_real, scaling):
        """``(old [B, Hkv, cap], new [B, Hkv, n])`` for the call the probe will rank (``question=W``):
        each token's largest attention probability from the call's last ``W`` queries (any query
        head of its KV head's group), on the probe's scale; the ranking takes the larger of the two.
        None with ``question=0``: the probe alone ranks."""
        if self.question == 0:
            return None
        probs, counts = window_probs(query, key_new, old_keys, old_valid, new_real, scaling, self.question)
        best = (probs * counts[:, None, None, :, None]).amax(dim=(2, 3))  # [B, Hkv, cap + n]
        cap = old_keys.shape[2]
        return best[..., :cap], best[..., cap:]

    def smooth_probe(self, scores: torch.Tensor, ordinal: torch.Tensor, valid: torch.Tensor,
                     probed: bool = True) -> torch.Tensor:
        """``scores`` ``[B, H, cap]`` (each live slot's reconstruction score), each the largest of the
        ``kernel`` live tokens around it in prompt order (``ordinal``); free slots stay 0. A prompt
        ranked by its question alone (not ``probed``) pools over ``question_kernel`` tokens."""
        return pool_in_order(scores, ordinal, valid, self.kernel if probed else self.question_kernel, "max")
