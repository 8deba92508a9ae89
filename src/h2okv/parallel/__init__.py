"""Tensor parallelism, no argparse here (``cli/args.py`` adds ``--tp``/``--tp-timeout``):

- ``launch``: run a command on N ranks (spawned here or by torchrun), one line for a failure;
- ``ranks``: where this process stands (rank, main rank, device) and whether a model shards;
- ``stats``: cache figures summed over the ranks.
"""
