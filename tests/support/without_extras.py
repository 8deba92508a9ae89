"""A fresh interpreter in which some modules are not installed (tests/package/test_packaging.py,
tests/package/test_readme_examples.py)."""

import subprocess
import sys
from pathlib import Path

from h2okv import extras

ROOT = Path(__file__).resolve().parents[2]

# the extras' modules and the packages only they bring in (fastapi's starlette and pydantic,
# lm-eval's datasets, evaluate and sacrebleu), and triton (the triton extra)
EXTRA_ONLY = sorted({m for modules in extras.MODULES.values() for m in modules}
                    | {"starlette", "pydantic", "datasets", "evaluate", "sacrebleu", "triton"})

# Run first in a fresh interpreter: the top-level modules named in argv[1] are not found, as if not
# installed. Each import finder is wrapped rather than one that raises put first, so that
# `importlib.util.find_spec` answers None for them, as transformers' and torch's probes expect.
HIDE = """
import sys

HIDDEN = set(sys.argv[1].split(","))


class Hidden:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [Hidden(finder) for finder in sys.meta_path]
"""


def run_without(modules, code: str, *argv: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter in which ``modules`` are not installed; ``argv`` follows in sys.argv[2:]."""
    return subprocess.run([sys.executable, "-c", HIDE + code, ",".join(modules), *argv], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
