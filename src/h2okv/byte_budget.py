"""A budget in bytes: what a user buys, turned into the bits and the slots a cache keeps.

Two spellings (``CacheSettings.bytes``; ``budget="4MiB"`` is the first):

- **bytes per sequence** (``4MiB``, ``4194304``): every layer's kept keys and values of one
  sequence, scales included, at most this many bytes;
- **a fraction of a full cache's bytes** (``0.1``): at most this share of what a full cache of the
  same tokens holds **in 16 bits** (bf16/fp16, what a model is served in; an fp32 CPU run is held
  to the same bytes, so 8-bit slots are not flattered 4x).

The slots are quantized (``BYTES_CODING``: 8-bit keys, 4-bit values, unless ``kv_bits`` says
otherwise), and then as many are kept as fit: a fraction ``f`` keeps ``f / share`` of each prompt's
tokens, where ``share`` is a coded slot's bytes over a 16-bit one's (7/16 for 8/4 bits in groups
of 32: ``f = 0.1`` keeps 22.8% of the tokens); bytes per sequence keep ``bytes / (layers x KV
heads x a slot's bytes)`` slots per layer and head, the next token's slot among them. A fraction is
of each prompt's tokens, so it holds the bytes asked up to that one slot and the rounding of a
fraction to slots; a chunked prefill holds one chunk more while it reads (``stats()["peak_capacity"]``).

Torch-free (the settings resolve a budget before torch loads); the arithmetic of a coded vector is
here once, and ``core/quant.py``'s codec is tested to store exactly this many bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from h2okv.core.compat import config_head_dim  # torch-free: the core package loads nothing by itself
from h2okv.vocabulary import SettingError

SCALE_BYTES = 2  # a group's scale and its low, each float16 (core/quant.py)
MEAN_BYTES = 2  # a centered key's mean, float16 a channel (core/quant.py: KeyCenter)
FULL_BITS = 16  # the full cache a fraction of bytes is measured against


def vector_bytes(dim: int, bits: int, group: int) -> int:
    """Bytes of one stored ``dim``-channel key or value: ``bits`` a channel, and a float16 scale and
    low per ``group`` channels (a group is at most the vector)."""
    group = min(group, dim)
    return dim * bits // 8 + 2 * SCALE_BYTES * (dim // group)


@dataclass(frozen=True)
class Geometry:
    """What a budget in bytes needs of a model: its layers, KV heads and head dimensions."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def of(cls, config) -> Geometry:
        """From a transformers (text) config."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = config_head_dim(config)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, head_dim)

    def slot_bytes(self, key_bits: int, value_bits: int, group: int) -> int:
        """One kept token's key and value in one layer and KV head."""
        return vector_bytes(self.key_dim, key_bits, group) + vector_bytes(self.value_dim, value_bits, group)

    def full_slot_bytes(self) -> int:
        return (self.key_dim + self.value_dim) * FULL_BITS // 8

    def beside_slot_bytes(self, window: int, center: bool, itemsize: int = FULL_BITS // 8) -> int:
        """What one sequence holds beside its slots in one layer and KV head: a float window's
        ``window`` tokens at ``itemsize`` bytes a channel, and centered keys' mean."""
        return window * (self.key_dim + self.value_dim) * itemsize + (self.key_dim * MEAN_BYTES if center else 0)


def parse_bytes_budget(value) -> int | float:
    """``bytes`` as given: a fraction in (0, 1] of a full 16-bit cache's bytes (a float), or bytes per
    sequence (a whole number > 1, or text such as ``4MiB``, ``512K``, ``1.5M``); else a one-line error."""
    from h2okv.sizes import parse_bytes

    if isinstance(value, bool):
        raise SettingError("{bytes} must be a fraction of a full cache's bytes in (0, 1] or bytes per sequence "
                           "(e.g. 0.1 or 4MiB), got {got}", got=repr(value))
    if isinstance(value, float) and (value <= 1 or not value.is_integer()):  # nan and inf too
        if not 0.0 < value <= 1.0:
            raise SettingError("{bytes} as a fraction of a full cache's bytes must be in (0, 1], got {got}", got=value)
        return value
    if isinstance(value, (int, float)):  # a whole number: bytes
        if value <= 1:
            raise SettingError("{bytes} must be bytes per sequence > 1 or a fraction in (0, 1], got {got}", got=value)
        return int(value)
    try:
        return parse_bytes(str(value))
    except Exception:  # noqa: BLE001 - argparse's type error, said again in the caller's words
        raise SettingError("{bytes} must be a fraction of a full cache's bytes in (0, 1] or bytes per sequence "
                           "(e.g. 0.1, 4194304 or 4MiB), got {got}", got=repr(value)) from None


def looks_like_bytes(budget) -> bool:
    """``budget="4MiB"``: text with a byte unit is bytes per sequence (``CacheSettings.build`` moves
    it to ``bytes``); a number, or other text, stays a budget in slots or a fraction."""
    from h2okv.sizes import has_byte_unit

    return isinstance(budget, str) and has_byte_unit(budget)


def budget_for_bytes(asked: int | float, geometry: Geometry, key_bits: int, value_bits: int, group: int,
                     least: int = 1, window: int = 0, center: bool = False) -> float | int:
    """The cache's ``budget`` that spends at most ``asked`` (``parse_bytes_budget``) on slots coded in
    ``key_bits``/``value_bits``: a fraction of each prompt (for a fraction of bytes; at most 1, every
    token), or slots per layer and KV head (for bytes per sequence; at least ``least``, else a
    one-line error that says what the bytes hold). ``window``: a float window's tokens
    (``float_window``), held in 16 bits beside the slots, taken from bytes per sequence first (a
    fraction of a prompt's bytes cannot hold a window of fixed size: ``CacheSettings`` refuses it).
    ``center``: centered keys (``center_keys``) hold one float16 mean key per layer and KV head
    beside the slots, also taken from bytes per sequence (a fraction's slots are the prompt's share:
    the mean, a slot's key in 16 bits, is counted in what the cache reports, not here)."""
    slot = geometry.slot_bytes(key_bits, value_bits, group)
    if isinstance(asked, float):
        return min(1.0, asked * geometry.full_slot_bytes() / slot)
    per_layer_head = geometry.layers * geometry.kv_heads
    beside = per_layer_head * geometry.beside_slot_bytes(window, center)
    # a layer holds one slot more than its budget, the next token's (written, then the step evicts)
    slots = max(asked - beside, 0) // (per_layer_head * slot) - 1
    if slots < least:
        raise SettingError("{bytes} {got} holds {slots} slot(s) per layer and KV head ({slot} bytes each over {layers} "
                           "layers x {heads} KV heads{beside}); this policy needs at least {least}: give more bytes",
                           got=asked, slots=max(slots, 0),
                           slot=slot, layers=geometry.layers, heads=geometry.kv_heads, least=least,
                           beside=f", beside a float window of {window} tokens" if window else "")
    return int(slots)
