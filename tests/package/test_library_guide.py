"""The library guide's document-and-questions example, run as a user would copy it, on the real
default model: every answer names the fact the document plants, under the `document` recipe at the
guide's budget, at a true 20% (no budget floor) and with the full cache."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "guides" / "library.md").read_text(encoding="utf-8")
RECIPE = 'recipe="document", budget=0.2'
FACTS = {"Who designed the library?": "Maria Okafor", "How many books does the library hold?": "86,000",
         "Who is the head librarian?": "Tomas Berg", "What was the most borrowed book last year?": "Bread for Beginners"}


def ask_snippet() -> str:
    return next(block for block in re.findall(r"```python\n(.*?)```", GUIDE, re.S) if "h2okv.ask(" in block)


def answers(snippet: str) -> dict[str, str]:
    ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    assert ran.returncode == 0, ran.stderr[-2000:]
    return dict(line.split(" -> ", 1) for line in ran.stdout.splitlines() if " -> " in line)


@pytest.mark.parametrize("settings", [RECIPE, RECIPE + ", budget_floor=0", 'policy="full"'])
def test_the_guides_document_questions_are_answered_right(settings):
    snippet = ask_snippet()
    assert RECIPE in snippet and "h2okv.load_model()" in snippet  # the default model, the documented recipe
    got = answers(snippet.replace(RECIPE, settings))
    assert set(got) == set(FACTS)
    for question, fact in FACTS.items():
        assert fact in got[question], (settings, question, got[question])
