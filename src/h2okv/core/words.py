"""Word spans (policy option ``words=1``): a token takes at least the best score of the word it is part of.

Why: a value of many tokens must be kept whole. Qwen's tokenizer reads a UUID as ~34 tokens (hex
digits one by one), and the question's attention lands on its first and last tokens: a pool of
``kernel=31`` (15 either side) reaches 15 tokens in from each end, so the middle token (the
fourth group's first digit) ranked low, was evicted, and the answer lost one character
(``...-933c-`` answered ``...-333c-``: every UUID ``bounded`` missed on the test split, at 2k, 8k and
16k). A wider kernel keeps that digit and wastes its slots on the filler around every chosen token.
A word (a run of tokens with no whitespace inside) is the unit a value is written in, so every
token of a word takes at least the word's best raw score: the UUID stays whole, and a word the
kernel already reaches across (every ordinary one) ranks exactly as without spans.

How: the cache reads each call's token ids before the model runs (a forward pre-hook, ``install_hook``)
and records them per row by ordinal (``WordRecord``, shared by the layers through ``RowBudgets``),
which numbers the words when a layer asks. A token starts a word when its text begins with whitespace or the token
before it ends with whitespace (``word_edges``, from the tokenizer's vocabulary); a word is cut every
``MAX_WORD_TOKENS`` tokens, so a long run without spaces (code, a base64 blob) is not one span. Where
a layer pools a ranking (a streamed probe's mass, a prompt's look-ahead scores, the reconstruction
pass), it then raises each live slot to its word's best unpooled score (``span_max``) over the live
slots of its row and head. A call writes its ids at each row's ordinals from the count of tokens the row has read; a
probe's call (read, never kept) writes nothing, nor does a decode step (never pooled; its token
stands alone).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from h2okv.core.compat import passed_cache

# the most tokens one span holds: a longer run without whitespace is cut into spans of this many
MAX_WORD_TOKENS = 64
# of a slot's own score, added after the span's maximum: tokens of one span then keep their order
# among themselves, so a row's choice among them does not depend on how many a batch evicts at once
TIE_BREAK = 1e-3
_WHITESPACE = frozenset(" \t\n\r\u0120\u010a\u0109\u2581")  # and byte-level BPE's / SentencePiece's marks
_HOOKED = "_h2okv_words_hook"
_EDGES = "_h2okv_word_edges"


def word_edges(tokenizer, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(begins, ends)`` ``[vocab]`` bool: whether a token's text begins / ends with whitespace.
    Special tokens (a chat template's markers) count as both: a span never crosses them. The
    vocabulary is read with ``convert_ids_to_tokens`` (the marks byte-level BPE and SentencePiece
    write for a space), else ``decode`` one id at a time, over ``len(tokenizer)`` ids (else ``size``:
    the model's vocabulary); None for a tokenizer that gives neither."""
    found = getattr(tokenizer, _EDGES, None)
    if found is None:
        size = len(tokenizer) if hasattr(tokenizer, "__len__") else size
        convert, decode = getattr(tokenizer, "convert_ids_to_tokens", None), getattr(tokenizer, "decode", None)
        if not size or (convert is None and decode is None):
            return None
        pieces = convert(list(range(size))) if convert is not None else [decode([i]) for i in range(size)]
        pieces = [piece or "" for piece in pieces]  # an id with no token: neither
        begins = torch.tensor([bool(p) and p[0] in _WHITESPACE for p in pieces], dtype=torch.bool)
        ends = torch.tensor([bool(p) and p[-1] in _WHITESPACE for p in pieces], dtype=torch.bool)
        if not bool(begins.any() | ends.any()):
            begins[:] = True  # a vocabulary with no whitespace marks (a word-level one): each token alone
        special = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < size]
        begins[special] = True
        ends[special] = True
        found = (begins, ends)
        setattr(tokenizer, _EDGES, found)  # kept with the tokenizer: built once, gone with it
    return found


def span_max(pooled: torch.Tensor, raw: torch.Tensor, words: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``pooled`` ``[B, H, N]`` (a ranking after its pool), each live slot raised to the best ``raw``
    (unpooled) score among the live slots of its row and head with the same word number (``words``;
    a negative one: a token of no known word, left as it is), plus ``TIE_BREAK`` of its own raw
    score where that raises it. Only a word the pool did not already reach across changes: a token
    within the kernel of its word's best already holds at least that best."""
    known = valid & (words >= 0)
    if not bool(known.any()):
        return pooled
    index = words.clamp(min=0)
    width = int(index.max()) + 1
    lowest = torch.finfo(raw.dtype).min
    table = torch.full((*raw.shape[:2], width), lowest, dtype=raw.dtype, device=raw.device)
    table.scatter_reduce_(-1, index, torch.where(known, raw, torch.full_like(raw, lowest)), "amax")
    best = table.gather(-1, index).to(pooled.dtype)
    return torch.where(known & (best > pooled), best + TIE_BREAK * raw.to(pooled.dtype), pooled)


class WordRecord:
    """Each row's token ids by ordinal (``[rows, T]``, -1 where not read), shared by a cache's layers
    (``RowBudgets.words``); the word numbers are worked out from them when a layer asks (``of``), once
    per write. The tokenizer's edges are found on the first call."""

    def __init__(self, rows: int = 0):
        self.ids = torch.full((rows, 0), -1, dtype=torch.long)
        self.edges: tuple[torch.Tensor, torch.Tensor] | None = None
        self.off = False  # no tokenizer was found: the layers pool without spans
        self._numbers: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    def write(self, ids: torch.Tensor, real: torch.Tensor | None, n_real: torch.Tensor) -> None:
        """A call's token ids ``[B, n]`` (``real``: which are not pads), each row's real tokens
        written at its ordinals from ``n_real`` ``[B]`` on."""
        ids = ids.cpu()
        if self.rows < ids.shape[0]:
            self.ids = torch.cat([self.ids, torch.full((ids.shape[0] - self.rows, self.ids.shape[1]), -1,
                                                       dtype=torch.long)])
        for row in range(ids.shape[0]):
            tokens = ids[row] if real is None else ids[row][real[row].cpu()]
            start = int(n_real[row])
            if len(tokens):
                self._grow(start + len(tokens))
                self.ids[row, start:start + len(tokens)] = tokens
        self._numbers = None

    def _grow(self, length: int) -> None:
        if self.ids.shape[1] < length:  # doubling: a prompt read in many pieces copies little
            width = max(length, 2 * self.ids.shape[1], 64)
            grown = torch.full((self.rows, width), -1, dtype=torch.long)
            grown[:, :self.ids.shape[1]] = self.ids
            self.ids = grown

    def numbers(self) -> torch.Tensor:
        """``[rows, T]``: each read token's word number in its row (-1: not read)."""
        if self._numbers is None:
            self._numbers = word_numbers(self.ids, *self.edges)
        return self._numbers

    def of(self, ordinal: torch.Tensor) -> torch.Tensor | None:
        """``ordinal`` ``[B, H, N]`` -> each token's word number (-1 unknown); None when the record
        does not cover the layer's rows (nothing written for them)."""
        if self.off or self.edges is None or self.rows != ordinal.shape[0] or not self.ids.shape[1]:
            return None
        numbers = self.numbers()
        b, h, n = ordinal.shape
        inside = (ordinal >= 0) & (ordinal < numbers.shape[1])
        flat = ordinal.clamp(0, numbers.shape[1] - 1).reshape(b, h * n).cpu()
        found = numbers.gather(1, flat).view(b, h, n).to(ordinal.device)
        return torch.where(inside, found, torch.full_like(found, -1))

    def select(self, index: torch.Tensor) -> WordRecord:
        """A new record holding rows ``index`` (repeats allowed)."""
        twin = WordRecord()
        twin.edges, twin.off = self.edges, self.off
        twin.ids = self.ids.index_select(0, index.cpu()) if self.rows else torch.full((len(index), 0), -1,
                                                                                    dtype=torch.long)
        return twin

    def extend(self, mine: int, other: WordRecord | None, rows: int) -> None:
        """Append ``rows`` rows (``other``'s record, or rows that have read nothing) after this
        record's ``mine`` rows (rows it never wrote read as not read)."""
        theirs = other.ids if other is not None and other.rows == rows else torch.full((rows, 0), -1, dtype=torch.long)
        own = self.ids[:mine]
        if own.shape[0] < mine:
            own = torch.cat([own, torch.full((mine - own.shape[0], own.shape[1]), -1, dtype=torch.long)])
        width = max(own.shape[1], theirs.shape[1])
        self.ids = torch.cat([F.pad(t, (0, width - t.shape[1]), value=-1) for t in (own, theirs)])
        if self.edges is None and other is not None:
            self.edges = other.edges
        self._numbers = None


def word_numbers(ids: torch.Tensor, begins: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``ids`` ``[rows, T]`` (-1: not read) -> each token's word number in its row (-1 where not
    read). A word starts at a row's first token, at a token whose text begins with whitespace, after
    one that ends with it, and after a token not read; it is cut every ``MAX_WORD_TOKENS`` tokens.
    Ids past the tokenizer's vocabulary (a model's padded embedding) stand alone."""
    known = ids >= 0
    outside = ids >= len(begins)
    token = ids.clamp(0, len(begins) - 1)
    starts = begins[token] | outside | ~known
    stops = ends[token] | outside | ~known  # the token after it starts a word
    starts[:, 1:] |= stops[:, :-1]
    starts[:, 0] = True
    position = torch.arange(ids.shape[1]).expand_as(ids)
    first = torch.cummax(torch.where(starts, position, torch.zeros_like(position)), dim=1).values
    starts |= (position - first) % MAX_WORD_TOKENS == 0
    return torch.where(known, starts.long().cumsum(1) - 1, torch.full_like(ids, -1))


def install_hook(model) -> None:
    """Once per model: a forward pre-hook that writes a call's token ids into its cache's word record
    (any cache without one: nothing happens)."""
    if not getattr(model, _HOOKED, False):
        model.register_forward_pre_hook(_before_call, with_kwargs=True)
        setattr(model, _HOOKED, True)


def _before_call(model, args, kwargs):
    cache = passed_cache(kwargs)
    record = getattr(getattr(cache, "row_budgets", None), "words", None)
    if record is None or record.off:
        return None
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2:
        # embeddings (no ids: those tokens stand alone), or a decode step: never pooled, and
        # writing it would cost a device sync every step; its ordinal stays unknown
        return None
    first = cache.layers[0]
    if first.probe.best is not None or first.stream == "probe":
        return None  # a probe's tokens are read and never kept: they have no ordinals
    if record.edges is None and not _find_edges(model, cache, record):
        return None
    mask = kwargs.get("attention_mask")
    real = None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.to(torch.bool).all()):
        real = mask[:, -ids.shape[1]:].to(torch.bool)
    n_real = first.n_real.cpu() if first.is_initialized else torch.zeros(ids.shape[0], dtype=torch.long)
    if len(n_real) == ids.shape[0]:
        record.write(ids, real, n_real)
    return None


def _find_edges(model, cache, record: WordRecord) -> bool:
    from h2okv.core.autorank import known_tokenizer

    tokenizer = known_tokenizer(model, cache)
    if tokenizer is None:
        record.off = True
        warnings.warn(f"h2okv: policy {cache.policy.spec!r} pools by words and found no tokenizer: pooled without "
                      f"them; pass H2OCache(model, ..., tokenizer=tokenizer)", stacklevel=3)
        return False
    record.edges = word_edges(tokenizer, getattr(model.config, "vocab_size", None))
    if record.edges is None:
        record.off = True
        warnings.warn(f"h2okv: policy {cache.policy.spec!r} pools by words and cannot read the tokenizer's "
                      f"vocabulary (no convert_ids_to_tokens or decode): pooled without them", stacklevel=3)
        return False
    return True
