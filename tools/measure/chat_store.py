"""Graded chats through the prefix store, one server configuration per run: how many of the chat
profile's hidden numbers a policy or recipe still answers when each turn resumes the state the
previous one stored (the store only; ``serve-bench --profile chat`` runs each with and without).

The conversations are ``serve-bench --profile chat``'s (``h2okv.bench.chat``): a system message
holding an essay with one "special magic number" per turn, the whole conversation resent each
turn. ``--seed 1`` draws other documents than the profile's default. Rows per turn, the store's
bytes and entries at the end (what the same store memory holds per conversation).

    python tools/measure/chat_store.py --model qwen2.5-0.5b --recipe document --recent-share 0.1 \\
        --conversations 8 --seed 1 --json docs/results/serve/chat-8conv-document-share0.1.json
    python tools/measure/chat_store.py --model qwen2.5-0.5b --policy full --conversations 8 --seed 1 \\
        --json docs/results/serve/chat-8conv-full.json
"""

import argparse
import asyncio

from h2okv import load_model
from h2okv.bench.chat import conversations, drive_chats, per_turn
from h2okv.bench.serve import scrape
from h2okv.eval.output import write_json
from h2okv.serve.api.app import create_app
from h2okv.serve.api.server import running_server
from h2okv.serve.eviction import EvictionDefaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--recipe", default=None, help="a recipe (its policy unless --policy is given)")
    parser.add_argument("--policy", default=None, help="a policy, or options of the recipe's (kvzip:kernel=7)")
    parser.add_argument("--budget", type=float, default=0.2, help="fraction of each prompt (evicting runs)")
    parser.add_argument("--recent-share", type=float, default=None)
    parser.add_argument("--prefill", choices=("chunked", "late"), default=None, help="(default: the recipe's, else chunked)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--store", default=512, type=int, help="prefix store MiB (default 512)")
    parser.add_argument("--kv-memory", default=512, type=int, help="KV MiB for running requests (default 512)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    model, tok = load_model(args.model)
    convs = conversations(tok, args.conversations, args.doc_tokens, args.turns, args.seed)
    if args.recipe is None and args.policy == "full":
        eviction = EvictionDefaults(policy="full", budget_floor=0)
    else:
        eviction = EvictionDefaults.from_options(recipe=args.recipe, policy=args.policy, budget=args.budget,
                                                 recent_share=args.recent_share, budget_floor=0, prefill=args.prefill)
    app = create_app(model, tok, model_name="m", eviction=eviction, kv_memory=args.kv_memory << 20,
                     prefill_chunk=128, prefix_memory=args.store << 20)
    with running_server(app) as url:
        rows = asyncio.run(drive_chats(url, tok, "m", convs, args.max_tokens, args.concurrency))
        after = scrape(url)
    result = {"settings": eviction.describe(), "args": vars(args), "turns": per_turn(rows, args.turns),
              "correct": sum(r["correct"] for r in rows), "answered": len(rows), "rows": rows,
              "prefix_bytes": after.get("h2okv_prefix_cache_bytes"), "entries": after.get("h2okv_prefix_cache_entries")}
    write_json(result, args.json)
    print(f"{result['settings']}: {result['correct']}/{result['answered']} right; "
          f"{[(t['turn'], t['correct'], t['ttft_median_s']) for t in result['turns']]}; "
          f"store {result['prefix_bytes']} bytes in {result['entries']} entries")


if __name__ == "__main__":
    main()
