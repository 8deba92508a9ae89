"""Figures of a tensor-parallel run summed over its ranks."""

from __future__ import annotations

from h2okv.parallel.ranks import is_distributed


def gather_stats(stats: dict) -> dict:
    """``cache.stats()`` of this rank -> the run's stats: KV bytes summed over ranks, plus each
    rank's own stats under ``per_rank``. A collective: every rank must call it. Single process:
    the stats unchanged, with ``per_rank`` = [stats]."""
    if not is_distributed():
        return {**stats, "world_size": 1, "per_rank": [stats]}
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, stats)
    total = dict(stats)
    for key in ("kv_bytes", "full_kv_bytes"):
        total[key] = sum(s[key] for s in everyone)
    return {**total, "world_size": len(everyone), "per_rank": everyone}
