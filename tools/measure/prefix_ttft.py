"""The prefix store's first promise, measured: a chat over a long document, turn 2's time to first
token with the store and without it, in one process on the default model (CPU).

Turn 1 asks a question about a ~2k-token essay; turn 2 sends the whole conversation again (the
document, the question, the answer as the chat template renders it, a new question), as a chat
client does. With ``prefix_memory`` the server resumes turn 1's compressed state and reads only
what is new. Interleaved: each repeat runs both engines.

    python tools/measure/prefix_ttft.py --json docs/results/serve/prefix-ttft.json
"""

import argparse
import json
import statistics
import time

import torch

from h2okv import load_model
from h2okv.eval.haystack import essays_folder
from h2okv.eval.output import write_json
from h2okv.serve.engine import Engine, EngineOptions, GenerationRequest


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def timed(engine, ids, budget, steps, ignore_eos=True):
    """(seconds to the first token, generated ids)."""
    heavy = None if budget is None else max(1, int(budget * len(ids) / 2))
    request = GenerationRequest(ids, steps, "full" if budget is None else "h2o", heavy, heavy,
                                temperature=0.0, ignore_eos=ignore_eos, budget_label=f"fraction {budget}")
    start = time.perf_counter()
    handle = engine.submit(request)
    first = None
    while True:
        event = handle.next_blocking(timeout=600)
        if first is None and event.kind in ("text", "done"):
            first = time.perf_counter() - start
        if event.final:
            return first, event.token_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2000, help="document length in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.2, help="h2o's share of each prompt (0: full)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model()
    essay = (essays_folder() / "addiction.txt").read_text() + "\n\n" + (essays_folder() / "apple.txt").read_text()
    document = tok.decode(tok(essay, add_special_tokens=False)["input_ids"][:args.tokens])
    budget = args.budget or None
    engines = {"store": Engine(model, tok, EngineOptions(prefill_chunk=512, prefix_memory=1 << 30)),
               "no store": Engine(model, tok, EngineOptions(prefill_chunk=512))}
    rows = []
    for engine in engines.values():
        engine.start()
    try:
        for repeat in range(args.repeats):
            # a new first question each repeat: no turn 1 resumes an earlier repeat's state
            first_q = [{"role": "user", "content": document + f"\n\nWhat is the first essay about? ({repeat})"}]
            for name, engine in engines.items():
                ids1 = chat_ids(tok, first_q)
                ttft1, answer = timed(engine, ids1, budget, 48, ignore_eos=False)  # an answer ends at EOS
                reply = tok.decode(answer, skip_special_tokens=True)
                ids2 = chat_ids(tok, first_q + [{"role": "assistant", "content": reply},
                                                {"role": "user", "content": f"And the second one? ({repeat})"}])
                ttft2, _ = timed(engine, ids2, budget, 8)
                extends = ids2[:len(ids1) + len(answer) - 1] == ids1 + answer[:-1]
                rows.append({"engine": name, "repeat": repeat, "turn1_prompt": len(ids1), "turn2_prompt": len(ids2),
                             "ttft1_s": ttft1, "ttft2_s": ttft2, "turn2_extends_turn1": extends})
                if engine.prefixes is not None:  # what the store holds now (a restart empties it)
                    rows[-1].update(store_entries=len(engine.prefixes), store_bytes=engine.prefixes.bytes)
                print(rows[-1], flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
    med = {name: statistics.median(r["ttft2_s"] for r in rows if r["engine"] == name) for name in engines}
    result = {"policy": "full" if budget is None else f"h2o {budget:g}", "document_tokens": args.tokens,
              "rows": rows, "ttft2_median_s": med, "ttft2_store_vs_none": med["store"] / med["no store"],
              "hits": engines["store"].prefixes.hits, "bytes_per_entry": rows[-2]["store_bytes"] / rows[-2]["store_entries"]}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
