"""Fixed-capacity slot buffers with per-slot bookkeeping: the KV cache that really evicts.

Each layer keeps ``[batch, kv_heads, capacity, head_dim]`` key/value buffers plus, per slot, the
accumulated attention it received (``score``), the index of its token among the real (non-pad)
tokens of its sequence (``ordinal``) and whether it holds a live token (``valid``). Attention is
invariant to the order of keys once RoPE is baked in, so a new token is written into any free slot
in place: no per-step gather, no reallocation once the buffer has reached ``budget + 1`` slots.

The work of a forward call (write, attend, accumulate, evict) happens in ``SlotLayer.attend``,
called from the registered attention function (``attention.py``), because that is where the query
is available. ``update`` only hands the new key/value states over.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import H2OError
from .policies import Budget, Policy, make_policy
from .slot_attention import slot_attention

DEFAULT_CHUNK = 512

# (layer, key_states, value_states) recorded by SlotLayer.update for the attention call that
# follows it in the same thread; the attention function checks the key is the same object
PENDING: ContextVar[tuple | None] = ContextVar("h2okv_pending", default=None)


@dataclass(frozen=True)
class BudgetSpec:
    """Either absolute slot counts or fractions of each sequence's prompt length (paper's setting)."""

    heavy: int | None = None
    recent: int | None = None
    heavy_ratio: float | None = None
    recent_ratio: float | None = None

    @classmethod
    def build(cls, policy: Policy, heavy, recent, heavy_ratio, recent_ratio) -> BudgetSpec:
        absolute = heavy is not None or recent is not None
        ratio = heavy_ratio is not None or recent_ratio is not None
        if not policy.evicts:
            if absolute or ratio:
                raise H2OError("policy 'full' keeps every token; do not give it a budget")
            return cls()
        if absolute and ratio:
            raise H2OError("give either --heavy/--recent or --heavy-ratio/--recent-ratio, not both")
        if not absolute and not ratio:
            # the paper's setting: 10% heavy hitters + 10% recent of the prompt ("20% KV cache")
            heavy_ratio, recent_ratio = 0.1, 0.1
        elif absolute:
            heavy, recent = int(heavy or 0), int(recent or 0)
            if heavy < 0 or recent < 0 or heavy + recent <= 0:
                raise H2OError(f"budget must be positive: heavy={heavy}, recent={recent}")
            if policy.name == "h2o" and (heavy <= 0 or recent <= 0):
                raise H2OError(f"h2o needs heavy > 0 and recent > 0 (got heavy={heavy}, recent={recent})")
            return cls(heavy=heavy, recent=recent)
        heavy_ratio = float(heavy_ratio or 0.0)
        recent_ratio = float(recent_ratio or 0.0)
        for name, value in (("heavy_ratio", heavy_ratio), ("recent_ratio", recent_ratio)):
            if not (0.0 <= value <= 1.0) or math.isnan(value):
                raise H2OError(f"{name} must be in (0, 1], got {value}")
        if heavy_ratio + recent_ratio <= 0:
            raise H2OError("heavy_ratio + recent_ratio must be > 0")
        if policy.name == "h2o" and (heavy_ratio <= 0 or recent_ratio <= 0):
            raise H2OError(f"h2o needs heavy_ratio and recent_ratio in (0, 1] (got {heavy_ratio}, {recent_ratio})")
        return cls(heavy_ratio=heavy_ratio, recent_ratio=recent_ratio)

    @property
    def is_ratio(self) -> bool:
        return self.heavy_ratio is not None

    def resolve(self, prompt_len: int) -> tuple[int, int]:
        """(heavy, recent) slots for a sequence whose prompt has ``prompt_len`` real tokens."""
        if not self.is_ratio:
            return self.heavy, self.recent
        # at least one slot for each part whose ratio is > 0 (a 5-token prompt still gets a budget)
        heavy = max(1, int(self.heavy_ratio * prompt_len)) if self.heavy_ratio > 0 else 0
        recent = max(1, int(self.recent_ratio * prompt_len)) if self.recent_ratio > 0 else 0
        return heavy, recent


@dataclass
class _FastDecode:
    """What ``SlotLayer._decode_step`` reuses between steps while every row is at its budget."""

    valid: torch.Tensor  # the buffers this was built for (identity is checked before each use)
    n_real: torch.Tensor
    dense_capacity: int
    ordinal_src: torch.Tensor
    recent_start: torch.Tensor
    next_free: torch.Tensor | None = None


class SlotLayer(CacheLayerMixin):
    """One decoder layer's slot buffers. See the module docstring."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: H2OCache, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.tokens_seen = 0  # positions consumed, pads included: what generate needs for positions
        self.peak_capacity = 0

    # -- transformers Cache layer protocol ---------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((b, h, 0, d))
        self.values = value_states.new_zeros((b, h, 0, value_states.shape[-1]))
        self.score = torch.zeros((b, h, 0), dtype=torch.float32, device=self.device)
        self.ordinal = torch.zeros((b, h, 0), dtype=torch.long, device=self.device)
        self.valid = torch.zeros((b, h, 0), dtype=torch.bool, device=self.device)
        self.n_real = torch.zeros((b,), dtype=torch.long, device=self.device)
        self._fast = None  # see _check_at_budget
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # the attention function picks these up (see attention.py); K/V are written into slots
        # there, chunk by chunk, interleaved with eviction
        PENDING.set((self, key_states, value_states))
        self.tokens_seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The model builds its mask over the *new* tokens only (causal + padding among them); the
        # old tokens' visibility is the slots' valid flag. kv_offset lines the padding mask up.
        return query_length, self.tokens_seen

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.tokens_seen = 0
        self.peak_capacity = 0

    def _select_batch(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        index = index.to(self.device)
        for name in ("keys", "values", "score", "ordinal", "valid", "n_real", "heavy", "recent"):
            if hasattr(self, name) and getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, index))
        self.rows_changed()

    def rows_changed(self) -> None:
        """Forget what was derived for the previous set of rows (largest budget, fast-decode
        state). Call after adding or removing rows by hand; row selection calls it itself."""
        self.__dict__.pop("_max_budget", None)
        self._fast = None
        if self.is_initialized and hasattr(self, "heavy"):
            self._check_at_budget()

    def reorder_cache(self, beam_idx):
        self._select_batch(beam_idx)

    def batch_select_indices(self, indices):
        self._select_batch(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int):
        if self.is_initialized:
            b = self.keys.shape[0]
            self._select_batch(torch.arange(b).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise H2OError("H2OCache cannot be cropped: evicted tokens are gone (assisted decoding is not supported)")

    # -- slot bookkeeping ----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def _resize(self, new_capacity: int, compact: bool) -> None:
        """Reallocate to ``new_capacity`` slots; ``compact`` moves live slots to the front first."""
        cap = self.capacity
        if compact:
            # live slots first; at most new_capacity of them (fewer when the buffer is smaller)
            order = torch.argsort((~self.valid).to(torch.int8), dim=-1, stable=True)[..., :new_capacity]
            keep = order.shape[-1]
            d = self.keys.shape[-1]
            parts = {
                "keys": self.keys.gather(2, order[..., None].expand(-1, -1, -1, d)),
                "values": self.values.gather(2, order[..., None].expand(-1, -1, -1, self.values.shape[-1])),
                "score": self.score.gather(2, order),
                "ordinal": self.ordinal.gather(2, order),
                "valid": self.valid.gather(2, order),
            }
        else:
            keep = cap
            parts = {n: getattr(self, n) for n in ("keys", "values", "score", "ordinal", "valid")}
        for name, old in parts.items():
            shape = list(old.shape)
            shape[2] = new_capacity
            new = old.new_zeros(shape)
            new[:, :, :keep] = old[:, :, :keep]
            setattr(self, name, new)
        self.peak_capacity = max(self.peak_capacity, new_capacity)

    def ensure_free(self, m: int) -> None:
        """Make room for ``m`` new tokens in every (sequence, head)."""
        if self.capacity >= self.max_budget + m:
            return  # steady state: eviction keeps every (sequence, head) at <= budget
        live = int(self.valid.sum(-1).max()) if self.capacity else 0
        needed = live + m
        if needed <= self.capacity:
            return
        limit = self.max_budget + m
        if m == 1:
            # decode before the budget is reached: grow in steps so growth is amortised
            needed = min(max(needed, self.capacity + max(32, self.capacity // 8)), limit)
        self._resize(needed, compact=False)

    def shrink_to_budget(self) -> None:
        """After a prefill, give back the chunk's extra slots: decode needs budget + 1."""
        target = self.max_budget + 1
        if self.capacity > target and int(self.valid.sum(-1).max()) < target:
            self._resize(target, compact=True)

    @property
    def max_budget(self) -> int | float:
        # fixed once the first forward call has set the row budgets; cached because ensure_free
        # asks on every step of every layer and the owner computes it with a device sync
        cached = getattr(self, "_max_budget", None)
        if cached is not None:
            return cached
        value = self.owner.max_budget
        if value != math.inf or not self.owner.policy.evicts:
            self._max_budget = value
        return value

    # -- the step ------------------------------------------------------------------------------
    def attend(self, query, key_new, value_new, new_mask, scaling, sliding_window=None):
        """Write, attend, accumulate and evict for one forward call; returns ``[B, q, Hq, D]``.

        ``new_mask`` is the model's boolean mask over the new tokens only (``get_mask_sizes``);
        we read padding from it and nothing else: causality among new tokens and the model's
        sliding window are applied from the slots' ordinals.
        """
        owner = self.owner
        b, _, q_len, _ = query.shape
        if q_len == 1 and new_mask is None and sliding_window is None and hasattr(self, "heavy"):
            return self._decode_step(query, key_new, value_new, scaling)
        nonpad = None
        if new_mask is not None:
            # a real token always sees itself; a pad key is seen by no query
            nonpad = new_mask.to(torch.bool)[:, 0].diagonal(dim1=-2, dim2=-1)
            if bool(nonpad.all()):
                nonpad = None
        if not hasattr(self, "heavy"):
            full = torch.ones(b, q_len, dtype=torch.bool, device=query.device)
            self.heavy, self.recent = owner.budgets_for(full if nonpad is None else nonpad, self.device)

        order = None
        if nonpad is not None:
            # Move every row's real tokens to the front (a right-padded layout): a row's chunks
            # then start at its own first token, as when the sequence runs alone.
            order = torch.argsort((~nonpad).to(torch.int8), dim=-1, stable=True)
            nonpad = nonpad.gather(1, order)
            query = query.gather(2, order[:, None, :, None].expand_as(query))
            key_new = key_new.gather(2, order[:, None, :, None].expand_as(key_new))
            value_new = value_new.gather(2, order[:, None, :, None].expand_as(value_new))

        chunk = owner.chunk_size if q_len > 1 else 1
        outputs = []
        for start in range(0, q_len, chunk):
            stop = min(start + chunk, q_len)
            outputs.append(
                self._step(
                    query[:, :, start:stop],
                    key_new[:, :, start:stop],
                    value_new[:, :, start:stop],
                    None if nonpad is None else nonpad[:, start:stop],
                    scaling,
                    sliding_window,
                )
            )
        if q_len > 1:
            self.shrink_to_budget()
        self._check_at_budget()
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [B, Hq, q, D]
        if order is not None:
            out = torch.empty_like(out).scatter_(2, order[:, None, :, None].expand_as(out), out)
        return out.transpose(1, 2).contiguous()

    def _check_at_budget(self) -> None:
        """One device sync: does every (sequence, head) hold exactly its row's budget of live tokens?

        If so, the next one-real-token step must evict exactly one slot in every (sequence, head)
        (there are always candidates: budget + 1 live tokens with distinct ordinals, at most
        ``recent`` of them recent), and a step keeps the property; ``_decode_step`` then needs no
        excess counts or drop masks. It keeps what it reuses from step to step in ``_fast``, tied
        to the tensors it was built for: anything that replaces them (a resize, a batch selection,
        the general path) makes it rebuild.
        """
        self._fast = None
        if not self.owner.policy.evicts or not hasattr(self, "heavy"):
            return
        budget = self.heavy + self.recent
        if not bool((self.valid.sum(-1) == budget[:, None]).all()):
            return
        b, h = self.valid.shape[:2]
        self._fast = _FastDecode(
            valid=self.valid,
            n_real=self.n_real,
            # all rows share one budget and the buffer has budget + 1 slots: once the new token is
            # written no slot is free, so attention needs no mask, and the one slot the eviction
            # frees is where the next token goes
            dense_capacity=int(budget[0]) + 1 if bool((budget == budget[0]).all()) else -1,
            ordinal_src=self.n_real.view(b, 1, 1).expand(b, h, 1),  # a view: follows n_real in place
            recent_start=(self.n_real - self.recent).view(b, 1, 1),  # advanced with n_real
        )

    def _decode_step(self, query, k_new, v_new, scaling):
        """``_step`` for one real token per row and no sliding window (every ``generate`` step)
        in the fewest tensor ops: the same slots, scores and evictions as ``_step``, without the
        masks and counts that ``_check_at_budget`` shows are not needed. A step is ~30 small ops
        per layer, each costing microseconds of dispatch on CPU, so the count is the cost."""
        policy = self.owner.policy
        b, hkv, _, d = k_new.shape
        self.ensure_free(1)
        fast = self._fast
        if fast is not None and (fast.valid is not self.valid or fast.n_real is not self.n_real):
            self._check_at_budget()
            fast = self._fast
        dense = fast is not None and self.capacity == fast.dense_capacity
        if dense and fast.next_free is not None:
            slot = fast.next_free  # the only free slot: last step's victim
        else:
            slot = self.valid.view(torch.uint8).argmin(dim=-1, keepdim=True)  # first free slot, [B, H, 1]
        index = slot.unsqueeze(-1).expand(b, hkv, 1, d)
        self.keys.scatter_(2, index, k_new)
        if v_new.shape[-1] != d:
            index = slot.unsqueeze(-1).expand(b, hkv, 1, v_new.shape[-1])
        self.values.scatter_(2, index, v_new)
        ordinal = fast.ordinal_src if fast is not None else self.n_real.view(b, 1, 1).expand(b, hkv, 1)
        self.ordinal.scatter_(2, slot, ordinal)
        self.score.scatter_(2, slot, 0.0)
        self.valid.scatter_(2, slot, True)
        out, mass = slot_attention(
            query, self.keys, self.values, None if dense else self.valid[:, :, None, :], scaling,
            need_mass=policy.needs_scores,
        )
        if mass is not None:
            self.score += mass
        self.n_real += 1
        if policy.evicts:
            if fast is not None:
                fast.recent_start += 1  # = n_real - recent
                key = policy.eviction_key(self.score, self.ordinal, self.layer_idx)
                if dense:
                    key = key.masked_fill(self.ordinal >= fast.recent_start, math.inf)
                else:
                    key = key.masked_fill(~(self.valid & (self.ordinal < fast.recent_start)), math.inf)
                victims = key.argmin(dim=-1, keepdim=True)
                self.valid.scatter_(2, victims, False)
                fast.next_free = victims if dense else None
            else:  # still filling up to the budget: the general eviction, then look again
                self._evict(1)
                self._check_at_budget()
        return out.transpose(1, 2).contiguous()

    def _step(self, query, k_new, v_new, nonpad, scaling, sliding_window):
        """One chunk of ``m`` new tokens (real tokens first in each row; ``nonpad=None``: all real)."""
        policy = self.owner.policy
        b, hkv, m, d = k_new.shape
        self.ensure_free(m)
        cap = self.capacity

        # the first m free slots of each (b, h), in token order
        if m == 1:
            slot_of_token = (~self.valid).to(torch.int8).argmax(dim=-1, keepdim=True)
        else:
            slot_of_token = torch.argsort(self.valid.to(torch.int8), dim=-1, stable=True)[..., :m]

        idx = slot_of_token[..., None]
        self.keys.scatter_(2, idx.expand(-1, -1, -1, d), k_new)
        self.values.scatter_(2, idx.expand(-1, -1, -1, v_new.shape[-1]), v_new)
        real = nonpad if nonpad is not None else torch.ones(b, m, dtype=torch.bool, device=self.device)
        ordinals = self.n_real[:, None] + torch.arange(m, device=self.device)  # [B, m]
        self.ordinal.scatter_(2, slot_of_token, ordinals[:, None, :].expand(b, hkv, m))
        self.score.scatter_(2, slot_of_token, 0.0)

        # which slots each new query may see: live old slots, plus new tokens up to itself (pads
        # sit after the real tokens of their row, so a real query never sees one)
        if m == 1:
            allowed = self.valid.scatter(2, slot_of_token, True)[:, :, None, :]
        else:
            token_of_slot = torch.full((b, hkv, cap), m, dtype=torch.long, device=self.device)
            token_of_slot.scatter_(2, slot_of_token, torch.arange(m, device=self.device).expand(b, hkv, m))
            q_idx = torch.arange(m, device=self.device)[:, None]  # [m, 1]
            allowed = self.valid[:, :, None, :] | (token_of_slot[:, :, None, :] <= q_idx)
        if sliding_window is not None and int(self.n_real.max()) + m > sliding_window:
            q_ord = ordinals[:, None, :, None]  # [B, 1, m, 1]
            allowed = allowed & (self.ordinal[:, :, None, :] > q_ord - sliding_window)

        out, mass = slot_attention(
            query, self.keys, self.values, allowed, scaling, need_mass=policy.needs_scores, query_weight=nonpad,
        )
        if mass is not None:
            self.score += mass

        self.valid.scatter_(2, slot_of_token, real[:, None, :].expand(b, hkv, m))
        self.n_real = self.n_real + real.sum(-1)
        if policy.evicts:
            self._evict(m)
        return out

    def _evict(self, m: int) -> None:
        """Free the lowest-ranked candidates until every (sequence, head) is within budget."""
        policy = self.owner.policy
        budget = (self.heavy + self.recent)[:, None]  # [B, 1]
        excess = (self.valid.sum(-1) - budget).clamp(min=0)  # [B, H]
        # candidates: live, not among the last `recent` real tokens of their sequence
        recent_start = (self.n_real - self.recent)[:, None, None]
        candidate = self.valid & (self.ordinal < recent_start)
        key = policy.eviction_key(self.score, self.ordinal, self.layer_idx).masked_fill(~candidate, math.inf)
        if m == 1:
            n_evict = 1
            _, victims = key.min(dim=-1, keepdim=True)
        else:
            n_evict = int(excess.max())
            if n_evict == 0:
                return
            _, victims = key.topk(n_evict, dim=-1, largest=False)
        rank = torch.arange(n_evict, device=self.device)
        drop = (rank < excess[..., None]) & candidate.gather(2, victims)
        self.valid.scatter_(2, victims, self.valid.gather(2, victims) & ~drop)

    # -- accounting ----------------------------------------------------------------------------
    def live_slots(self) -> torch.Tensor:
        return self.valid.sum(-1) if self.is_initialized else torch.zeros(0, dtype=torch.long)

    def kv_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def full_kv_bytes(self) -> int:
        """What a plain cache would hold: every position seen, for every row and head."""
        if not self.is_initialized:
            return 0
        b, h, _, d = self.keys.shape
        return 2 * b * h * self.tokens_seen * d * self.keys.element_size()


class H2OCache(Cache):
    """A ``transformers.Cache`` that keeps at most ``heavy + recent`` tokens per (sequence, layer, KV head).

    ``H2OCache(model, policy="h2o", heavy=102, recent=102)`` or
    ``H2OCache(model, policy="h2o", heavy_ratio=0.1, recent_ratio=0.1)``; pass it as
    ``past_key_values`` to ``model.generate`` or ``model(...)``. One cache serves one generation.
    """

    def __init__(
        self,
        model,
        policy: str | Policy = "h2o",
        heavy: int | None = None,
        recent: int | None = None,
        heavy_ratio: float | None = None,
        recent_ratio: float | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        seed: int = 0,
    ):
        from .attention import prepare_model

        self.policy = make_policy(policy, seed=seed)
        self.spec = BudgetSpec.build(self.policy, heavy, recent, heavy_ratio, recent_ratio)
        if int(chunk_size) < 1:
            raise H2OError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = int(chunk_size)
        num_layers = prepare_model(model)
        super().__init__(layers=[SlotLayer(self, i) for i in range(num_layers)])
        self._row_budgets: tuple[torch.Tensor, torch.Tensor] | None = None

    # row selection (beam search, generate's batch expansion) must keep the per-row budgets in step
    def _select_rows(self, index: torch.Tensor) -> None:
        if self._row_budgets is not None:
            heavy, recent = self._row_budgets
            self._row_budgets = (heavy.index_select(0, index.cpu()), recent.index_select(0, index.cpu()))

    def reorder_cache(self, beam_idx):
        self._select_rows(beam_idx)
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices):
        self._select_rows(torch.as_tensor(indices))
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int):
        if self._row_budgets is not None:
            rows = self._row_budgets[0].shape[0]
            self._select_rows(torch.arange(rows).repeat_interleave(repeats))
        super().batch_repeat_interleave(repeats)

    # per-row budgets are fixed by the first forward (the prompt), then shared by all layers
    def budgets_for(self, nonpad: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._row_budgets is None:
            lengths = nonpad.sum(-1).tolist()
            pairs = [self._split(self.spec.resolve(n)) for n in lengths]
            heavy = torch.tensor([p.heavy for p in pairs], dtype=torch.long)
            recent = torch.tensor([p.recent for p in pairs], dtype=torch.long)
            self._row_budgets = (heavy, recent)
        heavy, recent = self._row_budgets
        return heavy.to(device), recent.to(device)

    def _split(self, pair) -> Budget:
        if not self.policy.evicts:
            return Budget(0, 0)
        return self.policy.split(*pair)

    @property
    def max_budget(self) -> int | float:
        if not self.policy.evicts:
            return math.inf
        if self._row_budgets is None:
            return math.inf
        heavy, recent = self._row_budgets
        return int((heavy + recent).max())

    def budget(self) -> list[int] | None:
        """Slots per (layer, head) for each sequence, or None for ``full`` / before the first call."""
        if self._row_budgets is None or not self.policy.evicts:
            return None
        heavy, recent = self._row_budgets
        return (heavy + recent).tolist()

    def stats(self) -> dict:
        layers = [layer for layer in self.layers if layer.is_initialized]
        slots = [int(layer.live_slots().max()) for layer in layers]
        return {
            "policy": self.policy.name,
            "tokens_seen": self.get_seq_length(),
            "budget": self.budget(),
            "slots": slots,  # the most live tokens any (sequence, head) of each layer holds
            "capacity": [layer.capacity for layer in layers],
            "kv_bytes": sum(layer.kv_bytes() for layer in layers),
            "full_kv_bytes": sum(layer.full_kv_bytes() for layer in layers),
        }
