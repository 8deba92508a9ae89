"""Argument types and argument groups that several subcommands share.

Only argparse and light modules are imported here: every subcommand registers its parser on each
``h2okv`` call, ``--help`` included, so torch and the rest load inside the run functions.

Byte sizes (``--memory-cap``, ``--kv-memory``) have one rule: a plain integer is bytes; ``K``,
``M``, ``G``, ``T`` are binary (2^10, 2^20, 2^30, 2^40), with or without ``B`` or ``iB`` after
them, in any case: ``2G`` == ``2GB`` == ``2GiB`` == 2 * 2^30; fractions such as ``1.5M`` are
allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from h2okv.corpus import DEFAULT_PLAY
from h2okv.errors import H2OError
from h2okv.parallel.launch import DEFAULT_TIMEOUT_S
from h2okv.policy_names import POLICY_NAMES, RECONSTRUCTION_POLICIES
from h2okv.recipes import recipe_help
from h2okv.settings import CODING_FIELDS, PART_NAMES, CacheSettings
from h2okv.sizes import parse_bytes


# -- help -----------------------------------------------------------------------------------------
def examples(*commands: str) -> str:
    """A subcommand's epilog: real command lines, shown as written at the end of its ``--help``
    (tests/cli/test_parsers.py parses each one)."""
    return "examples:\n" + "\n".join(f"  {command}" for command in commands)


def sort_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """List ``subparsers``' commands by name in ``--help`` (they register in module order)."""
    subparsers._choices_actions.sort(key=lambda action: action.dest)
    subparsers.choices = dict(sorted(subparsers.choices.items()))


# -- types: a value or a one-line error ------------------------------------------------------------
def _positive(text: str, convert, noun: str):
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive {noun}, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive {noun} (> 0), got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _positive(text, int, "integer")


def positive_float(text: str) -> float:
    return _positive(text, float, "number")


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    """A nucleus mass: (0, 1]."""
    value = _positive(text, float, "number")
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    return _positive(text, float, "number of seconds")


def int_list(text: str) -> list[int]:
    """``1,8`` -> [1, 8], in the order given."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def memory_limit(text: str) -> int | None:
    """A byte size, or ``inf`` for no limit (None)."""
    return None if str(text).strip().lower() in ("inf", "infinity") else parse_bytes(text)


def store_size(text: str) -> int:
    """A byte size, or ``0`` / ``off`` for none (a store that is on by default can be turned off)."""
    return 0 if str(text).strip().lower() in ("0", "off") else parse_bytes(text)


# -- lists checked before any model work -----------------------------------------------------------
def parse_policies(text: str, reconstruction: bool = False) -> list[str]:
    """``full,h2o,snapkv:16`` -> names, duplicates dropped; one-line error for a bad name or option.

    A part with ``=`` and no ``:`` continues the policy before it, so a policy with several options
    fits in the list: ``h2o,snapkv:window=1,kernel=1,heads=shared`` is two policies."""
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if specs and "=" in part and ":" not in part:
            specs[-1] += "," + part
        elif part:
            specs.append(part)
    names = [check_policy(spec, reconstruction) for spec in specs]
    if not names:
        raise H2OError("--policies is empty; give e.g. full,h2o,local")
    return list(dict.fromkeys(names))


def check_policy(name: str, reconstruction: bool = False) -> str:
    """``name`` if it is a known policy with valid options (``snapkv:window=16``), else a one-line
    error; a policy that ranks by reconstruction (``kvzip``) only where the command runs that pass."""
    from h2okv.policies import make_policy, refuse_reconstruction

    make_policy(name)  # builds it: the policy checks its own options
    if not reconstruction:
        refuse_reconstruction(name, "this command")
    return name


def parse_budgets(text: str) -> list[float]:
    """Comma-separated cache budgets as fractions of the text, each in (0, 1]."""
    budgets = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise H2OError(f"budget {part!r} is not a number; give fractions like 0.1,0.2") from None
        if not (0.0 < value <= 1.0):
            raise H2OError(f"budget {part} must be a fraction of the text in (0, 1]")
        budgets.append(value)
    if not budgets:
        raise H2OError("--budgets is empty; give fractions like 0.1,0.2")
    return sorted(set(budgets))


def slots_or_fraction(text: str, min_slots: int) -> int | float | None:
    """One budget as typed: an integer >= ``min_slots`` is slots per layer and KV head, a number
    with a point in (0, 1] a fraction of the prompt; None for anything else."""
    if text.isdigit():
        return int(text) if int(text) >= min_slots else None
    try:
        value = float(text) if "." in text else None
    except ValueError:
        return None
    return value if value is not None and 0.0 < value <= 1.0 else None


def parse_kv_budgets(text: str) -> list[int | float]:
    """Comma-separated budgets, each either slots per layer and KV head (an integer >= 2: ``128``)
    or a fraction of each prompt (a number with a point, in (0, 1]: ``0.25``); both may be mixed."""
    budgets = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        value = slots_or_fraction(part, min_slots=2)
        if value is None:
            raise H2OError(f"budget {part!r}: give slots per layer and head (an integer >= 2, e.g. 128) "
                           "or a fraction of the prompt with a point (e.g. 0.25)")
        budgets.append(value)
    if not budgets:
        raise H2OError("--budgets is empty; give e.g. 64,128,256,512 (slots) or 0.1,0.2 (fractions)")
    return sorted(set(budgets), key=lambda b: (isinstance(b, int), b))


# -- argument groups -------------------------------------------------------------------------------
def add_model_args(parser: argparse.ArgumentParser, device: bool = True) -> None:
    parser.add_argument("--model", default=None, help="HF id, local directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    if device:
        parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
        parser.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")


# the flags of a budget, in the order --help lists them (each generated from its CacheSettings field)
BUDGET_FLAGS = ("budget", "bytes", "recent_share", "budget_floor", "heavy", "recent", "heavy_ratio", "recent_ratio", "chunk_size")


def add_cache_args(parser: argparse.ArgumentParser, names, **overrides: dict) -> None:
    """One flag per ``CacheSettings`` field in ``names``, built from the field (its help, how its
    text is read, its choices), so a setting is declared once. A flag not given is None (the
    recipe's or the field's default applies: ``cache_keywords``). ``overrides[name]`` replaces
    argparse keywords of one flag where a command means something of its own (``serve``'s chunk)."""
    fields = {f.name: f for f in dataclasses.fields(CacheSettings)}
    for name in names:
        meta = fields[name].metadata
        shown = str(meta.get("shown", fields[name].default)).lower()
        recipe = ", or the recipe's" if meta["recipe_sets"] else ""
        kwargs = {"default": None, "help": f"{meta['help']} (default: {shown}{recipe})"}
        kind = meta["kind"]
        if kind == "switch":
            kwargs = {**kwargs, "action": "store_true"}
        elif kind == "choice":
            kwargs["choices"] = meta["choices"]
        else:
            kwargs["type"] = FLAG_TYPES.get(kind, str)
        kwargs.update(overrides.get(name, {}))
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def add_budget_args(parser: argparse.ArgumentParser, policy_default: str = "h2o", reconstruction: bool = False) -> None:
    """``reconstruction``: the command runs ``kvzip``'s pass (``serve``), so its help lists it."""
    names = [p for p in POLICY_NAMES if reconstruction or p not in RECONSTRUCTION_POLICIES]
    parser.add_argument("--policy", default=None, help=f"one of {', '.join(names)}, options after a colon, e.g. snapkv:window=16 (default: {policy_default}, or the recipe's)")
    add_recipe_arg(parser)
    add_cache_args(parser, BUDGET_FLAGS)


def budget_from_args(args) -> dict:
    """The older spelling of a budget (``--heavy``/``--recent``/``--heavy-ratio``/``--recent-ratio``)."""
    return {name: getattr(args, name) for name in PART_NAMES}


def cache_keywords(args) -> dict:
    """``CacheSettings``' keywords from the flags ``add_budget_args`` and ``add_cache_args`` made,
    only those given (a recipe fills the rest)."""
    given = {name: getattr(args, name, None) for name in ("policy", "recipe", *CACHE_FLAG_NAMES)}
    # an unset switch (--protect-prompt) is False: not given either (0 is a value: --budget 0 is refused)
    return {key: value for key, value in given.items() if value is not None and value is not False}


def recent_share(text: str) -> float:
    """A share of the budget in [0, 1] (``--recent-share``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1], got {text!r}")
    return value


def add_recipe_arg(parser: argparse.ArgumentParser, grid: bool = False) -> None:
    """``--recipe``: a name for the best configuration we measured for a use (``h2okv.recipes``);
    a grid (``grid``) takes several, run beside ``--policies``."""
    what = "comma-separated recipes run beside --policies (which then defaults to full)" if grid else \
        "the measured best configuration for a use; --policy and the other flags given replace its parts"
    parser.add_argument("--recipe", default=None, metavar="NAME" + (",..." if grid else ""),
                        help=f"{what}: {recipe_help()}")


def parse_budget(text: str) -> float | int | str:
    """``--budget`` as typed: an integer (``256``) is slots per layer and KV head, any other number
    (``0.2``) a fraction of the prompt. Its range is the policy's to judge (``CacheSettings``,
    before any model loads), so anything else is handed on as text and refused there, in one
    message that names the range."""
    text = str(text).strip()
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def add_budget_shape_args(parser: argparse.ArgumentParser, prefill: bool = True, layers: bool = False) -> None:
    """How a ``--budgets`` fraction is spent (``--recent-share``) and, where prompts are read in
    forward calls of several tokens, when they are ranked (``--prefill``); ``layers``: the command
    runs ``kvzip``, whose cache-wide split ``--head-budgets layers`` then offers. The flags are
    ``add_cache_args``' with a grid's own defaults."""
    share = {"default": 0.5, "help": "share of each budget kept for the most recent tokens, the rest ranked by the "
                                     "policy (default: 0.5, the paper's half and half; e.g. 0.05)"}
    if not prefill:
        add_cache_args(parser, ["recent_share"], recent_share=share)
        return
    splits = ("uniform", "adaptive", "layers") if layers else ("uniform", "adaptive")
    add_cache_args(parser, ["recent_share", "prefill", "head_budgets", "head_floor"], recent_share=share,
                   prefill={"default": "chunked"}, head_budgets={"default": "uniform", "choices": splits})


def add_head_floor_arg(parser: argparse.ArgumentParser) -> None:
    add_cache_args(parser, ["head_floor"])


def shape_from_args(args) -> dict:
    """``new_cache``'s ``recent_share``, ``prefill`` and ``head_budgets`` keywords from
    ``add_budget_shape_args``, and the quantized slots' where a command has their flags."""
    shape = {"recent_share": args.recent_share}
    if getattr(args, "prefill", None) is not None:
        shape["prefill"] = args.prefill
    if getattr(args, "head_budgets", "uniform") != "uniform":
        shape["head_budgets"] = args.head_budgets
    if getattr(args, "head_floor", None) is not None:
        shape["head_floor"] = args.head_floor
    for name in CODING_FIELDS:  # quantized slots (bench --policies)
        if getattr(args, name, None) is not None:
            shape[name] = getattr(args, name)
    return shape


def add_tp_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=positive_int, default=None,
                        help="tensor-parallel ranks: this command starts N processes, each with a slice of every "
                        "layer and its own cache (default 1; under torchrun: its world size)")
    parser.add_argument("--tp-timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds a rank waits for the others in a collective before the run fails (default "
                        f"{DEFAULT_TIMEOUT_S:g}; joining the group at start-up waits at least 120)")


def add_threads_arg(parser, default: int = 1) -> None:
    parser.add_argument(
        "--threads", type=positive_int, default=default,
        help=f"CPU threads for torch (default: {default}); the per-token steps are tiny ops where extra threads cost more than they give",
    )


def apply_threads(threads: int | None) -> None:
    # Measured on the 2-core dev machine (shared with other jobs): a 512-token streaming pass with
    # h2o took 12.7 s with 1 thread and 137 s with 2, because each of the 512 x 30 layer steps is a
    # handful of microsecond-sized ops and OpenMP's synchronisation dominates them.
    if threads:
        import torch

        torch.set_num_threads(threads)


def add_text_args(parser) -> None:
    """Where the text of ``eval ppl`` and ``analyze`` comes from (see ``eval.text.source_text``)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--text", default=None, help="a UTF-8 text file to score")
    group.add_argument(
        "--corpus", default=None, help=f"shakespeare:NAME, a play of the offline corpus (default: shakespeare:{DEFAULT_PLAY}); "
        "shakespeare:all: every play, one after another"
    )
    group.add_argument("--dataset", default=None, help="Hugging Face dataset id[:config] (or local dataset folder); its text column is joined")
    parser.add_argument("--split", default=None, help="dataset split (default: test if present, else the first)")


def text_from_args(args) -> tuple[str, str]:
    """``(text, label)`` of ``add_text_args``' options."""
    from h2okv.eval.text import source_text

    return source_text(text=args.text, corpus=args.corpus, dataset=args.dataset, split=args.split)


# how a generated flag's text is read, by its field's kind (``add_cache_args``)
FLAG_TYPES = {"budget": parse_budget, "bytes": parse_budget, "share": recent_share, "int": int, "float": float, "positive": positive_int}
# the fields a command may take as flags (the rest: a Policy object, the seed that commands' --seed
# means for sampling, compileable that generate's --compile sets)
CACHE_FLAG_NAMES = tuple(f.name for f in dataclasses.fields(CacheSettings) if f.metadata.get("flag", True))
