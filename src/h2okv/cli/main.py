"""``h2okv`` command line. Each subcommand lives in its own module and registers itself here.

User errors (``H2OError``, bad arguments, a missing extra) print one line and exit with code 2; no
tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

from h2okv import __version__, extras
from h2okv.cli.args import examples, sort_subcommands
from h2okv.errors import H2OError, print_error
from h2okv.vocabulary import as_flag, said


def subcommand_modules() -> list[str]:
    """Every module of ``h2okv.cli`` that defines ``register(subparsers)``: adding a
    subcommand is adding one file."""
    here = [str(Path(__file__).parent)]  # this package, found without importing it (no import circle)
    names = sorted(m.name for m in pkgutil.iter_modules(here) if not m.name.startswith("_"))
    return [f"{__package__}.{n}" for n in names if n not in ("args", "main")]


class _Parser(argparse.ArgumentParser):
    """Every parser of the command, subcommands included: no abbreviations (``--budget`` must never
    be taken for ``--budgets``), epilogs and descriptions shown as written (their examples)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, exit 2 (argparse's default prints usage first)
        self.exit(2, f"h2okv: error: {message}\n")


EXAMPLES = examples(
    "h2okv demo",
    'h2okv generate --prompt "What is the capital of France?" --chat --recipe bounded --budget 0.2',
    "h2okv serve --recipe bounded --budget 0.2 --port 8000",
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="h2okv", description="H2O heavy-hitter KV-cache eviction for transformers",
                     epilog=EXAMPLES + "\n\n`h2okv COMMAND --help` shows a command's options and examples.")
    parser.add_argument("--version", action="version", version=f"h2okv {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in subcommand_modules():
        module = importlib.import_module(name)
        if hasattr(module, "register"):
            module.register(sub)
    sort_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, already printed)
        return int(exc.code or 0)
    try:
        with extras.needed_by(f"h2okv {args.command}", *extras.COMMANDS.get(args.command, ())):
            return int(args.func(args) or 0)
    except H2OError as exc:
        from h2okv.parallel.ranks import quiet_rank

        if not quiet_rank():  # under torchrun, an error every rank meets alike is printed once
            print_error(said(exc, as_flag))  # a setting named as the flag that sets it (--budget)
        return 2
    except KeyboardInterrupt:
        print("h2okv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
