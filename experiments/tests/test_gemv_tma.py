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
        kern = tma.build(p.n, p.k, residual=p.residual, swiglu=p.swiglu, gw_rows=p.gw_rows,
                         **check.VARIANTS[v])  # fmt: skip
        assert kern.plan.defines()["GW_ROWS"] == int(p.gw_rows)
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


class _FakeGpu:
    """The device check's harness run on the CPU: every kernel launch is computed by torch /
    rejax.nvfp4 from the buffers its pointers name (float64 products rounded once to bf16; the
    SwiGLU epilogue and the quantizer by quantize_activation), and the timers return constants.
    It exercises the harness (operand order, shapes, comparisons, summaries), not the kernels."""

    def __init__(self, torch, monkeypatch):
        import jax.numpy as jnp

        from cuda_ops import nvfp4_gemv
        from experiments import bench_kernel
        from rejax import nvfp4

        self.torch, self.jnp, self.nvfp4 = torch, jnp, nvfp4
        self.buffers = {}
        real = torch.Tensor.data_ptr

        def data_ptr(t):
            ptr = real(t)
            self.buffers[ptr] = t
            return ptr

        monkeypatch.setattr(torch.Tensor, "data_ptr", data_ptr)
        monkeypatch.setattr(check, "DEVICE", "cpu")
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 0}))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(tma.TmaKernel, "launch", lambda k, s, p: self.gemv(k.plan, p))
        monkeypatch.setattr(tma.TmaKernel, "attributes", lambda k: {"registers": 0})
        monkeypatch.setattr(nvfp4_gemv.GemvKernel, "launch", lambda k, s, p: self.gemv(k.plan, p))
        monkeypatch.setattr(check, "_launch_ptx", self.ptx)
        monkeypatch.setattr(bench_kernel, "time_torch_graph", lambda torch, fns: 1e-6)
        monkeypatch.setattr(bench_kernel, "time_read_floor_graph", lambda *a, **k: 2e-6)

    def t(self, ptr):
        return self.buffers[ptr]

    def y(self, xp, xs, xg, wp, ws, wg, layer):
        torch = self.torch
        lut = torch.tensor(check.LUT, dtype=torch.float64)
        li = int(self.t(layer))
        x = check._values64(torch, lut, self.t(xp)[None], self.t(xs)[None])[0]
        w = check._values64(torch, lut, self.t(wp)[li], self.t(ws)[li])
        gw = self.t(wg)[li]  # one scale, or one a row
        return w @ x * float(self.t(xg)[0]) * (gw.double() if gw.ndim else float(gw))

    def gemv(self, plan, p):
        torch = self.torch
        residual, swiglu = getattr(plan, "residual", False), getattr(plan, "swiglu", None)
        swiglu = swiglu or getattr(plan, "swiglu_out", None)
        if swiglu is not None:  # ..., layer, xgd, dp, ds, dg
            y = self.y(*p[:7]).to(torch.bfloat16)
            return self.swiglu_quant(y, self.t(p[7]), int(self.t(p[6])), swiglu, p[8:])
        head = p[:3] + p[4 if residual else 3 : -1]
        y = self.y(*head)
        if residual:
            y = self.t(p[3]).double() + y.to(torch.bfloat16).double()
        self.t(p[-1]).copy_(y.to(torch.bfloat16))

    def swiglu_quant(self, y, xgd, layer, mode, outs):
        import numpy as np

        torch, jnp = self.torch, self.jnp
        f = y.shape[-1] // 2
        g, u = y[..., :f].float(), y[..., f:].float()
        sig = torch.sigmoid(g).to(torch.bfloat16).float()
        h = ((g * sig).to(torch.bfloat16).float() * u).to(torch.bfloat16)
        scale = float(xgd[layer if mode == "stacked" else 0])
        q = self.nvfp4.quantize_activation(jnp.asarray(h.float().numpy()).reshape(1, f), scale)
        dp, ds, dg = (self.t(o) for o in outs)
        dp.copy_(torch.from_numpy(np.array(q.packed).reshape(-1)))
        ds.copy_(torch.from_numpy(np.array(q.scales).view(np.uint8).reshape(-1)))
        dg.fill_(scale)

    def ptx(self, ptx, entry, grid, threads, smem, ptrs, stream):
        if entry == "nvfp4_quantize_bf16":  # x = y [1, 2F], xg, nw, layer, xp, xs, xg_out
            stacked = self.t(ptrs[1]).numel() > 1
            mode = "stacked" if stacked else "scalar"
            layer = int(self.t(ptrs[3]))
            return self.swiglu_quant(self.t(ptrs[0]), self.t(ptrs[1]), layer, mode, ptrs[4:])
        assert entry == "nvfp4_gemv_w4a4", entry  # production's SWIGLU_OUT GEMV
        y = self.y(*ptrs[:7]).to(self.torch.bfloat16)
        mode = "stacked" if self.t(ptrs[7]).numel() > 1 else "scalar"
        return self.swiglu_quant(y, self.t(ptrs[7]), int(self.t(ptrs[6])), mode, ptrs[8:])


def test_device_check_harness_on_the_cpu(monkeypatch):
    # the check's Python around the kernels (operand lists, references, comparisons, timing
    # rows, summary), with fake kernels that compute the exact result: every case passes; a fake
    # production that drops the residual makes the residual cases fail the bound
    torch = pytest.importorskip("torch")
    pytest.importorskip("cuda.bindings.nvrtc")  # the plans still build the PTX
    from experiments import bench_kernel as bk

    _FakeGpu(torch, monkeypatch)
    variants = ["tma", "lsu", "tma_nomath"]
    rows, timing, failures = check.check_shape(torch, bk, 512, 2048, variants, True, 132)
    assert failures == [] and [r["variant"] for r in rows] == ["production", *variants]
    assert all(r["ok"] and r["vs_production_bitwise"] == 1.0 for r in rows[1:3])
    assert timing[0]["tma_s"] == 1e-6 and timing[0]["read_floor_4cta_s"] == 2e-6
    for gw_rows in (False, True):
        kw = {"residual": True, "layers": 3, "layer": 2, "gw_rows": gw_rows}
        rows, timing, failures = check.check_shape(torch, bk, 512, 2048, ["tma"], False, 132, **kw)
        assert failures == [] and timing == [] and rows[1]["ok"]
    rows, _, failures = check.check_swiglu(torch, bk, 512, 2048, ["tma"], False, 132,
                                           (0.0047, 0.0031), gw_rows=True)  # fmt: skip
    assert failures == [] and rows[0]["ok"] and rows[0]["case"].endswith("gw_rows")
    for xgd in ((0.0047, 0.0031), (1e-9,)):
        rows, timing, failures = check.check_swiglu(torch, bk, 512, 2048, ["tma"], True, 132, xgd)
        assert failures == [] and rows[0]["equal_to_production"] == [1.0, 1.0, 1.0], rows
        assert timing[0]["swiglu"] and "tma_s" in timing[0]
    summary = check.summarize(timing, ["tma"])
    assert summary["swiglu"]["tma"]["time_over_production"] == [1.0]

    from cuda_ops import nvfp4_gemv

    def no_residual(k, s, p):  # production forgets the residual
        head = p[:3] + p[4:-1] if k.plan.residual else p[:-1]
        fake.t(p[-1]).copy_(fake.y(*head).to(torch.bfloat16))

    fake = _FakeGpu(torch, monkeypatch)
    monkeypatch.setattr(nvfp4_gemv.GemvKernel, "launch", no_residual)
    rows, _, failures = check.check_shape(torch, bk, 512, 2048, ["tma"], False, 132, residual=True)
    assert rows[1]["vs_production_bitwise"] < 0.5 and failures == []  # tma itself is right


def test_install_swaps_the_decode_steps_batch_1_gemvs():
    # lowered for CUDA (no GPU), a batch-1 decode step's four W4A4 GEMVs become the TMA kernel
    # while installed (same operands: the quantizers and the rest are unchanged), batch 2 keeps
    # production's, and uninstall restores production's build
    pytest.importorskip("cuda.bindings.nvrtc")
    import dataclasses
    import re

    import jax
    import jax.numpy as jnp

    from cuda_ops import nvfp4_gemv
    from rejax import params as rparams
    from rejax import sampling
    from rejax.cache import init_cache
    from rejax.config import Config
    from rejax.decode import decode_step

    cfg = Config(quant="nvfp4", hidden_size=1024, intermediate_size=2048, head_dim=128,
                 num_heads=8, num_kv_heads=2, num_layers=2, vocab_size=512)  # fmt: skip
    params = rparams.init_params(cfg, 0, jnp.bfloat16)
    scale = jnp.full((cfg.num_layers,), 0.02, jnp.float32)
    weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
    params = dataclasses.replace(params, weights=weights)

    def names(batch):
        smp = sampling.Greedy()
        args = (params, jnp.zeros((batch, cfg.vocab_size), jnp.float32),
                init_cache(cfg, batch, 8, jnp.bfloat16), jnp.zeros((batch,), jnp.int32), smp,
                sampling.sampler_init(smp, batch), jax.random.split(jax.random.key(0), batch),
                jnp.int32(0))  # fmt: skip
        text = decode_step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return re.findall(r"name = \\22(\w+)\\22", text)

    before = names(1)
    build = nvfp4_gemv.build
    uninstall = tma.install(stages=4)
    try:
        assert nvfp4_gemv.build is not build
        jax.clear_caches()  # JAX keeps lowerings: the swap applies to new ones only
        got = names(1)
        assert "nvfp4_gemv_tma" not in names(2)
    finally:
        uninstall()
    jax.clear_caches()
    assert nvfp4_gemv.build is build and names(1) == before
    assert before.count("nvfp4_gemv_w4a4") == 4 and "nvfp4_gemv_tma" not in before
    assert got == ["nvfp4_gemv_tma" if e == "nvfp4_gemv_w4a4" else e for e in before]
    with pytest.raises(KernelError, match="stages=1"):
        tma.install(stages=1)
    assert nvfp4_gemv.build is build


def test_every_paper_shape_plans_and_compiles():
    # bench_kernel.py --gemv-tma times the kernel on all of the paper's layer shapes: each gets
    # a plan (chunks of whole 128-byte scale rows, partial lane rounds where K / 2 is not a
    # multiple of 512) that ptxas compiles without spills
    pytest.importorskip("cuda.bindings.nvrtc")
    from experiments.kernel_shapes import unique_shapes

    for n, k in unique_shapes():
        p = tma.plan(n, k)
        assert (k // 2) % p.kch == 0 and p.kch % 128 == 0 and p.stages >= 2, (n, k, p)
        rep = tma.ptxas_report(p)
        assert rep["spill_bytes"] == 0 and rep["registers"] * p.threads <= 65536, (n, k, rep)
    assert [tma.default_kch(k) for k in (4096, 5120, 3584, 18944, 13824)] == [
        1024, 640, 896, 4736, 768]  # fmt: skip
