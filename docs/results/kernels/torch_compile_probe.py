"""Probe: torch.compile (inductor, C++ on CPU) of the per-token scan recurrence vs eager.

One token's recurrence (~10 ops: bias, softmax, mass, shield, argmin, two scatters) on
[1, 3 KV heads, 3 query heads, 1500 keys], 64 tokens per timing, 1 thread. Prints eager and
compiled microseconds per token and the first call's compile time. Measured 2026-11-23 (r-kernels,
loaded 2-core machine): eager 248-272 us, compiled 648-972 us, compile 86.3 s -> not used; the
recurrence became a C loop instead (h2okv/core/native).

Run: PYTHONPATH=src nice python docs/results/kernels/torch_compile_probe.py
"""
import time, math, torch
torch.set_num_threads(1)
torch.set_grad_enabled(False)
B,H,G,W=1,3,3,1500
def step(row, bias, blocked, score, ordinal, thr):
    row += bias[:, :, None, :]
    p = torch.softmax(row, dim=-1)
    row.copy_(p)
    score.add_(p.sum(dim=2))
    shielded = (ordinal >= thr) | blocked
    rank = score.masked_fill(shielded, math.inf)
    victim = rank.argmin(-1, keepdim=True)
    bias.scatter_(-1, victim, -math.inf)
    blocked.scatter_(-1, victim, True)
def mk():
    logits=torch.randn(B,H,G,64,W)
    bias=torch.zeros(B,H,W); blocked=torch.zeros(B,H,W,dtype=torch.bool); blocked[...,:4]=True
    score=torch.zeros(B,H,W); ordinal=torch.arange(W).expand(B,H,W).contiguous()
    return logits,bias,blocked,score,ordinal
def run(fn, n=64):
    logits,bias,blocked,score,ordinal=mk()
    thrs=torch.arange(n)+W-200
    t0=time.perf_counter()
    for t in range(n):
        fn(logits[:,:,:,t], bias, blocked, score, ordinal, thrs[t])
    return (time.perf_counter()-t0)/n*1e6
for _ in range(3): print("eager us/token", run(step))
import torch._inductor.config as ic
t0=time.perf_counter()
c=torch.compile(step, dynamic=True)
run(c,2)
print("compile s", time.perf_counter()-t0)
for _ in range(3): print("compiled us/token", run(c))
