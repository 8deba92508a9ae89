"""A context held whole until its question ranks it (``read_context(..., hold=True)``).

A policy that ranks a call by its last queries (``snapkv``'s look-back window, the ``bounded``
recipe: ``Policy.ranks_upfront``) keeps what the end of the call asks for. Read before any question
exists, a document is then ranked by its own last sentences, and the question that comes later
finds what those needed: on the test split's real questions (SQuAD, DROP, CoQA, planted facts, four
a document; 0.5B, 2k, 20%) `bounded` so kept 39% of full's F1, where reading each question with its
document kept 96%, and holding it 95% at a quarter of those prompt tokens (docs/RESULTS.md).

Held, the context is read evicting nothing, and the budget is set once it has been read: nothing
is evicted then, and the next call of two tokens or more (the question, on the cache or on each of
``h2okv.ask``'s copies) ranks everything held with its own queries and brings each row down to the
budget. Read chunked or late, that keeps what one call of
document and question keeps (tested); streamed (``bounded``), the held slots are pooled in prompt
order once more, as streamed pieces are (``SlotLayer._prefill_scores``). The server holds a chat's
history so (``serve/engine.py``, ``Engine.held_history``).

The cost is memory: until a question is read the cache holds the whole context's K/V (``ask``'s
copies, and every answer, are at the budget). A fraction of a budget is taken of the context.
"""

from __future__ import annotations

import warnings

from h2okv.errors import H2OError

HOLD_ALL = 1 << 30  # a budget no prompt reaches: a row held whole evicts nothing


def ranks_by_question(policy) -> bool:
    """Whether ``policy`` (a class or an instance) ranks a call by the call's last queries, so that a
    context held whole is ranked by the question read after it: the library's ``read_context`` and
    the server's held history (``Engine.held_history``) hold for such a policy only."""
    return policy.ranks_upfront and not policy.ranks_by_reconstruction


def can_hold(cache) -> str | None:
    """Why ``cache`` cannot hold a context for its question (a one-line reason), None when it can."""
    policy = cache.policy
    if not policy.evicts:
        return f"policy {policy.spec!r} keeps everything"
    if not ranks_by_question(policy):
        return (f"policy {policy.spec!r} does not rank a call by its last queries (only such a policy, "
                f"snapkv or the bounded recipe, ranks a held context by its question)")
    if cache.head_budgets != "uniform":
        return f"head_budgets={cache.head_budgets!r} shares slots out at the read (hold needs 'uniform')"
    if cache.row_budgets.protect_prompt:
        return "the cache keeps its prompt whole already (protect_prompt)"
    if cache.get_seq_length():
        return "the cache has read tokens already (hold a context into a fresh cache)"
    return None


def wants_hold(cache, hold: bool | None) -> bool:
    """Whether ``read_context`` holds the context: ``hold`` None holds where the cache can; True
    where it cannot is a one-line ``H2OError``; False never holds (the context compressed at once)."""
    reason = can_hold(cache)
    if hold and reason is not None:
        raise H2OError(f"read_context(hold=True): {reason}")
    return bool(hold if hold is not None else reason is None)


def hold_rows(cache, rows: int) -> None:
    """Before the read: every row's budget is one no context reaches."""
    cache.row_budgets.fix([(HOLD_ALL, 1)] * rows)


def release(cache, length: int) -> None:
    """After the read of ``length`` tokens a row: each row takes its budget (of that length, for a
    fraction); nothing is evicted until the next call of two tokens or more ranks what is held."""
    cache.set_budgets([cache.row_budgets.spec.resolve(length)] * cache.rows)
    cache.row_budgets.awaiting_question = True  # a one-token call is refused until then (SlotLayer.attend)


def check_call(rows, tokens: int) -> None:
    """A call of ``tokens`` on a layer whose rows' context is held (``RowBudgets``): one of two or
    more ranks it, and the wait is over; a single token (a decode step) could evict one slot of the
    whole context, not bring it down to the budget, so it is a one-line error."""
    if tokens >= 2:
        rows.awaiting_question = False
        return
    raise H2OError("this cache holds a context whole for its question (read_context held it): read a question "
                   "of two tokens or more first, or read the context with read_context(..., hold=False)")


def warn_if_ranked_by_its_end(cache, length: int) -> None:
    """A policy that ranks a context this long by its last queries alone, read before its question
    and not held (``kvzip`` with ``question=W`` past ``probe_upto``: the ``prompt`` recipe past
    2,560 tokens), keeps what the context's own end asks for: on the test split's real questions at
    8k, read once, `prompt` kept 60% of full's F1 where `bounded`, held, kept 93%. The warning
    names what to use instead."""
    policy = cache.policy
    runs_probe = getattr(policy, "runs_probe", None)
    if runs_probe is None or not getattr(policy, "question", 0) or runs_probe(length):
        return
    warnings.warn(f"h2okv: policy {policy.spec!r} ranks a context past probe_upto tokens by its "
                  f"last queries alone, so read before its question it keeps what the context's own end asks "
                  f"for; for a document read once use recipe='bounded' (held for its question) or 'document'",
                  UserWarning, stacklevel=3)
