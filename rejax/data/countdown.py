"""Seeded Countdown problems with backtracking search traces (the search reasoner's task).

A problem gives `n_numbers` positive integers and a target; the answer is an expression that
uses every number exactly once with `+ - * /` and parentheses and equals the target (graded
exactly by `rejax.eval.grading`, task "countdown"). The generator plays integer Countdown: every
intermediate value is a positive integer no larger than `max_value` (subtraction only of a
smaller number, division only when exact), so every target it asks for is reachable that way.

The solution is a depth-first search written out one expansion per reasoning step, steps
separated by a blank line ("\\n\\n", the boundary the ReSET sampler watches). A step starts from
a state (the numbers still to combine, largest first), picks two of them and an operation (the
*choice*), then writes the result and the new state (*forced* arithmetic):

    Make 36 from 4 5 2 12.

    12 5 4 2: 4+2=6, left 12 6 5.

    12 6 5: 12+5=17, left 17 6: no.

    12 6 5: 12/6=2, left 5 2: no.

    12 5 4 2: 4/2=2, left 12 5 2.

    12 5 2: 5-2=3, left 12 3: 12*3=36.

    The answer is \\boxed{12*(5-4/2)}.

When two numbers are left, the step ends with `: no.` or with the operation that reaches the
target. A step that starts from an earlier state is a backtrack. The search is random but
guided: at every state the next child is one from which the target is still reachable with
probability `guide`, else a dead end; at most `max_wrong` dead ends are tried per state, and a
dead-end branch with three or more numbers is abandoned after 1..`dead_tries` leaf checks. The
answer is the solution path as one expression with the fewest parentheses.

Splits are disjoint by construction: a problem belongs to one split, chosen by a hash of its
canonical form (sorted numbers and target, `split_of`), so a reordering of the same numbers can
never sit in two splits. The difficulty parameters (`Difficulty`) change which problems and
traces are drawn, not the split of a given problem.

Example:
    >>> import random
    >>> p = make_problem(random.Random(0))
    >>> sorted(p)
    ['answer', 'numbers', 'problem', 'solution', 'target']
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
from collections.abc import Iterable, Iterator

from rejax.data.tasks import CHAT_TEMPLATE, SPECIAL_TOKENS, chat_prompt, raw_prompt

__all__ = [
    "CHAT_TEMPLATE",
    "DIFFICULTY_FILE",
    "SPECIAL_TOKENS",
    "SPLITS",
    "Difficulty",
    "chat_prompt",
    "iter_split",
    "load_difficulty",
    "make_problem",
    "raw_prompt",
    "read_jsonl",
    "save_difficulty",
    "solutions",
    "split",
    "split_of",
    "training_text",
    "write_jsonl",
]

# Hash buckets out of 100 per split: train 90%, validation 5%, test 5%.
SPLITS = {"train": range(90), "validation": range(90, 95), "test": range(95, 100)}
_OPS = "+-*/"
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclasses.dataclass(frozen=True)
class Difficulty:
    """What problems and traces `make_problem` draws.

    Attributes:
        n_numbers: numbers per problem (3..5).
        max_number: the numbers are drawn from 1..max_number.
        min_target, max_target: the target's range (inclusive).
        max_value: no intermediate value may exceed it.
        max_solutions: only targets reached by at most this many search paths (0: any); fewer
            paths make a problem harder to find by search.
        guide: probability that the next child tried at a state is one that can still reach
            the target (the rest of the time: a dead end, while untried ones remain).
        max_wrong: dead-end children tried per state at most.
        dead_tries: a dead-end branch of 3+ numbers is left after 1..dead_tries leaf checks.
    """

    n_numbers: int = 4
    max_number: int = 13
    min_target: int = 10
    max_target: int = 99
    max_value: int = 999
    max_solutions: int = 0
    guide: float = 0.5
    max_wrong: int = 3
    dead_tries: int = 2

    def __post_init__(self):
        checks = (
            ("n_numbers", 3 <= self.n_numbers <= 5, "3 <= n_numbers <= 5"),
            ("max_number", 2 <= self.max_number <= self.max_value, "2 <= max_number <= max_value"),
            (
                "min_target",
                1 <= self.min_target <= self.max_target <= self.max_value,
                "1 <= min_target <= max_target <= max_value",
            ),
            ("max_solutions", self.max_solutions >= 0, "max_solutions >= 0"),
            ("guide", 0.0 < self.guide <= 1.0, "0 < guide <= 1"),
            ("max_wrong", self.max_wrong >= 0, "max_wrong >= 0"),
            ("dead_tries", self.dead_tries >= 1, "dead_tries >= 1"),
        )
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"Difficulty.{name}={getattr(self, name)!r}: expected {want}")


DEFAULT = Difficulty()

# The difficulty a checkpoint was trained on, saved beside its config.json, so its test problems
# are drawn from the same family.
DIFFICULTY_FILE = "countdown_difficulty.json"


def save_difficulty(model_dir: str | os.PathLike, difficulty: Difficulty) -> None:
    """Writes `difficulty` as MODEL_DIR/countdown_difficulty.json."""
    path = os.path.join(model_dir, DIFFICULTY_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(difficulty), f, indent=1)
        f.write("\n")


def load_difficulty(model_dir: str | os.PathLike) -> Difficulty | None:
    """The difficulty saved in MODEL_DIR (`save_difficulty`), or None when there is none.

    Raises:
        ValueError: the file holds an unknown field or an invalid value.
    """
    path = os.path.join(model_dir, DIFFICULTY_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        fields = json.load(f)
    known = {f.name for f in dataclasses.fields(Difficulty)}
    if not isinstance(fields, dict) or not set(fields) <= known:
        raise ValueError(
            f"{path}: expected an object with fields among {sorted(known)}, got {fields!r}"
        )
    return Difficulty(**fields)


# ----------------------------------------------------------------------------------------------
# Integer Countdown moves (states are tuples sorted largest first)


def _moves(state: tuple[int, ...], max_value: int) -> list[tuple[int, str, int, int, tuple]]:
    """Every (x, op, y, result, new state) from `state`, x >= y, in a fixed order."""
    out = []
    for i in range(len(state)):
        for j in range(i + 1, len(state)):
            x, y = state[i], state[j]
            rest = state[:i] + state[i + 1 : j] + state[j + 1 :]
            for op in _OPS:
                r = _apply_int(op, x, y)
                if r is None or r > max_value:
                    continue
                out.append((x, op, y, r, tuple(sorted((*rest, r), reverse=True))))
    # Equal numbers give the same move twice; keep the first.
    seen, unique = set(), []
    for m in out:
        if m[:3] not in seen:
            seen.add(m[:3])
            unique.append(m)
    return unique


def _apply_int(op: str, x: int, y: int) -> int | None:
    if op == "+":
        return x + y
    if op == "-":
        return x - y if x > y else None
    if op == "*":
        return x * y
    return x // y if x % y == 0 else None


@functools.lru_cache(maxsize=1 << 20)
def _paths(state: tuple[int, ...], max_value: int) -> dict[int, int]:
    """{value: number of search paths from `state` that end on it} (one number left)."""
    if len(state) == 1:
        return {state[0]: 1}
    out: dict[int, int] = {}
    for *_, new in _moves(state, max_value):
        for v, c in _paths(new, max_value).items():
            out[v] = out.get(v, 0) + c
    return out


def solutions(numbers: Iterable[int], target: int, max_value: int = DEFAULT.max_value) -> int:
    """How many search paths (integer Countdown, intermediates <= max_value) reach `target`."""
    state = tuple(sorted(numbers, reverse=True))
    return _paths(state, max_value).get(target, 0)


def _reaches(state: tuple[int, ...], target: int, max_value: int) -> bool:
    return target in _paths(state, max_value)


# ----------------------------------------------------------------------------------------------
# Traces


def _state_text(state: tuple[int, ...]) -> str:
    return " ".join(map(str, state))


def _expression(op: str, left: tuple[str, int], right: tuple[str, int]) -> tuple[str, int]:
    """(text, precedence) of `left op right` with the parentheses that are needed."""
    prec = _PRECEDENCE[op]
    lt = left[0] if left[1] >= prec else f"({left[0]})"
    # Equal-precedence right operands need parentheses after - and / (a - (b + c)).
    rt = right[0] if right[1] > prec or (right[1] == prec and op in "+*") else f"({right[0]})"
    return f"{lt}{op}{rt}", prec


_LEAF = 3  # precedence of a bare number
_MAX_DRAWS = 10_000  # number draws before a difficulty is declared impossible
_MAX_STALE = 20_000  # split draws in a row without a new problem before giving up


class _Search:
    def __init__(self, rng: random.Random, target: int, d: Difficulty):
        self.rng, self.target, self.d = rng, target, d
        self.steps: list[str] = []
        self.answer: str | None = None

    def run(self, state: tuple[int, ...], exprs: dict) -> bool:
        """Explores `state` (exprs: value -> list of (text, precedence)); True when solved."""
        d = self.d
        moves = _moves(state, d.max_value)
        good = [m for m in moves if self._good(m[4])]
        bad = [m for m in moves if not self._good(m[4])]
        self.rng.shuffle(good)
        self.rng.shuffle(bad)
        wrong = 0
        while good:
            if bad and wrong < d.max_wrong and self.rng.random() >= d.guide:
                move, wrong = bad.pop(), wrong + 1
                self._step(state, move, exprs)
                if len(move[4]) > 2:
                    self._dead_end(move[4], self._child_exprs(move, exprs))
                continue
            move = good.pop()
            child = self._child_exprs(move, exprs)
            if self._step(state, move, exprs, child):
                return True
            if self.run(move[4], child):
                return True
        raise AssertionError("a good child always leads to the target")

    def _good(self, state: tuple[int, ...]) -> bool:
        if len(state) == 2:
            return any(m[3] == self.target for m in _moves(state, self.d.max_value))
        return _reaches(state, self.target, self.d.max_value)

    def _dead_end(self, state: tuple[int, ...], exprs: dict) -> None:
        moves = _moves(state, self.d.max_value)
        for move in self.rng.sample(moves, min(len(moves), self.rng.randint(1, self.d.dead_tries))):
            self._step(state, move, exprs)
            if len(move[4]) > 2:
                self._dead_end(move[4], self._child_exprs(move, exprs))

    @staticmethod
    def _child_exprs(move, exprs: dict) -> dict:
        x, op, y, r, _ = move
        child = {v: list(e) for v, e in exprs.items()}
        ex = child[x].pop()
        ey = child[y].pop()
        child.setdefault(r, []).append(_expression(op, ex, ey))
        return child

    def _step(self, state, move, exprs, child=None) -> bool:
        """Writes one expansion; True when it reaches the target (the answer is then set)."""
        x, op, y, r, new = move
        text = f"{_state_text(state)}: {x}{op}{y}={r}, left {_state_text(new)}"
        if len(new) > 2:
            self.steps.append(text + ".")
            return False
        hit = [m for m in _moves(new, self.d.max_value) if m[3] == self.target]
        if not hit:
            self.steps.append(text + ": no.")
            return False
        a, op2, b, _, _ = hit[0]
        self.steps.append(f"{text}: {a}{op2}{b}={self.target}.")
        child = child if child is not None else self._child_exprs(move, exprs)
        ea, eb = child[a].pop(), child[b].pop()
        self.answer = _expression(op2, ea, eb)[0]
        return True


def _trace(numbers: list[int], target: int, rng: random.Random, d: Difficulty) -> dict:
    state = tuple(sorted(numbers, reverse=True))
    exprs: dict = {}
    for v in state:
        exprs.setdefault(v, []).append((str(v), _LEAF))
    search = _Search(rng, target, d)
    search.run(state, exprs)
    body = [*search.steps, f"The answer is \\boxed{{{search.answer}}}."]
    return {
        "problem": problem_text(numbers, target),
        "numbers": list(numbers),
        "target": target,
        "solution": "\n\n".join(body),
        "answer": search.answer,
    }


def problem_text(numbers: Iterable[int], target: int) -> str:
    """The prompt of a problem: `Make <target> from <numbers>.` (numbers in the given order)."""
    return f"Make {target} from {' '.join(map(str, numbers))}."


def make_problem(rng: random.Random, difficulty: Difficulty = DEFAULT) -> dict:
    """Draws one problem and a search trace that solves it.

    Args:
        rng: the random source (`random.Random`); the result is a function of its state.
        difficulty: what to draw (`Difficulty`).

    Returns:
        {"problem": str, "numbers": list[int], "target": int, "solution": str, "answer": str}.
        The numbers are in prompt order; the solution is the search steps joined by "\\n\\n",
        ending with `The answer is \\boxed{answer}.`; `answer` is one correct expression.
    """
    d = difficulty
    if not isinstance(d, Difficulty):
        raise ValueError(f"difficulty must be a Difficulty, got {type(d).__name__}")  # noqa: TRY004
    for _ in range(_MAX_DRAWS):
        numbers = [rng.randint(1, d.max_number) for _ in range(d.n_numbers)]
        reach = _paths(tuple(sorted(numbers, reverse=True)), d.max_value)
        targets = sorted(
            v
            for v, c in reach.items()
            if d.min_target <= v <= d.max_target and (d.max_solutions == 0 or c <= d.max_solutions)
        )
        if not targets:
            continue
        return _trace(numbers, rng.choice(targets), rng, d)
    raise ValueError(f"no target in range after {_MAX_DRAWS} draws of numbers for {d}")


def split_of(numbers: Iterable[int], target: int) -> str:
    """The split ("train", "validation" or "test") of the problem (sorted numbers, target)."""
    key = f"countdown:{target}:{','.join(map(str, sorted(numbers)))}"
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % 100
    for name, buckets in SPLITS.items():
        if bucket in buckets:
            return name
    raise AssertionError(bucket)


def _check_split(name: str) -> None:
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; expected one of {sorted(SPLITS)}")


def iter_split(name: str, seed: int = 0, difficulty: Difficulty = DEFAULT) -> Iterator[dict]:
    """An endless, deterministic stream of problems of one split (may repeat problems)."""
    _check_split(name)
    rng = random.Random(f"rejax-countdown:{name}:{seed}:{difficulty}")
    while True:
        p = make_problem(rng, difficulty)
        if split_of(p["numbers"], p["target"]) == name:
            yield p


def split(name: str, n: int, seed: int = 0, difficulty: Difficulty = DEFAULT) -> list[dict]:
    """The first `n` distinct problems (by sorted numbers and target) of split `name`.

    Problems of different splits never coincide, whatever the seeds and difficulties:
    membership is decided by a hash of the canonical problem.

    Raises:
        ValueError: an unknown split, n < 0, or a difficulty with fewer than `n` distinct
            problems in the split (no new one in `_MAX_STALE` draws in a row).
    """
    _check_split(name)
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    seen, out, stale = set(), [], 0
    for p in iter_split(name, seed, difficulty):
        if len(out) == n:
            break
        key = (p["target"], tuple(sorted(p["numbers"])))
        if key not in seen:
            seen.add(key)
            out.append(p)
            stale = 0
        elif (stale := stale + 1) > _MAX_STALE:
            raise ValueError(
                f"split {name!r} of {difficulty} ran out of distinct problems at {len(out)} "
                f"(asked for {n}): widen the difficulty's ranges"
            )
    return out


def training_text(example: dict, chat: bool = True) -> str:
    """A full training sequence: prompt, solution and end-of-turn / end-of-text marker."""
    if chat:
        return chat_prompt(example["problem"]) + example["solution"] + "<|im_end|>"
    return raw_prompt(example["problem"]) + example["solution"] + "<|endoftext|>"


def write_jsonl(problems: Iterable[dict], path: str | os.PathLike) -> None:
    """Writes one {"problem", "numbers", "target", "answer"} object per line, the layout
    `rejax eval --task countdown` reads (`answer`, one correct expression, is not graded
    against: any expression that `rejax.eval.grading` accepts is right)."""
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            row = {k: p[k] for k in ("problem", "numbers", "target", "answer")}
            f.write(json.dumps(row) + "\n")


def write_trace_jsonl(problems: Iterable[dict], path: str | os.PathLike, chat: bool = True) -> None:
    """Writes one {"text": training_text(p, chat=chat)} object per line: each problem's
    reference search trace in the model's prompt format (prompt, solution, end marker), the
    layout `--scale-texts` of `rejax eval` / `rejax calibrate` / `rejax generate` reads to
    calibrate static NVFP4 activation scales (`rejax.calibrate_input_scales`). Use problems
    that are not evaluated (e.g. validation ones) and the chat setting the model runs with."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": training_text(p, chat=chat)}) + "\n" for p in problems)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Reads a file written by `write_jsonl` (every line needs problem, numbers, target)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"problem", "numbers", "target"} - set(row)
            if missing:
                raise ValueError(f"{path}:{lineno}: missing field(s) {sorted(missing)} in {row}")
            out.append(row)
    return out
