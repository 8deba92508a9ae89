"""``H2OCache``: the ``transformers.Cache`` that really evicts, and its public row operations."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from transformers.cache_utils import Cache

from h2okv.core import autorank, streamed, words
from h2okv.core.attention import prepare_model
from h2okv.core.budget import BudgetSpec, RowBudgets
from h2okv.core.compat import config_head_dim
from h2okv.core.layer import LayerConfig, SlotLayer
from h2okv.core.positions import RollingPositions, check_positions
from h2okv.core.quant import CENTER_TOKENS, KeyCenter, SlotCodec, SlotCoding
from h2okv.core.rope import RopeRotation
from h2okv.errors import H2OError
from h2okv.policies import Policy
from h2okv.settings import DEFAULT_CHUNK, PREFILL_MODES, CacheSettings

__all__ = ["DEFAULT_CHUNK", "PREFILL_MODES", "H2OCache"]


def slot_coding(model, settings: CacheSettings) -> SlotCoding | None:
    """The layers' slot coding for ``settings.kv_bits`` (and ``key_bits``; None: the model's
    dtype), checked against the model's head dimension."""
    if settings.kv_bits is None:
        return None
    config = model.config.get_text_config()
    head_dim = config_head_dim(config)
    group = min(settings.kv_group, head_dim)  # a group is at most a head's vector
    center = None
    if settings.center_keys:  # the keys' means are turned by the model's own RoPE (checked against it)
        try:
            # the mean of a row's first chunk at most: a server reads a prompt a chunk a call, and the
            # mean must not depend on how the prompt was cut into calls
            center = KeyCenter(tuple(RopeRotation.from_model(model, partial_ok=True).inv_freq.tolist()),
                               first=min(CENTER_TOKENS, settings.chunk_size))
        except H2OError as err:
            raise H2OError(f"center_keys turns each key's channel mean to its position: {err}") from None
    coding = SlotCoding(SlotCodec(settings.key_bits or settings.kv_bits, group), SlotCodec(settings.kv_bits, group),
                        window=settings.float_window, center=center)
    try:
        coding.bytes_per_slot(head_dim, head_dim)
    except ValueError as err:
        raise H2OError(str(err)) from None
    return coding


class H2OCache(Cache):
    """A ``transformers.Cache`` that keeps at most ``heavy + recent`` tokens per (sequence, layer, KV head).

    ``H2OCache(model)`` is the paper's H2O: 10% heavy hitters + 10% recent tokens of each prompt.
    ``H2OCache(model, recipe="bounded", budget=0.2)`` is the best configuration we measured for a
    use (``h2okv.recipes``: ``prompt``, ``bounded``, ``document``, ``generation``, ``stream``);
    keywords given beside a recipe replace its parts. Pass the cache as ``cache=`` (transformers
    >= 5.24; ``past_key_values=`` before) to ``model.generate`` or ``model(...)``. One cache
    serves one generation.

    ``budget``: a fraction of each prompt (a float in (0, 1]) or slots per (layer, KV head) (an
    int), ``recent_share`` of it for the most recent tokens (default 0.5), the rest for the
    policy's choice. The older spelling: ``heavy=``/``recent=`` slots or ``heavy_ratio=``/
    ``recent_ratio=`` fractions. A fraction never keeps fewer than ``budget_floor`` slots
    (``DEFAULT_BUDGET_FLOOR``; 0 turns it off), and a budget under ``DEGENERATE_SLOTS`` slots
    warns once (``H2OBudgetWarning``).
    ``policy`` is a name from ``POLICIES``, optionally with options (``"snapkv:window=16"``).
    The keywords build one checked value, ``h2okv.CacheSettings`` (``cache.settings``; ``stats()``
    records it): ``H2OCache(model, CacheSettings.from_recipe("bounded", 0.2))`` is the same cache
    as ``H2OCache(model, recipe="bounded", budget=0.2)``.

    ``prefill`` says when a forward call of several tokens (a prompt) is ranked:

    - ``"chunked"`` (default): bounded. The call is read in chunks of ``chunk_size`` and evicted
      down to the budget after each, so a layer never holds more than ``budget + chunk_size``
      slots per (sequence, KV head); early chunks are ranked before later ones (the question)
      exist, and later chunks attend only to what was kept.
    - ``"late"``: the call is read with exact attention (every token sees the whole call before
      it), the policy's scores accumulate over it, and each layer evicts to the budget once, at
      the end of the call: a full-cache prefill followed by one ranking. While a layer runs it
      holds ``budget + n`` slots for a call of ``n`` tokens (about the K/V the model computes for
      the call anyway); after the call, the budget + 1. The prefill's outputs are a full cache's.
      A prompt fed in several calls is ranked at the end of each call.
    - ``"streamed"``: flat in the prompt's length. The prompt is read through the whole model in
      pieces of ``chunk_size`` tokens, each ranked by the prompt's last ``window`` tokens read on
      top and never kept (``core/streamed.py``): budget + one piece of K/V and one piece of
      activations, where one call holds every token's hidden states. A ``snapkv`` policy;
      ``model.generate`` streams by itself (a forward pre-hook), a padded batch reads chunked.

    ``stats()["peak_capacity"]`` reports the most slots each layer ever allocated.

    ``head_budgets="adaptive"`` shares each layer's heavy slots out among its KV heads by the
    policy's rank (Ada-KV, ``core/head_budget.py``; ``head_floor`` is the share of a uniform head's
    choice every head keeps first). It needs a ranking policy with its own heads and a call ranked
    whole: ``prefill="late"``, or a policy that ranks the call before it is chunked (``snapkv``,
    ``knorm``, ``expected``). The layer's capacity is then its largest head budget, and ``stats()`` reports it.

    ``protect_prompt=True`` keeps each row's prompt (its first forward call) whole and applies the
    budget to what follows (generated tokens), as TriAttention does: ``budget()`` and the KV bytes
    count the prompt too.

    ``compileable=True`` lets ``torch.compile(model, fullgraph=True, dynamic=False)`` (or
    ``generate`` with a ``CompileConfig``; on CUDA by itself) run the decode steps at the budget as
    one graph with no recompilation: at the budget every shape is static. Those steps then run in
    tensor ops (the compiler makes the kernels, not ``core/native`` or Triton); prefill and rows
    still filling up to their budget stay eager.

    ``positions="rolling"`` keeps every position the model sees inside its context window so the
    cache reads and generates past it (``core/positions.py``); the default ``"true"`` does not.

    A policy that ranks by reconstruction (``kvzip``: recipes ``prompt`` and ``document``) is
    drop-in too: ``model.generate`` runs the pass before its first decode step
    (``core/autorank.py``) with ``tokenizer`` (default: the one in the model's local folder).

    Building a cache prepares ``model`` (``core/attention.py``): its attention implementation
    becomes ``"h2o"``, and the one it had (eager, sdpa, ...) runs every call no ``H2OCache`` hands
    over (a plain ``DynamicCache``, no cache: the model's own logits); its dense feed-forward runs
    calls longer than 512 tokens in slices; a forward pre-hook clears a stale hand-over.
    ``h2okv.restore_model(model)`` undoes all three; a cache built before it is not to be used after.
    """

    def __init__(self, model, policy: str | Policy | CacheSettings | None = None, *, tokenizer=None, **keywords):
        # the keywords are CacheSettings' fields (recipe=, budget=, prefill=, ...): it checks them,
        # names an unknown one, and fills in what a recipe or the defaults give
        if isinstance(policy, CacheSettings):
            if keywords:
                raise H2OError(f"give H2OCache a CacheSettings or keywords, not both (also given: "
                               f"{', '.join(sorted(keywords))})")
            settings = policy
        else:
            settings = CacheSettings.build(policy, **keywords)
        settings = settings.for_model(model.config)  # a budget in bytes: this model's slots (byte_budget.py)
        #: what this cache was built with (``h2okv.settings``); stats() records it
        self.settings = settings
        self.policy = settings.policy_object()
        self.spec = settings.budget_spec(self.policy)
        self.policy.bind(model)
        compileable, protect_prompt = settings.compileable, settings.protect_prompt
        num_layers = prepare_model(model)
        # what every layer is built with; the row budgets are the one state they share
        self.layer_config = LayerConfig(self.policy, self.prefill, self.chunk_size, self.head_budgets, self.head_floor,
                                        compileable=bool(compileable), coding=slot_coding(model, settings))
        self.row_budgets = RowBudgets(self.policy, self.spec, bool(protect_prompt))
        super().__init__(layers=[SlotLayer(i, self.layer_config, self.row_budgets) for i in range(num_layers)])
        scheme = check_positions(self.policy, settings.positions)
        self.rolling = None if scheme is None else RollingPositions(model, scheme)
        # kvzip: model.generate ranks the prompt by itself (core/autorank.py), with this tokenizer
        self.tokenizer, self.prompt_ids = tokenizer, None
        if self.policy.ranks_by_reconstruction:
            autorank.install_hook(model)
        if settings.prefill == "streamed":  # model.generate streams the prompt by itself (core/streamed.py)
            streamed.install_hook(model)
        if self.policy.words:  # every call's ids recorded by ordinal: the policy pools by words
            words.install_hook(model)

    # what the cache was built with, read from its settings (one copy of them)
    recipe = property(lambda self: self.settings.recipe)
    prefill = property(lambda self: self.settings.prefill)
    #: for stats(): what a budget= was split by (None: a budget given in parts)
    recent_share = property(lambda self: self.settings.recent_share)
    chunk_size = property(lambda self: self.settings.chunk_size)
    head_budgets = property(lambda self: self.settings.head_budgets)
    head_floor = property(lambda self: float(self.settings.head_floor))

    def set_compileable(self, compileable: bool) -> None:
        """Switch the decode steps at the budget to (or from) the tensor ops ``torch.compile``
        traces, e.g. after an eager prefill; every layer chooses its stepper again."""
        if compileable and self.rolling is not None:
            raise H2OError("compileable=True takes true positions only (rolling positions are not traced)")
        self.settings = self.settings.replace(compileable=bool(compileable))  # what stats() records
        self.layer_config = dataclasses.replace(self.layer_config, compileable=bool(compileable))
        for layer in self.layers:
            layer.set_config(self.layer_config)

    # -- rows: generate's beam search and batch expansion, the server's continuous batching -----
    def select_rows(self, index) -> None:
        """Keep rows ``index`` of every layer, in that order (repeats allowed), budgets in step."""
        index = torch.as_tensor(index, dtype=torch.long)
        self._share_rows(self.row_budgets.select(index))
        for layer in self.layers:
            layer.select_rows(index)
        if self.rolling is not None:
            self.rolling.select_rows(index)

    def _share_rows(self, rows: RowBudgets) -> None:
        self.row_budgets = rows
        for layer in self.layers:
            layer.rows = rows

    def append_rows(self, other: H2OCache) -> None:
        """Append ``other``'s rows (a cache of the same model and policy that has run); both end at
        the larger capacity. ``other`` must not be used afterwards."""
        if not self.row_budgets.fixed or not other.row_budgets.fixed:
            raise H2OError("append_rows needs two caches that have both seen a forward call")
        if self.policy.spec != other.policy.spec or len(self.layers) != len(other.layers):
            raise H2OError(f"cannot join a {other.policy.spec!r} cache to a {self.policy.spec!r} cache")
        if (self.rolling is None) != (other.rolling is None):
            raise H2OError("cannot join a cache with rolling positions to one with true positions")
        if self.rolling is not None:
            self.rolling.append_rows(other.rolling)
        self.row_budgets.extend(other.row_budgets)
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.append_rows(theirs)  # ends in the layer's refresh
            mine.tokens_seen = max(mine.tokens_seen, theirs.tokens_seen)

    def take_rows(self, index) -> H2OCache:
        """A new cache holding a copy of rows ``index`` (same policy object, same capacity); this
        cache is unchanged."""
        index = torch.as_tensor(index, dtype=torch.long)
        if not self.row_budgets.fixed:
            raise H2OError("take_rows needs a cache that has seen a forward call")
        twin = copy.copy(self)
        twin.row_budgets = self.row_budgets.select(index)
        if self.rolling is not None:
            twin.rolling = self.rolling.take_rows(index)
        twin.layers = [layer.copy_rows(index, twin.row_budgets) for layer in self.layers]
        return twin

    def add_rows(self, budgets: list[tuple[int | None, int | None]]) -> None:
        """Append rows that have seen nothing yet, with their own absolute ``(heavy, recent)``
        budgets (``(None, None)`` for a policy that keeps everything); their next forward call is
        their first. On a cache that has not run yet this fixes the rows of its first call (the
        call must then have ``len(budgets)`` rows). The server uses it to start prompts with
        different budgets in one forward, and to let new prompts join a batch part-way through
        others."""
        if self.row_budgets.protect_prompt:
            raise H2OError("protect_prompt takes each row's budget from its prompt: add_rows gives absolute budgets")
        pairs = [BudgetSpec.build(self.policy, h, r, None, None).resolve(0) for h, r in budgets]
        running = [layer for layer in self.layers if layer.is_initialized]
        if not self.row_budgets.fixed:
            if running:
                raise H2OError("add_rows on a cache whose first call is under way")
            self.row_budgets.fix(pairs)
            return
        if len(running) != len(self.layers):
            raise H2OError("add_rows needs every layer to have run")
        new = RowBudgets(self.policy, self.spec)
        new.fix(pairs)
        self.row_budgets.extend(new)
        if self.rolling is not None:
            self.rolling.add_rows(len(pairs))
        for layer in self.layers:
            layer.add_empty_rows(new.heavy, new.recent, new.sinks)

    def set_budgets(self, budgets: list[tuple[int, int]]) -> None:
        """Replace every row's absolute ``(heavy, recent)`` budget. Nothing is evicted now: the next
        forward call of two tokens or more ranks what is held with its own queries and brings each
        row down to its new budget (the server holds a chat's history whole, then lets the
        question choose what stays). Only for a cache that has run, with every head of a row on
        the row's budget (a cache-wide or adaptive split would have to be shared out again)."""
        if not self.policy.evicts:
            raise H2OError(f"policy {self.policy.spec!r} keeps everything: it has no budget to set")
        if self.row_budgets.protect_prompt or not self.row_budgets.fixed:
            raise H2OError("set_budgets needs a cache that has run, with absolute budgets")
        if len(budgets) != self.rows:
            raise H2OError(f"set_budgets got {len(budgets)} budgets for {self.rows} rows")
        running = [layer for layer in self.layers if layer.is_initialized]
        if len(running) != len(self.layers) or any(layer.head_heavy is not None for layer in running):
            raise H2OError("set_budgets needs every layer to have run, its heads on their rows' budgets")
        self.row_budgets.fix([BudgetSpec.build(self.policy, h, r, None, None).resolve(0) for h, r in budgets])
        for layer in running:
            layer.set_budgets(self.row_budgets.heavy, self.row_budgets.recent, self.row_budgets.sinks)

    def trim(self) -> None:
        """Give back every layer's free slots after its last live one (nothing moves, so each row
        keeps its slot layout); used after rows leave."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.trim()
                layer.changed()

    def fit_capacity(self, capacity: int) -> None:
        """Give every layer exactly ``capacity`` slots per (sequence, head); see ``SlotStorage.resize``."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.fit_capacity(capacity)

    @property
    def rows(self) -> int:
        return self.row_budgets.rows

    def compact(self) -> None:
        """Hold each head's own live slots only (the flat layout) in every layer whose heads keep
        uneven counts (a cache-wide or adaptive split): a state kept aside (the server's prefix
        store) then costs its live tokens, not its widest head's count times every head. Any later
        use (``take_rows``, a forward call) brings a layer back to the dense layout."""
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            if layer.ragged is not None:
                if not bool((layer.ragged.widths.view(layer.ragged.shape[:2]) > layer.live_slots() + 1).any()):
                    continue  # flat at the budget: one free slot a head, the next token's
                layer.to_dense()  # flat with room ahead (kvzip's tail filling, ``decode.TailFill``): cut it
            live = layer.live_slots()
            if bool((live == live.flatten()[0]).all()):
                continue  # even counts: the dense layout, trimmed, is already tight
            layer.pack_live(int(live.max()))  # each head's live slots first, in slot order; no free tail
            layer.flatten(live.reshape(-1).to(torch.int64).contiguous())

    def decode_capacity(self) -> int:
        """The slots per (row, head) a decode step needs: the largest budget of any layer's head
        (a cache-wide or adaptive split gives some heads more than the even share), plus the
        token the step writes before it evicts; 1 for a cache that keeps everything (no bound).
        Each layer's ``max_budget`` is counted once per change of its budgets, not per call."""
        budgets = [int(cap) for cap in (layer.max_budget for layer in self.layers if layer.is_initialized)
                   if cap != math.inf]
        return max(budgets, default=0) + 1

    def reorder_cache(self, beam_idx):
        self.select_rows(beam_idx)

    def batch_select_indices(self, indices):
        self.select_rows(indices)

    def batch_repeat_interleave(self, repeats: int):
        layer = next((lay for lay in self.layers if lay.is_initialized), None)
        if layer is not None:
            self.select_rows(torch.arange(layer.n_real.shape[0]).repeat_interleave(repeats))
        elif self.row_budgets.fixed:
            self.select_rows(torch.arange(self.rows).repeat_interleave(repeats))

    # -- budgets: fixed per row by the first forward call (the prompt), shared by all layers -----
    @property
    def max_budget(self) -> int | float:
        """The most slots any (row, layer, KV head) may hold: the layers' own once they have run
        (a cache-wide or adaptive head split, kvzip's tail, give layers budgets of their own), the
        rows' before (inf before the first call or for a policy that keeps everything)."""
        running = [layer.max_budget for layer in self.layers if layer.is_initialized]
        return max(running) if running else self.row_budgets.max_budget

    def budget(self) -> list[int] | None:
        """Slots per (layer, head) for each sequence, or None for ``full`` / before the first call."""
        return self.row_budgets.totals()

    @staticmethod
    def _head_range(layer) -> list[int] | None:
        if not layer.has_budget or not layer.config.policy.evicts:
            return None
        budget = layer.slot_budget()
        return [int(budget.min()), int(budget.max())]

    @staticmethod
    def _above_budget(layer) -> int:
        """The most live tokens a (row, KV head) of ``layer`` holds above its budget (kvzip's tail)."""
        if not layer.has_budget or not layer.config.policy.evicts:
            return 0
        return max(0, int((layer.live_slots() - (layer.slot_budget() - layer.probe.tail_slots)).max()))

    def _coding_label(self) -> str | None:
        """``"4-bit slots"``, ``"8-bit keys, 4-bit values"``, or None for slots in the model's dtype."""
        s = self.settings
        if s.kv_bits is None:
            return None
        label = (f"{s.kv_bits}-bit slots" if s.key_bits in (None, s.kv_bits)
                 else f"{s.key_bits}-bit keys, {s.kv_bits}-bit values")
        label += ", keys centered" if self.layer_config.coding.center is not None else ""
        return label + (f", the last {s.float_window} tokens also in float" if s.float_window else "")

    def stats(self) -> dict:
        layers = [layer for layer in self.layers if layer.is_initialized]
        slots = [int(layer.live_slots().max()) for layer in layers]
        kv, full = sum(layer.kv_bytes() for layer in layers), sum(layer.full_kv_bytes() for layer in layers)
        # the yardstick of a quantized cache: a model run in float32 (on a CPU) would otherwise
        # flatter 8-bit slots 4x, where a served model's cache is 16-bit
        full_16 = sum(layer.full_kv_bytes(torch.bfloat16) for layer in layers)
        kv_16 = sum(layer.kv_bytes(float_itemsize=2) for layer in layers)  # coded slots as they are
        live = sum(int(layer.live_slots().sum()) for layer in layers)
        seen = sum(layer.tokens_seen * layer.live_slots().numel() for layer in layers)
        return {
            "policy": self.policy.name,
            "policy_spec": self.policy.spec,
            "recipe": self.recipe,
            "settings": self.settings.describe(),
            "tokens_seen": self.get_seq_length(),
            "budget": self.budget(),
            "slots": slots,  # the most live tokens any (sequence, head) of each layer holds
            "capacity": [layer.capacity for layer in layers],
            "prefill": self.prefill,
            "recent_share": self.recent_share,
            "positions": "true" if self.rolling is None else "rolling",
            "protect_prompt": self.row_budgets.protect_prompt,
            "head_budgets": self.head_budgets,
            # per layer, the fewest and most slots one KV head may hold (equal unless adaptive)
            "head_budget_range": [self._head_range(layer) for layer in layers],
            # the most slots per (sequence, KV head) each layer ever allocated: budget + chunk for
            # a chunked prefill, budget + the call for a late one
            "peak_capacity": [layer.peak_capacity for layer in layers],
            "kv_bytes": kv,
            "full_kv_bytes": full,
            # the KV held as a share of a full cache's for the tokens seen, everything included; the
            # live tokens' share (the rest is room: growth, or the widest head's width that a dense
            # layer of uneven head budgets holds for every head)
            "kv_share": kv / full if full else 1.0,
            "kv_bits": self.settings.kv_bits,  # quantized slots (None: the model's dtype)
            # keys coded less their turned mean (``center_keys``; by default for a budget in bytes)
            "center_keys": self.layer_config.coding is not None and self.layer_config.coding.center is not None,
            "kv_coding": self._coding_label(),
            "full_kv_bytes_16bit": full_16,
            # what this cache would hold in a 16-bit model (float slots at 2 bytes, coded ones as
            # they are) over that full cache: the share a budget in bytes is held to
            "kv_bytes_16bit": kv_16,
            "kv_share_16bit": kv_16 / full_16 if full_16 else 1.0,
            "live_share": live / seen if seen else 1.0,
            # the most tokens a (row, layer, KV head) holds above its budget: kvzip's tail (what is
            # read after its ranking, kept whole for ``tail`` tokens), 0 for every other policy
            "above_budget_tokens": max((self._above_budget(layer) for layer in layers), default=0),
            # kvzip: the prompt has been read and waits for the reconstruction pass (core/autorank.py)
            "awaiting_ranking": bool(layers) and all(layer.probe.awaiting for layer in layers),
        }

    def summary(self) -> str:
        """One line: what the cache is, what it has seen, what it keeps and the bytes it holds
        against a full cache of the same tokens (``stats()`` has the per-layer lists)."""
        stats = self.stats()
        name = stats["policy_spec"] + (f" (recipe {self.recipe})" if self.recipe else "")
        if stats["kv_coding"] is not None:
            name += f", {stats['kv_coding']}"
        budget = stats["budget"]
        if budget is None:
            kept = "every token kept"
        else:
            low, high = min(budget), max(budget)
            kept = f"budget {low if low == high else f'{low}-{high}'} slots per layer and KV head"
            if stats["tokens_seen"] <= low:  # a short chat: say why it costs what a full cache costs
                kept += " (more than the tokens seen: nothing evicted)"
        if stats["awaiting_ranking"]:
            kept += " (prompt read whole, not ranked yet: the next call or h2okv.reconstruct ranks it)"
        mib = 1024 * 1024
        share = f"{stats['kv_share']:.0%}"
        if stats["above_budget_tokens"]:
            share += f"; up to {stats['above_budget_tokens']} tokens per head above the budget in kvzip's tail"
        if stats["kv_bits"] is not None and stats["full_kv_bytes_16bit"] != stats["full_kv_bytes"]:
            share += f"; {stats['kv_share_16bit']:.0%} of a 16-bit full cache"
        if stats["kv_share"] - stats["live_share"] >= 0.01:
            share += f"; live tokens {stats['live_share']:.0%}, the rest free slots"
        return (f"{name}: {stats['tokens_seen']} tokens seen, {kept}, KV {stats['kv_bytes'] / mib:.2f} MiB "
                f"vs {stats['full_kv_bytes'] / mib:.2f} MiB full ({share})")
