"""One batch of answers in a process of its own, so that its peak memory is its own.

A grid's process measures each batch's peak as the RSS high-water mark above what it held just
before (``bench.memory.measure_peak``). What that reads depends on what the process allocated
and freed before: the same code and prompt read 75-103 MiB late in a long grid and 366-463 MiB
in a fresh process (docs/RESULTS.md, Known misses), since the allocator hands back, or keeps,
earlier pages by its own rules. A fresh process has one history, always the same (start, load
the model, one warm-up forward, one short answer under the configuration: ``runner.warm_config``),
so its peak compares across runs, recipes and code versions.

A fresh process alone is not enough: glibc's malloc serves a block from its heap or maps it on
its own by a threshold it raises as big blocks are freed (up to 32 MiB), and which blocks stay in
the heap, fragmenting it, depends on timing (threads load the weights). The same prompt in two fresh
processes read 277 and 140 MiB (the default model, h2o, 1k tokens). So the child runs malloc with
a fixed threshold of 128 KiB and one arena: every tensor's block is mapped on its own and handed
back when freed, and the RSS follows live memory. Measured (the default model, 2k, two runs each):
full 131.0 / 130.9 MiB, h2o 83.3 / 83.2, against 142-216 and 428-600 under malloc's defaults. The
price is time: a mapped block is zero-filled on each first touch, so prefill reads 1.2-1.5x slower
here. Take times from a run without ``--fresh-process``; take peaks from one with it.

The child is *spawned* (a fork would inherit the parent's heap, which is the history we want
gone), loads the model itself with the run's arguments (``runner.answer_loaded``), answers one
batch and returns the answers, their costs and the cache's settings. It costs a model load per
batch (seconds for the 0.5B), so it is opt-in: ``h2okv eval longctx --fresh-process``.
"""

from __future__ import annotations

import multiprocessing
import traceback
from dataclasses import dataclass

from h2okv.environment import environment
from h2okv.errors import H2OError

# glibc reads these when a process starts: blocks of 128 KiB and more mapped on their own (a fixed
# threshold, which glibc then never raises) and one arena, so freed tensors leave the RSS at once
EXACT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "MALLOC_ARENA_MAX": "1"}


@dataclass(frozen=True)
class ModelLoad:
    """How a fresh process loads the grid's model: ``h2okv.models.load_model``'s arguments and
    the torch threads, as the parent's command line gave them."""

    name: str | None
    device: str = "cpu"
    dtype: str | None = None
    threads: int | None = None


def in_fresh_process(function, *args):
    """``function(*args)`` in a spawned process with ``EXACT_MALLOC``, which exits after it; its
    error, if any, is raised here (a bug's with the child's traceback as a note)."""
    spawn = multiprocessing.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)  # a pipe, not a pool: nothing left for the resource tracker
    child = spawn.Process(target=_call, args=(send, function, args), daemon=True)
    with environment(EXACT_MALLOC):  # the child's environment is this one's at its start
        child.start()
    send.close()
    try:
        ok, value, trace = receive.recv()
    except EOFError:  # killed (out of memory, a signal) before it could answer
        child.join()
        raise H2OError(f"the fresh process ended without an answer (exit code {child.exitcode})") from None
    finally:
        receive.close()
    child.join()
    if ok:
        return value
    if not isinstance(value, H2OError):
        value.add_note(f"in the fresh process:\n{trace}")
    raise value


def _call(send, function, args) -> None:
    try:
        send.send((True, function(*args), None))
    except BaseException as exc:  # every failure goes back to the parent, which raises it
        send.send((False, exc, traceback.format_exc()))
    finally:
        send.close()
