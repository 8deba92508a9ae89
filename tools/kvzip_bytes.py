"""KV bytes a ``kvzip`` ranking allocates, per head-budget split, on one prompt of a longctx export.

    .venv/bin/python tools/kvzip_bytes.py smollm2 docs/results/longctx/longctx-prompts-smollm2.json

Reads the export's first prompt's context with policy ``kvzip`` at 20% (recent share 0.05), runs
``h2okv.reconstruct``, and prints per split (uniform, adaptive, layers) the live slots (the budget
everywhere) and the bytes the layers' buffers hold (``H2OCache.stats``), beside a full cache's.
"""

import json
import sys

import torch

from h2okv import load_model, reconstruct
from h2okv.eval.longctx.prompt import Frame
from h2okv.generation import new_cache


def main(model_name: str, export: str) -> None:
    torch.set_num_threads(1)
    model, tokenizer = load_model(model_name)
    prompt = json.loads(open(export).read())["prompts"][0]
    ids = torch.tensor([prompt["context_ids"]])
    head = len(Frame(tokenizer, True).head)
    for split in ("uniform", "adaptive", "layers"):
        cache = new_cache(model, "kvzip", 0.2, recent_share=0.05, prefill="late", head_budgets=split)
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        reconstruct(model, cache, ids, tokenizer, start=head)
        stats = cache.stats()
        live = sum(int(layer.valid.sum()) for layer in cache.layers)
        print(f"{split:8s} context {ids.shape[1]} budget {stats['budget']} live slots {live} "
              f"KV {stats['kv_bytes'] / 2**20:.2f} MiB (full {stats['full_kv_bytes'] / 2**20:.2f} MiB), "
              f"layer capacity {min(stats['capacity'])}-{max(stats['capacity'])}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
