"""Final answers of math reasoning: extraction from a model's text and exact-match comparison.

GSM8K follows lm-eval's ``gsm8k`` task: its ``strict-match`` filter (``#### N``), the chain-of-thought
variant's ``The answer is N``, then its ``flexible-extract`` filter (the last number), and its
``exact_match`` settings (commas, dollar signs, a trailing period and case ignored). lm-eval's own
``RegexFilter`` and ``exact_match_hf_evaluate`` do that work (both import without a model or torch).
A ``\\boxed{}`` answer, which our chat prompt asks for, is looked at first.

MATH follows the Minerva grader (Lewkowycz et al. 2022, appendix D), which lm-eval's
``minerva_math`` task also uses: the last ``\\boxed{}`` (nested braces), else Minerva's
"Final Answer: The final answer is X. I hope it is correct.", normalised (the part after the last
"=", units and ``\\text{}`` wrappers, dollar signs, spaces, ``\\left``/``\\right``, shorthand
``\\frac12``, thousands separators) and compared as strings. lm-eval's module cannot be imported
here (it requires ``math_verify`` and ``antlr4`` at import) and its sympy equivalence needs
``antlr4``, so the normaliser below is ours, written from the paper's rules.

Both tasks then accept two answers that are the same number (``18.00`` and ``18``; ``0.5`` and
``\\frac{1}{2}``): "numbers normalised" as the grader's spirit asks, and never a wrong match.
"""

from __future__ import annotations

import re
from fractions import Fraction

INVALID = "[invalid]"  # lm-eval's RegexFilter fallback: an answer that matches no pattern

GSM8K_STRICT = r"#### (\-?[0-9\.\,]+)"  # lm-eval gsm8k.yaml, strict-match
GSM8K_COT = r"[Tt]he answer is \$?(\-?[0-9\.\,]+)."  # gsm8k-cot.yaml strict-match (a "$" allowed)
GSM8K_FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"  # lm-eval gsm8k.yaml, flexible-extract (last match)
GSM8K_IGNORE = [",", "\\$", "(?s).*#### ", "\\.$"]  # lm-eval gsm8k.yaml, exact_match regexes_to_ignore


# -- \boxed{...} -----------------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with nested braces, or of a
    ``\\boxed 5`` without braces; None when there is none or it is never closed."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text)]
    for match in reversed(starts):
        if match.group(1) is None:  # "\boxed 5$": up to the next $ or whitespace
            rest = re.match(r"[^\s$]+", text[match.end():])
            if rest:
                return rest.group(0)
            continue
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def minerva_final_answer(text: str) -> str | None:
    """X of Minerva's few-shot ending "Final Answer: The final answer is X. I hope it is correct."
    (the text may stop before "I hope")."""
    match = re.search(r"Final Answer: The final answer is(.*?)\.?\s*I hope it is correct\.", text + " I hope it is correct.",
                      re.DOTALL)
    return match.group(1).strip() if match else None


# -- numbers ----------------------------------------------------------------------------------------
def as_number(text: str) -> Fraction | None:
    """``18``, ``-3.50``, ``1,000``, ``\\frac{1}{2}``, ``-\\frac{3}{4}``, ``3/4`` as an exact number, else None."""
    text = text.strip().replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", text) or re.fullmatch(r"(-?)(\d+)/(\d+)", text)
    try:
        if frac:
            value = Fraction(int(frac.group(2)), int(frac.group(3)))
            return -value if frac.group(1) else value
        if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", text):
            return Fraction(text)
    except ZeroDivisionError:
        return None
    return None


def same_number(a: str, b: str) -> bool:
    x, y = as_number(a), as_number(b)
    return x is not None and x == y


# -- GSM8K ------------------------------------------------------------------------------------------
def _regex(pattern: str, text: str, group_select: int = 0) -> str:
    from lm_eval.filters.extraction import RegexFilter

    return RegexFilter(regex_pattern=pattern, group_select=group_select, fallback=INVALID).apply([[text]], [None])[0][0]


def gsm8k_answer(text: str) -> str:
    """The final answer of a GSM8K solution: the last number inside the last ``\\boxed{}``, else
    ``#### N``, else "The answer is N", else the last number (lm-eval's flexible extract)."""
    boxed = last_boxed(text)
    if boxed is not None:
        found = _regex(GSM8K_FLEXIBLE, boxed.replace("\\$", "$"), group_select=-1)
        if found != INVALID:
            return found
    for pattern in (GSM8K_STRICT, GSM8K_COT):
        found = _regex(pattern, text)
        if found != INVALID:
            return found
    return _regex(GSM8K_FLEXIBLE, text, group_select=-1)


def gsm8k_equal(predicted: str, gold: str) -> bool:
    """lm-eval's GSM8K exact match, or the same number."""
    if predicted == INVALID:
        return False
    from lm_eval.api.metrics import exact_match_hf_evaluate

    exact = exact_match_hf_evaluate([predicted], [gold], regexes_to_ignore=GSM8K_IGNORE, ignore_case=True)
    if exact["exact_match"] == 1.0:
        return True
    strip = lambda s: re.sub(r"\.$", "", s.replace("$", "").strip())  # noqa: E731
    return same_number(strip(predicted), strip(gold))


# -- MATH (Minerva) ---------------------------------------------------------------------------------
# words that name a unit or the counted thing after a number ("5 inches", "10 ways"): dropped
UNIT_WORDS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "inch", "ft", "feet", "foot", "hours", "hour",
    "km", "units", "unit", "sue", "points", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "seconds", "days", "years",
)
# TeX that changes how an answer looks, not what it is
TEX_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\%", "%",
             "\\ldots", "\\dots", "{,}", '"', "\\displaystyle")


def _unwrap(text: str, command: str) -> str:
    """``\\command{X}`` -> ``X`` (innermost first, so nesting unwraps too)."""
    pattern = re.compile(r"\\" + command + r"\{([^{}]*)\}")
    while True:
        new = pattern.sub(lambda m: m.group(1), text)
        if new == text:
            return text
        text = new


def normalize_math(answer: str) -> str:
    """Minerva's normal form of a final answer (see the module docstring)."""
    text = answer.split("=")[-1]
    for word in UNIT_WORDS:  # whole words only, never inside a TeX command (\left keeps its "ft")
        text = re.sub(rf"(?<![\\A-Za-z]){word}\b", "", text)
    # a wrapper the units left empty, with its power ("\mbox{ inches}^2" -> "")
    text = re.sub(r"\\(?:text|mbox|mathrm)\{\s*\}(\^\{?[23]\}?)?", "", text)
    for command in ("text", "textbf", "mbox", "mathrm", "overline", "boxed"):
        text = _unwrap(text, command)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for noise in TEX_NOISE:
        text = text.replace(noise, "")
    text = text.replace("\\$", "").replace("$", "").replace(" ", "").replace("\\{", "{").replace("\\}", "}")
    text = text.rstrip(".")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)  # \frac12 -> \frac{1}{2}
    text = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", text)  # \frac{1}2
    text = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", text)  # \frac9{19}
    text = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)  # \sqrt2 -> \sqrt{2}
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+", text):  # 100,000 (not a tuple like 0,1)
        text = text.replace(",", "")
    return text


def math_answer(text: str) -> str:
    """The final answer of a MATH solution: the last ``\\boxed{}``, else Minerva's "The final
    answer is X", normalised; ``INVALID`` when there is neither."""
    found = last_boxed(text)
    if found is None:
        found = minerva_final_answer(text)
    return INVALID if found is None else normalize_math(found)


def math_equal(predicted: str, gold: str) -> bool:
    """Exact match of normal forms (``predicted`` already normalised), or the same number."""
    if predicted == INVALID:
        return False
    reference = normalize_math(gold)
    return predicted == reference or same_number(predicted, reference)


# -- one entry point per task ----------------------------------------------------------------------
def extract_answer(task: str, text: str) -> str:
    return gsm8k_answer(text) if task == "gsm8k" else math_answer(text)


def is_correct(task: str, predicted: str, gold: str) -> bool:
    return gsm8k_equal(predicted, gold) if task == "gsm8k" else math_equal(predicted, gold)
