"""Arguments several subcommands share: model choice and eviction budget."""

from __future__ import annotations

import argparse

from h2okv.policies import POLICIES, make_policy


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_model_args(parser: argparse.ArgumentParser, device: bool = True) -> None:
    parser.add_argument("--model", default=None, help="HF id, local directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    if device:
        parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
        parser.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")


def add_budget_args(parser: argparse.ArgumentParser, policy_default: str = "h2o") -> None:
    parser.add_argument("--policy", default=policy_default, help=f"one of {', '.join(POLICIES)}, options after a colon, e.g. snapkv:window=16 (default: {policy_default})")
    parser.add_argument("--heavy", type=int, default=None, help="heavy-hitter slots per layer/head")
    parser.add_argument("--recent", type=int, default=None, help="recent-token slots per layer/head")
    parser.add_argument("--heavy-ratio", type=float, default=None, help="heavy slots as a fraction of the prompt (default 0.1)")
    parser.add_argument("--recent-ratio", type=float, default=None, help="recent slots as a fraction of the prompt (default 0.1)")
    parser.add_argument("--chunk-size", type=positive_int, default=512, help="prefill chunk length (default: 512)")


def check_policy(name: str) -> str:
    """``name`` if it is a known policy with valid options (``snapkv:window=16``), else a one-line error."""
    make_policy(name)  # builds it: the policy checks its own options
    return name


def budget_from_args(args) -> dict:
    return {
        "heavy": args.heavy,
        "recent": args.recent,
        "heavy_ratio": args.heavy_ratio,
        "recent_ratio": args.recent_ratio,
    }
