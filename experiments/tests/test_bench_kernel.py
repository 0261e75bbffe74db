"""Tests of the experiment tools (not the product): run with `python -m pytest experiments/tests`
from the repository root; the default test paths (tests/) do not include them."""

import pytest

from cuda_ops import build as cbuild

needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)


# ----------------------------------------------------------------------------- benchmark harness


@needs_nvrtc
def test_bench_read_floor_kernel_compiles():
    """The benchmark's read-only floor kernel (experiments/bench_kernel.py) compiles for sm_90
    with its 128-bit streaming loads and no local memory, so a device session does not find out."""
    from experiments import bench_kernel

    ptx = cbuild.compile_ptx(bench_kernel.READ_FLOOR_SRC, name="read_floor.cu", arch="compute_90")
    assert cbuild.ptx_entries(ptx) == {"read_floor": 5}
    assert ptx.count("ld.global.nc.L1::no_allocate.v4.u32") >= 5 and ".local" not in ptx


def test_bench_summary_reports_graph_and_jit_targets():
    from experiments import bench_kernel

    row = {"n": 4096, "k": 12288, "nvfp4_bytes": 28_311_552, "jax_bf16_s": 30e-6}
    rows = [
        {
            **row,
            "m": 1,
            "nvfp4_w4a4_s": 15e-6,
            "nvfp4_w4a4_graph_s": 10e-6,
            "read_floor_graph_s": 8e-6,
        },
        {**row, "m": 8, "nvfp4_w4a4_s": 30e-6, "nvfp4_w4a4_graph_s": 20e-6},
    ]
    derived, agg = bench_kernel.summarize(rows, copy_bw=4e12)
    assert agg["m1_geomean_speedup_vs_jax_bf16"] == pytest.approx(2.0)
    assert agg["m1_graph_geomean_speedup_vs_jax_bf16"] == pytest.approx(3.0)
    assert agg["m8_graph_geomean_speedup_vs_jax_bf16"] == pytest.approx(1.5)
    assert agg["qwen3_8b_down_m1_graph_us"] == pytest.approx(10.0)
    assert agg["m1_graph_min_pct_copy_bw_layers_ge_25MB"] == pytest.approx(70.78, abs=0.01)
    # the floor measured once per shape applies to every M of that shape
    assert [d["w4a4_graph_over_read_floor"] for d in derived] == pytest.approx([1.25, 2.5])
