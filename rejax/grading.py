r"""Math answer extraction and grading (PAPER.md §5, "math").

The answer of a response is the content of its last brace-balanced `\boxed{...}` (nesting
allowed), else the last number in the text. Both the extracted answer and the reference are
normalised (spaces and `$` removed, `\text{}` unwrapped, `\%` -> `%`, trailing `.` and leading `+`
dropped, thousands commas removed) and compared: equal strings, or both parse as numbers
(integers, decimals, `a/b`, `\frac{a}{b}`, `\dfrac`, `\tfrac`, negatives) within 1e-6. When the
optional `math_verify` package is installed it is consulted as an extra check, so symbolic
equivalences it knows about also count.

Example:
    >>> grade(r"... so the result is \boxed{\frac{1}{2}}.", "0.5")
    True
"""

from __future__ import annotations

import re
from fractions import Fraction

TOLERANCE = 1e-6
_NUMBER = re.compile(r"[-+]?\d*\.?\d+")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_FRAC_SHORT = re.compile(r"^(-?)\\[dt]?frac(\d)(\d)$")  # \frac12


def extract_answer(text: str) -> str | None:
    r"""The raw answer string of a response, or None when it has neither `\boxed{}` nor a number.

    Args:
        text: the model's response.

    Returns:
        The content of the last brace-balanced `\boxed{...}`; else the last match of
        `[-+]?\d*\.?\d+`; else None. An unclosed last `\boxed{` is ignored.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")  # noqa: TRY004
    boxed = None
    for match in _BOXED.finditer(text):
        content = _balanced(text, match.end())
        if content is not None:
            boxed = content
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _balanced(text: str, start: int) -> str | None:
    """The text from `start` up to the brace closing the one just before it, or None."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def normalize(answer: str) -> str:
    r"""Canonical string form of an answer (see the module docstring for the rules)."""
    s = str(answer).strip()
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    s = re.sub(r"\s+", "", s)
    prev = None
    while prev != s:  # nested \text{\text{...}}
        prev, s = s, _TEXT.sub(r"\1", s)
    s = s.replace("\\%", "%").replace("\\left", "").replace("\\right", "")
    s = s.rstrip(".")
    s = s.removeprefix("+")
    if re.fullmatch(r"[-+]?[\d,]*\.?\d+", s) and "," in s:
        s = s.replace(",", "")  # 1,234 -> 1234 (only for plain numbers: keep tuples intact)
    return s


def to_number(answer: str) -> Fraction | None:
    r"""The value of a normalised answer as an exact Fraction, or None if it is not a number.

    Accepts integers, decimals, `a/b`, `\frac{a}{b}` (also `\dfrac`, `\tfrac`, `\frac12`), each
    with an optional sign, and a trailing `%` (kept as the plain number: "50%" -> 50).
    """
    s = normalize(answer).rstrip("%")
    if s.startswith("{") and s.endswith("}") and _balanced(s, 1) == s[1:-1]:
        s = s[1:-1]
    m = _FRAC.match(s) or _FRAC_SHORT.match(s)
    if m:
        num, den = to_number(m.group(2)), to_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if m.group(1) else num / den
    if s.count("/") == 1:
        a, b = s.split("/")
        num, den = to_number(a), to_number(b)
        if num is None or den is None or den == 0:
            return None
        return num / den
    if s.startswith("-(") and s.endswith(")"):
        inner = to_number(s[2:-1])
        return None if inner is None else -inner
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)", s):
        return Fraction(s)
    return None


def is_equivalent(predicted: str, reference: str) -> bool:
    """Whether two answer strings agree (normalised string equality or |Δ| < 1e-6)."""
    a, b = normalize(predicted), normalize(reference)
    if a == b and a != "":
        return True
    x, y = to_number(a), to_number(b)
    if x is not None and y is not None:
        return abs(float(x - y)) < TOLERANCE
    return _math_verify(a, b)


def _math_verify(predicted: str, reference: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    try:
        return bool(verify(parse(f"${reference}$"), parse(f"${predicted}$")))
    except Exception:  # noqa: BLE001 (math_verify raises many types on bad LaTeX: "not equal")
        return False


def grade(text: str, answer: str) -> bool:
    """Whether a response's extracted answer matches the reference answer.

    Args:
        text: the model's full response.
        answer: the reference answer (e.g. "12", "-3", "\\frac{7}{2}").

    Returns:
        False when no answer can be extracted; otherwise `is_equivalent(extracted, answer)`.
    """
    if not isinstance(answer, (str, int)):
        raise ValueError(  # noqa: TRY004 (the project's bad-input error is ValueError)
            f"answer must be a str or int, got {type(answer).__name__}: {answer!r}"
        )
    predicted = extract_answer(text)
    if predicted is None:
        return False
    return is_equivalent(predicted, str(answer))
