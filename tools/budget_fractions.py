"""The KV each recipe holds at a budget, as a share of a full cache's: a ~1,500-token chat prompt,
16 new tokens, the library's ``generate`` on the default model (issue 58, "a budget means the
bytes the user sees").

    .venv/bin/python tools/budget_fractions.py [--budget 0.2] [--tokens 1500] [--option tail_in_budget=True]

Per recipe (``H2OCache.stats``): the KV bytes held / a full cache's, the live tokens / a full
cache's (the buffers' other slots are room: growth, or the widest head's width that a dense layer
of uneven head budgets holds for every head) and the most tokens a head holds above the budget
(kvzip's tail). ``--option policy=kvzip:tail_in_budget=1 --recipes prompt`` tries an option.
"""

import argparse

from h2okv import load_model
from h2okv.corpus import read_play, token_prefix
from h2okv.generation import generate
from h2okv.recipes import RECIPE_NAMES


def option(text: str):
    key, _, value = text.partition("=")
    return key, {"True": True, "False": False}.get(value, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--tokens", type=int, default=1500, help="the context's tokens before the chat frame")
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--recipes", default=",".join(RECIPE_NAMES))
    parser.add_argument("--option", action="append", default=[], help="an H2OCache keyword, key=value")
    args = parser.parse_args()
    model, tokenizer = load_model()
    context = tokenizer.decode(token_prefix(tokenizer, read_play(), args.tokens))
    prompt = context + "\n\nWho speaks first in this scene, and what does he ask?"
    options = dict(option(text) for text in args.option)
    print(f"budget {args.budget}, {args.new} new tokens, options {options or 'none'}")
    for recipe in args.recipes.split(","):
        out = generate(model, tokenizer, prompt, recipe=recipe, budget=args.budget, chat=True,
                       max_new_tokens=args.new, ignore_eos=True, **options)
        stats = out.stats
        print(f"{recipe:>10}: {stats['tokens_seen']} tokens seen, KV {stats['kv_share']:.1%} of full's, "
              f"live tokens {stats['live_share']:.1%}, up to {stats['above_budget_tokens']} tokens per head "
              f"above the budget")

if __name__ == "__main__":
    main()
