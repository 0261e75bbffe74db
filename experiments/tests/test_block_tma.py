"""experiments/kernels/nvfp4_block_tma.{cu,py}: plans, and every planned kernel through NVRTC and
ptxas (the device check is experiments/kernels/check_block_tma.py)."""

import pytest

from cuda_ops.build import KernelError
from experiments.kernels import check_block_tma as check
from experiments.kernels import nvfp4_block_tma as blk


def test_every_planned_block_fits_one_cta_an_sm_without_spills():
    pytest.importorskip("cuda.bindings.nvrtc")
    plans = check.problems() + [
        ("small", blk.plan(512, 512, 768)),  # kch 128: every K / 2 a multiple
        ("small_lsu", blk.plan(1024, 2048, 3072, producer="lsu", sms=16)),
    ]
    for v, p in plans:
        rep = blk.ptxas_report(p)
        assert rep["spill_bytes"] == 0 and rep["static_smem"] <= blk.STATIC_SMEM, (v, p, rep)
        assert rep["registers"] * p.threads <= 65536, (v, p, rep["registers"])
        assert p.smem + blk.STATIC_SMEM <= blk.SMEM_LIMIT and p.grid <= p.sms
        kern = blk.build(p.d, p.ko, p.f, **{f: getattr(p, f) for f in ("kch", "stages", "sms",
                         "producer", "ef", "gw_rows")})  # fmt: skip
        rows = [kern.plan.defines()[f"GW_ROWS_{m}"] for m in ("O", "GU", "D")]
        assert rows == [int(r) for r in p.gw_rows]
        ptx = kern.ptx
        bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
        lsu = "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in ptx
        assert (bulk, lsu) == (p.producer == "tma", p.producer == "lsu"), (v, p)
        assert ("createpolicy.fractional.L2::evict_first" in ptx) == p.ef
        # the grid barrier's module-global words, the exact block dots, the E4M3 scale convert
        assert "g_block_count" in ptx and "g_block_gen" in ptx and "atom.global.add" in ptx
        assert "dp4a" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
        n = blk.N_INPUTS + len(blk.OUTPUTS)
        assert f"{blk.ENTRY}_param_{n - 1}" in ptx and f"{blk.ENTRY}_param_{n}" not in ptx


def test_every_planned_pre_attention_kernel_compiles_without_spills():
    pytest.importorskip("cuda.bindings.nvrtc")
    shape = (*blk.QWEN3_8B_ATTENTION, 1536)
    plans = [blk.plan_qkv(*shape, **kw, **check.QKV_VARIANTS[v]) for v in check.QKV_VARIANTS
             for kw in ({}, {"gw_rows": True, "index_rows": True}, {"qk_norm": False})]  # fmt: skip
    plans.append(blk.plan_qkv(256, 4, 2, 32, 16))  # the CPU harness test's shape
    for p in plans:
        rep = blk.ptxas_report_qkv(p)
        assert rep["spill_bytes"] == 0 and rep["registers"] * p.threads <= 65536, (p, rep)
        assert p.smem + blk.STATIC_SMEM <= blk.SMEM_LIMIT and p.grid <= min(p.sms, p.n // 16)
        kern = blk.build_qkv(p.d, p.heads, p.kv_heads, p.head_dim, p.slots,
                             **{f: getattr(p, f) for f in ("qk_norm", "index_rows", "kch",
                                "stages", "producer", "ef", "gw_rows")})  # fmt: skip
        n = blk.QKV_INPUTS + len(blk.QKV_OUTPUTS)
        assert f"{blk.QKV_ENTRY}_param_{n - 1}" in kern.ptx and blk.ENTRY not in kern.ptx
        assert "g_block_gen" in kern.ptx and "st.global.u16" in kern.ptx  # barrier, rope tail
    assert blk.plan_qkv(*shape).kch == 1024 and blk.plan_qkv(*shape).grid == 132
    with pytest.raises(KernelError, match="head_dim=100"):
        blk.plan_qkv(4096, 32, 8, 100, 1536)
    with pytest.raises(KernelError, match="slots=0"):
        blk.plan_qkv(4096, 32, 8, 128, 0)


def test_plan_defaults_and_bad_plans():
    p = blk.plan(*blk.QWEN3_8B)
    assert (p.kch, p.stages, p.grid, p.threads) == (1024, 6, 132, 544)
    assert p.smem == 6 * 16 * (1024 + 128) + 12288 + 768 + 96
    # Qwen3-8B's o, gate_up and down: 4.5 bytes a weight in codes and scales (94.4 MB)
    assert p.weight_bytes == 4096 * 4096 * 9 // 16 + 3 * 12288 * 4096 * 9 // 16
    assert blk.plan(*blk.QWEN3_8B, sms=114).grid == 114  # every CTA resident: one an SM
    assert blk.plan(256, 256, 512).grid == 16  # no CTA without a row group of o
    assert blk.plan(1024, 1024, 1536).kch == 256  # the largest dividing every K / 2
    assert blk.plan(1024, 2048, 3072).kch == 512
    assert blk.plan(*blk.QWEN3_8B, eps=1e-5).defines()["NORM_EPS"] == "1e-05f"
    big = blk.plan(*blk.QWEN3_8B, kch=2048)
    assert big.stages == 5 and big.smem + blk.STATIC_SMEM <= blk.SMEM_LIMIT  # as many as fit
    for kw, match in [
        ({"kch": 768}, "kch=768"),
        ({"stages": 1}, "stages=1"),
        ({"stages": 20}, "do not fit"),
        ({"producer": "dma"}, "producer='dma'"),
        ({"producer": "lsu", "ef": True}, "needs producer 'tma'"),
        ({"sms": 0}, "sms=0"),
        ({"gw_rows": (True, False)}, "gw_rows="),
    ]:
        with pytest.raises(KernelError, match=match):
            blk.plan(*blk.QWEN3_8B, **kw)
    with pytest.raises(KernelError, match="f=1000"):
        blk.plan(4096, 4096, 1000)


def test_check_rejects_bad_arguments_before_any_gpu_work():
    with pytest.raises(SystemExit, match="--variants"):
        check.main(["--out", "unused.json", "--variants", "tma,nope"])
    with pytest.raises(SystemExit, match="'4096x4096': expected --shape"):
        check.main(["--out", "unused.json", "--shape", "4096x4096"])
    with pytest.raises(SystemExit, match="--parts"):
        check.main(["--out", "unused.json", "--parts", "block,mlp"])
    with pytest.raises(SystemExit, match="--qkv-variants"):
        check.main(["--out", "unused.json", "--qkv-variants", "tma_a16"])
    with pytest.raises(SystemExit, match="head_dim=100"):
        check.main(["--out", "unused.json", "--qkv-shape", "4096x32x8x100x1536"])
    with pytest.raises(SystemExit, match="d=1000"):
        check.main(["--out", "unused.json", "--shape", "1000x4096x12288"])


def test_static_scale_of_an_amax_puts_its_block_scale_at_448():
    assert check._scale_of(6.0 * 448.0 * 0.5) == pytest.approx(0.5)
    assert check._scale_of(0.0) > 0  # never a zero scale (its inverse is taken)


class _FakeBlockGpu:
    """The block check's harness on the CPU: test_gemv_tma's fake GEMVs and SwiGLU quantizer, a
    fake RMSNorm quantizer, and a fake block kernel that runs those same fakes in the kernel's
    operand order. A wrong pointer anywhere (the harness's lists or the block's) shows as a
    mismatch; the kernels' arithmetic is not what this exercises."""

    def __init__(self, torch, monkeypatch):
        from types import SimpleNamespace

        from experiments.tests.test_gemv_tma import _FakeGpu

        self.torch, self.ns = torch, SimpleNamespace
        self.fake = _FakeGpu(torch, monkeypatch)
        monkeypatch.setattr(check, "DEVICE", "cpu")
        monkeypatch.setattr(check, "_launch_ptx", self.ptx)

    def norm_quant(self, y, xg, nw, layer, outs):
        """quantize_activation of rms_norm(y) (nw given) or of y, static scale xg[layer]."""
        import numpy as np

        torch, f = self.torch, self.fake
        n = y.float()
        if nw is not None:
            n = (n * torch.rsqrt((n * n).mean() + 1e-6)).to(torch.bfloat16).float()
            n = n * nw[layer].float()
        scale = float(xg[layer])
        q = f.nvfp4.quantize_activation(f.jnp.asarray(n.numpy()).reshape(1, -1), scale)
        codes, scales, g = outs
        codes.copy_(torch.from_numpy(np.array(q.packed).reshape(-1)))
        scales.copy_(torch.from_numpy(np.array(q.scales).view(np.uint8).reshape(-1)))
        g.fill_(scale)

    def rope(self, qkv, qn, kn, layer, pos, index, inv_freq, kc, vc, q_out=None):
        """A stand-in for rope_cache (not its arithmetic): q scaled by q_norm and shifted by the
        position and the first frequency, k scaled by k_norm, both with v into the slot."""
        f, torch = self.fake, self.torch
        q_out = f.t(q_out) if q_out is not None else None
        kc, vc, y = f.t(kc), f.t(vc), f.t(qkv).float()
        li, slot = int(f.t(layer)), int(f.t(index)[0])
        kvh, hd = kc.shape[3], kc.shape[4]
        nq = y.numel() - 2 * kvh * hd
        q = y[:nq].view(-1, hd) * f.t(qn)[li].float() + float(f.t(pos)[0] * f.t(inv_freq)[0])
        k = y[nq : nq + kvh * hd].view(kvh, hd) * f.t(kn)[li].float()
        v = y[nq + kvh * hd :].view(kvh, hd)
        if q_out is not None:
            q_out.copy_(q.reshape(-1).to(torch.bfloat16))
        kc[li, 0, slot] = k.to(torch.bfloat16)
        vc[li, 0, slot] = v.to(torch.bfloat16)

    def ptx(self, ptx, entry, grid, threads, smem, ptrs, stream):
        f, torch = self.fake, self.torch
        if entry == "nvfp4_quantize_bf16":
            x, nw, outs = f.t(ptrs[0]), f.t(ptrs[2]), [f.t(p) for p in ptrs[4:]]
            layer = int(f.t(ptrs[3]))
            if nw.numel() > 1:  # RMSNorm prologue
                return self.norm_quant(x, f.t(ptrs[1]), nw, layer, outs)
            if x.numel() == 2 * outs[0].numel():  # no prologue (o's input)
                return self.norm_quant(x, f.t(ptrs[1]), None, layer, outs)
        if entry == "qk_norm_rope_cache":
            return self.rope(*ptrs[:9], ptrs[9])
        if entry == blk.QKV_ENTRY:
            (x, nw, xg, wp, ws, wg, layer, qn, kn, pos, index, inv_freq, kc, vc, q_out, _, _,
             qkv, gp, gs) = ptrs  # fmt: skip
            gg = torch.zeros(1)
            li = int(f.t(layer))
            self.norm_quant(f.t(x), f.t(xg), f.t(nw), li, [f.t(gp), f.t(gs), gg])
            f.gemv(self.ns(), [gp, gs, gg.data_ptr(), wp, ws, wg, layer, qkv])
            return self.rope(qkv, qn, kn, layer, pos, index, inv_freq, kc, vc, q_out)
        if entry != blk.ENTRY:
            return f.ptx(ptx, entry, grid, threads, smem, ptrs, stream)
        if len(ptrs) == blk.N_INPUTS - 1 + len(blk.OUTPUTS):  # a_bf16: a, xgo
            a, xgo, *rest = ptrs
            q = [torch.zeros(f.t(a).numel() // 2, dtype=torch.uint8),
                 torch.zeros(f.t(a).numel() // 16, dtype=torch.uint8), torch.zeros(1)]  # fmt: skip
            self.norm_quant(f.t(a), f.t(xgo), None, int(f.t(rest[13])), q)
            ptrs = [t.data_ptr() for t in q] + rest
        (ap, as_, ag, h, wo_p, wo_s, wo_g, nw, xgu, wgu_p, wgu_s, wgu_g, xgd, wd_p, wd_s, wd_g,
         layer, y2, y1, gp, gs, dp, ds) = ptrs  # fmt: skip
        gg, dg = torch.zeros(1), torch.zeros(1)
        f.gemv(self.ns(residual=True), [ap, as_, ag, h, wo_p, wo_s, wo_g, layer, y1])
        li = int(f.t(layer))
        self.norm_quant(f.t(y1), f.t(xgu), f.t(nw), li, [f.t(gp), f.t(gs), gg])
        f.gemv(
            self.ns(swiglu="stacked"),
            [gp, gs, gg.data_ptr(), wgu_p, wgu_s, wgu_g, layer, xgd, dp, ds, dg.data_ptr()],
        )
        f.gemv(self.ns(residual=True), [dp, ds, dg.data_ptr(), y1, wd_p, wd_s, wd_g, layer, y2])


def test_device_check_harness_on_the_cpu(monkeypatch):
    # calibration, the byte comparisons against the composition and production, the timing rows
    # and the summary, with fake kernels (see _FakeBlockGpu): every output equal; a fake block
    # whose down adds h instead of y1 fails the y2 comparison and only it
    torch = pytest.importorskip("torch")
    pytest.importorskip("cuda.bindings.nvrtc")  # the plans still build the PTX
    from experiments import bench_kernel as bk

    fake = _FakeBlockGpu(torch, monkeypatch)
    shape = (256, 512, 512)
    for gw_rows in check.GW_ROWS:
        prob = check.Block(torch, *shape, layers=2, copies=1, gw_rows=gw_rows, eps=1e-6,
                           seed=(shape, gw_rows))  # fmt: skip
        prob.calibrate(torch.tensor(1, dtype=torch.int32))
        assert 0 < float(prob.xgu[1]) < 1 and 0 < float(prob.xgd[1]) < 1
        variants = ["tma", "lsu", "tma_a16"]
        rows, failures = check.check(torch, prob, variants, 132)
        assert failures == [] and [r["variant"] for r in rows] == variants, failures
        for r in rows:
            assert r["ok"] and set(r["equal_to_composition"].values()) == {1.0}
            assert set(r["equal_to_production"].values()) == {1.0}
            assert r["y2_rel_to_production"] == 0.0
        # the calibration put each stage at order one
        o = prob.outs()
        prob.production(0, torch.tensor(1, dtype=torch.int32), o)
        assert 0.3 < float(o["y2"].float().std()) < 5
    tm = check.timing(torch, bk, prob, ["tma", "lsu", "tma_a16"], 132, skip={"lsu"})
    assert tm["tma_a16_s"] == 1e-6
    assert tm["production_s"] == tm["tma_s"] == 1e-6 and "lsu_s" not in tm
    summary = check.summarize(tm, ["tma", "lsu"], copy_bps=None)
    assert summary["tma"]["over_production"] == 1.0 and "lsu" not in summary
    assert summary["tma"]["TBps"] == round(blk.plan(*shape).weight_bytes / 1e-6 / 1e12, 3)

    real = fake.ptx

    def wrong_residual(ptx, entry, grid, threads, smem, ptrs, stream):
        if entry == blk.ENTRY:  # down's residual from h (operand 3) instead of y1
            ptrs = list(ptrs)
            real(ptx, entry, grid, threads, smem, ptrs, stream)
            f = fake.fake
            f.gemv(fake.ns(residual=True), [ptrs[21], ptrs[22], _dg(torch, prob, ptrs[16], f),
                                            ptrs[3], *ptrs[13:17], ptrs[17]])  # fmt: skip
            return None
        return real(ptx, entry, grid, threads, smem, ptrs, stream)

    monkeypatch.setattr(check, "_launch_ptx", wrong_residual)
    rows, failures = check.check(torch, prob, ["tma"], 132)
    eq = rows[0]["equal_to_composition"]
    assert not rows[0]["ok"] and len(failures) == 1 and eq["y2"] < 1.0
    assert all(v == 1.0 for k, v in eq.items() if k != "y2")


def test_pre_attention_check_harness_on_the_cpu(monkeypatch):
    # the qkv part of the check: calibration, bytes against the composition (quantizer, TMA
    # GEMV, rope_cache) and production, timing rows, with fake kernels; a fake kernel that
    # writes the wrong cache slot fails the cache comparisons only
    torch = pytest.importorskip("torch")
    pytest.importorskip("cuda.bindings.nvrtc")
    from experiments import bench_kernel as bk

    fake = _FakeBlockGpu(torch, monkeypatch)
    for gw_rows in (False, True):
        prob = check.Qkv(torch, 256, 4, 2, 32, slots=16, layers=2, copies=1, gw_rows=gw_rows,
                         eps=1e-6, seed=("cpu", gw_rows))  # fmt: skip
        prob.calibrate(torch.tensor(1, dtype=torch.int32))
        assert 0 < float(prob.xg[1]) < 1
        rows, failures = check.check_qkv(torch, prob, ["tma", "lsu"], 132)
        assert failures == [] and all(r["ok"] for r in rows), failures
        assert set(rows[0]["equal_to_production"].values()) == {1.0}
        assert rows[0]["equal_to_composition"]["k_cache"] == 1.0
    tm = check.timing_qkv(torch, bk, prob, ["tma", "lsu"], 132, skip={"lsu"})
    assert tm["tma_s"] == tm["production_s"] == 1e-6 and "lsu_s" not in tm

    real = fake.ptx

    def wrong_slot(ptx, entry, grid, threads, smem, ptrs, stream):
        if entry == blk.QKV_ENTRY:  # the index operand moved one slot on
            ptrs = list(ptrs)
            moved = (fake.fake.t(ptrs[10]) + 1) % prob.slots
            ptrs[10] = moved.data_ptr()
        return real(ptx, entry, grid, threads, smem, ptrs, stream)

    monkeypatch.setattr(check, "_launch_ptx", wrong_slot)
    rows, failures = check.check_qkv(torch, prob, ["tma"], 132)
    eq = rows[0]["equal_to_composition"]
    assert not rows[0]["ok"] and len(failures) == 1
    assert eq["k_cache"] < 1.0 and eq["v_cache"] < 1.0 and eq["q_out"] == eq["qkv"] == 1.0


def _dg(torch, prob, layer_ptr, f):
    """down's input global scale (xgd at the layer) in a buffer of its own: its pointer."""
    t = torch.tensor([float(prob.xgd[int(f.t(layer_ptr))])])
    return t.data_ptr()


def _decode_step_args(batch, cfg, params):
    import jax
    import jax.numpy as jnp

    from rejax import sampling
    from rejax.cache import init_cache

    smp = sampling.Greedy()
    return (params, jnp.zeros((batch, cfg.vocab_size), jnp.float32),
            init_cache(cfg, batch, 8, jnp.bfloat16), jnp.zeros((batch,), jnp.int32), smp,
            sampling.sampler_init(smp, batch), jax.random.split(jax.random.key(0), batch),
            jnp.int32(0))  # fmt: skip


def test_install_makes_the_batch_1_post_attention_block_one_launch():
    # lowered for CUDA (no GPU), a batch-1 decode step's o GEMV, gate_up quantizer, gate_up and
    # down GEMVs become one block kernel while installed (o's quantizer stays); batch 2 keeps
    # production's; on the CPU the step computes exactly what it did; uninstall restores it
    pytest.importorskip("cuda.bindings.nvrtc")
    import dataclasses
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np

    from rejax import decoder
    from rejax import params as rparams
    from rejax.config import Config
    from rejax.decode import decode_step

    cfg = Config(quant="nvfp4", hidden_size=1024, intermediate_size=2048, head_dim=128,
                 num_heads=8, num_kv_heads=2, num_layers=2, vocab_size=512)  # fmt: skip
    params = rparams.init_params(cfg, 0, jnp.bfloat16)
    scale = jnp.full((cfg.num_layers,), 0.02, jnp.float32)
    weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
    params = dataclasses.replace(params, weights=weights)

    def names(batch):
        args = _decode_step_args(batch, cfg, params)
        text = decode_step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return re.findall(r"name = \\22(\w+)\\22", text)

    def run():
        out = decode_step(*_decode_step_args(1, cfg, params))
        return [np.asarray(a) for a in jax.tree.leaves(out) if hasattr(a, "dtype")]

    before, cpu_before = names(1), run()
    original, pre_original = decoder._post_attention, decoder._pre_attention
    uninstall = blk.install(stages=4)
    try:
        assert decoder._post_attention is not original
        jax.clear_caches()  # JAX keeps lowerings: the swap applies to new ones only
        got, cpu_got = names(1), run()
        two = names(2)
    finally:
        uninstall()
    uninstall = blk.install(a_bf16=True)  # o's input quantized in the block: no quantizer
    try:
        jax.clear_caches()
        got_a16 = names(1)
        undo_qkv = blk.install_qkv()  # and the pre-attention kernel: two launches + attention
        try:
            jax.clear_caches()
            both, cpu_both = names(1), run()
        finally:
            undo_qkv()
    finally:
        uninstall()
    jax.clear_caches()
    assert decoder._post_attention is original and names(1) == before
    assert decoder._pre_attention is pre_original
    # production: the quantizers of qkv, o, gate_up and down's inputs and the four GEMVs (down's
    # quantizer stays at this small F); installed: qkv's quantizer and GEMV, o's quantizer, the
    # block
    assert before.count("nvfp4_gemv_w4a4") == 4 and before.count("nvfp4_quantize_bf16") == 4
    assert got == [*before[: before.index("nvfp4_gemv_w4a4", 2) - 1], "nvfp4_quantize_bf16",
                   blk.ENTRY]  # fmt: skip
    assert got_a16 == [*got[:-2], blk.ENTRY]
    assert both == [blk.QKV_ENTRY, blk.ENTRY]  # the attention's Pallas kernels beside them
    assert all(np.array_equal(a, b) for a, b in zip(cpu_both, cpu_before, strict=True))
    assert blk.ENTRY not in two and two.count("nvfp4_gemv_w4a4") == 4
    assert all(np.array_equal(a, b) for a, b in zip(cpu_got, cpu_before, strict=True))
    with pytest.raises(KernelError, match="stages=1"):
        blk.install(stages=1)
    assert decoder._post_attention is original


def test_why_not_names_what_the_block_kernel_does_not_take():
    import jax.numpy as jnp

    from rejax import params as rparams
    from rejax.config import Config

    cfg = Config(quant="nvfp4", hidden_size=1024, intermediate_size=2048, head_dim=128,
                 num_heads=8, num_kv_heads=2, num_layers=2, vocab_size=512)  # fmt: skip
    params = rparams.init_params(cfg, 0, jnp.bfloat16)
    scale = jnp.full((cfg.num_layers,), 0.02, jnp.float32)
    lw = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})["layers"]
    x, out = jnp.zeros((1, 1, 1024), jnp.bfloat16), jnp.zeros((1, 1, 1024), jnp.bfloat16)
    assert blk.why_not(x, out, lw, "two") == ""
    assert "one token of one row" in blk.why_not(jnp.zeros((2, 1, 1024)), out, lw, "two")
    assert "kernels='one'" in blk.why_not(x, out, lw, "one")
    no_scale = {**lw, "mlp": {**lw["mlp"], "down_proj": {**lw["mlp"]["down_proj"],
                                                           "input_scale": None}}}  # fmt: skip
    assert "static input scales" in blk.why_not(x, out, no_scale, "two")
