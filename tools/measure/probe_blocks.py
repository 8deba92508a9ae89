"""Time one probe call's attention (``core/reconstruction.py`` ``probe_attention``: KVzip's and the
streamed prefill's scoring) at a model's shapes, for several block sizes, on this machine's CPU.

The probe's logits run in query blocks; this picks the block size a device gets
(``CPU_PROBE_BLOCK_BYTES``). Each size runs in turns with the others, ``--repeats`` times, and
every run is checked to give the same output and scores as the first (the block only changes
how the work is cut). CPU time of one thread.

    python tools/measure/probe_blocks.py --context 8192 --probe 2048 --mib 64,16,4,2 --json F
"""

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from h2okv.core import reconstruction


@dataclass
class HeldSlots:
    """What ``probe_attention`` reads of a cache layer: every slot live, in prompt order."""

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self):
        b, hkv, cap, _ = self.keys.shape
        self.capacity = cap
        self.valid = torch.ones(b, hkv, cap, dtype=torch.bool)
        self.ordinal = torch.arange(cap).expand(b, hkv, cap)
        self.config = SimpleNamespace(policy=SimpleNamespace(sink_tokens=4))

    def kv(self):
        return self.keys, self.values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192, help="slots the cache holds")
    parser.add_argument("--probe", type=int, default=2048, help="probe tokens in the call (KVzip's chunk)")
    parser.add_argument("--heads", default="14,2", help="query heads, KV heads (Qwen2.5-0.5B: 14,2)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--mib", default="64,16,4,2", help="block sizes to time, MiB of float32 logits")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    hq, hkv = (int(v) for v in args.heads.split(","))
    d, cap, n = args.head_dim, args.context, args.probe
    layer = HeldSlots(torch.randn(1, hkv, cap, d), torch.randn(1, hkv, cap, d))
    query, key_new, value_new = torch.randn(1, hq, n, d), torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
    sizes = [int(v) for v in args.mib.split(",")]
    seconds = {mib: [] for mib in sizes}
    first = None
    saved = reconstruction.PROBE_BLOCK_BYTES, reconstruction.CPU_PROBE_BLOCK_BYTES
    try:
        for _ in range(args.repeats):
            for mib in sizes:
                reconstruction.PROBE_BLOCK_BYTES = reconstruction.CPU_PROBE_BLOCK_BYTES = mib * 2**20
                start = time.process_time()
                out, best = reconstruction.probe_attention(layer, query, key_new, value_new, d ** -0.5, 512)
                seconds[mib].append(time.process_time() - start)
                if first is None:
                    first = out, best
                elif not (torch.equal(out, first[0]) and torch.equal(best, first[1])):
                    raise SystemExit(f"{mib} MiB blocks gave other values than the first run's")
    finally:
        reconstruction.PROBE_BLOCK_BYTES, reconstruction.CPU_PROBE_BLOCK_BYTES = saved
    rows = [{"mib": mib, "seconds": seconds[mib], "median_s": statistics.median(seconds[mib])} for mib in sizes]
    for row in rows:
        print(f"{row['mib']:>4} MiB blocks: median {row['median_s']:.2f} s CPU "
              f"({', '.join(f'{s:.2f}' for s in row['seconds'])})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": cap, "probe": n, "heads": [hq, hkv], "head_dim": d, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    torch.set_num_threads(1)  # one core's CPU time, as the docstring says
    main()
