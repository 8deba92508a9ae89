"""``h2okv demo`` (what ``make demo`` runs): a question about a Hamlet scene, answered with the full
cache and with evicting policies at 20%, and where each answer first departs from full's."""

from __future__ import annotations

from h2okv.cli.args import positive_int
from h2okv.corpus import read_play

QUESTION = "Who is on guard when the scene opens, who relieves him, and what have the guards seen on the nights before?"
# (policy, label) compared with the full cache, all at the paper's 20% (10% heavy + 10% recent)
POLICIES = (("h2o", "H2O"), ("snapkv", "SnapKV (prompt-aware H2O)"))


def register(sub) -> None:
    p = sub.add_parser("demo", help="a question about a Hamlet scene: full cache vs H2O and SnapKV at 20%% on the default model")
    p.add_argument("--prompt-tokens", type=positive_int, default=900, help="tokens of the scene in the prompt (default: 900)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.set_defaults(func=run)


def scene(tokenizer, tokens: int) -> str:
    """The first ``tokens`` tokens of Act I, Scene I (the play's front matter is a cast list)."""
    play = read_play("hamlet_gut")
    text = play[play.find("ACT I.") :]
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens])


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """Index of the first token where ``other`` departs from ``reference`` (None: identical)."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def run(args) -> int:
    from h2okv.generation import generate, summary_line
    from h2okv.models import load_model

    model, tokenizer = load_model()
    passage = scene(tokenizer, args.prompt_tokens)
    prompt = f"Here is the opening of Hamlet.\n\n{passage}\n\nQuestion: {QUESTION}"
    print(f"Chat prompt: {args.prompt_tokens} tokens of Hamlet, Act I, ending with:\n  ...{passage[-160:]!r}")
    print(f"Question: {QUESTION}\n")
    full = generate(model, tokenizer, prompt, policy="full", max_new_tokens=args.max_new_tokens, chat=True)
    print("=== full cache ===")
    print(full.text.strip())
    print(summary_line(full.stats))
    print()
    for policy, label in POLICIES:
        result = generate(model, tokenizer, prompt, policy=policy, max_new_tokens=args.max_new_tokens, chat=True,
                          heavy_ratio=0.1, recent_ratio=0.1)
        print(f"=== {label}, 20% cache (10% heavy + 10% recent) ===")
        print(result.text.strip())
        print(summary_line(result.stats))
        at = first_difference(full.token_ids, result.token_ids)
        if at is None:
            print(f"-> the same {len(full.token_ids)} tokens as the full cache")
        else:
            same = tokenizer.decode(full.token_ids[:at])
            print(f"-> same as full for {at} tokens ({same[-60:]!r}), then {label.split()[0]} writes "
                  f"{tokenizer.decode(result.token_ids[at:at + 8])!r} where full writes {tokenizer.decode(full.token_ids[at:at + 8])!r}")
        print()
    return 0
