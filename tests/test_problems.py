"""Problem loaders for the paper's three tasks (rejax.eval.load_problems): AIME JSONL, GPQA
CSV / JSONL with the gold-position rule, LiveCodeBench rows with packed private tests and a
refused malicious pickle; bad rows named by file, line and field; `rejax eval --task code` end to
end on the bundled tiny model. Fixtures: tests/data/*_tiny.*"""

import base64
import csv
import json
import pickle
import random
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from rejax import cli
from rejax import eval as ev
from rejax.config import Config
from rejax.eval import harness
from rejax.params import Params
from rejax.sampling import Greedy

DATA = Path(__file__).resolve().parent / "data"
REPO = Path(__file__).resolve().parents[1]


def _pack(obj) -> str:
    """LiveCodeBench's private-test encoding: base64(zlib(pickle(obj)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(obj))).decode()


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _lcb_row(**overrides) -> dict:
    row = json.loads((DATA / "lcb_tiny.jsonl").read_text().splitlines()[0])
    row.update(overrides)
    return row


# ----------------------------------------------------------------------------- math


def test_math_rows_from_aime_jsonl():
    problems = ev.load_problems(DATA / "aime_tiny.jsonl", "math")
    assert problems == [
        {
            "id": "2024-I-1",
            "prompt": "Find the remainder when 2^10 is divided by 7.",
            "reference": "2",
        },
        {"id": "1", "prompt": "What is 12 * 12?", "reference": "144"},  # int answer, no id
    ]
    assert ev.load_problems(DATA / "aime_tiny.jsonl", "math", limit=1) == problems[:1]


# ----------------------------------------------------------------------------- mcq


def _gpqa_rows(k: int) -> list[dict]:
    return [
        {
            "Record ID": f"r{i}",
            "Question": f"Question {i}?",
            "Correct Answer": f"right {i}",
            "Incorrect Answer 1": f"wrong1 {i}",
            "Incorrect Answer 2": f"wrong2 {i}",
            "Incorrect Answer 3": f"wrong3 {i}",
        }
        for i in range(k)
    ]


def test_gpqa_gold_position_is_the_papers_rule(tmp_path):
    rows = _gpqa_rows(24)
    problems = ev.load_problems(_write_jsonl(tmp_path / "gpqa.jsonl", rows), "mcq")
    letters = []
    for idx, (row, p) in enumerate(zip(rows, problems)):
        gold = random.Random(idx).randint(0, 3)  # the paper's rule, row idx counted from 0
        expected = [row[f"Incorrect Answer {k}"] for k in (1, 2, 3)]
        expected.insert(gold, row["Correct Answer"])
        letters.append("ABCD"[gold])
        assert p["reference"] == "ABCD"[gold] and p["id"] == row["Record ID"]
        lines = p["prompt"].splitlines()[-4:]
        assert lines == [f"{x}) {c}" for x, c in zip("ABCD", expected)]
    assert len(set(letters)) == 4  # the rule moves the gold answer around


def test_gpqa_prompt_is_simple_evals_template():
    p = ev.load_problems(DATA / "gpqa_tiny.csv", "mcq")[1]
    assert p["prompt"] == (
        "Answer the following multiple choice question. The last line of your response should "
        "be of the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of "
        "ABCD. Think step by step before answering.\n\n"
        "What is the spin of an electron?\nGive the magnitude.\n\n"
        "A) 1\nB) 1/2\nC) 0\nD) 3/2"
    )
    assert p["reference"] == "ABCD"[random.Random(1).randint(0, 3)] == "B"


def test_gpqa_csv_and_jsonl_agree():
    assert ev.load_problems(DATA / "gpqa_tiny.csv", "mcq") == ev.load_problems(
        DATA / "gpqa_tiny.jsonl", "mcq"
    )


def test_gpqa_csv_error_names_the_record_line(tmp_path):
    rows = _gpqa_rows(3)
    rows[0]["Question"] = "spans\nthree\nlines"
    rows[1]["Question"] = "spans\ntwo lines"
    rows[1]["Incorrect Answer 3"] = ""
    f = tmp_path / "gpqa.csv"
    with f.open("w", newline="") as out:
        w = csv.DictWriter(out, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    # header line 1, row 0 on lines 2-4, row 1 on lines 5-6: named by the line it starts on
    with pytest.raises(ValueError, match=rf"{f}:5: field 'Incorrect Answer 3' is empty"):
        ev.load_problems(f, "mcq")


# ----------------------------------------------------------------------------- code


def test_lcb_rows_decode_private_tests_and_use_lcb_prompts():
    stdin_p, fn_p = ev.load_problems(DATA / "lcb_tiny.jsonl", "code")
    assert stdin_p["id"] == "abc000_a" and fn_p["id"] == "1"
    # public tests first, then the packed private ones
    assert [t["input"] for t in stdin_p["reference"]["tests"]] == ["1 2\n", "10 -4\n", "0 0\n"]
    assert stdin_p["reference"]["fn_name"] is None
    assert fn_p["reference"]["fn_name"] == "twoSum"
    assert [t["testtype"] for t in fn_p["reference"]["tests"]] == ["functional"] * 2
    assert stdin_p["prompt"].startswith("### Question:\nRead two integers A and B")
    assert "Read the inputs from stdin solve the problem" in stdin_p["prompt"]
    assert "```python\n# YOUR CODE HERE\n```" in stdin_p["prompt"]
    assert "You will use the following starter code" in fn_p["prompt"]
    assert "```python\nclass Solution:\n    def twoSum(" in fn_p["prompt"]
    assert fn_p["prompt"].endswith("### Answer: (use the provided format with backticks)\n\n")


def test_lcb_plain_json_private_tests_are_accepted(tmp_path):
    tests = [{"input": "5 5\n", "output": "10\n", "testtype": "stdin"}]
    f = _write_jsonl(tmp_path / "lcb.jsonl", [_lcb_row(private_test_cases=json.dumps(tests))])
    (p,) = ev.load_problems(f, "code")
    assert p["reference"]["tests"][-1] == tests[0]


class _Payload:
    """A pickle that creates a file when loaded by an ordinary unpickler."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    # The payload is live: a plain pickle.loads creates its file.
    live = tmp_path / "live"
    pickle.loads(zlib.decompress(base64.b64decode(_pack(_Payload(live)))))
    assert live.exists()
    marker = tmp_path / "pwned"
    rows = [_lcb_row(), _lcb_row(private_test_cases=_pack(_Payload(marker)))]
    f = _write_jsonl(tmp_path / "lcb.jsonl", rows)
    with pytest.raises(
        ValueError, match=rf"{f}:2: field 'private_test_cases' refused.*refused global io.open"
    ):
        ev.load_problems(f, "code")
    assert not marker.exists()


def test_pickled_non_string_and_garbage_are_refused(tmp_path):
    tests = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
    f = _write_jsonl(tmp_path / "a.jsonl", [_lcb_row(private_test_cases=_pack(tests))])
    with pytest.raises(
        ValueError, match=r":1: field 'private_test_cases' refused: .*got a pickled list"
    ):
        ev.load_problems(f, "code")
    f = _write_jsonl(tmp_path / "b.jsonl", [_lcb_row(private_test_cases="not base64 !!")])
    with pytest.raises(
        ValueError, match=r":1: field 'private_test_cases' is neither JSON nor base64"
    ):
        ev.load_problems(f, "code")


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"question_content": None}, r":1: missing field 'question_content'"),
        ({"public_test_cases": "[{"}, r":1: field 'public_test_cases' is not valid JSON"),
        ({"metadata": "[1]"}, r":1: field 'metadata' must hold a JSON dict, got list"),
        (
            {"private_test_cases": _pack(json.dumps([{"input": "1", "output": "1"}]))},
            r":1: field 'private_test_cases': code reference tests\[0\].testtype must be",
        ),
        (
            {
                "public_test_cases": json.dumps(
                    [{"input": "1", "output": "1", "testtype": "functional"}]
                )
            },
            r":1: field 'public_test_cases': .*functional but the reference has no fn_name",
        ),
        (
            {"public_test_cases": "[]", "private_test_cases": ""},
            r":1: code reference has no tests",
        ),
    ],
)
def test_bad_lcb_rows_name_file_line_and_field(tmp_path, overrides, match):
    f = _write_jsonl(tmp_path / "lcb.jsonl", [_lcb_row(**overrides)])
    with pytest.raises(ValueError, match=rf"{f}{match}"):
        ev.load_problems(f, "code")


def test_bad_files_and_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'essay'"):
        ev.load_problems(DATA / "aime_tiny.jsonl", "essay")
    with pytest.raises(ValueError, match="does not exist"):
        ev.load_problems(tmp_path / "none.jsonl", "math")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no problems"):
        ev.load_problems(empty, "mcq")
    with pytest.raises(ValueError, match="limit must be a positive"):
        ev.load_problems(DATA / "aime_tiny.jsonl", "math", limit=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "x"\n')
    with pytest.raises(ValueError, match=rf"{bad}:2: malformed JSON"):
        ev.load_problems(bad, "math")
    bad.write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "x"}\n')
    with pytest.raises(ValueError, match=rf"{bad}:3: missing field 'answer'"):
        ev.load_problems(bad, "math")
    bad.write_text('{"Question": "q", "Correct Answer": "a"}\n')
    with pytest.raises(ValueError, match=rf"{bad}:1: missing field 'Incorrect Answer 1'"):
        ev.load_problems(bad, "mcq")


# ----------------------------------------------------------------------------- rejax eval


def test_eval_task_is_documented():
    e_help = cli.build_parser()._subparsers._group_actions[0].choices["eval"].format_help()
    assert "--task {math,mcq,code,countdown}" in e_help and "--timeout" in e_help
    readme = (REPO / "README.md").read_text()
    assert "--task math|mcq|code|countdown" in readme and "--timeout S" in readme


def test_eval_bad_task_data_and_timeout_fail_before_loading(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "load_model", lambda *a: pytest.fail("the model was loaded"))
    code = ["eval", "--task", "code", "--data", str(DATA / "lcb_tiny.jsonl")]
    assert cli.main([*code, "--timeout", "0"]) == 2
    assert "--timeout must be a positive number of seconds, got 0" in capsys.readouterr().err
    # a math file read as code names the first row's missing field
    assert cli.main(["eval", "--task", "code", "--data", str(DATA / "aime_tiny.jsonl")]) == 2
    assert "aime_tiny.jsonl:1: missing field 'question_content'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["eval", "--task", "essay", "--data", str(DATA / "aime_tiny.jsonl")])
    assert "invalid choice: 'essay'" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:rejax.eval.sandbox. running as root")
def test_eval_task_code_end_to_end_on_the_tiny_model(capsys, tmp_path):
    out, summary = tmp_path / "results.jsonl", tmp_path / "summary.json"
    argv = ["eval", "--task", "code", "--model", "tiny", "--quant", "bf16"]
    argv += ["--data", str(DATA / "lcb_tiny.jsonl"), "--n", "1", "--max-new-tokens", "16"]
    argv += ["--sampler", "greedy", "--no-progress", "--out", str(out), "--summary", str(summary)]
    rc = cli.main(argv)
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["abc000_a", "1"]
    assert [r["reference"] for r in rows] == [
        {"n_tests": 3, "fn_name": None},
        {"n_tests": 2, "fn_name": "twoSum"},
    ]
    for r in rows:
        # 16 tokens of a tiny model are no program: graded (failed), not crashed
        assert r["correct"] == [False] and len(r["failure"]) == 1
        fail = r["failure"][0]
        assert fail["index"] == 0 and fail["status"] in ("error", "wrong_answer", "timeout")
        assert r["extracted_by"][0] in ("python_block", "fenced_block", "text")
    s = json.loads(summary.read_text())
    assert s["task"] == "code" and s["avg_at_n"]["avg"] == 0.0
    assert sum(s["failure_status"].values()) == 2 and sum(s["extracted_by"].values()) == 2
    assert "2 graded answers, extracted by:" in stdout and "failures:" in stdout


def _fake_generate(texts_by_prompt):
    """A stand-in for rejax.generate.generate that answers each prompt with fixed texts."""

    def generate(params, prompts, *, n, **kwargs):
        text = [t for p in prompts for t in texts_by_prompt[p][:n]]
        return SimpleNamespace(
            text=text,
            tokens=[[1, 2, 3]] * len(text),
            finish_reason=["stop"] * len(text),
            entropy=[[0.5]] * len(text),
        )

    return generate


def test_eval_reports_the_math_last_number_fallback(monkeypatch, capsys, tmp_path):
    responses = {
        # boxed and right; fallback and right; fallback and wrong; no answer at all
        "Find the remainder when 2^10 is divided by 7.": [r"so \boxed{2}", "it is 2"],
        "What is 12 * 12?": ["maybe 143", "no idea"],
    }
    monkeypatch.setattr(harness, "generate", _fake_generate(responses))
    fake = Params(weights={}, cfg=Config(max_position_embeddings=4096))  # never decoded
    monkeypatch.setattr(cli, "load_model", lambda spec, quant: fake)
    monkeypatch.setattr(cli, "_model_line", lambda args, params: "fake model")
    monkeypatch.setattr(cli, "encode_prompt", lambda params, problem, chat: [0] * 8)
    summary = tmp_path / "summary.json"
    argv = ["eval", "--data", str(DATA / "aime_tiny.jsonl"), "--n", "2", "--no-chat"]
    rc = cli.main([*argv, "--sampler", "greedy", "--no-progress", "--summary", str(summary)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    s = json.loads(summary.read_text())
    assert (s["n_last_number_fallback"], s["n_last_number_fallback_correct"]) == (2, 1)
    assert s["extracted_by"] == {"boxed": 1, "last_number": 2, "none": 1}
    assert s["avg_at_n"]["avg"] == pytest.approx(0.5)
    assert "2 of 4 graded answers came from the last-number fallback" in stdout
    assert "1 of them graded correct" in stdout


def test_evaluate_mcq_records_letters_and_rules(monkeypatch):
    problems = ev.load_problems(DATA / "gpqa_tiny.jsonl", "mcq")
    gold = [p["reference"] for p in problems]  # D, B, A
    responses = {
        problems[0]["prompt"]: [f"Answer: {gold[0]}"],
        problems[1]["prompt"]: [r"\boxed{C}"],
        problems[2]["prompt"]: ["no letter here"],
    }
    monkeypatch.setattr(harness, "generate", _fake_generate(responses))
    res = ev.evaluate(None, problems, Greedy(), n=1, chat=False, progress=False, task="mcq")
    assert [r["extracted"] for r in res.records] == [[gold[0]], ["C"], [None]]
    assert [r["extracted_by"] for r in res.records] == [["answer_line"], ["boxed"], [None]]
    assert res.correct.tolist() == [[True], [gold[1] == "C"], [False]]
    assert res.summary["extracted_by"] == {"answer_line": 1, "boxed": 1, "none": 1}
    with pytest.raises(ValueError, match="unknown task 'essay'"):
        ev.evaluate(None, problems, Greedy(), n=1, task="essay")
    with pytest.raises(ValueError, match="problem 0: mcq reference must be one of"):
        ev.evaluate(None, [dict(problems[0], reference="E")], Greedy(), n=1, task="mcq")
