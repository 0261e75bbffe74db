"""The code sandbox (rejax.eval.sandbox) and code grading through it (rejax.eval.grading, task="code"):
right, wrong, raising, extra whitespace, endless loops, unbounded allocation, the parent's
environment, closed stdin, process groups. Each test runs a handful of ~0.1 s interpreters."""

import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest

from rejax.eval import sandbox
from rejax.eval.grading import grade, grade_detail
from rejax.eval.sandbox import Limits, run_program

pytestmark = pytest.mark.filterwarnings("ignore:rejax.eval.sandbox. running as root")


def _stdin_ref(*pairs):
    return {
        "tests": [{"input": i, "output": o, "testtype": "stdin"} for i, o in pairs],
        "fn_name": None,
    }


def _call_ref(fn_name, *pairs):
    return {
        "tests": [{"input": i, "output": o, "testtype": "functional"} for i, o in pairs],
        "fn_name": fn_name,
    }


ADD = _stdin_ref(("1 2\n", "3\n"), ("10 -4\n", "6\n"))
RIGHT = "Reasoning...\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"


# ----------------------------------------------------------------------------- stdin tests


def test_right_program_passes_every_test():
    g = grade_detail(RIGHT, ADD, task="code")
    assert g.correct and g.failure is None and g.rule == "python_block"
    assert g.extracted == "a, b = map(int, input().split())\nprint(a + b)\n"


def test_wrong_program_names_the_failing_test():
    wrong = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else a - b)\n```"
    g = grade_detail(wrong, ADD, task="code")
    assert not g.correct
    # the first test passes, the second fails: all tests must pass
    assert g.failure["index"] == 1 and g.failure["status"] == "wrong_answer"
    assert (g.failure["input"], g.failure["expected"], g.failure["got"]) == (
        "10 -4\n",
        "6\n",
        "14\n",
    )


def test_raising_program_reports_its_stderr_tail():
    g = grade_detail("```python\nraise KeyError('boom')\n```", ADD, task="code")
    assert not g.correct and g.failure["index"] == 0 and g.failure["status"] == "error"
    assert "KeyError: 'boom'" in g.failure["stderr_tail"]
    assert 'File "solution.py", line 1' in g.failure["stderr_tail"]  # the program's own lines


def test_trailing_whitespace_is_ignored_but_not_other_differences():
    spaces = "```python\na, b = map(int, input().split())\nprint(a + b, '  \\n\\n')\n```"
    assert grade(spaces, ADD, task="code")
    leading = "```python\na, b = map(int, input().split())\nprint(' ', a + b)\n```"
    assert not grade(leading, ADD, task="code")


def test_endless_loop_is_killed_inside_the_timeout():
    t0 = time.perf_counter()
    g = grade_detail("```python\nwhile True:\n    pass\n```", ADD, task="code", timeout_s=0.5)
    elapsed = time.perf_counter() - t0
    assert not g.correct and g.failure["status"] == "timeout" and g.failure["index"] == 0
    assert elapsed < 2.5, elapsed  # one test, 0.5 s limit, then a SIGKILL: no 8 s wait


def test_unbounded_allocation_is_refused_by_the_memory_limit():
    # One allocation beyond the default 2 GiB address space: refused at once, nothing touched.
    g = grade_detail("```python\nx = bytearray(3 * 2**30)\nprint(3)\n```", ADD, task="code")
    assert not g.correct and g.failure["status"] == "error"
    assert "MemoryError" in g.failure["stderr_tail"]
    # Growing without bound stops at the limit (lowered here to keep the test light).
    grow = "chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))\n"
    r = run_program(grow, timeout_s=5.0, limits=Limits(memory_bytes=256 * 2**20))
    assert r.status == "error" and "MemoryError" in r.stderr_tail, r  # not "timeout"


def test_parent_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("REJAX_TEST_SECRET", "hunter2")
    prog = "import os\nprint(os.environ.get('REJAX_TEST_SECRET', 'unset'))\n"
    r = run_program(prog)
    assert r.status == "ok" and r.stdout == "unset\n"
    r = run_program("import os, json\nprint(json.dumps(sorted(os.environ)))")
    assert set(json.loads(r.stdout)) == set(sandbox._ENV) | {"HOME", "TMPDIR"}
    ref = _stdin_ref(("", "unset"))
    assert grade(f"```python\n{prog}```", ref, task="code")


def test_fresh_working_directory_is_removed_afterwards():
    r = run_program("import os\nprint(os.getcwd())\nprint(os.listdir('.'))\nopen('x', 'w')")
    cwd, listing = r.stdout.splitlines()
    assert r.status == "ok" and listing == "[]" and cwd != os.getcwd()
    assert not Path(cwd).exists()


def test_cpu_limit_kills_a_busy_program():
    r = run_program("while True:\n    pass", timeout_s=10.0, limits=Limits(cpu_s=1))
    assert r.status == "signal", r  # SIGXCPU after 1 s of CPU, not the 10 s wall timeout


def test_endless_output_is_cut_at_the_file_size_limit():
    r = run_program("while True:\n    print('x' * 1000)", limits=Limits(output_bytes=2**20))
    # Python ignores SIGXFSZ, so the write beyond the limit fails (EFBIG) and the program exits
    assert r.status == "error" and "File too large" in r.stderr_tail, r
    assert 0 < len(r.stdout) <= 2**20


def test_open_files_limit():
    prog = "fs = []\nfor i in range(1000):\n    fs.append(open('f%d' % i, 'w'))\n"
    r = run_program(prog, limits=Limits(open_files=32))
    assert r.status == "error" and "Too many open files" in r.stderr_tail


def test_timeout_kills_the_whole_process_group():
    # The program starts a grandchild that would outlive it, prints its pid, then hangs.
    prog = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '30'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    r = run_program(prog, timeout_s=1.0)
    assert r.status == "timeout"
    pid = int(r.stdout)
    deadline = time.time() + 2.0
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False


# ----------------------------------------------------------------------------- functional tests


TWO_SUM = _call_ref("twoSum", ("[2, 7, 11, 15]\n9", "[0, 1]"), ("[3, 3]\n6", "[0, 1]"))
TWO_SUM_CODE = """```python
class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return (seen[target - x], i)  # a tuple: JSON-normalised to a list
            seen[x] = i
```"""


def test_functional_method_and_top_level_function():
    assert grade(TWO_SUM_CODE, TWO_SUM, task="code")
    top = "```python\ndef twoSum(nums, target):\n    return [0, 1]\n```"
    assert grade(top, TWO_SUM, task="code")
    wrong = "```python\ndef twoSum(nums, target):\n    return [1, 0]\n```"
    g = grade_detail(wrong, TWO_SUM, task="code")
    assert not g.correct and g.failure["status"] == "wrong_answer" and g.failure["got"] == "[1, 0]"
    missing = "```python\ndef other(nums, target):\n    return [0, 1]\n```"
    g = grade_detail(missing, TWO_SUM, task="code")
    assert not g.correct and "no method Solution.twoSum" in g.failure["stderr_tail"]


def test_functional_output_is_json_normalised():
    ref = _call_ref("f", ("1", "2.0"), ("2", "true"))
    assert grade("def f(x):\n    return 2 if x == 1 else True\n", ref, task="code")
    assert not grade("def f(x):\n    return '2'\n", ref, task="code")


def test_functional_tests_get_a_closed_stdin_and_main_guard_does_not_run():
    ref = _call_ref("f", ("1", "1"))
    reads = "import sys\ndef f(x):\n    sys.stdin.read()\n    return x\n"
    g = grade_detail(reads, ref, task="code")
    assert not g.correct and "closed file" in g.failure["stderr_tail"]
    guarded = "def f(x):\n    return x\nif __name__ == '__main__':\n    print(input())\n"
    assert grade(guarded, ref, task="code")


def test_bad_sandbox_arguments():
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
        run_program("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="call name must be a Python identifier"):
        run_program("print(1)", call=("not a name", []))
    with pytest.raises(ValueError, match="call arguments must be JSON values"):
        run_program("print(1)", call=("f", [object()]))


# ----------------------------------------------------------------------------- privileges


def _world_readable_python():
    for path in ("/usr/bin/python3", shutil.which("python3") or ""):
        if path and os.path.isfile(path) and os.stat(path).st_mode & stat.S_IXOTH:
            real = os.path.realpath(path)
            if all(os.stat(d).st_mode & stat.S_IXOTH for d in Path(real).parents):
                return path
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop happens only when run as root")
def test_root_drops_to_nobody_and_cannot_lift_limits():
    python = _world_readable_python()
    if python is None:
        pytest.skip("no interpreter readable by 'nobody' on this machine")
    r = run_program("import os\nprint(os.getuid())", python=python)
    assert r.user == "nobody" and r.stdout.strip() != "0"
    lift = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))"
    r = run_program(lift, python=python)
    assert r.status == "error" and "not allowed to raise maximum limit" in r.stderr_tail
    forks = (
        "import os, time\n"
        "for i in range(100):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        print(i)\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(5)\n"
        "        os._exit(0)\n"
    )
    r = run_program(forks, python=python, limits=Limits(processes=8))
    assert r.status == "ok" and 0 < int(r.stdout) <= 8, r


def test_running_interpreter_user_is_reported():
    r = run_program("pass", python=sys.executable)
    assert r.user is not None
