"""Run NVIDIA kvpress presses on prompts exported by ``h2okv eval retrieval --export-prompts`` or
``h2okv eval longctx --export-prompts``.

Runs in the peer's own venv (``make peer`` -> ``.venv-peer``; kvpress pins transformers < 5.3), so
it must not import h2okv. Usage::

    .venv-peer/bin/python tools/peer/run_kvpress.py prompts.json --presses knorm,tova \\
        --modes question-compressed,question-out --json rows.json --threads 1

For every press, budget (kvpress ``compression_ratio`` = 1 - budget) and mode, each prompt is run
alone (kvpress compresses one sequence at a time), greedy-decoded for ``max_new_tokens`` tokens,
and scored as h2okv scores it: correct when the passkey appears in the answer. The rows have the
shape of ``h2okv eval retrieval --json``'s rows (one per policy x budget x context x depth), with
``policy`` = ``kvpress-<press>`` (question compressed) or ``kvpress-<press>-qout`` (question kept
out), so both files merge into one table. ``needle_kept`` is null (a compressed DynamicCache keeps
no token positions) and ``chunk_size`` is the whole compressed span (kvpress reads it at once).

A reasoning export (format ``h2okv-reasoning-prompts/1``, from ``h2okv eval reasoning
--export-prompts``) runs kvpress's ``DecodingPress`` around each of ``--presses`` (knorm, tova,
expected) at each slot budget instead: see ``decoding_kvpress.py`` (loaded by path, beside this file).

A longctx export (format ``h2okv-longctx-prompts/1``) gives rows of ``h2okv eval longctx --json``'s
shape instead, one per prompt, press, budget and mode, scored with the very metric h2okv uses: the
adapter loads ``src/h2okv/eval/longctx/metric.py`` and ``rows.py`` by path (standard library only,
no h2okv import). ``policy`` = ``kvpress-<press>``, ``question`` = ``aware`` (question-compressed)
or ``agnostic`` (question-out); ``full`` runs in every mode asked. The ``--json`` file is rewritten
after each press x budget x mode, and rows already in it are skipped (an interrupted run resumes).

How the question is handled:

- ``question-compressed``: context and question are one prefill under the press; the press scores
  with the question in view (as h2okv does, whose prompts end with the question). Decoding starts
  from that prefill's last logits.
- ``question-out`` (kvpress's default protocol, its pipeline): only the context is prefilled under
  the press; the question is then read uncompressed on top of the compressed cache, and decoding
  follows. The compression is question-agnostic.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

EXPORT_FORMAT = "h2okv-retrieval-prompts/1"
LONGCTX_FORMAT = "h2okv-longctx-prompts/1"
REASONING_FORMAT = "h2okv-reasoning-prompts/1"
MODES = {"question-compressed": "", "question-out": "-qout"}
QUESTION_OF_MODE = {"question-compressed": "aware", "question-out": "agnostic"}  # eval longctx's names
# ... and its names with several questions a context (``--questions-per-context``): the context
# compressed before the question is ``reuse`` (a press compresses it the same way for each of them,
# so the answers are those of one compressed state shared), read with it ``fresh``
MANY_QUESTIONS_OF_MODE = {"question-compressed": "fresh", "question-out": "reuse"}
MODE_OF_NAME = {**{m: m for m in MODES}, **{q: m for m, q in QUESTION_OF_MODE.items()}}
LONGCTX_DIR = Path(__file__).resolve().parents[2] / "src" / "h2okv" / "eval" / "longctx"
PRESSES = ["full", "knorm", "tova", "snapkv", "streaming", "observed", "expected", "adakv-snapkv", "kvzip",
           "chunkkv-snapkv"]


def question_of(mode: str, prompt: dict) -> str:
    """The row's ``question`` field for a prompt read in ``mode``."""
    return (MANY_QUESTIONS_OF_MODE if prompt.get("questions", 1) > 1 else QUESTION_OF_MODE)[mode]


def several_questions(prompt: dict) -> dict:
    """A prompt's ``questions`` and ``question_index`` (of several a context), for its row and key."""
    return {f: prompt[f] for f in ("questions", "question_index") if f in prompt}


def make_press(name: str, ratio: float):
    """The press behind one of our short names. SnapKV uses the window and kernel that RESULTS
    compared with h2okv's one-chunk ``snapkv`` (32, 7); the rest use kvpress's defaults."""
    if name == "full":
        return None
    import kvpress

    simple = {"knorm": kvpress.KnormPress, "tova": kvpress.TOVAPress, "streaming": kvpress.StreamingLLMPress,
              "observed": kvpress.ObservedAttentionPress, "expected": kvpress.ExpectedAttentionPress,
              "kvzip": kvpress.KVzipPress}
    if name in simple:
        return simple[name](compression_ratio=ratio)
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7)
    if name == "adakv-snapkv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7))
    if name == "chunkkv-snapkv":  # whole chunks of 20 tokens (kvpress's default) ranked by SnapKV's scores
        return kvpress.ChunkKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=7))
    raise SystemExit(f"run_kvpress: unknown press {name!r}; known: {', '.join(PRESSES)}")


def greedy_answer(model, tokenizer, cache, first_logits, next_position: int, max_new_tokens: int) -> str:
    """Greedy decoding on a (compressed) cache, with explicit positions: the cache may hold fewer
    entries than the tokens read, and the positions must continue the prompt's."""
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    generated = [int(first_logits.argmax())]
    for step in range(max_new_tokens - 1):
        if generated[-1] in stop:
            break
        out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache,
                    position_ids=torch.tensor([[next_position + step]]))
        generated.append(int(out.logits[0, -1].argmax()))
    return tokenizer.decode(generated, skip_special_tokens=True)


def new_cache(model, quantized: dict | None):
    """A ``DynamicCache``, or transformers' ``QuantizedCache`` (``quantized``: its keywords, e.g.
    quanto's 2 bits): the baseline of quantization alone, and under a press kvpress's combination
    of the two (a press re-quantizes what it keeps, ``kvpress.presses.base_press``). Note what it
    does: the prompt's own read attends to float keys and values, and only the tokens after it
    read the quantized ones; a residual of up to ``residual_length`` recent tokens stays float."""
    from transformers import DynamicCache, QuantizedCache

    if quantized is None:
        return DynamicCache()
    return QuantizedCache(config=model.config, **quantized)


def tensor_bytes(t) -> int:
    """What a tensor stores: a quantized one's (quanto's ``WeightQBitsTensor``) packed codes, scales
    and shifts, found through the tensor-subclass protocol; HQQ's ``(codes, meta)`` pair, its meta's
    scales and zeros; a plain tensor's elements (anything else, e.g. HQQ's shapes, stores nothing)."""
    if isinstance(t, (tuple, list)):
        return sum(tensor_bytes(item) for item in t)
    if isinstance(t, dict):
        return sum(tensor_bytes(item) for item in t.values())
    if not isinstance(t, torch.Tensor):
        return 0
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def share_of_16bit(cache, model, seen: int) -> float:
    """The bytes ``cache`` holds over a full 16-bit cache of the ``seen`` tokens read and generated
    (what h2okv's rows call ``kv_share_16bit``; a press leaves fewer in the cache than were seen)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    held = 0
    for layer in cache.layers:
        held += tensor_bytes(layer.keys) + tensor_bytes(layer.values)
        for name in ("_quantized_keys", "_quantized_values"):
            if getattr(layer, name, None) is not None:
                held += tensor_bytes(getattr(layer, name))
    return held / (seen * len(cache.layers) * kv_heads * head_dim * 2 * 2)


def answer_one(model, tokenizer, press, prompt: dict, mode: str, max_new_tokens: int,
               quantized: dict | None = None, held: list | None = None) -> str:
    """``held``, when given, gets the cache's ``share_of_16bit`` once the answer is decoded."""
    context, question = prompt["context_ids"], prompt["question_ids"]
    compressed = context + question if mode == "question-compressed" else context
    cache = new_cache(model, quantized)
    with torch.inference_mode():
        with press(model) if press is not None else contextlib.nullcontext():
            hidden = model.model(input_ids=torch.tensor([compressed]), past_key_values=cache).last_hidden_state
        if mode == "question-compressed":
            logits = model.lm_head(hidden[:, -1])[0]
        else:
            positions = torch.arange(len(context), len(context) + len(question)).unsqueeze(0)
            out = model(input_ids=torch.tensor([question]), past_key_values=cache, position_ids=positions,
                        logits_to_keep=1)
            logits = out.logits[0, -1]
        read = cache.get_seq_length()  # what the prompt left in the cache (a press: fewer than it read)
        answer = greedy_answer(model, tokenizer, cache, logits, len(context) + len(question), max_new_tokens)
    if held is not None:  # every token read, and those the answer fed back
        held.append(share_of_16bit(cache, model, len(context) + len(question) + cache.get_seq_length() - read))
    return answer


def cells(exported: dict, answers: list[str], policy: str, budget: float) -> list[dict]:
    """One row per context x depth, in ``h2okv eval retrieval --json``'s shape."""
    groups: dict[tuple[int, float], list[tuple[dict, str]]] = {}
    for prompt, answer in zip(exported["prompts"], answers, strict=True):
        groups.setdefault((prompt["context"], prompt["depth"]), []).append((prompt, answer))
    rows = []
    for (context, depth), group in groups.items():
        correct = sum(p["passkey"] in a for p, a in group)
        rows.append({"policy": policy, "budget": budget, "context": context, "depth": depth, "trials": len(group),
                     "correct": correct, "accuracy": correct / len(group), "needle_kept": None,
                     "haystack": exported["haystack"], "chunk_size": context, "answers": [a for _, a in group],
                     # a press compresses each layer once, after the whole prompt: h2okv's late prefill
                     "prefill": "late"})
    return rows


def load(model_path: str, attention: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=attention)
    return model.eval(), AutoTokenizer.from_pretrained(model_path)


def run(exported: dict, presses: list[str], modes: list[str], budgets: list[float], model_path: str) -> list[dict]:
    models = {}
    rows = []
    for name in presses:
        # ObservedAttention needs the attention weights, which only eager attention returns
        attention = "eager" if name == "observed" else "sdpa"
        if attention not in models:
            models[attention] = load(model_path, attention)
        model, tokenizer = models[attention]
        for budget in ([1.0] if name == "full" else budgets):
            for mode in (["question-compressed"] if name == "full" else modes):
                press = make_press(name, round(1.0 - budget, 6))
                start = time.perf_counter()
                answers = [answer_one(model, tokenizer, press, p, mode, exported["max_new_tokens"])
                           for p in exported["prompts"]]
                policy = f"kvpress-{name}" + ("" if name == "full" else MODES[mode])
                found = cells(exported, answers, policy, budget)
                rows += found
                print(f"{policy} @ {budget:g}: {sum(r['correct'] for r in found)}/{sum(r['trials'] for r in found)}"
                      f" ({time.perf_counter() - start:.0f} s)", flush=True)
    return rows


def load_by_path(name: str, folder: Path = LONGCTX_DIR):
    """``h2okv/eval/longctx/<name>.py`` (standard library only) without importing h2okv; or, with
    ``folder``, a module beside this file (this script is run by path, not as a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"h2okv_peer_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def longctx_rows(exported: dict, prompts: list[dict], answers: list[str], policy: str, budget: float, mode: str,
                 seconds: float, quantized: dict | None = None, **fields) -> list[dict]:
    """One ``h2okv eval longctx`` row per prompt, scored by h2okv's own metric file; a quantized
    cache's keywords are the row's cache options (its own cell and label)."""
    metric, rows = load_by_path("metric"), load_by_path("rows")
    return [rows.make_row(
        task=p["task"], context=p["context"], sample=p["sample"], question=question_of(mode, p), policy=policy,
        budget=budget, cache_options=dict(quantized or {}), **fields, **several_questions(p),
        chunk_size=len(p["context_ids"]) + (len(p["question_ids"]) if mode == "question-compressed" else 0),
        metric=p["metric"], score=metric.score(p["metric"], a, p["references"]), answer=a, references=p["references"],
        haystack=exported["haystack"], seed=exported["seed"], model=exported["model"],
        max_new_tokens=p["max_new_tokens"], seconds=round(seconds, 3),
    ) for p, a in zip(prompts, answers, strict=True)]


def run_longctx(exported: dict, presses: list[str], modes: list[str], budgets: list[float], model_path: str,
                models: dict | None = None, out: str | None = None, quantized: dict | None = None) -> list[dict]:
    """Every press x budget x mode on every prompt of a longctx export (``full``: budget 1, every
    mode). With ``out``, rows already in that file are kept and their prompts skipped, and the file
    is rewritten after each prompt: a long press (KVzip on the 1.5B model takes minutes a prompt)
    resumes where it stopped, as ``eval longctx`` does."""
    table = load_by_path("rows")
    rows = table.read_rows(out) if out else []
    done = {table.row_key(r) for r in rows}
    models = {} if models is None else models
    for name in presses:
        for budget in ([1.0] if name == "full" else budgets):
            for mode in modes:
                policy = f"kvpress-{name}"
                todo = [p for p in exported["prompts"] if table.row_key({
                    "haystack": exported["haystack"], "seed": exported["seed"], "question": question_of(mode, p),
                    "policy": policy, "budget": budget, "cache_options": dict(quantized or {}),
                    "task": p["task"], "context": p["context"], "sample": p["sample"], **several_questions(p)}) not in done]
                if not todo:
                    continue
                attention = "eager" if name == "observed" else "sdpa"  # ObservedAttention needs the weights
                if attention not in models:
                    models[attention] = load(model_path, attention)
                model, tokenizer = models[attention]
                press = make_press(name, round(1.0 - budget, 6))
                found = []
                for prompt in todo:
                    start, held = time.perf_counter(), [] if quantized else None
                    answer = answer_one(model, tokenizer, press, prompt, mode, prompt["max_new_tokens"], quantized, held)
                    bytes_held = {"kv_share_16bit": round(held[0], 4)} if held else {}
                    found += longctx_rows(exported, [prompt], [answer], policy, budget, mode,
                                          time.perf_counter() - start, quantized, **bytes_held)
                    rows = table.merge_rows(rows, found[-1:])
                    if out:
                        table.write_rows(rows, out)
                print(f"{policy} @ {budget:g} ({QUESTION_OF_MODE[mode]}): mean score "
                      f"{100 * sum(r['score'] for r in found) / len(found):.1f} ({sum(r['seconds'] for r in found):.0f} s)",
                      flush=True)
    return rows


QUANTIZED_BACKENDS = ("quanto", "hqq")


def parse_quantized(text: str | None) -> list[dict | None]:
    """``--quantized-cache quanto:2,quanto:4`` -> QuantizedCache keywords per run; none given: one
    run on the plain cache."""
    if not text:
        return [None]
    runs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        backend, _, bits = part.partition(":")
        if backend not in QUANTIZED_BACKENDS or bits not in ("2", "4", "8"):
            raise SystemExit(f"run_kvpress: --quantized-cache takes BACKEND:BITS ({', '.join(QUANTIZED_BACKENDS)}; "
                             f"2, 4 or 8), got {part!r}")
        runs.append({"backend": backend, "nbits": int(bits), "q_group_size": 64, "residual_length": 128})
    return runs


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="JSON written by h2okv eval retrieval/longctx --export-prompts")
    parser.add_argument("--presses", default="knorm,tova", help=f"comma-separated, of: {', '.join(PRESSES)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODE_OF_NAME)} (aware = question-compressed, "
                        "agnostic = question-out)")
    parser.add_argument("--budgets", default=None, help="kept fractions (default: the export's budgets)")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the export's model)")
    parser.add_argument("--compression-interval", type=int, default=1,
                        help="reasoning exports: DecodingPress compresses every N decode steps (default: 1)")
    parser.add_argument("--quantized-cache", default=None, metavar="BACKEND:BITS,...",
                        help="longctx exports: run every press again on transformers' QuantizedCache, e.g. "
                             "quanto:2,hqq:4 (groups of 64, a float residual of 128 tokens; needs optimum-quanto or hqq)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", required=True, help="output rows")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    exported = json.loads(Path(args.prompts).read_text())
    if exported.get("format") not in (EXPORT_FORMAT, LONGCTX_FORMAT, REASONING_FORMAT):
        raise SystemExit(f"run_kvpress: {args.prompts} is not an {EXPORT_FORMAT}, {LONGCTX_FORMAT} or "
                         f"{REASONING_FORMAT} export")
    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    if exported["format"] == REASONING_FORMAT:
        return main_reasoning(args, exported, presses)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [p for p in presses if p not in PRESSES]:  # fail before any model is loaded
        raise SystemExit(f"run_kvpress: unknown press(es) {unknown}; known: {', '.join(PRESSES)}")
    if unknown := [m for m in modes if m not in MODE_OF_NAME]:
        raise SystemExit(f"run_kvpress: unknown mode(s) {unknown}; known: {', '.join(MODE_OF_NAME)}")
    modes = list(dict.fromkeys(MODE_OF_NAME[m] for m in modes))
    if args.quantized_cache and exported["format"] != LONGCTX_FORMAT:
        raise SystemExit("run_kvpress: --quantized-cache runs on longctx exports")
    parse_quantized(args.quantized_cache)  # a bad spelling fails before any model is loaded
    budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else exported["budgets"]
    if args.threads:
        torch.set_num_threads(args.threads)
    if exported["format"] == LONGCTX_FORMAT:  # writes (and resumes) args.json as it goes
        models = {}
        for quantized in parse_quantized(args.quantized_cache):
            rows = run_longctx(exported, presses, modes, budgets, args.model or exported["model"], models=models,
                               out=args.json, quantized=quantized)
    else:
        rows = run(exported, presses, modes, budgets, args.model or exported["model"])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {len(rows)} rows to {args.json}")
    return 0


def main_reasoning(args, exported: dict, scorers: list[str]) -> int:
    decoding = load_by_path("decoding_kvpress", Path(__file__).resolve().parent)
    if unknown := [s for s in scorers if s not in decoding.SCORERS]:  # fail before any model is loaded
        raise SystemExit(f"run_kvpress: unknown decoding scorer(s) {unknown}; known: {', '.join(decoding.SCORERS)}")
    if args.compression_interval < 1:
        raise SystemExit(f"run_kvpress: --compression-interval must be >= 1, got {args.compression_interval}")
    try:
        budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else exported["budgets"]
    except ValueError:
        raise SystemExit(f"run_kvpress: --budgets {args.budgets!r}: DecodingPress takes slot counts") from None
    budgets = decoding.check_budgets(budgets)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        exported = {**exported, "model_path": args.model}
    piece = decoding.run_reasoning(exported, scorers, budgets, args.compression_interval, load, {}, out=args.json)
    print(f"{len(piece['rows'])} rows in {args.json}: grade and merge them with `h2okv eval reasoning-report`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
