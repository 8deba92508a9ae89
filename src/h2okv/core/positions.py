"""Rolling positions: keep every position the model sees inside its context window, however long
the text, so an evicting cache can read and generate past the window.

RoPE makes a logit depend only on the query-key distance, so what leaves the trained range past the
window is the distance to old kept keys (sinks, heavy hitters), not the cache size. Before each
forward call a rolling cache gives the call's tokens positions inside the window (the model's
``position_ids`` are replaced by a pre-hook on its base model, so the model rotates queries and
new keys there itself) and re-rotates the kept keys in place (``rope.RopeRotation``). Nothing in
the step, the scan or the policies changes: a key's position is baked into it, as before.

Two schemes (``H2OCache(positions=...)``; ``"true"`` is the default and does none of this):

- ``"rolling:shift"``: true distances, with a periodic shift (llama.cpp's context shift). Row
  ``b`` has an offset ``F``; a kept key of ordinal ``o`` sits at ``max(o - F, 0)``. When a call
  would take a position to ``window``, ``F`` grows by ``shift`` (default a quarter window) and
  every kept key is rotated once by ``-clamp(o - F_old, 0, shift)``: recent keys keep their true
  distances, keys older than the offset sit at 0 (distances capped below the window). Amortised:
  one rotation of the buffer per ``shift`` tokens; a key is rotated at most ``window / shift``
  times before it reaches 0, so rounding does not accumulate.
- ``"rolling:order"``: positions by cache order (StreamingLLM): before each call every kept key
  moves to its rank among its (row, head)'s kept keys and the call's tokens follow, so distances
  never exceed ``budget + call``. One rotation of the buffer per call (per decode step). A key's
  current position is found from the ordinals kept at the last compaction (``snap``) and the
  call's positions, so nothing is stored per slot.

``"rolling"`` names the scheme chosen on the measurements (``DEFAULT_ROLLING``). Each row rolls on
its own (its own offset / ranks), the state follows the cache's row operations, and tensor
parallelism needs nothing (a rank rotates its own heads, per head dimension).

A single call must fit the window (``rows' real tokens <= window``); longer texts are fed in
pieces (``eval stream``, the server's prefill chunks), else a one-line ``H2OError``.
"""

from __future__ import annotations

import copy

import torch

from h2okv.core.compat import passed_cache
from h2okv.core.rope import RopeRotation
from h2okv.errors import H2OError

SCHEMES = ("shift", "order")
DEFAULT_ROLLING = "shift"
POSITION_CHOICES = ("true", "rolling") + tuple(f"rolling:{s}" for s in SCHEMES)
_NEVER = torch.iinfo(torch.long).max  # an ordinal no token has: pads out the sorted snapshots
_HOOKED = "_h2okv_rolling_hook"


def parse_positions(spec: str | None) -> str | None:
    """``"true"``/None -> None (true positions); ``"rolling"`` or ``"rolling:SCHEME"`` -> the scheme."""
    if spec in (None, "true"):
        return None
    name, _, scheme = str(spec).partition(":")
    if name != "rolling" or (scheme and scheme not in SCHEMES):
        raise H2OError(f"positions must be one of {', '.join(POSITION_CHOICES)}, got {spec!r}")
    return scheme or DEFAULT_ROLLING


def check_positions(policy, spec: str | None) -> str | None:
    """``parse_positions`` for ``policy`` (a policy or its class). A policy ranked by
    reconstruction reads a probe that is never kept and that rolling positions would count, so
    it takes true positions only. One check for the cache, the server and its command line."""
    scheme = parse_positions(spec)
    if scheme is not None and policy.ranks_by_reconstruction:
        raise H2OError(f"policy {policy.name!r} reads a probe that is never kept, which positions={spec} would "
                       f"count: use positions=true (--positions true)")
    return scheme


class RollingPositions:
    """One cache's rolling state: per row the shift offset or the last compaction's snapshot."""

    def __init__(self, model, scheme: str, window: int | None = None, shift: int | None = None):
        self.rope = RopeRotation.from_model(model)
        self.scheme = scheme
        limit = model.config.get_text_config().max_position_embeddings
        self.window = int(window or limit)
        if not 2 <= self.window <= limit:
            raise H2OError(f"the rolling window must be in [2, {limit}] (the model's positions), got {self.window}")
        self.shift = int(shift or max(1, self.window // 4))
        if not 1 <= self.shift < self.window:
            raise H2OError(f"the rolling shift must be in [1, {self.window - 1}], got {self.shift}")
        self.offset: torch.Tensor | None = None  # [B] shift: a key of ordinal o sits at max(o - offset, 0)
        self.n0: torch.Tensor | None = None  # [B] order: real tokens seen at the last compaction
        self.live0: torch.Tensor | None = None  # [B] order: position of the first token after it
        self.snap: list[torch.Tensor | None] = []  # order, per layer: [B, H, k] kept ordinals, sorted
        install_hook(model)

    # -- a forward call --------------------------------------------------------------------------
    def before_call(self, cache, nonpad: torch.Tensor) -> torch.Tensor:
        """Re-rotate the kept keys for this call and return its ``position_ids`` ``[B, n]``."""
        layers = [layer for layer in cache.layers if layer.is_initialized]
        b = nonpad.shape[0]
        device = nonpad.device
        n_real = layers[0].n_real.to(device) if layers else torch.zeros(b, dtype=torch.long, device=device)
        if self.offset is None or self.offset.shape[0] != b:
            if layers and self.offset is not None:
                raise H2OError(f"rolling positions hold {self.offset.shape[0]} rows, the call has {b}")
            self._reset_rows(b, len(cache.layers), device)
        real = nonpad.sum(-1)
        if int(real.max()) > self.window:
            raise H2OError(f"a forward call of {int(real.max())} tokens per row does not fit the rolling window "
                           f"of {self.window} positions; feed the text in pieces")
        flat = [layer for layer in layers if layer.ragged is not None]
        for layer in flat:  # keys are rotated in their dense layout
            layer.to_dense()
        if self.scheme == "shift":
            start = self._shift(layers, n_real, real)
        else:
            start = self._compact(layers, n_real, real)
        for layer in flat:  # and the decode stepper chosen again (it flattens them back)
            layer.changed()
        within = torch.cumsum(nonpad.long(), dim=-1) - 1
        return (start[:, None] + within).masked_fill(~nonpad, 0)

    def _shift(self, layers, n_real, real) -> torch.Tensor:
        start = n_real - self.offset
        overflow = start + real - self.window
        if bool((overflow > 0).any()):
            amount = torch.where(overflow > 0, overflow.clamp(min=self.shift), 0)
            for layer in layers:
                rows = (-1, 1, 1)
                moved = (layer.ordinal - self.offset.view(rows)).clamp(min=0)
                delta = -torch.minimum(moved, amount.view(rows))
                self.rope.rotate_(layer.keys, delta.masked_fill(~layer.valid, 0))
            self.offset = self.offset + amount
            start = n_real - self.offset
        return start

    def _compact(self, layers, n_real, real) -> torch.Tensor:
        live = torch.zeros_like(n_real)
        for layer in layers:
            i = layer.layer_idx
            ordinal, valid = layer.ordinal, layer.valid
            kept = torch.sort(ordinal.masked_fill(~valid, _NEVER), dim=-1).values
            rank = torch.searchsorted(kept, ordinal.contiguous())
            rows = (-1, 1, 1)
            now = self.live0.view(rows) + ordinal - self.n0.view(rows)  # written since the last compaction
            snap = self.snap[i]
            if snap is not None and snap.shape[-1]:
                earlier = torch.searchsorted(snap, ordinal.contiguous())
                now = torch.where(ordinal < self.n0.view(rows), earlier, now)
            self.rope.rotate_(layer.keys, (rank - now).masked_fill(~valid, 0))
            width = int(valid.sum(-1).max())
            self.snap[i] = kept[..., :width].contiguous()
            live = torch.maximum(live, valid.sum(-1).amax(-1))
        if bool((live + real > self.window).any()):
            raise H2OError(f"cache order puts {int((live + real).max())} positions in one call, past the rolling "
                           f"window of {self.window}: the budget plus a call must fit it")
        self.n0, self.live0 = n_real.clone(), live
        return live

    # -- rows: kept in step with the cache's row operations --------------------------------------
    def _reset_rows(self, b: int, n_layers: int, device) -> None:
        zeros = torch.zeros(b, dtype=torch.long, device=device)
        self.offset, self.n0, self.live0 = zeros, zeros.clone(), zeros.clone()
        self.snap = [None] * n_layers

    def select_rows(self, index: torch.Tensor) -> None:
        if self.offset is None:
            return
        index = index.to(self.offset.device)
        self.offset, self.n0, self.live0 = (t.index_select(0, index) for t in (self.offset, self.n0, self.live0))
        self.snap = [None if s is None else s.index_select(0, index.to(s.device)) for s in self.snap]

    def take_rows(self, index: torch.Tensor) -> RollingPositions:
        twin = copy.copy(self)
        twin.select_rows(index)  # new tensors: this one keeps its own
        return twin

    def append_rows(self, other: RollingPositions) -> None:
        if other.offset is None:
            return
        if self.offset is None:
            self.offset, self.n0, self.live0, self.snap = other.offset, other.n0, other.live0, list(other.snap)
            return
        self.offset = torch.cat([self.offset, other.offset])
        self.n0, self.live0 = torch.cat([self.n0, other.n0]), torch.cat([self.live0, other.live0])
        self.snap = [_cat_padded(mine, theirs) for mine, theirs in zip(self.snap, other.snap, strict=True)]

    def add_rows(self, k: int) -> None:
        """``k`` rows that have seen nothing (no offset, no snapshot)."""
        if self.offset is None:
            return
        zeros = self.offset.new_zeros(k)
        self.offset, self.n0, self.live0 = (torch.cat([t, zeros]) for t in (self.offset, self.n0, self.live0))
        self.snap = [None if s is None else torch.cat([s, s.new_full((k, *s.shape[1:]), _NEVER)]) for s in self.snap]


def _cat_padded(mine, theirs):
    if mine is None or theirs is None:
        return mine if theirs is None else theirs if mine is None else None
    width = max(mine.shape[-1], theirs.shape[-1])
    pad = [torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=_NEVER) for t in (mine, theirs)]
    return torch.cat(pad)


# -- the hook: the model computes RoPE at the positions the cache gives ---------------------------
def _position_hook(module, args, kwargs):
    cache = passed_cache(kwargs)
    rolling = getattr(cache, "rolling", None)
    if rolling is None:
        return None
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = args[0] if args else kwargs.get("inputs_embeds")
    b, n = tokens.shape[0], tokens.shape[1]
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        nonpad = mask[:, -n:].to(torch.bool)
    else:
        nonpad = torch.ones(b, n, dtype=torch.bool, device=tokens.device)
    kwargs["position_ids"] = rolling.before_call(cache, nonpad)
    return args, kwargs


def install_hook(model) -> None:
    """Once per model: a pre-hook on its base model that lets a rolling cache set the positions
    (any other cache: nothing changes)."""
    base = getattr(model, "base_model", model)
    if not getattr(base, _HOOKED, False):
        base.register_forward_pre_hook(_position_hook, with_kwargs=True)
        setattr(base, _HOOKED, True)
