"""What installing h2okv gives: the core runs with none of the extras installed, a command without
its extra says which one to install, and the wheel carries the C kernel source and works outside
the repository."""

import email.parser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from h2okv import extras
from without_extras import EXTRA_ONLY, ROOT, run_without

CORE_GENERATION = """
import importlib
import json
import tempfile

import torch

from h2okv import H2OCache, load_model
from h2okv.core.compat import cache_arg
from h2okv.tools.tiny import random_ids, tiny_model, word_tokenizer

with tempfile.TemporaryDirectory() as folder:  # load_model's path for a local checkpoint
    tiny_model("llama").save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    model, _ = load_model(folder, cache=False)
cache = H2OCache(model, policy="h2o", heavy=4, recent=4)
ids = random_ids(24)
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                     do_sample=False, **cache_arg(cache))
blocked = []
for name in HIDDEN:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        blocked.append(name)
print(json.dumps({"new_tokens": out.shape[1] - ids.shape[1], "stats": cache.stats(), "blocked": blocked,
                  "imported": sorted(name for name in sys.modules if name.partition(".")[0] in HIDDEN)}))
"""


def test_the_core_runs_a_cached_generation_with_no_extra_installed():
    done = run_without(EXTRA_ONLY, CORE_GENERATION)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["new_tokens"] == 6
    assert max(result["stats"]["slots"]) == 8  # heavy 4 + recent 4: the budget was kept
    assert result["stats"]["tokens_seen"] > 8
    # the test can fail: every hidden module really was unimportable, and none slipped in
    assert sorted(result["blocked"]) == EXTRA_ONLY
    assert result["imported"] == []


CLI = """
from h2okv.cli import main

sys.exit(main(sys.argv[2:]))
"""


def test_the_command_line_parses_with_no_extra_installed():
    # every subcommand's module is imported to build the parser: none may import an extra as it loads
    done = run_without(EXTRA_ONLY, CLI, "--help")
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and "generate" in done.stdout


@pytest.mark.parametrize("hidden, argv, extra", [
    (["fastapi"], ["serve"], "serve"),
    (["matplotlib"], ["bench", "--quick"], "eval"),
    (["uvicorn"], ["serve-bench"], "serve"),
])
def test_a_command_without_its_extra_says_which_to_install(hidden, argv, extra):
    done = run_without(hidden, CLI, *argv)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"h2okv: error: h2okv {argv[0]} needs the {extra} extra: pip install 'h2okv[{extra}]'"]


def test_h2okv_lm_eval_without_lm_eval_says_which_extra():
    done = run_without(["lm_eval"], "from h2okv.extras import lm_eval_main\nsys.exit(lm_eval_main())")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "h2okv: error: h2okv-lm-eval needs the eval extra: pip install 'h2okv[eval]'"]


def test_an_import_of_an_extra_inside_a_command_becomes_the_same_error():
    # a command not listed in extras.COMMANDS that still reaches an extra's module
    with pytest.raises(extras.MissingExtra, match=r"h2okv x needs the eval extra: pip install 'h2okv\[eval\]'"):
        with extras.needed_by("h2okv x"):
            raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib.pyplot")
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):  # not an extra's: left as it is
        with extras.needed_by("h2okv x"):
            raise ModuleNotFoundError("No module named 'no_such_module'", name="no_such_module")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of the repository's package, built offline from a copy (a build in place would write
    build/ and an egg-info into the working tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (built,) = (tmp / "dist").glob("h2okv-*.whl")
    return built


def test_the_wheel_holds_the_kernel_source_and_lists_the_extras(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(zf.read(metadata).decode())
    assert {"h2okv/__init__.py", "h2okv/core/native/kernels.c", "h2okv/cli/main.py"} <= names
    assert meta["Name"] == "h2okv"
    assert {"serve", "eval", "triton", "all", "test"} <= set(meta.get_all("Provides-Extra"))
    core = {r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip()
            for r in meta.get_all("Requires-Dist") if "extra ==" not in r}
    assert core == {"torch", "transformers", "accelerate", "gguf", "numpy", "tqdm"}
    for name in ("lm-eval", "fastapi", "uvicorn", "matplotlib", "rouge-score", "prometheus-client"):
        assert any(r.startswith(name) and "extra ==" in r for r in meta.get_all("Requires-Dist")), name


def test_the_wheel_installs_and_imports_outside_the_repository(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    code = "import h2okv, pathlib; print(pathlib.Path(h2okv.__file__).parent)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(site)}, check=True)
    package = Path(done.stdout.strip())
    assert package == site / "h2okv"
    assert (package / "core" / "native" / "kernels.c").is_file()
