"""Memory measurement for the benchmark: peak memory of a piece of work, and KV-cache sizes.

CPU: torch has no allocator statistics for host memory, and ``tracemalloc`` does not see torch's
buffers, so we measure the process's resident set (RSS). To make a peak *of this work* honest in a
process that has already run other work: freed heap is first handed back to the OS
(``malloc_trim``) so it cannot be reused silently, the baseline is the RSS right before the work,
and the kernel's high-water mark (VmHWM) is reset (``/proc/self/clear_refs``, Linux >= 4.0) so it
covers this work only. Where that reset is unavailable a sampling thread polls RSS every
millisecond instead (a lower bound: it can miss a spike shorter than that).

CUDA: ``torch.cuda.max_memory_allocated`` above the allocation at the start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch

from h2okv.byte_budget import Geometry

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()


def release_free_heap() -> None:
    """Collect garbage and give freed heap pages back to the OS, so RSS reflects live memory."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def current_rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def _read_hwm() -> int | None:
    try:
        with open(_STATUS) as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class _Sampler(threading.Thread):
    def __init__(self, interval: float = 0.001):
        super().__init__(daemon=True)
        self.interval, self.peak, self._stop_event = interval, 0, threading.Event()
        self._proc = psutil.Process(os.getpid())

    def run(self):
        while not self._stop_event.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return max(self.peak, self._proc.memory_info().rss)


@dataclass
class PeakMemory:
    """Filled in when the ``measure_peak`` block ends: ``peak_bytes`` above ``baseline_bytes``."""

    method: str = ""
    baseline_bytes: int = 0
    peak_bytes: int = 0  # growth above the baseline at the worst moment of the block


@contextmanager
def measure_peak(device: torch.device | str = "cpu"):
    """``with measure_peak(dev) as mem: work()`` then ``mem.peak_bytes``."""
    device = torch.device(device)
    result = PeakMemory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        result.method = "cuda_max_memory_allocated"
        result.baseline_bytes = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result.peak_bytes = max(0, torch.cuda.max_memory_allocated(device) - result.baseline_bytes)
        return
    release_free_heap()
    result.baseline_bytes = current_rss()
    sampler = None
    if _reset_hwm() and _read_hwm() is not None:
        result.method = "rss_hwm_delta"
    else:
        result.method = "rss_sampled_delta"
        sampler = _Sampler()
        sampler.start()
    try:
        yield result
    finally:
        peak = sampler.stop() if sampler is not None else _read_hwm()
        result.peak_bytes = max(0, int(peak) - result.baseline_bytes)


# -- KV-cache sizes -------------------------------------------------------------------------------
def kv_geometry(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder model's attention."""
    geometry = Geometry.of(model.config)
    return geometry.layers, geometry.kv_heads, geometry.key_dim


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take across all layers (one sequence)."""
    layers, kv_heads, head_dim = kv_geometry(model)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def cache_kv_bytes(cache) -> int:
    """Bytes of key/value tensors a cache holds right now (``DynamicCache`` or ``H2OCache``)."""
    if hasattr(cache, "stats") and hasattr(cache, "policy"):
        return int(cache.stats()["kv_bytes"])
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
