"""The shape of the package, read from the source files: who may import whom, no import circle,
a command line whose parser loads no heavy library, and no function with a long parameter list."""

import ast
import json
import re
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


# -- parameter lists ----------------------------------------------------------------------------

MAX_PARAMETERS = 10  # more is a settings object's job (CacheSettings, GenerationOptions, GridSpec...)


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters a caller fills in one by one: positional and keyword-only, a method's
    ``self``/``cls`` not counted; ``*args``/``**kwargs`` are not counted either (as ruff's and
    pylint's too-many-arguments): they pass a group through whole."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"]))


def exempt(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel (``@triton.jit``: its arguments are the pointers, strides and constants of
    one launch) and a function that builds argparse parsers (``register``, ``add_*_args``)."""
    kernel = any(ast.unparse(d.func if isinstance(d, ast.Call) else d) == "triton.jit" for d in node.decorator_list)
    return kernel or node.name == "register" or re.fullmatch(r"add_\w+_args", node.name) is not None


def functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function under ``tree``: methods, nested functions and
    functions defined under an ``if`` included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


FUNCTIONS = {f"{name}.{qualname}": node for name, path in MODULES.items()
             for qualname, node in functions(ast.parse(path.read_text(encoding="utf-8")))}


def test_parameter_count_and_exemptions():
    source = """
class A:
    def method(self, a, /, b, *rest, c, **more): ...
    @classmethod
    def build(cls, a): ...
def plain(a, b=1, *, c): ...
@triton.jit
def kernel(A, B): ...
@triton.jit(do_not_specialize=["n"])
def specialized(A, n): ...
@torch.jit.script
def scripted(a): ...
def add_cache_args(parser, names): ...
def add_cache(parser, names): ...
"""
    found = dict(functions(ast.parse(source)))
    assert {name: parameter_count(node) for name, node in found.items()} == {
        "A.method": 3, "A.build": 1, "plain": 3, "kernel": 2, "specialized": 2, "scripted": 1, "add_cache_args": 2,
        "add_cache": 2}
    assert {name for name, node in found.items() if exempt(node)} == {"kernel", "specialized", "add_cache_args"}


def test_the_functions_are_read_from_the_sources():
    # a check that finds nothing proves nothing: methods and kernels are seen, a kernel is exempt
    assert parameter_count(FUNCTIONS["h2okv.core.cache.H2OCache.__init__"]) >= 2
    kernel = FUNCTIONS["h2okv.core.triton_kernels.decode_step_kernel"]
    assert parameter_count(kernel) > MAX_PARAMETERS and exempt(kernel)
    assert len(FUNCTIONS) > 500


def test_no_function_takes_more_than_ten_parameters():
    over = {name: parameter_count(node) for name, node in FUNCTIONS.items()
            if parameter_count(node) > MAX_PARAMETERS and not exempt(node)}
    assert over == {}
