"""A long conversation under eviction with rolling positions, measured: its saved KV state stops
growing once the budget fills, and the server's RSS stays flat, turn after turn.

One in-process server (``create_app`` + ``running_server``) serves the embedded default model
(SmolLM2-135M-Instruct, CPU) with an evicting policy at a fixed slot budget (h2o by default, or a
recipe), ``positions="rolling"`` and the prefix store on. One conversation: a system message
holding an essay chunk, then ``--turns`` user questions over ``/v1/chat/completions``, each turn
resending the whole history as chat clients do (greedy, streamed for the time to first token).
After each turn: the prompt's tokens, the tokens resumed from the store (``cached_tokens``), the
bytes of the conversation's newest saved state (the store's entry with the longest ids: the
prompt and answer just read), the store's bytes and entries, and the process's RSS. The newest
state's bytes are set against what a full cache of the same tokens would hold (tokens x
``bytes_per_slot``). The RSS is this process's (the server and its client); ``--trim-heap`` reads it
after a garbage collection and ``malloc_trim``, i.e. the live memory without the free heap the C
allocator keeps.

    python tools/measure/rolling_chat.py --json docs/results/serve/rolling-chat-50.json \\
        --plot docs/results/serve/rolling-chat-50.png
    python tools/measure/rolling_chat.py --trim-heap --json docs/results/serve/rolling-chat-50-trim-heap.json
    python tools/measure/rolling_chat.py --recipe stream --budget 256 \\
        --json docs/results/serve/rolling-chat-50-stream-256.json --plot docs/results/serve/rolling-chat-50-stream-256.png
"""

import argparse
import json
import statistics
import time

import httpx
import torch

from h2okv import load_model
from h2okv.bench.memory import current_rss, release_free_heap
from h2okv.eval.haystack import essays_folder
from h2okv.eval.output import write_json
from h2okv.serve import EvictionDefaults, create_app, running_server
from h2okv.serve.engine import EngineOptions
from h2okv.serve.memory import bytes_per_slot

MIB = 1 << 20
RSS_SETTLED = 2 * MIB  # "flat": RSS within this of its range over the remaining turns
TOPICS = ("the main argument", "the first example", "technology", "habits", "the author's advice", "progress",
          "the last paragraph", "what changes over time", "the tone", "a counter-argument")
ASKS = ("What does the essay say about {}?", "Summarise {} in one sentence.", "Why does the author bring up {}?",
        "Is the essay convincing on {}?", "Give a short quote related to {}.")


def questions(count: int) -> list[str]:
    """``count`` distinct questions about the essay (deterministic)."""
    return [f"({k + 1}) " + ASKS[k % len(ASKS)].format(TOPICS[(k // len(ASKS) + k) % len(TOPICS)])
            for k in range(count)]


def essay_chunk(tokenizer, tokens: int, name: str = "addiction.txt") -> str:
    text = (essays_folder() / name).read_text()
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens])


def chat_turn(client: httpx.Client, url: str, model_name: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: its text, usage, time to first token and latency."""
    body = {"model": model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, texts, usage = None, [], None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    texts.append(content)
    return {"text": "".join(texts), "usage": usage or {}, "ttft_s": ttft, "latency_s": time.perf_counter() - start}


def settle(engine, timeout: float = 10.0) -> None:
    """Wait until the engine has finished the turn (its completed state is saved at the finish)."""
    deadline = time.monotonic() + timeout
    while not engine.idle() and time.monotonic() < deadline:
        time.sleep(0.005)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def summarise(rows: list[dict], budget_slots: int, tail: int) -> dict:
    """When the newest state stops growing, whether it stays constant after, and RSS over the turns:
    at turn 5 and at the end, its slope over the last ``tail`` turns and over the turns after the
    store is full (its first eviction: until then RSS grows with the store, by design)."""
    states = [r["state_bytes"] for r in rows]
    # the turn the budget fills: the first whose saved state read more tokens than the budget holds
    # (else the first turn from which the bytes never change)
    filled = next((r["turn"] for r in rows if r["state_tokens"] > budget_slots), None)
    if filled is None:
        filled = next(r["turn"] for k, r in enumerate(rows) if len(set(states[k:])) == 1)
    after = states[filled - 1:]
    rss = [r["rss_bytes"] for r in rows]
    last = rows[-tail:]
    full = next((r["turn"] for r in rows if r["store_evictions"] > 0), None)
    steady = [] if full is None else rows[full - 1:]
    out = {"state_full_from_turn": filled, "state_bytes_after_fill": {"min": min(after), "max": max(after),
                                                                       "spread": max(after) - min(after)},
           "state_constant_after_fill": max(after) == min(after),
           "state_bytes_last": states[-1], "state_tokens_last": rows[-1]["state_tokens"],
           "full_cache_bytes_last": rows[-1]["full_cache_bytes"],
           "state_vs_full_last": states[-1] / rows[-1]["full_cache_bytes"],
           "rss_mib_first": rss[0] / MIB, "rss_mib_last": rss[-1] / MIB,
           f"rss_slope_mib_per_turn_last_{len(last)}": slope([r["turn"] for r in last], [r["rss_bytes"] / MIB for r in last]),
           "store_bytes_last": rows[-1]["store_bytes"], "store_entries_last": rows[-1]["store_entries"],
           "resumed_turns": sum(r["cached_tokens"] > 0 for r in rows[1:]), "of_turns": len(rows) - 1}
    if len(rows) >= 5:
        out["rss_mib_turn_5"] = rss[4] / MIB
    # the first turn from which RSS stays within RSS_SETTLED of its range to the end
    settled = next(k for k in range(len(rss)) if max(rss[k:]) - min(rss[k:]) <= RSS_SETTLED)
    out["rss_settled_from_turn"] = rows[settled]["turn"]
    out["rss_mib_range_settled"] = [min(rss[settled:]) / MIB, max(rss[settled:]) / MIB]
    out["store_full_from_turn"] = full  # None: it never evicted
    if len(steady) >= 2:
        out["rss_slope_mib_per_turn_store_full"] = slope([r["turn"] for r in steady],
                                                         [r["rss_bytes"] / MIB for r in steady])
        out["rss_mib_range_store_full"] = [min(r["rss_bytes"] for r in steady) / MIB,
                                           max(r["rss_bytes"] for r in steady) / MIB]
    return out


def plot(rows: list[dict], summary: dict, title: str, path: str) -> str:
    from h2okv.eval.plots import new_figure, save_figure

    fig, axes = new_figure(ncols=2, width=5.2, height=3.8)
    turns = [r["turn"] for r in rows]
    ax = axes[0][0]
    ax.plot(turns, [r["full_cache_bytes"] / MIB for r in rows], marker=".", color="0.5", linestyle="--",
            label="a full cache of the same tokens")
    ax.plot(turns, [r["state_bytes"] / MIB for r in rows], marker=".", color="C0", label="saved state (newest)")
    ax.axvline(summary["state_full_from_turn"], color="C0", alpha=0.3, linewidth=1)
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("KV bytes of the conversation (MiB)")
    ax.set_title(title, fontsize=8.5)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7.5)
    ax.grid(alpha=0.3)
    ax = axes[0][1]
    ax.plot(turns, [r["rss_bytes"] / MIB for r in rows], marker=".", color="C3", label="process RSS")
    ax.plot(turns, [(r["rss_bytes"] - r["store_bytes"]) / MIB for r in rows], marker=".", color="C1",
            label="RSS less the store's bytes")
    ax.plot(turns, [r["store_bytes"] / MIB for r in rows], marker=".", color="C2", label="prefix store (all entries)")
    if summary.get("store_full_from_turn"):
        ax.axvline(summary["store_full_from_turn"], color="C2", alpha=0.3, linewidth=1)
    ax.set_xlabel("turn of the conversation")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7.5)
    ax.grid(alpha=0.3)
    return str(save_figure(fig, path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--essay-tokens", type=int, default=500, help="the system message's essay chunk, in tokens")
    parser.add_argument("--max-tokens", type=int, default=32, help="each answer's max_tokens (greedy)")
    parser.add_argument("--policy", default="h2o", help="the server's policy (ignored with --recipe)")
    parser.add_argument("--recipe", default=None, help="a recipe instead of --policy (e.g. stream)")
    parser.add_argument("--budget", type=int, default=1024, help="KV slots each request keeps")
    parser.add_argument("--prefix-cache-memory", type=int, default=512 * MIB, help="the prefix store's bytes")
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--trim-heap", action="store_true",
                        help="collect garbage and malloc_trim before each RSS reading (live memory, not the heap's)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", default="docs/results/serve/rolling-chat-50.json")
    parser.add_argument("--plot", default=None, help="a PNG: state vs full bytes per turn; RSS per turn")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    model, tok = load_model()
    per_slot = bytes_per_slot(model)
    if args.recipe:
        eviction = EvictionDefaults.from_options(recipe=args.recipe, budget=args.budget)
    else:
        eviction = EvictionDefaults.from_options(policy=args.policy, budget=args.budget)
    app = create_app(model, tok, model_name="smollm2", eviction=eviction,
                     options=EngineOptions(positions="rolling", prefix_memory=args.prefix_cache_memory,
                                           prefill_chunk=args.prefill_chunk))
    engine = app.state.engine
    messages = [{"role": "system", "content": "Answer briefly from this essay.\n\n" + essay_chunk(tok, args.essay_tokens)}]
    rows = []
    print(f"{'turn':>4} {'prompt':>6} {'cached':>6} {'ttft s':>7} {'turn s':>6} {'state MiB':>9} {'slots':>5} "
          f"{'full MiB':>8} {'store MiB':>9} {'entries':>7} {'RSS MiB':>8}", flush=True)
    with running_server(app) as url, httpx.Client(timeout=600) as client:
        for turn, question in enumerate(questions(args.turns), start=1):
            messages.append({"role": "user", "content": question})
            answer = chat_turn(client, url, "smollm2", messages, args.max_tokens)
            settle(engine)
            messages.append({"role": "assistant", "content": answer["text"]})
            entries = list(engine.prefixes)
            newest = max(entries, key=lambda e: len(e.ids))
            if args.trim_heap:
                release_free_heap()
            usage = answer["usage"]
            row = {"turn": turn, "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                   "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                   "ttft_s": answer["ttft_s"], "latency_s": answer["latency_s"],
                   "state_tokens": len(newest.ids), "state_bytes": newest.bytes,
                   "state_slots": newest.bytes / per_slot, "full_cache_bytes": len(newest.ids) * per_slot,
                   "store_bytes": engine.prefixes.bytes, "store_entries": len(entries),
                   "store_evictions": engine.prefixes.evicted, "rss_bytes": current_rss(), "answer": answer["text"][:60]}
            rows.append(row)
            ttft = f"{row['ttft_s']:7.2f}" if row["ttft_s"] is not None else f"{'-':>7}"
            print(f"{turn:4d} {row['prompt_tokens']:6d} {row['cached_tokens']:6d} {ttft} {row['latency_s']:6.2f} "
                  f"{row['state_bytes'] / MIB:9.2f} {row['state_slots']:5.0f} {row['full_cache_bytes'] / MIB:8.2f} "
                  f"{row['store_bytes'] / MIB:9.1f} {row['store_entries']:7d} {row['rss_bytes'] / MIB:8.1f}", flush=True)
    summary = summarise(rows, args.budget, tail=min(30, len(rows)))
    summary["seconds"] = time.perf_counter() - began
    label = f"recipe {args.recipe}" if args.recipe else args.policy
    result = {"command": "python tools/measure/rolling_chat.py " + " ".join(
                  f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
                  if v is not None and v is not False),
              "model": "SmolLM2-135M-Instruct (embedded, float32, CPU)", "eviction": eviction.describe(),
              "positions": "rolling", "budget_slots": args.budget, "prefix_cache_memory": args.prefix_cache_memory,
              "bytes_per_slot": per_slot, "max_tokens": args.max_tokens, "essay_tokens": args.essay_tokens,
              "summary": summary, "rows": rows}
    print(json.dumps(summary, indent=1))
    if args.json:
        write_json(result, args.json)  # makes the folder
        print(f"wrote {args.json}")
    if args.plot:
        title = (f"{label}, {args.budget} slots, rolling positions, store {args.prefix_cache_memory // MIB} MiB"
                 f"\n{len(rows)} turns, max_tokens {args.max_tokens}")
        print(f"wrote {plot(rows, summary, title, args.plot)}")


if __name__ == "__main__":
    main()
