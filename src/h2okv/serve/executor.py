"""The executor: the only thing in the server that runs the model or changes a KV cache.

The engine (``engine.py``) decides *what* to run: which requests are admitted, which prompt chunks
this step prefills, which rows decode, what token each row feeds next. The ``Executor`` holds the
model and every KV cache (one ``DecodeBatch`` per policy, the caches of prompts being prefilled)
and does it. Its calls take plain, picklable data only (ints, strs, lists of ints, tuples of
those) and return logits or nothing. A sequence is named by an integer ``uid`` the engine assigns.

**The rule:** every call is deterministic given its arguments and the calls made before it. No
call reads a clock, a random source (cache policies take their seed in ``open``), a request's
text or anything else the engine holds. So a second executor (a tensor-parallel follower) that
receives the same calls in the same order holds the same caches and computes the same logits;
sampling, stop strings, detokenisation, timeouts and cancellation stay in the engine, which turns
their outcome into the next calls (``close``/``keep``/``decode`` with the chosen ids).

**Shared prefill.** The prompts being prefilled form one *prefill group* per policy: one
``H2OCache`` whose rows are those prompts, part-way through. A ``prefill`` call runs, per policy,
ONE forward over its parts: each row feeds its own chunk, left-padded to the longest (the core
moves every row's real tokens to the front and pads never become live slots nor add score, as in
``generate`` with left padding), so each row evolves as it would alone. A prompt not seen before
joins as a new row with its own budget (``H2OCache.add_rows``); every row already in the group must take part in every
call of its policy (a row left out would have to feed pads, and a pad-only step is not a no-op for
every policy), which the engine's scheduler guarantees. ``join_many`` copies the rows of prompts
that finished in one forward into their policy's decode batch together; it and ``close`` then cut
the group's free tail slots, so
the group holds at most ``rows * max(min(prompt, budget) + chunk)`` slots (see ``memory.py``).

**Ranked by reconstruction** (policy ``kvzip``). Such a prompt's ranked part (the whole prompt, or
its cacheable prefix: a document ranked before the question that follows it) is fed in one
``prefill`` call and never shares a forward: its own batch-1 cache reads every token but the last
with exact attention, reads the probe calls it was ``open``ed with (``core/reconstruction.py``;
built by the engine, which holds the tokenizer, from the ranked part) and evicts to its budget by
the scores they give, then reads the last token on the ranked cache, whose logits the call
returns. That is ``eval longctx``'s order, so the first generated token already sees the ranked
cache. Later calls read the rest of the prompt (the question) on that cache. The probe's keys and
values live for one layer's call only: what stays is the prompt, then the budget.

**Saved states** (the prefix store, ``prefix.py``). ``save(entry, uid)`` copies a decoding row's
state (the tokens it has fed) under an entry id the engine chose; ``open(..., resume=entry)`` starts
a sequence from a copy of it, and that sequence's prefill then reads the rest of its prompt on its
own batch-1 cache (never in a shared forward), as a ranked prompt does, before it joins its
policy's batch; ``forget(entry)`` drops one. A state of a policy that never evicts resumes with
``length`` too: its copy is cut to its first ``length`` tokens (``keep_first``), exactly what
reading them gives. A resumed prompt is never ranked by reconstruction
again: its first part was.

**Held whole** (``open(..., whole=True)``). A sequence of an evicting policy may read the first part
of its prompt on a cache of its own whose budget keeps everything (a chat's history, or a copy of a
history saved so), then ``set_budget`` gives it its own budget: nothing is evicted then; its next
call (the question) ranks everything held with its own queries and evicts down to it.

A call that raises leaves the caches as they were before it, except ``prefill`` and ``decode``
whose failure leaves the sequences involved unusable (a failed prefill drops its policy's whole
group): the engine then ``close``s them (``keep`` for a decode batch), which always succeeds.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import torch

from h2okv.core.cache import PREFILL_MODES, H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.held import HOLD_ALL  # a sequence held whole evicts nothing (``open``)
from h2okv.core.reconstruction import rank_by_probes
from h2okv.policies import policy_class
from h2okv.serve.batch import DecodeBatch
from h2okv.serve.eviction import EVERY_POLICY
from h2okv.serve.memory import bytes_per_slot

PAD_ID = 0  # what pads feed; masked out, so any id would do


@dataclass
class PrefillGroup:
    """The prompts of one policy being prefilled: ``cache`` row ``i`` is ``uids[i]``."""

    cache: H2OCache | None = None
    uids: list[int] = field(default_factory=list)

    def drop(self, uid: int) -> None:
        """Remove ``uid``'s row."""
        i = self.uids.index(uid)
        if len(self.uids) == 1:
            self.cache, self.uids = None, []
            return
        if self.cache is not None:
            self.cache.select_rows([j for j in range(len(self.uids)) if j != i])
            self.cache.trim()
        del self.uids[i]


@dataclass(frozen=True)
class SequenceSpec:
    """What an executor needs to build a sequence's cache (``heavy``/``recent`` None for ``full``)."""

    policy: str
    heavy: int | None
    recent: int | None
    seed: int
    probe: tuple[tuple[int, ...], ...] | None = None  # the probe calls of a policy ranked by reconstruction
    resume: int | None = None  # the saved state it starts from (its prompt's first part is read)
    length: int | None = None  # ... cut to its first tokens (a state of a policy that never evicts)
    whole: bool = False  # its prompt's first part is held whole until ``set_budget`` (``open``)
    lowered: bool = False  # ... and ``set_budget`` came before its cache was made (a resumed history)
    spans: tuple[tuple[int, int, int], ...] | None = None  # the probe calls' spans (kvzip:local=1)


def keep_first(cache: H2OCache, n: int) -> None:
    """Cut a batch-1 cache of a policy that never evicts to its first ``n`` tokens: what reading
    them gives (each slot keeps its token's K/V, written when it was read; a policy that keeps
    everything ranks nothing, so no score depends on the tokens cut)."""
    if cache.policy.evicts:
        raise ValueError(f"a {cache.policy.spec!r} cache's state after n tokens is not its first n")
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        layer.to_dense()
        if int(layer.n_real.min()) < n:
            raise ValueError(f"cannot keep the first {n} tokens of a cache that read {int(layer.n_real.min())}")
        layer.valid = layer.valid & (layer.ordinal < n)  # a new tensor: the live bound is counted again
        layer.n_real = torch.full_like(layer.n_real, n)
        layer.tokens_seen = n
    cache.trim()  # the cut slots are the tail (a full cache writes in order); ends in every layer's refresh


class Executor:
    """Owns ``model`` and the caches; see the module docstring for the determinism rule."""

    def __init__(self, model, prefill_chunk: int, prefill: str = "chunked", positions: str = "true",
                 cache_options: dict[str, dict] | None = None):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        self.model = model
        self.positions = positions  # every cache's position scheme (``H2OCache(positions=...)``)
        # more H2OCache keywords for the caches of one policy spec (a recipe's head split)
        self.cache_options = {spec: dict(options) for spec, options in (cache_options or {}).items()}
        self.device = model.device
        self.prefill_chunk = prefill_chunk
        self.prefill_mode = prefill  # H2OCache's: the engine feeds a late prompt in one call
        # only the last position's logits are needed; older transformers lack the argument
        self._keep_last = (
            {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        )
        self._specs: dict[int, SequenceSpec] = {}
        self._groups: dict[str, PrefillGroup] = {}  # policy -> the prompts being prefilled
        self._batches: dict[str, DecodeBatch] = {}  # policy -> the rows (uids) that decode together
        self._ranked: dict[int, H2OCache] = {}  # prompts ranked by reconstruction, waiting to join
        # prompts read on a cache of their own (a saved state's copy, or held whole), waiting to join
        self._resumed: dict[int, H2OCache] = {}
        self._saved: dict[int, H2OCache] = {}  # entry -> a sequence's saved state (batch-1)

    # -- facts about the model (no cache involved) -------------------------------------------------
    def slot_bytes(self) -> int:
        """Bytes of one token's K and V across all layers and KV heads (``memory.bytes_per_slot``)."""
        return bytes_per_slot(self.model, **self.cache_options.get(EVERY_POLICY, {}))

    # -- sequences -----------------------------------------------------------------------------
    def open(self, uid: int, policy: str, heavy: int | None, recent: int | None, seed: int,
             probe: list[list[int]] | None = None, resume: int | None = None, length: int | None = None,
             whole: bool = False, spans: list[tuple[int, int, int]] | None = None) -> None:
        """Register a sequence; its cache is built by its first ``prefill``. ``probe``: the probe
        calls (id lists) of a policy that ranks by reconstruction, which needs them; ``spans``: each
        call's ``(head, first, stop)``, for a policy that scores each on its own (``kvzip:local=1``). ``resume``: a
        saved entry it starts from (its cache is a copy of it; no probe), ``length``: its first
        tokens only (a state of a policy that never evicts). ``whole``: an evicting policy's
        sequence read on a cache of its own that evicts nothing (resumed: a state saved so) until
        ``set_budget`` gives it its budget; its next call ranks what is held and evicts."""
        if uid in self._specs:
            raise ValueError(f"sequence {uid} is already open")
        if whole:
            cls = policy_class(policy)
            if heavy is None or not cls.evicts or cls.ranks_by_reconstruction or probe is not None or length is not None:
                raise ValueError(f"sequence {uid}: only an evicting policy's prompt is held whole ({policy!r})")
            if resume is not None and resume not in self._saved:
                raise ValueError(f"sequence {uid}: no saved state {resume} to resume")
            self._specs[uid] = SequenceSpec(policy, heavy, recent, int(seed), None, resume, None, True)
            return
        if resume is not None:
            if resume not in self._saved or probe is not None:
                raise ValueError(f"sequence {uid}: no saved state {resume} to resume (or a probe with it)")
            if length is not None and (length < 1 or self._saved[resume].policy.evicts):
                raise ValueError(f"sequence {uid}: only a state that never evicts is cut, to >= 1 token")
            self._specs[uid] = SequenceSpec(policy, heavy, recent, int(seed), None, resume,
                                            None if length is None else int(length))
            return
        if length is not None:
            raise ValueError(f"sequence {uid}: a length goes with a saved state to resume")
        if policy_class(policy).ranks_by_reconstruction != (probe is not None):
            raise ValueError(f"sequence {uid}: probe calls go with a policy that ranks by reconstruction, "
                             f"and only with one ({policy!r})")
        calls = None if probe is None else tuple(tuple(int(t) for t in call) for call in probe)
        if calls is not None and not all(calls):
            raise ValueError(f"sequence {uid}: an empty probe call")
        if spans is not None and (calls is None or len(spans) != len(calls)):
            raise ValueError(f"sequence {uid}: one span per probe call")
        spans = None if spans is None else tuple(tuple(int(v) for v in span) for span in spans)
        self._specs[uid] = SequenceSpec(policy, heavy, recent, int(seed), calls, spans=spans)

    def prefill(self, parts: list[tuple[int, list[int], int]]) -> dict[int, torch.Tensor]:
        """Feed prompt chunks: ``parts`` is ``[(uid, token_ids, first_position), ...]``, each uid at
        most once, every token of a sequence's prompt exactly once over its calls, in order, and
        every sequence part-way through its prompt in every call (see the module docstring). One
        forward per policy among the parts. Returns each uid's logits at its chunk's last token."""
        uids = [uid for uid, _, _ in parts]
        if len(set(uids)) != len(uids):
            raise ValueError("a sequence appears twice in one prefill call")
        by_policy: dict[str, list[tuple[int, list[int], int]]] = {}
        for uid, ids, start in parts:
            if uid not in self._specs or self._joined(uid):
                raise ValueError(f"sequence {uid} is not open for prefill")
            if not ids:
                raise ValueError(f"sequence {uid}: an empty chunk")
            by_policy.setdefault(self._specs[uid].policy, []).append((uid, list(ids), int(start)))
        for policy, group in self._groups.items():
            missing = set(group.uids) - set(uids)
            if policy in by_policy and missing:
                raise ValueError(f"sequences {sorted(missing)} are part-way through their prompts and must take part")
        out = {}
        for policy, mine in by_policy.items():
            alone = {uid for uid, _, _ in mine if uid in self._resumed or self._specs[uid].resume is not None
                     or self._specs[uid].whole}
            for uid, ids, start in mine:  # each on its own cache (a copy of the saved state it resumes)
                if uid in alone:
                    out[uid] = self._read_on(self._resumed, uid, ids, start)
            mine = [part for part in mine if part[0] not in alone]
            if not mine:
                continue
            if policy_class(policy).ranks_by_reconstruction:
                for uid, ids, start in mine:  # one at a time, never padded: see the module docstring
                    ranked = uid in self._ranked  # its ranked part read: the rest goes on top
                    out[uid] = self._read_on(self._ranked, uid, ids, start) if ranked else \
                        self._prefill_ranked(uid, ids, start)
            else:
                out.update(self._prefill_group(policy, mine))
        return out

    def set_budget(self, uid: int) -> None:
        """A sequence opened ``whole`` takes its budget: nothing is evicted now; its next prefill
        call (two tokens or more) ranks what it holds with that call's queries and evicts down to
        it (``H2OCache.set_budgets``)."""
        spec = self._specs.get(uid)
        cache = self._resumed.get(uid)
        if spec is None or not spec.whole or (cache is None and spec.resume is None):
            raise ValueError(f"sequence {uid} is not a prompt held whole (or resuming a history so)")
        if cache is not None:
            cache.set_budgets([(spec.heavy, spec.recent)])
        self._specs[uid] = dataclasses.replace(spec, whole=False, lowered=cache is None)

    def join(self, uid: int, capacity: int) -> None:
        """The prefilled ``uid`` becomes the last row of its policy's decode batch, which then has
        ``max(capacity, current)`` slots per row (``join_many`` of one)."""
        self._join([uid], capacity)

    def join_many(self, uids: list[int], capacity: int) -> None:
        """The prefilled ``uids`` (one policy) become the last rows of its decode batch, in that
        order, which then has ``max(capacity, current)`` slots per row. The rows a prefill group
        gives up are copied out of it in one ``take_rows`` (none when they are the whole group, in
        its order) and the batch grows once: joined one by one, a batch that gains n rows in a step
        was copied n times (``H2OCache.append_rows``). The same caches as ``join`` one by one."""
        self._join(uids, capacity)

    def _join(self, uids: list[int], capacity: int) -> None:
        if not uids:
            return
        if len(set(uids)) != len(uids) or any(uid not in self._specs for uid in uids):
            raise ValueError(f"sequences {uids} are not distinct open sequences")
        policy = self._specs[uids[0]].policy
        if any(self._specs[uid].policy != policy for uid in uids):
            raise ValueError(f"sequences {uids} are not all of policy {policy!r}")
        group = self._groups.get(policy)
        own = {uid for uid in uids if uid in self._ranked or uid in self._resumed}
        grouped = [uid for uid in uids if uid not in own]
        if grouped and (group is None or group.cache is None or not set(grouped) <= set(group.uids)):
            raise ValueError(f"sequences {grouped} have not been prefilled")
        # runs of consecutive uids from one source, in order: the group's rows of a run in one copy
        pieces: list[tuple[list[int], H2OCache | None]] = []  # (uids, their own cache; None: the group's)
        for uid in uids:
            if uid in own:
                pieces.append(([uid], self._ranked[uid] if uid in self._ranked else self._resumed[uid]))
            elif pieces and pieces[-1][1] is None:
                pieces[-1][0].append(uid)
            else:
                pieces.append(([uid], None))
        whole = group is not None and grouped == group.uids and len(pieces) == 1
        caches = [group.cache if whole else group.cache.take_rows([group.uids.index(u) for u in run])
                  if cache is None else cache for run, cache in pieces]
        for uid in own:  # from here on nothing raises before the batch takes them
            self._ranked.pop(uid, None)
            self._resumed.pop(uid, None)
        if group is not None and grouped:
            if whole or len(grouped) == len(group.uids):
                del self._groups[policy]
            else:
                gone = set(grouped)
                group.cache.select_rows([i for i, u in enumerate(group.uids) if u not in gone])
                group.cache.trim()
                group.uids = [u for u in group.uids if u not in gone]
        batch = self._batches.setdefault(policy, DecodeBatch(policy))
        for (run, _), cache in zip(pieces, caches, strict=True):
            batch.add(run, cache, capacity)

    def decode(self, policy: str, uids: list[int], ids: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step of ``policy``'s batch: row ``i`` (``uids`` must be the batch's rows, in
        order) feeds token ``ids[i]`` at ``positions[i]``. Returns logits ``[rows, vocab]``."""
        batch = self._batches.get(policy)
        if batch is None or list(uids) != batch.rows:
            raise ValueError(f"decode rows {uids} are not the {policy!r} batch's rows")
        tokens = torch.tensor([[t] for t in ids], dtype=torch.long, device=self.device)
        where = torch.tensor([[p] for p in positions], dtype=torch.long, device=self.device)
        out = self.model(input_ids=tokens, position_ids=where, **cache_arg(batch.cache), use_cache=True,
                         **self._keep_last)
        return out.logits[:, -1]

    def keep(self, policy: str, uids: list[int], capacity: int) -> None:
        """Keep only rows ``uids`` (a subset of the batch's rows, in order) of ``policy``'s batch, at
        ``capacity`` slots per row; the sequences dropped are closed."""
        batch = self._batches.get(policy)
        if batch is None:
            if uids:
                raise ValueError(f"no {policy!r} batch")
            return
        for uid in set(batch.rows) - set(uids):
            self._specs.pop(uid, None)
        batch.keep(list(uids), capacity)
        if not batch.rows:
            del self._batches[policy]

    def close(self, uid: int) -> None:
        """Forget a sequence that has not joined a decode batch (no-op for an unknown uid)."""
        if self._joined(uid):
            raise ValueError(f"sequence {uid} decodes: drop it with keep()")
        spec = self._specs.pop(uid, None)
        self._ranked.pop(uid, None)
        self._resumed.pop(uid, None)
        group = None if spec is None else self._groups.get(spec.policy)
        if group is not None and uid in group.uids:
            group.drop(uid)
            if not group.uids:
                del self._groups[spec.policy]

    def reset(self) -> None:
        """Drop every sequence and cache."""
        self._specs.clear()
        self._groups.clear()
        self._batches.clear()
        self._ranked.clear()
        self._resumed.clear()
        self._saved.clear()

    # -- saved states (the prefix store) ---------------------------------------------------------
    def save(self, entry: int, uid: int) -> int:
        """Save sequence ``uid``'s state as ``entry`` (a copy; the sequence goes on): a decoding row,
        or a prompt part-way through its prefill; returns the copy's bytes."""
        if entry in self._saved:
            raise ValueError(f"entry {entry} is already saved")
        policy = self._specs[uid].policy if uid in self._specs else None
        batch, group = self._batches.get(policy), self._groups.get(policy)
        if batch is not None and uid in batch.rows:
            cache, row = batch.cache, batch.rows.index(uid)
        elif group is not None and uid in group.uids and group.cache is not None:
            cache, row = group.cache, group.uids.index(uid)
        elif uid in self._resumed or uid in self._ranked:
            cache, row = self._resumed.get(uid) or self._ranked[uid], 0
        else:
            raise ValueError(f"sequence {uid} holds no state to save")
        copy = cache.take_rows([row])
        copy.trim()  # the batch's spare slots past the row's last live one
        copy.compact()  # heads of uneven budgets: each holds its own live slots only
        self._saved[entry] = copy
        return sum(layer.kv_bytes() for layer in copy.layers)

    def forget(self, entry: int) -> None:
        """Drop saved state ``entry`` (no-op for an unknown one)."""
        self._saved.pop(entry, None)

    def saved_entries(self) -> list[int]:
        """The ids of the saved states held, sorted (every rank of ``serve --tp`` holds the same)."""
        return sorted(self._saved)

    def saved_bytes(self) -> int:
        return sum(layer.kv_bytes() for cache in self._saved.values() for layer in cache.layers)

    # -- observation (does not change anything) ------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of K/V buffers allocated now, prefill caches and decode batches together."""
        total = sum(batch.kv_bytes() for batch in self._batches.values())
        groups = [g.cache for g in self._groups.values() if g.cache is not None] + list(self._ranked.values()) \
            + list(self._resumed.values())
        return total + sum(layer.kv_bytes() for cache in groups for layer in cache.layers)

    def prefilling(self, policy: str) -> list[int]:
        group = self._groups.get(policy)
        ranked = [uid for own in (self._ranked, self._resumed) for uid in own if self._specs[uid].policy == policy]
        return ([] if group is None else list(group.uids)) + ranked

    def rows(self, policy: str) -> list[int]:
        batch = self._batches.get(policy)
        return [] if batch is None else list(batch.rows)

    # -- internals -----------------------------------------------------------------------------------
    def _joined(self, uid: int) -> bool:
        return any(uid in batch.rows for batch in self._batches.values())

    def _new_cache(self, spec: SequenceSpec) -> H2OCache:
        budget = {} if spec.heavy is None else {"heavy": spec.heavy, "recent": spec.recent}
        positions = self.positions if spec.heavy is not None else "true"  # keeping everything, nothing rolls
        # a prompt ranked by reconstruction is read whole whatever the server's mode
        prefill = "late" if spec.probe is not None else self.prefill_mode
        options = {**self.cache_options.get(EVERY_POLICY, {}),  # quantized slots: every cache's
                   **(self.cache_options.get(spec.policy, {}) if spec.heavy is not None else {})}
        return H2OCache(self.model, policy=spec.policy, chunk_size=self.prefill_chunk, seed=spec.seed,
                        prefill=prefill, positions=positions, **budget, **options)

    def _prefill_ranked(self, uid: int, ids: list[int], start: int) -> torch.Tensor:
        """A prompt ranked by reconstruction: all but its last token read, the probe, the last token."""
        spec = self._specs[uid]
        if start != 0 or uid in self._ranked or len(ids) < 2:
            raise ValueError(f"sequence {uid}: a prompt ranked by reconstruction is fed whole (>= 2 tokens), once")
        device = self.device
        try:
            cache = self._new_cache(spec)
            head, last = ids[:-1], ids[-1:]
            self.model(input_ids=torch.tensor([head], dtype=torch.long, device=device), **cache_arg(cache),
                       use_cache=True, **self._keep_last)
            # a head of one token is read as a decode step, held whole with nothing to rank (a
            # two-token prompt, e.g. [0, 0], stopped here with a 500 under the default recipe)
            if all(layer.probe.awaiting for layer in cache.layers):
                rank_by_probes(self.model, cache, [torch.tensor([call], dtype=torch.long, device=device)
                                                   for call in spec.probe], spec.spans)
            out = self.model(input_ids=torch.tensor([last], dtype=torch.long, device=device),
                             position_ids=torch.tensor([[len(head)]], dtype=torch.long, device=device),
                             **cache_arg(cache), use_cache=True, **self._keep_last)
        except Exception:
            self._ranked.pop(uid, None)
            raise
        self._ranked[uid] = cache
        return out.logits[0, -1]

    def _read_on(self, own: dict[int, H2OCache], uid: int, ids: list[int], start: int) -> torch.Tensor:
        """The next part of a prompt with a batch-1 cache of its own (``own[uid]``: a resumed one's
        copy of its saved state, made at its first part; a ranked one's cache), in one forward."""
        cache = own.get(uid)
        if cache is None:
            spec = self._specs[uid]
            if spec.resume is None:  # held whole from its first token
                cache = self._new_cache(dataclasses.replace(spec, heavy=HOLD_ALL, recent=1))
            else:
                cache = self._saved[spec.resume].take_rows([0])
            if spec.length is not None:
                keep_first(cache, spec.length)
            if spec.lowered:  # a history saved whole, resumed to read the question on
                cache.set_budgets([(spec.heavy, spec.recent)])
        try:
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                             position_ids=torch.arange(start, start + len(ids), device=self.device)[None],
                             **cache_arg(cache), use_cache=True, **self._keep_last)
        except Exception:
            own.pop(uid, None)
            raise
        own[uid] = cache
        return out.logits[0, -1]

    def _prefill_group(self, policy: str, parts: list[tuple[int, list[int], int]]) -> dict[int, torch.Tensor]:
        group = self._groups.setdefault(policy, PrefillGroup())
        known = {uid: (ids, start) for uid, ids, start in parts}
        new = [uid for uid, _, _ in parts if uid not in group.uids]
        try:
            if group.cache is None:
                group.cache = self._new_cache(self._specs[parts[0][0]])
            # each row its own budget (the cache's spec is the first row's)
            group.cache.add_rows([(self._specs[uid].heavy, self._specs[uid].recent) for uid in new])
            group.uids.extend(new)
            rows = [known[uid] for uid in group.uids]
            width = max(len(ids) for ids, _ in rows)
            # left padding: every row's last real token is the last position (logits_to_keep=1)
            tokens = [[PAD_ID] * (width - len(ids)) + ids for ids, _ in rows]
            positions = [[start] * (width - len(ids)) + list(range(start, start + len(ids))) for ids, start in rows]
            kwargs = {}
            if any(len(ids) < width for ids, _ in rows):
                seen = group.cache.get_seq_length()  # the model's mask is sliced at this offset
                kwargs["attention_mask"] = torch.tensor(
                    [[1] * seen + [0] * (width - len(ids)) + [1] * len(ids) for ids, _ in rows],
                    dtype=torch.long, device=self.device)
            out = self.model(input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
                             position_ids=torch.tensor(positions, dtype=torch.long, device=self.device),
                             **cache_arg(group.cache), use_cache=True, **kwargs, **self._keep_last)
        except Exception:
            del self._groups[policy]  # its cache is half-written: no row of it can go on
            raise
        logits = out.logits[:, -1]
        return {uid: logits[i] for i, uid in enumerate(group.uids)}
