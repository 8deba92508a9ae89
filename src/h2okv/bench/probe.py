"""``python -m h2okv.bench.probe``: prefill peak memory, measured in a fresh process.

Reads ``{"spawn": [model, device, dtype, threads], "config": {...}, "contexts": [...]}`` on stdin
and prints one JSON line ``[{"policy", "context", "peak_bytes", "method"}, ...]``. Started by
``runner.measure_memory_isolated`` (which sets the allocator up for honest peaks).
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import torch

    from h2okv.bench.model import load_bench_model
    from h2okv.bench.runner import Bench, BenchConfig

    request = json.load(sys.stdin)
    name, device, dtype, threads = request["spawn"]
    if threads:
        torch.set_num_threads(int(threads))
    model, tokenizer = load_bench_model(name, device, dtype)
    bench = Bench(model, tokenizer, BenchConfig(**request["config"]))
    with torch.no_grad():
        peaks = bench.memory_curve(request["contexts"])
    rows = [{"policy": p, "context": c, "peak_bytes": b, "method": m} for (p, c), (b, m) in peaks.items()]
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
