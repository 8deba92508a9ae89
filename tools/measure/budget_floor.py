"""How many slots a short chat prompt needs to be answered as the full cache answers it: the
measurement behind ``DEFAULT_BUDGET_FLOOR`` (src/h2okv/core/budget.py).

Twelve one-fact chat questions (36-40 tokens with the template) are answered greedily, 64 new
tokens, with the full cache and with h2o at a fixed number of slots per layer and KV head (half
heavy, half recent). Writes one row per question: the prompt length and every answer.

    .venv/bin/python tools/measure/budget_floor.py --json docs/results/budget-floor.json
"""

import argparse
import json

import torch

from h2okv import H2OCache, load_model
from h2okv.core.compat import cache_arg

QUESTIONS = [
    "What is the capital of France?", "Who wrote Romeo and Juliet?", "What is 12 plus 7?",
    "Name the largest planet in the solar system.", "What color is the sky on a clear day?",
    "How many legs does a spider have?", "What is the boiling point of water in Celsius?",
    "Translate 'thank you' into Spanish.", "What is the chemical symbol for gold?",
    "Give me three fruits that are red.", "Who painted the Mona Lisa?", "What language is spoken in Brazil?",
]
SLOTS = [6, 16, 32, 48, 64, 96, 128]


def answer(model, tokenizer, enc, cache, max_new_tokens: int) -> str:
    with torch.inference_mode():
        out = model.generate(**enc, **cache_arg(cache), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    rows = []
    for question in QUESTIONS:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        row = {"question": question, "prompt_tokens": int(enc["input_ids"].shape[1]),
               "full": answer(model, tokenizer, enc, H2OCache(model, policy="full"), args.max_new_tokens)}
        for slots in SLOTS:
            cache = H2OCache(model, policy="h2o", heavy=slots // 2, recent=slots - slots // 2)
            row[str(slots)] = answer(model, tokenizer, enc, cache, args.max_new_tokens)
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {str(s): {"identical": sum(r[str(s)] == r["full"] for r in rows),
                        "same_first_sentence": sum(r[str(s)].split(".")[0] == r["full"].split(".")[0] for r in rows)}
               for s in SLOTS}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"questions": len(rows), "max_new_tokens": args.max_new_tokens, "by_slots": summary, "rows": rows},
                  f, indent=1)
    for s in SLOTS:
        print(f"{s:4d} slots: {summary[str(s)]['identical']:2d}/{len(rows)} identical answers, "
              f"{summary[str(s)]['same_first_sentence']:2d}/{len(rows)} with the same first sentence")


if __name__ == "__main__":
    main()
