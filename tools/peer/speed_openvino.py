"""Each engine's H2O against its own full cache, in one run on one machine: h2okv (its ``h2o`` on
``H2OCache``) and OpenVINO GenAI (``run_openvino.py speed`` in ``.venv-peer-ov``: cache eviction,
SUM), on the same prompt ids, one thread each. Usage (h2okv's venv)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/peer/speed_openvino.py --model qwen2.5-0.5b \\
        --contexts 1024,8192 --steps 32 --budget 0.2 --threads 1 --json speed.json

Per context, a prompt of that many token ids (seeded, drawn from the vocabulary's ordinary range)
is read and ``--steps`` tokens decoded after the first, greedily, EOS ignored. TTFT is reading the
prompt until the first token (h2okv: ``bench.recipe_costs.read_prompt``; OpenVINO: its TTFT metric);
decode tokens/s is the steps over their time (OpenVINO: 1 / its TPOT). The two engines differ in
kind (OpenVINO compiles the graph and evicts only after the prompt, in 32-token blocks; h2okv evicts
while reading the prompt in chunks), so compare each engine's h2o with its own full, not the
engines with each other. The table and the JSON give both, and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PEER_PYTHON = HERE.parents[1] / ".venv-peer-ov" / "bin" / "python"


def prompt_ids(context: int, vocab: int, seed: int = 0) -> list[int]:
    """``context`` ids drawn uniformly below ``vocab`` (special tokens sit above it in Qwen's)."""
    generator = torch.Generator().manual_seed(seed + context)
    return torch.randint(100, vocab, (context,), generator=generator).tolist()


def ours(model, tokenizer, ids: list[int], policy: str, budget: float, steps: int) -> dict:
    from h2okv.bench.recipe_costs import read_prompt
    from h2okv.core.cache import H2OCache
    from h2okv.core.compat import cache_arg

    cache = H2OCache(model, policy="full") if policy == "full" else H2OCache(model, policy=policy, budget=budget,
                                                                             budget_floor=0)
    with torch.inference_mode():
        start = time.perf_counter()
        logits = read_prompt(model, tokenizer, cache, torch.tensor([ids]))
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(steps):
            logits = model(input_ids=logits.argmax(-1, keepdim=True), **cache_arg(cache), use_cache=True).logits[:, -1]
        decode = time.perf_counter() - start
    stats = cache.stats()
    return {"engine": "h2okv", "context": len(ids), "policy": policy, "budget": 1.0 if policy == "full" else budget,
            "prefill_s": round(prefill, 3), "steps": steps, "decode_s": round(decode, 3),
            "kv_fraction": round(stats["kv_bytes"] / stats["full_kv_bytes"], 4)}


def theirs(model_dir: str, prompts: list[list[int]], budget: float, steps: int, threads: int) -> dict:
    if not PEER_PYTHON.exists():
        raise SystemExit(f"speed_openvino: {PEER_PYTHON} is missing: run `make peer-openvino`")
    with tempfile.TemporaryDirectory() as tmp:
        ids, out = Path(tmp) / "ids.json", Path(tmp) / "out.json"
        ids.write_text(json.dumps(prompts))
        subprocess.run([str(PEER_PYTHON), str(HERE / "run_openvino.py"), "speed", "--model", model_dir, "--ids",
                        str(ids), "--steps", str(steps), "--budget", str(budget), "--threads", str(threads),
                        "--json", str(out)], check=True)
        return json.loads(out.read_text())


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with its TTFT and decode tokens/s, and their ratios to its engine's full."""
    full = {(r["engine"], r["context"]): r for r in rows if r["budget"] == 1.0}
    for row in rows:
        row["ttft_s"] = row["prefill_s"]
        row["decode_tok_s"] = round(row["steps"] / row["decode_s"], 2)
        base = full[row["engine"], row["context"]]
        row["ttft_vs_full"] = round(row["prefill_s"] / base["prefill_s"], 3)
        row["decode_vs_full"] = round(row["decode_tok_s"] / (base["steps"] / base["decode_s"]), 3)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'engine':9} {'context':>7} {'policy':17} {'TTFT s':>8} {'x full':>7} {'decode tok/s':>13} "
             f"{'x full':>7} {'KV kept':>8}"]
    for r in rows:
        lines.append(f"{r['engine']:9} {r['context']:>7} {r['policy']:17} {r['ttft_s']:>8.2f} {r['ttft_vs_full']:>7.2f} "
                     f"{r['decode_tok_s']:>13.2f} {r['decode_vs_full']:>7.2f} {r['kv_fraction']:>8.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    from h2okv.models import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    prompts = [prompt_ids(c, min(tokenizer.vocab_size, 150000)) for c in contexts]
    load = [os.getloadavg()[0]]
    rows = []
    with torch.inference_mode():  # one short forward first: weights paged in before the first timing
        model(input_ids=torch.tensor([prompts[0][:16]]))
    for ids in prompts:
        for policy in ("full", "h2o"):
            rows.append(ours(model, tokenizer, ids, policy, args.budget, args.steps))
            print(json.dumps(rows[-1]), flush=True)
    del model
    load.append(os.getloadavg()[0])
    peer = theirs(str(tokenizer.name_or_path), prompts, args.budget, args.steps, args.threads)
    load.append(os.getloadavg()[0])
    rows = with_ratios(rows + peer["rows"])
    print(table(rows))
    result = {"model": args.model, "steps": args.steps, "budget": args.budget, "threads": args.threads,
              "load_avg_1m": load, "openvino": peer["software"], "torch": torch.__version__, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
