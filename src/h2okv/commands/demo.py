"""``h2okv demo`` (what ``make demo`` runs): the same prompt with ``full`` and with ``h2o`` at 20%."""

from __future__ import annotations

from ..corpus import read_play
from ..generate import generate, summary_line
from ..models import load_model
from .common import positive_int


def register(sub) -> None:
    p = sub.add_parser("demo", help="full cache vs H2O at 20%% on the default model and a Hamlet prompt")
    p.add_argument("--prompt-tokens", type=positive_int, default=1024)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.set_defaults(func=run)


def run(args) -> int:
    model, tokenizer = load_model()
    ids = tokenizer(read_play("hamlet_gut"), add_special_tokens=False)["input_ids"][: args.prompt_tokens]
    prompt = tokenizer.decode(ids)
    print(f"Prompt: the first {len(ids)} tokens of Hamlet, ending with:\n  ...{prompt[-200:]!r}\n")
    for policy, budget in (("full", {}), ("h2o", {"heavy_ratio": 0.1, "recent_ratio": 0.1})):
        result = generate(model, tokenizer, prompt, policy=policy, max_new_tokens=args.max_new_tokens, **budget)
        label = "full cache" if policy == "full" else "H2O, 20% cache (10% heavy + 10% recent)"
        print(f"=== {label} ===")
        print(result.text.strip())
        print(summary_line(result.stats))
        print()
    return 0
