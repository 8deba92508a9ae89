"""What a user reads names no issue number or date of our work: every ``--help`` text and every
string in the source that can reach a user (docstrings and comments are for us, and not checked)."""

import argparse
import ast
import re
from pathlib import Path

import h2okv
from h2okv.cli.main import build_parser

HISTORY = re.compile(r"\bissues? #?\d+|\bissue's\b|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)
SOURCE = Path(h2okv.__file__).parent


def all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def test_no_help_text_names_an_issue_or_a_date():
    found = [(p.prog, m.group()) for p in all_parsers(build_parser()) for m in HISTORY.finditer(p.format_help())]
    assert found == []


def user_strings(tree: ast.AST):
    """``(line, text)`` of each string constant in ``tree`` that is not a docstring."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_message_names_an_issue_or_a_date():
    found = [f"{path.relative_to(SOURCE)}:{line}: {m.group()}"
             for path in sorted(SOURCE.rglob("*.py"))
             for line, text in user_strings(ast.parse(path.read_text(encoding="utf-8")))
             for m in HISTORY.finditer(text)]
    assert found == []


def test_the_checks_would_see_one():
    assert HISTORY.search("the soak (issue 20)") and HISTORY.search("measured 2026-11-24")
    assert not HISTORY.search("the 10-minute soak") and not HISTORY.search("an issue with the tokenizer")
    tree = ast.parse('"""docstring, issue 20"""\nMESSAGE = "see issue 20"\n')
    assert [text for _, text in user_strings(tree) if HISTORY.search(text)] == ["see issue 20"]
