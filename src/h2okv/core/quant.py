"""Quantized slots: a kept token's key and value vectors in 8, 4 or 2 bits (``kv_bits``).

Each slot is quantized on its own, per token, in groups of ``group`` channels: a group's codes are
``round((x - low) / scale)`` in ``[0, 2**bits - 1]``, with its ``low`` (the group's minimum) and
``scale`` stored in float16 beside the codes (asymmetric min-max, as KIVI's values and HQQ's
groups). Codes of 4 and 2 bits are packed two and four to a byte.

Per token and not per channel (KIVI quantizes keys per channel, across tokens): a slot is evicted
and written alone, every step, so a scale shared with other slots would have to be re-fitted, and
every slot of its group re-coded, whenever one of them leaves. Per token, a write codes one slot
and an eviction touches nothing.

The layer reads its slots back through ``decode`` (``SlotStorage.kv``): attention, scoring and
eviction see the dequantized values and are otherwise unchanged. A forward call's new keys and
values are passed through ``roundtrip`` before anything attends to them (``SlotLayer.attend``), so
a token attends to itself as it is stored, and every path (a chunk, the per-token scan, a decode
step) gives what the same path gives an unquantized cache fed the dequantized values
(``tests/core/test_quantized_slots.py``). Coding a roundtripped vector again gives the same
codes, scale and low (tested): writing it costs nothing more in accuracy.

**A float window** (``SlotCoding.window``, ``float_window``): each row's last ``window`` tokens are
also kept in the model's dtype, beside their codes, and read back from there until a newer token
takes their place; then their codes, written with them, are what they read back (KIVI's residual
window of recent tokens in full precision). Each query reads its own last ``window`` tokens in float
and older ones from their codes, however the tokens were cut into calls (``SlotStorage.banded_kv``
for a chunk, the scan's band in ``core/scan.py``; a one-token step reads the window as it stands).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2okv.settings import DEFAULT_KV_GROUP
from h2okv.settings import KV_BITS as BITS

SCALE_DTYPE = torch.float16  # the group's scale and low: 4 bytes a group, whatever the model's dtype


@dataclass(frozen=True)
class SlotCodec:
    """How a layer stores its slots' keys and values: ``bits`` per channel, one float16 scale and
    low per ``group`` channels of a token."""

    bits: int
    group: int = DEFAULT_KV_GROUP

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"kv_bits must be one of {', '.join(map(str, BITS))}, got {self.bits!r}")
        if self.group < 1:
            raise ValueError(f"kv_group must be >= 1, got {self.group!r}")

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def groups(self, dim: int) -> int:
        """Groups of a ``dim``-channel vector (a group that does not divide ``dim`` is refused)."""
        if dim % self.group or self.group % self.per_byte:
            raise ValueError(f"kv_group {self.group} must divide the head dimension {dim} and be a multiple of "
                             f"{self.per_byte} ({self.bits}-bit codes pack {self.per_byte} to a byte)")
        return dim // self.group

    def code_width(self, dim: int) -> int:
        """Bytes of codes per ``dim``-channel vector."""
        return dim // self.per_byte

    def bytes_per_vector(self, dim: int) -> int:
        """What one stored key or value vector costs: its codes, and its groups' scale and low."""
        return self.code_width(dim) + 2 * self.groups(dim) * torch.finfo(SCALE_DTYPE).bits // 8

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[..., D]`` -> ``(codes [..., D / per_byte] uint8, scale [..., G], low [..., G])``."""
        levels, scale, low = self._fit(x)
        return self.pack(levels.to(torch.uint8).reshape(x.shape)), scale, low

    def encode_and_decode(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """``(encode(x), decode(*encode(x), x.dtype))`` from one fit, without unpacking the codes just
        packed: the levels are whole numbers in float32 either way, so the values are the same."""
        levels, scale, low = self._fit(x)
        decoded = self._values(levels, scale, low, x.dtype).reshape(x.shape)
        return (self.pack(levels.to(torch.uint8).reshape(x.shape)), scale, low), decoded

    def _fit(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``'s levels (float32 ``[..., G, group]``, whole numbers), scale and low."""
        *lead, dim = x.shape
        grouped = x.float().reshape(*lead, self.groups(dim), self.group)
        low = grouped.amin(-1).to(SCALE_DTYPE)
        # the scale and low as stored (float16) are the ones the codes are fitted to, so that
        # decoding gives the nearest level of what is stored, and coding that again changes nothing
        span = grouped.amax(-1) - low.float()
        scale = (span / self.levels).to(SCALE_DTYPE)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0
        levels = ((grouped - low.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, self.levels)
        return levels, scale, low

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stored vectors ``[..., D]`` in ``dtype``."""
        levels = self.unpack(codes)
        *lead, dim = levels.shape
        grouped = levels.reshape(*lead, dim // self.group, self.group).float()
        return self._values(grouped, scale, low, dtype).reshape(*lead, dim)

    @staticmethod
    def _values(levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Grouped float32 levels ``[..., G, group]`` back to values in ``dtype`` (still grouped)."""
        return (levels * scale.float()[..., None] + low.float()[..., None]).to(dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a slot would give it back (its codes never packed: the same values, one fit)."""
        levels, scale, low = self._fit(x)
        return self._values(levels, scale, low, x.dtype).reshape(x.shape)

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` codes of ``bits`` each -> ``[..., D / per_byte]`` bytes (the first code low)."""
        if self.per_byte == 1:
            return codes
        parts = codes.reshape(*codes.shape[:-1], codes.shape[-1] // self.per_byte, self.per_byte)
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=codes.device)
        return (parts << shifts).sum(-1, dtype=torch.uint8)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        if self.per_byte == 1:
            return packed
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=packed.device)
        return ((packed[..., None] >> shifts) & self.levels).reshape(*packed.shape[:-1], packed.shape[-1] * self.per_byte)


CENTER_TOKENS = 256  # a row's first real tokens whose keys give the channel means (``KeyCenter``)


@dataclass(frozen=True)
class KeyCenter:
    """Keys coded less their channel's mean, turned to each key's position (``center_keys``).

    A model with a key bias (Qwen2.5's) gives some channels a large constant offset before the
    rotary turn (the bias alone explains the first layer's; the tokens' mean, the later layers' too).
    Coded per token, that offset sets the group's range and 4 bits lose the small channels (2.2x the
    0.5B's perplexity, ``docs/RESULTS.md``). Per row and KV head, the mean of the row's first
    ``first`` keys taken back before their turn (``mean``, float16, kept beside the slots) is turned
    to each slot's position and taken from its key before coding, and put back when read: only the
    residual is coded, and a slot still codes alone, so eviction touches nothing. ``first`` is 256,
    at most the cache's chunk: the mean comes from a row's first call, so a server that reads a
    prompt a chunk a call gets the mean a whole call gets. Encoding and decoding turn the mean by
    the slot's ordinal, so they agree whatever positions the model gave (a constant shift of the
    positions only shifts the mean's turn with them). ``inv_freq``: the model's rotary frequencies
    (rotate-half pairs over the first ``2 * len(inv_freq)`` channels, ``core/rope.py``), a tuple so
    that codings compare by value."""

    inv_freq: tuple[float, ...]
    first: int = CENTER_TOKENS

    def frequencies(self, device) -> torch.Tensor:
        """The frequencies as a float32 tensor on ``device`` (a layer builds it once:
        ``SlotStorage.center_freq``). float32 angles, not the float64 that ``RopeRotation`` turns
        keys with: the turn only has to be the same when a key is coded and when it is read (both
        form it from the slot's ordinal alike), and at far positions its rounding (a few thousandths
        of a radian at 32k) only centers a little less exactly. Half the cost of a step's turn."""
        return torch.tensor(self.inv_freq, dtype=torch.float32, device=device)

    @staticmethod
    def turn(x: torch.Tensor, ordinal: torch.Tensor, freq: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
        """``x`` ``[B, H, n, D]`` or ``[B, H, 1, D]`` (float32) turned to positions ``sign * ordinal``
        ``[B, H, n]`` at frequencies ``freq`` (``frequencies``): a new ``[B, H, n, D]`` tensor."""
        half = freq.numel()
        angle = (ordinal.to(freq.dtype) * sign)[..., None] * freq
        cos, sin = angle.cos(), angle.sin()
        first, second, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        rest = rest.expand(*angle.shape[:-1], rest.shape[-1])  # channels past the rotary ones stay
        return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)

    def offset(self, centering: tuple, ordinal: torch.Tensor) -> torch.Tensor:
        """A layer's ``(mean [B, H, D], freq)`` (``SlotStorage.centering``), the mean turned to each
        slot's ordinal ``[B, H, n]``: ``[B, H, n, D]`` float32 (the mean broadcast, never copied per slot)."""
        mean, freq = centering
        return self.turn(mean.float()[:, :, None, :], ordinal, freq)

    def mean_of(self, keys: torch.Tensor, ordinal: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
        """``[B, H, D]``: each row's mean key before the turn over its tokens of ordinal below
        ``first`` (``ordinal`` ``[B, n]``, -1 for a pad); a row with none gets zeros."""
        taken = ((ordinal >= 0) & (ordinal < self.first)).float()[:, None, :, None]  # [B, 1, n, 1]
        before = self.turn(keys.float(), ordinal.clamp_min(0)[:, None, :].expand(keys.shape[:3]), freq, -1.0)
        return ((before * taken).sum(2) / taken.sum(2).clamp_min(1.0)).to(SCALE_DTYPE)


@dataclass(frozen=True)
class SlotCoding:
    """A layer's coding of its keys and of its values. Keys may take more bits than values: their
    outlier channels (Qwen2.5's) make a per-token code of 4 bits cost the 0.5B 2.2x its perplexity,
    where 4-bit values cost nothing measurable (``docs/RESULTS.md``, quantized slots)."""

    keys: SlotCodec
    values: SlotCodec
    window: int = 0  # each row's last tokens also kept in the model's dtype (the module docstring)
    center: KeyCenter | None = None  # keys coded less their channel's turned mean (``KeyCenter``)

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"float_window must be a whole number >= 0, got {self.window!r}")

    def bytes_per_slot(self, key_dim: int, value_dim: int) -> int:
        return self.keys.bytes_per_vector(key_dim) + self.values.bytes_per_vector(value_dim)

    def encode_keys(self, keys: torch.Tensor, centering: tuple | None, ordinal: torch.Tensor | None):
        """``keys`` ``[B, H, n, D]`` at slot ordinals ``[B, H, n]`` -> ``(codes, scale, low)``;
        ``centering``: the layer's (``SlotStorage.centering``), None for keys not centered."""
        if self.center is None:
            return self.keys.encode(keys)
        return self.keys.encode(keys.float() - self.center.offset(centering, ordinal))

    def decode_keys(self, parts: tuple, centering: tuple | None, ordinal: torch.Tensor, dtype: torch.dtype):
        """The keys ``encode_keys`` coded, in ``dtype``."""
        if self.center is None:
            return self.keys.decode(*parts, dtype)
        return (self.keys.decode(*parts, torch.float32) + self.center.offset(centering, ordinal)).to(dtype)

    def encode_and_decode_keys(self, keys: torch.Tensor, centering: tuple | None, ordinal: torch.Tensor | None):
        """``(encode_keys(...), decode_keys(...))`` from one fit (``SlotCodec.encode_and_decode``)."""
        if self.center is None:
            return self.keys.encode_and_decode(keys)
        offset = self.center.offset(centering, ordinal)
        parts, residual = self.keys.encode_and_decode(keys.float() - offset)
        return parts, (residual + offset).to(keys.dtype)
