"""Tests of the GEMM benchmark harness (experiments/bench_gemm.py), CPU only."""

import pytest


def test_every_variant_plans_every_benchmarked_problem():
    """A device session must not find out that a variant cannot run a shape: every variant's
    options are valid and supported on all 18 layer shapes at every benchmarked M."""
    from cuda_ops import nvfp4_gemm
    from experiments import bench_gemm
    from experiments.kernel_shapes import unique_shapes

    assert len(unique_shapes()) == 18
    for name in bench_gemm.VARIANTS:
        opts = bench_gemm._options(name)
        for n, k in unique_shapes():
            for m in (8, 16, 32, 64, 128, 256):
                assert nvfp4_gemm.check_shape(m, n, k, opts) == (True, ""), (name, m, n, k)


def test_gemm_summary_geomeans_per_m():
    from experiments import bench_gemm

    rows = [
        {"n": 4096, "k": 4096, "m": 16, "nvfp4_bytes": 9_437_184, "jax_bf16_s": 20e-6,
         "gemm_graph_s": 10e-6, "gemm_kt256_graph_s": 8e-6, "old_path_s": 40e-6,
         "dot_kernel_s": 25e-6},
        {"n": 4096, "k": 12288, "m": 16, "nvfp4_bytes": 28_311_552, "jax_bf16_s": 60e-6,
         "gemm_graph_s": 15e-6, "gemm_kt256_graph_s": 20e-6},
        {"n": 4096, "k": 4096, "m": 8, "nvfp4_bytes": 9_437_184, "jax_bf16_s": 20e-6,
         "gemm_graph_s": 10e-6, "gemv_graph_s": 5e-6},
    ]  # fmt: skip
    derived, targets = bench_gemm.summarize(rows, 4e12, ["gemm", "gemm_kt256"])
    assert targets["m16_best_geomean_x_bf16"] == pytest.approx((2.5 * 4.0) ** 0.5)
    assert targets["m16_gemm_geomean_x_bf16"] == pytest.approx((2.0 * 4.0) ** 0.5)
    assert targets["m16_old_path_geomean_x_bf16"] == pytest.approx(0.5)
    assert targets["m16_dot_kernel_geomean_x_bf16"] == pytest.approx(0.8)
    assert targets["m8_gemv_graph_geomean_x_bf16"] == pytest.approx(4.0)
    assert derived[0]["best_variant"] == "gemm_kt256" and derived[1]["best_variant"] == "gemm"
    assert derived[1]["best_pct_copy_bw"] == pytest.approx(100 * 28_311_552 / 15e-6 / 4e12)


def test_wgmma_variants_plan_every_shape_at_large_m():
    """The wgmma large-tile variants (M >= 128 only) have a supported plan on all 18 shapes
    at M = 128 / 256 / 512, and are skipped below 128 rows."""
    from cuda_ops import nvfp4_gemm_wgmma as wgm
    from experiments import bench_gemm
    from experiments.kernel_shapes import unique_shapes

    assert set(bench_gemm.WGMMA_VARIANTS) and not set(bench_gemm.WGMMA_VARIANTS) & set(
        bench_gemm.VARIANTS
    )
    for name in bench_gemm.WGMMA_VARIANTS:
        assert 64 not in bench_gemm.VARIANT_MS[name] and 256 in bench_gemm.VARIANT_MS[name]
        for n, k in unique_shapes():
            for m in (128, 256, 512):
                p = bench_gemm._wgmma_plan(name, m, n, k)
                assert wgm.check_plan(p) == (True, ""), (name, m, n, k)
                assert p.tm >= 128 and (p.m, p.n, p.k) == (m, n, k)
