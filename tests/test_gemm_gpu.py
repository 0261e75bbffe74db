"""GPU tests of the NVFP4 W4A4 tensor-core GEMM (marker `gpu`; skipped without a CUDA GPU).

Each case draws random NVFP4 operands on the GPU (codes uniform, E4M3 scales 0.125 .. 240, so
many weights are fp16 subnormals inside the kernel), launches the kernel directly into a
NaN-poisoned output (twice: bitwise repeatable), adds split-K partials in split order, and
compares with float64 of the same dequantized operands: relative error (Frobenius) <= 1.5x the
error of the float64 result merely rounded to bf16, plus 1e-6 (the GEMV tests' bound). Also:
stacked weights with a device layer index and per-row global scales, the XLA launch paths
(PTX custom call and buffer_callback) equal the direct launch, the dispatch takes the GEMM on
CUDA, and a jitted lax.scan equals eager calls. The residual epilogue (`residual=True`,
-DEPI_RES=1: in the epilogue, the cluster reduction or the split-K finish) equals r + the GEMM
without it bitwise, through XLA and launched directly into a NaN-poisoned output.

GEMM letters: M tokens, N out features, K in features.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

HEAD = 128
MODELS = {  # hidden, intermediate, q heads, kv heads (the paper's models)
    "Qwen3-8B": (4096, 12288, 32, 8),
    "Qwen3-14B": (5120, 17408, 40, 8),
    "Qwen3-32B": (5120, 25600, 64, 8),
    "R1-Distill-Qwen-7B": (3584, 18944, 28, 4),
    "R1-Distill-Qwen-14B": (5120, 13824, 40, 8),
}


def _shapes():
    seen = []
    for d, f, nq, nkv in MODELS.values():
        for nk in [((nq + 2 * nkv) * HEAD, d), (d, nq * HEAD), (f, d), (d, f)]:
            if nk not in seen:
                seen.append(nk)
    return seen


MS = [8, 9, 16, 17, 32, 64, 128, 256, 512]  # 8: the GEMM at the GEMV's largest M
ODD = [(8, 256), (1000, 768), (1003, 1280), (24, 3328), (520, 4352), (1, 512)]
ODD_MS = [9, 13, 33, 100, 257, 300]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % 2**31


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


LUT = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def _weights(torch, n, k, gen, layers=None, gw_rows=False, scales=(0x20, 0x78)):
    """Uniform codes; E4M3 scale bytes in [scales[0], scales[1]) (default 0.125 .. 240)."""
    stack = () if layers is None else (layers,)
    wp = torch.randint(0, 256, (*stack, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    ws = torch.randint(*scales, (*stack, n, k // 16), dtype=torch.uint8, device="cuda",
                       generator=gen)  # fmt: skip
    gshape = (*stack, n) if gw_rows else stack
    wg = (torch.rand(gshape, device="cuda", generator=gen) * 1e-3 + 1e-4).float()
    return wp, ws, wg


def _acts(torch, m, k, gen):
    xp = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    xs = torch.randint(0x20, 0x78, (m, k // 16), dtype=torch.uint8, device="cuda", generator=gen)
    xg = (torch.rand((m,), device="cuda", generator=gen) * 1e-2 + 1e-3).float()
    return xp, xs, xg


def _values(torch, p, s, dtype):
    """codes [R, K/2] and scale bytes [R, K/16] -> e2m1 * SF as `dtype` [R, K]."""
    lut = torch.tensor(LUT, dtype=torch.float64, device="cuda")
    c = torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1).long()
    v = lut[c].reshape(p.shape[0], -1, 16)
    sf = s.view(torch.float8_e4m3fn).double()[..., None]
    return (v * sf).reshape(p.shape[0], -1).to(dtype)


def _x_hat(torch, xp, xs):
    """torch mirror of rejax.ops.linear.gemm_x_operand (checked against it below)."""
    m, k = xp.shape[0], 2 * xp.shape[1]
    xh = _values(torch, xp, xs, torch.float16)
    return xh.reshape(m, k // 128, 4, 4, 2, 4).permute(0, 1, 3, 2, 5, 4).reshape(m, k).contiguous()


def _wd64(torch, wp, ws, gw):
    """float64 weights e2m1 * SF * global (one matrix)."""
    g = gw.double()[:, None] if gw.ndim == 1 else gw.double()
    return _values(torch, wp, ws, torch.float64) * g


def _ref64(torch, xp, xs, xg, wd64):
    return (_values(torch, xp, xs, torch.float64) * xg.double()[:, None]) @ wd64.T


def _run(torch, kernel, ops, m, n):
    """Direct launch into a NaN-poisoned output (and split-K workspace). Returns (y bf16 [M, N],
    whether every output and partial was written)."""
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    work = None
    if kernel.plan.partials:
        work = torch.full(kernel.plan.out_shape, float("nan"), dtype=torch.float32, device="cuda")
    kernel.launch(
        torch.cuda.current_stream().cuda_stream,
        [t.data_ptr() for t in ops] + [y.data_ptr()],
        None if work is None else work.data_ptr(),
    )
    torch.cuda.synchronize()
    written = bool(torch.isfinite(y).all()) and (work is None or bool(torch.isfinite(work).all()))
    return y, written


def _rel(torch, a, b):
    return float(torch.linalg.norm(a.double() - b) / torch.linalg.norm(b))


def _check(torch, kernel, ops, m, n, y64, failures, tag):
    y1, w1 = _run(torch, kernel, ops, m, n)
    y2, _ = _run(torch, kernel, ops, m, n)
    floor = _rel(torch, y64.to(torch.bfloat16), y64)
    err = _rel(torch, y1, y64)
    if not w1:
        failures.append((*tag, "unwritten or non-finite outputs"))
    elif not torch.equal(y1.view(torch.int16), y2.view(torch.int16)):
        failures.append((*tag, "not repeatable"))
    elif err > 1.5 * floor + 1e-6:
        failures.append((*tag, f"rel err {err:.3e} > 1.5 x bf16 floor {floor:.3e}"))


@pytest.mark.parametrize("shape_set", ["models", "odd"])
def test_gemm_matches_float64_reference(torch, shape_set):
    """Every layer shape of the paper's models at M in {8, ..., 512}, odd N / K at odd M."""
    from cuda_ops import nvfp4_gemm

    shapes, ms = (_shapes(), MS) if shape_set == "models" else (ODD, ODD_MS)
    _check_shapes(torch, shapes, ms, nvfp4_gemm.DEFAULT_OPTIONS, _seed("gemm", shape_set))


def _check_shapes(torch, shapes, ms, options, seed):
    """Every (N, K) of `shapes` at every M of `ms` with `options`, within the float64 bound."""
    from cuda_ops import nvfp4_gemm

    nvfp4_gemm.prebuild(
        [{"m": m, "n": n, "k": k, "options": options} for n, k in shapes for m in ms]
    )
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    failures = []
    layer0 = torch.zeros((), dtype=torch.int32, device="cuda")
    for n, k in shapes:
        wp, ws, wg = _weights(torch, n, k, gen)
        wd64 = _wd64(torch, wp, ws, wg)
        for m in ms:
            kernel = nvfp4_gemm.build(m, n, k, options=options)
            xp, xs, xg = _acts(torch, m, k, gen)
            ops = [_x_hat(torch, xp, xs), xg, wp, ws, wg, layer0]
            y64 = _ref64(torch, xp, xs, xg, wd64)
            tag = (m, n, k, kernel.plan.wr, kernel.plan.splitk)
            _check(torch, kernel, ops, m, n, y64, failures, tag)
        del wd64
    assert not failures, failures


@pytest.mark.parametrize("occupancy", ["wide", "fill", "fill16"])
def test_wide_occupancy_on_the_decode_shapes(torch, occupancy):
    """GemmOptions(occupancy="wide") (64-row weight tiles, K split up to 8), "fill" (2-stage
    pipelines, other splits) and "fill16" (batch 8 in a 16-token tile, its rows past M masked)
    on Qwen3-8B's four layer shapes at the decode batches M = 8, 16, 32, 64: within 1.5x the
    bf16 floor of float64 (the residual epilogue: test_residual_epilogue_equals_the_xla_add)."""
    from cuda_ops import nvfp4_gemm

    options = nvfp4_gemm.GemmOptions(occupancy=occupancy)
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    _check_shapes(torch, shapes, (8, 16, 32, 64), options, _seed(occupancy))


def test_stacked_weights_with_layer_index_and_per_row_scales(torch):
    """A stack of 3 matrices with one global scale per row; layer 2 chosen by the device index."""
    from cuda_ops import nvfp4_gemm

    gen = torch.Generator(device="cuda")
    gen.manual_seed(_seed("stacked"))
    failures = []
    for n, k in [(4096, 4096), (1003, 1280), (6144, 4096)]:
        wp, ws, wg = _weights(torch, n, k, gen, layers=3, gw_rows=True)
        layer = torch.tensor(2, dtype=torch.int32, device="cuda")
        wd64 = _wd64(torch, wp[2], ws[2], wg[2])
        for m in (9, 64, 300):
            kernel = nvfp4_gemm.build(m, n, k, gw_rows=True)
            xp, xs, xg = _acts(torch, m, k, gen)
            ops = [_x_hat(torch, xp, xs), xg, wp, ws, wg, layer]
            y64 = _ref64(torch, xp, xs, xg, wd64)
            _check(torch, kernel, ops, m, n, y64, failures, (m, n, k))
    assert not failures, failures


@pytest.mark.parametrize(
    "options",
    [
        {"kt": 256},
        {"splitk": 1},
        {"splitk": 5},
        {"tm": 32, "wr": 1, "warps": 8},
        {"tm": 8},
        {"tm": 48, "wm": 2, "warps": 4},
        {"tm": 128, "wm": 2, "wr": 2, "warps": 8, "kt": 256},
        {"reduce": "cluster"},
        {"reduce": "cluster", "splitk": 3, "wm": 2},
        {"occupancy": "wide"},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_tile_options_match_float64(torch, options):
    """The configurations a benchmark may select are correct too (one shape, several M)."""
    from cuda_ops import nvfp4_gemm

    opts = nvfp4_gemm.GemmOptions(**options)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(_seed("options", sorted(options.items())))
    failures = []
    n, k = 5120, 3584  # K = 14 x 256
    wp, ws, wg = _weights(torch, n, k, gen)
    wd64 = _wd64(torch, wp, ws, wg)
    layer0 = torch.zeros((), dtype=torch.int32, device="cuda")
    for m in (9, 40, 130):
        kernel = nvfp4_gemm.build(m, n, k, options=opts)
        xp, xs, xg = _acts(torch, m, k, gen)
        ops = [_x_hat(torch, xp, xs), xg, wp, ws, wg, layer0]
        y64 = _ref64(torch, xp, xs, xg, wd64)
        _check(torch, kernel, ops, m, n, y64, failures, (m, n, k, options))
    assert not failures, failures


@pytest.mark.parametrize("w_shift", [0, 7])
def test_subnormal_fp16_weights(torch, w_shift):
    """Tiny block scales (E4M3 subnormals 2^-9 .. and small normals): the decoded weights
    e2m1 x SFw x 2^(w_shift - 14) are fp16 subnormals for most elements, which the fp16 multiply
    and the tensor cores must keep (no flush to zero) for the float64 bound to hold."""
    from cuda_ops import nvfp4_gemm

    opts = nvfp4_gemm.GemmOptions(w_shift=w_shift)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(_seed("subnormal", w_shift))
    failures = []
    n, k = 1024, 2048
    wp, ws, wg = _weights(torch, n, k, gen, scales=(0x01, 0x18))
    wg = wg * 1e3  # keep the outputs in bf16's normal range
    wd64 = _wd64(torch, wp, ws, wg)
    layer0 = torch.zeros((), dtype=torch.int32, device="cuda")
    for m in (9, 64):
        kernel = nvfp4_gemm.build(m, n, k, options=opts)
        xp, xs, xg = _acts(torch, m, k, gen)
        ops = [_x_hat(torch, xp, xs), xg, wp, ws, wg, layer0]
        y64 = _ref64(torch, xp, xs, xg, wd64)
        _check(torch, kernel, ops, m, n, y64, failures, (m, n, k, w_shift))
    assert not failures, failures


def test_sanitizer_subset(torch):
    """A few small launches (split and unsplit, odd M and N, stacked), the subset that
    `compute-sanitizer` runs (see the module docstring of experiments/bench_gemm.py)."""
    from cuda_ops import nvfp4_gemm

    gen = torch.Generator(device="cuda")
    gen.manual_seed(3)
    failures = []
    for m, n, k, split in [(9, 1003, 1280, 1), (33, 520, 4352, 4), (257, 256, 512, 1)]:
        wp, ws, wg = _weights(torch, n, k, gen, layers=2)
        layer = torch.tensor(1, dtype=torch.int32, device="cuda")
        kernel = nvfp4_gemm.build(m, n, k, options=nvfp4_gemm.GemmOptions(splitk=split))
        xp, xs, xg = _acts(torch, m, k, gen)
        ops = [_x_hat(torch, xp, xs), xg, wp, ws, wg, layer]
        y64 = _ref64(torch, xp, xs, xg, _wd64(torch, wp[1], ws[1], wg[1]))
        _check(torch, kernel, ops, m, n, y64, failures, (m, n, k))
    assert not failures, failures


@pytest.mark.parametrize("reduce", ["finish", "cluster"])
@pytest.mark.parametrize(("m", "n", "k"), [(16, 4096, 4096), (300, 1003, 1280), (64, 5120, 25600)])
def test_xla_paths_equal_the_direct_launch(torch, m, n, k, reduce):
    """The primitive on CUDA (x_hat fusion + PTX custom call or buffer_callback, split-K through
    the finish kernel or a cluster) gives the direct launch's bits; the torch x_hat used above
    equals gemm_x_operand's."""
    import jax
    import jax.numpy as jnp

    from cuda_ops import nvfp4_gemm
    from rejax.ops import linear as kernels

    gen = torch.Generator(device="cuda")
    gen.manual_seed(_seed("xla", m, n, k))
    wp, ws, wg = _weights(torch, n, k, gen)
    xp, xs, xg = _acts(torch, m, k, gen)
    layer0 = torch.zeros((), dtype=torch.int32, device="cuda")
    xh = _x_hat(torch, xp, xs)
    opts = nvfp4_gemm.GemmOptions(reduce=reduce)
    direct, _ = _run(
        torch, nvfp4_gemm.build(m, n, k, options=opts), [xh, xg, wp, ws, wg, layer0], m, n
    )
    direct = direct.float().cpu().numpy()
    args = [jax.dlpack.from_dlpack(t) for t in (xp, xs, xg, wp, ws, wg, layer0)]
    xh_jax = jax.jit(kernels.gemm_x_operand)(args[0], args[1])
    np.testing.assert_array_equal(
        np.asarray(xh_jax).view(np.uint16), xh.cpu().numpy().view(np.uint16)
    )
    kw = {"act": "w4a4", "n": n, "k": k, "gemm_options": opts}
    for launch in ("ptx", "callback"):
        y = jax.jit(
            lambda *a, launch=launch: kernels.gemv_call(a, impl="cuda", launch=launch, **kw)
        )(*args)
        np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), direct, err_msg=launch)


@pytest.mark.parametrize(
    "options", [{}, {"reduce": "cluster"}, {"splitk": 1}, {"occupancy": "wide"}]
)
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 12288)])  # Qwen3-8B o, down_proj
def test_residual_epilogue_equals_the_xla_add(torch, n, k, options):
    """gemv_call(residual=r) on the GEMM (built with EPI_RES) == r + gemv_call() bitwise, both
    jitted; the direct launch of the residual kernel into NaN-poisoned output and workspace
    writes the same bits. {}: the plan's K split through the finish kernel at these M."""
    import jax
    import jax.numpy as jnp

    from cuda_ops import nvfp4_gemm
    from rejax.ops import linear as kernels

    opts = nvfp4_gemm.GemmOptions(**options)
    kw = {"act": "w4a4", "n": n, "k": k, "impl": "cuda", "launch": "ptx", "gemm_options": opts}
    fused = jax.jit(lambda r, *a: kernels.gemv_call(a, residual=r, **kw))
    plain = jax.jit(lambda r, *a: r + kernels.gemv_call(a, **kw))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(_seed("residual", n, k, options))
    wp, ws, wg = _weights(torch, n, k, gen, layers=2)
    layer = torch.ones((), dtype=torch.int32, device="cuda")
    for m in (8, 9, 16, 64):
        xp, xs, xg = _acts(torch, m, k, gen)
        res = torch.randn((m, n), device="cuda", generator=gen).to(torch.bfloat16)
        r, *args = [jax.dlpack.from_dlpack(t) for t in (res, xp, xs, xg, wp, ws, wg, layer)]
        what = f"M={m} N={n} K={k} {options}"
        text = fused.lower(r, *args).compile().as_text()
        assert nvfp4_gemm.ENTRY in text and "nvfp4_gemv_w4a4" not in text, what
        # the add is the kernel's: the residual call has fewer adds than the XLA composition
        assert text.count(" add(") < plain.lower(r, *args).compile().as_text().count(" add("), what
        want = np.asarray(plain(r, *args).astype(jnp.float32))
        got = np.asarray(fused(r, *args).astype(jnp.float32))
        assert np.isfinite(got).all(), what
        np.testing.assert_array_equal(got, want, err_msg=what)
        kernel = nvfp4_gemm.build(m, n, k, options=opts, residual=True)
        ops = [_x_hat(torch, xp, xs), xg, res, wp, ws, wg, layer]
        direct, written = _run(torch, kernel, ops, m, n)
        assert written, f"{what}: outputs or partials left unwritten"
        np.testing.assert_array_equal(direct.float().cpu().numpy(), want, err_msg=what)


def test_nvfp4_linear_takes_the_gemm_on_cuda(torch):
    """impl='auto' at M = 2 x 24 tokens: the GEMM (no reference note), equal to impl='cuda', and
    within the bf16 floor of float64; a jitted lax.scan over a stacked weight equals eager."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from rejax import nvfp4
    from rejax.ops import _dispatch
    from rejax.ops import linear as kernels

    rng = np.random.default_rng(3)
    mats = [
        nvfp4.quantize_weight(rng.standard_normal((1024, 2048)).astype(np.float32))
        for _ in range(3)
    ]
    w = nvfp4.stack(mats)
    x = jnp.asarray(rng.standard_normal((2, 24, 2048)), jnp.bfloat16)
    before = set(_dispatch.noted())
    auto = np.asarray(kernels.nvfp4_linear(x, w, layer=1), np.float32)
    assert set(_dispatch.noted()) == before, set(_dispatch.noted()) - before
    cuda = np.asarray(kernels.nvfp4_linear(x, w, layer=1, impl="cuda"), np.float32)
    np.testing.assert_array_equal(auto, cuda)
    xq = nvfp4.quantize_activation(x.reshape(48, 2048))
    y64 = (
        np.asarray(nvfp4.dequantize(xq), np.float64)
        @ np.asarray(nvfp4.dequantize(mats[1]), np.float64).T
    )
    floor = np.linalg.norm(y64.astype(ml_dtypes.bfloat16).astype(np.float64) - y64)
    assert np.linalg.norm(auto.reshape(48, -1) - y64) <= 1.5 * floor + 1e-6 * np.linalg.norm(y64)
    layers = jnp.arange(3, dtype=jnp.int32)
    _, scanned = jax.jit(
        lambda x: jax.lax.scan(lambda c, i: (c, kernels.nvfp4_linear(x, w, layer=i)), 0, layers)
    )(x)
    for i in range(3):
        eager = np.asarray(kernels.nvfp4_linear(x, w, layer=i), np.float32)
        np.testing.assert_array_equal(np.asarray(scanned[i], np.float32), eager)


@pytest.mark.parametrize(
    ("m", "n", "k", "tm"),
    [
        (256, 4096, 4096, 128),
        (200, 1024, 2048, 128),
        (512, 6144, 4096, 256),
        (130, 4096, 12288, 128),
        (300, 4096, 12288, 256),
    ],
)
def test_wgmma_linear_matches_float64_and_the_gemm(torch, m, n, k, tm):
    """GemmOptions.wgmma_min_m (opt-in): from that many rows the primitive runs the wgmma GEMM
    (128 / 256-token tiles; stacked weights at layer 1, per-row global scales; M = 200 and 130
    pad the last tile; a K split where the tiles do not fill a wave): within the bf16 floor of
    float64, bitwise repeatable, the PTX custom call equal to the buffer_callback launch, close
    to the mma.sync GEMM (only the fp32 summation order differs), and the residual form equal
    to XLA's bf16 add of the plain result. No dispatch note."""
    import jax
    import jax.numpy as jnp

    from cuda_ops import nvfp4_gemm, nvfp4_gemm_wgmma
    from rejax.ops import _dispatch
    from rejax.ops import linear as kernels

    gen = torch.Generator(device="cuda")
    gen.manual_seed(_seed("wgmma", m, n, k, tm))
    wp, ws, wg = _weights(torch, n, k, gen, layers=2, gw_rows=True)
    xp, xs, xg = _acts(torch, m, k, gen)
    layer1 = torch.ones((), dtype=torch.int32, device="cuda")
    y64 = _ref64(torch, xp, xs, xg, _wd64(torch, wp[1], ws[1], wg[1]))
    floor = _rel(torch, y64.to(torch.bfloat16), y64)
    args = [jax.dlpack.from_dlpack(t) for t in (xp, xs, xg, wp, ws, wg, layer1)]
    opts = nvfp4_gemm.GemmOptions(wgmma_min_m=128, wgmma_tm=tm, max_m=None)
    kw = {"act": "w4a4", "n": n, "k": k, "gw_rows": True}
    kernel = nvfp4_gemm_wgmma.build_linear(m, n, k, tm=tm, gw_rows=True)
    before = set(_dispatch.noted())
    outs = {}
    for launch in ("ptx", "callback"):
        f = jax.jit(
            lambda *a, launch=launch: kernels.gemv_call(
                a, impl="auto", launch=launch, gemm_options=opts, **kw
            )
        )
        assert nvfp4_gemm_wgmma.ENTRY in f.lower(*args).as_text() or launch == "callback"
        outs[launch] = np.asarray(f(*args).astype(jnp.float32))
        again = np.asarray(f(*args).astype(jnp.float32))
        np.testing.assert_array_equal(outs[launch], again, err_msg=f"{launch}: not repeatable")
    assert set(_dispatch.noted()) == before, set(_dispatch.noted()) - before
    np.testing.assert_array_equal(outs["ptx"], outs["callback"])
    y = torch.from_numpy(outs["ptx"]).cuda()
    assert bool(torch.isfinite(y).all())
    assert _rel(torch, y, y64) <= 1.5 * floor + 1e-6, (kernel.plan, _rel(torch, y, y64), floor)
    # the mma.sync GEMM on the same operands (impl="cuda" takes it at any M it supports)
    gemm = jax.jit(lambda *a: kernels.gemv_call(a, impl="cuda", launch="ptx", **kw))(*args)
    gemm = np.asarray(gemm.astype(jnp.float32))
    assert np.linalg.norm(outs["ptx"] - gemm) <= 1e-2 * np.linalg.norm(gemm)
    # residual: XLA's bf16 add after the GEMM
    res = jax.random.normal(jax.random.key(m), (m, n), jnp.bfloat16)
    with_res = jax.jit(
        lambda r, *a: kernels.gemv_call(
            a, impl="auto", launch="ptx", gemm_options=opts, residual=r, **kw
        )
    )(res, *args)
    plain = jnp.asarray(outs["ptx"]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(with_res).view(np.uint16), np.asarray(res + plain).view(np.uint16)
    )
