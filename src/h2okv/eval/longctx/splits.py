"""The long-context splits: recipes are chosen on ``dev`` and reported on ``test``.

A number measured on the prompts a recipe was tuned on says how well it was tuned, not how well it
holds for a user's document. The two splits therefore never share a haystack nor a seed (so not a
single needle, key, value or word list), and ``test`` adds lengths ``dev`` never runs:

- ``dev``: the Paul Graham essays, seed 0, 2,048 tokens: the prompts every recipe and option so
  far was chosen on (docs/RESULTS.md's earlier tables); 6,144 (``--contexts``, a length ``test``
  never runs) for choices at long prompts.
- ``test``: CoQA's stories (five genres of prose no recipe saw), seed 1, 2k to 32k tokens.

Tasks that draw no text from the haystack (variable tracking and the single number use RULER's
filler sentences, the word-count families generate their lists) still differ by seed.

The protocol (docs/guides/evaluation.md, "Choosing and reporting"): screen and choose on ``dev``;
run the chosen configuration once on ``test``; quote ``test``; never go back to change a choice
because of a ``test`` number (a change made after looking at ``test`` makes its numbers ``dev``'s).
"""

from __future__ import annotations

from dataclasses import dataclass

from h2okv.errors import H2OError


@dataclass(frozen=True)
class Split:
    name: str
    haystack: str
    seed: int
    contexts: tuple[int, ...]  # the lengths run when --contexts is not given
    use: str


SPLITS = {
    split.name: split
    for split in (
        Split("dev", "essays", 0, (2048,), "choose recipes and options here"),
        Split("test", "stories", 1, (2048, 4096, 8192), "report here, never tune (16k and 32k: --contexts)"),
    )
}


def get_split(name: str) -> Split:
    split = SPLITS.get(name)
    if split is None:
        raise H2OError(f"unknown split {name!r}; choose one of {', '.join(SPLITS)}")
    return split


def split_of(haystack: str, seed: int) -> str | None:
    """The split whose prompts these are, or None for prompts of neither (any other haystack or seed)."""
    return next((s.name for s in SPLITS.values() if (s.haystack, s.seed) == (haystack, seed)), None)
