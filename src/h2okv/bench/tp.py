"""``h2okv bench --tp N``: decode step time and KV bytes per rank under tensor parallelism, next to
a single-process copy of the same model (TP 1) measured in the same run.

Every rank loads its slice of the model; rank 0 also loads the whole model. For each (context,
batch, policy) both are prefilled with the same prompt, then their decode steps alternate: one
step of the N-rank model (all ranks), one step of the TP-1 model (rank 0, while the others wait at
a barrier), so drift on a shared machine hits both alike. Each number is the median of its steps.
The greedy tokens of both are compared: tensor parallelism must not change what is generated.
"""

from __future__ import annotations

import statistics
import time

import torch

from h2okv.bench.memory import cache_kv_bytes
from h2okv.bench.report import write_report
from h2okv.bench.runner import Timer, environment, prompt_ids
from h2okv.core.budget import BudgetSpec
from h2okv.core.compat import cache_arg
from h2okv.generation import new_cache
from h2okv.parallel.ranks import is_main_rank

POLICIES = ("full", "h2o")


def _new_cache(model, policy: str, budget: float, chunk_size: int):
    return new_cache(model, "h2o" if policy == "h2o" else None, budget, chunk_size)


class _Run:
    """One model's generation state for one grid point: cache, last token, step times."""

    def __init__(self, model, ids, batch: int, policy: str, cfg):
        self.model, self.cache = model, _new_cache(model, policy, cfg.budget, cfg.chunk_size)
        out = model(input_ids=ids, **cache_arg(self.cache), use_cache=True, logits_to_keep=1)
        if batch > 1:
            self.cache.batch_repeat_interleave(batch)
        self.token = out.logits[:, -1:].argmax(-1).repeat(batch, 1)
        self.tokens, self.times = [self.token[0, 0].item()], []

    def step(self, timer: Timer, timed: bool) -> None:
        start = timer.now()
        out = self.model(input_ids=self.token, **cache_arg(self.cache), use_cache=True)
        self.token = out.logits[:, -1:].argmax(-1)
        elapsed = timer.now() - start
        self.tokens.append(self.token[0, 0].item())
        if timed:
            self.times.append(elapsed * 1000)


def measure(model_tp, model_one, tokenizer, cfg) -> list[dict]:
    """The grid, on every rank (a collective). ``model_one`` is the TP-1 model on rank 0, else None.
    Returns rows on rank 0 (other ranks: an empty list)."""
    import torch.distributed as dist

    main = is_main_rank()
    device = next(model_tp.parameters()).device
    timer = Timer(device)
    vocab = model_tp.config.get_text_config().vocab_size
    ids_all = prompt_ids(tokenizer, cfg.play, max(cfg.contexts), vocab).to(device)
    rows = []
    for context in cfg.contexts:
        ids = ids_all[:, :context]
        for batch in cfg.batches:
            for policy in POLICIES:
                tp_run = _Run(model_tp, ids, batch, policy, cfg)
                one_run = _Run(model_one, ids, batch, policy, cfg) if main else None
                for i in range(cfg.warmup + cfg.steps):
                    timed = i >= cfg.warmup
                    dist.barrier()
                    tp_run.step(timer, timed)
                    dist.barrier()  # the other ranks wait here while rank 0 times the TP-1 model
                    if one_run is not None:
                        one_run.step(timer, timed)
                rank_kv = [None] * dist.get_world_size()
                dist.all_gather_object(rank_kv, cache_kv_bytes(tp_run.cache))
                rank_ms = [None] * dist.get_world_size()
                dist.all_gather_object(rank_ms, statistics.median(tp_run.times))
                if main:
                    one_kv = cache_kv_bytes(one_run.cache)
                    rows.append({
                        "context": context, "batch": batch, "policy": policy, "tp": dist.get_world_size(),
                        "decode_step_ms": statistics.median(tp_run.times),
                        "decode_step_ms_per_rank": rank_ms,
                        "kv_bytes_per_rank": rank_kv,
                        "tp1_decode_step_ms": statistics.median(one_run.times),
                        "tp1_kv_bytes": one_kv,
                        "per_rank_kv_vs_tp1": max(rank_kv) / one_kv if one_kv else None,
                        "step_vs_tp1": statistics.median(tp_run.times) / statistics.median(one_run.times),
                        "same_tokens_as_tp1": tp_run.tokens == one_run.tokens,
                        "steps": len(tp_run.times),
                    })
                del tp_run, one_run
    return rows


def markdown(result: dict) -> str:
    env, n = result["environment"], result["tp"]
    lines = [
        f"# h2okv bench --tp {n}", "",
        f"Model {env['model']}, {env['device']} {env['dtype']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['threads']} thread(s) per rank, {env['cpus']} CPUs.", "",
        f"| context | batch | policy | TP 1 step ms | TP {n} step ms | TP {n} / TP 1 | TP 1 KV bytes | "
        f"TP {n} KV bytes per rank | per rank / TP 1 | same tokens |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        per_rank = ", ".join(f"{b:,}" for b in r["kv_bytes_per_rank"])
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['policy']} | {r['tp1_decode_step_ms']:.2f} | "
            f"{r['decode_step_ms']:.2f} | {r['step_vs_tp1']:.2f} | {r['tp1_kv_bytes']:,} | {per_rank} | "
            f"{r['per_rank_kv_vs_tp1']:.3f} | {'yes' if r['same_tokens_as_tp1'] else 'NO'} |"
        )
    lines += ["", *(f"- {note}" for note in result["notes"]), ""]
    return "\n".join(lines)


def run_tp(cfg, *, model: str | None, device: str, dtype, tp: int, threads: int | None, json_path,
           markdown_path=None) -> int:
    """``h2okv bench --tp N`` on one rank (of a group already up): measure, and on rank 0 print the
    report and write the JSON and Markdown where named."""
    from h2okv.models import load_model

    if threads:
        torch.set_num_threads(threads)
    started = time.time()
    model_tp, tokenizer = load_model(model, device=device, dtype=dtype, tp=tp)
    model_one = None
    if is_main_rank():
        model_one, _ = load_model(model, device=device, dtype=dtype, cache=False)
    with torch.inference_mode():
        rows = measure(model_tp, model_one, tokenizer, cfg)
    if not is_main_rank():
        return 0
    device = next(model_one.parameters()).device
    env = environment(model_one, device, next(model_one.parameters()).dtype)
    env["model"] = model or "SmolLM2-135M-Instruct (embedded default)"
    result = {
        "tp": tp, "config": {k: getattr(cfg, k) for k in ("contexts", "batches", "steps", "warmup", "budget",
                                                              "chunk_size", "play")},
        "environment": env, "rows": rows, "wall_s": time.time() - started,
        "notes": [
            f"TP {tp}: {tp} ranks, each with a slice of every layer (the model's tp plan) and its own cache; "
            "TP 1: the whole model in rank 0, measured in the same run, steps alternating with the TP ones",
            "step ms: wall-clock median of the timed decode steps (TP: rank 0's, which includes waiting for the "
            "others in each all-reduce)",
            "KV bytes: key/value tensors allocated at the end of decoding, all rows; per rank for TP",
            f"h2o keeps {cfg.budget:g} of the prompt per (layer, KV head) ({BudgetSpec.from_fraction(cfg.budget).heavy_ratio:g} heavy + "
            f"{BudgetSpec.from_fraction(cfg.budget).recent_ratio:g} recent); full is a plain DynamicCache",
            "same tokens: the greedy tokens of the TP run equal the TP-1 run's, step for step (row 0)",
        ],
    }
    report = markdown(result)
    written = write_report(result, report, json_path, markdown_path)
    print(report)
    if written:
        print("wrote " + ", ".join(str(p) for p in written))
    return 0
