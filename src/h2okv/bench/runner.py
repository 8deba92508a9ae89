"""The benchmark: prefill and decode speed and memory of ``full`` vs ``h2o`` vs ``reference``.

- ``full``: a plain transformers ``DynamicCache`` (SDPA attention): what users run today.
- ``h2o``: our ``H2OCache`` at the budget (heavy = recent = budget/2 of the prompt).
- ``reference``: a plain ``DynamicCache`` that only ever holds as many tokens as H2O keeps
  (cropped back to that size before every step): the cost of attending over a cache that small
  with no bookkeeping at all, so ``h2o step / reference step`` is what H2O's bookkeeping costs.

Decode timing prefills ONE sequence per (policy, context) and replicates its cache across the
batch (``batch_repeat_interleave``): every row of a batch holds the same prompt. Timed steps are
interleaved round-robin across policies (and the order rotated each round), so machine drift
(other jobs on a shared CPU) hits all policies alike; each number is the median of its steps.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from h2okv.bench.memory import cache_kv_bytes, kv_bytes_per_token, measure_peak
from h2okv.bench.report import check_targets
from h2okv.core.budget import BudgetSpec
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.generation import new_cache

POLICIES = ("full", "h2o", "reference")
# with --compile, h2o and reference also decode through the compiled model under these names
COMPILED = " compiled"
COMPILED_KEYS = ("decode_step_ms", "decode_step_cpu_ms", "decode_tokens_per_s")


@dataclass
class BenchConfig:
    batches: list[int] = field(default_factory=lambda: [1, 8])
    contexts: list[int] = field(default_factory=lambda: [2048, 4096])
    budget: float = 0.2  # fraction of the prompt kept: heavy = recent = budget / 2
    steps: int = 32  # timed decode steps per (policy, batch, context)
    warmup: int = 2  # untimed steps per policy before timing
    # timed steps are split into this many round-robin rounds; None: one step per policy per
    # round, the finest interleaving (a burst of load from another job then hits every policy)
    rounds: int | None = None
    prefill_repeats: int = 1
    memory_contexts: list[int] = field(default_factory=lambda: [1024, 2048, 4096])  # prefill peak vs length
    memory_cap: int | None = None  # bytes of KV cache allowed (the --memory-cap study)
    cap_context: int | None = None  # context for the cap study (default: the largest context)
    cap_steps: int = 8
    chunk_size: int = 512
    play: str = "hamlet_gut"
    # "subprocess": prefill peaks measured in a fresh process (see measure_memory_isolated);
    # "inprocess": in this one (quicker; the allocator's reuse of freed heap adds noise)
    memory_isolation: str = "subprocess"
    # a torch.compile backend: h2o and reference also decode through the compiled model (the
    # ``compiled_*`` keys of their rows), in the same interleaved rounds; None: eager only
    compile: str | None = None

    def validate(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise H2OError(f"batch sizes must be >= 1, got {self.batches}")
        if not self.contexts or min(self.contexts) < 2:
            raise H2OError(f"contexts must be >= 2 tokens, got {self.contexts}")
        if not (0.0 < self.budget < 1.0) or math.isnan(self.budget):
            raise H2OError(f"--budget must be in (0, 1), got {self.budget}")
        if self.steps < 1 or self.warmup < 0 or (self.rounds is not None and self.rounds < 1) or self.prefill_repeats < 1:
            raise H2OError("--steps, --rounds and --prefill-repeats must be >= 1 and --warmup >= 0")
        if self.memory_cap is not None and self.memory_cap <= 0:
            raise H2OError(f"--memory-cap must be a positive number of bytes, got {self.memory_cap}")
        if any(c < 2 for c in self.memory_contexts):
            raise H2OError(f"memory contexts must be >= 2 tokens, got {self.memory_contexts}")
        if self.memory_isolation not in ("subprocess", "inprocess"):
            raise H2OError(f"memory isolation must be 'subprocess' or 'inprocess', got {self.memory_isolation!r}")

    @property
    def ratio(self) -> float:
        return BudgetSpec.from_fraction(self.budget).heavy_ratio


def prompt_ids(tokenizer, play: str, n_tokens: int, vocab_size: int | None = None) -> torch.Tensor:
    """The first ``n_tokens`` real tokens of a Shakespeare play. Without a tokenizer (tiny test
    models) the play's bytes, folded into the model's vocabulary."""
    from h2okv.corpus import read_play, token_prefix

    text = read_play(play)
    if tokenizer is None:
        raw = text.encode("utf-8")
        if len(raw) < n_tokens:
            raise H2OError(f"text has only {len(raw)} bytes, {n_tokens} requested")
        return torch.tensor([list(raw[:n_tokens])], dtype=torch.long) % (vocab_size or 256)
    return torch.tensor([token_prefix(tokenizer, text, n_tokens)], dtype=torch.long)


class Timer:
    """Wall-clock timing that waits for the device (CUDA kernels are asynchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@dataclass
class Prefilled:
    policy: str
    context: int
    cache: object
    next_token: torch.Tensor  # [1, 1]
    prefill_s: list[float]
    peak_mem_bytes: int
    peak_mem_method: str
    kept_tokens: int  # tokens the cache holds per (layer, head) after the prefill


@contextmanager
def _nothing():
    yield None


class Bench:
    #: how a fresh process loads the same model: (model name, device, dtype, threads); None: no isolation
    spawn_args: tuple | None = None

    def __init__(self, model, tokenizer, config: BenchConfig, progress=None):
        config.validate()
        self.model, self.tokenizer, self.cfg = model, tokenizer, config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.timer = Timer(self.device)
        self.progress = progress  # a tqdm-like object with update(n), or None
        longest = max([*config.contexts, *config.memory_contexts, config.cap_context or 0])
        vocab = model.config.get_text_config().vocab_size
        self.ids = prompt_ids(tokenizer, config.play, longest, vocab).to(self.device)
        self.compiled = None
        if config.compile:
            # one compiled model for every grid point: each (batch, context, cache) is its own graph
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            backend, mode = config.compile, None
            if isinstance(backend, str):  # "inductor:reduce-overhead": CUDA graphs
                backend, _, mode = backend.partition(":")
            self.compiled = torch.compile(model, dynamic=False, backend=backend, mode=mode or None)

    # -- caches ----------------------------------------------------------------------------------
    def _new_cache(self, policy: str):
        return new_cache(self.model, "h2o" if policy == "h2o" else None, self.cfg.budget, self.cfg.chunk_size)

    def budget_tokens(self, context: int) -> int:
        """Slots H2O keeps per (layer, head) for a ``context``-token prompt (heavy + recent)."""
        heavy = max(1, int(self.cfg.ratio * context))
        return 2 * heavy

    def _forward(self, ids, cache, compiled: bool = False, **kw):
        model = self.compiled if compiled else self.model
        return model(input_ids=ids, **cache_arg(cache), use_cache=True, **kw)

    def _prompt(self, policy: str, context: int) -> torch.Tensor:
        """``reference`` reads only the last budget tokens of the prompt."""
        ids = self.ids[:, :context]
        return ids[:, -self.budget_tokens(context) :] if policy == "reference" else ids

    def warm_up(self) -> None:
        """One short prefill and step per policy first: one-time costs (kernel choice, thread
        pools, lazy buffers) are then not charged to whichever policy happens to run first."""
        for policy in POLICIES:
            n = min(64, max(self.cfg.contexts))
            cache = self._new_cache(policy)
            out = self._forward(self.ids[:, :n], cache, logits_to_keep=1)
            self._forward(out.logits[:, -1:].argmax(-1), cache)

    def prefill(self, policy: str, context: int, memory: bool = False) -> Prefilled:
        """Prefill one sequence, timed; with ``memory`` also its peak memory, in this process."""
        ids = self._prompt(policy, context)
        times, peak, method, cache, out = [], 0, "", None, None
        for _ in range(self.cfg.prefill_repeats):
            cache = out = None
            cache = self._new_cache(policy)
            with measure_peak(self.device) if memory else _nothing() as mem:
                start = self.timer.now()
                out = self._forward(ids, cache, logits_to_keep=1)
                times.append(self.timer.now() - start)
            if mem is not None:
                peak, method = max(peak, mem.peak_bytes), mem.method
            self._tick()
        next_token = out.logits[:, -1:].argmax(-1)
        kept = max(cache.budget()) if policy == "h2o" else ids.shape[1]
        return Prefilled(policy, context, cache, next_token, times, peak, method, kept)

    def memory_curve(self, contexts: list[int]) -> dict[tuple[str, int], tuple[int, str]]:
        """Prefill peak memory of every policy at every context, measured here (one by one,
        after a warm-up). Run in a fresh process by ``measure_memory_isolated``."""
        self.warm_up()
        peaks = {}
        for context in sorted(contexts):
            for policy in POLICIES:
                cache = self._new_cache(policy)
                with measure_peak(self.device) as mem:
                    self._forward(self._prompt(policy, context), cache, logits_to_keep=1)
                del cache
                peaks[(policy, context)] = (mem.peak_bytes, mem.method)
        return peaks

    # -- decode ----------------------------------------------------------------------------------
    def _replicate(self, pre: Prefilled, batch: int, compiled: bool = False):
        cache = copy.deepcopy(pre.cache)
        if batch > 1:
            cache.batch_repeat_interleave(batch)
        if compiled and pre.policy == "h2o":
            cache.set_compileable(True)  # its steps at the budget in tensor ops the compiler traces
        return cache, pre.next_token.repeat(batch, 1)

    def _step(self, policy: str, state: dict) -> float:
        cache = state["cache"]
        if policy.startswith("reference"):
            excess = cache.get_seq_length() - state["keep"]
            if excess > 0:
                cache.crop(-excess)  # stay at H2O's size: attend over keep + 1 tokens, like H2O
        start, cpu = self.timer.now(), time.process_time()
        out = self._forward(state["token"], cache, compiled=policy.endswith(COMPILED))
        state["token"] = out.logits[:, -1:].argmax(-1)
        elapsed = self.timer.now() - start
        state["cpu"].append(time.process_time() - cpu)
        return elapsed

    def rounds_for(self, steps: int) -> int:
        return min(self.cfg.rounds or steps, steps)

    def decode(self, prefilled: dict[str, Prefilled], batches: dict[str, int], steps: int) -> dict:
        """Interleaved decode timing; ``batches[policy]`` rows each. Returns per-policy stats."""
        rounds = self.rounds_for(steps)
        states = {}
        runs = [(policy, policy, False) for policy in prefilled]
        if self.compiled is not None:
            runs += [(policy + COMPILED, policy, True) for policy in prefilled if policy in ("h2o", "reference")]
        for name, policy, compiled in runs:
            pre = prefilled[policy]
            cache, token = self._replicate(pre, batches[policy], compiled)
            states[name] = {"cache": cache, "token": token, "keep": pre.kept_tokens, "times": [], "cpu": [],
                            "batch": batches[policy]}
        policies = list(states)
        for policy in policies:
            for _ in range(self.cfg.warmup):
                self._step(policy, states[policy])
            states[policy]["cpu"].clear()
        per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
        for r, n in enumerate(per_round):
            order = policies[r % len(policies) :] + policies[: r % len(policies)]
            for policy in order:
                for _ in range(n):
                    states[policy]["times"].append(self._step(policy, states[policy]))
            self._tick()
        result = {}
        for policy, st in states.items():
            times_ms = [t * 1000 for t in st["times"]]
            median = statistics.median(times_ms)
            b = st["batch"]
            result[policy] = {
                "batch": b,
                "decode_step_ms": median,
                "decode_step_ms_mean": statistics.fmean(times_ms),
                "decode_step_ms_min": min(times_ms),
                "decode_tokens_per_s": b * 1000.0 / median,
                # CPU time of this process per step: what other jobs on a shared machine cannot
                # inflate by taking the cores away (with one thread it is our own compute)
                "decode_step_cpu_ms": statistics.median(t * 1000 for t in st["cpu"]),
                "kv_bytes": cache_kv_bytes(st["cache"]),
                "steps": len(times_ms),
            }
            st["cache"] = None
        return result

    def _tick(self, n: int = 1) -> None:
        if self.progress is not None:
            self.progress.update(n)

    # -- the whole run ---------------------------------------------------------------------------
    def prefill_contexts(self) -> list[int]:
        ctx = set(self.cfg.contexts) | set(self.cfg.memory_contexts)
        if self.cfg.memory_cap:
            ctx.add(self.cap_context)
        return sorted(ctx)

    def work_units(self) -> int:
        cfg = self.cfg
        units = len(self.prefill_contexts()) * len(POLICIES) * cfg.prefill_repeats
        units += len(cfg.contexts) * len(cfg.batches) * self.rounds_for(cfg.steps)
        if cfg.memory_cap:
            units += self.rounds_for(cfg.cap_steps)
        return units

    @property
    def cap_context(self) -> int:
        return self.cfg.cap_context or max(self.cfg.contexts)

    def run(self) -> dict:
        cfg = self.cfg
        started = time.time()
        env = environment(self.model, self.device, self.dtype)  # load average before our own work
        decode_ctx = set(cfg.contexts) | ({self.cap_context} if cfg.memory_cap else set())
        prefill_ctx = self.prefill_contexts()
        # memory first, in a fresh process where possible: nothing of this process's own
        # history (freed heap, lazily built buffers) can then blur the peaks
        isolated = cfg.memory_isolation == "subprocess" and self.device.type == "cpu" and self.spawn_args
        if isolated:
            peaks = measure_memory_isolated(self.spawn_args, cfg, prefill_ctx)
        self.warm_up()
        prefilled: dict[int, dict[str, Prefilled]] = {}
        prefill_rows = []
        for i, context in enumerate(prefill_ctx):
            order = list(POLICIES[i % 3 :] + POLICIES[: i % 3])  # rotate who goes first
            done = {p: self.prefill(p, context, memory=not isolated) for p in order}
            for policy in POLICIES:
                pre = done[policy]
                if isolated:
                    pre.peak_mem_bytes, pre.peak_mem_method = peaks[(policy, context)]
                prefill_rows.append({
                    "policy": policy, "context": context, "prefill_s": statistics.median(pre.prefill_s),
                    "prefill_s_all": pre.prefill_s, "peak_mem_bytes": pre.peak_mem_bytes,
                    "peak_mem_method": pre.peak_mem_method, "prompt_tokens": self._prompt(policy, context).shape[1],
                })
            if context in decode_ctx:
                prefilled[context] = {p: done[p] for p in POLICIES}
            del done

        rows = []
        for context in cfg.contexts:
            for batch in cfg.batches:
                stats = self.decode(prefilled[context], dict.fromkeys(POLICIES, batch), cfg.steps)
                for policy in POLICIES:
                    pre = prefilled[context][policy]
                    compiled = stats.get(policy + COMPILED, {})
                    rows.append({
                        "policy": policy, "batch": batch, "context": context, "budget": cfg.budget,
                        "kept_tokens": pre.kept_tokens,
                        "prefill_s": statistics.median(pre.prefill_s),
                        "peak_mem_bytes": pre.peak_mem_bytes,
                        **{k: v for k, v in stats[policy].items() if k != "batch"},
                        **{f"compiled_{k}": compiled[k] for k in COMPILED_KEYS if k in compiled},
                    })

        cap = self.memory_cap_study(prefilled) if cfg.memory_cap else None
        result = {
            "config": asdict(cfg),
            "environment": env,
            "notes": [
                "decode: one sequence is prefilled per (policy, context) and its cache replicated across "
                "the batch (batch_repeat_interleave); every row holds the same prompt",
                "decode_step_ms is the wall-clock median over interleaved round-robin steps; "
                "decode_tokens_per_s = batch * 1000 / decode_step_ms; decode_step_cpu_ms is the median "
                "process CPU time per step (robust to other jobs taking the cores; with 1 thread, our compute)",
                "reference: a plain DynamicCache holding H2O's number of tokens (the prompt's last ones), "
                "cropped back before every step; timing only, its tokens are not a real generation",
                "peak_mem_bytes: growth of process memory above the level just before the batch-1 prefill "
                "(CPU: RSS high-water mark, by default in a fresh process with glibc's mmap threshold at 64 KiB "
                "so freed buffers go back to the OS at once; CUDA: max_memory_allocated)",
                "kv_bytes: key/value tensors allocated at the end of decoding, all rows",
            ],
            "rows": rows,
            "prefill": prefill_rows,
            "memory_cap": cap,
            "summary": summarize(rows, prefill_rows),
            "wall_s": time.time() - started,
        }
        result["targets"] = check_targets(result)
        return result

    def memory_cap_study(self, prefilled: dict[int, dict[str, Prefilled]]) -> dict:
        """Largest batch whose KV cache fits under the cap, for full and h2o, and the decode
        throughput each reaches there (the paper's throughput argument, measured)."""
        cfg, context = self.cfg, self.cap_context
        per_token = kv_bytes_per_token(self.model, self.dtype)
        steps = cfg.cap_steps
        full_tokens = context + cfg.warmup + steps  # a plain cache grows by one token per step
        # H2O's steady state: budget + 1 slots (what the prefilled cache has allocated)
        h2o_slots = max(prefilled[context]["h2o"].cache.stats()["capacity"])
        batches = {"full": cfg.memory_cap // (full_tokens * per_token), "h2o": cfg.memory_cap // (h2o_slots * per_token)}
        out = {
            "cap_bytes": cfg.memory_cap, "context": context, "kv_bytes_per_token": per_token,
            "full_tokens_per_row": full_tokens, "h2o_slots_per_row": h2o_slots,
            "max_batch": dict(batches), "steps": steps,
        }
        runnable = {p: b for p, b in batches.items() if b >= 1}
        if runnable:
            stats = self.decode({p: prefilled[context][p] for p in runnable}, runnable, steps)
            out["measured"] = {p: {**s, "fits": s["kv_bytes"] <= cfg.memory_cap} for p, s in stats.items()}
        else:
            self._tick(self.rounds_for(steps))
        m = out.get("measured", {})
        if "full" in m and "h2o" in m:
            out["h2o_vs_full_batch"] = batches["h2o"] / batches["full"]
            out["h2o_vs_full_throughput"] = m["h2o"]["decode_tokens_per_s"] / m["full"]["decode_tokens_per_s"]
        return out


def summarize(rows: list[dict], prefill_rows: list[dict]) -> dict:
    by = {(r["policy"], r["batch"], r["context"]): r for r in rows}
    per_row = []
    for (policy, batch, context), h in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if policy != "h2o":
            continue
        f, ref = by[("full", batch, context)], by[("reference", batch, context)]
        per_row.append({
            "batch": batch, "context": context,
            "h2o_vs_full_throughput": h["decode_tokens_per_s"] / f["decode_tokens_per_s"],
            "h2o_vs_reference_step": h["decode_step_ms"] / ref["decode_step_ms"],
            "h2o_vs_reference_step_cpu": h["decode_step_cpu_ms"] / ref["decode_step_cpu_ms"],
            "h2o_vs_full_kv_bytes": h["kv_bytes"] / f["kv_bytes"],
            "h2o_vs_full_prefill": h["prefill_s"] / f["prefill_s"],
            **({"h2o_vs_reference_step_compiled": h["compiled_decode_step_ms"] / ref["compiled_decode_step_ms"],
                "h2o_compiled_vs_eager_step": h["compiled_decode_step_ms"] / h["decode_step_ms"]}
               if "compiled_decode_step_ms" in h and "compiled_decode_step_ms" in ref else {}),
        })
    pre = {(r["policy"], r["context"]): r for r in prefill_rows}
    prefill = []
    for (policy, context), h in sorted(pre.items(), key=lambda kv: kv[0][1]):
        if policy != "h2o":
            continue
        f = pre[("full", context)]
        prefill.append({
            "context": context,
            "h2o_vs_full_prefill": h["prefill_s"] / f["prefill_s"],
            "h2o_peak_mem_bytes": h["peak_mem_bytes"],
            "full_peak_mem_bytes": f["peak_mem_bytes"],
        })
    return {"rows": per_row, "prefill": prefill}


def environment(model, device, dtype) -> dict:
    import transformers

    env = {
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
    }
    try:
        env["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def measure_memory_isolated(spawn_args: tuple, cfg: BenchConfig, contexts: list[int]) -> dict:
    """Prefill peaks measured by ``python -m h2okv.bench.probe`` in a fresh process.

    glibc's ``MALLOC_MMAP_THRESHOLD_`` is set to 64 KiB there: every large buffer is its own
    mapping, returned to the OS when freed, so RSS follows live tensors and the high-water mark
    of one prefill is not inflated by heap that an earlier one left behind (measured here, the
    default allocator made repeated identical H2O prefills differ by up to 3x).
    """
    payload = json.dumps({"spawn": list(spawn_args), "config": asdict(cfg), "contexts": contexts})
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        [sys.executable, "-m", "h2okv.bench.probe"], input=payload, capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise H2OError(f"memory probe failed: {tail[0]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return {(r["policy"], r["context"]): (r["peak_bytes"], r["method"] + "_fresh_process") for r in rows}


def run_bench(model, tokenizer, config: BenchConfig, progress: bool = True, spawn_args: tuple | None = None) -> dict:
    """Run the benchmark on a loaded model (tokenizer None: tiny test models); returns the result.

    ``spawn_args`` = (model name, device, dtype, threads) lets the memory probe load the same
    model in a fresh process; without it memory is measured in this process."""
    from tqdm.auto import tqdm

    bench = Bench(model, tokenizer, config)
    bench.spawn_args = spawn_args
    with torch.no_grad():
        if progress:
            with tqdm(total=bench.work_units(), desc="bench", unit="step") as bar:
                bench.progress = bar
                result = bench.run()
        else:
            result = bench.run()
    try:
        result["environment"]["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    return result
