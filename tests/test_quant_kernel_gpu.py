"""GPU tests of the stand-alone activation quantizer `nvfp4_quantize_bf16` (marker `gpu`) and of
`fused_linear(kernels="two")` (quantizer kernel, then the plain W4A4 GEMV or the GEMM).

* Its codes, E4M3 scales and global scales equal `rejax.nvfp4.quantize_activation` of the
  prologue's output bitwise for prologue "none", static and dynamic global scales, zero and
  saturating blocks, at the GEMV's rows and above them. "rmsnorm" sums the mean square in the
  kernel's own order and "swiglu" takes CUDA's expf for the sigmoid (not XLA's logistic), so a
  few of the prologue's bf16 outputs may round the other way: >= QUANT_EQUAL of the code bytes
  equal (measured on the H200: 0.4-0.6% of the bytes differ with "swiglu") on the rows whose
  dynamic global scale agrees (a row's largest value rounded the other way changes its scale
  and so its codes: >= 90% of the rows agree, every scale within 1e-2).
* Its "xhat" form (-DXHAT_OUT=1, the GEMM's fp16 operand) equals
  `rejax.ops.linear.gemm_x_operand` of quantize_activation's codes and scales bitwise for
  prologue "none" (M = 9..256, K = 4096 and 12288, static and dynamic scales, zero rows, -0 and
  saturating blocks), and gemm_x_operand of the "codes" form's outputs bitwise for every
  prologue (the same device code).
* `fused_linear(kernels="two")` equals the unfused composition bitwise for prologue "none" with a
  residual (same quantized operands, the same GEMV or GEMM; the residual added in the linear's
  epilogue is the same bf16 add); from M = 8 on the linear is the GEMM, reading the quantizer
  kernel's x_hat (GemmOptions.x_quant "kernel", the default). At M = 64 that path equals the
  one without the x_hat form (XLA's quantizer and gemm_x_operand, then the same GEMM) bitwise
  for "none", and up to the quantizer's rounding for "rmsnorm" and "swiglu" (relative
  Frobenius error <= FUSED_RTOL; for "rmsnorm" also >= FUSED_EQUAL of the outputs equal).
* Its "xhat_tiles" form (-DXHAT_OUT=2, the wgmma GEMM's stage tiles) equals
  `to_stage_tiles(wgmma_x_operand(...))` of the "codes" form's outputs bitwise for every
  prologue (M = 9, 130, 300: padding rows of the last tile zero), and in front of the wgmma
  GEMM (`GemmOptions.wgmma_x_quant` "kernel") `fused_linear` equals the "xla" path bitwise for
  prologue "none" (the same codes, the same GEMM).
* The plain W4A4 GEMV with the residual epilogue (`gemv_call(residual=r)`, -DEPI_RES=1) equals
  r + the GEMV without it bitwise on the Qwen3-8B o_proj and down_proj shapes, M = 1..8, static
  and dynamic input scales; launched directly into a NaN-poisoned output it writes the same bits.

GEMM letters: M tokens, N out features, K in features.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_ops import nvfp4_gemm, nvfp4_gemv, nvfp4_quant
from rejax import layers, nvfp4
from rejax.ops import fused_linear as fl
from rejax.ops import linear as kernels

pytestmark = pytest.mark.gpu

QUANT_EQUAL = 0.97
FUSED_RTOL = 1e-2
FUSED_EQUAL = 0.97


def _x(m, width, seed, scale=2.0):
    x = jax.random.normal(jax.random.key(seed), (m, width), jnp.float32) * scale
    x = x.at[0, :16].set(0.0)  # a zero block
    x = x.at[m - 1, 32:48].set(3e4)  # a block that saturates E4M3 with the static scale
    return x.astype(jnp.bfloat16)


def _quantize(x, xg, nw, layer, k, fused):
    kern = nvfp4_quant.build(x.shape[0], k, fused)
    f = jax.jit(lambda *a: fl._quant_p.bind(*a, k=k, fused=fused, kernel=kern))
    ref = jax.jit(lambda *a: fl._quant_reference(*a, k=k, fused=fused))
    return [np.asarray(a) for a in f(x, xg, nw, layer)], [
        np.asarray(a) for a in ref(x, xg, nw, layer)
    ]


@pytest.mark.parametrize("prologue", ["none", "swiglu", "rmsnorm"])
@pytest.mark.parametrize("dynamic", [False, True, "stacked"])
@pytest.mark.parametrize("k", [4096, 12288])
def test_quantizer_equals_quantize_activation(k, dynamic, prologue):
    """ "stacked": a static input scale per layer [L], read by the kernel at the layer (the
    other layer's scale differs, so reading the wrong one changes the codes)."""
    stacked = dynamic == "stacked"
    dynamic = dynamic is True
    fused = nvfp4_gemv.Fused(
        prologue=prologue, dynamic=dynamic, norm_stacked=True, scale_stacked=stacked
    )
    width = 2 * k if prologue == "swiglu" else k
    norm = (1 + 0.1 * jax.random.normal(jax.random.key(3), (2, k))).astype(jnp.bfloat16)
    xg = jnp.asarray([0.05, 0.01] if stacked else [0.01], jnp.float32)
    layer = jnp.int32(1)
    for m in (1, 3, 8, 64, 300):  # the GEMV's rows, GEMM batches (300: one CTA a row)
        x = _x(m, width, m * 7 + k)
        got, want = _quantize(x, xg, norm, layer, k, fused)
        what = f"M={m} K={k} dynamic={dynamic} prologue={prologue}"
        if prologue != "none":
            # a prologue output that rounds the other way can be a row's largest value: that
            # row gets a slightly different dynamic global scale, and with it other block
            # scales and codes. So the codes and scales are compared with the prologue's output
            # quantized at the kernel's own global scales (given per row), and the global
            # scales with the reference's to 2% (two bf16 ulps of the amax: measured 1.02% with
            # swiglu on the H200, where XLA may keep the sigmoid in fp32 and the kernel rounds).
            np.testing.assert_allclose(got[2], want[2], rtol=2e-2, err_msg=what)
            h = fl._prologue(x, norm, layer, k=k, fused=fused).astype(jnp.bfloat16)
            q = nvfp4.quantize_activation(h, jnp.asarray(got[2]))
            at_own = (
                np.asarray(q.packed),
                np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)),
            )
            assert np.mean(got[0] == at_own[0]) >= QUANT_EQUAL, what
            assert np.mean(got[1] == at_own[1]) >= QUANT_EQUAL, what
        else:
            for g, w, name in zip(got, want, ("codes", "scales", "global scale")):
                np.testing.assert_array_equal(g, w, err_msg=f"{name}: {what}")


O_DOWN = [(4096, 4096), (4096, 12288)]  # Qwen3-8B o_proj and down_proj (N, K)


def _weight(n, k):
    """A stack of 2 random NVFP4 matrices (codes and scales made on the device)."""
    key = jax.random.key(n + k)
    packed = jax.random.randint(key, (2, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(jax.random.fold_in(key, 1), (2, n, k // 16), 0x20, 0x48)
    scales = jax.lax.bitcast_convert_type(scales.astype(jnp.uint8), jnp.float8_e4m3fn)
    return nvfp4.Nvfp4Tensor(packed, scales, jnp.full((2,), 1e-3, jnp.float32), (n, k))


def _res(m, n, seed):
    return jax.random.normal(jax.random.key(seed), (m, n), jnp.float32).astype(jnp.bfloat16)


@pytest.mark.parametrize(("n", "k"), O_DOWN)
def test_two_kernels_equal_the_composition(n, k):
    w = _weight(n, k)
    layer = jnp.int32(1)
    stacked = jnp.asarray([0.05, 0.02], jnp.float32)  # per layer: reading layer 0's shows
    for params in ({"weight": w}, {"weight": w, "input_scale": stacked}):
        two = jax.jit(
            lambda x, r, p=params: fl.fused_linear(
                x, p, layer=layer, residual=r, kernels="two", residual_epilogue=True
            )
        )
        unfused = jax.jit(lambda x, r, p=params: r + layers.linear(x, p, "nvfp4", layer=layer))
        for m in (1, 8, 16, 64):
            x = _x(m, k, m + n, scale=1.0)
            r = jax.random.normal(jax.random.key(m), (m, n), jnp.float32).astype(jnp.bfloat16)
            text = two.lower(x, r).compile().as_text()
            # the quantizer kernel at every M (GemmOptions.x_quant "kernel", the default: from
            # 8 rows on its x_hat form feeds the GEMM); no dot reference either way
            assert nvfp4_quant.ENTRY in text, m
            assert (nvfp4_gemm.ENTRY in text) == (m >= nvfp4_gemm.DEFAULT_MIN_M), m
            got = np.asarray(two(x, r), np.float32)
            assert np.isfinite(got).all()
            np.testing.assert_array_equal(got, np.asarray(unfused(x, r), np.float32))


# every M of the GEMV, M = 8 included (the dispatch sends M >= 8 to the GEMM by default)
GEMV_TO_8 = nvfp4_gemm.GemmOptions(min_m=9)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize(("n", "k"), O_DOWN)
def test_gemv_residual_epilogue_equals_the_xla_add(n, k, static):
    """gemv_call(residual=r) (the GEMV built with EPI_RES) == r + gemv_call() bitwise, both
    jitted on the GPU, on activations quantized with a static or a per-row dynamic scale."""
    w = _weight(n, k)
    layer = jnp.int32(1)
    kw = {"act": "w4a4", "n": n, "k": k, "impl": "cuda", "launch": "ptx", "gemm_options": GEMV_TO_8}
    fused = jax.jit(lambda r, *a: kernels.gemv_call(a, residual=r, **kw))
    plain = jax.jit(lambda r, *a: r + kernels.gemv_call(a, **kw))
    for m in range(1, 9):
        args = kernels._operands(_x(m, k, m + k, scale=1.0), w, "w4a4", 0.02 if static else None,
                                 layer)  # fmt: skip
        r = _res(m, n, m)
        what = f"M={m} N={n} K={k} static={static}"
        text = fused.lower(r, *args).compile().as_text()
        assert "nvfp4_gemv_w4a4" in text and nvfp4_gemm.ENTRY not in text, what
        # the add is the kernel's: the residual call has fewer adds than the XLA composition
        assert text.count(" add(") < plain.lower(r, *args).compile().as_text().count(" add("), what
        got = np.asarray(fused(r, *args), np.float32)
        assert np.isfinite(got).all(), what
        np.testing.assert_array_equal(got, np.asarray(plain(r, *args), np.float32), err_msg=what)


@pytest.mark.parametrize(("n", "k"), O_DOWN)
def test_gemv_residual_direct_launch_writes_every_output(n, k):
    """The residual kernel launched directly (torch operands, per-row global scales) into a
    NaN-poisoned output gives the bits of r + the GEMV through XLA: every output written."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(n + k)

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)

    def scales(*shape):  # E4M3 0.125 .. 240
        return torch.randint(0x20, 0x78, shape, dtype=torch.uint8, device="cuda", generator=gen)

    kw = {"act": "w4a4", "n": n, "k": k, "impl": "cuda", "launch": "ptx", "gemm_options": GEMV_TO_8}
    plain = jax.jit(lambda r, *a: r + kernels.gemv_call(a, **kw))
    for m in (1, 3, 8):
        xg = (torch.rand((m,), device="cuda", generator=gen) * 1e-2 + 1e-3).float()
        res = torch.randn((m, n), device="cuda", generator=gen).to(torch.bfloat16)
        wg = (torch.rand((2,), device="cuda", generator=gen) * 1e-3 + 1e-4).float()
        layer = torch.tensor(1, dtype=torch.int32, device="cuda")
        ops = [codes(m, k // 2), scales(m, k // 16), xg, res, codes(2, n, k // 2),
               scales(2, n, k // 16), wg, layer]  # fmt: skip
        kernel = nvfp4_gemv.build("w4a4", m, n, k, residual=True)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernel.launch(
            torch.cuda.current_stream().cuda_stream, [t.data_ptr() for t in ops] + [out.data_ptr()]
        )
        torch.cuda.synchronize()
        direct = out.float().cpu().numpy()
        args = [jax.dlpack.from_dlpack(t) for t in ops]
        want = np.asarray(plain(args[3], *args[:3], *args[4:]), np.float32)
        assert np.isfinite(direct).all(), f"M={m}: outputs left unwritten"
        np.testing.assert_array_equal(direct, want, err_msg=f"M={m} N={n} K={k}")


PREFETCH_CASES = [
    nvfp4_gemv.Prefetch(at="end", mode="line"),
    nvfp4_gemv.Prefetch(at="start", mode="bulk", evict_first=True),
    nvfp4_gemv.Prefetch(at="end", mode="last", evict_first=True),
]


@pytest.mark.parametrize(
    "options", PREFETCH_CASES, ids=["end-line", "start-bulk-ef", "end-last-ef"]
)
@pytest.mark.parametrize(("n", "k"), O_DOWN)
def test_gemv_prefetch_changes_no_bits(n, k, options):
    """The W4A4 GEMV with L2 prefetch hints (two targets: the next layer's stack, which at the
    last layer points past the stack and must be skipped, and a partial one) equals the GEMV
    without them bitwise, with the residual epilogue, M = 1, 2, 4, 7 (the streaming and persistent
    variants), at layer 0 and at the last layer."""
    w = _weight(n, k)
    other = _weight(3 * n, k)  # any stacks will do: prefetches read nothing into the result
    kw = {"act": "w4a4", "n": n, "k": k, "impl": "cuda", "launch": "ptx"}
    targets = (
        nvfp4_gemv.PrefetchTarget(n, k, w.stack[0], 1, 1.0),
        nvfp4_gemv.PrefetchTarget(3 * n, k, other.stack[0], 0, 0.3),
    )
    spec = dataclasses.replace(options, targets=targets)
    stacks = [(t.packed, jax.lax.bitcast_convert_type(t.scales, jnp.uint8)) for t in (w, other)]
    hinted = jax.jit(lambda r, *a: kernels.gemv_call(a, residual=r, prefetch=(spec, stacks), **kw))
    plain = jax.jit(lambda r, *a: kernels.gemv_call(a, residual=r, **kw))
    for layer in (0, w.stack[0] - 1):
        for m in (1, 2, 4, 7):
            args = kernels._operands(_x(m, k, m + k, scale=1.0), w, "w4a4", 0.02,
                                     jnp.int32(layer))  # fmt: skip
            r = _res(m, n, m)
            what = f"M={m} N={n} K={k} layer={layer} {options}"
            text = hinted.lower(r, *args).compile().as_text()
            assert "nvfp4_gemv_w4a4" in text, what
            got = np.asarray(hinted(r, *args), np.float32)
            assert np.isfinite(got).all(), what
            want = np.asarray(plain(r, *args), np.float32)
            np.testing.assert_array_equal(got, want, err_msg=what)


# ----------------------------------------------------------------------------- the x_hat form

XHAT_M = (9, 16, 64, 256, 300, 512)  # from nvfp4_quant.ROW_CTA_MIN_M (264): one CTA a row
XHAT_OPTIONS = nvfp4_gemm.GemmOptions(x_quant="kernel")  # the x_hat quantizer (the default)


def _x_edges(m, width, seed, scale=2.0):
    """`_x` with an all-zero row and a block of -0 (codes 8: x_hat -0) besides the zero and
    saturating blocks."""
    x = _x(m, width, seed, scale)
    x = x.at[1].set(0.0)
    return x.at[2, 64:80].set(-0.0)


def _xhat(x, xg, nw, layer, k, fused):
    """(the kernel's (x_hat, global scale), gemm_x_operand of quantize_activation's codes and
    scales with its global scale) as NumPy arrays, x_hat as its fp16 bits."""
    kern = nvfp4_quant.build(x.shape[0], k, fused, out="xhat")
    f = jax.jit(lambda *a: fl._quant_xhat_p.bind(*a, k=k, fused=fused, kernel=kern))
    ref = jax.jit(lambda *a: fl._xhat_reference(*a, k=k, fused=fused))
    got, want = f(x, xg, nw, layer), ref(x, xg, nw, layer)
    bits = [np.asarray(a[0]).view(np.uint16) for a in (got, want)]
    return (bits[0], np.asarray(got[1])), (bits[1], np.asarray(want[1]))


@pytest.mark.parametrize("dynamic", [False, True, "stacked"])
@pytest.mark.parametrize("k", [4096, 12288])
def test_xhat_form_equals_gemm_x_operand(k, dynamic):
    """Prologue "none": the kernel's x_hat == gemm_x_operand(quantize_activation codes, scales)
    bit for bit (the GEMM's K order, -0 kept), and its global scale per row the reference's;
    the static scale stacked per layer is read at the layer."""
    stacked = dynamic == "stacked"
    dynamic = dynamic is True
    fused = nvfp4_gemv.Fused(dynamic=dynamic, scale_stacked=stacked)
    xg = jnp.asarray([0.05, 0.01] if stacked else [0.01], jnp.float32)
    nw = jnp.zeros((1,), jnp.bfloat16)
    layer = jnp.int32(1)
    for m in XHAT_M:
        x = _x_edges(m, k, m * 11 + k)
        (got, got_g), (want, want_g) = _xhat(x, xg, nw, layer, k, fused)
        what = f"M={m} K={k} dynamic={dynamic} stacked={stacked}"
        assert (want == 0x8000).any(), what  # the -0 block is there to check
        np.testing.assert_array_equal(got, want, err_msg=f"x_hat: {what}")
        np.testing.assert_array_equal(got_g, want_g, err_msg=f"global scale: {what}")


@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize("k", [4096, 12288])
def test_xhat_form_is_the_codes_form_in_the_gemm_order(k, prologue):
    """Every prologue, dynamic global scale: the "xhat" kernel == gemm_x_operand of the "codes"
    kernel's outputs bit for bit (quant8 and quant4 run the same operations per element); against
    the XLA reference "rmsnorm" and "swiglu" may round a few of the quantizer's inputs the other
    way (>= QUANT_EQUAL of the x_hat elements equal)."""
    fused = nvfp4_gemv.Fused(prologue=prologue, dynamic=True, norm_stacked=True)
    width = 2 * k if prologue == "swiglu" else k
    norm = (1 + 0.1 * jax.random.normal(jax.random.key(3), (2, k))).astype(jnp.bfloat16)
    xg = jnp.ones((1,), jnp.float32)
    layer = jnp.int32(1)
    for m in (9, 64, 300):  # 300: one CTA a row (nvfp4_quant.ROW_CTA_MIN_M)
        x = _x_edges(m, width, m * 13 + k)
        (got, got_g), (want, want_g) = _xhat(x, xg, norm, layer, k, fused)
        codes = nvfp4_quant.build(m, k, fused)
        qf = jax.jit(lambda *a, c=codes: fl._quant_p.bind(*a, k=k, fused=fused, kernel=c))
        xp, xs, xgr = qf(x, xg, norm, layer)
        via_codes = np.asarray(jax.jit(kernels.gemm_x_operand)(xp, xs)).view(np.uint16)
        what = f"M={m} K={k} prologue={prologue}"
        np.testing.assert_array_equal(got, via_codes, err_msg=what)
        np.testing.assert_array_equal(got_g, np.asarray(xgr), err_msg=what)
        if prologue == "none":
            np.testing.assert_array_equal(got, want, err_msg=what)
        else:
            assert np.mean(got == want) >= QUANT_EQUAL, what
            # the row's amax may be an input the two round differently: SwiGLU's
            # rbf16(rbf16(g * sigmoid) * up) with the kernel's sigmoid moves the product by up
            # to two bf16 ulps (2 x 2^-7 at a binade's bottom; measured 1.03% and 1.16% at
            # 300 rows on an H100, experiments/results/wgmma_g4_small_m_h100/)
            np.testing.assert_allclose(got_g, want_g, rtol=2.0**-6, err_msg=what)


@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize(("n", "k"), O_DOWN)
def test_gemm_on_the_kernels_xhat_equals_the_xla_xhat_path(monkeypatch, n, k, prologue):
    """fused_linear at M = 64 (the GEMM, residual in its epilogue, static stacked input scale):
    the quantizer kernel's x_hat fed to the GEMM equals the path without the x_hat form (XLA's
    prologue, quantizer and gemm_x_operand, then the same GEMM) bitwise for prologue "none",
    and within the quantizer's rounding for "rmsnorm" and "swiglu"."""
    w = _weight(n, k)
    layer = jnp.int32(1)
    params = {"weight": w, "input_scale": jnp.asarray([0.05, 0.02], jnp.float32)}
    norm = (1 + 0.1 * jax.random.normal(jax.random.key(5), (2, k))).astype(jnp.bfloat16)
    width = 2 * k if prologue == "swiglu" else k
    m = 64
    x = _x_edges(m, width, n + k, scale=1.0)
    r = _res(m, n, n)

    def fused(x, r):
        return fl.fused_linear(x, params, layer=layer, prologue=prologue, norm=norm, residual=r,
                               kernels="two", residual_epilogue=True,
                               gemm_options=XHAT_OPTIONS)  # fmt: skip

    new = jax.jit(fused)
    text = new.lower(x, r).compile().as_text()
    assert nvfp4_quant.ENTRY in text and nvfp4_gemm.ENTRY in text
    got = np.asarray(new(x, r), np.float64)
    build = nvfp4_quant.build

    def no_xhat(*args, out="codes", **kw):
        if out == "xhat":
            raise nvfp4_gemv.KernelError("the test's path without the x_hat form")
        return build(*args, out=out, **kw)

    monkeypatch.setattr(nvfp4_quant, "build", no_xhat)
    jax.clear_caches()  # lower again, without the x_hat form
    try:
        old = jax.jit(fused)
        text = old.lower(x, r).compile().as_text()
        assert nvfp4_quant.ENTRY not in text and nvfp4_gemm.ENTRY in text
        want = np.asarray(old(x, r), np.float64)
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # nothing lowered without the x_hat form outlives this test
    assert np.isfinite(got).all()
    what = f"N={n} K={k} prologue={prologue}"
    if prologue == "none":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel <= FUSED_RTOL, (what, rel)
        if prologue == "rmsnorm":
            # swiglu: XLA may keep the sigmoid and silu in fp32 inside its fusion (excess
            # precision) where the kernel rounds them to bf16, so about 0.5% of the inputs of a
            # row move by an ulp and most outputs move a little (30-45% equal on the H200)
            assert np.mean(got == want) >= FUSED_EQUAL, (what, rel)


@pytest.mark.parametrize("tile_m", [128, 256])
@pytest.mark.parametrize("scale", ["dynamic", "static"])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize("k", [4096, 12288])
def test_xhat_tiles_form_is_the_codes_form_as_stage_tiles(k, prologue, scale, tile_m):
    """Every prologue, dynamic or static stacked global scale (layer 1), stacked norm weights:
    the "xhat_tiles" kernel == to_stage_tiles of wgmma_x_operand of the "codes" kernel's
    outputs bit for bit (the same per-element operations and row statistics; the last tile's
    padding rows zero), its global scales the codes form's. M = 9, 130, 300: 8-row groups with
    1, 2 and 4 real rows at the end; 128- and 256-token tiles (`GemmOptions.wgmma_tm`)."""
    from cuda_ops import nvfp4_gemm_wgmma as wgm

    dynamic = scale == "dynamic"
    fused = nvfp4_gemv.Fused(
        prologue=prologue, dynamic=dynamic, norm_stacked=True, scale_stacked=not dynamic
    )
    width = 2 * k if prologue == "swiglu" else k
    norm = (1 + 0.1 * jax.random.normal(jax.random.key(4), (2, k))).astype(jnp.bfloat16)
    xg = jnp.ones((1,), jnp.float32) if dynamic else jnp.asarray([0.5, 0.02], jnp.float32)
    layer = jnp.int32(1)
    for m in (9, 130, 300):
        x = _x_edges(m, width, m * 17 + k)
        tiles = nvfp4_quant.build(m, k, fused, out="xhat_tiles", tile_m=tile_m)
        tf = jax.jit(lambda *a, t=tiles: fl._quant_tiles_p.bind(*a, k=k, fused=fused, kernel=t,
                                                                 tile_m=tile_m))  # fmt: skip
        got, got_g = tf(x, xg, norm, layer)
        codes = nvfp4_quant.build(m, k, fused)
        qf = jax.jit(lambda *a, c=codes: fl._quant_p.bind(*a, k=k, fused=fused, kernel=c))
        xp, xs, xgr = qf(x, xg, norm, layer)
        want = jax.jit(lambda p, s: wgm.to_stage_tiles(wgm.wgmma_x_operand(p, s), tile_m, 128))(
            xp, xs
        )
        assert got.shape == want.shape == (-(-m // tile_m), k // 128, tile_m * 128)
        got16, want16 = np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
        # rows with a difference: [tile, stage, column, 8-row group, row, element] layout
        diff = (got16 != want16).reshape(got16.shape[0], k // 128, 16, tile_m // 8, 8, 8)
        bad = np.nonzero(diff.any(axis=(1, 2, 5)).reshape(-1))[0]
        what = f"M={m} K={k} {prologue} {scale}: rows {bad[:12].tolist()} of {bad.size} differ"
        np.testing.assert_array_equal(got16, want16, err_msg=what)
        np.testing.assert_array_equal(np.asarray(got_g), np.asarray(xgr), err_msg=what)


@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize("k", [4096, 12288])
def test_xhat_tiles_whole_row_chunks_write_the_default_bytes(k, prologue):
    """The "xhat_tiles" form with one CTA an 8-row group (chunk = K, the image in passes of
    `TILES_IMG_MAX`) and with K / 4096 CTAs a group writes the default chunking's tiles and
    global scales bit for bit: the row statistics do not depend on the chunk (the same threads
    sum in the same order) and each element's operations are the same. M = 130 and 300 (a last
    group of 2 and 4 real rows, padding rows zero), dynamic scales, 128-token tiles."""
    fused = nvfp4_gemv.Fused(prologue=prologue, dynamic=True, norm_stacked=True)
    width = 2 * k if prologue == "swiglu" else k
    norm = (1 + 0.1 * jax.random.normal(jax.random.key(5), (2, k))).astype(jnp.bfloat16)
    xg, layer = jnp.ones((1,), jnp.float32), jnp.int32(1)
    for m in (130, 300):
        x = _x_edges(m, width, m * 31 + k)
        outs = {}
        for chunk in (None, 4096, k):
            kern = nvfp4_quant.build(m, k, fused, out="xhat_tiles", tile_m=128, chunk=chunk)
            f = jax.jit(lambda *a, t=kern: fl._quant_tiles_p.bind(*a, k=k, fused=fused, kernel=t,
                                                                  tile_m=128))  # fmt: skip
            got, got_g = f(x, xg, norm, layer)
            outs[kern.chunk] = (np.asarray(got).view(np.uint16), np.asarray(got_g))
        (base, base_g), default = outs[512], nvfp4_quant.default_chunk(k, "xhat_tiles", m)
        assert default == 512 and set(outs) == {512, 4096, k}
        for chunk, (got, got_g) in outs.items():
            what = f"M={m} K={k} {prologue} chunk={chunk}"
            np.testing.assert_array_equal(got, base, err_msg=what)
            np.testing.assert_array_equal(got_g, base_g, err_msg=what)


@pytest.mark.parametrize("tm", [128, 256])
@pytest.mark.parametrize(("n", "k"), O_DOWN)
def test_wgmma_on_the_kernels_tiles_equals_the_xla_tiles_path(n, k, tm):
    """fused_linear at M = 200 (the wgmma GEMM of `tm`-token tiles, prologue "none", residual,
    static stacked input scale): the quantizer kernel's stage tiles (GemmOptions.wgmma_x_quant
    "kernel") give the bits of XLA's quantizer and tiles ("xla") in front of the same GEMM."""
    from cuda_ops import nvfp4_gemm_wgmma as wgm

    w = _weight(n, k)
    layer = jnp.int32(1)
    params = {"weight": w, "input_scale": jnp.asarray([0.05, 0.02], jnp.float32)}
    m = 200
    x = _x_edges(m, k, n + k + 1, scale=1.0)
    r = _res(m, n, n + 1)
    outs = {}
    for xq in ("kernel", "xla"):
        opts = nvfp4_gemm.GemmOptions(wgmma_x_quant=xq, wgmma_tm=tm)
        f = jax.jit(lambda x, r, o=opts: fl.fused_linear(x, params, layer=layer, residual=r,
                                                         kernels="two", gemm_options=o))  # fmt: skip
        text = f.lower(x, r).compile().as_text()
        assert wgm.ENTRY in text and (nvfp4_quant.ENTRY in text) == (xq == "kernel"), xq
        outs[xq] = np.asarray(f(x, r), np.float64)
    assert np.isfinite(outs["kernel"]).all()
    np.testing.assert_array_equal(outs["kernel"], outs["xla"], err_msg=f"N={n} K={k} tm={tm}")
