"""What a source file imports, read from its syntax tree (nothing is executed): the layout tests
and the peer tests (whose scripts run in a venv without h2okv) check imports this way."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` names in an ``import`` or an absolute ``from ... import``, anywhere
    in the file (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def top_level_imports(path: Path) -> set[str]:
    """The packages behind ``imported_modules``: ``torch.nn`` counts as ``torch``."""
    return {name.split(".")[0] for name in imported_modules(path)}
