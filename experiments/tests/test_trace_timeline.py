"""experiments/trace_timeline.py on a synthetic trace: host thunks beside GPU kernels."""

from __future__ import annotations

import gzip
import importlib.util
import json
import pathlib

_DIR = pathlib.Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("trace_timeline", _DIR / "trace_timeline.py")
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)


def _trace(steps: int, wait_step: int | None = None) -> dict:
    """Per step: a 20 us host graph launch while the GPU idles 25 us, then the kernels (40 us
    of GEMV, 30 us lm_head, with a 5 us gap between them); one command-buffer update. Step
    `wait_step` (counted from the first lm_head) also waits 300 us on a predicate copy."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "python3"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7"}},
    ]
    ev, t = [], 0.0
    for i in range(steps):
        if wait_step is not None and i == wait_step + 1:
            ev.append({"ph": "X", "pid": 1, "tid": 3, "ts": t, "dur": 290.0, "name": "MemcpyD2H"})
            t += 300.0
        ev.append({"ph": "X", "pid": 1, "tid": 3, "ts": t, "dur": 20.0, "name": "cuGraphLaunch"})
        ev.append({"ph": "X", "pid": 1, "tid": 3, "ts": t, "dur": 1.0, "name": "$python fn"})
        if i == 1:
            ev.append(
                {"ph": "X", "pid": 1, "tid": 3, "ts": t, "dur": 9.0,
                 "name": "command_buffer::update"}
            )  # fmt: skip
        t += 25.0
        ev.append({"ph": "X", "pid": 2, "tid": 7, "ts": t, "dur": 40.0, "name": "nvfp4_gemv"})
        t += 45.0
        ev.append({"ph": "X", "pid": 2, "tid": 7, "ts": t, "dur": 30.0, "name": "gemm_fusion_dot"})
        t += 30.0
    return {"traceEvents": meta + ev}


def test_steady_state_and_timeline(tmp_path, capsys):
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(6), f)
    host, gpu = tt.load(str(path))
    assert {e["name"] for e in host} == {"cuGraphLaunch", "command_buffer::update"}
    assert len(gpu) == 12
    s = tt.steady_state(gpu, gpu[0]["ts"], float("inf"))
    assert s["steps"] == 5 and s["span_us_per_step"] == 100.0
    assert s["idle_us_per_step"] == 30.0  # 25 us waiting for the launch + 5 us between kernels
    assert s["idle_pairs"][0] == ("gemm_fusion_dot", "nvfp4_gemv", 25.0)
    marks = tt.step_marks(gpu)
    rows = tt.step_timeline(host, gpu, marks[2], marks[3], gap_us=3.0)
    kinds = [(k, text.split()[0]) for _, k, _, text in rows]
    # the step's lm_head, then the host's launch while the GPU idles, then the GEMV after it
    assert kinds == [("G", "gemm_fusion_dot"), ("H", "cuGraphLaunch"), ("G", "nvfp4_gemv")]
    assert "after 25.0 us idle" in rows[2][3]
    out = tt.main([str(path), "--step", "1", "--skip-ms", "0"])
    assert out == {"steady": s, "updates": 1, "step_idle_us": [30.0] * 5, "step": 1}
    assert "command-buffer updates: 1, 9 us host" in capsys.readouterr().out


def test_idlest_step(tmp_path, capsys):
    """--step -1 prints the steady step with the most GPU idle: the predicate's round trip."""
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(8, wait_step=4), f)
    _, gpu = tt.load(str(path))
    idle = tt.step_idle(gpu, tt.step_marks(gpu))
    assert idle == [30.0] * 4 + [330.0] + [30.0] * 2
    out = tt.main([str(path), "--step", "-1", "--skip-ms", "0"])
    assert out["step"] == 4 and out["step_idle_us"] == idle
    text = capsys.readouterr().out
    assert "30 30 30 30 330 30 30" in text and "MemcpyD2H" in text
    assert tt.split_idle(idle) == {
        "ordinary_us": 30.0, "outliers": 1, "extra_us": 300.0, "extra_us_per_step": 300.0 / 7
    }  # fmt: skip
    assert "1 outlier steps (> 2x + 20 us) at +300.0 us each, 42.9 us a step" in text
    assert tt.split_idle([])["outliers"] == 0
    assert "after 325.0 us idle" in text
