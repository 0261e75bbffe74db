"""Math answer extraction and grading (PAPER.md §5), including tricky answers."""

from fractions import Fraction

import pytest

from rejax.grading import extract_answer, grade, is_equivalent, normalize, to_number


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{12}.", "12"),
        (r"first \boxed{3} then \boxed{4}", "4"),  # the last box wins
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{\frac{\sqrt{2}}{2}} done", r"\frac{\sqrt{2}}{2}"),
        (r"\boxed{ {a} + {b} }", " {a} + {b} "),
        (r"\boxed{5} and an unclosed \boxed{6", "5"),  # unbalanced last box is ignored
        (r"\fbox{7}", "7"),
        ("The result is 12, then 13.5.", "13.5"),  # no box: the last number
        ("x = -4", "-4"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("$ 12 $", "12"),
        (r"\text{12}", "12"),
        (r"\text{\textbf{5}}", "5"),
        (r"50\%", "50%"),
        ("7.", "7"),
        ("+3", "3"),
        ("1,234,567", "1234567"),
        ("(1,2)", "(1,2)"),  # commas of a tuple stay
    ],
)
def test_normalize(raw, expected):
    assert normalize(raw) == expected


@pytest.mark.parametrize(
    "raw, value",
    [
        ("12", Fraction(12)),
        ("-3", Fraction(-3)),
        ("0.25", Fraction(1, 4)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        (r"\frac{1}{2}", Fraction(1, 2)),
        (r"\dfrac{7}{2}", Fraction(7, 2)),
        (r"\tfrac{7}{2}", Fraction(7, 2)),
        (r"-\frac{7}{2}", Fraction(-7, 2)),
        (r"\frac{-7}{2}", Fraction(-7, 2)),
        (r"\frac12", Fraction(1, 2)),
        ("{5}", Fraction(5)),
        ("1,000", Fraction(1000)),
        ("x+1", None),
        (r"\frac{1}{0}", None),
        ("", None),
    ],
)
def test_to_number(raw, value):
    assert to_number(raw) == value


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"\boxed{12}", "12"),
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\dfrac{3}{4}}", "3/4"),
        (r"\boxed{-\frac{7}{2}}", r"\frac{-7}{2}"),
        (r"\boxed{-3.5}", r"-\frac{7}{2}"),
        (r"\boxed{$1,234$}", "1234"),
        (r"\boxed{\text{42}}", "42"),
        (r"\boxed{+7.}", "7"),
        (r"\boxed{012}", "12"),
        (r"The final answer is 5.", "5"),
        (r"\boxed{\boxed{3}}", "3"),
        (r"\boxed{0.3333333333}", r"\frac{1}{3}"),  # within 1e-6
        ("answer: 33", 33),  # integer references (AIME files) are accepted
    ],
)
def test_grade_correct(text, answer):
    assert grade(text, answer)


@pytest.mark.parametrize(
    "text, answer",
    [
        ("I could not solve it.", "12"),  # no answer at all
        ("", "0"),
        (r"\boxed{13}", "12"),
        (r"\boxed{-12}", "12"),
        (r"\boxed{\frac{1}{3}}", "0.33"),  # beyond 1e-6
        (r"\boxed{12} was wrong, correct is \boxed{13}", "12"),  # last box counts
        (r"\boxed{}", "0"),
        (r"\boxed{x+1}", "x+2"),
    ],
)
def test_grade_incorrect(text, answer):
    assert not grade(text, answer)


def test_is_equivalent_symbolic_via_math_verify():
    pytest.importorskip("math_verify")
    assert is_equivalent(r"\sqrt{4}", "2")
    assert not is_equivalent(r"\sqrt{5}", "2")


def test_bad_input():
    with pytest.raises(ValueError, match="text must be a str"):
        extract_answer(None)
    with pytest.raises(ValueError, match="math reference must be a str or int"):
        grade(r"\boxed{1}", None)
