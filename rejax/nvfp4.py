"""NVFP4: the 4-bit block-scaled format every rejax weight and activation becomes.

GEMM letters in this file: M rows of x, N out features (weight rows), K in features.

An NVFP4 tensor of logical shape [rows, K] stores
  * E2M1 codes, two per byte: element 2j in the low nibble of byte j, 2j+1 in the high nibble
    (`packed`, uint8 [rows, K/2]); code bit 3 is the sign, codes 8..15 are the negatives;
  * one E4M3 scale per 16 consecutive elements along K (`scales`, float8_e4m3fn [rows, K/16]);
  * a float32 global scale (`global_scale`: [] for one per matrix, or [rows], one per row: per-row
    dynamic activations, or a fused weight whose shards keep their own scales).
It dequantizes as `e2m1(code) * (float(scale) * global_scale)`. A decoder stacks the matrices of
its layers: leading stack dims on every array (packed [L, rows, K/2], scales [L, rows, K/16],
global_scale [L] or [L, rows]); `take(t, i)` reads one matrix of a stack.

Weights follow NVIDIA ModelOpt's `NVFP4QTensor.quantize` bit for bit (the same IEEE float32
operations in the same order, run jitted on the default device; `_quantize_weight_numpy` is the
numpy twin). Activations follow the vLLM / TensorRT-LLM recipe with the division order of
torchao's `nvfp4_quantize` (static global scale, dynamic block scales) and are jittable. `nvfp4_matmul` is the reference the CUDA kernel is checked against.

Numerics notes:
  * Activation divisions use `_div_rn` (an exactly rounded division checked in integers),
    because XLA rewrites float divisions under jit and the GPU's division is not correctly
    rounded, and either moves E4M3 / E2M1 ties; E4M3 scales
    are read back by table, because XLA drops float32 -> float8 -> float32 round trips.
  * XLA flushes float32 subnormals, so the jitted paths (activations, dequantize, matmul) treat
    values below 2**-126 as 0; real weights and activations are far above that. quantize_weight
    computes on float32 bit patterns in integer arithmetic (`_div_bits`, an IEEE division with
    subnormals) and matches ModelOpt on subnormal inputs too.
  * The default activation recipe has no lower clamp on block scales (TensorRT-LLM / vLLM);
    torchao clamps them to 2**-6, reproduced with `min_block_scale=TORCHAO_MIN_BLOCK_SCALE`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# torchao's `nvfp4_quantize` clamps block scales to at least the smallest normal E4M3 (2**-6);
# the TensorRT-LLM / vLLM kernels do not (subnormal scales and SF = 0 occur). Pass this as
# `min_block_scale` to reproduce torchao.
TORCHAO_MIN_BLOCK_SCALE = 2.0**-6
# ModelOpt clamps weight block scales to the smallest E4M3 subnormal before the cast.
_WEIGHT_MIN_BLOCK_SCALE = 2.0**-9

E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
# Midpoints between consecutive E2M1 magnitudes. Round-to-nearest-even: a value exactly on a
# midpoint goes to the even code, i.e. down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5.
_ROUND_DOWN_TIES = (0.25, 1.25, 2.5, 5.0)
_ROUND_UP_TIES = (0.75, 1.75, 3.5)

_FLOAT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
_ACTS = ("w4a4", "w4a16")
# Budget (in f32 elements) for the [G, M, N] block partials materialized per scan step.
_PARTIALS_BUDGET = 1 << 24
# Up to this many rows (decode shapes, the kernel's domain) the matmul reference adds the block
# partials in block order; above it, one dot over pre-scaled values (XLA's summation order).
SEQUENTIAL_MAX_M = 16


@dataclasses.dataclass(frozen=True)
class Nvfp4Tensor:
    """NVFP4 tensor of logical shape (rows, K).

    Attributes:
        packed: uint8 [rows, K // 2]; element 2j in the low nibble of byte j, 2j+1 in the high one.
        scales: float8_e4m3fn [rows, K // 16]; scale j covers elements 16j .. 16j + 15.
        global_scale: float32 [] (weights, static activations) or [rows] (per-row dynamic
            activation scale).
        shape: static logical shape (rows, K).
    """

    packed: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata={"static": True})

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1]

    @property
    def stack(self) -> tuple[int, ...]:
        """Leading stack dims (() for one matrix, (L,) for a decoder's layers)."""
        return tuple(np.shape(self.packed)[:-2])

    @property
    def per_row(self) -> bool:
        """True when the global scale has one value per row."""
        return np.ndim(self.global_scale) == len(self.stack) + 1

    @property
    def nbytes(self) -> int:
        """Bytes of packed codes + block scales + global scale(s)."""
        return int(self.packed.size + self.scales.size + 4 * self.global_scale.size)


jax.tree_util.register_dataclass(Nvfp4Tensor)


# ----------------------------------------------------------------------------- validation


def _is_concrete(a: Any) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _check_matrix(name: str, a: Any, dtypes=_FLOAT_DTYPES) -> None:
    shape = tuple(np.shape(a))
    if len(shape) != 2:
        raise ValueError(f"{name} must be 2-D [rows, K], got shape {shape}")
    if shape[1] == 0 or shape[1] % BLOCK:
        raise ValueError(
            f"{name}.shape={shape}: K={shape[1]} must be a positive multiple of {BLOCK}"
        )
    dtype = np.dtype(a.dtype)
    if dtype not in dtypes:
        raise ValueError(
            f"{name}.dtype={dtype} not supported; expected one of {[str(d) for d in dtypes]}"
        )


def _check_finite(name: str, a: Any) -> None:
    if not _is_concrete(a):
        return
    a32 = np.asarray(a).astype(np.float32)
    bad = ~np.isfinite(a32)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} (shape {a32.shape}) has {int(bad.sum())} non-finite values, "
            f"first at {idx}: {a32[idx]}"
        )


def _check_input_scale(input_scale: Any, rows: int | None = None) -> jax.Array:
    per_row = rows is not None and np.size(input_scale) != 1
    if per_row and tuple(np.shape(input_scale)) != (rows,):
        raise ValueError(
            f"input_scale must be a scalar (or shape [1]) or one per row [{rows}], got shape "
            f"{np.shape(input_scale)}"
        )
    if not per_row and np.size(input_scale) != 1:
        raise ValueError(
            f"input_scale must be a scalar (or shape [1]), got shape {np.shape(input_scale)}"
        )
    if _is_concrete(input_scale):
        value = np.asarray(input_scale, dtype=np.float32)
        if not (np.all(np.isfinite(value)) and np.all(value > 0)):
            raise ValueError(f"input_scale must be finite and > 0, got {value}")
    scale = jnp.asarray(input_scale, jnp.float32)
    return scale if per_row else scale.reshape(())


# ----------------------------------------------------------------------------- E2M1 codes


def _e2m1_magnitude(a, xp):
    """|v| -> E2M1 magnitude code 0..7 (RNE, saturating at 6); a = |v| in float32."""
    code = sum((a > t).astype(xp.uint8) for t in _ROUND_DOWN_TIES)
    code = code + sum((a >= t).astype(xp.uint8) for t in _ROUND_UP_TIES)
    return code.astype(xp.uint8)


def e2m1_round(v: jax.Array) -> jax.Array:
    """Rounds float32 values to E2M1 codes (RNE, saturating to +-6; the sign bit of v is kept).

    Args:
        v: float array (any shape), finite.

    Returns:
        uint8 codes of v's shape; -0.0 and negatives that round to zero give code 8.
    """
    v = jnp.asarray(v, jnp.float32)
    sign = jnp.signbit(v).astype(jnp.uint8) << 3
    return _e2m1_magnitude(jnp.abs(v), jnp) | sign


def pack_e2m1(codes: jax.Array) -> jax.Array:
    """Packs E2M1 codes two per byte (element 2j in the low nibble of byte j).

    Args:
        codes: uint8 [rows, K], values 0..15, K even.

    Returns:
        uint8 [rows, K // 2].
    """
    shape = tuple(np.shape(codes))
    if len(shape) != 2 or shape[1] % 2:
        raise ValueError(f"codes must be 2-D [rows, K] with K even, got shape {shape}")
    if np.dtype(codes.dtype) != np.uint8:
        raise ValueError(f"codes.dtype={np.dtype(codes.dtype)}, expected uint8")
    if _is_concrete(codes) and shape[1] and int(np.max(np.asarray(codes), initial=0)) > 15:
        raise ValueError(f"codes must be 0..15, got max {int(np.max(np.asarray(codes)))}")
    codes = jnp.asarray(codes)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(jnp.uint8)


def unpack_e2m1(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_e2m1`: uint8 [rows, K // 2] -> uint8 codes [rows, K]."""
    shape = tuple(np.shape(packed))
    if len(shape) != 2:
        raise ValueError(f"packed must be 2-D [rows, K // 2], got shape {shape}")
    if np.dtype(packed.dtype) != np.uint8:
        raise ValueError(f"packed.dtype={np.dtype(packed.dtype)}, expected uint8")
    packed = jnp.asarray(packed)
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)  # [rows, K // 2, 2]
    return codes.reshape(shape[0], shape[1] * 2)


def _pack_np(codes: np.ndarray) -> np.ndarray:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


# ----------------------------------------------------------------------------- exact division


def _significand_quotient(ma, mb, ea, eb):
    """Exact integer division of significands Ma, Mb in [2^23, 2^24) (uint32) with biased
    exponents ea, eb: (Q in [2^23, 2^24), remainder 0 <= R < Mb as int32, Mb as int32, the
    biased exponent of the quotient). Ma is doubled when it is the smaller significand, so
    Ma / Mb lies in [1, 2); the float estimate is corrected in integers."""
    small = ma < mb
    ma = jnp.where(small, ma << 1, ma)  # < 2^25, even: exact in float32
    exp = ea - eb + 127 - small.astype(jnp.int32)
    q = _quotient_estimate(ma, mb)
    rem = jax.lax.bitcast_convert_type((ma << 23) - q * mb, jnp.int32)  # exact, mod 2^32
    mbi = mb.astype(jnp.int32)
    for _ in range(4):  # the estimate is within 4 units of the true quotient
        low = rem < 0
        q = jnp.where(low, q - 1, q)
        rem = jnp.where(low, rem + mbi, rem)
        high = rem >= mbi
        q = jnp.where(high, q + 1, q)
        rem = jnp.where(high, rem - mbi, rem)
    return q, rem, mbi, exp


def _quotient_estimate(ma: jax.Array, mb: jax.Array) -> jax.Array:
    """floor(ma * 2^23 / mb) to within a few units, from a float divide (any rounding)."""
    est = ma.astype(jnp.float32) / mb.astype(jnp.float32)
    return jnp.clip(est * jnp.float32(2.0**23), 2.0**23 - 8, 2.0**24 + 8).astype(jnp.uint32)


def _div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE float32 a / b (round to nearest even) for a >= 0, b > 0, exact on every backend.

    A float divide is not enough: XLA's simplifier rewrites divisions under jit
    (x / c -> x * (1 / c), (x / y) / z -> x / (y * z), x / broadcast(y) -> x * broadcast(1 / y))
    and the GPU backend's division is not correctly rounded (1-ulp differences measured on the
    H200), which moves E4M3 / E2M1 ties. So the float quotient is only an estimate of the 24-bit
    significand quotient Q; the exact remainder R = Ma * 2^23 - Q * Mb is computed in wrapping
    uint32 arithmetic (it fits in int32 whenever the estimate is within a few units), Q is
    corrected until 0 <= R < Mb, and rounded to nearest even from R. No loops: it fuses into
    its consumers. Operands and results below 2**-126 flush to 0 (as XLA does); results above
    the float32 range become inf.
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    u32 = jnp.uint32
    abits = jax.lax.bitcast_convert_type(a, u32)
    bbits = jax.lax.bitcast_convert_type(b, u32)
    ea = ((abits >> 23) & 0xFF).astype(jnp.int32)
    eb = ((bbits >> 23) & 0xFF).astype(jnp.int32)
    ma = (abits & u32(0x7FFFFF)) | u32(0x800000)  # [2^23, 2^24)
    mb = (bbits & u32(0x7FFFFF)) | u32(0x800000)
    # Ma / Mb in [1, 2): double Ma when it is the smaller significand.
    q, rem, mbi, exp = _significand_quotient(ma, mb, ea, eb)
    up = (2 * rem > mbi) | ((2 * rem == mbi) & ((q & 1) == 1))
    q = q + up.astype(u32)
    carry = q >= u32(1 << 24)
    q = jnp.where(carry, q >> 1, q)
    exp = exp + carry.astype(jnp.int32)
    bits = (jnp.clip(exp, 0, 255).astype(u32) << 23) | (q & u32(0x7FFFFF))
    bits = jnp.where(exp >= 255, u32(0x7F800000), bits)
    bits = jnp.where((exp <= 0) | (ea == 0), u32(0), bits)  # underflow, a zero or subnormal
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


# E4M3 byte -> float32, read by table: XLA drops a float32 -> float8 -> float32 convert pair
# under jit (excess precision), which would leave activation block scales unrounded.
_E4M3_TABLE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
_E4M3_TABLE[np.isnan(_E4M3_TABLE)] = 0.0  # 0x7F / 0xFF (NaN) never occur as scales


def e4m3_to_f32(s: jax.Array) -> jax.Array:
    """Exact float32 values of float8_e4m3fn scales, by table lookup on their bytes."""
    idx = jax.lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.int32)
    return jnp.asarray(_E4M3_TABLE)[idx]


# ----------------------------------------------------------------------------- quantizers


def quantize_weight(w: Any) -> Nvfp4Tensor:
    """Quantizes a weight matrix to NVFP4 exactly as ModelOpt's `NVFP4QTensor.quantize`.

    Mirrors ModelOpt op for op, with IEEE float32 rounding at every step:
    global = amax(|w|) / 2688; block scale = E4M3(clamp(amax_blk / (6 * global), 2**-9, 448)),
    1.0 for an all-zero block; code = E2M1_rn_sat(w / (float(scale) * global)); the sign bit is
    set for scaled values < 0 (so -0.0 gives code 0).
    An all-zero matrix (where ModelOpt produces NaN) gives codes 0, scales 1.0, global 0.0.
    Runs jitted on the default device (the GPU when there is one); its bytes equal the numpy
    reference `_quantize_weight_numpy`, subnormal inputs and quotients included.

    Args:
        w: [N, K] bfloat16 / float16 / float32 (numpy or jax array), finite, K % 16 == 0.

    Returns:
        Nvfp4Tensor with shape (N, K) and a scalar global scale.
    """
    _check_matrix("w", w)
    n, k = np.shape(w)
    w = jnp.asarray(w)
    block_amax, amax_bits = _weight_block_amax(w)
    amax_bits = np.asarray(amax_bits, np.uint32)  # the one value read back to the host
    if amax_bits >= _F32_INF_BITS:
        _check_finite("w", w)  # raises, naming the first non-finite value
    # The scalar steps run in numpy float32 on the host, exactly as in the reference.
    amax = amax_bits.view(np.float32)[()]
    global_scale = amax / np.float32(E2M1_MAX * E4M3_MAX)
    if amax == 0:
        return _zero_weight(n, k)
    if global_scale == 0:
        raise ValueError(f"w amax {amax!r} is too small: amax / 2688 underflows float32 to 0")
    scale_denom = np.float32(E2M1_MAX) * global_scale
    # Every possible code denominator float(scale) * global, one per E4M3 byte.
    code_denoms = _E4M3_TABLE * global_scale
    packed, scales = _quantize_weight_arrays(
        w, block_amax, scale_denom.view(np.uint32), code_denoms.view(np.uint32)
    )
    return Nvfp4Tensor(
        packed=packed,
        scales=scales,
        global_scale=jnp.asarray(global_scale, jnp.float32),
        shape=(n, k),
    )


def _zero_weight(n: int, k: int) -> Nvfp4Tensor:
    return Nvfp4Tensor(
        packed=jnp.zeros((n, k // 2), jnp.uint8),
        scales=jnp.ones((n, k // BLOCK), jnp.float8_e4m3fn),
        global_scale=jnp.zeros((), jnp.float32),
        shape=(n, k),
    )


def _quantize_weight_numpy(w: Any) -> Nvfp4Tensor:
    """The reference for `quantize_weight`: the same recipe in numpy float32 on the host."""
    _check_matrix("w", w)
    _check_finite("w", w)
    n, k = np.shape(w)
    x = np.asarray(w).astype(np.float32)
    amax = np.float32(np.max(np.abs(x)))
    global_scale = amax / np.float32(E2M1_MAX * E4M3_MAX)
    if amax == 0:
        return _zero_weight(n, k)
    if global_scale == 0:
        raise ValueError(f"w amax {amax!r} is too small: amax / 2688 underflows float32 to 0")
    blocks = x.reshape(n, k // BLOCK, BLOCK)
    block_amax = np.max(np.abs(blocks), axis=-1)  # [N, K/16]
    scale = block_amax / (np.float32(E2M1_MAX) * global_scale)
    scale[scale == 0] = np.float32(1.0)
    scale = np.clip(scale, np.float32(_WEIGHT_MIN_BLOCK_SCALE), np.float32(E4M3_MAX))
    scale_e4m3 = scale.astype(ml_dtypes.float8_e4m3fn)
    denom = scale_e4m3.astype(np.float32) * global_scale  # [N, K/16]
    with np.errstate(divide="ignore", invalid="ignore"):  # denom underflows to 0 for a tiny
        scaled = (blocks / denom[..., None]).reshape(n, k)  # global: +-inf (code +-6) or NaN (0)
    codes = _e2m1_magnitude(np.abs(scaled), np) | ((scaled < 0).astype(np.uint8) << 3)
    return Nvfp4Tensor(
        packed=jnp.asarray(_pack_np(codes)),
        scales=jnp.asarray(scale_e4m3),
        global_scale=jnp.asarray(global_scale, jnp.float32),
        shape=(n, k),
    )


# The jitted weight quantizer works on float32 bit patterns in integer arithmetic, so that no
# float op can flush a subnormal (XLA does, on CPU and GPU) or round differently from numpy.
_F32_INF_BITS = 0x7F800000
_E4M3_ONE_BYTE = 0x38  # 1.0: ModelOpt's scale for an all-zero block
# uint32 bits of the E2M1 rounding thresholds (scaled > t for the ties that round down, >= t for
# those that round up), compared with the bits of non-negative quotients.
_DOWN_TIE_BITS = tuple(int(np.float32(t).view(np.uint32)) for t in _ROUND_DOWN_TIES)
_UP_TIE_BITS = tuple(int(np.float32(t).view(np.uint32)) for t in _ROUND_UP_TIES)
_F16_TO_F32_BITS = np.arange(1 << 15, dtype=np.uint16).view(np.float16).astype(np.float32)
_F16_TO_F32_BITS = _F16_TO_F32_BITS.view(np.uint32)  # float16 bits 0..0x7FFF -> float32 bits


def _abs_and_sign_bits(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Bits of |w| in w's own width (uint16 for bf16 / f16, uint32 for f32) and w's sign bit.

    Non-negative floats order like their bits, so maxima can be taken on these directly.
    """
    bits = jax.lax.bitcast_convert_type(w, jnp.uint32 if w.dtype == jnp.float32 else jnp.uint16)
    sign = bits.dtype.type(1 << (8 * bits.dtype.itemsize - 1))
    return bits & (sign - 1), bits >= sign


def _f32_bits(abs_bits: jax.Array, dtype: Any) -> jax.Array:
    """Exact float32 bits (uint32) of `_abs_and_sign_bits` magnitudes, without a float convert."""
    if dtype == jnp.bfloat16:
        return abs_bits.astype(jnp.uint32) << 16
    if dtype == jnp.float16:
        return jnp.asarray(_F16_TO_F32_BITS)[abs_bits.astype(jnp.int32)]
    return abs_bits


# Jitted (here and below): a one-off offline computation, compiled once per weight shape and run
# on the default device instead of op by op.
@jax.jit
def _weight_block_amax(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Bits of amax(|w|) per block [N, K/16] and over all of w []; uint32.

    Non-negative floats order like their bits; a non-finite value gives bits >= _F32_INF_BITS.
    """
    n, k = w.shape
    mag, _ = _abs_and_sign_bits(w.reshape(n, k // BLOCK, BLOCK))
    block_amax = _f32_bits(jnp.max(mag, axis=-1), w.dtype)  # the max before widening: cheaper
    return block_amax, jnp.max(block_amax)


def _unpack_f32_bits(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Bits of a finite float32 > 0 -> (significand in [2^23, 2^24), e): value sig * 2^(e - 150).

    Subnormals are normalized (their e goes below 1)."""
    field = (bits >> 23).astype(jnp.int32)
    sig = jnp.where(field > 0, (bits & jnp.uint32(0x7FFFFF)) | jnp.uint32(0x800000), bits)
    shift = jax.lax.clz(sig).astype(jnp.int32) - 8  # 0 for normals
    return sig << shift.astype(jnp.uint32), jnp.maximum(field, 1) - shift


def _div_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE float32 a / b (round to nearest even) on bit patterns, as numpy divides.

    a, b: uint32 bits of finite floats, a >= 0, b >= 0 (0 / b = 0, a / 0 = inf for a > 0).
    Unlike `_div_rn`, subnormal operands and quotients are exact: both significands are
    normalized, the 24-bit significand quotient Q and remainder R come from the same corrected
    float estimate, and a subnormal quotient rounds Q with R as sticky bit. Overflow gives inf.
    """
    a, b = jnp.broadcast_arrays(a, b)
    u32 = jnp.uint32
    ma, ea = _unpack_f32_bits(a)
    mb, eb = _unpack_f32_bits(jnp.where(b == 0, u32(0x3F800000), b))
    q, rem, mbi, exp = _significand_quotient(ma, mb, ea, eb)
    # Q in [2^23, 2^24), 0 <= R < Mb. One more quotient bit, then drop 1 bit for a normal
    # quotient and 2 - exp bits for a subnormal one (26 drop everything: the result is 0).
    guard = 2 * rem >= mbi
    sticky = (2 * rem - jnp.where(guard, mbi, 0)) != 0
    q2 = (q << 1) | guard.astype(u32)  # < 2^25
    drop = jnp.clip(2 - exp, 1, 26).astype(u32)
    kept = q2 >> drop
    dropped = q2 & ((u32(1) << drop) - 1)
    half = u32(1) << (drop - 1)
    up = (dropped > half) | ((dropped == half) & (sticky | ((kept & 1) == 1)))
    kept = kept + up.astype(u32)
    # A carry out of the significand moves into the exponent field on its own.
    bits = ((jnp.clip(exp, 1, 255) - 1).astype(u32) << 23) + kept
    bits = jnp.minimum(bits, u32(_F32_INF_BITS))
    bits = jnp.where(b == 0, u32(_F32_INF_BITS), bits)
    return jnp.where(a == 0, u32(0), bits)


def _e4m3_weight_scale(q: jax.Array) -> jax.Array:
    """ModelOpt's E4M3 block scale bytes (uint8) from the bits q of amax_blk / (6 * global):
    1.0 where q == 0, else round-to-nearest-even of clamp(q, 2**-9, 448)."""
    lo, hi = (int(np.float32(v).view(np.uint32)) for v in (_WEIGHT_MIN_BLOCK_SCALE, E4M3_MAX))
    qc = jnp.clip(q, jnp.uint32(lo), jnp.uint32(hi))
    e = (qc >> 23).astype(jnp.int32) - 127  # [-9, 8]
    sig = (qc & jnp.uint32(0x7FFFFF)) | jnp.uint32(0x800000)
    # Keep 3 fraction bits; below 2**-6 (E4M3 subnormals) keep multiples of 2**-9.
    drop = (20 + jnp.maximum(-6 - e, 0)).astype(jnp.uint32)
    kept = sig >> drop
    dropped = sig & ((jnp.uint32(1) << drop) - 1)
    half = jnp.uint32(1) << (drop - 1)
    up = (dropped > half) | ((dropped == half) & ((kept & 1) == 1))
    kept = (kept + up.astype(jnp.uint32)).astype(jnp.int32)
    # Normal: byte = (e + 7) << 3 | (kept - 8), a carry (kept = 16) bumping the exponent;
    # subnormal: byte = kept (kept = 8 is the smallest normal, byte 8).
    byte = 8 * jnp.maximum(e + 6, 0) + kept
    return jnp.where(q == 0, _E4M3_ONE_BYTE, byte).astype(jnp.uint8)


@jax.jit
def _quantize_weight_arrays(w, block_amax, scale_denom_bits, code_denom_bits):
    n, k = w.shape
    mag, negative = _abs_and_sign_bits(w.reshape(n, k // BLOCK, BLOCK))  # [N, K/16, 16]
    mag = _f32_bits(mag, w.dtype)
    scale_bytes = _e4m3_weight_scale(_div_bits(block_amax, scale_denom_bits))
    denom = code_denom_bits[scale_bytes.astype(jnp.int32)]  # [N, K/16]
    scaled = _div_bits(mag, denom[..., None])  # |w| / denom, [N, K/16, 16]
    code = sum((scaled > jnp.uint32(t)).astype(jnp.uint8) for t in _DOWN_TIE_BITS)
    code = code + sum((scaled >= jnp.uint32(t)).astype(jnp.uint8) for t in _UP_TIE_BITS)
    negative = negative & (scaled != 0)  # scaled < 0: -0.0 and underflows to -0.0 are not
    code = (code | (negative.astype(jnp.uint8) << 3)).reshape(n, k // 2, 2)
    # Packed as a sum over the pair axis: on CPU ~6x faster than code[..., 0] | code[..., 1] << 4,
    # whose strided reads keep XLA from vectorizing the division above.
    packed = jnp.sum(code << jnp.array([0, 4], jnp.uint8), axis=-1, dtype=jnp.uint8)
    return packed, jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn)


def _input_precision(x: jax.Array) -> jax.Array:
    """x as float32, holding exactly x's bf16 / f16 values.

    Under jit, XLA may skip the rounding of a float32 value cast to bf16 and back (excess
    precision), so the quantizer would see float32 activations; reduce_precision pins them to
    the dtype the caller asked for.
    """
    xf = x.astype(jnp.float32)
    if x.dtype == jnp.bfloat16:
        return jax.lax.reduce_precision(xf, exponent_bits=8, mantissa_bits=7)
    if x.dtype == jnp.float16:
        return jax.lax.reduce_precision(xf, exponent_bits=5, mantissa_bits=10)
    return xf


def dynamic_global_scale(x: jax.Array) -> jax.Array:
    """Per-row dynamic activation global scale amax(|x_row|) / (6 * 448); 1.0 for zero rows.

    Args:
        x: [M, K] float.

    Returns:
        float32 [M].
    """
    return global_scale_from_amax(activation_amax(x))


def activation_amax(x: jax.Array) -> jax.Array:
    """amax(|x_row|) at x's own precision (bf16 / f16 values exactly): float32 [M] of [M, K].

    A row split over devices (a tensor-parallel row-parallel linear) takes the max of these
    over the devices before `global_scale_from_amax`, so every device quantizes its slice with
    the scale of the whole row.
    """
    return jnp.max(jnp.abs(_input_precision(jnp.asarray(x))), axis=-1)


def global_scale_from_amax(amax: jax.Array) -> jax.Array:
    """The dynamic global scale amax / (6 * 448) of rows with this amax; 1.0 where it is 0."""
    scale = _div_rn(amax, E2M1_MAX * E4M3_MAX)
    return jnp.where(scale > 0, scale, jnp.float32(1.0))


def quantize_activation(
    x: jax.Array, input_scale: Any = None, *, min_block_scale: float = 0.0
) -> Nvfp4Tensor:
    """Quantizes activations to NVFP4 (static or per-row global scale, dynamic block scales).

    Per row m and block j (TensorRT-LLM / vLLM recipe, torchao's division order):
      SF = E4M3_satfinite(max(amax_blk / 6 / g, min_block_scale));
      out_scale = (1 / g) / float(SF), or 0 when SF == 0;
      code = E2M1_rn_sat(x * out_scale), sign bit from x's sign bit (-0.0 -> code 8).
    Jittable; validation of values happens only for concrete (non-traced) inputs.

    Args:
        x: [M, K] bfloat16 / float16 / float32, K % 16 == 0.
        input_scale: float32 scalar g > 0 (calibrated amax / (6 * 448)), or float32 [M] (one
            given scale per row: the dynamic scale of rows split over devices); None -> per-row
            dynamic g = amax(|x_row|) / (6 * 448) (1.0 for an all-zero row).
        min_block_scale: lower clamp on the block scale before the E4M3 cast; 0 follows the
            TensorRT-LLM / vLLM kernels, `TORCHAO_MIN_BLOCK_SCALE` reproduces torchao.

    Returns:
        Nvfp4Tensor of shape (M, K); global_scale [] for a static scale, [M] when dynamic or
        given per row.
    """
    _check_matrix("x", x)
    _check_finite("x", x)
    if not (np.isfinite(min_block_scale) and 0.0 <= min_block_scale <= E4M3_MAX):
        raise ValueError(f"min_block_scale must be in [0, 448], got {min_block_scale}")
    if input_scale is not None:
        input_scale = _check_input_scale(input_scale, rows=np.shape(x)[0])
    return _quantize_activation_arrays(jnp.asarray(x), input_scale, float(min_block_scale))


# Jitted so that eager calls (tests, debugging) compile once per shape instead of once per op;
# inside an outer jit it is inlined like any other traced function.
@functools.partial(jax.jit, static_argnames="min_block_scale")
def _quantize_activation_arrays(x, input_scale, min_block_scale):
    m, k = x.shape
    xf = _input_precision(x).reshape(m, k // BLOCK, BLOCK)  # [M, K/16, 16]
    block_amax = jnp.max(jnp.abs(xf), axis=-1)  # [M, K/16]
    if input_scale is None:
        global_scale = dynamic_global_scale(x)  # [M]
        g = global_scale[:, None]
    else:
        global_scale = input_scale
        g = input_scale if input_scale.ndim == 0 else input_scale[:, None]  # [] or [M, 1]
    sf = _div_rn(_div_rn(block_amax, E2M1_MAX), g)  # IEEE divisions, in torchao's order
    sf = jnp.clip(sf, jnp.float32(min_block_scale), jnp.float32(E4M3_MAX))
    sf_e4m3 = sf.astype(jnp.float8_e4m3fn)
    sf32 = e4m3_to_f32(sf_e4m3)
    nonzero = sf32 > 0
    out_scale = _div_rn(_div_rn(1.0, g), jnp.where(nonzero, sf32, 1.0))
    out_scale = jnp.where(nonzero, out_scale, 0.0)
    scaled = jnp.clip(xf * out_scale[..., None], -E2M1_MAX, E2M1_MAX)
    codes = e2m1_round(scaled).reshape(m, k)
    return Nvfp4Tensor(
        packed=pack_e2m1(codes),
        scales=sf_e4m3,
        global_scale=global_scale,
        shape=(m, k),
    )


def _check_tensor(name: str, t: Any, *, stacked: bool = False) -> None:
    if not isinstance(t, Nvfp4Tensor):
        raise ValueError(f"{name} must be an Nvfp4Tensor, got {type(t).__name__}")  # noqa: TRY004
    rows, k = t.shape
    stack = t.stack if stacked else ()
    expect = {
        "packed": ((*stack, rows, k // 2), np.uint8),
        "scales": ((*stack, rows, k // BLOCK), np.dtype(jnp.float8_e4m3fn)),
    }
    for field, (shape, dtype) in expect.items():
        a = getattr(t, field)
        if tuple(a.shape) != shape or np.dtype(a.dtype) != np.dtype(dtype):
            raise ValueError(
                f"{name}.{field} has shape {tuple(a.shape)} dtype {a.dtype}; expected {shape} "
                f"{np.dtype(dtype)} for logical shape {t.shape}"
            )
    if tuple(t.global_scale.shape) not in (stack, (*stack, rows)):
        raise ValueError(
            f"{name}.global_scale shape {tuple(t.global_scale.shape)}, expected {stack} or "
            f"{(*stack, rows)}"
        )


def take(t: Nvfp4Tensor, i: Any) -> Nvfp4Tensor:
    """Matrix i of a stacked Nvfp4Tensor (i may be traced: a dynamic index, no copy of the rest).

    Args:
        t: Nvfp4Tensor with at least one stack dim.
        i: int or int32 [] index into the first stack dim.

    Returns:
        Nvfp4Tensor with one stack dim fewer.
    """
    if not t.stack:
        raise ValueError(f"take() needs a stacked Nvfp4Tensor, got packed {t.packed.shape}")

    def one(a):
        return jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False)

    return Nvfp4Tensor(
        packed=one(t.packed), scales=one(t.scales), global_scale=one(t.global_scale), shape=t.shape
    )


def stack(tensors: list[Nvfp4Tensor]) -> Nvfp4Tensor:
    """Stacks equal-shaped Nvfp4Tensors along a new leading dim (a decoder's layers).

    Global scales must all be per matrix or all per row.
    """
    if not tensors:
        raise ValueError("stack() needs at least one Nvfp4Tensor")
    first = tensors[0]
    for i, t in enumerate(tensors):
        _check_tensor(f"tensors[{i}]", t, stacked=True)
        if t.shape != first.shape or t.stack != first.stack or t.per_row != first.per_row:
            raise ValueError(
                f"tensors[{i}] has shape {t.shape} stack {t.stack} per_row={t.per_row}; "
                f"tensors[0] has {first.shape} {first.stack} per_row={first.per_row}"
            )

    def cat(field):
        return jnp.stack([jnp.asarray(getattr(t, field)) for t in tensors])

    return Nvfp4Tensor(
        packed=cat("packed"),
        scales=cat("scales"),
        global_scale=cat("global_scale"),
        shape=first.shape,
    )


def concat_rows(tensors: list[Nvfp4Tensor]) -> Nvfp4Tensor:
    """Concatenates the rows of NVFP4 matrices (fused q/k/v or gate/up shards), bytes unchanged.

    Each shard keeps its own global scale exactly: when they all equal the first shard's, the
    result has that one scale; otherwise one scale per row (each row holding its shard's). No
    value is re-quantized.

    Args:
        tensors: Nvfp4Tensors of shapes (rows_i, K), unstacked, equal K.

    Returns:
        Nvfp4Tensor (sum rows_i, K).
    """
    if not tensors:
        raise ValueError("concat_rows() needs at least one Nvfp4Tensor")
    k = tensors[0].k
    for i, t in enumerate(tensors):
        _check_tensor(f"tensors[{i}]", t)
        if t.k != k:
            raise ValueError(f"tensors[{i}].shape={t.shape}: K differs from {tensors[0].shape}")
    rows = sum(t.rows for t in tensors)
    scalars = [np.asarray(t.global_scale, np.float32) for t in tensors]
    if all(g.ndim == 0 for g in scalars) and all(g == scalars[0] for g in scalars):
        global_scale = jnp.asarray(scalars[0])
    else:
        global_scale = jnp.concatenate(
            [
                jnp.broadcast_to(jnp.asarray(g, jnp.float32), (t.rows,))
                for g, t in zip(scalars, tensors)
            ]
        )
    return Nvfp4Tensor(
        packed=jnp.concatenate([jnp.asarray(t.packed) for t in tensors]),
        scales=jnp.concatenate([jnp.asarray(t.scales) for t in tensors]),
        global_scale=global_scale,
        shape=(rows, k),
    )


def split_rows(t: Nvfp4Tensor, sizes: tuple[int, ...]) -> list[Nvfp4Tensor]:
    """Inverse of `concat_rows`: shards of `sizes` rows; a per-row scale that is constant over a
    shard becomes that shard's scalar scale again (so a fused checkpoint round-trips exactly)."""
    _check_tensor("t", t)
    if sum(sizes) != t.rows:
        raise ValueError(f"sizes {sizes} do not add up to the {t.rows} rows of {t.shape}")
    out, start = [], 0
    gs = np.asarray(t.global_scale, np.float32)
    for n in sizes:
        g = gs if gs.ndim == 0 else gs[start : start + n]
        if g.ndim == 1 and np.all(g == g[0]):
            g = g[0]
        out.append(
            Nvfp4Tensor(
                packed=t.packed[start : start + n],
                scales=t.scales[start : start + n],
                global_scale=jnp.asarray(g, jnp.float32),
                shape=(n, t.k),
            )
        )
        start += n
    return out


def _block_values(t: Nvfp4Tensor) -> jax.Array:
    """E2M1 values as float32 [rows, K/16, 16]."""
    codes = unpack_e2m1(t.packed)
    return jnp.asarray(E2M1_VALUES)[codes].reshape(t.rows, t.k // BLOCK, BLOCK)


def _row_global(t: Nvfp4Tensor) -> jax.Array:
    """Global scale broadcastable over rows: [] or [rows, 1]."""
    g = t.global_scale.astype(jnp.float32)
    return g[:, None] if g.ndim == 1 else g


def _col_global(w: Nvfp4Tensor) -> jax.Array:
    """A weight's global scale broadcastable over output columns [M, N]: [] or [1, N]."""
    g = w.global_scale.astype(jnp.float32)
    return g[None, :] if g.ndim == 1 else g


def dequantize(t: Nvfp4Tensor) -> jax.Array:
    """Dequantizes an NVFP4 tensor: e2m1(code) * (float(scale) * global_scale).

    Args:
        t: Nvfp4Tensor of shape (rows, K).

    Returns:
        float32 [rows, K].
    """
    _check_tensor("t", t)
    return _dequantize_arrays(t)


@jax.jit
def _dequantize_arrays(t: Nvfp4Tensor) -> jax.Array:
    block_scale = e4m3_to_f32(t.scales) * _row_global(t)  # [rows, K/16]
    return (_block_values(t) * block_scale[..., None]).reshape(t.rows, t.k)


# ----------------------------------------------------------------------------- matmul


def _blockwise_accumulate(
    xv: jax.Array, wv: jax.Array, sw: jax.Array, sx: jax.Array | None, budget: int
) -> jax.Array:
    """sum_j (sw[n, j] * sx[m, j]) * P[m, n, j] in float32, added in block order j = 0, 1, ...

    xv: f32 [M, J, 16]; wv: f32 [N, J, 16]; sw: f32 [N, J]; sx: f32 [M, J] or None (no x scale).
    P[m, n, j] is the 16-element dot of block j. Chunks of G blocks are materialized as
    [G, M, N] per scan step, so memory stays bounded for large M; the float32 additions are the
    same ((t_0 + t_1) + t_2) + ... for any G. Returns f32 [M, N].
    """
    m, j, _ = xv.shape
    n = wv.shape[0]
    g = max(1, min(j, budget // max(1, m * n)))
    chunks = -(-j // g)
    pad = chunks * g - j
    # Zero blocks add exactly 0, so padding the block axis does not change the result.
    xv = jnp.pad(xv, ((0, 0), (0, pad), (0, 0))).reshape(m, chunks, g, BLOCK)
    wv = jnp.pad(wv, ((0, 0), (0, pad), (0, 0))).reshape(n, chunks, g, BLOCK)
    sw = jnp.pad(sw, ((0, 0), (0, pad))).reshape(n, chunks, g)
    if sx is not None:
        sx = jnp.pad(sx, ((0, 0), (0, pad))).reshape(m, chunks, g)

    def body(acc, c):
        xc = jax.lax.dynamic_index_in_dim(xv, c, axis=1, keepdims=False)  # [M, G, 16]
        wc = jax.lax.dynamic_index_in_dim(wv, c, axis=1, keepdims=False)  # [N, G, 16]
        partials = jnp.einsum("mgk,ngk->gmn", xc, wc, precision=jax.lax.Precision.HIGHEST)
        scale = jax.lax.dynamic_index_in_dim(sw, c, axis=1, keepdims=False).T[:, None, :]
        if sx is not None:  # SFw * SFx is exact in float32 (two 4-bit significands)
            sxc = jax.lax.dynamic_index_in_dim(sx, c, axis=1, keepdims=False)  # [M, G]
            scale = scale * sxc.T[:, :, None]
        terms = partials * scale  # [G, M, N]
        for i in range(g):
            acc = acc + terms[i]
        return acc, None

    acc, _ = jax.lax.scan(body, jnp.zeros((m, n), jnp.float32), jnp.arange(chunks))
    return acc


def _scaled_values(t: Nvfp4Tensor) -> jax.Array:
    """e2m1(code) * float(scale) as float32 [rows, K]; exact (a 2-bit times a 4-bit significand)."""
    return (_block_values(t) * e4m3_to_f32(t.scales)[..., None]).reshape(t.rows, t.k)


def _exact_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 a @ b.T where a's and b's values are exact in a's dtype; float32 accumulation.

    Pre-scaled NVFP4 values e2m1 * SF have at most 6 significant bits, so they are exact in
    bfloat16 and every bf16 x bf16 product is exact in float32: the dot runs on bf16 operands
    (tensor cores on a GPU) and only the float32 summation order is XLA's. float32 operands
    (a float32 x in W4A16) use a float32 dot at HIGHEST precision.
    """
    if a.dtype == jnp.bfloat16:
        return jnp.dot(a, b.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32)
    return jnp.dot(a, b.T, precision=jax.lax.Precision.HIGHEST)


def _check_order(order: str, m: int) -> bool:
    if order not in ("auto", "blocks", "dot"):
        raise ValueError(f"order={order!r}, expected 'auto', 'blocks' or 'dot'")
    return order == "blocks" or (order == "auto" and m <= SEQUENTIAL_MAX_M)


def nvfp4_matmul_q(xq: Nvfp4Tensor, w: Nvfp4Tensor, *, order: str = "auto") -> jax.Array:
    """W4A4 product of already-quantized activations and weights, as the kernel computes it.

    y[m, n] = alpha * sum_j (SFw[n, j] * SFx[m, j]) * P[m, n, j], P the 16-element block dot of
    E2M1 values; every product, block sum and scaled block sum is exact in float32, so the only
    roundings are the float32 sum across blocks, the product with alpha = global_w * global_x
    (per row for a dynamic x) and the final bf16 cast.

    Args:
        xq: Nvfp4Tensor (M, K).
        w: Nvfp4Tensor (N, K); global scale [] or per row [N].
        order: "blocks" adds the scaled block sums in block order j = 0, 1, ... (a scan; memory
            bounded by chunks of blocks); "dot" is one float32 dot of the exactly pre-scaled
            values e2m1 * SF, so only the cross-block summation order differs (XLA's); "auto"
            uses "blocks" for M <= SEQUENTIAL_MAX_M, else "dot".

    Returns:
        bfloat16 [M, N].
    """
    _check_tensor("xq", xq)
    _check_tensor("w", w)
    if xq.k != w.k:
        raise ValueError(f"K mismatch: xq.shape={xq.shape}, w.shape={w.shape}")
    return _matmul_q_arrays(xq, w, _check_order(order, xq.rows), _PARTIALS_BUDGET)


def nvfp4_matmul_prescaled(
    xv: jax.Array, xg: jax.Array, w: Nvfp4Tensor, *, order: str = "auto"
) -> jax.Array:
    """`nvfp4_matmul_q` from the activations' pre-scaled values instead of their codes: xv =
    e2m1(code) * SFx [M, K] (exact in float16, bfloat16 or float32; what the GEMM's x_hat
    operand holds) and the global scale per row xg f32 [M]. The result is bit for bit
    `nvfp4_matmul_q` of the tensor those values came from: in block order each block's
    sum_k xv * e2m1(w) is SFx * P exactly (a common scale, at most 12 significant bits), and
    times SFw it is the (SFw * SFx) * P that `nvfp4_matmul_q` adds; in dot order the operands are
    the same values.

    Returns:
        bfloat16 [M, N].
    """
    _check_tensor("w", w)
    m, k = xv.shape
    if k != w.k or tuple(xg.shape) != (m,):
        raise ValueError(f"xv {xv.shape}, xg {xg.shape} for w.shape={w.shape}")
    sequential = _check_order(order, m)
    return _matmul_prescaled_arrays(xv.astype(jnp.float32), xg, w, sequential, _PARTIALS_BUDGET)


# The array parts below are jitted so eager calls compile once per shape, not once per op.
@functools.partial(jax.jit, static_argnames=("sequential", "budget"))
def _matmul_prescaled_arrays(xv, xg, w: Nvfp4Tensor, sequential: bool, budget: int):
    m, k = xv.shape
    if sequential:
        sw = e4m3_to_f32(w.scales)  # [N, J]
        blocks = xv.reshape(m, k // BLOCK, BLOCK)
        acc = _blockwise_accumulate(blocks, _block_values(w), sw, None, budget)
    else:
        acc = _exact_dot(xv.astype(jnp.bfloat16), _scaled_values(w))
    alpha = _col_global(w) * xg.astype(jnp.float32)[:, None]
    return (acc * alpha).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("sequential", "budget"))
def _matmul_q_arrays(xq: Nvfp4Tensor, w: Nvfp4Tensor, sequential: bool, budget: int):
    if not sequential:
        return matmul_q_values(xq, scaled_values_bf16(w), w.global_scale)
    sx = e4m3_to_f32(xq.scales)  # [M, J]
    sw = e4m3_to_f32(w.scales)  # [N, J]
    acc = _blockwise_accumulate(_block_values(xq), _block_values(w), sw, sx, budget)
    alpha = _col_global(w) * _row_global(xq)
    return (acc * alpha).astype(jnp.bfloat16)


def matmul_q_values(
    xq: Nvfp4Tensor, w_values: jax.Array, w_global: jax.Array, *, x_barrier: bool = False
) -> jax.Array:
    """`nvfp4_matmul_q(xq, w, order="dot")` from w's exactly pre-scaled values: `w_values` bf16
    [N, K] = e2m1 * SFw (exact in bf16; e.g. the dequantizer kernel's), `w_global` its global
    scale [] or [N]. The order "dot" of `nvfp4_matmul_q` is this function on
    `scaled_values_bf16(w)`, so given the same values it gives the same bits. `x_barrier`: the
    activations' bf16 values pass an optimization barrier before the dot (the same values), so
    that XLA cannot fuse their decode into the GEMM's operand loads."""
    xv = _scaled_values(xq).astype(jnp.bfloat16)
    if x_barrier:
        xv = jax.lax.optimization_barrier(xv)
    return matmul_x_values(xv, _row_global(xq), w_values, w_global)


def matmul_x_values(
    x_values: jax.Array, x_global: jax.Array, w_values: jax.Array, w_global: jax.Array
) -> jax.Array:
    """`matmul_q_values` from the activations' exact bf16 values e2m1 * SFx [M, K] (e.g. the
    quantizer kernel's "xhat_bf16" form) and their global scale [] or [M] (or [M, 1]): the
    same operations, so the same bits."""
    return scale_x_values_sum(x_values_sum(x_values, w_values), x_global, w_global)


def x_values_sum(x_values: jax.Array, w_values: jax.Array) -> jax.Array:
    """`matmul_x_values`' float32 sum [M, N] of the exact bf16 values x [M, K] and w [N, K]
    (before the global scales): one bf16 dot with float32 accumulation."""
    return _exact_dot(x_values, w_values)


def scale_x_values_sum(acc: jax.Array, x_global: jax.Array, w_global: jax.Array) -> jax.Array:
    """`matmul_x_values` from its float32 sum `acc` [M, N]: bf16(acc * (w_global * x_global)),
    w_global [] or [N], x_global [] or [M] (or [M, 1])."""
    xg = jnp.asarray(x_global).astype(jnp.float32)
    xg = xg[:, None] if xg.ndim == 1 else xg
    g = jnp.asarray(w_global).astype(jnp.float32)
    alpha = (g[None, :] if g.ndim == 1 else g) * xg
    return (acc * alpha).astype(jnp.bfloat16)


def scaled_values_bf16(w: Nvfp4Tensor) -> jax.Array:
    """e2m1(code) * SF as bf16 [rows, K], exact: the values the dequantizer kernel writes."""
    return _scaled_values(w).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("sequential", "budget"))
def _matmul_w4a16_arrays(x: jax.Array, w: Nvfp4Tensor, sequential: bool, budget: int):
    m, k = x.shape
    xf = x.astype(jnp.float32)
    if sequential:
        xv = xf.reshape(m, k // BLOCK, BLOCK)
        sw = e4m3_to_f32(w.scales)
        acc = _blockwise_accumulate(xv, _block_values(w), sw, None, budget)
    else:
        # bf16 x and the (exact) bf16 weight values: products exact, float32 accumulation
        xd = x if x.dtype == jnp.bfloat16 else xf
        acc = _exact_dot(xd, _scaled_values(w))
    return (acc * _col_global(w)).astype(jnp.bfloat16)


def nvfp4_matmul(
    x: jax.Array,
    w: Nvfp4Tensor,
    *,
    act: str = "w4a4",
    input_scale: Any = None,
    order: str = "auto",
) -> jax.Array:
    """Reference NVFP4 linear y = x @ w.T with the kernel's numerics.

    W4A4: x is quantized by `quantize_activation(x, input_scale)` and multiplied by
    `nvfp4_matmul_q`. W4A16: per block, the float32 dot of x (upcast to float32) with the E2M1
    weight values, times SFw, float32 accumulation across blocks, times global_w, then bf16.

    Args:
        x: [M, K] bfloat16 / float16 / float32.
        w: Nvfp4Tensor (N, K); global scale [] or per row [N].
        act: "w4a4" or "w4a16".
        input_scale: static activation global scale (W4A4 only); None -> per-row dynamic.
        order: as in `nvfp4_matmul_q`; for W4A16 "dot" is one float32 dot of x with
            e2m1 * SFw (exact values), so the summation order within and across blocks is XLA's.

    Returns:
        bfloat16 [M, N].
    """
    if act not in _ACTS:
        raise ValueError(f"act={act!r}, expected one of {_ACTS}")
    _check_matrix("x", x)
    _check_tensor("w", w)
    if np.shape(x)[1] != w.k:
        raise ValueError(f"K mismatch: x.shape={tuple(np.shape(x))}, w.shape={w.shape}")
    sequential = _check_order(order, np.shape(x)[0])
    if act == "w4a4":
        return nvfp4_matmul_q(quantize_activation(x, input_scale), w, order=order)
    if input_scale is not None:
        raise ValueError("input_scale is only used with act='w4a4'; got one with act='w4a16'")
    _check_finite("x", x)
    return _matmul_w4a16_arrays(jnp.asarray(x), w, sequential, _PARTIALS_BUDGET)
