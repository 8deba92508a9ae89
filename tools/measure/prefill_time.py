"""CPU seconds of one prompt's read (and optionally a few greedy tokens) under each recipe, on the
0.5B, one thread: the A/B of two code versions runs this under each checkout in turns.

    PYTHONPATH=OLD/src python tools/measure/prefill_time.py --context 4096 --recipes document
    PYTHONPATH=NEW/src python tools/measure/prefill_time.py --context 4096 --recipes document

The prompt is this repository's docs (a fixed text); ``--generate N`` times ``model.generate`` of N
tokens instead (a reconstruction recipe then runs its pass) and prints the tokens, which two
versions must share.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from h2okv import H2OCache
from h2okv.models import load_model

DOCS = Path(__file__).resolve().parents[2] / "docs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--recipes", default="document")
    parser.add_argument("--generate", type=int, default=0, help="greedy tokens (0: the prompt's read alone)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    text = "".join(path.read_text() for path in sorted(DOCS.glob("**/*.md")))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :args.context]
    row = {"context": ids.shape[1], "generate": args.generate}
    with torch.inference_mode():
        for recipe in args.recipes.split(","):
            cache = H2OCache(model, recipe=recipe, budget=0.2, tokenizer=tokenizer)
            start = time.process_time()
            if args.generate:
                out = model.generate(ids, past_key_values=cache, max_new_tokens=args.generate, do_sample=False)
                row[f"{recipe}_tokens"] = out[0, ids.shape[1]:].tolist()
            else:
                model(ids, past_key_values=cache)
            row[f"{recipe}_cpu_s"] = round(time.process_time() - start, 2)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
