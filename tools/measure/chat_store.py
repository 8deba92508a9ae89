"""Graded chats through the prefix store, one server configuration per run: how many of the chat
profile's hidden numbers (``--source essays``) or CoQA's real questions (``--source coqa``) a policy
or recipe still answers when each turn resumes the state the previous one stored (the store only;
``serve-bench --profile chat`` runs each with and without).

``--source coqa`` (``h2okv.bench.doc_chat``): ``--documents`` documents of ``--doc-tokens`` tokens of
CoQA's stories (the test split's half with seed 1), ``--per-document`` conversations over each,
each about another story, ``--turns`` of its CoQA questions in order, graded by token F1.

The conversations are ``serve-bench --profile chat``'s (``h2okv.bench.chat``): a system message
holding an essay with one "special magic number" per turn, the whole conversation resent each
turn. ``--seed 1`` draws other documents than the profile's default. Rows per turn, the store's
bytes and entries at the end (what the same store memory holds per conversation).

    python tools/measure/chat_store.py --model qwen2.5-0.5b --recipe document --recent-share 0.1 \\
        --conversations 8 --seed 1 --json docs/results/serve/chat-8conv-document-share0.1.json
    python tools/measure/chat_store.py --model qwen2.5-0.5b --policy full --conversations 8 --seed 1 \\
        --json docs/results/serve/chat-8conv-full.json
    python tools/measure/chat_store.py --model qwen2.5-0.5b --source coqa --documents 3 --per-document 2 \\
        --turns 3 --doc-tokens 2048 --json docs/results/serve/coqa-chat-default.json    # the server's default
"""

import argparse
import asyncio

from h2okv import load_model
from h2okv.bench.chat import conversations, drive_chats, per_turn
from h2okv.bench.doc_chat import coqa_chats
from h2okv.bench.serve import scrape
from h2okv.eval.output import write_json
from h2okv.serve.api.app import create_app
from h2okv.serve.api.server import running_server
from h2okv.serve.engine import EngineOptions
from h2okv.serve.eviction import EvictionDefaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--recipe", default=None, help="a recipe (its policy unless --policy is given)")
    parser.add_argument("--policy", default=None, help="a policy, or options of the recipe's (kvzip:kernel=7)")
    parser.add_argument("--budget", type=float, default=0.2, help="fraction of each prompt (evicting runs; with "
                        "neither --recipe nor --policy, the server's default: `h2okv serve` with no flags)")
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
    parser.add_argument("--source", choices=("essays", "coqa"), default="essays",
                        help="hidden numbers in essays, or CoQA's stories and questions graded by F1")
    parser.add_argument("--documents", type=int, default=3, help="--source coqa: documents")
    parser.add_argument("--per-document", type=int, default=2, help="--source coqa: conversations over each document")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    model, tok = load_model(args.model)
    if args.source == "coqa":
        convs = coqa_chats(tok, args.documents, args.per_document, args.turns, args.doc_tokens, args.seed)
    else:
        convs = conversations(tok, args.conversations, args.doc_tokens, args.turns, args.seed)
    if args.recipe is None and args.policy is None:  # what `h2okv serve` runs with no flags
        from h2okv.cli.serve import DEFAULT_RECIPE

        eviction = EvictionDefaults.from_options(recipe=DEFAULT_RECIPE)  # its budget and floor too
    elif args.recipe is None and args.policy == "full":
        eviction = EvictionDefaults.from_options(policy="full", budget_floor=0)
    else:
        eviction = EvictionDefaults.from_options(recipe=args.recipe, policy=args.policy, budget=args.budget,
                                                 recent_share=args.recent_share, budget_floor=0, prefill=args.prefill)
    app = create_app(model, tok, model_name="m", eviction=eviction,
                     options=EngineOptions(kv_memory=args.kv_memory << 20, prefill_chunk=128,
                                           prefix_memory=args.store << 20))
    with running_server(app) as url:
        rows = asyncio.run(drive_chats(url, tok, "m", convs, args.max_tokens, args.concurrency))
        after = scrape(url)
    result = {"settings": eviction.describe(), "args": vars(args), "turns": per_turn(rows, args.turns),
              "correct": sum(r["correct"] for r in rows), "answered": len(rows),
              "score_mean": round(sum(r["score"] for r in rows) / max(1, len(rows)), 4), "rows": rows,
              "prefix_bytes": after.get("h2okv_prefix_cache_bytes"), "entries": after.get("h2okv_prefix_cache_entries")}
    write_json(result, args.json)
    print(f"{result['settings']}: {result['correct']}/{result['answered']} right, mean score {result['score_mean']}; "
          f"{[(t['turn'], t['correct'], t['score_mean'], t['ttft_median_s']) for t in result['turns']]}; "
          f"store {result['prefix_bytes']} bytes in {result['entries']} entries")


if __name__ == "__main__":
    main()
