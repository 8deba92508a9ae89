"""RULER's metric, with no dependency beyond the standard library: ``tools/peer/run_kvpress.py``
runs in kvpress's own venv, where h2okv is not installed, and loads this very file by path, so the
two sides of a comparison are scored by one definition.

A sample's score is in [0, 1]; RULER reports the mean over samples x 100.

- ``string_match_all`` (every synthetic task): the share of the reference strings found in the
  prediction, case-insensitively;
- ``string_match_part`` (RULER's QA): 1 when any reference is found.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str) -> str:
    """RULER's post-processing: strip, and control characters become line breaks."""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    found = clean_prediction(prediction).lower()
    return sum(ref.lower() in found for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    found = clean_prediction(prediction).lower()
    return float(any(ref.lower() in found for ref in references))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(metric: str, prediction: str, references: list[str]) -> float:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    if not references:
        raise ValueError("a sample needs at least one reference string")
    return METRICS[metric](prediction, references)
