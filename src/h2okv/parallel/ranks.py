"""Where this process stands in a tensor-parallel group: its rank, whether it is the one that
prints, which device it uses, and whether a model can be sharded over ``tp`` ranks at all.

Cheap to import (torch loads on first call): the CLI asks ``quiet_rank()`` when it prints an error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from h2okv.errors import H2OError

_EXTERNAL_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


# -- where this process stands ---------------------------------------------------------------------
@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int


def launched_by_torchrun() -> bool:
    """True when an external launcher (torchrun) started this process as one rank of a group."""
    return all(name in os.environ for name in _EXTERNAL_ENV)


def quiet_rank() -> bool:
    """A torchrun rank other than 0: errors every rank meets alike (bad arguments, a model that
    does not shard) are printed by rank 0 alone."""
    return launched_by_torchrun() and os.environ.get("RANK") != "0"


def external_rank() -> RankInfo:
    try:
        return RankInfo(*(int(os.environ[name]) for name in _EXTERNAL_ENV))
    except ValueError:
        raise H2OError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun)") from None


def resolve_tp(requested: int | None) -> int:
    """The tensor-parallel size: ``--tp``, or torchrun's world size when it launched us."""
    if launched_by_torchrun():
        world = external_rank().world_size
        if requested is not None and requested != world:
            raise H2OError(f"--tp {requested}, but torchrun started {world} process(es) (WORLD_SIZE={world}); "
                           f"give --tp {world} or leave --tp out")
        return world
    return requested or 1


def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if is_distributed() else 0


def is_main_rank() -> bool:
    """Rank 0, or any single-process run: the one that prints and writes files."""
    return rank() == 0


def rank_device(device: str, info: RankInfo | None) -> str:
    """``cuda`` on rank r of a node is ``cuda:<local rank>``; CPU stays CPU."""
    if info is None or not device.startswith("cuda"):
        return device
    return f"cuda:{info.local_rank}"


# -- checking a model before any rank starts -------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_model(config, tp: int, name: str = "the model") -> None:
    """Raise ``H2OError`` when ``tp`` ranks cannot shard this model: no tp plan, or query / KV
    heads that do not divide by ``tp`` (each rank must hold whole KV heads for H2O to evict per
    head without talking to the others)."""
    if tp == 1:
        return
    text = config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        raise H2OError(f"--tp {tp}: {name} ({text.model_type}) has no tensor-parallel plan in transformers; "
                       "run it with --tp 1")
    q_heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or q_heads)
    for what, heads in (("KV heads", kv_heads), ("query heads", q_heads)):
        if heads % tp:
            valid = ", ".join(str(d) for d in _divisors(math.gcd(q_heads, kv_heads)))
            raise H2OError(f"--tp {tp}: {name} has {heads} {what}, which do not divide by {tp} "
                           f"(each rank holds whole heads); use --tp {valid}")
