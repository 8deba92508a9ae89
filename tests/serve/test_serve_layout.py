"""The runtime (``h2okv.serve`` outside ``api/``) knows nothing of HTTP: it neither imports the
HTTP layer nor FastAPI, pydantic, starlette or uvicorn, so the engine runs without a server."""

import subprocess
import sys
from pathlib import Path

import h2okv.serve
from source_imports import imported_modules

SERVE = Path(h2okv.serve.__file__).parent
HTTP = ("h2okv.serve.api", "fastapi", "pydantic", "starlette", "uvicorn")


def test_runtime_modules_do_not_import_http():
    runtime = list(SERVE.glob("*.py"))
    assert {p.name for p in runtime} >= {"engine.py", "scheduler.py", "types.py", "errors.py", "outputs.py"}
    for path in runtime:
        bad = [m for m in imported_modules(path) if m.startswith(HTTP)]
        assert not bad, f"{path.name} imports {bad}"


def test_importing_the_engine_loads_no_web_framework():
    code = ("import sys, h2okv.serve.engine, h2okv.serve.scheduler; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'pydantic', 'starlette', 'uvicorn')"
            " or m.startswith('h2okv.serve.api')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
