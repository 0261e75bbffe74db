"""Answer extraction and grading (the paper's rules): math (tricky answers), the mcq rules and their
order, code extraction, and the `grade` entry's validation. Code execution: test_sandbox.py."""

from fractions import Fraction

import pytest

from rejax.eval.grading import (
    _extract_choice,
    _extract_code,
    extract_answer,
    extract_choice,
    extract_code,
    grade,
    grade_detail,
    is_equivalent,
    normalize,
    to_number,
)


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


# ----------------------------------------------------------------------------- grade() entry


def test_math_rule_names_the_last_number_fallback():
    g = grade_detail("I think it is 3, or maybe 4", "4")
    assert (g.correct, g.extracted, g.rule) == (True, "4", "last_number")
    g = grade_detail(r"so \boxed{4}, not 5", "4")
    assert (g.correct, g.extracted, g.rule) == (True, "4", "boxed")
    assert grade_detail("no idea", "4").rule is None
    assert grade(r"\boxed{4}", "4", task="math") and grade(r"\boxed{4}", "4", "math")


def test_unknown_task_and_bad_references():
    with pytest.raises(ValueError, match="unknown task 'physics'"):
        grade("x", "1", task="physics")
    with pytest.raises(ValueError, match=r"mcq reference must be one of 'A'..'D', got 'E'"):
        grade("Answer: A", "E", task="mcq")
    with pytest.raises(ValueError, match="mcq reference"):
        grade("Answer: A", "a", task="mcq")
    with pytest.raises(ValueError, match="code reference must be a dict"):
        grade("print(1)", "1", task="code")
    with pytest.raises(ValueError, match="has no tests"):
        grade("print(1)", {"tests": [], "fn_name": None}, task="code")
    with pytest.raises(ValueError, match=r"tests\[0\].testtype must be 'stdin' or 'functional'"):
        grade("print(1)", {"tests": [{"input": "", "output": "1", "testtype": "x"}]}, task="code")
    with pytest.raises(ValueError, match=r"tests\[0\] is functional but the reference has no"):
        ref = {"tests": [{"input": "1", "output": "1", "testtype": "functional"}]}
        grade("def f(x): return x", ref, task="code")
    with pytest.raises(ValueError, match=r"tests\[1\].input: a line is not JSON"):
        ok = {"input": "1", "output": "1", "testtype": "functional"}
        bad = {"input": "[1,", "output": "1", "testtype": "functional"}
        grade("def f(x): return x", {"tests": [ok, bad], "fn_name": "f"}, task="code")


# ----------------------------------------------------------------------------- mcq


@pytest.mark.parametrize(
    "text, letter, rule",
    [
        # rule 1: the last "Answer: X" (simple-evals' required last line)
        ("Answer: B", "B", "answer_line"),
        ("Answer: A\nOn reflection...\nAnswer: C", "C", "answer_line"),
        ("**Answer:** D", "D", "answer_line"),
        ("answer: (b)... no. ANSWER: $C$", "C", "answer_line"),
        ("Final Answer:\tA", "A", "answer_line"),
        # the letter must be on the "Answer:" line: here "A" only starts the next sentence
        ("Final answer:\nA student would say so", "A", "standalone"),
        # rule 1 beats every later rule, wherever they appear
        (r"Answer: B. Though \boxed{C} and the answer is D.", "B", "answer_line"),
        # rule 2: a boxed letter (the last one that is a letter)
        (r"So \boxed{C}.", "C", "boxed"),
        (r"\boxed{\text{A}}", "A", "boxed"),
        (r"\boxed{(D)} is it", "D", "boxed"),
        (r"\boxed{B} then \boxed{42}", "B", "boxed"),
        (r"the answer is A, so \boxed{D}", "D", "boxed"),  # rule 2 beats rule 3
        # rule 3: "answer / choice / option is X"
        ("The correct answer is (C), not B.", "C", "phrase"),
        ("so the best choice is D; A and B fail", "D", "phrase"),
        ("The option is: A and then B", "A", "phrase"),
        ("the answer is option B, I think D was wrong", "B", "phrase"),
        # rule 4: the last standalone capital A-D
        ("Between A and C, I pick C", "C", "standalone"),
        ("(B) looks right", "B", "standalone"),
        ("Answer: Because A", "A", "standalone"),  # "Because" is not a letter
        # no letter at all
        ("I am unsure; maybe the third one.", None, None),
        ("Bad Cat Dog", None, None),  # capitals inside words are not choices
        ("", None, None),
    ],
)
def test_extract_choice_rules_and_order(text, letter, rule):
    assert _extract_choice(text) == (letter, rule)
    assert extract_choice(text) == letter
    if letter is not None:
        assert grade(text, letter, task="mcq")
        wrong = "A" if letter != "A" else "B"
        assert not grade(text, wrong, task="mcq")
    else:
        assert not any(grade(text, x, task="mcq") for x in "ABCD")


def test_mcq_grade_detail_records_letter_and_rule():
    g = grade_detail("Thinking... Answer: D", "D", task="mcq")
    assert (g.correct, g.extracted, g.rule, g.failure) == (True, "D", "answer_line", None)


# ----------------------------------------------------------------------------- code extraction


@pytest.mark.parametrize(
    "text, program, rule",
    [
        ("```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```", "print(2)\n", "python_block"),
        ("```Python3\nx = 1\n```", "x = 1\n", "python_block"),
        # a later non-python block does not beat the last python one
        ("```python\nprint(1)\n```\n```text\nout\n```", "print(1)\n", "python_block"),
        ("```\nprint(3)\n```", "print(3)\n", "fenced_block"),
        ("```cpp\nint main(){}\n```\n```\nprint(4)\n```", "print(4)\n", "fenced_block"),
        ("print(5)", "print(5)", "text"),
        ("```python\nprint(6)", "```python\nprint(6)", "text"),  # unclosed fence
    ],
)
def test_extract_code(text, program, rule):
    assert _extract_code(text) == (program, rule)
    assert extract_code(text) == program
