"""A GGUF model dequantized once into a plain checkpoint folder (safetensors + tokenizer) that later
loads read directly: loading from the GGUF dequantizes every time, which is slow.

A folder is trusted only for what made it. A tokenizer that one transformers version saved was seen
loading wrongly under another (5.2 -> 5.23 put token id 0 between words), so the folder's name holds
the transformers version and our conversion format (h2okv.paths.converted_dir), and a manifest
written last, inside the temporary folder, records the same key. A folder whose manifest is missing
or differs (left by an older h2okv, copied, renamed or half-written by hand) is converted again.
The finished folder appears in one rename, so an interrupted conversion never leaves a folder that
is later trusted. Processes that need the same folder convert one at a time (a lock file beside it):
dequantizing the 1.5B model takes ~14 GB, and two at once were seen killed for memory on 24 GB.

A user's own GGUF (``--model my.gguf``, ``user=True`` here) is cached the same way, in a folder of
its own per resolved path, and its key adds that path and the file's modification time: a file
rewritten in place, even at the same size, is converted again, never served from a stale folder.
Its conversion for an older size of the file is removed then.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from h2okv import paths

# bump when the folder's contents change meaning (what is saved, or how): older folders are then
# converted again instead of trusted (1 was the unversioned ``<stem>-<size>`` layout)
FORMAT_VERSION = 2
MANIFEST = "h2okv-conversion.json"
# without the lock (no fcntl), a temporary folder this old was abandoned (a killed process); a live
# conversion writes into its folder within minutes (the 0.5B Qwen takes ~200 s in all)
ABANDONED_AFTER_S = 6 * 3600


def transformers_version() -> str:
    from transformers import __version__

    return __version__


def conversion_key(gguf: Path, user: bool = False) -> dict:
    """What a converted folder depends on; a folder is reused only when its manifest holds this.
    ``user``: a user's file, which may change in place, so its path and mtime count too."""
    stat = gguf.stat()
    key = {"format": FORMAT_VERSION, "gguf": gguf.name, "gguf_bytes": stat.st_size,
           "transformers": transformers_version()}
    if user:
        key |= {"gguf_path": str(gguf.resolve()), "gguf_mtime_ns": stat.st_mtime_ns}
    return key


def converted_folder(gguf: Path, user: bool = False) -> Path:
    return paths.converted_dir(gguf, transformers_version(), FORMAT_VERSION, user=user)


def untrusted_reason(folder: Path, key: dict) -> str | None:
    """None when ``folder`` is a finished conversion made for ``key``; else why it is not."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (unfinished, or not made by this h2okv)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    made_for = manifest.get("key") if isinstance(manifest, dict) else None
    if made_for != key:
        return f"made for {made_for}, need {key}"
    return None


def trusted_folder(gguf: Path, user: bool = False) -> Path | None:
    """The converted folder for ``gguf`` if a trusted one exists (nothing is converted)."""
    folder = converted_folder(gguf, user)
    return folder if untrusted_reason(folder, conversion_key(gguf, user)) is None else None


def ensure_converted(gguf: Path, user: bool = False) -> Path:
    """The trusted converted folder for ``gguf``, converting it first (one line on stderr) if needed.
    ``user``: a user's own file (see the module's note)."""
    folder, key = converted_folder(gguf, user), conversion_key(gguf, user)
    reason = untrusted_reason(folder, key)
    if reason is None:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _one_at_a_time(folder, gguf.name) as exclusive:
        reason = untrusted_reason(folder, key)
        if reason is None:  # another process finished it while this one waited
            return folder
        _convert(gguf, folder, key, reason, exclusive)
    if user:
        _remove_older_sizes(folder)
    return folder


@contextlib.contextmanager
def _one_at_a_time(folder: Path, name: str):
    """Hold the lock of ``folder``'s conversion (a file beside it); say so when waiting for it.
    Yields whether the lock is held: without ``fcntl`` (Windows) conversions are not serialized,
    and the rename alone keeps them safe."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(folder.with_name(f".lock-{folder.name}"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"h2okv: waiting for another process converting {name}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(gguf: Path, folder: Path, key: dict, reason: str, exclusive: bool = False) -> None:
    """Dequantize ``gguf`` into a temporary folder and publish it as ``folder``; ``exclusive``: this
    process holds the conversion's lock, so any temporary folder of it is a killed one's."""
    why = f"replacing {folder}: {reason}" if folder.exists() else f"saving it in {folder}"
    print(f"h2okv: converting {gguf.name} once for transformers {key['transformers']} ({why})", file=sys.stderr)
    _remove_abandoned(folder, every=exclusive)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".convert-{folder.name}-"))
    try:
        write_plain_checkpoint(gguf, tmp)
        # the manifest last: a folder that has one holds everything
        (tmp / MANIFEST).write_text(json.dumps({"key": key, "versions": _versions()}, indent=1) + "\n")
        _publish(tmp, folder, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def _remove_older_sizes(folder: Path) -> None:
    """Delete conversions of a user's file at another size, by this transformers and format: the
    folder of each file path holds one file's conversions, and the file has changed since."""
    suffix = folder.name[folder.name.rindex("-transformers-"):]
    for other in folder.parent.iterdir():
        if other != folder and not other.name.startswith(".") and other.name.endswith(suffix):
            shutil.rmtree(other, ignore_errors=True)


def _remove_abandoned(folder: Path, every: bool = False) -> None:
    """Delete temporary folders that a killed conversion of ``folder`` left (never trusted, but large):
    the old ones, or ``every`` one when no other conversion of it can be running (the lock is ours)."""
    cutoff = time.time() - ABANDONED_AFTER_S
    for prefix in (".convert-", ".stale-"):
        for leftover in folder.parent.glob(f"{prefix}{folder.name}-*"):
            try:
                if every or leftover.stat().st_mtime < cutoff:
                    shutil.rmtree(leftover, ignore_errors=True)
            except OSError:  # another process removed it first
                pass


def _publish(tmp: Path, folder: Path, key: dict) -> None:
    """Move the finished ``tmp`` to ``folder`` in one rename, replacing an untrusted folder there."""
    try:
        os.replace(tmp, folder)
        return
    except OSError:
        if untrusted_reason(folder, key) is None:  # another process finished the same conversion first
            return
    stale = folder.with_name(f".stale-{folder.name}-{uuid.uuid4().hex[:8]}")
    os.replace(folder, stale)
    try:
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def _versions() -> dict:
    """Library versions recorded for a reader of the manifest (the key decides reuse)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "gguf"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def write_plain_checkpoint(gguf: Path, folder: Path) -> None:
    """Dequantize ``gguf`` and save float32 safetensors, config and tokenizer into ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
