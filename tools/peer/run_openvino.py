"""Run OpenVINO GenAI's cache eviction (its H2O: accumulated attention, ``SUM`` or ``NORM_SUM``) on
prompts exported by ``h2okv eval longctx --export-prompts`` or ``h2okv eval reasoning --export-prompts``.

Runs in its own venv (``make peer-openvino`` -> ``.venv-peer-ov``), so it imports no h2okv, and
imports openvino only inside functions (the tests load it in h2okv's venv). Usage::

    .venv-peer-ov/bin/python tools/peer/run_openvino.py export --model CHECKPOINT_DIR
    .venv-peer-ov/bin/python tools/peer/run_openvino.py prompts.json --policies full,h2o-sum,h2o-norm_sum \\
        --budgets 0.2 --threads 1 --json rows.json

The model. ``export`` (run on first use anyway) converts our converted checkpoint (the export's
``model`` / ``model_path`` folder) to OpenVINO IR in float32 with optimum-intel (``optimum-cli
export openvino --weight-format fp32 --task text-generation-with-past``), once, into a folder beside
it (``<folder>-openvino-fp32``; a marker file written last tells a finished export from a killed one).
The pipeline is read with float32 inference and a float32 KV cache (``INFERENCE_PRECISION_HINT``,
``KV_CACHE_PRECISION``: OpenVINO's CPU default is bf16 with a 16-bit cache) and ``--threads``
(``INFERENCE_NUM_THREADS``). It is fed the exported token ids as they are (a tensor, no tokenizer
on the way in); answers are decoded by the checkpoint's own HF tokenizer, as kvpress's are.

The eviction. One ``ContinuousBatchingPipeline`` per policy and cache size, one prompt at a time,
greedy. OpenVINO evicts per layer (every KV head of a layer keeps the same tokens), whole blocks of
32 tokens (its CPU block), never during the prefill: the prompt is read in full and cut to the
budget at the first decode steps, then once per filled block. Its cache is start | evictable | recent:

- ``max_cache_size`` = our budget in tokens (``eviction_sizes``: a fraction of the prompt's length as
  h2okv resolves it, heavy and recent parts each ``int(share x length)``; or a slot count), to the
  nearest whole block, at least 3 blocks;
- ``recent_size`` = our recent part (half), to the nearest whole block, at least one;
- ``start_size`` = one block, the least OpenVINO allows (H2O has no such area: it comes out of the
  heavy-hitter part);
- ``snapkv_window_size`` = 0: every prompt query adds to the scores, as H2O's (OpenVINO's default,
  8, scores the prompt by its last 8 queries only); ``apply_rotation`` = false (kept keys keep their
  positions, as ours). OpenVINO max-pools each step's scores over 7 neighbouring tokens (fixed).

A longctx export gives rows of ``h2okv eval longctx --json``'s shape (question ``aware``: one
prompt; ``chunk_size`` the whole prompt), scored with h2okv's own ``metric.py`` and built by its
``rows.py`` (both loaded by path), so the files merge with ``h2okv eval longctx --merge``; policies
``openvino-full``, ``openvino-h2o-sum``, ``openvino-h2o-norm_sum``; ``cache_options`` hold the rule
above (``CACHE_OPTIONS``: the same for every prompt, so rows of one configuration stay one line of
the table). ``prefill_s`` and ``decode_s`` come from OpenVINO's own metrics (TTFT; TPOT x the tokens
after the first), ``kv_fraction`` from its cache usage after the last step. A reasoning export gives
``eval reasoning``'s piece (rows built by ``decoding_kvpress.reasoning_row``, beside this file),
graded by ``h2okv eval reasoning-report``. The ``--json`` file is rewritten after each prompt, and
prompts already in it are skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

LONGCTX_FORMAT = "h2okv-longctx-prompts/1"
REASONING_FORMAT = "h2okv-reasoning-prompts/1"
PIECE_FORMAT = "h2okv-reasoning/1"
LONGCTX_DIR = Path(__file__).resolve().parents[2] / "src" / "h2okv" / "eval" / "longctx"
# our policy name -> OpenVINO's AggregationMode (None: no eviction)
POLICIES = {"full": None, "h2o-sum": "SUM", "h2o-norm_sum": "NORM_SUM"}
BLOCK = 32  # OpenVINO's KV block on CPU (kv_cache_manager.hpp: cpu_block_size)
RECENT_SHARE = 0.5  # h2okv's: half of a budget for the most recent tokens
SNAPKV_WINDOW = 0  # 0: the whole prompt's attention counts (H2O), not its last N queries
CACHE_OPTIONS = {"block_size": BLOCK, "start_size": BLOCK, "recent_share": RECENT_SHARE,
                 "snapkv_window_size": SNAPKV_WINDOW}
MARKER = "h2okv-openvino.json"
PACKAGES = ("openvino", "openvino-genai", "optimum-intel", "transformers")


def fail(message: str):
    """A bad input: one line on stderr and exit status 2 (argparse's own for a bad option)."""
    print(f"run_openvino: {message}", file=sys.stderr)
    raise SystemExit(2)


def openvino_genai():
    """The ``openvino_genai`` module, or a one-line error that says which venv has it."""
    try:
        import openvino_genai
    except ImportError:
        fail("openvino-genai is not installed in this Python: run `make peer-openvino` and use "
             ".venv-peer-ov/bin/python")
    return openvino_genai


def nearest_blocks(tokens: float) -> int:
    """Whole blocks nearest to ``tokens`` (a half block rounds up, not to even)."""
    return int(tokens / BLOCK + 0.5)


def our_slots(budget: float | int, prompt_len: int, share: float = RECENT_SHARE) -> tuple[int, int]:
    """``(heavy, recent)`` slots h2okv's h2o keeps for this prompt (``BudgetSpec.resolve``): a
    fraction in (0, 1] of the prompt, each part ``int(part x length)`` and at least 1; an int,
    that many slots with the heavy part rounded down."""
    if isinstance(budget, float) and 0 < budget <= 1:
        return max(1, int(budget * (1 - share) * prompt_len)), max(1, int(budget * share * prompt_len))
    heavy = int(int(budget) * (1 - share))
    return heavy, int(budget) - heavy


def eviction_sizes(budget: float | int, prompt_len: int, share: float = RECENT_SHARE) -> dict:
    """OpenVINO's ``CacheEvictionConfig`` sizes (tokens) for our budget on this prompt: the total
    and the recent part to the nearest whole block, one start block, at least one evictable block
    (it needs ``max_cache_size > start_size + recent_size``)."""
    heavy, recent = our_slots(budget, prompt_len, share)
    total = max(3, nearest_blocks(heavy + recent))
    recent_blocks = min(max(1, nearest_blocks(recent)), total - 2)
    return {"max_cache_size": total * BLOCK, "start_size": BLOCK, "recent_size": recent_blocks * BLOCK}


def f32_properties(threads: int | None) -> dict:
    """The compile properties: float32 compute and KV cache (the CPU default is bf16 and a 16-bit
    cache, which would not compare with our float32 runs), and the thread count."""
    properties = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    if threads:
        properties["INFERENCE_NUM_THREADS"] = int(threads)
    return properties


def scheduler_config(ov_genai, policy: str, sizes: dict | None, longest: int):
    """One sequence at a time, its prompt read in one step, KV blocks for ``longest`` tokens;
    eviction for an h2o policy."""
    config = ov_genai.SchedulerConfig()
    config.num_kv_blocks = kv_blocks(longest)
    config.max_num_batched_tokens = max(256, longest)
    config.max_num_seqs = 1
    config.enable_prefix_caching = False  # every prompt read afresh, as each of ours is
    aggregation = POLICIES[policy]
    if aggregation is not None:
        config.use_cache_eviction = True
        config.cache_eviction_config = ov_genai.CacheEvictionConfig(
            start_size=sizes["start_size"], recent_size=sizes["recent_size"],
            max_cache_size=sizes["max_cache_size"], aggregation_mode=getattr(ov_genai.AggregationMode, aggregation),
            apply_rotation=False, snapkv_window_size=SNAPKV_WINDOW)
    return config


def kv_blocks(longest: int) -> int:
    """KV blocks for one sequence of ``longest`` tokens, with room for a partly filled block."""
    return -(-longest // BLOCK) + 2


# -- the model: our checkpoint as OpenVINO IR ------------------------------------------------------

def ir_folder(model_dir: Path) -> Path:
    return model_dir.with_name(f"{model_dir.name}-openvino-fp32")


def export_ir(model_dir: Path, run=subprocess.run) -> Path:
    """The float32 IR of ``model_dir``, exported once beside it (into a temporary folder renamed
    when done, the marker written last)."""
    target = ir_folder(model_dir)
    if (target / MARKER).is_file():
        return target
    if not (model_dir / "config.json").is_file():
        fail(f"{str(model_dir)!r} is not an HF checkpoint folder (no config.json); give --model")
    tmp = target.with_name(f".{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cli = Path(sys.executable).with_name("optimum-cli")
    print(f"exporting {model_dir} to OpenVINO IR (float32) in {target}", flush=True)
    done = run([str(cli), "export", "openvino", "--model", str(model_dir), "--task", "text-generation-with-past",
                "--weight-format", "fp32", str(tmp)], check=False)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        fail(f"optimum-cli export openvino failed (exit {done.returncode}) for {model_dir}")
    (tmp / MARKER).write_text(json.dumps({"source": str(model_dir.resolve()), "weight_format": "fp32",
                                          "software": software()}) + "\n")
    shutil.rmtree(target, ignore_errors=True)  # an unfinished one (no marker)
    tmp.rename(target)
    return target


def kv_bytes_per_token(model_dir: Path) -> int:
    """float32 K and V of one token in every layer and KV head, from the HF config."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * 4


def software() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return ", ".join(found)


# -- decoding ------------------------------------------------------------------------------------

def end_of_answer(tokens: list[int], decode, eos_ids: set[int], stop: list[str], max_new_tokens: int):
    """``(tokens, finish)`` cut where h2okv's greedy loop ends (``decoding_kvpress.greedy_tokens``):
    at an EOS (not kept), after the token whose text completes a stop string, or at max_new_tokens."""
    kept = []
    for token in tokens[:max_new_tokens]:
        if token in eos_ids:
            return kept, "eos"
        kept.append(token)
        if stop and any(s in decode(kept) for s in stop):
            return kept, "stop"
    return kept, "length"


class Engine:
    """OpenVINO pipelines over one IR, one alive at a time (each holds its compiled model and KV
    blocks): ``answer(policy, sizes, ids, ...)`` decodes one prompt greedily."""

    def __init__(self, ir: Path, tokenizer, threads: int | None, longest: int, bytes_per_token: int):
        self.ir, self.tokenizer, self.threads, self.longest = ir, tokenizer, threads, longest
        self.bytes_per_token = bytes_per_token
        self.key, self.pipe, self.next_id = None, None, 0

    def pipeline(self, policy: str, sizes: dict | None):
        if self.key != (policy, json.dumps(sizes, sort_keys=True)):
            ov_genai = openvino_genai()
            self.pipe = None  # free the previous one's memory before compiling the next
            config = scheduler_config(ov_genai, policy, sizes, self.longest)
            self.pipe = ov_genai.ContinuousBatchingPipeline(str(self.ir), config, "CPU", f32_properties(self.threads))
            self.key = (policy, json.dumps(sizes, sort_keys=True))
        return self.pipe

    def answer(self, policy: str, sizes: dict | None, ids: list[int], max_new_tokens: int,
               eos_ids: set[int] | None = None, stop: list[str] | None = None, ignore_eos: bool = False) -> dict:
        import numpy as np
        import openvino

        pipe = self.pipeline(policy, sizes)
        config = pipe.get_config()
        config.do_sample, config.max_new_tokens = False, max_new_tokens
        if ignore_eos:  # a speed run: exactly max_new_tokens steps
            config.ignore_eos, eos_ids = True, set()
        if eos_ids:  # a reasoning export names its EOS ids; a longctx one uses the model's
            config.stop_token_ids = set(eos_ids)
        if stop:  # stop early; the answer is cut by our own rule below
            config.stop_strings, config.include_stop_str_in_output = set(stop), True
        eos = set(eos_ids or []) | set(config.stop_token_ids) | {config.eos_token_id}
        self.next_id += 1
        handle = pipe.add_request(self.next_id, openvino.Tensor(np.array([ids], dtype=np.int64)), config)
        while pipe.has_non_finished_requests():
            pipe.step()
        usage = pipe.get_metrics().cache_usage  # the finished sequence still holds its blocks
        generated = handle.read_all()[0].generated_ids
        metrics = handle.get_perf_metrics()
        decode = lambda t: self.tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
        tokens, finish = end_of_answer(generated, decode, set() if ignore_eos else eos, stop or [], max_new_tokens)
        held = usage / 100 * kv_blocks(self.longest) * BLOCK  # tokens per layer
        ttft, tpot = metrics.get_ttft().mean / 1000, metrics.get_tpot().mean / 1000
        return {"token_ids": tokens, "finish": finish, "text": decode(tokens), "prefill_s": ttft,
                "decode_s": tpot * max(0, len(generated) - 1), "kv_slots": round(held),
                "kv_bytes": round(held * self.bytes_per_token),
                "kv_fraction": held / (len(ids) + len(generated))}


def load_engine(exported: dict, model: str | None, threads: int | None, longest: int) -> Engine:
    from transformers import AutoTokenizer

    model_dir = Path(model or exported.get("model_path") or exported.get("model") or "")
    ir = export_ir(model_dir)
    return Engine(ir, AutoTokenizer.from_pretrained(model_dir), threads, longest, kv_bytes_per_token(model_dir))


# -- longctx rows --------------------------------------------------------------------------------

def load_by_path(name: str, folder: Path = LONGCTX_DIR):
    """``h2okv/eval/longctx/<name>.py`` (standard library only) without importing h2okv; or, with
    ``folder``, a module beside this file (this script is run by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(f"h2okv_peer_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def policy_label(policy: str) -> str:
    return f"openvino-{policy}"


def prompt_ids(prompt: dict) -> list[int]:
    return prompt["context_ids"] + prompt["question_ids"]


def longctx_row(exported: dict, prompt: dict, result: dict, policy: str, budget: float) -> dict:
    metric, rows = load_by_path("metric"), load_by_path("rows")
    answer = result["text"]
    return rows.make_row(
        task=prompt["task"], context=prompt["context"], sample=prompt["sample"], question="aware",
        policy=policy_label(policy), budget=budget, cache_options={} if POLICIES[policy] is None else CACHE_OPTIONS,
        chunk_size=len(prompt_ids(prompt)), metric=prompt["metric"],
        score=metric.score(prompt["metric"], answer, prompt["references"]), answer=answer,
        references=prompt["references"], haystack=exported["haystack"], seed=exported["seed"],
        model=exported["model"], max_new_tokens=prompt["max_new_tokens"],
        seconds=round(result["prefill_s"] + result["decode_s"], 3), prefill_s=round(result["prefill_s"], 3),
        decode_s=round(result["decode_s"], 3), kv_fraction=round(result["kv_fraction"], 4), batch=1)


def run_longctx(exported: dict, policies: list[str], budgets: list[float], out: str, answer) -> list[dict]:
    """Every policy x budget (``full``: budget 1) on every prompt; ``answer(policy, sizes, ids,
    max_new_tokens)`` decodes one. ``out`` is rewritten after each prompt; its rows are kept and
    their prompts skipped."""
    table = load_by_path("rows")
    rows = table.read_rows(out)
    done = {table.row_key(r) for r in rows}
    for policy in policies:
        for budget in ([1.0] if POLICIES[policy] is None else budgets):
            found = []
            for prompt in exported["prompts"]:
                key = table.row_key({"haystack": exported["haystack"], "seed": exported["seed"], "question": "aware",
                                     "policy": policy_label(policy), "budget": budget,
                                     "cache_options": {} if POLICIES[policy] is None else CACHE_OPTIONS,
                                     "task": prompt["task"], "context": prompt["context"], "sample": prompt["sample"]})
                if key in done:
                    continue
                ids = prompt_ids(prompt)
                sizes = None if POLICIES[policy] is None else eviction_sizes(budget, len(ids))
                result = answer(policy, sizes, ids, prompt["max_new_tokens"])
                found.append(longctx_row(exported, prompt, result, policy, budget))
                rows = table.merge_rows(rows, found[-1:])
                table.write_rows(rows, out)
            if found:
                print(f"{policy_label(policy)} @ {budget:g}: mean score {100 * sum(r['score'] for r in found) / len(found):.1f}"
                      f" ({sum(r['seconds'] for r in found):.0f} s)", flush=True)
    return rows


# -- reasoning piece -----------------------------------------------------------------------------

def read_piece(out: str, setup: dict) -> dict:
    if Path(out).is_file():
        piece = json.loads(Path(out).read_text(encoding="utf-8"))
        if not isinstance(piece, dict) or piece.get("format") != PIECE_FORMAT or piece.get("setup") != setup:
            fail(f"{out} is not a piece of this export's setup {setup}; use another --json")
        return piece
    return {"format": PIECE_FORMAT, "setup": setup, "rows": [], "batches": [], "peer": {}}


def run_reasoning(exported: dict, policies: list[str], budgets: list[int], out: str, answer) -> dict:
    """Every policy x slot budget (``full``: none) on every problem; the piece is rewritten after
    each problem, whose rows are kept and skipped on a second run."""
    reasoning_row = load_by_path("decoding_kvpress", Path(__file__).resolve().parent).reasoning_row
    setup = {**exported["setup"], "batch_size": 1}  # one sequence at a time
    piece = read_piece(out, setup)
    done = {(r["policy"], r["budget"], r["id"]) for r in piece["rows"]}
    for policy in policies:
        for budget in ([None] if POLICIES[policy] is None else budgets):
            label = policy_label(policy)
            piece["peer"][label] = peer_note(policy)
            for problem in exported["problems"]:
                if (label, budget, problem["id"]) in done:
                    continue
                ids = problem["prompt_ids"]
                sizes = None if budget is None else eviction_sizes(budget, len(ids))
                result = answer(policy, sizes, ids, setup["max_new_tokens"], set(exported["eos_ids"]), problem["stop"])
                row = reasoning_row(setup, problem, result, label, budget)
                piece["rows"].append(row)
                piece["batches"].append({
                    "policy": label, "budget": budget, "rows": 1, "new_tokens": row["new_tokens"],
                    "seconds": round(result["prefill_s"] + result["decode_s"], 3),
                    "load_avg_1m": round(os.getloadavg()[0], 2), "prefill_seconds": round(result["prefill_s"], 3),
                    "decode_seconds_per_token": round(result["decode_s"] / max(1, row["new_tokens"] - 1), 4),
                    **({} if sizes is None else {"openvino": sizes})})
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(piece, indent=1) + "\n")
                print(f"{label} @ {budget}: problem {problem['id']}, {row['new_tokens']} tokens, {row['finish']}",
                      flush=True)
    return piece


def peer_note(policy: str) -> str:
    if POLICIES[policy] is None:
        return f"ContinuousBatchingPipeline, no eviction; float32 CPU, batch 1; {software()}"
    return (f"ContinuousBatchingPipeline, CacheEvictionConfig(aggregation_mode={POLICIES[policy]}, "
            f"start_size={BLOCK}, recent_size=<recent part, whole blocks>, max_cache_size=<budget, whole blocks>, "
            f"snapkv_window_size={SNAPKV_WINDOW}, apply_rotation=False); float32 CPU, batch 1; {software()}")


# -- command line --------------------------------------------------------------------------------

def parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if unknown := [p for p in policies if p not in POLICIES]:
        fail(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    if not policies:
        fail("--policies is empty")
    return list(dict.fromkeys(policies))


def parse_budgets(text: str | None, exported: dict) -> list:
    """Fractions in (0, 1] for a longctx export, slot counts for a reasoning one."""
    reasoning = exported["format"] == REASONING_FORMAT
    raw = text.split(",") if text else [str(b) for b in exported.get("budgets") or []]
    budgets = []
    for part in (p.strip() for p in raw if p.strip() and p.strip() != "full"):
        try:
            value = int(part) if reasoning else float(part)
        except ValueError:
            value = None
        if value is None or (reasoning and value < 3 * BLOCK) or (not reasoning and not 0 < value <= 1):
            rule = f"a slot count >= {3 * BLOCK} (three OpenVINO blocks)" if reasoning else "a fraction in (0, 1]"
            fail(f"budget {part!r} is not {rule}")
        budgets.append(value)
    return budgets


def read_export(path: str) -> dict:
    try:
        exported = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        fail(f"cannot read {path}: {exc}")
    if not isinstance(exported, dict) or exported.get("format") not in (LONGCTX_FORMAT, REASONING_FORMAT):
        fail(f"{path} is not an {LONGCTX_FORMAT} or {REASONING_FORMAT} export (`h2okv eval longctx|reasoning "
             "--export-prompts`)")
    return exported


def main_export(argv) -> int:
    parser = argparse.ArgumentParser(prog="run_openvino.py export", description="export a checkpoint to OpenVINO IR")
    parser.add_argument("--model", help="HF checkpoint folder (e.g. ~/.cache/h2okv/<model>-transformers-.../)")
    parser.add_argument("--prompts", help="or: an export whose model folder to use")
    args = parser.parse_args(argv)
    if bool(args.model) == bool(args.prompts):
        fail("export takes one of --model DIR or --prompts FILE")
    exported = read_export(args.prompts) if args.prompts else {}
    openvino_genai()
    print(export_ir(Path(args.model or exported.get("model_path") or exported.get("model"))))
    return 0


def main_speed(argv) -> int:
    """``speed``: TTFT and decode time of ``full`` and ``h2o-sum`` on given prompt ids (a JSON list
    of id lists), for ``speed_openvino.py``, which times h2okv on the same ids."""
    parser = argparse.ArgumentParser(prog="run_openvino.py speed", description=main_speed.__doc__)
    parser.add_argument("--model", required=True, help="HF checkpoint folder")
    parser.add_argument("--ids", required=True, help="JSON: a list of prompts, each a list of token ids")
    parser.add_argument("--steps", type=int, default=32, help="tokens decoded after the first")
    parser.add_argument("--budget", type=float, default=0.2, help="h2o's fraction of each prompt")
    parser.add_argument("--policies", default="full,h2o-sum")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    policies = parse_policies(args.policies)
    prompts = json.loads(Path(args.ids).read_text(encoding="utf-8"))
    openvino_genai()
    model_dir = Path(args.model)
    longest = max(map(len, prompts)) + args.steps + 1 + BLOCK
    from transformers import AutoTokenizer

    engine = Engine(export_ir(model_dir), AutoTokenizer.from_pretrained(model_dir), args.threads, longest,
                    kv_bytes_per_token(model_dir))
    rows = []
    for ids in prompts:
        for policy in policies:
            sizes = None if POLICIES[policy] is None else eviction_sizes(args.budget, len(ids))
            engine.answer(policy, sizes, ids[:64], 2, ignore_eos=True)  # compile and warm up, not timed
            result = engine.answer(policy, sizes, ids, args.steps + 1, ignore_eos=True)
            rows.append({"engine": "openvino", "context": len(ids), "policy": policy_label(policy),
                         "budget": 1.0 if sizes is None else args.budget, "openvino": sizes,
                         "prefill_s": round(result["prefill_s"], 3), "steps": len(result["token_ids"]) - 1,
                         "decode_s": round(result["decode_s"], 3), "kv_fraction": round(result["kv_fraction"], 4)})
            print(json.dumps(rows[-1]), flush=True)
    Path(args.json).write_text(json.dumps({"software": software(), "threads": args.threads, "rows": rows}, indent=1)
                               + "\n")
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="JSON written by h2okv eval longctx/reasoning --export-prompts")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of: {', '.join(POLICIES)}")
    parser.add_argument("--budgets", default=None, help="fractions (longctx) or slot counts (reasoning); "
                        "default: the export's")
    parser.add_argument("--limit", type=int, default=None, help="only the export's first N prompts")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the export's)")
    parser.add_argument("--threads", type=int, default=None, help="OpenVINO's INFERENCE_NUM_THREADS")
    parser.add_argument("--json", required=True, help="output rows (resumed if it exists)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return main_export(argv[1:])
    if argv[:1] == ["speed"]:
        return main_speed(argv[1:])
    args = parse_args(argv)
    exported = read_export(args.prompts)
    policies = parse_policies(args.policies)
    budgets = parse_budgets(args.budgets, exported)
    if not budgets and any(POLICIES[p] for p in policies):
        fail("no budget: give --budgets")
    reasoning = exported["format"] == REASONING_FORMAT
    key = "problems" if reasoning else "prompts"
    if args.limit is not None:
        if args.limit < 1:
            fail(f"--limit must be >= 1, got {args.limit}")
        exported = {**exported, key: exported[key][: args.limit]}
    openvino_genai()  # fail before anything is exported
    if reasoning:
        longest = max(len(p["prompt_ids"]) for p in exported["problems"]) + exported["setup"]["max_new_tokens"]
    else:
        longest = max(len(prompt_ids(p)) + p["max_new_tokens"] for p in exported["prompts"])
    engine = load_engine(exported, args.model, args.threads, longest + BLOCK)
    if reasoning:
        piece = run_reasoning(exported, policies, budgets, args.json, engine.answer)
        print(f"{len(piece['rows'])} rows in {args.json}: grade and merge them with `h2okv eval reasoning-report`")
    else:
        rows = run_longctx(exported, policies, budgets, args.json, engine.answer)
        print(f"{len(rows)} rows in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
