"""Launching a command on N tensor-parallel ranks (``--tp N``, or as one rank under torchrun).

Each rank holds a slice of every layer, loaded by transformers with the model's tp plan, and its
own ``H2OCache``. The cache needs no communication: H2O scores and evicts per KV head, and the tp
plan gives every rank whole KV heads, so each rank evicts its own heads exactly as a single process
would evict them.

A command runs in one of three ways:

- ``--tp 1`` (the default) and no launcher: in this process, as always.
- ``--tp N`` and no launcher: this process starts N ranks on this machine (torch.multiprocessing,
  spawn), watches them, and when one fails stops the others and reports the first failure as one
  line. Only rank 0 writes to the terminal.
- under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment): this process is
  one rank and joins the process group that torchrun's rendezvous describes (``MASTER_ADDR``,
  ``MASTER_PORT``), so the same command spans several machines.

Every collective has a timeout (``--tp-timeout``): a rank that stops answering fails the run
instead of hanging it. The ranks' rendezvous has its own, longer bound (``RENDEZVOUS_MIN_S``): on a
busy machine the ranks may start seconds apart, which a short collective timeout should not fail.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import traceback

from h2okv.environment import environment
from h2okv.errors import H2OError, print_error
from h2okv.parallel.ranks import (
    RankInfo,
    check_tp_model,
    external_rank,
    is_distributed,
    launched_by_torchrun,
    rank_device,
    resolve_tp,
)

DEFAULT_TIMEOUT_S = 600.0
_ECHO_GRACE_S = 3.0


# -- before any rank starts ------------------------------------------------------------------------
def prepare(args) -> int:
    """Resolve ``args.tp`` and, for more than one rank, check the model shards (a config read,
    before any process starts). Returns the tp size."""
    args.tp = resolve_tp(getattr(args, "tp", None))
    if args.tp > 1:
        from h2okv.models import load_config

        model = getattr(args, "model", None)
        if model and model.startswith("tiny:"):
            raise H2OError(f"--tp {args.tp} needs a model loaded from files; tiny:ARCH models are built in memory")
        check_tp_model(load_config(model), args.tp, name=model or "the default model (SmolLM2-135M-Instruct)")
        device = getattr(args, "device", "cpu") or "cpu"
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise H2OError("--device cuda requested but no CUDA device is available")
            if not launched_by_torchrun() and torch.cuda.device_count() < args.tp:
                raise H2OError(f"--tp {args.tp} on CUDA needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
        elif launched_by_torchrun():
            hide_gpus_from_cpu_rank()
    return args.tp


def hide_gpus_from_cpu_rank() -> None:
    """A CPU rank must not see GPUs: transformers' tensor-parallel loading binds each rank to the
    accelerator it finds (``cuda:<LOCAL_RANK>``), whatever ``--device`` says; with one GPU, rank 1
    failed with "invalid device ordinal" (seen on the first lent H100). ``_spawn`` hides them before
    its ranks start; a rank that torchrun started hides them itself, which takes effect while
    nothing in the process has asked CUDA for its devices yet (the count is cached after that)."""
    import torch

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_available():
        raise H2OError("--device cpu under torchrun on a machine with GPUs: start the ranks with "
                       "CUDA_VISIBLE_DEVICES= (transformers would put each rank's slice on a GPU) or use --device cuda")


# -- running a command on every rank ---------------------------------------------------------------
def run(args, body, signals_to_rank0: bool = False) -> int:
    """``body(args) -> exit code`` on every rank (or once, for ``--tp 1``). Call ``prepare`` first
    (``run`` does when ``args.tp`` is still unset). ``body`` must be a module-level function: the
    ranks import it by name.

    ``signals_to_rank0`` (a server, which drains on SIGTERM): when this process started the ranks,
    they run in their own process group, so a terminal's Ctrl-C reaches this process only, and
    each SIGTERM or SIGINT it receives is passed on to rank 0 as SIGTERM; rank 0 then decides when
    the others stop. The run ends when every rank has exited."""
    tp = args.tp if isinstance(getattr(args, "tp", None), int) and args.tp >= 1 else prepare(args)
    timeout = getattr(args, "tp_timeout", DEFAULT_TIMEOUT_S)
    if tp == 1 or is_distributed():  # single process, or already a rank (a command run inside a rank)
        return int(body(args) or 0)
    if launched_by_torchrun():
        return _run_external(args, body, timeout)
    return _spawn(args, body, tp, timeout, signals_to_rank0)


# the least time the ranks wait for each other to join the group: a short --tp-timeout (3 s) failed
# the rendezvous on a 2-core machine running three other jobs (a rank reached the store late)
RENDEZVOUS_MIN_S = 120.0


def _init_group(info: RankInfo, device: str, timeout: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(
        backend="nccl" if cuda else "gloo", rank=info.rank, world_size=info.world_size,
        timeout=datetime.timedelta(seconds=max(timeout, RENDEZVOUS_MIN_S)),
        device_id=torch.device("cuda", info.local_rank) if cuda else None,
    )
    if timeout < RENDEZVOUS_MIN_S:  # the group is up: its collectives get --tp-timeout
        distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))


def _silence_output() -> None:
    """Ranks other than 0 print nothing: their stdout/stderr (Python and C level) go to /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def is_comm_error(exc: BaseException | None) -> bool:
    """A failure of the process group rather than of this rank's work (most likely the echo of
    another rank's failure): c10d's errors, gloo's (plain ``RuntimeError``s that name gloo: a
    timeout, a peer that closed its connection), or an exception raised from one of those."""
    import torch.distributed as dist

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc).lower()):
            return True
        exc, seen = exc.__cause__, seen + 1
    return False


def _one_line(exc: BaseException, timeout: float) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else ""
    if isinstance(exc, H2OError):
        return first or type(exc).__name__
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    if "timed out" in text.lower() or "timeout" in text.lower():
        line += f" (another rank did not answer within --tp-timeout {timeout:g} s)"
    return line


def _run_body(args, body, info: RankInfo, timeout: float, report) -> int:
    """One rank's life: join the group, run the command, leave. Exceptions become one line via
    ``report(rank, line, user_error, traceback_text, comm_error)``; returns the exit code."""
    import torch.distributed as dist

    args.device = rank_device(getattr(args, "device", "cpu") or "cpu", info)
    try:
        _init_group(info, args.device, timeout)
        code = int(body(args) or 0)
        dist.barrier()  # nobody leaves (closing its sockets) while another is still in a collective
        return code
    except H2OError as exc:
        report(info.rank, _one_line(exc, timeout), True, None, False)
        return 2
    except Exception as exc:  # a bug or a lost peer: still one line; the traceback goes to a file
        report(info.rank, _one_line(exc, timeout), False, traceback.format_exc(), is_comm_error(exc))
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_main(local_rank: int, args, body, world: int, port: int, timeout: float, errors,
               own_group: bool = False) -> None:
    """Entry point of a rank started by ``_spawn`` (torch.multiprocessing calls it in the child)."""
    if own_group:  # signals come from the launcher only (see ``run``)
        os.setpgid(0, 0)
    # tqdm (the weight-loading bars) would create a multiprocessing lock: a named semaphore that a
    # rank killed by the launcher cannot release, which the resource tracker then reports as
    # "leaked" after the one-line error. A rank starts no processes: tqdm's thread lock suffices.
    import tqdm.std

    tqdm.std.TqdmDefaultWriteLock.mp_lock = None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if local_rank != 0:
        _silence_output()
    if "OMP_NUM_THREADS" not in os.environ:  # N ranks share the cores (torchrun does the same)
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    def report(rank, line, user_error, trace, comm_error):
        errors.put((rank, line, user_error, trace, comm_error))

    code = _run_body(args, body, RankInfo(local_rank, world, local_rank), timeout, report)
    sys.stdout.flush()
    if code:
        sys.exit(code)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_trace(rank: int, trace: str | None) -> str:
    if not trace:
        return ""
    fd, path = tempfile.mkstemp(prefix=f"h2okv-tp-rank{rank}-", suffix=".log")
    with os.fdopen(fd, "w") as fh:
        fh.write(trace)
    return f" (traceback: {path})"


def _spawn(args, body, tp: int, timeout: float, signals_to_rank0: bool = False) -> int:
    """Start ``tp`` ranks here, wait; on the first failure stop the rest and report one line."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    # torch logs "Terminating process ..." when it stops the survivors: not for our users' eyes
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    cpu = not (getattr(args, "device", "cpu") or "cpu").startswith("cuda")
    # CPU ranks must not see GPUs (see ``hide_gpus_from_cpu_rank``)
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if cpu else {}
    with environment(hidden):
        procs = mp.start_processes(_rank_main, args=(args, body, tp, port, timeout, errors, signals_to_rank0),
                                   nprocs=tp, join=False, start_method="spawn")
    failure = None
    restore = _forward_signals(procs.processes[0].pid) if signals_to_rank0 else {}
    try:
        while not procs.join(timeout=0.5, grace_period=1.0):
            pass
    except ProcessException as exc:
        failure = exc
    except KeyboardInterrupt:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        for p in procs.processes:
            p.join(5)
            if p.is_alive():
                p.kill()
        raise
    finally:
        for sig, handler in restore.items():
            signal.signal(sig, handler)
    if failure is None:
        return 0
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    # the cause: the first rank's own failure; failures to reach a peer are echoes of it. When every
    # report is such an echo and the first rank found dead was killed without a word, the kill is.
    causes = [r for r in reports if not r[4]] or reports
    killed = getattr(failure, "signal_name", None) and failure.error_index not in {r[0] for r in reports}
    if reports and not (killed and causes is reports):
        rank_, line, user_error, trace, _ = causes[0]
        message = f"rank {rank_} of {tp} failed: {line}{_save_trace(rank_, trace)}"
        if user_error:
            raise H2OError(message)
    else:
        code = getattr(failure, "exit_code", None)
        how = f"was killed by {failure.signal_name}" if getattr(failure, "signal_name", None) else f"exited with code {code}"
        message = f"rank {failure.error_index} of {tp} {how}"
    print_error(message)
    return 1


def _forward_signals(pid: int) -> dict:
    """SIGTERM and SIGINT to this process become SIGTERM to ``pid``; returns the previous handlers
    (nothing when not on the main thread, where Python cannot set handlers)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(sig, frame):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}


def _run_external(args, body, timeout: float) -> int:
    """This process is one rank of a torchrun launch. Rank 0 prints; a failing rank prints its
    own one line (torchrun then stops the others and reports the exit codes)."""
    info = external_rank()
    saved_err = os.fdopen(os.dup(2), "w")
    if info.rank != 0:
        _silence_output()

    def report(rank, line, user_error, trace, comm_error):
        if comm_error:
            # most likely the echo of another rank's failure: torchrun stops this rank within a
            # moment, and only the cause should be printed; still alive later, it speaks
            time.sleep(_ECHO_GRACE_S)
        print(f"h2okv: error: rank {rank} of {info.world_size} failed: {line}{_save_trace(rank, trace)}",
              file=saved_err, flush=True)

    code = _run_body(args, body, info, timeout, report)
    sys.stdout.flush()
    return code
