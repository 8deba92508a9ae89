"""Accuracy evaluations. Every module here that defines ``register_eval(subparsers)`` becomes an
``h2okv eval <name>`` subcommand (see ``commands/eval.py``)."""
