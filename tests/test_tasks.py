"""The arithmetic task generator: determinism, split disjointness, solution format, JSONL."""

import json
import random
import re
from fractions import Fraction

import pytest

from rejax.data import tasks
from rejax.eval.grading import grade, to_number


def _eval_expression(problem: str) -> Fraction:
    """Evaluates "Evaluate <expr>." independently of the generator (exact fractions)."""
    expr = problem.removeprefix("Evaluate ").removesuffix(".")
    assert re.fullmatch(r"[\d\s+\-*/()]+", expr), expr
    # Wrap every integer in Fraction(...) so `/` is exact division.
    return eval(re.sub(r"(\d+)", r"Fraction(\1)", expr), {"Fraction": Fraction})


def test_make_problem_is_deterministic():
    a = [tasks.make_problem(random.Random(7)) for _ in range(3)]
    b = [tasks.make_problem(random.Random(7)) for _ in range(3)]
    assert a == b
    rng1, rng2 = random.Random(1), random.Random(1)
    assert [tasks.make_problem(rng1) for _ in range(20)] == [
        tasks.make_problem(rng2) for _ in range(20)
    ]
    assert tasks.make_problem(random.Random(1)) != tasks.make_problem(random.Random(2))


def test_split_is_deterministic_and_seed_dependent():
    assert tasks.split("test", 50, seed=3) == tasks.split("test", 50, seed=3)
    assert tasks.split("test", 50, seed=3) != tasks.split("test", 50, seed=4)
    first = tasks.split("validation", 40)
    assert tasks.split("validation", 10) == first[:10]  # a prefix, so sizes nest


def test_splits_are_disjoint_and_unique():
    problems = {
        name: [p["problem"] for p in tasks.split(name, n, seed=0)]
        for name, n in (("train", 3000), ("validation", 500), ("test", 500))
    }
    for name, texts in problems.items():
        assert len(set(texts)) == len(texts), f"{name} has duplicates"
        assert all(tasks.split_of(t) == name for t in texts)
    assert not set(problems["train"]) & set(problems["validation"])
    assert not set(problems["train"]) & set(problems["test"])
    assert not set(problems["validation"]) & set(problems["test"])
    # Different seeds still cannot cross splits: membership is a function of the text.
    other = {p["problem"] for p in tasks.split("test", 300, seed=11)}
    assert not other & set(problems["train"]) and not other & set(problems["validation"])


def test_split_of_partition_sizes():
    rng = random.Random(0)
    counts = {name: 0 for name in tasks.SPLITS}
    for _ in range(4000):
        counts[tasks.split_of(tasks.make_problem(rng)["problem"])] += 1
    # 90/5/5 buckets; binomial 4-sigma bounds.
    assert 3500 < counts["train"] < 3700
    assert 120 < counts["validation"] < 280 and 120 < counts["test"] < 280


def test_solutions_are_correct_and_well_formed():
    rng = random.Random(123)
    n_fraction = n_negative = 0
    for _ in range(500):
        p = tasks.make_problem(rng)
        value = _eval_expression(p["problem"])
        assert to_number(p["answer"]) == value, p
        steps = p["solution"].split("\n\n")
        n_ops = sum(p["problem"].count(f" {op} ") for op in "+-*/")
        assert tasks.MIN_OPS <= n_ops <= tasks.MAX_OPS
        assert len(steps) >= n_ops + 1  # one step per operation plus the answer line
        assert steps[-1] == f"The answer is \\boxed{{{p['answer']}}}."
        assert all(s.strip() for s in steps) and "\n\n\n" not in p["solution"]
        assert grade(p["solution"], p["answer"])
        # Every "a op b = c" step is arithmetically right.
        for a, op, b, c in re.findall(
            r"(-?\d+) ([-+*/]) \(?(-?\d+)\)? = (-?\d+(?:/\d+)?)[,.]", p["solution"]
        ):
            assert Fraction(c) == tasks._apply(op, Fraction(a), Fraction(b)), (a, op, b, c)
        n_fraction += "frac" in p["answer"]
        n_negative += p["answer"].startswith("-")
        assert value.denominator > 1 or abs(value) <= tasks.MAX_ABS_VALUE
    assert 0 < n_fraction < 100 and 0 < n_negative < 250


def test_training_text_and_prompts():
    p = tasks.make_problem(random.Random(5))
    chat = tasks.training_text(p)
    assert chat.startswith(tasks.chat_prompt(p["problem"])) and chat.endswith("<|im_end|>")
    raw = tasks.training_text(p, chat=False)
    assert raw == f"{p['problem']}\n\n{p['solution']}<|endoftext|>"


def test_chat_prompt_matches_template():
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(tasks.CHAT_TEMPLATE)
    text = template.render(
        messages=[{"role": "user", "content": "Evaluate 1 + 2."}], add_generation_prompt=True
    )
    assert text == tasks.chat_prompt("Evaluate 1 + 2.")


def test_jsonl_round_trip(tmp_path):
    problems = tasks.split("test", 5)
    path = tmp_path / "test.jsonl"
    tasks.write_jsonl(problems, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"problem": p["problem"], "answer": p["answer"]} for p in problems]
    assert tasks.read_jsonl(path) == rows


def test_bad_input_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        tasks.split("dev", 3)
    with pytest.raises(ValueError, match="n must be >= 0"):
        tasks.split("test", -1)
    with pytest.raises(ValueError, match="min_ops=3, max_ops=2"):
        tasks.make_problem(random.Random(0), min_ops=3, max_ops=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1"}\n')
    with pytest.raises(ValueError, match="missing field"):
        tasks.read_jsonl(bad)
