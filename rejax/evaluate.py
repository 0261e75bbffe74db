"""Evaluation harness: problem files, batched sampling + grading, avg@n with a CI, τ0 calibration,
and the paper's observation statistics (how often low-entropy tokens leave the BF16 argmax).

Everything here is host glue around `rejax.generate.generate` (one compiled decode loop per
batch shape) and `rejax.generate.logits` (teacher forcing); nothing in this module is jitted.

Problem files: `load_problems` reads the released formats of the paper's three tasks (AIME math
JSONL, GPQA CSV / JSONL, LiveCodeBench code JSONL) and the bundled Countdown task's JSONL
(`rejax.data.countdown.write_jsonl`); `load_jsonl` reads the math layout alone (`problem`,
`answer`) for calibration.
"""

from __future__ import annotations

import base64
import binascii
import csv
import dataclasses
import io
import json
import math
import os
import pickle
import statistics
import time
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

# Official ReSET defaults (the official release): T_low 0.3, τ0 0.6349, T_high 1.0, w 32, top-p 0.95.
DEFAULT_T_LOW = 0.3
DEFAULT_TAU0 = 0.6349
DEFAULT_T_HIGH = 1.0
DEFAULT_TOP_P = 0.95
DEFAULT_WINDOW = 32
# The calibration recipe (the paper's recipe): T = 0.6 sampling, 80th percentile of all entropies.
CALIBRATION_TEMPERATURE = 0.6
CALIBRATION_PERCENTILE = 80.0


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
      task: one of `rejax.grading.TASKS`.
      limit: keep only the first `limit` problems (None keeps all).

    Returns:
      list of {"id": str, "prompt": str, "reference": ...}, the reference in the form
      `rejax.grading.grade` takes for `task` (answer string, gold letter, {"tests",
      "fn_name"} with public tests first, or {"numbers", "target"}).

    Raises:
      ValueError: an unknown task, a missing or empty file, `limit` <= 0, or a bad row; row
        errors name the file, the line and the field. No row is skipped.
    """
    from rejax import grading

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
    import random

    question = _field(row, "Question", where).strip()
    correct = _field(row, "Correct Answer", where).strip()
    choices = [_field(row, f"Incorrect Answer {k}", where).strip() for k in (1, 2, 3)]
    gold = random.Random(idx).randint(0, 3)
    choices.insert(gold, correct)
    prompt = GPQA_TEMPLATE.format(question=question, **dict(zip("ABCD", choices)))
    return {"id": _row_id(row, "Record ID", idx), "prompt": prompt, "reference": "ABCD"[gold]}


def _code_problem(row: dict, where: str, idx: int) -> dict:
    from rejax import grading

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


# ----------------------------------------------------------------------------------------------
# Samplers from a command-line spec


def parse_sampler(
    spec: str,
    *,
    t_low: float = DEFAULT_T_LOW,
    tau0: float = DEFAULT_TAU0,
    t_high: float = DEFAULT_T_HIGH,
    top_p: float = DEFAULT_TOP_P,
    window: int = DEFAULT_WINDOW,
):
    """Builds a sampler from `greedy`, `temp:T` or `reset`.

    `top_p` applies to `temp:T` and `reset`; `t_low`, `tau0`, `t_high`, `window` to `reset`
    only. ReSET's newline masks are left None: `generate` fills them from the tokenizer.

    Raises:
      ValueError: an unknown spec, a non-numeric or non-positive temperature, top_p outside
        (0, 1], or out-of-range ReSET hyperparameters.
    """
    from rejax import sampling

    _check_range("top_p", top_p, 0.0, 1.0, lo_open=True)
    name, _, arg = spec.strip().partition(":")
    name = name.lower()
    if name == "greedy" and not arg:
        return sampling.Greedy()
    if name in ("temp", "temperature"):
        try:
            t = float(arg)
        except ValueError:
            raise ValueError(
                f"sampler spec {spec!r}: temperature {arg!r} is not a number "
                "(expected e.g. 'temp:0.6')"
            ) from None
        if not math.isfinite(t) or t <= 0:
            raise ValueError(
                f"sampler spec {spec!r}: temperature must be a finite number > 0 "
                "(use 'greedy' for argmax decoding)"
            )
        return sampling.Temperature(t=t, top_p=top_p)
    if name == "reset" and not arg:
        _check_range("t_low", t_low, 0.0, math.inf)
        _check_range("t_high", t_high, 0.0, math.inf, lo_open=True)
        _check_range("tau0", tau0, 0.0, math.inf)
        if window < 1:
            raise ValueError(f"ReSET window must be >= 1, got {window}")
        return sampling.ReSET(t_high=t_high, t_low=t_low, tau_0=tau0, window=window, top_p=top_p)
    raise ValueError(
        f"unknown sampler spec {spec!r}; expected 'greedy', 'temp:T' (T > 0, e.g. 'temp:0.6') "
        "or 'reset'"
    )


def _check_range(name, value, lo, hi, *, lo_open=False):
    ok = isinstance(value, (int, float)) and math.isfinite(value) and value <= hi
    ok = ok and (value > lo if lo_open else value >= lo)
    if not ok:
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value!r}")


def describe_sampler(sampler) -> dict:
    """A JSON-able description of a sampler (its class and float hyperparameters)."""
    out = {"kind": type(sampler).__name__}
    for f in dataclasses.fields(sampler):
        v = getattr(sampler, f.name)
        if v is None or isinstance(v, (bool, int, float, str)):
            out[f.name] = v
        elif np.ndim(v) == 0:
            out[f.name] = float(v)
    return out


# ----------------------------------------------------------------------------------------------
# Metric


CI_METHODS = ("normal", "bootstrap", "wilson")


def _z(confidence: float) -> float:
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(p: float, n: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion p observed over n units.

    Unlike the normal approximation it stays inside [0, 1], has non-zero width at p = 0 and
    p = 1 (10 of 10 gives [0.722, 1]) and is defined for n = 1.

    Args:
      p: the observed proportion in [0, 1].
      n: number of units (> 0).
      confidence: two-sided level in (0, 1).

    Returns:
      (lo, hi), fractions in [0, 1].
    """
    if n <= 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"wilson_interval needs 0 <= p <= 1 and n > 0, got p={p!r}, n={n!r}")
    z = _z(confidence)
    z2n = z * z / n
    center = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / n + z2n / (4 * n))
    return max(0.0, center - half), min(1.0, center + half)


def avg_at_n_ci(
    correct,
    *,
    confidence: float = 0.95,
    method: str = "normal",
    n_boot: int = 10_000,
    seed: int = 0,
) -> dict:
    """avg@n and its confidence interval, with problems as the sampling unit.

    avg@n = mean over problems of the per-problem fraction of correct samples (equal to
    correct / (problems * n) when every problem has n samples). The n samples of one problem
    are correlated, so the interval treats the per-problem means p_i as the i.i.d. draws:

      method "normal":    avg ± z * sd(p_i, ddof=1) / sqrt(P), z the normal quantile
                          (1.96 for 95%); clipped to [0, 1].
      method "bootstrap": percentile interval of the mean of p_i over `n_boot` resamples of
                          the problems with replacement (seeded).
      method "wilson":    Wilson score interval of avg over P units. Each p_i lies in [0, 1],
                          so var(p_i) <= avg * (1 - avg), the binomial variance this interval
                          assumes: it is conservative for n > 1.

    "normal" and "bootstrap" estimate the spread from the data; with one problem, or when
    every problem has the same mean (all right, all wrong), that estimate is zero or undefined
    and their interval would be empty or NaN. They then fall back to "wilson"; `method` in the
    result names the interval actually computed and `requested_method` the one asked for.

    Args:
      correct: bool/int array [P, n] (or a list of per-problem lists, ragged allowed).
      confidence: two-sided level in (0, 1).
      method: one of CI_METHODS.
      n_boot, seed: bootstrap resamples and their seed.

    Returns:
      {"avg", "lo", "hi", "se", "n_problems", "n_samples", "confidence", "method",
      "requested_method"}; avg/lo/hi are finite fractions in [0, 1]; se is the standard error
      of avg over problems (sd(p_i) / sqrt(P)), None for a single problem.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if method not in CI_METHODS:
        raise ValueError(f"unknown CI method {method!r}; expected one of {CI_METHODS}")
    rows = [np.asarray(r, dtype=np.float64).reshape(-1) for r in correct]
    if not rows or any(r.size == 0 for r in rows):
        raise ValueError("avg_at_n_ci needs at least one problem with at least one sample")
    p = np.array([r.mean() for r in rows])
    n_problems = p.size
    avg = float(p.mean())
    se = float(p.std(ddof=1) / math.sqrt(n_problems)) if n_problems > 1 else None
    used = method
    if method != "wilson" and (n_problems < 2 or np.all(p == p[0])):
        used = "wilson"
    if used == "wilson":
        lo, hi = wilson_interval(min(max(avg, 0.0), 1.0), n_problems, confidence=confidence)
    elif used == "normal":
        z = _z(confidence)
        lo, hi = max(0.0, avg - z * se), min(1.0, avg + z * se)
    else:
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, n_problems, size=(n_boot, n_problems))
        means = p[idx].mean(axis=1)
        alpha = (1 - confidence) / 2
        lo, hi = (float(q) for q in np.quantile(means, [alpha, 1 - alpha]))
    return {
        "avg": avg,
        "lo": float(lo),
        "hi": float(hi),
        "se": se,
        "n_problems": int(n_problems),
        "n_samples": int(sum(r.size for r in rows)),
        "confidence": confidence,
        "method": used,
        "requested_method": method,
    }


def paired_difference_ci(correct_a, correct_b, *, confidence: float = 0.95) -> dict:
    """avg@n(a) - avg@n(b) on the same problems, with a CI over problems.

    d_i = mean(a_i) - mean(b_i) per problem; the interval is mean(d) ± z * sd(d, ddof=1) /
    sqrt(P) ("normal"). Pairing removes the between-problem variance (difficulty) from the
    comparison. With one problem, or when every d_i is equal (both sides all right, say), that
    spread is zero or undefined; the interval is then Newcombe's hybrid score interval
    ("newcombe": the Wilson intervals of both sides over P problems combined), which ignores
    the pairing and so is conservative for positively correlated sides.

    Args:
      correct_a, correct_b: bool/int [P, n] (or per-problem lists) for the same P problems.
      confidence: two-sided level in (0, 1).

    Returns:
      {"diff", "lo", "hi", "se", "n_problems", "confidence", "method"} (finite fractions in
      [-1, 1]; se None for a single problem).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    a = [np.asarray(r, np.float64).reshape(-1) for r in correct_a]
    b = [np.asarray(r, np.float64).reshape(-1) for r in correct_b]
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same non-zero number of problems, got {len(a)} and {len(b)}")
    if any(x.size == 0 for x in a + b):
        raise ValueError("every problem needs at least one sample on both sides")
    pa = np.array([x.mean() for x in a])
    pb = np.array([y.mean() for y in b])
    d = pa - pb
    diff = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else None
    if d.size > 1 and not np.all(d == d[0]):
        z = _z(confidence)
        lo, hi, method = diff - z * se, diff + z * se, "normal"
    else:
        ma, mb = float(pa.mean()), float(pb.mean())
        la, ua = wilson_interval(ma, d.size, confidence=confidence)
        lb, ub = wilson_interval(mb, d.size, confidence=confidence)
        lo = diff - math.sqrt((ma - la) ** 2 + (ub - mb) ** 2)
        hi = diff + math.sqrt((ua - ma) ** 2 + (mb - lb) ** 2)
        method = "newcombe"
    return {
        "diff": diff,
        "lo": max(-1.0, lo),
        "hi": min(1.0, hi),
        "se": se,
        "n_problems": int(d.size),
        "confidence": confidence,
        "method": method,
    }


# ----------------------------------------------------------------------------------------------
# Prompts and step boundaries


def prompt_ids(params, problem: str, *, chat: bool) -> list[int]:
    """Token ids of one prompt exactly as `rejax.generate.generate` builds them.

    chat=True renders one user message through the checkpoint's chat template
    (`rejax.generate.render_chat`, no extra special tokens); chat=False encodes the raw text
    with the tokenizer's own post-processing.
    """
    from rejax.generate import render_chat

    if params.tokenizer is None or params.tokenizer.tokenizer is None:
        raise ValueError("these params carry no tokenizer (the checkpoint needs tokenizer.json)")
    tok = params.tokenizer.tokenizer
    if chat:
        return list(tok.encode(render_chat(params, problem), add_special_tokens=False).ids)
    return list(tok.encode(problem).ids)


def has_chat_template(params) -> bool:
    """Whether the checkpoint carries a chat template (`chat=True` then works)."""
    return params.tokenizer is not None and bool(params.tokenizer.chat_template)


def step_spans(tokens: Sequence[int], nl_mask, dnl_mask) -> list[tuple[int, int]]:
    """Splits a response into reasoning steps with ReSET's boundary rule (the paper's step rule).

    A new step starts at position t iff token t-1 is a double-newline token, or tokens t-1 and
    t-2 are both single-newline tokens; the boundary token belongs to the step it ends.

    Args:
      tokens: generated ids (prompt excluded).
      nl_mask, dnl_mask: bool [V] masks from `rejax.sampling.newline_masks`.

    Returns:
      [(start, end)] half-open spans covering all tokens, in order.
    """
    nl, dnl = np.asarray(nl_mask), np.asarray(dnl_mask)
    spans, start = [], 0
    for t in range(1, len(tokens)):
        prev, prev2 = tokens[t - 1], tokens[t - 2] if t >= 2 else None
        if dnl[prev] or (nl[prev] and prev2 is not None and nl[prev2]):
            spans.append((start, t))
            start = t
    if tokens:
        spans.append((start, len(tokens)))
    return spans


# ----------------------------------------------------------------------------------------------
# Evaluation


@dataclasses.dataclass
class EvalResult:
    """Output of `evaluate`.

    Attributes:
      records: one JSON-able dict per problem (the input fields plus `responses`, `extracted`,
        `correct`, `n_correct`, `num_tokens`, `finish_reason`, `mean_entropy`).
      correct: bool [P, n] grading of every sample.
      summary: JSON-able dict: `avg_at_n` (see `avg_at_n_ci`), token counts, timing, sampler.
      tokens: generated ids per sample, problem-major ([P * n] lists), for teacher forcing.
    """

    records: list[dict]
    correct: np.ndarray
    summary: dict
    tokens: list[list[int]]


def evaluate(
    params,
    problems: Sequence[dict],
    sampler,
    *,
    n: int = 8,
    max_new_tokens: int = 1024,
    batch_size: int | None = None,
    key: int = 0,
    chat: bool | None = None,
    progress: bool = True,
    ci_method: str = "normal",
    task: str = "math",
    timeout_s: float = 8.0,
    grade_workers: int | None = None,
) -> EvalResult:
    """Samples n responses per problem, grades them and computes avg@n with a 95% CI.

    One `rejax.generate` call: problems are decoded `batch_size` at a time (batch_size * n
    rows in one jitted prefill + while_loop); every batch has the same shape (the last is
    padded), so the decode loop compiles once per prompt-length bucket, and row r samples with
    fold_in(key, r), so the results do not depend on batch_size. Grading:
    `rejax.grading.grade_detail` for `task` (math: last `\\boxed{}` else the last number; mcq:
    the letter rules; code: every test in the sandbox; countdown: the last boxed expression,
    exactly), after every reference was checked.

    Args:
      params: the model (`rejax.load`), with a tokenizer.
      problems: dicts with `prompt` and `reference` (see `load_problems`), or for math
        `problem` and `answer` (see `load_jsonl`), or for countdown `problem`, `numbers` and
        `target` (`rejax.data.countdown` problems).
      sampler: Greedy / Temperature / ReSET (see `parse_sampler`).
      n: samples per problem (> 0).
      max_new_tokens: generation budget per sample (> 0).
      batch_size: problems per batch (default: min(#problems, max(1, 64 // n))).
      key: int seed.
      chat: render prompts with the chat template (None: when the checkpoint has one).
      progress: a tqdm bar on stderr counting problems done, with problems/s and the
        generated tokens/s (it moves when a batch finishes).
      ci_method: one of CI_METHODS (see `avg_at_n_ci`).
      task: one of `rejax.grading.TASKS` (how the responses are graded).
      timeout_s: code: wall-clock limit per test run.
      grade_workers: code: sandboxed runs at a time (default: min(4, CPU count)).

    Returns:
      EvalResult. Records hold `extracted` (math answer / letter / program), `extracted_by`
      (the rule that found it) and for code `failure` (the first failing test per sample, with
      its stderr tail; None when it passed). The summary adds `task`, `extracted_by` (counts
      per rule), `grade_s` (grading time; `wall_s` is generation only) and for math
      `n_last_number_fallback` / `n_last_number_fallback_correct`, for code and countdown
      `failure_status` (counts per failure kind).
    """
    from rejax.generate import generate
    from rejax.grading import TASKS, check_reference, grade_detail

    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive number of samples per problem, got {n!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not problems:
        raise ValueError("evaluate needs at least one problem")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    prompts, refs = [], []
    for i, p in enumerate(problems):
        prompt, ref = _prompt_and_reference(p, i, task)
        try:
            check_reference(ref, task)
        except ValueError as e:
            raise ValueError(f"problem {i}: {e}") from None
        prompts.append(prompt)
        refs.append(ref)
    if batch_size is None:
        batch_size = min(len(problems), max(1, 64 // n))
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if chat is None:
        chat = has_chat_template(params)
    t0 = time.perf_counter()
    bar = _ProblemProgress(len(problems), n) if progress else None
    try:
        gen = generate(
            params,
            prompts,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            key=key,
            n=n,
            batch_size=batch_size,
            chat=chat,
            progress=bar.update if bar is not None else False,
        )
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0  # generation only: code grading can take a while

    def _grade(r):
        return grade_detail(gen.text[r], refs[r // n], task, timeout_s=timeout_s)

    workers = grade_workers or (min(4, os.cpu_count() or 1) if task == "code" else 1)
    if workers > 1:  # each code grade waits on sandbox processes, so threads overlap them
        with ThreadPoolExecutor(workers) as pool:
            grades = list(pool.map(_grade, range(len(problems) * n)))
    else:
        grades = [_grade(r) for r in range(len(problems) * n)]
    records, correct = [], []
    for i, p in enumerate(problems):
        rows = range(i * n, (i + 1) * n)
        texts = [gen.text[r] for r in rows]
        ok = [grades[r].correct for r in rows]
        rec = dict(p)
        if task == "code":  # the tests can be megabytes: keep their count, not a copy
            rec["reference"] = {"n_tests": len(refs[i]["tests"]), "fn_name": refs[i]["fn_name"]}
        rec.update(
            index=i,
            responses=texts,
            extracted=[grades[r].extracted for r in rows],
            extracted_by=[grades[r].rule for r in rows],
            correct=ok,
            n_correct=sum(ok),
            num_tokens=[len(gen.tokens[r]) for r in rows],
            finish_reason=[gen.finish_reason[r] for r in rows],
            mean_entropy=[float(np.mean(gen.entropy[r])) if gen.entropy[r] else None for r in rows],
        )
        if task == "code":
            rec["failure"] = [grades[r].failure for r in rows]
        records.append(rec)
        correct.append(ok)
    tokens = gen.tokens
    correct = np.asarray(correct, dtype=bool)
    lengths = np.array([len(t) for t in tokens])
    finish = [f for r in records for f in r["finish_reason"]]
    summary = {
        "avg_at_n": avg_at_n_ci(correct, method=ci_method),
        "n": n,
        "n_problems": len(problems),
        "sampler": describe_sampler(sampler),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "chat": chat,
        "seed": key,
        "tokens_generated": int(lengths.sum()),
        "mean_response_tokens": float(lengths.mean()),
        "frac_length_capped": float(np.mean([f == "length" for f in finish])),
        "frac_no_answer": float(np.mean([a is None for r in records for a in r["extracted"]])),
        "task": task,
        "extracted_by": _counts(str(g.rule) if g.rule else "none" for g in grades),
        "wall_s": wall,
        "tokens_per_s": float(lengths.sum() / wall) if wall > 0 else None,
        "grade_s": time.perf_counter() - t0 - wall,
    }
    if task == "math":
        fallback = [g for g in grades if g.rule == "last_number"]
        summary["n_last_number_fallback"] = len(fallback)
        summary["n_last_number_fallback_correct"] = sum(g.correct for g in fallback)
    if task in ("code", "countdown"):
        summary["failure_status"] = _counts(g.failure["status"] for g in grades if g.failure)
    return EvalResult(records=records, correct=correct, summary=summary, tokens=tokens)


def _counts(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def _prompt_and_reference(p: dict, i: int, task: str):
    if "prompt" in p and "reference" in p:
        return p["prompt"], p["reference"]
    if task == "math" and "problem" in p and "answer" in p:
        return p["problem"], p["answer"]
    if task == "countdown" and {"problem", "numbers", "target"} <= set(p):
        return p["problem"], {"numbers": p["numbers"], "target": p["target"]}
    raise ValueError(
        f"problem {i} needs 'prompt' and 'reference' (see load_problems)"
        + (" or 'problem' and 'answer'" if task == "math" else "")
        + (" or 'problem', 'numbers' and 'target'" if task == "countdown" else "")
        + f", got keys {sorted(p)}"
    )


class _ProblemProgress:
    """tqdm bar over problems fed by `generate`'s per-batch progress callback."""

    def __init__(self, n_problems: int, n: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=n_problems, desc=f"eval (n={n})", unit="problem")
        self.tokens = 0
        self.t0 = time.perf_counter()

    def update(self, prompts: int, tokens: int) -> None:
        self.tokens += tokens
        wall = time.perf_counter() - self.t0
        rate = f"{self.tokens / wall:.0f} tok/s" if wall > 0 else ""
        self.bar.set_postfix_str(rate, refresh=False)  # drawn once, by the update below
        self.bar.update(prompts)

    def close(self) -> None:
        self.bar.close()


# ----------------------------------------------------------------------------------------------
# Teacher forcing


def teacher_forced_logits(params, sequences: Sequence[Sequence[int]], *, max_elems: int = 1 << 27):
    """Yields float32 logits [T_i, V] for each token sequence, computed in padded batches.

    Sequences are right-padded (causal attention keeps padding out of earlier positions) to a
    multiple of 64 and batched so that one batch's logits hold at most `max_elems` floats.
    """
    from rejax.generate import logits as _logits

    v = params.cfg.vocab_size
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: dict[int, np.ndarray] = {}
    i = 0
    while i < len(order):
        t_pad = -(-len(sequences[order[i]]) // 64) * 64
        # All sequences of this batch share the padded length of the longest one in it.
        rows = max(1, max_elems // (t_pad * v))
        group = order[i : i + rows]
        t_pad = -(-max(len(sequences[k]) for k in group) // 64) * 64
        batch = np.zeros((len(group), t_pad), np.int32)
        for r, k in enumerate(group):
            batch[r, : len(sequences[k])] = sequences[k]
        z = np.asarray(_logits(params, batch))
        for r, k in enumerate(group):
            out[k] = z[r, : len(sequences[k])]
        i += len(group)
    for k in range(len(sequences)):
        yield out.pop(k)


def _entropy_np(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    e = np.exp(z - m)
    s = e.sum(axis=-1, keepdims=True)
    p = e / s
    return (np.log(s[..., 0]) - (p * (z - m)).sum(axis=-1)).astype(np.float32)


def processed_entropy(
    z: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> np.ndarray:
    """Entropy (nats) of the distribution HF `output_scores` describe: logits / T, then top-k,
    then top-p (HF semantics: drop tokens whose ascending cumulative mass is <= 1 - top_p,
    keep at least one), renormalised; the log is clamped at 1e-12 as the official calibration.

    Args:
      z: float [..., V] raw logits.

    Returns:
      float32 [...].
    """
    z = z.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z >= kth, z, -np.inf)
    if top_p < 1.0:
        order = np.argsort(z, axis=-1)
        zs = np.take_along_axis(z, order, axis=-1)
        ps = np.exp(zs - zs[..., -1:])
        ps /= ps.sum(axis=-1, keepdims=True)
        remove = np.cumsum(ps, axis=-1) <= 1 - top_p
        remove[..., -1] = False
        mask = np.empty_like(remove)
        np.put_along_axis(mask, order, remove, axis=-1)
        z = np.where(mask, -np.inf, z)
    m = z.max(axis=-1, keepdims=True)
    p = np.exp(z - m)
    p /= p.sum(axis=-1, keepdims=True)
    h = -(p * np.log(np.maximum(p, 1e-12))).sum(axis=-1)
    return np.maximum(h, 0.0).astype(np.float32)  # no -0.0 for one-token distributions


# ----------------------------------------------------------------------------------------------
# τ0 calibration (the paper's recipe)


def _generation_setting(params, name, default):
    return dict(params.generation_config).get(name, default)


def calibrate_tau0(
    params,
    problems: Sequence[dict],
    *,
    n_problems: int = 5,
    max_new_tokens: int = 4096,
    temperature: float = CALIBRATION_TEMPERATURE,
    top_p: float | None = None,
    top_k: int | None = None,
    percentile: float = CALIBRATION_PERCENTILE,
    key: int = 0,
    chat: bool | None = None,
    processed: bool = True,
) -> dict:
    """τ0 = a percentile of all token entropies the model produces on calibration problems.

    Samples one response per problem at `temperature` (the paper: NVFP4 model, T = 0.6, the
    checkpoint's generation_config top-k / top-p), concatenates the raw full-vocabulary T=1
    entropy of every generated token (what ReSET thresholds: `Generation.entropy`) and takes
    its `percentile`-th percentile (numpy linear interpolation). With `processed=True` the
    responses are also teacher-forced through the same model to get the entropy of the
    processed distribution (T, top-k, top-p; what HF `output_scores` hold) and its percentile;
    the raw one is the τ0 this function returns.

    Args:
      params: the model to calibrate (the NVFP4 one for ReSET).
      problems: dicts with `problem`; the first `n_problems` are used.
      top_p, top_k: None = the generation_config's value (else 0.95 and 0).

    Returns:
      dict with `tau0` (= `tau0_raw`), `tau0_processed` (or None), `percentile`, `n_tokens`,
      `entropy_raw` (float32 array of all token entropies), `entropy_processed` (or None),
      `response_lengths`, `sampler`, `teacher_forced_max_abs_diff` (raw entropy recomputed from
      teacher-forced logits vs the decode loop's; a consistency check), `used` = "raw".
    """
    from rejax import sampling
    from rejax.generate import generate

    if not isinstance(n_problems, int) or n_problems <= 0:
        raise ValueError(f"n_problems must be a positive int, got {n_problems!r}")
    if len(problems) < n_problems:
        raise ValueError(f"calibration needs {n_problems} problems, the data holds {len(problems)}")
    if not 0 < percentile < 100:
        raise ValueError(f"percentile must be in (0, 100), got {percentile}")
    if chat is None:
        chat = has_chat_template(params)
    top_p = float(_generation_setting(params, "top_p", 0.95) if top_p is None else top_p)
    top_k = int(_generation_setting(params, "top_k", 0) if top_k is None else top_k)
    top_k = min(top_k, params.cfg.vocab_size)
    sampler = sampling.Temperature(t=temperature, top_p=top_p, top_k=top_k)
    texts = [p["problem"] for p in problems[:n_problems]]
    gen = generate(
        params,
        texts,
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        key=key,
        n=1,
        chat=chat,
        progress=False,
    )
    raw = np.concatenate([np.asarray(e, np.float32) for e in gen.entropy])
    if raw.size == 0:
        raise ValueError("calibration generated no tokens")
    out = {
        "tau0": float(np.percentile(raw, percentile)),
        "tau0_raw": float(np.percentile(raw, percentile)),
        "tau0_processed": None,
        "used": "raw",
        "percentile": percentile,
        "n_problems": n_problems,
        "n_tokens": int(raw.size),
        "entropy_raw": raw,
        "entropy_processed": None,
        "response_lengths": [len(t) for t in gen.tokens],
        "sampler": describe_sampler(sampler),
        "max_new_tokens": max_new_tokens,
        "chat": chat,
        "seed": key,
        "teacher_forced_max_abs_diff": None,
    }
    if processed:
        seqs, spans = [], []
        for text, toks in zip(texts, gen.tokens):
            ids = prompt_ids(params, text, chat=chat)
            seqs.append(ids + list(toks))
            spans.append((len(ids) - 1, len(ids) - 1 + len(toks)))
        proc, diff = [], 0.0
        for (a, b), z, ent in zip(spans, teacher_forced_logits(params, seqs), gen.entropy):
            zr = z[a:b]  # logits that predicted each generated token
            proc.append(processed_entropy(zr, temperature, top_p, top_k))
            if b > a:
                diff = max(diff, float(np.max(np.abs(_entropy_np(zr) - np.asarray(ent)))))
        proc = np.concatenate(proc)
        out["entropy_processed"] = proc
        out["tau0_processed"] = float(np.percentile(proc, percentile))
        out["teacher_forced_max_abs_diff"] = diff
    return out


# ----------------------------------------------------------------------------------------------
# Observation statistics (PAPER claim (i))


OBSERVATION_SETS = ("all", "low", "high", "low_symbolic")


def observation_stats(
    ref_params,
    problems: Sequence[dict],
    tokens: Sequence[Sequence[int]],
    *,
    n: int,
    tau0: float,
    chat: bool | None = None,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict:
    """How often sampled tokens leave the reference (BF16) model's argmax, by reference entropy.

    Each response is teacher-forced through `ref_params`; at every generated position the
    reference entropy H_ref (raw, T=1, full vocabulary) and argmax are recorded. A position is
    *low-entropy* when H_ref < tau0 and *symbolic* when the reference argmax decodes to text
    containing a digit. For samples from the reference model itself the off-argmax rate is the
    sampler's own; for NVFP4 samples it adds the quantization's argmax flips (claim (i)).

    Args:
      ref_params: the BF16 model.
      problems: the problems the responses answer (`problem` field), in order.
      tokens: generated ids, problem-major: responses i*n .. i*n+n-1 answer problems[i].
      n: samples per problem.
      tau0: the low-entropy threshold (nats).

    Returns:
      `summarize_observations` of the per-problem counts: for all / low / high / low-symbolic
      positions the counts `n_*`, off-argmax counts `off_*`, rates `rate_*` and bootstrap 95%
      CIs over problems `ci_*`, the mean reference NLL of the sampled tokens at low-entropy
      positions, and `counts` (int [P, 4, 2]: positions and off-argmax per set) and
      `nll_low` (float [P, 2]: NLL sum and count) for merging runs.
    """
    if len(tokens) != len(problems) * n:
        raise ValueError(
            f"expected {len(problems)} problems x n={n} = {len(problems) * n} "
            f"responses, got {len(tokens)}"
        )
    if chat is None:
        chat = has_chat_template(ref_params)
    tok = ref_params.tokenizer.tokenizer
    v = ref_params.cfg.vocab_size
    digit = np.zeros((v,), bool)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    pieces = tok.decode_batch([[i] for i in range(min(v, n_tok))], skip_special_tokens=False)
    digit[: len(pieces)] = [any(c.isdigit() for c in s) for s in pieces]

    seqs, spans = [], []
    for i, p in enumerate(problems):
        ids = prompt_ids(ref_params, p["problem"], chat=chat)
        for r in range(i * n, (i + 1) * n):
            seqs.append(ids + list(tokens[r]))
            # logits at position j predict token j + 1: the generated tokens are predicted
            # from positions len(ids) - 1 .. len(ids) + len - 2
            spans.append((len(ids) - 1, len(ids) - 1 + len(tokens[r])))
    counts = np.zeros((len(problems), len(OBSERVATION_SETS), 2), np.int64)
    nll_low = np.zeros((len(problems), 2), np.float64)
    for s, ((a, b), z) in enumerate(zip(spans, teacher_forced_logits(ref_params, seqs))):
        if b == a:
            continue
        i = s // n
        z = z[a:b].astype(np.float64)
        y = np.asarray(seqs[s][a + 1 : b + 1])
        h = _entropy_np(z)
        am = z.argmax(axis=-1)
        off = am != y
        low = h < tau0
        masks = (np.ones_like(low), low, ~low, low & digit[am])
        for k, m in enumerate(masks):
            counts[i, k] += (m.sum(), (off & m).sum())
        m = z.max(-1)
        nll = np.log(np.exp(z - m[:, None]).sum(-1)) + m - z[np.arange(len(y)), y]
        nll_low[i] += (nll[low].sum(), low.sum())
    out = summarize_observations(counts, nll_low, n_boot=n_boot, seed=seed)
    out.update(tau0=tau0, n_responses=len(seqs))
    return out


def summarize_observations(counts, nll_low, *, n_boot: int = 2000, seed: int = 0) -> dict:
    """Rates and bootstrap CIs (resampling problems) from `observation_stats` counts.

    Args:
      counts: int [P, 4, 2] per problem and set (`OBSERVATION_SETS`): (positions, off-argmax).
      nll_low: float [P, 2] per problem: (sum of reference NLL at low-entropy positions, count).

    Returns:
      dict with `n_<set>`, `off_<set>`, `rate_<set>` (None without positions) and `ci_<set>`
      (95% percentile interval of the pooled rate over `n_boot` resamples of the problems),
      `mean_ref_nll_low`, and the inputs as lists under `counts` / `nll_low`.
    """
    counts = np.asarray(counts, np.int64)
    nll_low = np.asarray(nll_low, np.float64)
    rng = np.random.default_rng(seed)
    boot = rng.integers(0, len(counts), size=(n_boot, len(counts)))
    out = {}
    for k, name in enumerate(OBSERVATION_SETS):
        c = counts[:, k]
        total, off = int(c[:, 0].sum()), int(c[:, 1].sum())
        out[f"n_{name}"] = total
        out[f"off_{name}"] = off
        out[f"rate_{name}"] = off / total if total else None
        out[f"ci_{name}"] = None
        if total:
            bt = c[boot].sum(axis=1)  # [n_boot, 2]
            with np.errstate(invalid="ignore", divide="ignore"):
                r = bt[:, 1] / bt[:, 0]
            lo, hi = np.nanquantile(r, [0.025, 0.975])
            out[f"ci_{name}"] = [float(lo), float(hi)]
    n_low = nll_low[:, 1].sum()
    out["mean_ref_nll_low"] = float(nll_low[:, 0].sum() / n_low) if n_low else None
    out["counts"] = counts.tolist()
    out["nll_low"] = nll_low.tolist()
    return out


def write_calibration(
    out_dir: str | Path,
    result: dict,
    reference: dict | None = None,
    *,
    quant: str = "nvfp4",
    meta: dict | None = None,
    prefix: str = "calibrate",
) -> list[Path]:
    """Writes a calibration (`calibrate_tau0` results) to `out_dir`.

    Files: `{prefix}.json` (τ0 values, settings, `meta`), `{prefix}_entropies.npz` (every token
    entropy: `<quant>_raw`, `<quant>_processed`, and `bf16_*` for the reference) and
    `{prefix}_entropy.png` (histograms of the reference vs the calibrated model with the
    percentile marked; skipped with a message on stderr when matplotlib is not installed).

    Returns:
      the paths written.
    """
    import sys

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {quant: result} if reference is None else {"bf16": reference, quant: result}
    arrays = {}
    for name, r in runs.items():
        arrays[f"{name}_raw"] = np.asarray(r["entropy_raw"], np.float32)
        if r.get("entropy_processed") is not None:
            arrays[f"{name}_processed"] = np.asarray(r["entropy_processed"], np.float32)
    npz = out_dir / f"{prefix}_entropies.npz"
    np.savez_compressed(npz, **arrays)

    def _public(r):
        return {k: v for k, v in r.items() if not k.startswith("entropy_")}

    summary = dict(meta or {})
    summary.update(
        tau0=result["tau0"],
        used=result["used"],
        quant=quant,
        calibration=_public(result),
        reference_bf16=None if reference is None else _public(reference),
        entropy_stats={k: _describe(v) for k, v in arrays.items()},
        files={"entropies": npz.name},
    )
    files = [npz]
    png = out_dir / f"{prefix}_entropy.png"
    try:
        _plot_entropies(png, runs, quant, result["percentile"])
        summary["files"]["plot"] = png.name
        files.append(png)
    except ImportError:
        print(
            "rejax calibrate: matplotlib is not installed, skipping the entropy plot "
            "(pip install matplotlib)",
            file=sys.stderr,
        )
    js = out_dir / f"{prefix}.json"
    js.write_text(json.dumps(summary, indent=2) + "\n")
    return [js, *files]


def _describe(x: np.ndarray) -> dict:
    q = np.percentile(x, [50, 80, 90, 99]) if x.size else [math.nan] * 4
    return {
        "n": int(x.size),
        "mean": float(x.mean()) if x.size else None,
        "p50": float(q[0]),
        "p80": float(q[1]),
        "p90": float(q[2]),
        "p99": float(q[3]),
        "frac_below_0.1": float(np.mean(x < 0.1)) if x.size else None,
    }


def _plot_entropies(path: Path, runs: dict, quant: str, percentile: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("raw", "processed") if all(k in _kinds(r) for r in runs.values())]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        top = max(float(np.max(r[f"entropy_{kind}"])) for r in runs.values())
        bins = np.linspace(0.0, max(top, 1e-3), 60)
        for (name, r), color in zip(runs.items(), ("tab:blue", "tab:red")):
            h = np.asarray(r[f"entropy_{kind}"])
            q = float(np.percentile(h, percentile))
            ax.hist(
                h,
                bins=bins,
                density=True,
                histtype="step",
                lw=1.6,
                color=color,
                label=f"{name} (n={h.size}, p{percentile:g}={q:.3g})",
            )
            ax.axvline(q, color=color, ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("token entropy (nats)")
        ax.set_ylabel("density")
        title = "raw logits, T=1, full vocabulary" if kind == "raw" else "processed scores"
        ax.set_title(f"{title} (tau0 = {quant} p{percentile:g})" if kind == "raw" else title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _kinds(r: dict) -> set:
    return {k for k in ("raw", "processed") if r.get(f"entropy_{k}") is not None}
