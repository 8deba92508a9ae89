"""``python -m h2okv.tools.tp_check``: ``h2okv serve --tp N`` against ``--tp 1`` on one model.

Starts a real server process for each (``--tp 1`` first), sends the same greedy completions one at a
time, reads ``/metrics`` (the engine's KV peak, and with ``--tp N`` every rank's), stops the server
with SIGTERM and records its exit status. Then says whether the texts are the same and whether each
rank held 1/N of the single process's KV bytes. Writes a JSON record (``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from h2okv.tools.process import ServerProcess


def metrics(url: str) -> dict:
    """``/metrics`` samples: unlabelled by name, per-rank ones as ``name{rank}``."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=120).text):
        for sample in family.samples:
            key = sample.name if "rank" not in sample.labels else f"{sample.name}{{{sample.labels['rank']}}}"
            if not sample.labels or "rank" in sample.labels:
                out[key] = sample.value
    return out


def run_server(tp: int, args, prompts: list[str], log_dir: Path) -> dict:
    argv = ["--model", args.model, "--served-model-name", "check", "--log-level", "warning",
            "--policy", args.policy, "--chunk-size", str(args.chunk_size), "--tp", str(tp)]
    if args.heavy is not None:
        argv += ["--heavy", str(args.heavy), "--recent", str(args.recent)]
    started = time.monotonic()
    server = ServerProcess(argv, log_path=log_dir / f"serve_tp{tp}.log")
    with server:
        server.wait_healthy(timeout=args.startup_timeout)
        ready = time.monotonic() - started
        texts, seconds = [], []
        for prompt in prompts:
            t0 = time.monotonic()
            r = httpx.post(server.url + "/v1/completions", timeout=args.request_timeout,
                           json={"model": "check", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                                 "ignore_eos": True})
            r.raise_for_status()
            seconds.append(time.monotonic() - t0)
            texts.append(r.json()["choices"][0]["text"])
        figures = metrics(server.url)
        server.terminate()
        code = server.wait(120)
    per_rank = [figures[k] for k in sorted(k for k in figures if k.startswith("h2okv_rank_kv_bytes_peak{"))]
    return {"tp": tp, "texts": texts, "request_seconds": seconds, "startup_seconds": ready, "exit_code": code,
            "kv_bytes_peak": figures["h2okv_kv_bytes_peak"], "kv_bytes_peak_per_rank": per_rank or None,
            "kv_bytes_in_use_per_rank": [figures[k] for k in sorted(figures)
                                         if k.startswith("h2okv_rank_kv_bytes_in_use{")] or None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h2okv.tools.tp_check", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompt-file", required=True, help="text; the prompts are its first --prompt-chars characters, "
                   "then that many from successive offsets")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--heavy", type=int, default=32)
    p.add_argument("--recent", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=128)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    text = Path(args.prompt_file).read_text()
    prompts = [text[i * args.prompt_chars:(i + 1) * args.prompt_chars] for i in range(args.prompts)]
    log_dir = Path(args.json).parent if args.json else Path(".")
    runs = [run_server(1, args, prompts, log_dir), run_server(args.tp, args, prompts, log_dir)]
    single, tp = runs
    result = {
        "model": args.model, "policy": args.policy, "heavy": args.heavy, "recent": args.recent,
        "max_tokens": args.max_tokens, "prompt_chars": args.prompt_chars, "runs": runs,
        "same_texts": single["texts"] == tp["texts"],
        "per_rank_is_1_over_n": all(b * args.tp == single["kv_bytes_peak"] for b in tp["kv_bytes_peak_per_rank"]),
        "exit_codes": [single["exit_code"], tp["exit_code"]],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    for run in runs:
        print(f"--tp {run['tp']}: KV peak {run['kv_bytes_peak']:.0f} B (per rank: {run['kv_bytes_peak_per_rank']}), "
              f"startup {run['startup_seconds']:.0f} s, requests {[round(s, 1) for s in run['request_seconds']]} s, "
              f"exit {run['exit_code']}")
    print(f"same texts: {result['same_texts']}; each rank 1/{args.tp} of the KV bytes: {result['per_rank_is_1_over_n']}")
    return 0 if result["same_texts"] and result["per_rank_is_1_over_n"] and result["exit_codes"] == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
