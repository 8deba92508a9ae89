"""Run awslabs keys_values' H2O (PyPI ``keys-vals`` 0.2.0, on LitGPT) on the problems exported by
``h2okv eval reasoning --export-prompts``.

Runs in the peer's own venv (``make peer-kv`` -> ``.venv-peer-kv``: keys_values runs LitGPT models,
and the litgpt it needs cannot be resolved beside the transformers it imports), so it must not import
h2okv. Usage::

    OMP_NUM_THREADS=1 .venv-peer-kv/bin/python tools/peer/run_keys_values.py prompts.json \\
        --budgets 128,full --json piece.json

The model is the export's HF checkpoint (``--model-dir``, default the export's ``model_path``),
converted once to LitGPT's format under ``~/.cache/h2okv/litgpt/<its folder's name>`` (the LitGPT
config is chosen from the HF config's shape; a model it does not know is a one-line error).

For every budget, each problem is decoded alone, greedily, from the exported prompt ids, until one
of the exported EOS ids (not kept), a stop string, or ``max_new_tokens``: what ``h2okv eval
reasoning`` does for one row. One problem at a time because keys_values' batched generation
(``batched_generate_fn``) needs prompts of equal length and has no attention mask for padding, so
left-padded GSM8K prompts of different lengths would attend to their pads.

How the budget maps. h2okv's integer budget is the number of KV slots per layer and KV head, half
of them (``--recent-share``, ``eval reasoning``'s default 0.5) for the most recent tokens. A
keys_values cache keeps ``cache_length`` slots per layer, per KV head and per batch row, and its
H2O (``h2o-default``, ``H2OKVCache``) protects the last ``grace_period`` tokens from eviction: so
``cache_length`` = our budget and ``grace_period`` = its recent part. Differences that stay: the
H2O scores start at zero after keys_values' prefill (its prefill computes no attention weights); a
prompt longer than the budget is prefilled up to the budget, and the rest read in chunks of 16
whose first overwrites the slots after the first 5% without looking at scores; scores are summed
over a KV head's query heads and not normalized. ``full`` is keys_values' last-recently-inserted
cache sized to hold every prompt and answer: it never evicts (its answers should equal ours).

Rows have the shape of ``eval reasoning``'s (``keep_text``) with ``predicted`` and ``correct``
null, built by ``decoding_kvpress.reasoning_row`` (loaded by path, beside this file): ``h2okv eval
reasoning-report`` grades them with h2okv's own ``answers.py`` (it needs lm-eval, which this venv
lacks). ``policy`` is ``keys_values-h2o`` (``keys_values-h2o recent=<share>`` for a share other than
0.5, as ``eval reasoning`` labels its own) or ``keys_values-full``. Each problem is one entry of
``batches``, with its prefill seconds and decode seconds per token beside ``eval reasoning``'s
timings. The ``--json`` piece is rewritten after every problem; problems already in it are skipped.

Two workarounds for keys-vals 0.2.0, both outside the package:

- its wheel lacks ``keys_values/attention/zero_padded_qlen_thresholds.csv``, which the default
  choice between eager and SDPA attention reads: the model gets the attention class's own fallback
  rule instead (eager below 512 query tokens) and the caches share the model's attention;
- ``LongContextInferenceModel``'s prompt pass returns ``lm_head`` of the last hidden state without
  the final norm (``transformer.ln_f``), so the first generated token came from unnormalised
  logits (later tokens go through ``GPT.forward``, which applies it): the prompt pass here runs
  with ``lm_head`` = ``ln_f`` then ``lm_head``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

EXPORT_FORMAT = "h2okv-reasoning-prompts/1"
PIECE_FORMAT = "h2okv-reasoning/1"
DEFAULT_RECENT_SHARE = 0.5  # eval reasoning's: half of each budget for the most recent tokens
H2O_CACHE = "h2o-default"  # keys_values' H2OKVCache (per-row decisions; h2o-orig-default averages rows)
FULL_CACHE = "lastrec-default"  # LongContextInferenceModel refuses a dense cache; sized to never evict
PROMPT_CHUNK = 16  # keys_values' default chunk for a prompt longer than the cache
CACHE_ROOT = Path.home() / ".cache" / "h2okv" / "litgpt"
PACKAGES = ("keys-vals", "litgpt", "torch", "transformers")
# LitGPT's config for an HF checkpoint of this shape: (model_type, layers, hidden size, query heads,
# KV heads, MLP size). The conversion copies weights by position in that shape, so the shape is
# what must match; these are the models h2okv runs reasoning on (the 1.5B has not been tried).
LITGPT_NAMES = {
    ("qwen2", 24, 896, 14, 2, 4864): "Qwen2.5-Coder-0.5B-Instruct",
    ("qwen2", 28, 1536, 12, 2, 8960): "Qwen2.5-Coder-1.5B-Instruct",
}


def fail(message: str):
    """A bad input: one line on stderr and exit status 2 (argparse's own for a bad option)."""
    print(f"run_keys_values: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_budgets(text: str) -> list[int | None]:
    """``128,full`` -> ``[128, None]``: slots per layer and KV head, ``full`` (None) keeps all."""
    budgets = []
    for part in (p.strip() for p in text.split(",")):
        if part == "full":
            budgets.append(None)
        elif part.isdigit() and int(part) >= 1:
            budgets.append(int(part))
        else:
            fail(f"--budgets {text!r}: {part!r} is neither a number of slots >= 1 nor 'full'")
    if not budgets:
        fail("--budgets is empty")
    return list(dict.fromkeys(budgets))


def recent_slots(budget: int, share: float) -> int:
    """The recent part of ``budget`` as ``eval reasoning`` splits it (``BudgetSpec.from_slots``:
    the heavy part rounds down); keys_values needs at least one slot left for heavy hitters."""
    recent = budget - int(budget * (1 - share))
    if recent >= budget:
        fail(f"--recent-share {share:g} leaves budget {budget} no heavy-hitter slot "
             "(keys_values needs grace_period < cache_length)")
    return recent


def policy_label(budget: int | None, share: float) -> str:
    if budget is None:
        return "keys_values-full"
    return "keys_values-h2o" + ("" if share == DEFAULT_RECENT_SHARE else f" recent={share:g}")


def read_export(path: str) -> dict:
    try:
        exported = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        fail(f"cannot read {path}: {exc}")
    if not isinstance(exported, dict) or exported.get("format") != EXPORT_FORMAT:
        fail(f"{path} is not an {EXPORT_FORMAT} export (from `h2okv eval reasoning --export-prompts`)")
    return exported


def model_dir(given: str | None, exported: dict) -> Path:
    """The HF checkpoint folder: ``--model-dir``, else the export's ``model_path`` if it is here."""
    path = Path(given or exported.get("model_path") or "")
    if not (path / "config.json").is_file():
        origin = "--model-dir" if given else "the export's model_path"
        fail(f"{origin} {str(path)!r} is not an HF checkpoint folder (no config.json); give --model-dir")
    return path


def litgpt_name(hf_config: dict) -> str:
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "intermediate_size")
    shape = tuple(hf_config.get(k) for k in keys)
    if shape not in LITGPT_NAMES:
        fail(f"no LitGPT config known for an HF model of shape {dict(zip(keys, shape, strict=True))}; "
             f"known: {', '.join(LITGPT_NAMES.values())}")
    return LITGPT_NAMES[shape]


def litgpt_checkpoint(hf_dir: Path, cache_root: Path = CACHE_ROOT, convert=None) -> Path:
    """The LitGPT checkpoint of ``hf_dir``, converted once into ``cache_root/<hf_dir's name>``.

    ``convert_to_litgpt`` writes into the folder it reads, so the folder holds links to the HF
    files and gains ``lit_model.pth`` and ``model_config.yaml``; a marker written last tells a
    finished conversion from an interrupted one."""
    name = litgpt_name(json.loads((hf_dir / "config.json").read_text(encoding="utf-8")))
    target = cache_root / hf_dir.name
    marker = target / "h2okv-litgpt.json"
    if marker.is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for source in hf_dir.iterdir():
        link = target / source.name
        if source.is_file() and not link.exists():
            link.symlink_to(source.resolve())
    print(f"converting {hf_dir} to LitGPT ({name}) in {target}", flush=True)
    (convert or convert_to_litgpt)(target, name)
    marker.write_text(json.dumps({"source": str(hf_dir.resolve()), "litgpt_name": name}) + "\n")
    return target


def convert_to_litgpt(folder: Path, name: str) -> None:
    # float32: h2okv's reasoning runs on CPU in float32, and the K/V byte counts assume it
    from litgpt.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    convert_hf_checkpoint(folder, model_name=name, dtype="float32")


def load_gpt(checkpoint: Path):
    """keys_values' ``GPT`` with the checkpoint's weights, float32 on CPU."""
    import torch
    from keys_values.config import Config
    from keys_values.model import GPT

    config = Config.from_file(checkpoint / "model_config.yaml")
    # workaround: the keys-vals 0.2.0 wheel lacks attention/zero_padded_qlen_thresholds.csv, which
    # the default eager-vs-SDPA predicate loads (FileNotFoundError in GPT()); this is the rule the
    # attention class itself falls back to (attention/base.py)
    gpt = GPT(config, use_eager_kernel=lambda kv_len, q_len: q_len < 512)
    weights = torch.load(checkpoint / "lit_model.pth", map_location="cpu", mmap=True, weights_only=True)
    gpt.load_state_dict(weights, strict=True)
    return gpt.eval()


def cache_for(gpt, budget: int | None, recent: int, longest: int):
    """Assign every layer a keys_values cache for ``budget`` and return the model that reads
    prompts through it; ``longest`` (prompt + answer) sizes ``full``'s cache."""
    import torch
    from keys_values.kvcache.factory import KVCacheFactory
    from keys_values.long_context import LongContextInferenceModel
    from keys_values.utils import VerbosityLevels

    # mha=gpt.mha: the caches share the model's attention (and so its eager rule, see load_gpt)
    options = {"mha": gpt.mha}
    if budget is not None:
        options["grace_period"] = recent
    gpt.assign_kv_caches(KVCacheFactory.create(
        gpt_model=gpt, name=FULL_CACHE if budget is None else H2O_CACHE, max_batch_size=1,
        cache_length=longest if budget is None else budget, dtype=torch.float32, device=torch.device("cpu"),
        cache_kwargs=options))
    return LongContextInferenceModel(gpt_model=gpt, head_model=None, chunk_size=PROMPT_CHUNK,
                                     verbose=VerbosityLevels.NONE)


def prompt_logits(model, prompt: list[int]):
    """The last position's logits after reading ``prompt`` (the caches are reset first)."""
    import torch

    gpt = model.gpt_model
    head = gpt.lm_head
    # workaround: keys-vals 0.2.0's LongContextInferenceModel._forward_internal_no_check (targets=None)
    # returns gpt_model.lm_head(last hidden state) without transformer.ln_f, the final RMSNorm, so the
    # first token would come from unnormalised logits; put the norm in front of the head for this pass
    gpt.lm_head = torch.nn.Sequential(gpt.transformer.ln_f, head)
    try:
        return model(torch.tensor([prompt]), targets=None)[0, -1]
    finally:
        gpt.lm_head = head


def cache_kv(gpt) -> tuple[int, int]:
    """``(bytes, most slots)`` of the K/V the caches hold: K and V of every layer and KV head, as
    ``greedy.row_kv`` counts ours (a layer holds what it has read, up to its length)."""
    total, most = 0, 0
    config = gpt.config
    for cache in gpt.get_kv_caches():
        slots = min(cache.input_pos, cache.cache_length)
        total += 2 * config.n_query_groups * config.head_size * 4 * slots  # float32
        most = max(most, slots)
    return total, most


def decode_problem(model, tokenizer, problem: dict, max_new_tokens: int, eos_ids: set[int], cut_at_stop) -> dict:
    """Greedy answer of one problem: ``decoding_kvpress.greedy_tokens`` on keys_values' model."""
    import torch

    gpt, prompt, stop = model.gpt_model, problem["prompt_ids"], problem["stop"]
    gpt.max_seq_length = len(prompt) + max_new_tokens  # as keys_values' generate_fn sets it
    greedy_tokens = load_beside("decoding_kvpress").greedy_tokens
    start = time.perf_counter()
    with torch.inference_mode():
        logits = prompt_logits(model, prompt)
        prefilled = time.perf_counter()
        tokens, finish = greedy_tokens(logits, lambda token, step: gpt(torch.tensor([[token]]))[0, -1],
                                       tokenizer, stop, max_new_tokens, eos_ids)
    end = time.perf_counter()
    kv_bytes, kv_slots = cache_kv(gpt)
    config = gpt.config
    token_16 = len(gpt.get_kv_caches()) * 2 * config.n_query_groups * config.head_size * 2  # a full 16-bit token
    return {"token_ids": tokens, "finish": finish, "kv_bytes": kv_bytes, "kv_slots": kv_slots,
            "kv_bytes_16bit": kv_bytes // 2,  # its float32 slots, counted at 16 bits
            "kv_share_16bit": round(kv_bytes / 2 / (token_16 * (len(prompt) + len(tokens))), 4),
            "text": cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop),
            "prefill_seconds": prefilled - start,
            # the steps after the prompt pass: each produced one token, the last of them the EOS
            "decode_seconds_per_token": (end - prefilled) / max(1, len(tokens) - (finish != "eos"))}


def read_piece(out: str, setup: dict) -> dict:
    if Path(out).is_file():
        try:
            piece = json.loads(Path(out).read_text(encoding="utf-8"))
        except ValueError as exc:
            fail(f"cannot read {out}: {exc}")
        if not isinstance(piece, dict) or piece.get("format") != PIECE_FORMAT or piece.get("setup") != setup:
            fail(f"{out} is not a piece of this export's setup {setup}; use another --json")
        return piece
    return {"format": PIECE_FORMAT, "setup": setup, "rows": [], "batches": [], "peer": {}}


def peer_note(budget: int | None, recent: int) -> str:
    if budget is None:
        cache = f"{FULL_CACHE} sized to the longest prompt + max_new_tokens (never evicts)"
    else:
        cache = (f"{H2O_CACHE} (H2OKVCache), cache_length=<budget>, grace_period={recent} of {budget}, "
                 f"prompt chunks of {PROMPT_CHUNK}")
    return f"{cache}; float32 CPU, batch 1; {software()}"


def software() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return ", ".join(found)


def run(exported: dict, budgets: list[int | None], share: float, out: str, decoder_for) -> dict:
    """Every budget on every problem of the export; returns the piece, written to ``out`` after every
    problem (rows already in it are kept and their problems skipped). ``decoder_for(budget,
    recent)`` returns the function that answers one problem under that budget (it loads the model
    on first use, so a finished piece loads nothing)."""
    setup = {**exported["setup"], "batch_size": 1}  # one sequence at a time (see the docstring)
    piece = read_piece(out, setup)
    done = {(r["policy"], r["budget"], r["id"]) for r in piece["rows"]}
    reasoning_row = load_beside("decoding_kvpress").reasoning_row
    for budget in budgets:
        policy = policy_label(budget, share)
        recent = 0 if budget is None else recent_slots(budget, share)
        todo = [p for p in exported["problems"] if (policy, budget, p["id"]) not in done]
        if not todo:
            continue
        decode = decoder_for(budget, recent)
        piece["peer"][policy] = peer_note(budget, recent)
        for problem in todo:
            start, cpu_start = time.perf_counter(), time.process_time()
            result = decode(problem)
            row = reasoning_row(setup, problem, result, policy, budget)
            piece["rows"].append(row)
            piece["batches"].append({
                "policy": policy, "budget": budget, "rows": 1, "new_tokens": row["new_tokens"],
                "seconds": round(time.perf_counter() - start, 3),
                "cpu_seconds": round(time.process_time() - cpu_start, 3),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "prefill_seconds": round(result["prefill_seconds"], 3),
                "decode_seconds_per_token": round(result["decode_seconds_per_token"], 4)})
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(piece, indent=1) + "\n")
            print(f"{policy} @ {budget}: problem {problem['id']}, {row['new_tokens']} tokens, {row['finish']}, "
                  f"{piece['batches'][-1]['seconds']:.0f} s ({result['decode_seconds_per_token']:.3f} s/token)",
                  flush=True)
    return piece


def keys_values_decoder(exported: dict, hf_dir: Path):
    """``run``'s ``decoder_for`` on keys_values: the checkpoint converted and loaded once, then a
    fresh set of caches per budget."""
    loaded = {}
    max_new, eos = exported["setup"]["max_new_tokens"], set(exported["eos_ids"])
    longest = max(len(p["prompt_ids"]) for p in exported["problems"]) + max_new + 1
    cut_at_stop = load_beside("decoding_kvpress").cut_at_stop

    def decoder_for(budget, recent):
        if not loaded:
            from transformers import AutoTokenizer

            loaded["tokenizer"] = AutoTokenizer.from_pretrained(hf_dir)
            loaded["gpt"] = load_gpt(litgpt_checkpoint(hf_dir))
        model = cache_for(loaded["gpt"], budget, recent, longest)
        return lambda problem: decode_problem(model, loaded["tokenizer"], problem, max_new, eos, cut_at_stop)

    return decoder_for


def load_beside(name: str):
    """A module beside this file (this script is run by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(f"h2okv_peer_{name}", Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="JSON written by h2okv eval reasoning --export-prompts")
    parser.add_argument("--budgets", default=None,
                        help="comma-separated slots per layer and KV head, and 'full' (default: the export's budgets)")
    parser.add_argument("--recent-share", type=float, default=DEFAULT_RECENT_SHARE,
                        help="share of each budget kept for the most recent tokens, keys_values' grace_period "
                             f"(default: {DEFAULT_RECENT_SHARE}, as eval reasoning)")
    parser.add_argument("--limit", type=int, default=None, help="only the export's first N problems")
    parser.add_argument("--model-dir", default=None, help="HF checkpoint folder (default: the export's model_path)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", required=True, help="output piece (resumed if it exists)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    exported = read_export(args.prompts)
    budgets = parse_budgets(args.budgets if args.budgets else ",".join(map(str, exported.get("budgets") or [])))
    if not 0.0 <= args.recent_share <= 1.0:  # also refuses nan
        fail(f"--recent-share must be in [0, 1], got {args.recent_share:g}")
    for budget in budgets:  # fail before any model is loaded
        if budget is not None:
            recent_slots(budget, args.recent_share)
    if args.limit is not None:
        if args.limit < 1:
            fail(f"--limit must be >= 1, got {args.limit}")
        exported = {**exported, "problems": exported["problems"][: args.limit]}
    hf_dir = model_dir(args.model_dir, exported)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    piece = run(exported, budgets, args.recent_share, args.json, keys_values_decoder(exported, hf_dir))
    print(f"{len(piece['rows'])} rows in {args.json}: grade and merge them with `h2okv eval reasoning-report`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
