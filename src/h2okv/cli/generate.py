"""``h2okv generate``: one generation with an eviction policy, then a one-line memory summary."""

from __future__ import annotations

import sys
from pathlib import Path

from h2okv.cli.args import (
    add_budget_args,
    add_cache_args,
    add_model_args,
    add_tp_args,
    cache_keywords,
    examples,
    non_negative_float,
    positive_float,
    positive_int,
    probability,
)
from h2okv.errors import H2OError
from h2okv.settings import CODING_FIELDS

EXAMPLES = examples(
    'h2okv generate --prompt "What is the capital of France?" --chat --recipe bounded --budget 0.2',
    "h2okv generate --prompt-file long.txt --recipe stream --max-new-tokens 256",
)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text with an H2O (or other policy) KV cache",
                       epilog=EXAMPLES)
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help="tokens to generate at most (default: 128); with true positions the prompt and these must "
                        "fit the model's window")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--kv-every", type=positive_int, default=None,
                   help="print the KV memory every N tokens (it stays flat once an evicting cache is full)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="sampling temperature; 0 (default) is greedy decoding")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (with --temperature)")
    p.add_argument("--repetition-penalty", type=positive_float, default=1.0,
                   help="divide the logits of tokens already in the text by this (1: off); long greedy or "
                        "low-temperature texts from small models loop without it")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND[:MODE]",
                   help="compile the decode steps at the budget with torch.compile (default backend inductor; inductor:reduce-overhead for CUDA graphs; "
                        "the first steps compile for minutes on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (every --tp rank uses the same)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never stop at the end-of-sequence token: generate exactly --max-new-tokens (long runs)")
    add_model_args(p)
    add_budget_args(p, reconstruction=True)
    add_cache_args(p, ["prefill", "head_budgets", "head_floor", "positions", "protect_prompt", *CODING_FIELDS])
    add_tp_args(p)
    p.set_defaults(func=run)


def read_prompt(args) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise H2OError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise H2OError(f"prompt file not found: {args.prompt_file}")
        prompt = path.read_text(encoding="utf-8", errors="replace")
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise H2OError("give --prompt TEXT or --prompt-file F")
    if not prompt.strip():
        raise H2OError("the prompt is empty")
    return prompt


def run(args) -> int:
    from h2okv.core.positions import parse_positions
    from h2okv.parallel import launch
    from h2okv.settings import CacheSettings

    args.prompt_text = read_prompt(args)
    parse_positions(args.positions)
    # checked before the (slow) model load and before any rank starts; every rank builds its cache from it
    args.settings = CacheSettings.build(**cache_keywords(args))
    launch.prepare(args)
    return launch.run(args, generate_on_rank)


def generate_on_rank(args) -> int:
    """The generation itself: in this process, or on every rank of a ``--tp`` run (all ranks
    compute the same tokens; rank 0 prints)."""
    from h2okv.generation import generate, summary_line
    from h2okv.models import load_model
    from h2okv.parallel.ranks import is_main_rank
    from h2okv.parallel.stats import gather_stats

    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, tp=args.tp)
    stream = args.stream and is_main_rank()

    def kv_line(seen: int, kv: int, since: int, seconds: float) -> None:  # live while streaming, on stderr
        rate = f", {since} tokens in {seconds:.0f} s" if since else ""
        print(f"[kv] tokens seen {seen}: KV {kv / 2**20:.2f} MiB{rate}", file=sys.stderr, flush=True)

    result = generate(
        model, tokenizer, args.prompt_text, args.settings, max_new_tokens=args.max_new_tokens,
        chat=args.chat, stream=stream, kv_every=args.kv_every, temperature=args.temperature, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, ignore_eos=args.ignore_eos,
        on_kv=kv_line if stream else None, compile=args.compile,
    )
    stats = gather_stats(result.stats)
    if not is_main_rank():
        return 0
    if not stream:
        print(result.text)
    else:
        print()
    for seen, kv in stats.get("kv_history", []):
        print(f"[kv] tokens seen {seen}: KV {kv / 2**20:.2f} MiB")
    print(summary_line(stats))
    return 0
