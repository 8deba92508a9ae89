"""Tensor parallelism: launching ranks, rank identity, and stats summed over ranks."""
