"""Text to evaluate on (``eval ppl``, ``analyze``): a file, a Hugging Face dataset or a play of the
offline corpus, cut into token windows."""

from __future__ import annotations

import torch

from h2okv.corpus import DEFAULT_PLAY, read_play, read_text_source
from h2okv.errors import H2OError, first_line


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
        raise H2OError(f"cannot load dataset {spec!r}: {first_line(exc)}") from None
    if split is None:
        split = "test" if "test" in loaded else next(iter(loaded))
    if split not in loaded:
        raise H2OError(f"dataset {spec!r} has no split {split!r}; it has {', '.join(loaded)}")
    part = loaded[split]
    if column not in part.column_names:
        raise H2OError(f"dataset {spec!r} has no {column!r} column; it has {', '.join(part.column_names)}")
    return "\n".join(t for t in part[column] if t)


def source_text(text: str | None = None, corpus: str | None = None, dataset: str | None = None,
                split: str | None = None) -> tuple[str, str]:
    """``(text, label)`` from a text file, a dataset or a corpus play (default: Hamlet); the
    command line's ``--text`` / ``--corpus`` / ``--dataset`` / ``--split``."""
    if text is not None:
        return read_text_source(text), text
    if dataset is not None:
        return load_dataset_text(dataset, split), dataset
    corpus = corpus or f"shakespeare:{DEFAULT_PLAY}"
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
