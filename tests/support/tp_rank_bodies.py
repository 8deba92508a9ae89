"""Rank bodies of the tensor-parallel failure tests, in a module of their own that imports only
torch and ``h2okv.parallel.launch``: every spawned rank imports the module that defines its body, and
the test modules' imports (transformers, the CLI) would cost each rank seconds."""

import os
import time

import torch

from h2okv.errors import H2OError
from h2okv.parallel import ranks as tp_ranks


def fail_on_rank_1(args) -> int:
    import torch.distributed as dist

    with open(os.path.join(args.dir, f"pid{tp_ranks.rank()}"), "w") as fh:
        fh.write(str(os.getpid()))
    dist.barrier()
    if tp_ranks.rank() == 1:
        raise H2OError("rank one cannot go on")
    mark_waiting(args)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone: the launcher must end it
    return 0


def hang_on_rank_1(args) -> int:
    import torch.distributed as dist

    if tp_ranks.rank() == 1:
        time.sleep(600)  # stuck, but alive: only the collective's timeout can end rank 0
    mark_waiting(args)
    dist.all_reduce(torch.ones(1))
    return 0


def mark_waiting(args) -> None:
    """When rank 0 starts waiting (starting the ranks takes seconds to a minute on a busy machine:
    the tests time what follows)."""
    with open(os.path.join(args.dir, "waiting_since"), "w") as fh:
        fh.write(repr(time.time()))
