r"""Answer extraction and grading for the paper's three tasks: `grade` is the entry.

**math** (reference: the answer string). The answer of a response is the content of its last
brace-balanced `\boxed{...}` (nesting allowed), else the last number in the text (the
*last-number fallback*: a response that never boxes an answer is graded on whatever number it
mentions last). Both the extracted answer and the reference are normalised (spaces and `$`
removed, `\text{}` unwrapped, `\%` -> `%`, trailing `.` and leading `+` dropped, thousands
commas removed) and compared: equal strings, or both parse as numbers (integers, decimals,
`a/b`, `\frac{a}{b}`, `\dfrac`, `\tfrac`, negatives) within 1e-6. When the optional
`math_verify` package is installed it is consulted as an extra check, so symbolic equivalences
it knows about also count.

**mcq** (reference: the gold letter A-D). The first rule that finds a letter wins: the last
`Answer: X`, else the last boxed letter (`\boxed{X}`), else the last "answer / choice / option
is X", else the last standalone capital A-D. No letter is graded wrong.

**countdown** (reference: `{"numbers": [int, ...], "target": int}`). The answer is the content
of the last brace-balanced `\boxed{...}` (no fallback), read as an arithmetic expression of
non-negative integers, `+ - * /` (`\times`, `\cdot`, `\div` too) and parentheses (no unary
minus, no decimals). It is right when it uses every number exactly once (as a multiset) and
evaluates exactly (fractions, so intermediate values may be non-integers) to the target. A
division by zero or anything else that does not parse is wrong; `Grade.failure["status"]` says
which rule failed: "no_answer", "malformed", "wrong_numbers" or "wrong_value".

**code** (reference: `{"tests": [...], "fn_name": ...}`). The program is the last fenced
`python` block, else the last fenced block of any language, else the whole text. Every test
must pass, each run in `rejax.eval.sandbox` (a separate, limited process) with its own timeout:
stdin tests compare stdout with the expected output after `rstrip()`; functional tests parse
each input line as one JSON argument, call `Solution().<fn_name>(*args)` (or the top-level
function `fn_name`) and compare the JSON-normalised return value with the JSON output.

Example:
    >>> grade(r"... so the result is \boxed{\frac{1}{2}}.", "0.5")
    True
    >>> grade("The answer is (C).", "C", task="mcq")
    True
    >>> grade(r"\boxed{(7+4)*6/3}", {"numbers": [3, 4, 6, 7], "target": 22}, task="countdown")
    True
"""

from __future__ import annotations

import dataclasses
import json
import re
from fractions import Fraction

from rejax.eval import sandbox

TASKS = ("math", "mcq", "code", "countdown")
TOLERANCE = 1e-6
DEFAULT_TIMEOUT_S = 8.0  # per code test, as the paper
_NUMBER = re.compile(r"[-+]?\d*\.?\d+")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_FRAC_SHORT = re.compile(r"^(-?)\\[dt]?frac(\d)(\d)$")  # \frac12


def extract_answer(text: str) -> str | None:
    r"""The raw math answer of a response, or None when it has neither `\boxed{}` nor a number.

    Args:
        text: the model's response.

    Returns:
        The content of the last brace-balanced `\boxed{...}`; else the last match of
        `[-+]?\d*\.?\d+` (the last-number fallback); else None. An unclosed last `\boxed{` is
        ignored.
    """
    return _extract_math(text)[0]


def _extract_math(text: str) -> tuple[str | None, str | None]:
    _check_text(text)
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    numbers = _NUMBER.findall(text)
    return (numbers[-1], "last_number") if numbers else (None, None)


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")  # noqa: TRY004


def _boxed_contents(text: str) -> list[str]:
    out = []
    for match in _BOXED.finditer(text):
        content = _balanced(text, match.end())
        if content is not None:
            out.append(content)
    return out


def _last_boxed(text: str) -> str | None:
    boxes = _boxed_contents(text)
    return boxes[-1] if boxes else None


# Multiple choice, in the paper's order. A letter must not be glued to a word or digit, so
# "Answer: Because" or "is Bob" never reads as a choice. Markdown bold and a `(X)` / `$X$`
# wrapping are allowed around the letter.
_LETTER = r"[ \t*$(\[]*([A-D])(?![A-Za-z0-9])"
_MCQ_ANSWER = re.compile(r"(?i:answer)[ \t]*\**[ \t]*:" + _LETTER)
_MCQ_PHRASE = re.compile(r"(?i:answer|choice|option)\s+is\s*:?(?:\s*(?i:option|choice))?" + _LETTER)
_MCQ_STANDALONE = re.compile(r"(?<![A-Za-z0-9])([A-D])(?![A-Za-z0-9])")
_MCQ_BOX_LETTER = re.compile(r"[\s$(]*([A-D])[\s$).]*")
MCQ_RULES = ("answer_line", "boxed", "phrase", "standalone")


def extract_choice(text: str) -> str | None:
    r"""The multiple-choice letter of a response (see the module docstring), or None.

    Args:
        text: the model's response.

    Returns:
        "A".."D" from the first rule that finds one: the last `Answer: X`, the last boxed
        letter (`\boxed{X}`, `\boxed{\text{X}}`, `\boxed{(X)}`), the last "answer / choice /
        option is X", the last standalone capital A-D; None when no rule does.
    """
    return _extract_choice(text)[0]


def _extract_choice(text: str) -> tuple[str | None, str | None]:
    _check_text(text)
    found = _MCQ_ANSWER.findall(text)
    if found:
        return found[-1], "answer_line"
    for content in reversed(_boxed_contents(text)):
        m = _MCQ_BOX_LETTER.fullmatch(normalize(content))
        if m:
            return m.group(1), "boxed"
    for rule, pattern in (("phrase", _MCQ_PHRASE), ("standalone", _MCQ_STANDALONE)):
        found = pattern.findall(text)
        if found:
            return found[-1], rule
    return None, None


_FENCE_PYTHON = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_FENCE_ANY = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
CODE_RULES = ("python_block", "fenced_block", "text")


def extract_code(text: str) -> str:
    """The program of a response: the last fenced python block, else the last fenced block,
    else the whole text.

    Args:
        text: the model's response.

    Returns:
        The program source (never None: a response without code fails to run instead).
    """
    return _extract_code(text)[0]


def _extract_code(text: str) -> tuple[str, str]:
    _check_text(text)
    for rule, pattern in (("python_block", _FENCE_PYTHON), ("fenced_block", _FENCE_ANY)):
        blocks = pattern.findall(text)
        if blocks:
            return blocks[-1], rule
    return text, "text"


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


@dataclasses.dataclass(frozen=True)
class Grade:
    """The grading of one response.

    Attributes:
      correct: whether it is right.
      extracted: the extracted answer (math: the answer string, mcq: the letter, code: the
        program), None when nothing could be extracted.
      rule: which extraction rule produced it (math: "boxed" | "last_number"; mcq: one of
        `MCQ_RULES`; code: one of `CODE_RULES`; countdown: "boxed"), None when nothing was extracted.
      failure: code: the first failing test (`index`, `testtype`, `status`, `input`,
        `expected`, `got`, `stderr_tail`; long fields cut to `FAILURE_CHARS`), None when every
        test passed; countdown: `{"status": ...}` (see the module docstring) when wrong; None
        for other tasks.
    """

    correct: bool
    extracted: str | None
    rule: str | None
    failure: dict | None = None


FAILURE_CHARS = 500  # characters kept of a failing test's input / expected / got


def grade(text: str, reference, task: str = "math", timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether a response is correct (see the module docstring for each task's rule).

    Args:
        text: the model's full response.
        reference: math: the answer (str or int, e.g. "12", "\\frac{7}{2}"); mcq: the gold
            letter "A".."D"; code: `{"tests": [{"input": str, "output": str, "testtype":
            "stdin" | "functional"}, ...], "fn_name": str | None}`; countdown: `{"numbers":
            [int, ...], "target": int}`.
        task: one of `TASKS`.
        timeout_s: code only: wall-clock limit per test, in seconds.

    Returns:
        `grade_detail(...).correct`.
    """
    return grade_detail(text, reference, task, timeout_s=timeout_s).correct


def grade_detail(
    text: str, reference, task: str = "math", timeout_s: float = DEFAULT_TIMEOUT_S
) -> Grade:
    """Grades a response and says what was extracted, by which rule, and (code) what failed.

    Args: as `grade`.

    Returns:
        Grade.

    Raises:
        ValueError: an unknown task, a reference of the wrong form for the task, or text that
          is not a str.
    """
    if task != "code":  # code references are checked (and parsed) below
        check_reference(reference, task)
    if task == "math":
        predicted, rule = _extract_math(text)
        ok = predicted is not None and is_equivalent(predicted, str(reference))
        return Grade(ok, predicted, rule)
    if task == "mcq":
        letter, rule = _extract_choice(text)
        return Grade(letter == reference, letter, rule)
    if task == "countdown":
        _check_text(text)
        expression = _last_boxed(text)
        if expression is None:
            return Grade(False, None, None, {"status": "no_answer"})
        status = countdown_status(expression, reference["numbers"], reference["target"])
        return Grade(
            status == "correct",
            expression,
            "boxed",
            None if status == "correct" else {"status": status},
        )
    tests, fn_name = check_code_reference(reference)
    program, rule = _extract_code(text)
    failure = _run_tests(program, tests, fn_name, timeout_s)
    return Grade(failure is None, program, rule, failure)


def check_reference(reference, task: str) -> None:
    """Raises ValueError unless `reference` has the form `task` needs (see `grade`).

    Args:
        reference: the reference answer.
        task: one of `TASKS`.
    """
    if task == "math":
        if not isinstance(reference, (str, int)) or isinstance(reference, bool):
            raise ValueError(
                f"math reference must be a str or int, got {type(reference).__name__}: "
                f"{reference!r}"
            )
    elif task == "mcq":
        if reference not in ("A", "B", "C", "D"):
            raise ValueError(f"mcq reference must be one of 'A'..'D', got {reference!r}")
    elif task == "countdown":
        ok = isinstance(reference, dict) and set(reference) >= {"numbers", "target"}
        numbers = reference.get("numbers") if ok else None
        ok = ok and isinstance(numbers, (list, tuple)) and len(numbers) >= 1
        ok = ok and all(_is_int(x) and x >= 0 for x in numbers) and _is_int(reference["target"])
        if not ok:
            raise ValueError(
                'countdown reference must be {"numbers": [non-negative ints], "target": int}, '
                f"got {reference!r:.200}"
            )
    elif task == "code":
        check_code_reference(reference)
    else:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_COUNTDOWN_TOKEN = re.compile(r"\s*(?:([0-9]+)|(\\times|\\cdot|\\div|[-+*/()]))")
_COUNTDOWN_OPS = {"\\times": "*", "\\cdot": "*", "\\div": "/"}


def countdown_value(expression: str) -> tuple[Fraction, list[int]] | None:
    """The exact value of a Countdown expression and the integers it uses, or None.

    Args:
        expression: integers, `+ - * /` (also `\\times`, `\\cdot`, `\\div`), parentheses and
            spaces; no unary minus, no decimals.

    Returns:
        (value as a Fraction, the integers in order of appearance); None when the text does not
        parse or divides by zero.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a str, got {type(expression).__name__}")  # noqa: TRY004
    tokens, pos = [], 0
    text = expression.strip()
    while pos < len(text):
        m = _COUNTDOWN_TOKEN.match(text, pos)
        if m is None:
            return None
        tokens.append(int(m.group(1)) if m.group(1) else _COUNTDOWN_OPS.get(m.group(2), m.group(2)))
        pos = m.end()
    numbers: list[int] = []
    try:
        value, end = _cd_sum(tokens, 0, numbers)
    except (IndexError, ZeroDivisionError, ValueError, RecursionError):
        return None
    return (value, numbers) if end == len(tokens) else None


def _cd_sum(tokens, i, numbers):
    value, i = _cd_product(tokens, i, numbers)
    while i < len(tokens) and tokens[i] in ("+", "-"):
        rhs, j = _cd_product(tokens, i + 1, numbers)
        value, i = (value + rhs if tokens[i] == "+" else value - rhs), j
    return value, i


def _cd_product(tokens, i, numbers):
    value, i = _cd_atom(tokens, i, numbers)
    while i < len(tokens) and tokens[i] in ("*", "/"):
        rhs, j = _cd_atom(tokens, i + 1, numbers)
        value, i = (value * rhs if tokens[i] == "*" else value / rhs), j  # 0 raises
    return value, i


def _cd_atom(tokens, i, numbers):
    t = tokens[i]
    if isinstance(t, int):
        numbers.append(t)
        return Fraction(t), i + 1
    if t == "(":
        value, j = _cd_sum(tokens, i + 1, numbers)
        if tokens[j] != ")":
            raise ValueError("unclosed parenthesis")
        return value, j + 1
    raise ValueError(f"unexpected {t!r}")


def countdown_status(expression: str, numbers, target: int) -> str:
    """Grades a Countdown answer: "correct", "malformed", "wrong_numbers" or "wrong_value".

    Args:
        expression: the answer expression (see `countdown_value`).
        numbers: the given numbers; each must be used exactly once (as a multiset).
        target: the value to reach, exactly.
    """
    parsed = countdown_value(expression)
    if parsed is None:
        return "malformed"
    value, used = parsed
    if sorted(used) != sorted(numbers):
        return "wrong_numbers"
    return "correct" if value == target else "wrong_value"


def check_code_reference(reference) -> tuple[list[dict], str | None]:
    """Validates a code reference and parses its functional tests' JSON.

    Args:
        reference: `{"tests": [...], "fn_name": str | None}` (see `grade`).

    Returns:
        (tests, fn_name): tests as dicts with `input`, `output`, `testtype`, plus `args` (the
        parsed argument list) and `value` (the parsed expected value) for functional tests.

    Raises:
        ValueError: naming the test and field that is missing or malformed.
    """
    if not isinstance(reference, dict) or not isinstance(reference.get("tests"), list):
        raise ValueError(  # noqa: TRY004 (the project's bad-input error is ValueError)
            'code reference must be a dict {"tests": [...], "fn_name": str | None}, got '
            f"{type(reference).__name__}"
        )
    tests, fn_name = reference["tests"], reference.get("fn_name")
    if not tests:
        raise ValueError("code reference has no tests (every problem needs at least one)")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise ValueError(f"code reference fn_name must be a Python identifier, got {fn_name!r}")
    out = []
    for i, test in enumerate(tests):
        where = f"code reference tests[{i}]"
        if not isinstance(test, dict):
            raise ValueError(  # noqa: TRY004
                f"{where} must be a dict, got {type(test).__name__}"
            )
        for field in ("input", "output"):
            if not isinstance(test.get(field), str):
                raise ValueError(  # noqa: TRY004
                    f"{where}.{field} must be a str, got {test.get(field)!r:.80}"
                )
        kind = test.get("testtype")
        if kind not in ("stdin", "functional"):
            raise ValueError(f"{where}.testtype must be 'stdin' or 'functional', got {kind!r}")
        test = dict(test)
        if kind == "functional":
            if fn_name is None:
                raise ValueError(f"{where} is functional but the reference has no fn_name")
            try:
                test["args"] = [json.loads(line) for line in test["input"].splitlines() if line]
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}.input: a line is not JSON ({e.msg})") from None
            try:
                test["value"] = json.loads(test["output"])
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}.output is not JSON ({e.msg})") from None
        out.append(test)
    return out, fn_name


def _run_tests(program: str, tests: list[dict], fn_name, timeout_s: float) -> dict | None:
    """The first failing test (as `Grade.failure`), or None when all pass."""
    for i, test in enumerate(tests):
        if test["testtype"] == "stdin":
            run = sandbox.run_program(program, stdin=test["input"], timeout_s=timeout_s)
            got = run.stdout
            passed = run.status == "ok" and got.rstrip() == test["output"].rstrip()
        else:
            run = sandbox.run_program(program, call=(fn_name, test["args"]), timeout_s=timeout_s)
            got = run.value
            # JSON round trip on both sides: tuples become lists, 1 == 1.0 as in Python
            passed = run.status == "ok" and got is not None and _json_equal(got, test["value"])
        if not passed:
            status = run.status if run.status != "ok" else "wrong_answer"
            return {
                "index": i,
                "testtype": test["testtype"],
                "status": status,
                "input": test["input"][:FAILURE_CHARS],
                "expected": test["output"][:FAILURE_CHARS],
                "got": None if got is None else got[:FAILURE_CHARS],
                "stderr_tail": run.stderr_tail,
            }
    return None


def _json_equal(text: str, value) -> bool:
    try:
        return json.loads(text) == value
    except ValueError:  # the program wrote something else on the result channel
        return False
