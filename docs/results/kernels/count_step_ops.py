"""Top-level aten ops in one decode step of the default model: a plain cache of H2O's size vs
h2o's eager step (each op is a kernel launch on a GPU, where a small model's step is launch-bound).

    PYTHONPATH=src OMP_NUM_THREADS=1 python docs/results/kernels/count_step_ops.py
"""

from collections import Counter

import torch

from h2okv.core import kernels
from h2okv.core.compat import cache_arg
from h2okv.generation import new_cache
from h2okv.models import load_model

torch.set_num_threads(1)
model, _ = load_model(None)
ids = torch.randint(100, 20000, (8, 512), generator=torch.Generator().manual_seed(0))
KEPT = 102  # h2o at 0.2 of 512 tokens keeps 102 slots per layer and head


def top_level_ops(policy: str | None) -> Counter:
    cache = new_cache(model, policy, 0.2) if policy else new_cache(model, None)
    out = model(input_ids=ids if policy else ids[:, :KEPT], **cache_arg(cache), use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(2):  # past the first steps at budget (the free slot found once)
        nxt = model(input_ids=nxt, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=nxt, **cache_arg(cache), use_cache=True)
    return Counter(e.name for e in prof.events()
                   if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::")))


with kernels.use_kernels("eager"):
    for name, policy in (("plain cache of h2o's size", None), ("h2o, eager step", "h2o")):
        ops = top_level_ops(policy)
        print(f"{name}: {sum(ops.values()) / model.config.num_hidden_layers:.1f} aten ops a layer;",
              ", ".join(f"{op[6:]} {n}" for op, n in ops.most_common(12)))
