"""GPU tests of the stand-alone activation quantizer `nvfp4_quantize_bf16` (marker `gpu`) and of
`fused_linear(kernels="two")` (quantizer kernel, then the plain W4A4 GEMV).

* Its codes, E4M3 scales and global scales equal `rejax.nvfp4.quantize_activation` of the
  prologue's output bitwise for prologue "none", static and dynamic global scales, zero and
  saturating blocks. "rmsnorm" sums the mean square in the kernel's own order and "swiglu" takes
  CUDA's expf for the sigmoid (not XLA's logistic), so a few of the prologue's bf16 outputs may
  round the other way: >= QUANT_EQUAL of the code bytes equal (measured on the H200: 0.4-0.6%
  of the bytes differ with "swiglu").
* `fused_linear(kernels="two")` equals the unfused composition bitwise for prologue "none" with a
  residual (same quantized operands, the same GEMV; the residual added in the GEMV's epilogue is
  the same bf16 add); at M = 16 and 64, above the quantizer kernel's 8 rows, the quantizer is
  XLA's and the linear the GEMM (with the residual in its epilogue), as the composition's.
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
    for m in (1, 3, 8):
        x = _x(m, width, m * 7 + k)
        got, want = _quantize(x, xg, norm, layer, k, fused)
        what = f"M={m} K={k} dynamic={dynamic} prologue={prologue}"
        if prologue != "none":
            assert np.mean(got[0] == want[0]) >= QUANT_EQUAL, what
            np.testing.assert_allclose(got[2], want[2], rtol=1e-2, err_msg=what)
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
            # above 8 rows XLA quantizes and the GEMM follows; no dot reference either way
            assert (nvfp4_quant.ENTRY in text) == (m <= nvfp4_quant.MAX_M), m
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
