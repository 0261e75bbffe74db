"""Tests for rejax.nvfp4: E2M1/E4M3 tables, packing, quantizers (bit-exact against ModelOpt and
torchao when installed), dequantize and the reference matmul numerics."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rejax import nvfp4
from rejax.nvfp4 import (
    E2M1_VALUES,
    TORCHAO_MIN_BLOCK_SCALE,
    Nvfp4Tensor,
    dequantize,
    e2m1_round,
    nvfp4_matmul,
    nvfp4_matmul_q,
    pack_e2m1,
    quantize_activation,
    quantize_weight,
    unpack_e2m1,
)

RNG_SEED = 20261129

# Jitted once per shape: eager JAX compiles every op per new shape, which dominates CPU time.
_quantize_activation = jax.jit(quantize_activation, static_argnames="min_block_scale")
_dequantize = jax.jit(dequantize)
_matmul = jax.jit(nvfp4_matmul, static_argnames=("act", "order"))


def _bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)


def _scale_bytes(t: Nvfp4Tensor) -> np.ndarray:
    return np.asarray(t.scales).view(np.uint8)


def _codes(t: Nvfp4Tensor) -> np.ndarray:
    return np.asarray(unpack_e2m1(t.packed))


def _random_bf16_bits(rng, shape, exp_range=None) -> np.ndarray:
    """Uniform random bf16 bit patterns (finite only), optionally with the exponent field
    restricted to [lo, hi): covers subnormals, huge and tiny magnitudes."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(np.uint16)
    if exp_range is not None:
        exp = rng.integers(exp_range[0], exp_range[1], size=shape).astype(np.uint16)
        bits = (bits & 0x807F) | (exp << 7)
    a = bits.view(ml_dtypes.bfloat16).copy()
    a[~np.isfinite(a.astype(np.float32))] = 0
    return a


def _tie_weight() -> np.ndarray:
    """A bf16 weight whose scaled values hit every E2M1 rounding tie exactly.

    amax = 2688 makes the global scale exactly 1.0; a block with amax 6 gets scale 1.0 and a
    block with amax 12 gets scale 2.0, so scaled values equal w (or w / 2) exactly.
    """
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    row0 = np.concatenate([ties, -ties])  # amax 6 -> scale 1
    row1 = np.concatenate([2 * ties, -2 * ties])  # amax 12 -> scale 2
    row2 = np.zeros(16, np.float32)
    row2[3] = 2688.0
    w = np.stack([row0, row1, row2])
    return _bf16(np.concatenate([w, w[:, ::-1]], axis=1))  # [3, 32]


# --------------------------------------------------------------------------- E2M1 and packing


def test_e2m1_table_matches_paper_and_ml_dtypes():
    paper = [0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    np.testing.assert_array_equal(E2M1_VALUES[:8], paper)
    np.testing.assert_array_equal(E2M1_VALUES[8:], -np.array(paper, np.float32))
    assert np.signbit(E2M1_VALUES[8])  # code 8 is -0
    decoded = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(E2M1_VALUES, decoded)
    assert E2M1_VALUES.dtype == np.float32


def test_e2m1_ties_and_saturation_exact():
    v = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.0, 7.0, 1e30, 0.0]
    expect = [0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7, 0]  # 0, 1, 1, 2, 2, 4, 4, 6, 6, 6, 6, 0
    np.testing.assert_array_equal(np.asarray(e2m1_round(np.float32(v))), expect)
    np.testing.assert_array_equal(np.asarray(e2m1_round(-np.float32(v))), np.array(expect) | 8)
    values = E2M1_VALUES[np.asarray(e2m1_round(np.float32(v)))]
    np.testing.assert_array_equal(values, [0, 1, 1, 2, 2, 4, 4, 6, 6, 6, 6, 0])
    # Every representable value maps to its own code.
    np.testing.assert_array_equal(np.asarray(e2m1_round(E2M1_VALUES))[1:], np.arange(1, 16))


def test_e2m1_round_matches_ml_dtypes_on_all_magnitudes():
    rng = np.random.default_rng(RNG_SEED)
    bits = rng.integers(0, 1 << 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    v = bits.view(np.float32)
    v = v[np.isfinite(v)]
    mids = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 10)])
    grid = np.linspace(-7, 7, 100_001, dtype=np.float32)
    v = np.concatenate([v, near, -near, grid])
    expect = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(e2m1_round(v)), expect)


def test_pack_layout_and_roundtrip():
    codes = np.array([[1, 2, 3, 4, 15, 0, 8, 7]], np.uint8)
    packed = np.asarray(pack_e2m1(codes))
    np.testing.assert_array_equal(packed, [[0x21, 0x43, 0x0F, 0x78]])  # element 2j low nibble
    rng = np.random.default_rng(RNG_SEED)
    codes = rng.integers(0, 16, size=(7, 96), dtype=np.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (7, 48) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(unpack_e2m1(packed)), codes)
    every_byte = np.arange(256, dtype=np.uint8).reshape(2, 128)
    np.testing.assert_array_equal(np.asarray(pack_e2m1(unpack_e2m1(every_byte))), every_byte)


# --------------------------------------------------------------------------- the container


def test_nvfp4_tensor_pytree_and_properties():
    t = quantize_weight(np.ones((3, 32), np.float32))
    leaves, treedef = jax.tree_util.tree_flatten(t)
    assert len(leaves) == 3
    assert jax.tree_util.tree_unflatten(treedef, leaves).shape == (3, 32)
    assert (t.rows, t.k) == (3, 32)
    assert t.nbytes == 3 * 16 + 3 * 2 + 4
    assert t.packed.dtype == jnp.uint8 and t.scales.dtype == jnp.float8_e4m3fn
    assert t.global_scale.dtype == jnp.float32 and t.global_scale.shape == ()
    doubled = jax.jit(lambda t: dataclasses.replace(t, global_scale=2 * t.global_scale))(t)
    assert doubled.shape == (3, 32)
    np.testing.assert_array_equal(np.asarray(doubled.packed), np.asarray(t.packed))


# --------------------------------------------------------------------------- properties

# XLA flushes float32 subnormals (dequantize and the activation path run in XLA), so the
# properties are drawn where every scale product is a normal float32: no subnormal inputs and a
# tensor amax of 0 or >= 1e-30 (real weights and activations are far above this).
_finite_f32 = st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=False, width=32)


def _matrices():
    shapes = st.tuples(st.sampled_from([1, 3]), st.sampled_from([16, 32, 64]))
    return shapes.flatmap(lambda s: hnp.arrays(np.float32, s, elements=_finite_f32))


def _halfstep_bound(scaled: np.ndarray) -> np.ndarray:
    """Largest |v - e2m1(round(v))| for RNE with saturation, by |v|."""
    a = np.abs(scaled)
    return np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, np.where(a <= 6, 1.0, a - 6.0)))


def _check_quantized_properties(x: np.ndarray, t: Nvfp4Tensor, *, g: np.ndarray):
    """Error bound, sign, zero blocks, saturation for x [rows, K] and its quantization t."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 16, 16).astype(np.float64)
    sf = np.asarray(t.scales).astype(np.float64)  # [rows, K/16]
    step = sf * np.asarray(g, np.float64).reshape(-1, 1)  # float(SF) * global per block
    codes = _codes(t).reshape(rows, k // 16, 16)
    deq = np.asarray(_dequantize(t), np.float64).reshape(blocks.shape)
    np.testing.assert_array_equal(deq, E2M1_VALUES[codes] * step[..., None].astype(np.float32))
    live = step > 0  # a dead (SF = 0) block dequantizes to 0; its inputs are bounded by callers
    scaled = np.where(live[..., None], blocks / np.where(live, step, 1)[..., None], 0)
    blocks = np.where(live[..., None], blocks, 0)
    # RNE half step (or the saturation excess) in units of the block scale, plus the float32
    # rounding of the dequantized product.
    bound = _halfstep_bound(scaled) * step[..., None] * (1 + 1e-6) + np.abs(deq) * 2**-23
    assert np.all(np.abs(blocks - deq) <= bound)
    # Sign: a non-zero dequantized value has the input's sign; positives never get a sign bit.
    nz = deq != 0
    assert np.all(np.sign(deq[nz]) == np.sign(blocks[nz]))
    assert np.all(codes[blocks > 0] < 8)
    # The largest element of a block saturates to the top code unless the scale was clamped.
    amax = np.max(np.abs(blocks), axis=-1)
    top = np.take_along_axis(codes, np.argmax(np.abs(blocks), axis=-1)[..., None], -1)[..., 0]
    unclamped = (amax > 0) & (sf >= 2**-6) & (sf < 448)
    assert np.all(top[unclamped] & 7 == 7)
    return amax


@settings(max_examples=150, deadline=None)
@given(_matrices(), st.booleans(), st.integers(0, 3))
def test_quantize_weight_properties(w, zero_block, row):
    w = w.copy()
    if zero_block:
        w[row % w.shape[0], :16] = 0.0
    # After the zero block: zeroing the only large value can leave a subnormal global scale.
    assume(not np.any(w) or np.max(np.abs(w)) >= 1e-30)
    t = quantize_weight(w)
    _assert_same_quantization(t, nvfp4._quantize_weight_numpy(w), "drawn")
    assert t.shape == w.shape
    if not np.any(w):
        assert float(t.global_scale) == 0.0
    amax = _check_quantized_properties(w, t, g=t.global_scale)
    sf = np.asarray(t.scales).astype(np.float32)
    assert np.all(sf[amax == 0] == 1.0)  # ModelOpt: an all-zero block gets scale 1.0
    assert np.all(_codes(t).reshape(*amax.shape, 16)[amax == 0] == 0)


@settings(max_examples=150, deadline=None)
@given(_matrices(), st.floats(0.05, 4.0), st.booleans())
def test_quantize_activation_properties(x, calib, dynamic):
    amax = float(np.max(np.abs(x)))
    assume(amax == 0 or amax >= 1e-30)
    input_scale = None if dynamic else np.float32(max(amax, 1e-3) * calib / 2688)
    t = _quantize_activation(x, input_scale)
    g = np.asarray(t.global_scale)
    assert g.shape == ((x.shape[0],) if dynamic else ())
    block_amax = _check_quantized_properties(x, t, g=np.broadcast_to(g, (x.shape[0],)))
    sf = np.asarray(t.scales).astype(np.float32)
    assert np.all(sf[block_amax == 0] == 0.0)  # SF = 0 and codes 0 for a zero block
    # A non-zero block whose scale rounds to E4M3 zero (amax / 6 / g <= 2**-10) is zeroed.
    limit = np.broadcast_to(6 * np.reshape(g, (-1, 1)) * 2.0**-10 * (1 + 1e-6), sf.shape)
    underflow = (sf == 0) & (block_amax > 0)
    assert np.all(block_amax[underflow] <= limit[underflow])
    assert np.all(_codes(t).reshape(*block_amax.shape, 16)[block_amax == 0] & 7 == 0)


# --------------------------------------------------------------------------- ModelOpt exactness


def _modelopt_weight_cases():
    rng = np.random.default_rng(RNG_SEED)
    cases = [("ties", _tie_weight())]
    shapes = [(1, 16), (5, 64), (16, 256), (3, 48)]
    for i in range(40):  # Gaussian weights over 12 decades, with zero blocks and outliers
        n, k = shapes[i % len(shapes)]
        w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(10 ** rng.uniform(-8, 4))
        if i % 3 == 0:
            w[int(rng.integers(n)), :16] = 0
        if i % 4 == 0:  # one row with an outlier: its blocks and all others scale very differently
            w[int(rng.integers(n)), int(rng.integers(k))] *= 1e4
        cases.append((f"gauss{i}", _bf16(w)))
    for i in range(40):  # raw bf16 bit patterns: every exponent, subnormals, signed zeros
        n, k = shapes[i % len(shapes)]
        if i < 15:
            exp_range = None
        elif i < 30:
            lo = int(rng.integers(0, 240))
            exp_range = (lo, lo + int(rng.integers(1, 16)))
        else:
            exp_range = (0, int(rng.integers(1, 12)))  # subnormal / tiny magnitudes
        cases.append((f"bits{i}", _random_bf16_bits(rng, (n, k), exp_range)))
    big = rng.standard_normal((64, 1024)).astype(np.float32) * 0.02
    big[::7, ::33] = 0
    cases.append(("layer", _bf16(big)))
    return cases


def test_quantize_weight_bit_exact_with_modelopt():
    torch = pytest.importorskip("torch")
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    compared = 0
    for name, w in _modelopt_weight_cases():
        if not np.any(w.astype(np.float32)):
            continue  # ModelOpt returns NaN scales for an all-zero tensor; tested separately
        wt = torch.from_numpy(w.view(np.int16).copy()).view(torch.bfloat16)
        q, scale, scale_2 = qtensor.NVFP4QTensor.quantize(wt.clone(), 16)
        t = quantize_weight(w)
        np.testing.assert_array_equal(
            np.asarray(t.packed), q._quantized_data.numpy(), err_msg=f"codes of {name}"
        )
        np.testing.assert_array_equal(
            _scale_bytes(t), scale.view(torch.uint8).numpy(), err_msg=f"scales of {name}"
        )
        assert np.float32(t.global_scale).tobytes() == np.float32(scale_2.item()).tobytes(), name
        compared += w.size
        if float(t.global_scale) < 2.0**-110:
            continue  # XLA flushes the subnormal scale products; the codes above are still exact
        deq = q.dequantize(
            dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16}
        )
        np.testing.assert_array_equal(np.asarray(_dequantize(t)), deq.numpy(), err_msg=name)
    assert compared > 100_000


def test_quantize_weight_accepts_jax_and_float_dtypes():
    rng = np.random.default_rng(RNG_SEED)
    w = _bf16(rng.standard_normal((5, 64)))
    ref = quantize_weight(w)
    for other in (jnp.asarray(w), w.astype(np.float32), jnp.asarray(w).astype(jnp.float16)):
        t = quantize_weight(other)
        np.testing.assert_array_equal(np.asarray(t.packed), np.asarray(ref.packed))
        np.testing.assert_array_equal(_scale_bytes(t), _scale_bytes(ref))


def test_quantize_weight_all_zero():
    t = quantize_weight(np.zeros((2, 32), np.float32))
    assert float(t.global_scale) == 0.0
    np.testing.assert_array_equal(np.asarray(t.packed), 0)
    np.testing.assert_array_equal(np.asarray(t.scales).astype(np.float32), 1.0)
    np.testing.assert_array_equal(np.asarray(dequantize(t)), 0.0)


def test_quantize_weight_ties_by_hand():
    t = quantize_weight(_tie_weight())
    np.testing.assert_array_equal(np.asarray(t.scales).astype(np.float32)[:2, 0], [1.0, 2.0])
    assert float(t.global_scale) == 1.0
    expect = [0, 2, 2, 4, 4, 6, 6, 7]  # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    np.testing.assert_array_equal(_codes(t)[0, :16], expect + [c | 8 for c in expect])
    np.testing.assert_array_equal(_codes(t)[1, :16], expect + [c | 8 for c in expect])


# --------------------------------------------------------------------------- jitted weight quantizer


def _float_bits(rng, n, exp_range) -> np.ndarray:
    """float32 bit patterns (uint32), random mantissas, biased exponents in [lo, hi)."""
    man = rng.integers(0, 1 << 23, size=n, dtype=np.uint32)
    exp = rng.integers(exp_range[0], exp_range[1], size=n).astype(np.uint32)
    return man | (exp << 23)


def test_div_bits_is_numpy_division():
    """`_div_bits` is numpy's float32 division bit for bit: subnormal operands and quotients
    (which `_div_rn` flushes), overflow to inf, a / 0 = inf; 0 / b = 0 (numpy: NaN for 0 / 0)."""
    rng = np.random.default_rng(RNG_SEED + 30)
    div = jax.jit(nvfp4._div_bits)
    ranges = [
        ((1, 255), (1, 255)),  # every normal: quotients overflow and underflow
        ((0, 1), (1, 255)),  # subnormal dividends
        ((1, 255), (0, 1)),  # subnormal divisors
        ((0, 1), (0, 1)),
        ((0, 30), (100, 160)),  # quotients at the subnormal boundary and rounding to 0 / 2**-149
        ((100, 160), (0, 30)),
    ]
    for (alo, ahi), (blo, bhi) in ranges:
        a, b = _float_bits(rng, 100_000, (alo, ahi)), _float_bits(rng, 100_000, (blo, bhi))
        b[::97] &= 0xFF800000  # powers of two: exact quotients, exact ties when subnormal
        a[::89] = 0
        b[::83] = 0
        with np.errstate(all="ignore"):
            expect = a.view(np.float32) / b.view(np.float32)
        expect[a == 0] = 0
        got = np.asarray(div(a, b))
        bad = np.flatnonzero(got != expect.view(np.uint32))
        assert bad.size == 0, (
            f"{bad.size} quotients differ, e.g. {a.view(np.float32)[bad[0]]!r} / "
            f"{b.view(np.float32)[bad[0]]!r}: {got[bad[0]]:#x} != {expect.view(np.uint32)[bad[0]]:#x}"
        )


@pytest.mark.parametrize("skew", [-4, -1, 1, 3])
def test_div_bits_corrects_a_wrong_estimate(monkeypatch, skew):
    """A significand quotient estimate off by up to 4 units (the skew plus the float estimate's
    own rounding up, which `_div_rn` tolerates but `_div_bits`'s sticky bit does not) still
    gives numpy's quotient, subnormal ones included."""
    estimate = nvfp4._quotient_estimate
    monkeypatch.setattr(
        nvfp4,
        "_quotient_estimate",
        lambda ma, mb: (estimate(ma, mb).astype(jnp.int32) + skew).astype(jnp.uint32),
    )
    rng = np.random.default_rng(RNG_SEED + 31)
    a, b = _float_bits(rng, 50_000, (0, 40)), _float_bits(rng, 50_000, (90, 170))
    got = np.asarray(jax.jit(lambda a, b: nvfp4._div_bits(a, b))(a, b))  # fresh trace
    np.testing.assert_array_equal(got, (a.view(np.float32) / b.view(np.float32)).view(np.uint32))


def test_e4m3_weight_scale_matches_ml_dtypes():
    """ModelOpt's scale byte: 1.0 for 0, else clamp to [2**-9, 448] and round to E4M3 (RNE), on
    every exponent from 2**-12 to 2**10 with the mantissa bits at and around every tie."""
    exp = np.arange(127 - 12, 127 + 10, dtype=np.uint32)
    top = np.arange(1 << 11, dtype=np.uint32) << 12
    low = np.array([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], np.uint32)
    bits = (exp[:, None, None] << 23) | top[None, :, None] | low[None, None, :]
    extra = np.array([0, 1, 0x7FFFFF, 0x7F7FFFFF, 0x7F800000], np.uint32)  # 0, subnormals, max
    bits = np.concatenate([bits.ravel(), extra])
    q = bits.view(np.float32)
    expect = np.clip(np.where(q == 0, np.float32(1), q), np.float32(2.0**-9), np.float32(448))
    got = np.asarray(jax.jit(nvfp4._e4m3_weight_scale)(bits))
    np.testing.assert_array_equal(got, expect.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def _f16_bits(rng, shape) -> np.ndarray:
    a = rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(np.uint16).view(np.float16)
    a = a.copy()
    a[~np.isfinite(a)] = 0
    return a


def _f32_bit_matrix(rng, shape, exp_range) -> np.ndarray:
    bits = _float_bits(rng, int(np.prod(shape)), exp_range).reshape(shape)
    sign = rng.integers(0, 2, size=shape, dtype=np.uint32) << 31
    return (bits | sign).view(np.float32)


def _twin_cases():
    """(name, w) for the jitted quantizer against its numpy twin: every input dtype, random and
    raw bit patterns (subnormals, huge values, signed zeros), zero blocks and matrices, E2M1 ties,
    block scales clamped at 2**-9 and 448, and ModelOpt's quirks on tiny global scales."""
    rng = np.random.default_rng(RNG_SEED + 32)
    shapes = [(1, 16), (4, 64), (7, 96), (16, 256)]
    dtypes = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
    cases = []
    for i in range(24):
        n, k = shapes[i % len(shapes)]
        for dname, dtype in dtypes.items():
            top = 4.0 if dname == "f16" else 30.0
            w = rng.standard_normal((n, k)) * 10 ** rng.uniform(-6, top)
            if i % 3 == 0:
                w[int(rng.integers(n)), :16] = 0  # an all-zero block
            if i % 3 == 1:
                w[:, ::5] = -0.0
            if i % 4 == 0:  # an outlier: the other blocks' scales clamp at 2**-9 or underflow
                w[int(rng.integers(n)), int(rng.integers(k))] *= 10 ** rng.uniform(2, 5)
            w = np.clip(w, -60000, 60000) if dname == "f16" else w
            cases.append((f"gauss{i}-{dname}", w.astype(dtype)))
    for i in range(30):
        n, k = shapes[i % len(shapes)]
        lo = int(rng.integers(0, 240)) if i % 3 else 0  # every third: subnormal / tiny values
        window = (lo, lo + int(rng.integers(1, 16)))
        cases.append((f"bits{i}-bf16", _random_bf16_bits(rng, (n, k), None if i < 5 else window)))
        cases.append((f"bits{i}-f16", _f16_bits(rng, (n, k))))
        cases.append((f"bits{i}-f32", _f32_bit_matrix(rng, (n, k), window if i else (0, 255))))
    for dname, dtype in dtypes.items():
        cases.append((f"zeros-{dname}", np.zeros((3, 32), dtype)))
        cases.append((f"negzeros-{dname}", np.full((3, 32), -0.0, dtype)))
    # Exact E2M1 ties and saturation (global scale 2**k), at several powers of two.
    for k in (-100, -60, 0, 60, 100):
        cases.append((f"ties*2^{k}", _bf16(_tie_weight().astype(np.float32) * np.float32(2.0**k))))
    cases.append(("ties-f16", _tie_weight().astype(np.float16)))
    # Global scale exactly 1 (amax 2688): block amax / 6 at, between and around E4M3 steps of
    # the 2**-9 floor and the subnormal range, and just above 448 * 6.
    steps = np.float32(6 * 2.0**-9) * np.float32([0.25, 0.5, 0.75, 1, 1.5, 2.5, 3.5, 7.5, 8.5])
    row = np.zeros((len(steps) + 1, 16), np.float32)
    row[:-1, 0] = steps
    row[:-1, 1:] = steps[:, None] * rng.uniform(-1, 1, (len(steps), 15)).astype(np.float32)
    row[-1, 0] = 2688
    near = np.nextafter(row, np.float32(np.inf))
    cases.append(("floor-steps", row.reshape(-1, 32)))
    cases.append(("floor-steps-next", near.reshape(-1, 32)))
    # Top block clamped at 448: amax / (6 * RN(amax / 2688)) > 448 whenever RN rounds down.
    for i in range(10):
        w = rng.standard_normal((2, 32)).astype(np.float32)
        w[0, 0] = np.float32(rng.uniform(1, 2)) * np.float32(2.0 ** int(rng.integers(-20, 20)))
        cases.append((f"ceiling{i}", w))
    # amax / (6 * global) underflows to 0 for a tiny block: scale 1.0, as for an all-zero block.
    w = np.zeros((2, 32), np.float32)
    w[0, 0], w[1, :16], w[1, 16:] = 3e38, 1e-38, 1e-44
    cases.append(("scale-underflow", w))
    # Subnormal global scale: float(scale) * global underflows to 0 and ModelOpt divides by it.
    w = np.zeros((2, 32), np.float32)
    w[0, 0], w[1, :3], w[1, 16:19] = 2.0**-130, [2.0**-149, -(2.0**-149), 0], [2.0**-140, 0, -0.0]
    cases.append(("denominator-zero", w))
    cases.append(("huge", np.float32([[3.4e38, -3.4e38] * 8 + [1e30, -1e-30] * 8])))
    return cases


def _assert_same_quantization(t: Nvfp4Tensor, ref: Nvfp4Tensor, name: str) -> None:
    assert t.shape == ref.shape, name
    np.testing.assert_array_equal(
        np.asarray(t.packed), np.asarray(ref.packed), err_msg=f"codes of {name}"
    )
    np.testing.assert_array_equal(_scale_bytes(t), _scale_bytes(ref), err_msg=f"scales of {name}")
    got, want = np.asarray(t.global_scale), np.asarray(ref.global_scale)
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == (), name
    assert got.tobytes() == want.tobytes(), name


def test_quantize_weight_equals_numpy_twin():
    """The jitted quantizer gives the bytes of the numpy float32 recipe it replaced, on numpy
    and jax inputs of every dtype."""
    cases = _twin_cases()
    for name, w in cases:
        ref = nvfp4._quantize_weight_numpy(w)
        _assert_same_quantization(quantize_weight(w), ref, name)
        _assert_same_quantization(quantize_weight(jnp.asarray(w)), ref, f"{name} (jax)")
    assert sum(w.size for _, w in cases) > 150_000


def test_quantize_weight_modelopt_quirks():
    """The edge cases of the recipe appear in the twin cases as intended (so that the test above
    covers them): scales clamped at both ends, a scale of 1.0 for a block whose amax / (6 * global)
    underflows, and a code of +-6 where float(scale) * global underflows to 0."""
    cases = dict(_twin_cases())
    floor = quantize_weight(cases["floor-steps"])
    sf = _scale_bytes(floor).reshape(-1)[:-1]  # the blocks in order, less the 2688 one
    # 6 * 2**-9 * [0.25 .. 8.5] / 6 in units of 2**-9, clamped up to 1, RNE: 1.5 -> 2, 2.5 -> 2
    np.testing.assert_array_equal(sf, [1, 1, 1, 1, 2, 2, 4, 8, 8])
    ceilings = [_scale_bytes(quantize_weight(w)).max() for n, w in cases.items() if "ceil" in n]
    assert max(ceilings) == 0x7E  # 448
    under = quantize_weight(cases["scale-underflow"])
    np.testing.assert_array_equal(_scale_bytes(under)[1], [0x38, 0x38])  # 1.0
    np.testing.assert_array_equal(_codes(under)[1], 0)
    zero_denom = quantize_weight(cases["denominator-zero"])
    assert _scale_bytes(zero_denom)[1, 0] == 1  # 2**-9, and 2**-9 * global rounds to 0
    np.testing.assert_array_equal(_codes(zero_denom)[1, :3], [7, 15, 0])  # +-inf; 0 / 0 = NaN


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_quantize_weight_non_finite_message(dtype, bad):
    w = np.ones((3, 32), np.float32)
    w[2, 17] = bad
    w = jnp.asarray(w).astype(dtype)
    with pytest.raises(ValueError, match=r"non-finite values, first at \(2, 17\)"):
        quantize_weight(w)
    with pytest.raises(ValueError, match=r"non-finite values, first at \(2, 17\)"):
        nvfp4._quantize_weight_numpy(w)


# --------------------------------------------------------------------------- torchao exactness


def _torchao_quantize(x: np.ndarray, per_tensor_scale: np.float32):
    torch = pytest.importorskip("torch")
    ao = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    xt = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    scales, packed = ao.nvfp4_quantize(xt, 16, torch.tensor(np.float32(per_tensor_scale)))
    return packed.numpy(), scales.view(torch.uint8).numpy()


def _activation_cases():
    rng = np.random.default_rng(RNG_SEED + 1)
    cases = []
    shapes = [(1, 16), (4, 64), (9, 128)]
    for i in range(60):
        m, k = shapes[i % len(shapes)]
        if i < 30:
            x = _bf16(rng.standard_normal((m, k)) * 10 ** rng.uniform(-3, 3))
            x[0, :16] = 0 if i % 2 else x[0, :16]
        else:
            lo = int(rng.integers(60, 190))
            x = _random_bf16_bits(rng, (m, k), (lo, lo + int(rng.integers(1, 24))))
        amax = np.float32(np.max(np.abs(x.astype(np.float32))))
        if amax == 0:
            continue
        # Calibrated scales below and above this batch's amax (saturating blocks included).
        scale = np.float32(amax / np.float32(2688) * np.float32(rng.uniform(0.05, 3.0)))
        cases.append((x, scale))
    # Ties: with input_scale 1 a block of amax 6 gets SF 1, so x * out_scale == x exactly.
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    cases.append((_bf16(np.concatenate([ties, -ties, 2 * ties, -2 * ties])[None]), 1.0))
    return cases


def test_quantize_activation_bit_exact_with_torchao():
    """min_block_scale=TORCHAO_MIN_BLOCK_SCALE reproduces torchao on every code and scale; the
    default (TensorRT-LLM / vLLM: no lower clamp) agrees on every block torchao does not clamp."""
    compared = 0
    for x, scale in _activation_cases():
        packed, scales = _torchao_quantize(x, scale)
        t = _quantize_activation(x, scale, min_block_scale=TORCHAO_MIN_BLOCK_SCALE)
        np.testing.assert_array_equal(np.asarray(t.packed), packed)
        np.testing.assert_array_equal(_scale_bytes(t), scales)
        t0 = _quantize_activation(x, scale)
        unclamped = (np.asarray(t0.scales).astype(np.float32) >= 2**-6).repeat(8, axis=1)
        np.testing.assert_array_equal(np.asarray(t0.packed)[unclamped], packed[unclamped])
        keep = scales > 0x08  # blocks whose torchao scale is above the clamp 2**-6
        np.testing.assert_array_equal(_scale_bytes(t0)[keep], scales[keep])
        compared += x.size
    assert compared > 20_000


def test_quantize_activation_ties_by_hand():
    x, scale = _activation_cases()[-1]
    t = quantize_activation(x, scale)
    np.testing.assert_array_equal(np.asarray(t.scales).astype(np.float32), [[1.0, 2.0]])
    expect = [0, 2, 2, 4, 4, 6, 6, 7]
    np.testing.assert_array_equal(_codes(t)[0], (expect + [c | 8 for c in expect]) * 2)


@pytest.mark.parametrize("jit", [False, True])
def test_dynamic_activation_matches_torchao_per_row(jit):
    """Per-row scales hit E4M3 / E2M1 ties often enough that a plain float division (which XLA
    rewrites, e.g. (a / 6) / g -> a / (6 * g)) fails here: about 10-30 codes and 3-8 scales of
    these 4096 blocks differ."""
    rng = np.random.default_rng(RNG_SEED + 2)
    x = _bf16(rng.standard_normal((64, 1024)))
    x[:, 7] *= 50  # an outlier channel: most blocks sit far below the row amax
    x[2] = 0
    x[3] *= 1e-3
    quant = _quantize_activation if jit else quantize_activation
    t = quant(x, None, min_block_scale=TORCHAO_MIN_BLOCK_SCALE)
    g = np.asarray(t.global_scale)
    amax = np.max(np.abs(x.astype(np.float32)), axis=1)
    np.testing.assert_array_equal(g, np.where(amax > 0, amax / np.float32(2688), 1.0))
    for r in range(x.shape[0]):
        packed, scales = _torchao_quantize(x[r : r + 1], g[r])
        np.testing.assert_array_equal(np.asarray(t.packed)[r : r + 1], packed)
        np.testing.assert_array_equal(_scale_bytes(t)[r : r + 1], scales)


def test_div_rn_is_ieee_division():
    """The division behind the activation scales equals numpy's float32 division (operands and
    results below 2**-126 flush to 0), eagerly and under jit, where XLA would rewrite a plain
    float divide by a constant or a broadcast."""
    rng = np.random.default_rng(RNG_SEED + 7)

    def floats(n, lo, hi):
        man = rng.integers(0, 1 << 23, size=n, dtype=np.uint32)
        exp = rng.integers(lo, hi, size=n).astype(np.uint32)
        return (man | (exp << 23)).view(np.float32)

    div = jax.jit(nvfp4._div_rn)
    for (alo, ahi), (blo, bhi) in [
        ((1, 255), (1, 255)),
        ((100, 160), (100, 160)),
        ((0, 3), (100, 140)),
    ]:
        a, b = floats(50_000, alo, ahi), floats(50_000, blo, bhi)
        b[b == 0] = 1
        with np.errstate(all="ignore"):
            expect = np.where(np.abs(a) < 2.0**-126, np.float32(0), a) / b
        expect[np.abs(expect) < 2.0**-126] = 0
        for f in (nvfp4._div_rn, div):
            np.testing.assert_array_equal(
                np.asarray(f(a, b)).view(np.uint32), expect.view(np.uint32)
            )
    small = np.arange(1, 3000, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(div(small, 6.0)), small / np.float32(6))
    np.testing.assert_array_equal(np.asarray(div(1.0, small)), np.float32(1) / small)


@pytest.mark.parametrize("skew", [-4, -1, 1, 4])
def test_div_rn_corrects_a_wrong_estimate(monkeypatch, skew):
    """The float quotient is only an estimate (XLA may rewrite it, a GPU rounds it loosely):
    an estimate off by up to 4 units still gives numpy's correctly rounded quotient."""
    estimate = nvfp4._quotient_estimate
    monkeypatch.setattr(
        nvfp4,
        "_quotient_estimate",
        lambda ma, mb: (estimate(ma, mb).astype(jnp.int32) + skew).astype(jnp.uint32),
    )
    rng = np.random.default_rng(RNG_SEED + 8)
    a = rng.uniform(1e-3, 1e3, 50_000).astype(np.float32)
    b = rng.uniform(1e-3, 1e3, 50_000).astype(np.float32)
    got = np.asarray(jax.jit(lambda a, b: nvfp4._div_rn(a, b))(a, b))  # fresh trace
    np.testing.assert_array_equal(got.view(np.uint32), (a / b).view(np.uint32))


# --------------------------------------------------------------------------- jit == eager


def test_jit_equals_eager():
    rng = np.random.default_rng(RNG_SEED + 3)
    x = rng.standard_normal((5, 128)) * np.float32([[0.01], [0.3], [1], [3], [100]])
    x[:, 5] *= 40  # outlier channel: many blocks land on E4M3 / E2M1 ties under XLA rewrites
    x = jnp.asarray(x, jnp.bfloat16)
    w = quantize_weight(_bf16(rng.standard_normal((24, 128)) * 0.05))
    scale = np.float32(2.5 / 2688)
    quant = jax.jit(quantize_activation, static_argnames="min_block_scale")
    for s in (scale, None):
        for mbs in (0.0, TORCHAO_MIN_BLOCK_SCALE):
            a, b = quantize_activation(x, s, min_block_scale=mbs), quant(x, s, min_block_scale=mbs)
            for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_array_equal(np.asarray(leaf_a), np.asarray(leaf_b))
    mm = jax.jit(nvfp4_matmul, static_argnames=("act", "order"))
    for act, s in (("w4a4", scale), ("w4a4", None), ("w4a16", None)):
        for order in ("blocks", "dot"):
            eager = nvfp4_matmul(x, w, act=act, input_scale=s, order=order)
            jitted = mm(x, w, act=act, input_scale=s, order=order)
            assert eager.dtype == jnp.bfloat16 and eager.shape == (5, 24)
            np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


# --------------------------------------------------------------------------- matmul numerics


def _sequential_reference(xq: Nvfp4Tensor, w: Nvfp4Tensor) -> np.ndarray:
    """Numpy W4A4: exact block partials, float32 sum in block order, alpha, bf16."""
    m, n, j = xq.rows, w.rows, w.k // 16
    xv = E2M1_VALUES[_codes(xq)].reshape(m, j, 16).astype(np.float64)
    wv = E2M1_VALUES[_codes(w)].reshape(n, j, 16).astype(np.float64)
    partial = np.einsum("mjk,njk->mnj", xv, wv)  # exact
    sx = np.asarray(xq.scales).astype(np.float64)
    sw = np.asarray(w.scales).astype(np.float64)
    terms = (partial * sw[None, :, :] * sx[:, None, :]).astype(np.float32)  # exact
    assert np.array_equal(terms.astype(np.float64), partial * sw[None] * sx[:, None])
    acc = np.zeros((m, n), np.float32)
    for b in range(j):
        acc = acc + terms[:, :, b]
    alpha = np.float32(w.global_scale) * np.asarray(xq.global_scale, np.float32).reshape(-1, 1)
    return (acc * alpha).astype(ml_dtypes.bfloat16)


def _bf16_order(v) -> np.ndarray:
    """bf16 values (after rounding) as integers that step by one per representable value."""
    bits = np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).view(np.int16).astype(np.int32)
    return np.where(bits >= 0, bits, -(bits & 0x7FFF))


def test_matmul_q_hand_computed():
    k = 32
    ones = np.full((2, k), 2, np.uint8)  # code 2 = 1.0

    def tensor(codes, scale, g):
        rows = codes.shape[0]
        return Nvfp4Tensor(
            packed=pack_e2m1(codes),
            scales=jnp.full((rows, k // 16), scale, jnp.float8_e4m3fn),
            global_scale=jnp.asarray(g, jnp.float32),
            shape=(rows, k),
        )

    xq = tensor(ones, 2.0, np.float32([1.0, 0.5]))  # per-row global scale
    w_codes = np.tile(np.uint8([7, 15]), (3, k // 2))  # +6, -6, ... -> every block sums to 0
    w_codes[1] = 5  # all 3.0
    w = tensor(w_codes, 0.5, 4.0)
    y = np.asarray(nvfp4_matmul_q(xq, w)).astype(np.float32)
    # row m, col 1: sum 32 * (1 * 3) * SFx 2 * SFw 0.5 * alpha (4 * g_m)
    np.testing.assert_array_equal(y, [[0, 32 * 3 * 4, 0], [0, 32 * 3 * 2, 0]])


@pytest.mark.parametrize("dynamic", [False, True])
def test_matmul_blocks_order_is_exactly_sequential(dynamic, monkeypatch):
    rng = np.random.default_rng(RNG_SEED + 4)
    x = _bf16(rng.standard_normal((3, 256)) * np.float32([[0.1], [1.0], [30.0]]))
    w = quantize_weight(_bf16(rng.standard_normal((40, 256)) * 0.03))
    xq = quantize_activation(x, None if dynamic else np.float32(20 / 2688))
    expect = _sequential_reference(xq, w)
    got = np.asarray(nvfp4_matmul_q(xq, w, order="blocks"))
    np.testing.assert_array_equal(got.view(np.uint16), expect.view(np.uint16))
    monkeypatch.setattr(nvfp4, "_PARTIALS_BUDGET", 3 * 40 * 3)  # chunks of 3 blocks, padded
    chunked = np.asarray(nvfp4_matmul_q(xq, w, order="blocks"))
    np.testing.assert_array_equal(chunked.view(np.uint16), expect.view(np.uint16))


@pytest.mark.parametrize("budget", [None, 3])
def test_matmul_accumulates_in_block_order(budget, monkeypatch):
    """Block 0 contributes 2**25 + 2**17 (a bf16 midpoint) and blocks 1..15 contribute 1.0 each.
    In block order every 1.0 is lost to float32 rounding and bf16 rounds the midpoint down to
    2**25; any other order keeps some of them and rounds up to 2**25 + 2**18."""
    if budget is not None:
        monkeypatch.setattr(nvfp4, "_PARTIALS_BUDGET", budget)  # one block per scan step
    code = {0.0: 0, 1.0: 2, 1.5: 3, 6.0: 7}
    x_vals = np.zeros((1, 256), np.float32)
    w_vals = np.zeros((1, 256), np.float32)
    x_vals[0, :16] = [6.0] * 15 + [1.0]
    w_vals[0, :16] = [6.0] * 14 + [1.5, 1.0]  # 14 * 36 + 9 + 1 = 514 = 2 * 257
    x_vals[0, 16::16] = 1.0
    w_vals[0, 16::16] = 1.0
    scales = np.ones((1, 16), np.float32)
    scales[0, 0] = 256.0  # 514 * 256 * 256 = 2**25 + 2**17

    def tensor(vals):
        codes = np.vectorize(code.get)(vals).astype(np.uint8)
        return Nvfp4Tensor(
            packed=pack_e2m1(codes),
            scales=jnp.asarray(scales, jnp.float8_e4m3fn),
            global_scale=jnp.float32(1.0),
            shape=(1, 256),
        )

    xq, w = tensor(x_vals), tensor(w_vals)
    assert float(np.asarray(_sequential_reference(xq, w), np.float32)[0, 0]) == 2.0**25
    y = float(np.asarray(nvfp4_matmul_q(xq, w, order="blocks"), np.float32)[0, 0])
    assert y == 2.0**25


def test_matmul_against_float64_dequantized_reference():
    """|y - ref| <= 2**-8 |ref| (bf16 output rounding) + f32 accumulation slack.

    ref is the float64 product of the dequantized operands. The accumulation term bounds
    J * 2**-24 * sum_j |t_j| * alpha; measured maxima are printed for the report."""
    rng = np.random.default_rng(RNG_SEED + 5)
    x = _bf16(rng.standard_normal((20, 512)))
    x[:, 7] *= 50  # an outlier channel
    w = quantize_weight(_bf16(rng.standard_normal((48, 512)) * 0.02))
    wd = np.asarray(dequantize(w), np.float64)
    worst = {}
    for act, scale, order in [
        ("w4a4", np.float32(60 / 2688), "blocks"),
        ("w4a4", None, "blocks"),
        ("w4a4", None, "dot"),
        ("w4a16", None, "blocks"),
        ("w4a16", None, "dot"),
    ]:
        if act == "w4a4":
            xd = np.asarray(_dequantize(_quantize_activation(x, scale)), np.float64)
        else:
            xd = x.astype(np.float64)
        ref = xd @ wd.T
        y = np.asarray(_matmul(x, w, act=act, input_scale=scale, order=order), np.float64)
        slack = (512 // 16 + 16) * 2.0**-24 * (np.abs(xd) @ np.abs(wd).T)
        bound = 2.0**-8 * np.abs(ref) + slack + 1e-30
        ratio = np.abs(y - ref) / bound
        assert ratio.max() <= 1.0, (act, order, ratio.max())
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert rel <= 2.0**-9, (act, order, rel)
        # Stronger: within one bf16 step of the correctly rounded float64 result, and equal to it
        # almost everywhere (the float32 sum and alpha roundings rarely cross a bf16 midpoint).
        steps = np.abs(_bf16_order(y) - _bf16_order(ref))
        assert steps.max() <= 1, (act, order, steps.max())
        assert np.mean(steps == 0) >= 0.99, (act, order, np.mean(steps == 0))
        worst[(act, scale is None, order)] = (float(ratio.max()), float(np.mean(steps == 0)))
    print("max |y - ref| / bound, fraction equal to bf16(ref):", worst)


def test_matmul_dot_order_close_to_blocks_order():
    rng = np.random.default_rng(RNG_SEED + 6)
    x = _bf16(rng.standard_normal((24, 256)))
    w = quantize_weight(_bf16(rng.standard_normal((32, 256))))
    for act in ("w4a4", "w4a16"):
        a = np.asarray(_matmul(x, w, act=act, order="blocks"), np.float32)
        b = np.asarray(_matmul(x, w, act=act, order="dot"), np.float32)
        # Only the float32 summation order differs: at most one bf16 ulp apart.
        np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=1e-6)


# --------------------------------------------------------------------------- bad input


def _bad_inputs():
    good_w = quantize_weight(np.ones((4, 32), np.float32))
    x = np.ones((2, 32), np.float32)
    nan_x = x.copy()
    nan_x[1, 3] = np.nan
    inf_w = np.ones((2, 32), np.float32)
    inf_w[0, 0] = np.inf
    broken = dataclasses.replace(good_w, packed=good_w.packed[:, :8])
    return [
        (lambda: quantize_weight(np.ones((4, 24), np.float32)), "multiple of 16"),
        (lambda: quantize_weight(np.ones((4, 0), np.float32)), "multiple of 16"),
        (lambda: quantize_weight(np.ones((2, 4, 32), np.float32)), "2-D"),
        (lambda: quantize_weight(np.ones(32, np.float32)), "2-D"),
        (lambda: quantize_weight(np.ones((4, 32), np.float64)), "float64"),
        (lambda: quantize_weight(np.ones((4, 32), np.int32)), "int32"),
        (lambda: quantize_weight(inf_w), "non-finite"),
        (lambda: quantize_weight(np.full((1, 16), 1e-44, np.float32)), "underflows"),
        (lambda: quantize_activation(np.ones((2, 20), np.float32), 1.0), "multiple of 16"),
        (lambda: quantize_activation(np.ones((2, 2, 32), np.float32), 1.0), "2-D"),
        (lambda: quantize_activation(np.ones((2, 32), np.int8), 1.0), "int8"),
        (lambda: quantize_activation(nan_x, 1.0), "non-finite"),
        (lambda: quantize_activation(x, 0.0), "input_scale"),
        (lambda: quantize_activation(x, -1.0), "input_scale"),
        (lambda: quantize_activation(x, np.nan), "input_scale"),
        (lambda: quantize_activation(x, np.inf), "input_scale"),
        # one scale per row is [M] = [2]; any other shape is refused
        (lambda: quantize_activation(x, np.ones(3, np.float32)), "input_scale"),
        (lambda: quantize_activation(x, np.ones((2, 1), np.float32)), "input_scale"),
        (lambda: quantize_activation(x, np.array([1.0, 0.0], np.float32)), "input_scale"),
        (lambda: quantize_activation(x, 1.0, min_block_scale=-1.0), "min_block_scale"),
        (lambda: pack_e2m1(np.zeros((2, 3), np.uint8)), "K even"),
        (lambda: pack_e2m1(np.zeros((2, 4), np.int32)), "uint8"),
        (lambda: pack_e2m1(np.full((2, 4), 16, np.uint8)), "0..15"),
        (lambda: unpack_e2m1(np.zeros(4, np.uint8)), "2-D"),
        (lambda: unpack_e2m1(np.zeros((2, 4), np.int8)), "uint8"),
        (lambda: nvfp4_matmul(np.ones((2, 64), np.float32), good_w), "K mismatch"),
        (lambda: nvfp4_matmul(x, good_w, act="w8a8"), "act"),
        (lambda: nvfp4_matmul(x, good_w, order="fast"), "order"),
        (lambda: nvfp4_matmul(x, good_w, act="w4a16", input_scale=1.0), "input_scale"),
        (lambda: nvfp4_matmul(nan_x, good_w, act="w4a16"), "non-finite"),
        (lambda: nvfp4_matmul(x, np.ones((4, 32), np.float32)), "Nvfp4Tensor"),
        (lambda: nvfp4_matmul(x, broken), "packed"),
        (lambda: nvfp4_matmul_q(quantize_activation(np.ones((2, 64), np.float32)), good_w), "K"),
        # a stack of weights is one matrix per call (nvfp4.take picks one)
        (lambda: nvfp4_matmul_q(quantize_activation(x), nvfp4.stack([good_w, good_w])), "packed"),
        (lambda: dequantize(broken), "packed"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_bad_input_raises(case):
    fn, match = _bad_inputs()[case]
    with pytest.raises(ValueError, match=match):
        fn()


def test_per_row_input_scale_equals_the_dynamic_scale():
    # given the dynamic scale of each row, the per-row static path is the dynamic path
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 64)) * np.array([[1], [10], [0.1], [3], [7]])).astype(np.float32)
    dyn = quantize_activation(x)
    given = quantize_activation(x, nvfp4.global_scale_from_amax(nvfp4.activation_amax(x)))
    other = quantize_activation(x, np.full(5, 0.01, np.float32))
    for field in ("packed", "scales", "global_scale"):
        np.testing.assert_array_equal(
            np.asarray(getattr(given, field), np.float32),
            np.asarray(getattr(dyn, field), np.float32),
        )
    assert not np.array_equal(
        np.asarray(other.scales, np.float32), np.asarray(dyn.scales, np.float32)
    )
