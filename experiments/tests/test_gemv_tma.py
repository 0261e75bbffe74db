"""experiments/kernels/nvfp4_gemv_tma.{cu,py}: plans, and every planned kernel through NVRTC and
ptxas (the device check is experiments/kernels/check_gemv_tma.py)."""

import numpy as np
import pytest

from cuda_ops.build import KernelError
from experiments.kernels import check_gemv_tma as check
from experiments.kernels import nvfp4_gemv_tma as tma


def test_every_planned_kernel_fits_its_occupancy_without_spills():
    pytest.importorskip("cuda.bindings.nvrtc")
    for v, p in check.problems():
        assert p.grid <= p.ctas * p.sms and p.n % p.warps == 0
        rep = tma.ptxas_report(p)
        assert rep["spill_bytes"] == 0 and rep["static_smem"] <= tma.STATIC_SMEM, (v, p, rep)
        assert rep["registers"] * p.threads * p.ctas <= 65536, (v, p, rep["registers"])
        assert p.ctas * (p.smem + 1024) <= tma.SM_SMEM and p.smem <= tma.SMEM_LIMIT
        kern = tma.build(p.n, p.k, residual=p.residual, swiglu=p.swiglu, **check.VARIANTS[v])
        bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in kern.ptx
        lsu = "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in kern.ptx
        assert (bulk, lsu) == (p.producer == "tma", p.producer == "lsu"), (v, p)
        assert ("createpolicy.fractional.L2::evict_first" in kern.ptx) == p.ef
        assert ("dp4a" in kern.ptx) != p.nomath
        assert f"nvfp4_gemv_tma_param_{p.n_inputs + p.n_outputs - 1}" in kern.ptx
        assert f"nvfp4_gemv_tma_param_{p.n_inputs + p.n_outputs}" not in kern.ptx


def test_plan_defaults_and_bad_plans():
    p = tma.plan(4096, 12288)
    assert (p.kch, p.stages, p.warps, p.threads, p.grid) == (1024, 6, 16, 544, 132)
    assert p.in_flight == 6 * 16 * (1024 + 128) and p.smem == p.in_flight + 12288 + 768 + 96
    assert tma.plan(4096, 1024).kch == 512  # K / 2 when smaller
    assert tma.plan(64, 4096).grid == 4  # no CTA without rows
    for kw, match in [
        ({"kch": 768}, "kch=768"),
        ({"warps": 24}, "warps=24"),
        ({"stages": 1}, "stages=1"),
        ({"stages": 40}, "do not fit"),
        ({"ctas": 2, "stages": 8}, "do not fit"),
        ({"producer": "dma"}, "producer='dma'"),
        ({"producer": "lsu", "ef": True}, "needs producer 'tma'"),
        ({"swiglu": "stack"}, "swiglu='stack'"),
        ({"swiglu": "scalar", "warps": 8}, "swiglu needs warps=16"),
        ({"swiglu": "scalar", "residual": True}, "no residual"),
    ]:
        with pytest.raises(KernelError, match=match):
            tma.plan(4096, 4096, **kw)
    with pytest.raises(KernelError, match="K=1000"):
        tma.plan(4096, 1000)
    with pytest.raises(SystemExit, match="--variants"):
        check.main(["--out", "unused.json", "--variants", "tma,nope"])


def test_check_rejects_bad_shapes_before_any_gpu_work():
    with pytest.raises(SystemExit, match="--shapes '4096'"):
        check.main(["--out", "unused.json", "--shapes", "4096"])
    with pytest.raises(SystemExit, match="K=1000"):
        check.main(["--out", "unused.json", "--shapes", "4096x1000"])


def test_float64_reference_decodes_as_rejax_nvfp4():
    # the device check's reference: codes and E4M3 bytes -> e2m1 x SF in float64, on torch;
    # rejax.nvfp4.dequantize of the same bytes (global scale 1) must give the same values
    torch = pytest.importorskip("torch")
    import jax
    import jax.numpy as jnp

    from rejax import nvfp4

    rng = np.random.default_rng(0)
    p = rng.integers(0, 256, (3, 32), dtype=np.uint8)
    s = rng.integers(*check.SCALES, (3, 4), dtype=np.uint8)
    lut = torch.tensor(check.LUT, dtype=torch.float64)
    got = check._values64(torch, lut, torch.from_numpy(p), torch.from_numpy(s)).numpy()
    t = nvfp4.Nvfp4Tensor(
        jnp.asarray(p),
        jax.lax.bitcast_convert_type(jnp.asarray(s), jnp.float8_e4m3fn),
        jnp.float32(1.0),
        (3, 64),
    )
    np.testing.assert_array_equal(got, np.asarray(nvfp4.dequantize(t), np.float64))


def test_summary_ratios():
    timing = [
        {"case": "a", "production_s": 2e-6, "tma_s": 1e-6, "read_floor_4cta_s": 1e-6},
        {"case": "b", "production_s": 8e-6, "tma_s": 2e-6, "read_floor_4cta_s": 1e-6},
        {"case": "b+res", "residual": True, "production_s": 4e-6, "lsu_s": 8e-6,
         "read_floor_4cta_s": 1e-6},
    ]  # fmt: skip
    out = check.summarize(timing, ["tma", "lsu"])
    plain, res = out["plain"], out["residual"]
    assert plain["tma"]["time_over_production"] == [0.5, 0.25]
    assert plain["tma"]["geomean_over_production"] == pytest.approx(np.sqrt(0.125))
    assert plain["tma"]["geomean_over_read_floor"] == pytest.approx(np.sqrt(2.0))
    assert plain["production"]["us"] == [2.0, 8.0] and "lsu" not in plain
    assert res["lsu"]["time_over_production"] == [2.0] and res["lsu"]["cases"] == ["b+res"]
    assert "tma" not in res
