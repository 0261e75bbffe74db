"""GPU tests of the NVFP4 GEMV kernel (marker `gpu`; skipped without a CUDA GPU).

Each case draws fresh random operands on the GPU, launches the kernel into a NaN-poisoned output
(twice: results must be bitwise identical), and compares with a float64 reference of the same
dequantized operands. Bound: the relative error (Frobenius) must be <= 1.5x the error of the
float64 result merely rounded to bf16, plus 1e-6 -- the kernel's integer block dots are exact and
its fp32 accumulation adds far less than bf16 output rounding (measured ratio in
experiments/results/gpu_kernel_check.json). Also: the XLA PTX custom call and the buffer_callback
path give the kernel's bits, a jitted `lax.scan` equals eager calls, and the JAX reference
differs only by fp32 summation-order noise.

GEMM letters: M tokens, N out features, K in features.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

HEAD = 128
MODELS = {  # hidden, intermediate, q heads, kv heads (PAPER.md section 4)
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


ODD = [(8, 256), (1000, 768), (1003, 1280), (24, 3328), (520, 4352), (1, 512)]


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _operands(torch, act, m, n, k, gen):
    def codes(r, c):
        return torch.randint(0, 256, (r, c), dtype=torch.uint8, device="cuda", generator=gen)

    def scales(r, c):  # E4M3 0.125 .. 240
        return torch.randint(0x20, 0x78, (r, c), dtype=torch.uint8, device="cuda", generator=gen)

    w = [
        codes(n, k // 2),
        scales(n, k // 16),
        (torch.rand((), device="cuda", generator=gen) * 1e-3 + 1e-4).float(),
    ]
    if act == "w4a4":
        xg = (torch.rand((m,), device="cuda", generator=gen) * 1e-2 + 1e-3).float()
        return [codes(m, k // 2), scales(m, k // 16), xg, *w]
    return [torch.randn((m, k), device="cuda", generator=gen).to(torch.bfloat16), *w]


def _ref64(torch, act, ops):
    lut = torch.tensor(
        [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
        dtype=torch.float64,
        device="cuda",
    )

    def deq(p, s):
        c = torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1).long()
        v = lut[c].reshape(p.shape[0], -1, 16)
        return (v * s.view(torch.float8_e4m3fn).double()[..., None]).reshape(p.shape[0], -1)

    if act == "w4a4":
        xp, xs, xg, wp, ws, wg = ops
        x = deq(xp, xs) * xg.double()[:, None]
    else:
        x, wp, ws, wg = ops
        x = x.double()
    return x @ (deq(wp, ws) * wg.double()).T


def _launch(torch, kernel, ops, m, n):
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernel.launch(
        torch.cuda.current_stream().cuda_stream, [t.data_ptr() for t in ops] + [out.data_ptr()]
    )
    torch.cuda.synchronize()
    return out


def _rel(torch, a, b):
    return float(torch.linalg.norm(a.double() - b) / torch.linalg.norm(b))


@pytest.mark.parametrize("variant", ["persistent", "stream", "xplanes"])
@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
@pytest.mark.parametrize("shape_set", ["models", "odd"])
def test_kernel_matches_float64_reference(torch, monkeypatch, variant, act, shape_set):
    from cuda_ops import nvfp4_gemv

    if variant == "xplanes":  # experimental staged-x layout of the W4A4 persistent kernel
        if act != "w4a4":
            pytest.skip("W4A16 stages no activations")
        monkeypatch.setenv("REJAX_GEMV_XPLANES", "1")
        variant = "persistent"
    monkeypatch.setenv(nvfp4_gemv.VARIANT_ENV, variant)  # stream applies to M <= 4
    gen = torch.Generator(device="cuda")
    gen.manual_seed(hash((act, shape_set)) % 2**31)
    failures = []
    shapes = _shapes() if shape_set == "models" else ODD
    for n, k in shapes:
        for m in range(1, 9):
            kernel = nvfp4_gemv.build(act, m, n, k)
            ops = _operands(torch, act, m, n, k, gen)
            y1 = _launch(torch, kernel, ops, m, n)
            y2 = _launch(torch, kernel, ops, m, n)
            y64 = _ref64(torch, act, ops)
            floor = _rel(torch, y64.to(torch.bfloat16), y64)
            err = _rel(torch, y1, y64)
            if not torch.isfinite(y1).all():
                failures.append((m, n, k, "unwritten or non-finite outputs"))
            elif not torch.equal(y1.view(torch.int16), y2.view(torch.int16)):
                failures.append((m, n, k, "not repeatable"))
            elif err > 1.5 * floor + 1e-6:
                failures.append((m, n, k, f"rel err {err:.3e} > 1.5 x bf16 floor {floor:.3e}"))
    assert not failures, failures


@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 12288), (3, 1003, 1280), (8, 5120, 25600)])
def test_xla_launch_paths_and_jax_reference(torch, act, m, n, k):
    import jax
    import jax.numpy as jnp

    from cuda_ops import nvfp4_gemv
    from rejax import kernels

    gen = torch.Generator(device="cuda")
    gen.manual_seed(m * n + k)
    ops = _operands(torch, act, m, n, k, gen)
    direct = _launch(torch, nvfp4_gemv.build(act, m, n, k), ops, m, n).float().cpu().numpy()
    args = [jax.dlpack.from_dlpack(t) for t in ops]
    kw = {"act": act, "n": n, "k": k}
    for launch in ("ptx", "callback"):
        y = jax.jit(
            lambda *a, launch=launch: kernels._gemv_call(a, impl="cuda", launch=launch, **kw)
        )(*args)
        np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), direct, err_msg=launch)
    ref = np.asarray(jax.jit(lambda *a: kernels._reference(*a, **kw))(*args).astype(jnp.float32))
    # Kernel and JAX reference share the exact block dots and differ only in the fp32 order of
    # the sum over blocks (the reference adds 1600 blocks sequentially at K = 25600). Judge both
    # against float64: the kernel must be at the bf16 floor or better than the reference, and
    # agree with it bit for bit on almost every element.
    y64 = _ref64(torch, act, ops).cpu().numpy()
    floor = np.linalg.norm(y64.astype(np.float32).astype(jnp.bfloat16).astype(np.float64) - y64)

    def err(y):
        return np.linalg.norm(y.astype(np.float64) - y64)

    assert err(direct) <= max(1.5 * floor, err(ref)) + 1e-6 * np.linalg.norm(y64)
    assert (direct != ref).mean() < 0.01


@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_scan_equals_eager(torch, act):
    """The primitive inside a jitted lax.scan gives the bits of eager calls (same operands)."""
    import jax
    import jax.numpy as jnp

    from rejax import kernels

    m, n, k, steps = 4, 1024, 2048, 3
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    per_step = [_operands(torch, act, m, n, k, gen) for _ in range(steps)]
    stacked = [
        jnp.stack([jax.dlpack.from_dlpack(ops[i]) for ops in per_step])
        for i in range(len(per_step[0]))
    ]
    kw = {"act": act, "n": n, "k": k, "impl": "cuda", "launch": kernels.default_launch()}
    eager = [kernels._gemv_call([a[s] for a in stacked], **kw) for s in range(steps)]
    _, scanned = jax.jit(
        lambda ops: jax.lax.scan(lambda c, xs: (c, kernels._gemv_call(xs, **kw)), 0, ops)
    )(stacked)
    for s in range(steps):
        np.testing.assert_array_equal(
            np.asarray(scanned[s], np.float32), np.asarray(eager[s], np.float32)
        )


@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
def test_nvfp4_linear_uses_kernel_on_cuda(torch, act):
    """impl='auto' on CUDA equals impl='cuda' and stays within the bf16 bound of the reference."""
    import jax.numpy as jnp

    from rejax import kernels, nvfp4

    rng = np.random.default_rng(3)
    w = nvfp4.quantize_weight(rng.standard_normal((1024, 2048)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((2, 3, 2048)), jnp.bfloat16)
    auto = np.asarray(kernels.nvfp4_linear(x, w, act=act), np.float32)
    cuda = np.asarray(kernels.nvfp4_linear(x, w, act=act, impl="cuda"), np.float32)
    ref = np.asarray(kernels.nvfp4_linear(x, w, act=act, impl="ref"), np.float32)
    np.testing.assert_array_equal(auto, cuda)
    assert np.linalg.norm(cuda - ref) <= 1e-2 * np.linalg.norm(ref)
