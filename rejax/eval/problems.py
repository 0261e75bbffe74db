"""Problem files: the released formats of the paper's three tasks (AIME math JSONL, GPQA
CSV / JSONL, LiveCodeBench code JSONL) and the bundled Countdown task (`rejax.data.countdown`) through `load_problems`, the math layout alone
(`problem`, `answer`) through `load_jsonl`, and `write_jsonl`."""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import pickle
import random
import zlib
from collections.abc import Iterable
from pathlib import Path

from rejax.eval import grading

# ----------------------------------------------------------------------------------------------
# Problem files


def load_jsonl(path: str | Path, *, limit: int | None = None) -> list[dict]:
    """Reads a JSONL problem file.

    Args:
      path: file with one JSON object per line, each with a string `problem` and an `answer`
        (string or number; stored as a string). Blank lines are skipped; other keys are kept.
      limit: keep only the first `limit` problems (None keeps all).

    Returns:
      list of dicts with at least `problem` (str) and `answer` (str).

    Raises:
      ValueError: missing file, malformed JSON (names the line number), missing fields, an
        empty file, or `limit` <= 0.
    """
    path = Path(path)
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be a positive number of problems, got {limit}")
    if not path.is_file():
        raise ValueError(
            f"data file {str(path)!r} does not exist or is not a file (expected JSONL)"
        )
    problems = []
    for lineno, row in _rows(path, what="a JSON object with 'problem' and 'answer'"):
        for field in ("problem", "answer"):
            if field not in row:
                raise ValueError(f"{path}:{lineno}: missing field {field!r}")
        if not isinstance(row["problem"], str) or not row["problem"].strip():
            raise ValueError(f"{path}:{lineno}: 'problem' must be a non-empty string")
        if not _is_answer(row["answer"]):
            raise ValueError(
                f"{path}:{lineno}: 'answer' must be a string or a number, got {row['answer']!r}"
            )
        row["answer"] = str(row["answer"])
        if not row["answer"].strip():
            # An empty gold answer would grade every response wrong without a word.
            raise ValueError(f"{path}:{lineno}: 'answer' is empty (expected the gold answer)")
        problems.append(row)
        if limit is not None and len(problems) >= limit:
            break
    if not problems:
        raise ValueError(f"data file {str(path)!r} holds no problems")
    return problems


def _is_answer(value) -> bool:
    return type(value) in (str, int, float)


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Writes one JSON object per line (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# The three released formats of the paper's evaluation. Prompts are the user message (no template).

# OpenAI simple-evals' multiple-choice template, used for GPQA.
GPQA_TEMPLATE = (
    "Answer the following multiple choice question. The last line of your response should be of "
    "the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think "
    "step by step before answering.\n\n{question}\n\nA) {A}\nB) {B}\nC) {C}\nD) {D}"
)
# LiveCodeBench's generic code-generation question template (lcb_runner prompts); its system
# message is not sent, as the paper uses no system prompt.
LCB_WITH_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose "
    "your code within delimiters."
)
LCB_WITHOUT_STARTER = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not "
    "directly test on the sample inputs). Enclose your code within delimiters as follows. Ensure "
    "that when the python program runs, it reads the inputs, runs the algorithm and writes output "
    "to STDOUT."
)
_MAX_PRIVATE_BYTES = 1 << 30  # decompressed private tests of one row (a zlib bomb guard)


def load_problems(path: str | Path, task: str, *, limit: int | None = None) -> list[dict]:
    """Reads a problem file for `task` ("math", "mcq", "code" or "countdown").

    Formats (JSONL, one object per line; a `.csv` file is read as CSV with a header row):
      math: `problem` and `answer` (string or number), as the public AIME sets; optional `id`.
      mcq: GPQA rows with `Question`, `Correct Answer`, `Incorrect Answer 1`..`3` (optional
        `Record ID`). For the row at 0-based index idx the correct answer is inserted at
        position `random.Random(idx).randint(0, 3)` among the incorrect ones (kept in order);
        the prompt is simple-evals' template (`GPQA_TEMPLATE`).
      code: LiveCodeBench `code_generation_lite` rows with `question_content`, `starter_code`,
        `public_test_cases` (JSON list of {input, output, testtype}), `private_test_cases`
        (the same list as JSON, or base64 of zlib of a pickled JSON string), `metadata` (JSON
        with `func_name` for functional problems), optional `question_id`. The pickle is read
        by an unpickler that refuses every global, so a file carrying anything but a pickled
        string is refused and nothing in it runs. The prompt is LCB's stdin / starter-code
        question template.
      countdown: `problem` (the prompt), `numbers` (list of ints), `target` (int), optional
        `id`, as `rejax.data.countdown.write_jsonl` writes them.

    Args:
      path: the file.
      task: one of `rejax.eval.grading.TASKS`.
      limit: keep only the first `limit` problems (None keeps all).

    Returns:
      list of {"id": str, "prompt": str, "reference": ...}, the reference in the form
      `rejax.eval.grading.grade` takes for `task` (answer string, gold letter, {"tests",
      "fn_name"} with public tests first, or {"numbers", "target"}).

    Raises:
      ValueError: an unknown task, a missing or empty file, `limit` <= 0, or a bad row; row
        errors name the file, the line and the field. No row is skipped.
    """
    convert = {
        "math": _math_problem,
        "mcq": _mcq_problem,
        "code": _code_problem,
        "countdown": _countdown_problem,
    }.get(task)
    if convert is None:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(grading.TASKS)}")
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"limit must be a positive number of problems, got {limit!r}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist or is not a file")
    problems = []
    for idx, (lineno, row) in enumerate(_rows(path)):
        where = f"{path}:{lineno}"
        problem = convert(row, where, idx)
        try:
            grading.check_reference(problem["reference"], task)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        problems.append(problem)
        if limit is not None and len(problems) >= limit:
            break
    if not problems:
        raise ValueError(f"data file {str(path)!r} holds no problems")
    return problems


def _rows(path: Path, what: str = "a JSON object"):
    """Yields (line number, row dict) of a JSONL or CSV file (the line a CSV record starts on);
    a JSONL line that is not a JSON object is an error saying `what` was expected."""
    if path.suffix.lower() == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            start = 2
            for row in reader:
                yield start, row
                start = reader.line_num + 1
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            if type(row) is not dict:
                raise ValueError(f"{path}:{lineno}: expected {what}, got {type(row).__name__}")
            yield lineno, row


def _field(row: dict, name: str, where: str, *, types=(str,), empty: bool = False):
    if name not in row or row[name] is None:
        raise ValueError(f"{where}: missing field {name!r}")
    value = row[name]
    if type(value) not in types:
        kinds = " or ".join(t.__name__ for t in types)
        raise ValueError(f"{where}: field {name!r} must be {kinds}, got {type(value).__name__}")
    if not empty and isinstance(value, str) and not value.strip():
        raise ValueError(f"{where}: field {name!r} is empty")
    return value


def _row_id(row: dict, key: str, idx: int) -> str:
    value = row.get(key)
    return str(idx) if value is None or value == "" else str(value)


def _math_problem(row: dict, where: str, idx: int) -> dict:
    problem = _field(row, "problem", where)
    answer = _field(row, "answer", where, types=(str, int, float))
    return {"id": _row_id(row, "id", idx), "prompt": problem, "reference": str(answer).strip()}


def _countdown_problem(row: dict, where: str, idx: int) -> dict:
    problem = _field(row, "problem", where)
    numbers = _field(row, "numbers", where, types=(list,))
    target = _field(row, "target", where, types=(int,))
    return {
        "id": _row_id(row, "id", idx),
        "prompt": problem,
        "reference": {"numbers": numbers, "target": target},
    }


def _mcq_problem(row: dict, where: str, idx: int) -> dict:
    question = _field(row, "Question", where).strip()
    correct = _field(row, "Correct Answer", where).strip()
    choices = [_field(row, f"Incorrect Answer {k}", where).strip() for k in (1, 2, 3)]
    gold = random.Random(idx).randint(0, 3)
    choices.insert(gold, correct)
    prompt = GPQA_TEMPLATE.format(question=question, **dict(zip("ABCD", choices)))
    return {"id": _row_id(row, "Record ID", idx), "prompt": prompt, "reference": "ABCD"[gold]}


def _code_problem(row: dict, where: str, idx: int) -> dict:
    content = _field(row, "question_content", where)
    starter = row.get("starter_code") or ""
    if not isinstance(starter, str):
        raise ValueError(  # noqa: TRY004
            f"{where}: field 'starter_code' must be str, got {type(starter).__name__}"
        )
    public = _json_field(row, "public_test_cases", where, list)
    private = row.get("private_test_cases")
    private = [] if private in (None, "") else _private_tests(private, where)
    metadata = _json_field(row, "metadata", where, dict) if row.get("metadata") else {}
    fn_name = metadata.get("func_name") or None
    for field, tests in (("public_test_cases", public), ("private_test_cases", private)):
        if tests:
            try:
                grading.check_code_reference({"tests": tests, "fn_name": fn_name})
            except ValueError as e:
                raise ValueError(f"{where}: field {field!r}: {e}") from None
    prompt = f"### Question:\n{content}\n\n"
    if starter.strip():
        prompt += f"### Format: {LCB_WITH_STARTER}\n```python\n{starter}\n```\n\n"
    else:
        prompt += f"### Format: {LCB_WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n"
    prompt += "### Answer: (use the provided format with backticks)\n\n"
    reference = {"tests": public + private, "fn_name": fn_name}
    return {"id": _row_id(row, "question_id", idx), "prompt": prompt, "reference": reference}


def _json_field(row: dict, name: str, where: str, kind: type):
    value = _field(row, name, where, types=(str, kind))
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: field {name!r} is not valid JSON ({e.msg})") from None
    if not isinstance(value, kind):
        raise ValueError(  # noqa: TRY004 (the project's bad-input error is ValueError)
            f"{where}: field {name!r} must hold a JSON {kind.__name__}, got {type(value).__name__}"
        )
    return value


class _StringOnlyUnpickler(pickle.Unpickler):
    """Refuses every global (class or function) and persistent id: only plain data loads, so
    no code in the pickle can run (a `__reduce__` payload needs a global to call)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused persistent id")


def _private_tests(value, where: str) -> list:
    field = "private_test_cases"
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise ValueError(  # noqa: TRY004
            f"{where}: field {field!r} must be str, got {type(value).__name__}"
        )
    text = value.strip()
    if text.startswith("["):  # older releases store plain JSON
        return _json_field({field: text}, field, where, list)
    try:
        packed = base64.b64decode(text, validate=True)
        z = zlib.decompressobj()
        data = z.decompress(packed, _MAX_PRIVATE_BYTES)
        if z.unconsumed_tail:
            raise ValueError(f"decompresses to more than {_MAX_PRIVATE_BYTES} bytes")
    except (binascii.Error, zlib.error, ValueError) as e:
        raise ValueError(
            f"{where}: field {field!r} is neither JSON nor base64 + zlib data ({e})"
        ) from None
    try:
        payload = _StringOnlyUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 (any failure of untrusted data is a refusal)
        raise ValueError(
            f"{where}: field {field!r} refused: the pickle is not a plain string ({e})"
        ) from None
    if not isinstance(payload, str):
        raise ValueError(  # noqa: TRY004 (the project's bad-input error is ValueError)
            f"{where}: field {field!r} refused: expected a pickled JSON string, got a pickled "
            f"{type(payload).__name__}"
        )
    return _json_field({field: payload}, field, where, list)
