"""Final-answer extraction and comparison of ``eval reasoning`` on known GSM8K / MATH answer formats."""

import pytest

from h2okv.eval.answers import (
    INVALID,
    extract_answer,
    gsm8k_answer,
    gsm8k_equal,
    is_correct,
    last_boxed,
    math_answer,
    math_equal,
    normalize_math,
)


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}} and later \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # the last, nested
    ("$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\fbox{7}", "7"),
    ("the answer is $\\boxed 5$.", "5"),
    ("\\boxed{unclosed", None),
    ("no box at all", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    # GSM8K's own solutions: "#### N" (lm-eval strict-match)
    ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "18"),
    ("#### 1,234", "1,234"),
    # the few-shot chain of thought's ending
    ("5 bagels for 3 dollars each will be 15 dollars. So the answer is 8.", "8"),
    ("The answer is $5.", "5"),
    # our chat prompt's \boxed{}, with dollars and units inside
    ("She makes $18 a day.\n\nFinal answer: \\boxed{\\$18}", "$18"),
    ("\\boxed{18 \\text{ dollars}}", "18"),
    # nothing else: the last number (lm-eval flexible-extract)
    ("First 3 then 4, finally 12 apples.", "12"),
    ("I cannot solve this.", INVALID),
])
def test_gsm8k_answer(text, expected):
    assert gsm8k_answer(text) == expected


@pytest.mark.parametrize("predicted, gold, same", [
    ("18", "18", True),
    ("$18", "18", True),
    ("1,234", "1234", True),
    ("18.", "18", True),
    ("18.00", "18", True),  # the same number
    ("-3", "-3", True),
    ("17", "18", False),
    ("180", "18", False),
    (INVALID, "18", False),
])
def test_gsm8k_equal(predicted, gold, same):
    assert gsm8k_equal(predicted, gold) is same


@pytest.mark.parametrize("raw, normal", [
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"),
    ("\\frac9{19}", "\\frac{9}{19}"),
    ("\\frac12", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),  # \left keeps its "ft"
    ("(-\\infty, 0]", "(-\\infty,0]"),
    ("\\$32,\\!348", "32348"),
    ("100,000", "100000"),
    ("0,1", "0,1"),  # a tuple, not a thousands separator
    ("864 \\mbox{ inches}^2", "864"),
    ("15\\mbox{ cm}^2", "15"),
    ("x = 5", "5"),
    ("\\text{(C)}", "(C)"),
    ("10\\%", "10"),
    ("90^\\circ", "90"),
    ("\\sqrt2", "\\sqrt{2}"),
])
def test_normalize_math(raw, normal):
    assert normalize_math(raw) == normal


@pytest.mark.parametrize("text, gold, correct", [
    ("Therefore $r = 3$ and the point is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("so $\\boxed{\\dfrac{1}{2}}$", "\\frac12", True),
    ("so $\\boxed{0.5}$", "\\frac{1}{2}", True),  # the same number
    ("so $\\boxed{\\$36}$", "\\$36", True),
    ("Final Answer: The final answer is $24$. I hope it is correct.", "24", True),  # Minerva's few-shot form
    ("Final Answer: The final answer is $24$", "24", True),  # stopped before "I hope"
    ("so $\\boxed{25}$", "24", False),
    ("no final answer", "24", False),
])
def test_math_answer_and_equal(text, gold, correct):
    assert math_equal(math_answer(text), gold) is correct


def test_one_entry_point_per_task():
    assert extract_answer("gsm8k", "#### 7") == "7" and is_correct("gsm8k", "7", "7")
    assert extract_answer("math500", "\\boxed{7}") == "7" and is_correct("math500", "7", "7")
    assert not is_correct("math500", INVALID, INVALID)
