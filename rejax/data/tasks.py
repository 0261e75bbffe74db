"""Seeded multi-step arithmetic problems with step-by-step solutions (the tiny model's task).

A problem asks for the value of an integer expression with 2-5 operations (`+ - * /`,
parentheses). Its solution evaluates one operation per reasoning step; steps are separated by
a blank line ("\\n\\n", the step boundary the ReSET sampler watches) and the last line is
`The answer is \\boxed{...}`. Answers are integers (mostly small, sometimes negative) or, for a
few problems whose last operation is an inexact division, a reduced fraction `\\frac{a}{b}`.

Splits are disjoint by construction: a problem belongs to exactly one split, chosen by a hash
of its text (`split_of`), and `split(name, ...)` keeps only that split's problems.

Example:
    >>> import random
    >>> p = make_problem(random.Random(0))
    >>> sorted(p)
    ['answer', 'problem', 'solution']
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from collections.abc import Iterable, Iterator
from fractions import Fraction

# Hash buckets out of 100 per split: train 90%, validation 5%, test 5%.
SPLITS = {"train": range(90), "validation": range(90, 95), "test": range(95, 100)}
MIN_OPS, MAX_OPS = 2, 5
MAX_LEAF = 30  # numbers in a problem are 1..30
MAX_ABS_VALUE = 999  # every intermediate value stays within [-999, 999]
FRACTION_PROB = 0.15  # share of problems whose final division may leave a fraction
_OPS = "+-*/"
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_STEP_WORDS = ("First", "Next", "Then", "After that")  # "Finally" opens the last step

# The chat format the tiny model is trained on (ChatML, as Qwen3 uses, without a system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclasses.dataclass
class _Node:
    op: str | None = None  # None for a leaf
    value: Fraction = Fraction(0)  # leaves: the number; inner nodes: filled by evaluation
    left: _Node | None = None
    right: _Node | None = None


def _random_tree(rng: random.Random, n_ops: int) -> _Node:
    if n_ops == 0:
        return _Node(value=Fraction(rng.randint(1, MAX_LEAF)))
    n_left = rng.randint(0, n_ops - 1)
    op = rng.choice(_OPS)
    node = _Node(op, left=_random_tree(rng, n_left), right=_random_tree(rng, n_ops - 1 - n_left))
    # Keep leaf-by-leaf products and quotients small, and such quotients exact.
    if node.left.op is None and node.right.op is None:
        if op == "*":
            node.left.value, node.right.value = (
                Fraction(rng.randint(2, 12)),
                Fraction(rng.randint(2, 12)),
            )
        elif op == "/":
            divisor = rng.randint(2, 9)
            node.left.value = Fraction(divisor * rng.randint(1, 12))
            node.right.value = Fraction(divisor)
    return node


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def _format_value(v: Fraction, *, latex: bool) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    sign = "-" if v < 0 else ""
    if latex:
        return f"{sign}\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}"
    return f"{sign}{abs(v.numerator)}/{v.denominator}"


def _render(node: _Node, parent_prec: int = 0, right_side: bool = False) -> str:
    if node.op is None:
        text = _format_value(node.value, latex=False)
        return f"({text})" if node.value < 0 and parent_prec else text
    prec = _PRECEDENCE[node.op]
    text = f"{_render(node.left, prec)} {node.op} {_render(node.right, prec, right_side=True)}"
    # Parenthesize a lower-precedence child, and an equal-precedence right child
    # (a - (b - c), a / (b * c)) since the operators are left-associative.
    if prec < parent_prec or (right_side and prec == parent_prec):
        return f"({text})"
    return text


def _ready_nodes(node: _Node) -> list[_Node]:
    """Operation nodes whose operands are both numbers, left to right."""
    if node.op is None:
        return []
    if node.left.op is None and node.right.op is None:
        return [node]
    return _ready_nodes(node.left) + _ready_nodes(node.right)


def _solve(root: _Node, allow_fraction: bool) -> tuple[list[str], Fraction] | None:
    """Evaluates `root` in place one operation at a time; None if a constraint fails."""
    steps = []
    while root.op is not None:
        node = _ready_nodes(root)[0]
        a, b = node.left.value, node.right.value
        if node.op == "/" and b == 0:
            return None
        value = _apply(node.op, a, b)
        if value.denominator != 1 and not (allow_fraction and node is root):
            return None
        if abs(value) > MAX_ABS_VALUE:
            return None
        lhs = f"{_render(node.left, 3)} {node.op} {_render(node.right, 3)}"
        result = _format_value(value, latex=False)
        node.op, node.value, node.left, node.right = None, value, None, None
        if root.op is None:
            steps.append(f"{lhs} = {result}.")
        else:
            steps.append(f"{lhs} = {result}, so the expression becomes {_render(root)}.")
    return steps, root.value


def make_problem(rng: random.Random, *, min_ops: int = MIN_OPS, max_ops: int = MAX_OPS) -> dict:
    """Draws one problem.

    Args:
        rng: the random source (`random.Random`); the result is a function of its state.
        min_ops, max_ops: inclusive range for the number of operations (1 <= min_ops <= max_ops).

    Returns:
        {"problem": str, "solution": str, "answer": str}. The solution is the reasoning steps
        joined by "\\n\\n", ending with `The answer is \\boxed{answer}.`; `answer` is the boxed
        string (an integer such as "-12", or a LaTeX fraction such as "\\frac{7}{2}").
    """
    if not 1 <= min_ops <= max_ops:
        raise ValueError(f"need 1 <= min_ops <= max_ops, got min_ops={min_ops}, max_ops={max_ops}")
    while True:
        n_ops = rng.randint(min_ops, max_ops)
        allow_fraction = rng.random() < FRACTION_PROB
        root = _random_tree(rng, n_ops)
        if allow_fraction and root.op == "/" and root.right.op is None:
            root.right.value = Fraction(rng.randint(2, 9))  # usually leaves a remainder
        expression = _render(root)
        solved = _solve(root, allow_fraction)
        if solved is None:
            continue
        steps, value = solved
        if len(steps) == 1:
            body = list(steps)
        else:
            words = [_STEP_WORDS[min(i, len(_STEP_WORDS) - 1)] for i in range(len(steps) - 1)]
            body = [f"{w}, {s}" for w, s in zip(words + ["Finally"], steps)]
        answer = _format_value(value, latex=True)
        if value.denominator != 1:
            body.append(f"In lowest terms that is {answer}.")
        body.append(f"The answer is \\boxed{{{answer}}}.")
        return {
            "problem": f"Evaluate {expression}.",
            "solution": "\n\n".join(body),
            "answer": answer,
        }


def split_of(problem: str) -> str:
    """The split ("train", "validation" or "test") that a problem text belongs to."""
    bucket = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "little") % 100
    for name, buckets in SPLITS.items():
        if bucket in buckets:
            return name
    raise AssertionError(bucket)


def _check_split(name: str) -> None:
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; expected one of {sorted(SPLITS)}")


def iter_split(name: str, seed: int = 0) -> Iterator[dict]:
    """An endless, deterministic stream of problems of one split (may repeat problems)."""
    _check_split(name)
    rng = random.Random(f"rejax-tasks:{name}:{seed}")
    while True:
        p = make_problem(rng)
        if split_of(p["problem"]) == name:
            yield p


def split(name: str, n: int, seed: int = 0) -> list[dict]:
    """The first `n` distinct problems of split `name` for `seed` (deterministic).

    Problems of different splits never coincide, whatever the seeds: membership is decided by
    a hash of the problem text.
    """
    _check_split(name)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    seen, out = set(), []
    for p in iter_split(name, seed):
        if len(out) == n:
            break
        if p["problem"] not in seen:
            seen.add(p["problem"])
            out.append(p)
    return out


def chat_prompt(problem: str) -> str:
    """The problem as one user turn in the chat format, ready for the assistant's answer.

    Equal to rendering `CHAT_TEMPLATE` with one user message and add_generation_prompt=True.
    """
    return f"<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"


def training_text(example: dict, chat: bool = True) -> str:
    """A full training sequence: prompt, solution and end-of-turn / end-of-text marker."""
    if chat:
        return chat_prompt(example["problem"]) + example["solution"] + "<|im_end|>"
    return raw_prompt(example["problem"]) + example["solution"] + "<|endoftext|>"


def raw_prompt(problem: str) -> str:
    """The problem as a plain-text prompt (no chat template): the text and a blank line."""
    return f"{problem}\n\n"


def write_jsonl(problems: Iterable[dict], path: str | os.PathLike) -> None:
    """Writes one {"problem", "answer"} JSON object per line (the AIME dataset layout)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"problem": p["problem"], "answer": p["answer"]}) + "\n" for p in problems
        )


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Reads a JSONL file of problems; every line needs "problem" and "answer" fields."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"problem", "answer"} - set(row)
            if missing:
                raise ValueError(f"{path}:{lineno}: missing field(s) {sorted(missing)} in {row}")
            row["answer"] = str(row["answer"])
            out.append(row)
    return out
