"""The Countdown task: generator determinism, split disjointness, trace format, and the exact
checker (rejax.eval.grading task "countdown"), with the eval wiring (load_problems, evaluate)."""

import itertools
import json
import random
import re
from fractions import Fraction

import pytest

from rejax import eval as ev
from rejax.data import countdown
from rejax.eval.grading import countdown_status, countdown_value, grade, grade_detail

_STEP = re.compile(
    r"(?P<state>[\d ]+): (?P<x>\d+)(?P<op>[-+*/])(?P<y>\d+)=(?P<r>\d+), left (?P<new>[\d ]+)"
    r"(?P<end>\.|: no\.|: (?P<a>\d+)(?P<op2>[-+*/])(?P<b>\d+)=(?P<t>\d+)\.)"
)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split()]


def _brute_force_solvable(numbers, target) -> bool:
    """Any combination with + - * / over exact fractions (independent of the generator)."""
    values = [Fraction(v) for v in numbers]
    if len(values) == 1:
        return values[0] == target
    for i, j in itertools.permutations(range(len(values)), 2):
        rest = [v for k, v in enumerate(values) if k not in (i, j)]
        a, b = values[i], values[j]
        outs = [a + b, a - b, a * b] + ([a / b] if b else [])
        if any(_brute_force_solvable([*rest, r], target) for r in outs):
            return True
    return False


def test_make_problem_is_deterministic():
    a = [countdown.make_problem(random.Random(7)) for _ in range(3)]
    assert a == [countdown.make_problem(random.Random(7)) for _ in range(3)]
    rng1, rng2 = random.Random(1), random.Random(1)
    assert [countdown.make_problem(rng1) for _ in range(20)] == [
        countdown.make_problem(rng2) for _ in range(20)
    ]
    assert countdown.make_problem(random.Random(1)) != countdown.make_problem(random.Random(2))


def test_split_is_deterministic_seeded_and_nested():
    assert countdown.split("test", 30, seed=3) == countdown.split("test", 30, seed=3)
    assert countdown.split("test", 30, seed=3) != countdown.split("test", 30, seed=4)
    assert countdown.split("validation", 10) == countdown.split("validation", 25)[:10]


def _key(p):
    return (p["target"], tuple(sorted(p["numbers"])))


def test_splits_are_disjoint_and_unique_up_to_reordering():
    easy = countdown.Difficulty(n_numbers=3, max_number=20)
    got = {
        name: countdown.split(name, n, seed=0, difficulty=d)
        for name, n, d in (
            ("train", 800, countdown.DEFAULT),
            ("validation", 100, countdown.DEFAULT),
            ("test", 80, easy),
        )
    }
    keys = {name: {_key(p) for p in ps} for name, ps in got.items()}
    for name, ps in got.items():
        assert len(keys[name]) == len(ps), f"{name} has duplicates"
        assert all(countdown.split_of(p["numbers"], p["target"]) == name for p in ps)
    assert not keys["train"] & keys["validation"] and not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]
    # Reordered numbers are the same problem: the split ignores the order.
    p = got["test"][0]
    assert countdown.split_of(p["numbers"][::-1], p["target"]) == "test"
    # Another seed still cannot reach into train or validation.
    other = {_key(p) for p in countdown.split("test", 60, seed=11)}
    assert not other & keys["train"] and not other & keys["validation"]


def test_split_partition_sizes():
    counts = dict.fromkeys(countdown.SPLITS, 0)
    rng = random.Random(0)
    for _ in range(4000):
        numbers = [rng.randint(1, 13) for _ in range(4)]
        counts[countdown.split_of(numbers, rng.randint(10, 99))] += 1
    assert 3500 < counts["train"] < 3700  # 90/5/5 buckets, binomial 4-sigma bounds
    assert 120 < counts["validation"] < 280 and 120 < counts["test"] < 280


@pytest.mark.parametrize(
    "difficulty",
    [countdown.DEFAULT, countdown.Difficulty(n_numbers=3, max_number=20, guide=0.3)],
    ids=["default", "three-numbers"],
)
def test_traces_are_valid_searches(difficulty):
    """Every step's arithmetic and state are right, each step starts from a state already
    reached, every `no` is a true dead end, and the boxed answer passes the checker."""
    rng = random.Random(5)
    n_backtracks = n_no = 0
    for _ in range(300):
        p = countdown.make_problem(rng, difficulty)
        assert len(p["numbers"]) == difficulty.n_numbers
        assert difficulty.min_target <= p["target"] <= difficulty.max_target
        assert p["problem"] == f"Make {p['target']} from {' '.join(map(str, p['numbers']))}."
        steps = p["solution"].split("\n\n")
        assert steps[-1] == f"The answer is \\boxed{{{p['answer']}}}."
        root = tuple(sorted(p["numbers"], reverse=True))
        reached, previous = {root}, None
        for k, step in enumerate(steps[:-1]):
            m = _STEP.fullmatch(step)
            assert m, step
            state, new = tuple(_ints(m["state"])), tuple(_ints(m["new"]))
            assert state in reached, (step, reached)
            if previous is not None and state != previous:
                n_backtracks += 1
            x, y, r = int(m["x"]), int(m["y"]), int(m["r"])
            assert x >= y and countdown._apply_int(m["op"], x, y) == r, step
            rest = list(state)
            rest.remove(x)
            rest.remove(y)
            assert new == tuple(sorted([*rest, r], reverse=True)), step
            if len(new) > 2:
                assert m["end"] == ".", step
                reached.add(new)
                previous = new
            elif m["end"] == ": no.":
                n_no += 1
                # targets are >= 10, so b - a < 0 and b / a <= 1 cannot reach them either
                assert not _brute_force_solvable(new, p["target"]), step
                previous = state
            else:
                assert k == len(steps) - 2, "the hit is the last search step"
                a, b = int(m["a"]), int(m["b"])
                assert (a, b) == new and countdown._apply_int(m["op2"], a, b) == p["target"]
        reference = {"numbers": p["numbers"], "target": p["target"]}
        assert grade(p["solution"], reference, task="countdown"), p
        assert countdown.solutions(p["numbers"], p["target"]) >= 1
    assert n_no > 100  # the traces do search, not just solve
    if difficulty.n_numbers > 3:
        assert n_backtracks > 50


def test_trace_lengths_are_moderate():
    rng = random.Random(9)
    lengths = [len(countdown.make_problem(rng)["solution"]) for _ in range(300)]
    assert max(lengths) < 1200 and 100 < sum(lengths) / len(lengths) < 400


def test_difficulty_is_checked(monkeypatch):
    with pytest.raises(ValueError, match=r"Difficulty.n_numbers=2"):
        countdown.Difficulty(n_numbers=2)
    with pytest.raises(ValueError, match=r"Difficulty.guide=0"):
        countdown.Difficulty(guide=0)
    with pytest.raises(ValueError, match=r"min_target"):
        countdown.Difficulty(min_target=50, max_target=10)
    impossible = countdown.Difficulty(n_numbers=3, max_number=2, min_target=990, max_target=999)
    with pytest.raises(ValueError, match="no target in range"):
        countdown.make_problem(random.Random(0), impossible)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        countdown.split("dev", 3)
    monkeypatch.setattr(countdown, "_MAX_STALE", 300)  # keep the exhausted split quick
    few = countdown.Difficulty(n_numbers=3, max_number=3, min_target=10, max_target=30)
    with pytest.raises(ValueError, match="ran out of distinct problems"):
        countdown.split("train", 100, difficulty=few)


def test_max_solutions_keeps_only_rare_targets():
    d = countdown.Difficulty(max_solutions=2)
    rng = random.Random(3)
    for _ in range(50):
        p = countdown.make_problem(rng, d)
        assert 1 <= countdown.solutions(p["numbers"], p["target"]) <= 2


# ----------------------------------------------------------------------------- the checker


REF = {"numbers": [3, 4, 6, 7], "target": 22}


@pytest.mark.parametrize(
    "answer",
    ["(7+4)*6/3", "6/3*(7+4)", " ( 7 + 4 ) \\times 6 \\div 3 ", "((7+4)*(6/3))", "(4+7)*(6/3)"],
)
def test_checker_accepts_right_answers(answer):
    assert grade(f"... The answer is \\boxed{{{answer}}}.", REF, task="countdown")


def test_checker_is_exact_with_fractions():
    # 8 / (3 - 8/3) = 24: a non-integer intermediate is fine, and no float rounding passes.
    assert countdown_status("8/(3-8/3)", [3, 3, 8, 8], 24) == "correct"
    assert countdown_value("1/3+1/3+1/3")[0] == 1
    assert countdown_status("10/3*3", [10, 3, 3], 10) == "correct"
    assert countdown_status("1/3*3", [1, 3, 3], 1) == "correct"
    assert countdown_status("7/3", [7, 3], 2) == "wrong_value"  # 2.333..., not rounded


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        ("(7+4)*6/3+0", "wrong_numbers"),  # an extra number
        ("(7+4)*6", "wrong_numbers"),  # a number left out
        ("(7+7)*6/3", "wrong_numbers"),  # one used twice, another missing
        ("(7+4)*6/2", "wrong_numbers"),
        ("7+4+6+3", "wrong_value"),
        ("(7+4)*6/3=22", "malformed"),
        ("(7+4*6/3", "malformed"),
        ("(7+4))*6/3", "malformed"),
        ("-3+7*4-6+3", "malformed"),  # no unary minus
        ("7.0+4*6/3", "malformed"),
        ("(7+4)**6/3", "malformed"),
        ("22", "wrong_numbers"),
        ("", "malformed"),
        ("x", "malformed"),
        ("(" * 5000 + "1" + ")" * 5000, "malformed"),  # deep nesting: refused, not a crash
    ],
)
def test_checker_refuses_wrong_and_malformed(answer, status):
    text = f"The answer is \\boxed{{{answer}}}."
    g = grade_detail(text, REF, task="countdown")
    assert not g.correct and g.failure == {"status": status}, (answer, g)


def test_checker_division_by_zero_and_no_answer():
    assert countdown_status("7/(4-4)", [7, 4, 4], 1) == "malformed"
    g = grade_detail("7+4+6+3 = 20, so I give up", REF, task="countdown")
    assert not g.correct and g.extracted is None and g.failure == {"status": "no_answer"}
    # The last box counts.
    assert grade("\\boxed{7+4+6+3} no: \\boxed{(7+4)*6/3}", REF, task="countdown")
    assert not grade("\\boxed{(7+4)*6/3} no: \\boxed{7+4+6+3}", REF, task="countdown")


@pytest.mark.parametrize(
    "reference",
    [
        {"numbers": [1, 2], "target": "3"},
        {"numbers": [1, True], "target": 3},
        {"numbers": [], "target": 3},
        {"numbers": [1, -2], "target": 3},
        {"numbers": "1 2", "target": 3},
        {"target": 3},
        "3",
    ],
)
def test_bad_references_are_refused(reference):
    with pytest.raises(ValueError, match="countdown reference must be"):
        grade("\\boxed{1+2}", reference, task="countdown")


# ----------------------------------------------------------------------------- eval wiring


def test_jsonl_round_trip_through_load_problems(tmp_path):
    problems = countdown.split("test", 5)
    path = tmp_path / "countdown.jsonl"
    countdown.write_jsonl(problems, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [sorted(r) for r in rows] == [["answer", "numbers", "problem", "target"]] * 5
    assert countdown.read_jsonl(path) == rows
    loaded = ev.load_problems(path, "countdown")
    assert [p["prompt"] for p in loaded] == [p["problem"] for p in problems]
    for p, q in zip(problems, loaded):
        assert q["reference"] == {"numbers": p["numbers"], "target": p["target"]}
        assert grade(p["solution"], q["reference"], task="countdown")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "Make 3 from 1 2.", "numbers": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field 'target'"):
        ev.load_problems(bad, "countdown")
    bad.write_text(json.dumps({"problem": "Make 3 from 1 2.", "numbers": [1, 2.5], "target": 3}))
    with pytest.raises(ValueError, match=r"bad.jsonl:1: countdown reference must be"):
        ev.load_problems(bad, "countdown")


def test_trace_jsonl_round_trip_through_scale_texts(tmp_path):
    from rejax import cli

    problems = countdown.split("validation", 3)
    path = tmp_path / "traces.jsonl"
    args = cli.build_parser().parse_args(["eval", "--data", "x", "--scale-texts", str(path)])
    for chat, end in ((None, "<|im_end|>"), (True, "<|im_end|>"), (False, "<|endoftext|>")):
        kwargs = {} if chat is None else {"chat": chat}
        countdown.write_trace_jsonl(problems, path, **kwargs)
        texts = [countdown.training_text(p, chat=chat is not False) for p in problems]
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert rows == [{"text": t} for t in texts]
        assert all(t.endswith(end) and p["solution"] in t for t, p in zip(texts, problems))
        # What `--scale-texts` reads back: the same texts, numbered by line.
        assert cli._read_scale_texts(args) == list(enumerate(texts, start=1))


def test_difficulty_file_round_trip_and_errors(tmp_path):
    assert countdown.load_difficulty(tmp_path) is None  # no file: the caller's default
    d = countdown.Difficulty(n_numbers=3, max_number=25, max_target=199, guide=0.7)
    countdown.save_difficulty(tmp_path, d)
    assert countdown.load_difficulty(tmp_path) == d
    (tmp_path / countdown.DIFFICULTY_FILE).write_text('{"n_numbers": 3, "depth": 2}')
    with pytest.raises(ValueError, match="fields among"):
        countdown.load_difficulty(tmp_path)
    (tmp_path / countdown.DIFFICULTY_FILE).write_text('{"n_numbers": 9}')
    with pytest.raises(ValueError, match="n_numbers=9"):
        countdown.load_difficulty(tmp_path)
