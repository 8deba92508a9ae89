"""Environment variables for the processes a block starts, restored after it."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set inside the block, as it was after: a spawned process
    reads the environment when it starts, so a child gets settings this process does not keep."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
