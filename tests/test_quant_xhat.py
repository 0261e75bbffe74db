"""The quantizer kernel's "xhat" form (cuda_ops/nvfp4_quant.py, -DXHAT_OUT=1 in nvfp4_gemv.cu),
checked on CPU: a NumPy model of what each thread of `nvfp4_quantize_bf16` writes (quant8's codes
and block scale through xhat8's byte permutes and fp16 multiply, stored at the kernel's index)
equals `rejax.ops.linear.gemm_x_operand` bit for bit; the kernel takes any number of rows; NVRTC
compiles both output forms for sm_90. The GPU runs of the kernel are in
tests/test_quant_kernel_gpu.py.

GEMM letters: M rows (tokens), K in features.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemv, nvfp4_quant
from rejax.ops import linear as kernels

# the kernel's byte tables and masks (nvfp4_gemv.cu, XHAT_OUT section)
TH_LO, TH_HI = 0x3E3C3800, 0x46444240
U32 = np.uint32


def _prmt(lo, hi, sel):
    """PTX prmt.b32 (default mode) on uint32 arrays: byte k of the result is byte (nibble k of
    sel) & 7 of {hi, lo}, or its msb replicated when the nibble's bit 3 is set."""
    lo, hi, sel = (np.asarray(a, np.uint64) for a in (lo, hi, sel))
    both = lo | (hi << np.uint64(32))
    out = np.zeros(np.broadcast(lo, hi, sel).shape, np.uint64)
    for k in range(4):
        nib = (sel >> np.uint64(4 * k)) & np.uint64(0xF)
        byte = (both >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        sign = (nib & np.uint64(8)) != 0
        byte = np.where(sign, np.where(byte & np.uint64(0x80), np.uint64(0xFF), 0), byte)
        out |= byte.astype(np.uint64) << np.uint64(8 * k)
    return out.astype(U32)


def _hmul2(a, b):
    """mul.rn.f16x2 on uint32 arrays of two fp16 halves."""
    out = np.zeros(np.broadcast(a, b).shape, U32)
    for shift in (0, 16):
        ha = ((a >> U32(shift)) & U32(0xFFFF)).astype(np.uint16).view(np.float16)
        hb = ((b >> U32(shift)) & U32(0xFFFF)).astype(np.uint16).view(np.float16)
        prod = (ha * hb).astype(np.float16).view(np.uint16).astype(U32)
        out |= prod << U32(shift)
    return out


def _e4m3x2_to_f16x2(v):
    """cvt.rn.f16x2.e4m3x2 of the low 16 bits of uint32 v: (low byte, high byte) -> f16x2."""
    out = np.zeros(np.shape(v), U32)
    for half in (0, 1):
        byte = ((v >> U32(8 * half)) & U32(0xFF)).astype(np.uint8)
        f16 = byte.view(ml_dtypes.float8_e4m3fn).astype(np.float16).view(np.uint16)
        out |= f16.astype(U32) << U32(16 * half)
    return out


def _xhat8(c, scale):
    """The kernel's xhat8 on uint32 arrays: 8 codes c (nibble j = element j) and the block's
    E4M3 byte -> 4 f16x2 words (e_i, e_{i+4}), [..., 4]."""
    mag = c & U32(0x77777777)
    lo = _prmt(TH_LO, TH_HI, mag)
    hi = _prmt(TH_LO, TH_HI, mag >> U32(16))
    sf2 = _e4m3x2_to_f16x2(scale * U32(0x101))
    sgn = c & U32(0x88888888)
    words = []
    for i in range(4):
        h = _prmt(lo, hi, U32((i << 4) | ((4 + i) << 12))) & U32(0xFF00FF00)
        words.append(_hmul2(h, sf2) | ((sgn << U32(12 - 4 * i)) & U32(0x80008000)))
    return np.stack(words, axis=-1)


def kernel_xhat(xp: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """What `nvfp4_quantize_bf16` built with XHAT_OUT writes for the codes xp uint8 [M, K/2] and
    scale bytes xs uint8 [M, K/16] that its quant8 computes: thread item i (elements e0 = 8i ..
    e0 + 7) stores xhat8's 16 bytes at 128c + 32u + 8t (e0 = 128c + 32t + 8u). float16 [M, K]."""
    m, k = xp.shape[0], 2 * xp.shape[1]
    codes = np.ascontiguousarray(xp).view("<u4")  # [M, K/8]: 8 codes per item, little-endian
    e0 = 8 * np.arange(k // 8)
    scale = xs[:, e0 // 16].astype(U32)
    runs = _xhat8(codes, scale)  # [M, K/8, 4] words
    at = (e0 & ~127) | (((e0 >> 3) & 3) << 5) | (((e0 >> 5) & 3) << 3)
    out = np.zeros((m, k // 2), U32)  # f16x2 words
    for w in range(4):
        out[:, at // 2 + w] = runs[..., w]
    return out.view(np.float16)


def _codes_and_scales(m, k, seed):
    """Random codes (every nibble value) and E4M3 scale bytes 0x00 .. 0x7E (zero, subnormal,
    the largest finite 448): every (code, scale) pair the quantizer can write, and a zero row
    and a row of zero blocks with signed codes."""
    rng = np.random.default_rng(seed)
    xp = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    xs = rng.integers(0, 0x7F, (m, k // 16), dtype=np.uint8)
    xs[:, :3] = [0x00, 0x01, 0x7E]
    xp[0], xs[0] = 0, 0  # an all-zero row
    xs[1 % m, 4:8] = 0  # zero blocks under nonzero codes: +0 / -0 by the code's sign
    xp[2 % m, :8] = 0x88  # -0 codes
    return xp, xs


@pytest.mark.parametrize("k", [256, 4096, 12288])
def test_kernel_xhat_model_equals_gemm_x_operand_bitwise(k):
    m = 9
    xp, xs = _codes_and_scales(m, k, k)
    got = kernel_xhat(xp, xs).view(np.uint16)
    want = np.asarray(kernels.gemm_x_operand(jnp.asarray(xp), jnp.asarray(xs)))
    assert want.dtype == np.float16
    np.testing.assert_array_equal(got, want.view(np.uint16))
    # the exact values, not only equal bits: e2m1 * SFx, -0 where the code is negative
    assert np.signbit(want[0]).sum() == 0 and (want[0] == 0).all()


def test_kernel_xhat_model_covers_every_code_and_scale():
    """Each of the 16 codes times each of the 127 finite non-negative E4M3 scales: the value
    e2m1(code) * SFx as gemm_x_operand gives it (the product is exact in fp16)."""
    codes = np.arange(16, dtype=np.uint8)
    # row r holds scale r in all of its blocks; each block holds codes 0..15
    xs = np.repeat(np.arange(0x7F, dtype=np.uint8)[:, None], 256 // 16, axis=1)
    block = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)  # 16 codes in 8 bytes
    xp = np.tile(block, (0x7F, 256 // 16))
    got = kernel_xhat(xp, xs).view(np.uint16)
    want = np.asarray(kernels.gemm_x_operand(jnp.asarray(xp), jnp.asarray(xs))).view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_quantizer_takes_any_number_of_rows():
    """check_shape: any M >= 1 (the GEMM's decode batches and prefill too), K a multiple of 256;
    the "xhat" form's default chunking: one quant8 round per thread."""
    for m in (1, 8, 9, 64, 256, 512, 4096):
        assert nvfp4_quant.check_shape(m, 4096) == (True, ""), m
    assert not nvfp4_quant.check_shape(0, 4096)[0]
    assert not nvfp4_quant.check_shape(64, 4096 + 128)[0]
    assert [nvfp4_quant.default_chunk(k, "xhat") for k in (4096, 12288, 2560, 2304)] == [
        1024,
        1024,
        512,
        256,
    ]
    assert [nvfp4_quant.default_threads(c, "xhat") for c in (1024, 512, 256)] == [128, 64, 32]
    assert nvfp4_quant.default_chunk(4096) == 512 and nvfp4_quant.default_threads(512) == 128
    # from ROW_CTA_MIN_M rows one CTA a row (no row's statistics recomputed per chunk); below
    # it the chunks above
    big = nvfp4_quant.ROW_CTA_MIN_M
    assert nvfp4_quant.default_chunk(12288, "xhat", big) == 12288
    assert nvfp4_quant.default_chunk(4096, "codes", 4096) == 4096
    assert nvfp4_quant.default_chunk(12288, "xhat", big - 1) == 1024
    assert nvfp4_quant.default_threads(12288, "xhat") == 128


def test_quantizer_build_takes_one_cta_a_row_from_row_cta_min_m(monkeypatch):
    """build() without a chunk: at 512 rows one CTA a row (grid [512, 1], 128 threads), at 64
    rows 1024-element chunks (grid [64, 12]); an explicit chunk still wins."""
    monkeypatch.setattr(
        nvfp4_quant,
        "compile_ptx",
        lambda *a, **kw: (
            ".visible .entry nvfp4_quantize_bf16(.param .u64 p0, .param .u64 p1, "
            ".param .u64 p2, .param .u64 p3, .param .u64 p4, .param .u64 p5)\n{ ret; }\n"
        ),
    )
    nvfp4_quant._build_cached.cache_clear()
    swiglu = nvfp4_gemv.Fused(prologue="swiglu")
    try:
        big = nvfp4_quant.build(512, 12288, swiglu, arch="compute_90", out="xhat")
        assert (big.chunk, big.threads) == (12288, 128)
        assert "grid_x = 512, grid_y = 1," in big.backend_config()
        small = nvfp4_quant.build(64, 12288, swiglu, arch="compute_90", out="xhat")
        assert small.chunk == 1024 and "grid_x = 64, grid_y = 12," in small.backend_config()
        forced = nvfp4_quant.build(512, 12288, swiglu, arch="compute_90", out="xhat", chunk=1024)
        assert forced.chunk == 1024
    finally:
        nvfp4_quant._build_cached.cache_clear()


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_build_refuses_bad_xhat_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(nvfp4_gemv.KernelError, match="out='fp8'"):
        nvfp4_quant.build(16, 4096, nvfp4_gemv.PLAIN, arch="compute_90", out="fp8")
    with pytest.raises(nvfp4_gemv.KernelError, match="chunk=128"):  # quant8: 256-element warps
        nvfp4_quant.build(16, 4096, nvfp4_gemv.PLAIN, arch="compute_90", chunk=128, out="xhat")
    with pytest.raises(nvfp4_gemv.KernelError, match="M=0"):
        nvfp4_quant.build(0, 4096, nvfp4_gemv.PLAIN, arch="compute_90", out="xhat")


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
@pytest.mark.parametrize("k", [4096, 12288])
def test_both_forms_compile_for_sm90(quant_defines, k):
    """NVRTC compiles `nvfp4_quantize_bf16` with XHAT_OUT on and off (every prologue, static and
    dynamic scales) to PTX whose entry takes 6 / 7 parameters, launched over [M, K / chunk] for
    M = 16, 64; ptxas builds it for sm_90 without spills; the "codes" form is built without the
    XHAT_OUT define (its PTX and cache keys are those of the GEMV's quantizer)."""
    seen = quant_defines
    source = cbuild.read_source(nvfp4_gemv.SOURCE)
    try:
        for prologue in nvfp4_gemv.PROLOGUES:
            for dynamic in (False, True):
                fused = nvfp4_gemv.Fused(prologue=prologue, dynamic=dynamic, norm_stacked=True)
                for out, params in (("codes", 7), ("xhat", 6)):
                    for m in (16, 64):
                        kern = nvfp4_quant.build(m, k, fused, arch="compute_90", out=out)
                        assert cbuild.ptx_entries(kern.ptx) == {nvfp4_quant.ENTRY: params}
                        cfg = kern.backend_config()
                        grid = f"grid_x = {m}, grid_y = {k // kern.chunk},"
                        assert grid in cfg and f"block_x = {kern.threads}," in cfg, cfg[-300:]
                    assert ("XHAT_OUT" in seen[-1]) == (out == "xhat"), seen[-1]
                    log = cbuild.ptxas_log(source, seen[-1], "sm_90", name=nvfp4_gemv.SOURCE)
                    assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
        xhat = nvfp4_quant.build(64, k, nvfp4_gemv.PLAIN, arch="compute_90", out="xhat")
        assert (xhat.chunk, xhat.threads, xhat.n_outputs) == (1024, 128, 2)
        assert "st.global.v4" in xhat.ptx  # x_hat leaves in 16-byte runs
    finally:
        nvfp4_quant._build_cached.cache_clear()


def kernel_xhat_tiles(xp: np.ndarray, xs: np.ndarray, tm: int, chunk: int = 256) -> np.ndarray:
    """What `nvfp4_quantize_bf16` built with XHAT_OUT = 2 writes: a CTA per 8-row group and
    `chunk`-element chunk; its thread item it (row m = it % 8, slot t = it / 8 % 4, half
    v = it / 32 % 2, stage c = it / 64 of the chunk) takes the 16-element block e0 = 128c +
    32t + 16v, whose pieces u = 2v, 2v + 1 give xhat8's words; word i of piece u goes to the
    image [stage][column 4u + i][row m][slot t]; the image is stored as 16-byte pieces j (row
    j % 8, column j / 8 % 16, stage j / 128) at the row's place in its tile. Rows past M are
    zeros. float16 [ceil(M / tm), K / 128, tm * 128]."""
    m, k = xp.shape[0], 2 * xp.shape[1]
    codes = np.ascontiguousarray(xp).view("<u4")
    e8 = 8 * np.arange(k // 8)
    runs = _xhat8(codes, xs[:, e8 // 16].astype(U32))  # [M, K/8, 4] words of piece e8 / 8
    rows = -(-m // tm) * tm
    out = np.zeros((rows // tm, k // 128, tm * 64), U32)  # f16x2 words, padding rows zero
    for row0 in range(0, rows, 8):
        for c0 in range(0, k // 128, chunk // 128):
            img = np.zeros((chunk // 128, 16, 8, 4), U32)
            for it in range(chunk // 2):
                mm, t, v, c = it % 8, it // 8 % 4, it // 32 % 2, it // 64
                if row0 + mm >= m:
                    continue
                e0 = (c0 + c) * 128 + 32 * t + 16 * v
                for h in range(2):
                    words = runs[row0 + mm, (e0 + 8 * h) // 8]
                    for i in range(4):
                        img[c, 4 * (2 * v + h) + i, mm, t] = words[i]
            flat = img.reshape(-1, 4)
            tile, base = row0 // tm, (row0 % tm) * 8 // 2  # in f16x2 words
            for j in range(chunk):
                mm, q, c = j % 8, j // 8 % 16, j // 128
                at = base + (q * tm * 8 + mm * 8) // 2
                out[tile, c0 + c, at : at + 4] = flat[j]
    return out.view(np.float16)


@pytest.mark.parametrize(
    ("m", "k", "tm", "chunk"), [(9, 256, 128, 256), (130, 512, 128, 256), (20, 512, 256, 512)]
)
def test_kernel_xhat_tiles_model_equals_the_wgmma_stage_tiles(m, k, tm, chunk):
    """The "xhat_tiles" form's NumPy model (xhat8's words, the shared-memory image, the store
    index, the zero padding rows) equals the wgmma GEMM's BULK x operand of the same codes and
    scales, `to_stage_tiles(wgmma_x_operand(xp, xs), tm, 128)`, bit for bit."""
    from cuda_ops import nvfp4_gemm_wgmma as wgm

    xp, xs = _codes_and_scales(m, k, m + k)
    got = kernel_xhat_tiles(xp, xs, tm, chunk).view(np.uint16)
    want = wgm.to_stage_tiles(np.asarray(wgm.wgmma_x_operand(jnp.asarray(xp), jnp.asarray(xs))),
                              tm, 128)  # fmt: skip
    assert got.shape == want.shape == (-(-m // tm), k // 128, tm * 128)
    np.testing.assert_array_equal(got, np.asarray(want).view(np.uint16))


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_xhat_tiles_form_builds_over_whole_tiles(tmp_path, monkeypatch):
    """ "xhat_tiles": compiled for its M (XHAT_M), tile (XHAT_TM) and 8 rows a CTA (M_TOK),
    launched over the 8-row groups of whole tiles (grid x = ceil(M / tile_m) tile_m / 8) and
    512-element chunks, outputs [tiles, K / 128, tile_m * 128] float16 and [M] float32; ptxas
    builds it for sm_90 without a stack frame or spills, also with a whole row a CTA (chunk =
    K, its image in passes of `TILES_IMG_MAX`); bad tiles and chunks are refused."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    nvfp4_quant._build_cached.cache_clear()
    try:
        for m, k, tm, pro in ((200, 4096, 128, "rmsnorm"), (300, 12288, 256, "swiglu")):
            kern = nvfp4_quant.build(m, k, nvfp4_gemv.Fused(prologue=pro), arch="compute_90",
                                     out="xhat_tiles", tile_m=tm)  # fmt: skip
            tiles = -(-m // tm)
            assert kern.chunk == 512 and kern.threads == 128
            assert kern.grid == (tiles * tm // 8, k // 512, 1)
            assert f"grid_x = {tiles * tm // 8}," in kern.backend_config()
            assert kern.out_shapes == (((tiles, k // 128, tm * 128), "float16"),
                                       ((m,), "float32"))  # fmt: skip
            assert cbuild.ptx_entries(kern.ptx) == {nvfp4_quant.ENTRY: 6}
            defines = (
                nvfp4_quant._GEMV_DUMMIES
                | nvfp4_gemv.Fused(prologue=pro).defines()
                | {"K_IN": k, "NTHREADS": kern.threads, "QUANT_ONLY": 1, "QCHUNK": kern.chunk}
                | {"XHAT_OUT": 2, "XHAT_TM": tm, "XHAT_M": m, "M_TOK": 8}
            )
            log = cbuild.ptxas_log(cbuild.read_source(nvfp4_gemv.SOURCE), defines,
                                   arch="sm_90", name=nvfp4_gemv.SOURCE)  # fmt: skip
            assert "0 bytes stack frame" in log and "spill" not in log.replace(
                "0 bytes spill stores, 0 bytes spill loads", ""
            ), log
        for k, pro in ((4096, "rmsnorm"), (12288, "swiglu")):  # one CTA an 8-row group
            fused = nvfp4_gemv.Fused(prologue=pro)
            whole = nvfp4_quant.build(300, k, fused, arch="compute_90", out="xhat_tiles",
                                      chunk=k)  # fmt: skip
            assert whole.grid == (-(-300 // 128) * 128 // 8, 1, 1)
            defines = (
                nvfp4_quant._GEMV_DUMMIES
                | fused.defines()
                | {"K_IN": k, "NTHREADS": 128, "QUANT_ONLY": 1, "QCHUNK": k}
                | {"XHAT_OUT": 2, "XHAT_TM": 128, "XHAT_M": 300, "M_TOK": 8}
            )
            log = cbuild.ptxas_log(cbuild.read_source(nvfp4_gemv.SOURCE), defines,
                                   arch="sm_90", name=nvfp4_gemv.SOURCE)  # fmt: skip
            # the image: one pass of TILES_IMG_MAX elements (16 bytes each) beside the
            # statistics' few hundred bytes
            smem = int(re.search(r"(\d+) bytes smem", log).group(1))
            assert nvfp4_quant.TILES_IMG_MAX * 16 <= smem < nvfp4_quant.TILES_IMG_MAX * 16 + 1024
            assert "0 bytes stack frame" in log, log
        with pytest.raises(nvfp4_gemv.KernelError, match="chunk=768"):
            nvfp4_quant.build(200, 4096, nvfp4_gemv.PLAIN, arch="compute_90",
                              out="xhat_tiles", chunk=768)  # fmt: skip
        with pytest.raises(nvfp4_gemv.KernelError, match="tile_m=64, expected one of"):
            nvfp4_quant.build(200, 4096, nvfp4_gemv.PLAIN, arch="compute_90",
                              out="xhat_tiles", tile_m=64)  # fmt: skip
    finally:
        nvfp4_quant._build_cached.cache_clear()


def _source_constants(path, names) -> dict:
    """`#define NAME 0x...u` constants of a kernel source, by name."""
    text = cbuild.read_source(path)
    found = dict(re.findall(r"#define (\w+) (0x[0-9A-Fa-f]+)u", text))
    return {name: int(found[name], 16) for name in names}


def _hmul2_bf16(a, b):
    """mul.rn.bf16x2 on uint32 arrays of two bf16 halves (the float32 product of two bf16
    values is exact, so rounding it to bf16 is the correctly rounded product)."""
    out = np.zeros(np.broadcast(a, b).shape, U32)
    for shift in (0, 16):
        ha = (((a >> U32(shift)) & U32(0xFFFF)) << U32(16)).view(np.float32)
        hb = (((b >> U32(shift)) & U32(0xFFFF)) << U32(16)).view(np.float32)
        prod = (ha * hb).astype(ml_dtypes.bfloat16).view(np.uint16).astype(U32)
        out |= prod << U32(shift)
    return out


def kernel_xhat_bf16(xp: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """What `nvfp4_quantize_bf16` built with XHAT_OUT = 3 writes for codes xp uint8 [M, K/2]
    and E4M3 scale bytes xs [M, K/16] (xbf8, per 8 elements: the codes as one word c): the bf16
    magnitudes' low and high bytes looked up by prmt in the kernel's tables (BL_*, BH_*,
    read from its source), interleaved into 4 words, times (SFx, SFx) in bf16 (the float's high
    half), then each element's sign bit from prmt's sign mode on c and c << 4. bf16 bits
    uint16 [M, K] in natural K order."""
    t = _source_constants(nvfp4_gemv.SOURCE, ("BL_LO", "BL_HI", "BH_LO", "BH_HI"))
    m, k = xp.shape[0], 2 * xp.shape[1]
    c = np.ascontiguousarray(xp).view("<u4").astype(U32)  # [M, K / 8]: element 8q + j nibble j
    sd = np.repeat(xs.view(ml_dtypes.float8_e4m3fn).astype(np.float32), 2, axis=1)
    sb = sd.view(U32) >> U32(16)
    sf2 = sb | (sb << U32(16))
    mag, c4 = c & U32(0x77777777), (c << U32(4)).astype(U32)
    w = [None] * 4
    for h in range(2):
        sel = mag >> U32(16 * h)
        lo, hi = _prmt(t["BL_LO"], t["BL_HI"], sel), _prmt(t["BH_LO"], t["BH_HI"], sel)
        w[2 * h] = _hmul2_bf16(_prmt(lo, hi, 0x5140), sf2)
        w[2 * h + 1] = _hmul2_bf16(_prmt(lo, hi, 0x7362), sf2)
    for i in range(4):
        w[i] = w[i] | (_prmt(c, c4, ((8 + i) << 12) | ((12 + i) << 4)) & U32(0x80008000))
    words = np.stack(w, axis=-1).reshape(m, k // 2)  # word i of 8 elements: elements 2i, 2i + 1
    return np.ascontiguousarray(words).view(np.uint16)


def test_kernel_xhat_bf16_model_covers_every_code_and_scale():
    """Each of the 16 codes times each of the 127 finite non-negative E4M3 scales: xbf8's recipe
    gives e2m1(code) * SFx as `nvfp4.scaled_values_bf16` does, bit for bit (-0 for code 8 and
    for negative codes of a zero scale)."""
    from rejax import nvfp4

    codes = np.arange(16, dtype=np.uint8)
    xs = np.repeat(np.arange(0x7F, dtype=np.uint8)[:, None], 256 // 16, axis=1)
    block = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    xp = np.tile(block, (0x7F, 256 // 16))
    got = kernel_xhat_bf16(xp, xs)
    xq = nvfp4.Nvfp4Tensor(
        packed=jnp.asarray(xp), scales=jnp.asarray(xs).view(jnp.float8_e4m3fn),
        global_scale=jnp.float32(1.0), shape=(0x7F, 256),
    )  # fmt: skip
    want = np.asarray(nvfp4.scaled_values_bf16(xq)).view(np.uint16)
    np.testing.assert_array_equal(got, want)
    assert (got[0] == np.where(np.tile(codes, 16) >= 8, 0x8000, 0)).all()  # the zero scale


def test_e2m1_magnitude_of_the_kernels_equals_the_thresholds_for_every_float():
    """common.cuh's e2m1_mag (one add of 2^22 / 2^23 / 2^24 by range, then the sum's bits less a
    constant; its constants read from the source) equals nvfp4._e2m1_magnitude, the reference's
    thresholds, for every float32 in [0, 6] (1.09e9 values; numpy's float32 add rounds to
    nearest even as the GPU's __fadd_rn does)."""
    from rejax import nvfp4

    text = cbuild.read_source("common.cuh")
    magic = re.search(r"magic = lo \? ([\d.]+)f : mid \? ([\d.]+)f : ([\d.]+)f;", text)
    base = re.search(
        r"base = lo \? (0x[0-9A-F]+)u : mid \? (0x[0-9A-F]+)u - (\d+)u : (0x[0-9A-F]+)u - (\d+)u;",
        text,
    )
    assert magic and base, "e2m1_mag's form changed: update this test"
    magics = [np.float32(float(v)) for v in magic.groups()]
    b = base.groups()
    bases = [U32(int(b[0], 16)), U32(int(b[1], 16) - int(b[2])), U32(int(b[3], 16) - int(b[4]))]
    top = int(np.float32(6.0).view(U32))
    step = 1 << 24
    for start in range(0, top + 1, step):
        a = np.arange(start, min(start + step, top + 1), dtype=U32).view(np.float32)
        lo, mid = a < np.float32(2.0), a < np.float32(4.0)
        mg = np.where(lo, magics[0], np.where(mid, magics[1], magics[2]))
        bs = np.where(lo, bases[0], np.where(mid, bases[1], bases[2]))
        got = (a + mg).view(U32) - bs
        want = nvfp4._e2m1_magnitude(a, np)
        bad = np.nonzero(got != want)[0]
        assert bad.size == 0, (a[bad[:5]], got[bad[:5]], want[bad[:5]])


@pytest.mark.parametrize("k", [256, 4096])
def test_kernel_xhat_bf16_model_equals_the_scaled_values_bitwise(k):
    """The "xhat_bf16" form's bit recipe (xbf8) equals `nvfp4.scaled_values_bf16` of the same
    codes and scales, what the dot path's bf16 dot takes: every code and scale byte, zero and
    subnormal scales, -0 codes and zero blocks under signed codes, bit for bit (signs of zeros
    included), and its low halves are zero (the product is exact in bf16)."""
    from rejax import nvfp4

    m = 9
    xp, xs = _codes_and_scales(m, k, k + 3)
    got = kernel_xhat_bf16(xp, xs)
    xq = nvfp4.Nvfp4Tensor(
        packed=jnp.asarray(xp), scales=jnp.asarray(xs).view(jnp.float8_e4m3fn),
        global_scale=jnp.float32(1.0), shape=(m, k),
    )  # fmt: skip
    want = np.asarray(nvfp4.scaled_values_bf16(xq)).view(np.uint16)
    np.testing.assert_array_equal(got, want)
    assert (got == 0x8000).any() and (got == 0).any()  # both zeros occur


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_xhat_bf16_form_builds(tmp_path, monkeypatch):
    """ "xhat_bf16": XHAT_OUT = 3, the "xhat" form's chunking (one CTA a row from
    ROW_CTA_MIN_M rows), outputs bf16 [M, K] and float32 [M]; ptxas builds it for sm_90 without
    a stack frame; the stage-tile form refuses finish= (the finish forms are "xhat" and
    "xhat_bf16", tests/test_dot_block.py)."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    nvfp4_quant._build_cached.cache_clear()
    try:
        for m, k, pro in ((64, 4096, "rmsnorm"), (4096, 12288, "swiglu")):
            fused = nvfp4_gemv.Fused(prologue=pro)
            kern = nvfp4_quant.build(m, k, fused, arch="compute_90", out="xhat_bf16")
            xh = nvfp4_quant.build(m, k, fused, arch="compute_90", out="xhat")
            assert (kern.chunk, kern.threads, kern.grid) == (xh.chunk, xh.threads, xh.grid)
            assert kern.out_shapes == (((m, k), "bfloat16"), ((m,), "float32"))
            assert cbuild.ptx_entries(kern.ptx) == {nvfp4_quant.ENTRY: 6}
            defines = (
                nvfp4_quant._GEMV_DUMMIES
                | fused.defines()
                | {"K_IN": k, "NTHREADS": kern.threads, "QUANT_ONLY": 1, "QCHUNK": kern.chunk}
                | {"XHAT_OUT": 3}
            )
            log = cbuild.ptxas_log(cbuild.read_source(nvfp4_gemv.SOURCE), defines,
                                   arch="sm_90", name=nvfp4_gemv.SOURCE)  # fmt: skip
            assert "0 bytes stack frame" in log, log
        fin = nvfp4_quant.FinishIn(splitk=2)
        with pytest.raises(nvfp4_gemv.KernelError, match="'xhat_bf16', got 'xhat_tiles'"):
            nvfp4_quant.build(64, 4096, nvfp4_gemv.PLAIN, arch="compute_90", out="xhat_tiles",
                              finish=fin)  # fmt: skip
    finally:
        nvfp4_quant._build_cached.cache_clear()
