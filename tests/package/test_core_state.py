"""No module-level mutable state in ``core/``: what the core chooses or loads for a process lives
in one registry with a reset (``core/runtime.py``), everything else a module defines at its top
is a constant (read-only tables: ``MappingProxyType``, tuples)."""

import ast
from pathlib import Path

from h2okv.core import kernels
from h2okv.core.native import build
from h2okv.core.runtime import RUNTIME

CORE = Path(__file__).resolve().parents[2] / "src" / "h2okv" / "core"
# the one registry, and the attention hand-over: a ContextVar (each thread and task its own) and
# the slot torch.compile traces instead (set and taken inside one traced call, core/attention.py)
ALLOWED = {("runtime.py", "RUNTIME"), ("attention.py", "PENDING"), ("attention.py", "_TRACED")}
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "ContextVar", "Runtime", "bytearray"}


def module_state(path: Path) -> list[str]:
    """Names ``path`` binds at its top to a mutable value, and every ``global`` statement in it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [f"global {', '.join(node.names)}" for node in ast.walk(tree) if isinstance(node, ast.Global)]
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        value = node.value
        mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in MUTABLE_CALLS)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        found += [t.id for t in targets if mutable and isinstance(t, ast.Name) and t.id != "__all__"]
    return [name for name in found if (path.name, name) not in ALLOWED]


def test_core_holds_no_module_level_mutable_state():
    offenders = {str(path.relative_to(CORE)): names for path in sorted(CORE.rglob("*.py"))
                 if (names := module_state(path))}
    assert offenders == {}


def test_the_scan_finds_state():
    scratch = CORE.parent.parent.parent / "tests" / "package" / "_scratch_state.py"
    try:
        scratch.write_text("A = []\nB = (1, 2)\nC: dict = {}\ndef f():\n    global A\n", encoding="utf-8")
        assert module_state(scratch) == ["global A", "A", "C"]
    finally:
        scratch.unlink()


def test_the_registry_forgets_what_the_process_chose_or_loaded():
    kernels.set_kernels("eager")
    build.library()  # built, found, or known unbuildable: recorded either way
    assert RUNTIME.kernels == "eager" and build.build_info() is not None
    RUNTIME.reset()
    assert RUNTIME.kernels is None and build.build_info() is None and RUNTIME.native_library is None
    assert kernels.get_kernels() in kernels.KERNELS
