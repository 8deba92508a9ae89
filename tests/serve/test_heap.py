"""``serve/heap.py``: with glibc's mmap threshold pinned, buffers of about 1 MiB freed and
allocated again in slowly growing sizes (as request bodies, activations and KV caches are) go back
to the OS; with glibc's dynamic threshold they pile up in the heap as free holes between small
long-lived allocations (the soak's RSS growth, issue 20). Each case runs in a fresh interpreter:
the threshold is process-wide and this one's history would decide the outcome."""

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# prints how many MiB the heap (glibc's arenas) grew while large buffers came and went
SCENARIO = """
import ctypes, sys
sys.path.insert(0, {src!r})
from h2okv.serve.heap import pin_mmap_threshold
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if {pin}:
    assert pin_mmap_threshold()
big = bytearray(8 << 20)  # freed: a dynamic threshold rises to 8 MiB
del big
before = libc.mallinfo2().arena
small, bigs = [], []
for i in range(100):
    bigs.append(bytearray((1 << 20) + i * 4096))
    small.append(bytearray(1024))  # outlives the big buffer allocated just before it
    if len(bigs) > 3:
        bigs.pop(0)
print((libc.mallinfo2().arena - before) >> 20)
"""


def heap_growth_mib(pin: bool) -> int:
    script = SCENARIO.format(src=SRC, pin=pin)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    return int(out.stdout.strip())


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc only")
def test_pinned_threshold_returns_freed_large_buffers():
    assert heap_growth_mib(pin=False) >= 5  # the failure mode, so the check below means something
    assert heap_growth_mib(pin=True) <= 1


def test_an_mmap_threshold_from_the_environment_is_left_alone(monkeypatch):
    from h2okv.serve.heap import pin_mmap_threshold

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert pin_mmap_threshold() is False
