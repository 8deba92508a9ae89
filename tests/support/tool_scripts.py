"""The repository's scripts under tools/ (run by path, not installed) loaded as modules for tests."""

import importlib.util
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(relative: str):
    """``tools/<relative>`` (e.g. ``peer/run_kvpress.py``) as a fresh module."""
    path = TOOLS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
