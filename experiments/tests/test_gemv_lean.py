"""Tests of the lean-GEMV experiment (experiments/kernels/gemv_lean.py and gemv_lean_run.sh),
CPU only: the sources it derives from production's, the SASS counts that show what it removes,
and the summaries of the device runs."""

import json
import pathlib
import subprocess

import pytest

from cuda_ops import build as cbuild
from experiments import sass
from experiments.kernels import gemv_lean as gl

needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)
needs_nvdisasm = pytest.mark.skipif(
    sass.nvdisasm_path() is None, reason="nvdisasm not installed (nvidia-cuda-nvdisasm)"
)
RUNNER = pathlib.Path(gl.__file__).with_name("gemv_lean_run.sh")


def test_lean_sources_change_only_what_they_name():
    common = cbuild.read_source("common.cuh")
    lean = gl.lean_common(common)
    assert "prmt_lo(1)" in lean and "nvfp4_prmt_lo[3]" in lean
    assert (
        lean.replace(gl._ACT_LEAN, gl._ACT_PRODUCTION).replace(gl._ROW_LEAN, gl._ROW_PRODUCTION)
        == common
    )
    gemv = cbuild.read_source("nvfp4_gemv.cu")
    assert gl.lean_gemv(gemv).replace(gl._TILE_LEAN, gl._TILE_PRODUCTION) == gemv
    with pytest.raises(ValueError, match="no longer holds"):
        gl.lean_common(lean)  # already lean: what it replaces is gone


def test_write_tree_cli(tmp_path):
    assert gl.main(["--write-tree", str(tmp_path)]) == 0
    ops = tmp_path / "cuda_ops"
    assert (ops / "common.cuh").read_text() == gl.lean_common(cbuild.read_source("common.cuh"))
    assert (ops / "nvfp4_gemv.cu").read_text() == gl.lean_gemv(cbuild.read_source("nvfp4_gemv.cu"))


def test_gemv_source_is_self_contained():
    for lean in (True, False):
        text = gl.gemv_source(lean)
        assert '#include "common.cuh"' not in text.splitlines()
        assert ("nvfp4_prmt_lo" in text) == lean


@needs_nvrtc
@needs_nvdisasm
def test_lean_loop_has_no_table_copies():
    """Production's loop holds a register copy of a table word per prmt or so (the count a
    planted literal table brings back); the lean one none, and is shorter by at least as many."""
    prod = gl.loop_count(False, "w4a4", 1, 24576, 4096)
    lean = gl.loop_count(True, "w4a4", 1, 24576, 4096)
    assert prod["loop_prmt"] == lean["loop_prmt"] == 64
    assert prod["loop_imad_u32"] >= 40
    assert lean["loop_imad_u32"] == 0
    assert lean["loop"] <= prod["loop"] - prod["loop_imad_u32"]
    assert lean["registers"] <= 128  # 512 threads, one CTA an SM


def _fake_runs(out, kind, rows_for):
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for tree in ("base", "new"):
        for run in (1, 2, 3):
            (raw / f"gemv_lean_{kind}_{tree}_{run}.json").write_text(
                json.dumps(rows_for(tree, run))
            )


def test_summarize_kernel_medians_and_ratio(tmp_path):
    def rows(tree, run):
        us = {"base": [7.0, 6.9, 9.0], "new": [6.0, 6.2, 6.1]}[tree][run - 1]
        return {"rows": [{"n": 6144, "k": 4096, "m": 1, "nvfp4_w4a4_graph_s": us * 1e-6,
                          "read_floor_graph_s": 5.3e-6}]}  # fmt: skip

    _fake_runs(tmp_path, "kernel", rows)
    (row,) = gl.summarize_kernel(str(tmp_path))["rows"]
    assert row["runs"] == [3, 3]
    assert row["base_us"] == pytest.approx(7.0) and row["new_us"] == pytest.approx(6.1)
    assert row["ratio"] == pytest.approx(6.1 / 7.0)
    assert row["read_floor_us"] == pytest.approx(5.3)


def test_summarize_decode_medians_and_ratio(tmp_path):
    def runs(tree, run):
        ms = {"base": 2.5, "new": 2.4}[tree] + 0.01 * run
        return {"runs": [{"batch": 1, "mode": "nvfp4", "ms_per_token": ms},
                         {"batch": 8, "mode": "nvfp4", "ms_per_token": 2 * ms}]}  # fmt: skip

    _fake_runs(tmp_path, "decode", runs)
    b1, b8 = gl.summarize_decode(str(tmp_path))["rows"]
    assert (b1["batch"], b8["batch"]) == (1, 8)
    assert b1["ratio"] == pytest.approx(2.42 / 2.52)
    assert b8["new_ms"] == pytest.approx(4.84)


def test_summarize_cli_rejects_a_missing_directory(tmp_path):
    with pytest.raises(SystemExit, match="no such directory"):
        gl.main(["--summarize-kernel", str(tmp_path / "nope")])


def test_runner_usage_and_syntax():
    assert subprocess.run(["bash", "-n", str(RUNNER)], check=False).returncode == 0
    r = subprocess.run(["bash", str(RUNNER)], check=False, capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
