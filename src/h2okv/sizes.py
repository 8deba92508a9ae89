"""Byte sizes as people write them (``2147483648``, ``512M``, ``2G``, ``2GiB``, ``1.5M``; binary
units): the command line's ``--kv-memory`` and ``--prefix-cache-memory``, and tools that start a
server with them. Torch-free and CLI-free, so any module may parse one."""

from __future__ import annotations

import argparse
import re

_BYTE_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_BYTE_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(?:I?B)?|B)?")


def has_byte_unit(text: str) -> bool:
    """``4MiB``, ``512K``, ``100B``: a size written with a unit (a bare number is not: it may be a count)."""
    match = _BYTE_SIZE.fullmatch(str(text).strip().upper())
    return match is not None and match.group(0) != match.group(1)


def parse_bytes(text: str) -> int:
    """``2147483648``, ``2G``, ``2GB``, ``2GiB``, ``512M``, ``1.5M`` -> bytes (see the module doc)."""
    match = _BYTE_SIZE.fullmatch(str(text).strip().upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a byte size like 2147483648, 512M or 2G (binary units), got {text!r}")
    value = int(float(match.group(1)) * _BYTE_SCALE[match.group(2) or ""])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive byte size, got {text!r}")
    return value
