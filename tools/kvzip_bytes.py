"""KV bytes a ``kvzip`` ranking allocates, per head-budget split, on one prompt of a longctx export.

    .venv/bin/python tools/kvzip_bytes.py smollm2 docs/results/longctx/longctx-prompts-smollm2.json
    .venv/bin/python tools/kvzip_bytes.py qwen2.5-1.5b docs/results/longctx/longctx-prompts-qwen1.5b-2048.json \
        --splits layers --recent-share 0.01 --head-floor 0

Reads the export's first prompt's context with policy ``kvzip`` at 20% (recent share 0.05 unless
told), runs ``h2okv.reconstruct``, and prints per split (uniform, adaptive, layers) the live slots
(the budget everywhere) and the bytes the layers' buffers hold (``H2OCache.stats``), beside a full
cache's.
"""

import argparse
import json

import torch

from h2okv import load_model, reconstruct
from h2okv.eval.longctx.prompt import Frame
from h2okv.generation import new_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("export", help="an `h2okv eval longctx --export-prompts` file")
    parser.add_argument("--splits", default="uniform,adaptive,layers")
    parser.add_argument("--recent-share", type=float, default=0.05)
    parser.add_argument("--head-floor", type=float, default=None, help="default: the cache's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    prompt = json.loads(open(args.export).read())["prompts"][0]
    ids = torch.tensor([prompt["context_ids"]])
    head = len(Frame(tokenizer, True).head)
    floor = {} if args.head_floor is None else {"head_floor": args.head_floor}
    for split in args.splits.split(","):
        cache = new_cache(model, "kvzip", 0.2, recent_share=args.recent_share, prefill="late", head_budgets=split,
                          **floor)
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        reconstruct(model, cache, ids, tokenizer, start=head)
        stats = cache.stats()
        live = sum(int(layer.valid.sum()) for layer in cache.layers)
        print(f"{split:8s} context {ids.shape[1]} budget {stats['budget']} live slots {live} "
              f"KV {stats['kv_bytes'] / 2**20:.2f} MiB (full {stats['full_kv_bytes'] / 2**20:.2f} MiB), "
              f"layer capacity {min(stats['capacity'])}-{max(stats['capacity'])}", flush=True)


if __name__ == "__main__":
    main()
