"""Runs untrusted Python programs (model-written code) in a separate, limited process.

Each `run_program` call starts one fresh interpreter (`python -I -X utf8`) that:

- lives in its own session / process group, killed as a whole (SIGKILL) when the wall-clock
  timeout expires, and again after a normal exit so no background child survives the run;
- gets a clean environment (a fixed PATH / LANG / HOME / TMPDIR and single-threaded BLAS
  variables; nothing from the caller's environment) and a fresh temporary working directory,
  deleted afterwards;
- reads stdin from the test input, or for a function call has its stdin closed before the
  program runs (the arguments arrive on stdin and are read first);
- writes stdout / stderr to files (never pipes), so a chatty or hanging program cannot block
  the caller or fill its memory;
- sets its own limits with `resource` before the program runs: CPU time, address space
  (2 GiB), open files, processes/threads, output file size, no core dumps;
- when started as root, drops to the `nobody` user first if the interpreter is readable by
  other users (otherwise it stays root and a warning says so: root may raise its own limits
  and is exempt from the process limit).

It is a guard against accidents (infinite loops, runaway memory, fork bombs, stray files in the
caller's directory, reading the caller's secrets from the environment), not a security
boundary: the program can read and write whatever the user it runs as can, and use the network.
Run untrusted code you did not generate inside a container or VM.

Example:
    >>> run_program("print(input()[::-1])", stdin="abc\\n").stdout
    'cba\\n'
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

# Modules made available to every program, as LiveCodeBench's harness does (LeetCode starter code
# uses `List[int]` without importing it). Plain `import`s, not `*`, so builtins like `pow` stay.
HEADER = (
    "from typing import *\n"
    "import bisect, collections, functools, heapq, itertools, math, re, string, sys\n"
    "from collections import Counter, defaultdict, deque\n"
    "from functools import cache, lru_cache, reduce\n"
)
STDERR_TAIL = 2000  # characters of stderr kept in a RunResult

# The child's whole environment: nothing is inherited from the caller.
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

_warned_root = False


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of a sandboxed program (set with `resource.setrlimit` in the child).

    Attributes:
      memory_bytes: address space (RLIMIT_AS); an allocation beyond it raises MemoryError.
      open_files: file descriptors (RLIMIT_NOFILE).
      processes: processes and threads the program may start (RLIMIT_NPROC, set to the ones
        its user already runs plus this many).
      output_bytes: largest file the program may write, stdout included (RLIMIT_FSIZE).
      cpu_s: CPU seconds (RLIMIT_CPU); None = the wall timeout rounded up, plus one.
    """

    memory_bytes: int = 2 * 2**30
    open_files: int = 64
    processes: int = 16
    output_bytes: int = 64 * 2**20
    cpu_s: int | None = None


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one sandboxed run did.

    Attributes:
      status: "ok" (exit 0), "error" (non-zero exit), "timeout" (killed at the wall-clock
        limit) or "signal" (killed by a signal, e.g. SIGXCPU at the CPU limit).
      returncode: the exit status (negative: the signal number), None after a timeout.
      stdout: everything the program printed (at most `Limits.output_bytes`).
      stderr_tail: the last `STDERR_TAIL` characters of stderr.
      value: for a function call, the JSON text of the return value (None otherwise or when
        the call did not return).
      user: the user the program ran as ("nobody", or "root" when privileges were kept).
      seconds: wall-clock time of the run.
    """

    status: str
    returncode: int | None
    stdout: str
    stderr_tail: str
    value: str | None
    user: str | None
    seconds: float


def run_program(
    source: str,
    *,
    stdin: str = "",
    call: tuple[str, list] | None = None,
    timeout_s: float = 8.0,
    limits: Limits = Limits(),
    python: str | None = None,
) -> RunResult:
    """Runs `source` in a fresh sandboxed interpreter (see the module docstring).

    Args:
      source: the program text. `HEADER` is executed first in its namespace.
      stdin: the program's standard input (ignored for a function call).
      call: (name, args) to call `Solution().<name>(*args)`, or the top-level function `name`
        when there is no such method, after running the program as module `solution`; the
        return value comes back as JSON in `RunResult.value`. None runs the program as
        `__main__` with `stdin`.
      timeout_s: wall-clock limit in seconds (> 0), interpreter start-up included.
      limits: resource limits.
      python: the interpreter (default: the running one).

    Returns:
      RunResult.

    Raises:
      ValueError: bad arguments (a non-positive timeout, non-JSON call arguments, ...).
    """
    if not isinstance(source, str):
        raise ValueError(f"source must be a str, got {type(source).__name__}")  # noqa: TRY004
    if not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if call is not None:
        name, args = call
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"call name must be a Python identifier, got {name!r}")
        try:
            stdin = json.dumps(list(args))
        except (TypeError, ValueError) as e:
            raise ValueError(f"call arguments must be JSON values: {e}") from None
    elif not isinstance(stdin, str):
        raise ValueError(f"stdin must be a str, got {type(stdin).__name__}")
    if os.name != "posix":
        raise ValueError("the code sandbox needs a POSIX system (resource limits, sessions)")
    cpu_s = limits.cpu_s if limits.cpu_s is not None else math.ceil(timeout_s) + 1

    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="rejax-sandbox-")
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        if os.geteuid() == 0:
            # The program may run as nobody (see _DRIVER): give it its working directory.
            os.chown(workdir, *_nobody())
        # Unnamed files outside the working directory: stdin, stdout, stderr, the driver's
        # result channel and its configuration.
        f_in, f_out, f_err, f_res, f_cfg = (
            stack.enter_context(tempfile.TemporaryFile()) for _ in range(5)
        )
        f_in.write(stdin.encode("utf-8"))
        f_in.seek(0)
        config = {
            "source": source,
            "header": HEADER,
            "call": None if call is None else call[0],
            "result_fd": f_res.fileno(),
            "limits": {
                "AS": limits.memory_bytes,
                "NOFILE": limits.open_files,
                "FSIZE": limits.output_bytes,
                "CPU": cpu_s,
                "CORE": 0,
            },
            "processes": limits.processes,
            "nobody": list(_nobody()),
        }
        f_cfg.write(json.dumps(config).encode("utf-8"))
        f_cfg.seek(0)
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [python or sys.executable, "-I", "-X", "utf8", "-c", _DRIVER, str(f_cfg.fileno())],
            stdin=f_in,
            stdout=f_out,
            stderr=f_err,
            cwd=workdir,
            env=dict(_ENV, HOME=workdir, TMPDIR=workdir),
            pass_fds=(f_res.fileno(), f_cfg.fileno()),
            start_new_session=True,  # own process group, so one killpg reaches every child
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
            status = "ok" if returncode == 0 else ("error" if returncode > 0 else "signal")
        except subprocess.TimeoutExpired:
            returncode, status = None, "timeout"
        _kill_group(proc.pid)
        if returncode is None:
            proc.wait()
        seconds = time.perf_counter() - t0
        stdout = _read(f_out, 0, limits.output_bytes)
        stderr = _read(f_err, -4 * STDERR_TAIL, None)  # bytes, so a few times the characters
        lines = _read(f_res, 0, None).splitlines()
    try:
        user = json.loads(lines[0])["user"]
    except (IndexError, ValueError, TypeError, KeyError):
        user = None  # the driver failed before reporting (or the program overwrote it)
    if user == "root":
        _warn_root()
    return RunResult(
        status=status,
        returncode=returncode,
        stdout=stdout,
        stderr_tail=stderr[-STDERR_TAIL:],
        value=lines[1] if len(lines) > 1 else None,
        user=user,
        seconds=seconds,
    )


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _read(f, start: int, limit: int | None) -> str:
    """Reads a file from `start` (negative: that many bytes before its end) up to `limit`."""
    f.seek(start if start >= 0 else max(0, f.seek(0, os.SEEK_END) + start))
    data = f.read() if limit is None else f.read(limit)
    return data.decode("utf-8", errors="replace")


def _warn_root() -> None:
    global _warned_root
    if not _warned_root:
        _warned_root = True
        warnings.warn(
            "rejax.eval.sandbox: running as root and the interpreter is not readable by 'nobody', "
            "so programs keep root's rights (they may raise their own limits and the process limit "
            "does not apply); run the grader as an unprivileged user",
            RuntimeWarning,
            stacklevel=3,
        )


# The child's first code (run with `python -I -c`): it reads its configuration, drops root,
# sets the limits, then runs the program. Keep it self-contained: it runs in the fresh
# interpreter, not in this module.
_DRIVER = r"""
import json, os, resource, sys

def _usable_by_others(path):
    # "other" must be able to list `path` (imports scan their directories) and search it and
    # every directory above it
    path = os.path.realpath(path)
    need = 0o005
    while True:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return False
        if mode & need != need:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path, need = parent, 0o001

def _user_tasks(uid):
    n = 0
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if pid.isdigit():
            try:
                if os.stat("/proc/" + pid).st_uid == uid:
                    n += len(os.listdir("/proc/" + pid + "/task"))
            except OSError:
                pass
    return n

def _main():
    with os.fdopen(int(sys.argv[1]), "rb") as f:
        cfg = json.loads(f.read())
    result = os.fdopen(cfg["result_fd"], "w", encoding="utf-8")
    header = compile(cfg["header"], "<header>", "exec")
    code = compile(cfg["source"], "solution.py", "exec")
    args = None
    if cfg["call"] is not None:
        args = json.loads(sys.stdin.read())
        sys.stdin.close()
        os.close(0)  # a function call gets no stdin
    user = None
    if os.geteuid() == 0:
        stdlib = os.path.dirname(os.__file__)
        if _usable_by_others(stdlib):
            uid, gid = cfg["nobody"]
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            user = "nobody"
        else:
            user = "root"
    else:
        import pwd
        try:
            user = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:
            user = str(os.getuid())
    limits = dict(cfg["limits"], NPROC=_user_tasks(os.getuid()) + cfg["processes"])
    for name, value in limits.items():
        kind = getattr(resource, "RLIMIT_" + name)
        soft, hard = resource.getrlimit(kind)
        # CPU: SIGXCPU at the soft limit, SIGKILL one second later
        want = value + 1 if name == "CPU" else value
        if hard != resource.RLIM_INFINITY:
            value, want = min(value, hard), min(want, hard)
        resource.setrlimit(kind, (value, want))
    result.write(json.dumps({"user": user}) + "\n")
    result.flush()
    call = cfg["call"]
    del cfg
    sys.argv = ["solution.py"]
    ns = {"__name__": "__main__" if call is None else "solution", "__builtins__": __builtins__}
    exec(header, ns)
    exec(code, ns)
    if call is None:
        return
    cls = ns.get("Solution")
    if isinstance(cls, type) and hasattr(cls, call):
        fn = getattr(cls(), call)
    elif callable(ns.get(call)):
        fn = ns[call]
    else:
        sys.stderr.write("no method Solution." + call + " and no function " + call + "\n")
        sys.exit(1)
    result.write(json.dumps(fn(*args)) + "\n")
    result.flush()

_main()
"""
