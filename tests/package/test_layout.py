"""The shape of the package, read from the source files: who may import whom, no import circle,
and a command line whose parser loads no heavy library."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "h2okv"
# what runs inside a server or a generation: it must not depend on test fixtures or tools
RUNTIME = ("h2okv.core", "h2okv.policies", "h2okv.serve", "h2okv.parallel", "h2okv.models", "h2okv.generation")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """Every h2okv module ``path`` imports, at the top or inside a function: ``from h2okv.eval
    import offline`` names the module ``h2okv.eval.offline``, ``from h2okv.eval.ppl import ppl_grid``
    the module ``h2okv.eval.ppl``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {name for name in found if name == "h2okv" or name.startswith("h2okv.")}


# a module importing itself is no circle (lm_eval_model does, run as __main__, to register its class once)
GRAPH = {name: imported_modules(path) - {name} for name, path in MODULES.items()}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_graph_is_read_from_the_sources():
    # a check that finds nothing proves nothing: these edges exist and must be seen
    assert "h2okv.eval.ppl" in GRAPH["h2okv.cli.eval.ppl"]  # inside a function
    assert "h2okv.cli.args" in GRAPH["h2okv.cli.eval.ppl"]  # at the top
    assert "h2okv.eval.offline" in GRAPH["h2okv.eval.tasks"]  # from a package import a module
    assert len(MODULES) > 60


def test_no_library_module_imports_the_cli():
    offenders = {name: sorted(m for m in deps if within(m, "h2okv.cli"))
                 for name, deps in GRAPH.items() if not within(name, "h2okv.cli")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_runtime_module_imports_the_tools():
    offenders = {name: sorted(m for m in deps if within(m, "h2okv.tools"))
                 for name, deps in GRAPH.items() if any(within(name, r) for r in RUNTIME)}
    assert {k: v for k, v in offenders.items() if v} == {}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (``[a, b, ..., a]``), or None: a depth-first search over the modules."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle():
    assert find_cycle(GRAPH) is None


@pytest.mark.parametrize("code", [
    "import h2okv",
    "import h2okv; from h2okv.cli.main import build_parser; build_parser()",
])
def test_help_loads_no_heavy_library(code):
    """``h2okv --help`` stays fast because building the parser imports neither torch nor
    transformers nor lm-eval: they load in the subcommands' run functions."""
    check = f"{code}; import json, sys; print(json.dumps([m for m in ('torch', 'transformers', 'lm_eval', 'fastapi') if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC), "PATH": ""})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
