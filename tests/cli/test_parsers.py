"""The command line's parsers, all of them: every flag has a help text, no flag is taken for an
abbreviation of another, commands are listed by name, and each ends its ``--help`` with examples
that parse."""

import argparse
import shlex

import pytest

from h2okv import __version__, cli
from h2okv.cli.main import build_parser


def parsers(parser=None, path=("h2okv",)):
    """``(command path, parser)`` for the top-level parser and every subcommand under it."""
    parser = parser or build_parser()
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def subcommand_lists(parser=None):
    for _, parser in parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                yield action


ALL = list(parsers())
COMMANDS = [(path, parser) for path, parser in ALL if not any(isinstance(a, argparse._SubParsersAction)
                                                               for a in parser._actions)]


def test_every_flag_and_command_has_a_help_text():
    missing = [f"{path} {'/'.join(action.option_strings) or action.dest}" for path, parser in ALL
               for action in parser._actions if not action.help and not isinstance(action, argparse._SubParsersAction)]
    missing += [f"{action.dest}" for subs in subcommand_lists() for action in subs._choices_actions if not action.help]
    assert not missing, f"no help text: {', '.join(missing)}"


def test_no_parser_takes_abbreviations(capsys):
    assert all(parser.allow_abbrev is False for _, parser in ALL)
    # `eval ppl --budget 0.2` was silently taken as --budgets 0.2
    assert cli.main(["eval", "ppl", "--budget", "0.2"]) == 2
    assert "unrecognized arguments: --budget 0.2" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"h2okv {__version__}"


def test_commands_are_listed_by_name():
    for subs in subcommand_lists():
        names = [action.dest for action in subs._choices_actions]
        assert names == sorted(names) and list(subs.choices) == sorted(subs.choices)
    assert {"eval", "generate", "serve"} <= set(next(subcommand_lists()).choices)


@pytest.mark.parametrize("path, parser", ALL, ids=[path for path, _ in ALL])
def test_each_help_ends_with_examples_that_parse(path, parser):
    help_text = parser.format_help()
    assert "\nexamples:\n" in help_text
    examples = [line.strip() for line in parser.epilog.splitlines() if line.strip().startswith("h2okv ")]
    assert examples
    for example in examples:
        assert f"\n  {example}\n" in help_text + "\n"  # shown as written, not re-wrapped
        args = build_parser().parse_args(shlex.split(example)[1:])  # a bad example exits here
        if path != "h2okv":
            assert example.startswith(path + " ") or example == path
        assert hasattr(args, "func")
