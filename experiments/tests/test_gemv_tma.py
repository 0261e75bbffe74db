"""experiments/kernels/nvfp4_gemv_tma.{cu,py}: plans, and every planned kernel through NVRTC and
ptxas (the device check is experiments/kernels/check_gemv_tma.py)."""

import pytest

from cuda_ops.build import KernelError
from experiments.kernels import check_gemv_tma as check
from experiments.kernels import nvfp4_gemv_tma as tma


def test_every_planned_kernel_fits_its_occupancy_without_spills():
    pytest.importorskip("cuda.bindings.nvrtc")
    for v, p in check.problems():
        assert p.grid <= p.ctas * p.sms and p.n % p.warps == 0
        rep = tma.ptxas_report(p)
        assert rep["spill_bytes"] == 0, (v, p)
        assert rep["registers"] * p.threads * p.ctas <= 65536, (v, p, rep["registers"])
        assert p.ctas * (p.smem + 1024) <= tma.SM_SMEM and p.smem <= tma.SMEM_LIMIT
        kern = tma.build(p.n, p.k, **check.VARIANTS[v])
        bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in kern.ptx
        lsu = "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in kern.ptx
        assert (bulk, lsu) == (p.producer == "tma", p.producer == "lsu"), (v, p)
        assert ("createpolicy.fractional.L2::evict_first" in kern.ptx) == p.ef
        assert ("dp4a" in kern.ptx) != p.nomath


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
