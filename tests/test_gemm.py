"""CPU tests of the NVFP4 W4A4 tensor-core GEMM (cuda_ops/nvfp4_gemm): its operand layout (a
lane-by-lane model of the kernel's fragments), plan, dispatch, CUDA lowering, NVRTC builds, and
the reference at every M.

GEMM letters: M rows of x, N out features, K in features.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _lowering import decode_step_cuda_text

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_dequant, nvfp4_gemm, nvfp4_gemm_wgmma, nvfp4_gemv, nvfp4_quant
from rejax import config as rconfig
from rejax import layers as rlayers
from rejax import nvfp4
from rejax.ops import _dispatch
from rejax.ops import linear as kernels

BASE = nvfp4_gemm.GemmOptions(occupancy="base")

needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)


def _u8(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _wide(rng, shape):
    """Normal values with a wide spread of magnitudes (many block scales, subnormal ones too)."""
    return (rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape))).astype(np.float32)


# ----------------------------------------------------------------------------- fragment model


def _f16_pair(word: int) -> np.ndarray:
    return np.array([word & 0xFFFF, word >> 16], np.uint16).view(np.float16).astype(np.float64)


def _decode8(v: int, scale: float) -> list[np.ndarray]:
    """The kernel's decode8: 8 codes -> f16x2 (e_i, e_{i+4}) * 2^-14, times the scale."""
    mag, sgn = 0x0E000E00, 0x80008000
    words = [
        ((v << 9) & mag) | ((v << 12) & sgn),
        ((v << 5) & mag) | ((v << 8) & sgn),
        ((v << 1) & mag) | ((v << 4) & sgn),
        ((v >> 3) & mag) | (v & sgn),
    ]
    return [_f16_pair(w & 0xFFFFFFFF) * scale for w in words]


def _model_tile(wp: np.ndarray, ws: np.ndarray, xh: np.ndarray, w_shift: int) -> np.ndarray:
    """One 16-row x 8-token tile over all of K, lane by lane as nvfp4_gemm.cu's compute_stage
    reads shared memory (code chunk t, word u, scale byte 2t + u / 2, x slot 4u + t), with the
    m16n8k16 fragment layouts of the PTX ISA (A: a0 / a2 row g, a1 / a3 row g + 8, columns
    2t + {0, 1} (+8); B: b0 rows 2t + {0, 1}, b1 rows 2t + 8 + {0, 1}, column g). Returns
    C [16, 8] * 2^(14 - w_shift) in float64 (the kernel's epilogue factor)."""
    k = 2 * wp.shape[1]
    table = nvfp4._E4M3_TABLE
    c = np.zeros((16, 8))
    for ch in range(k // 128):
        codes, scales = wp[:, ch * 64 : (ch + 1) * 64], ws[:, ch * 8 : (ch + 1) * 8]
        for u in range(4):
            a = [np.zeros((16, 16)), np.zeros((16, 16))]
            b = [np.zeros((16, 8)), np.zeros((16, 8))]
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                rows = []
                for r in (g, g + 8):
                    word = int.from_bytes(
                        bytes(codes[r, 16 * t + 4 * u : 16 * t + 4 * u + 4]), "little"
                    )
                    scale = float(table[scales[r, 2 * t + u // 2]]) * 2.0**w_shift
                    rows.append(_decode8(word, scale))
                x0 = ch * 128 + (4 * u + t) * 8
                xs = xh[g, x0 : x0 + 8].astype(np.float64)
                for mi in range(2):  # mma 2u uses P0, P1 and x pairs 0, 1; mma 2u + 1 the rest
                    for h in range(2):
                        a[mi][g, 2 * t + h] = rows[0][2 * mi][h]
                        a[mi][g + 8, 2 * t + h] = rows[1][2 * mi][h]
                        a[mi][g, 2 * t + 8 + h] = rows[0][2 * mi + 1][h]
                        a[mi][g + 8, 2 * t + 8 + h] = rows[1][2 * mi + 1][h]
                        b[mi][2 * t + h, g] = xs[4 * mi + h]
                        b[mi][2 * t + 8 + h, g] = xs[4 * mi + 2 + h]
            c += a[0] @ b[0] + a[1] @ b[1]
    return c * 2.0 ** (14 - w_shift)


def test_fragment_model_of_the_kernel_equals_the_exact_product():
    """The kernel's operand contract, checked lane by lane: its weight decode (fp16 bit trick
    times the block scale) and the host's x_hat layout (`gemm_x_operand`) meet in the mma
    fragments so that C = W_hat X_hat^T exactly (float64 of the pre-scaled values, no global
    scales). Values span many binades, so subnormal fp16 weights occur."""
    rng = np.random.default_rng(0)
    k = 256
    rows = 2.0 ** -np.arange(16, dtype=np.float32)[:, None]  # small rows: subnormal fp16
    w = nvfp4.quantize_weight(_wide(rng, (16, k)) * rows)
    xq = nvfp4.quantize_activation(jnp.asarray(_wide(rng, (8, k)), jnp.bfloat16))
    xh = np.asarray(
        kernels.gemm_x_operand(xq.packed, jax.lax.bitcast_convert_type(xq.scales, jnp.uint8))
    )
    assert xh.dtype == np.float16
    wd = np.asarray(nvfp4._scaled_values(w), np.float64)
    xd = np.asarray(nvfp4._scaled_values(xq), np.float64)
    for w_shift in (0, nvfp4_gemm.DEFAULT_W_SHIFT):
        got = _model_tile(np.asarray(w.packed), _u8(w.scales), xh, w_shift)
        np.testing.assert_array_equal(got, wd @ xd.T)
        small = np.abs(wd[wd != 0]) * 2.0 ** (w_shift - 14)
        assert (small < 2.0**-14).any(), "no subnormal fp16 weight exercised"


def test_x_operand_is_exact_in_float16():
    """x_hat = e2m1 * SFx is exact in fp16 over the whole E4M3 range (2^-10 .. 2688)."""
    rng = np.random.default_rng(1)
    xq = nvfp4.quantize_activation(jnp.asarray(_wide(rng, (4, 512)) * 1e3, jnp.bfloat16))
    xh = np.asarray(kernels.gemm_x_operand(xq.packed, _u8(xq.scales)), np.float64)
    want = np.asarray(nvfp4._scaled_values(xq), np.float64)
    # undo the permutation: position 32u + 8t + j holds element 32t + 8u + j // 2 + 4 (j % 2)
    u, t, j = np.meshgrid(np.arange(4), np.arange(4), np.arange(8), indexing="ij")
    dst = (32 * u + 8 * t + j).reshape(-1)
    src = (32 * t + 8 * u + j // 2 + 4 * (j % 2)).reshape(-1)
    perm = np.concatenate([c * 128 + src for c in range(4)])
    back = np.empty_like(xh)
    back[:, perm] = xh[:, np.concatenate([c * 128 + dst for c in range(4)])]
    np.testing.assert_array_equal(back, want)


# ----------------------------------------------------------------------------- plan and options


def test_plan_tiles_and_split_k():
    """The "base" occupancy rule (about two CTAs per SM, the K split capped by its traffic)."""
    p = nvfp4_gemm.plan(9, 4096, 4096, options=BASE)
    assert (p.tm, p.tile_n, p.threads) == (16, 128, 128)
    # 32 weight tiles on 132 SMs: K split so that about two CTAs per SM have work
    assert p.grid == (1, 32, 8) and p.out_shape == (8, 9, 4096)
    big = nvfp4_gemm.plan(256, 4096, 4096, options=BASE)  # 64-token tiles
    assert (big.tm, big.tile_n, big.threads) == (64, 128, 128)
    assert big.grid == (4, 32, 1) and big.out_shape == (256, 4096)  # partials would cost too much
    wm2 = nvfp4_gemm.plan(256, 4096, 4096, options=nvfp4_gemm.GemmOptions(wm=2, occupancy="base"))
    assert (wm2.tm, wm2.wm, wm2.tile_n, wm2.threads, wm2.grid) == (128, 2, 64, 256, (2, 64, 1))
    assert (
        nvfp4_gemm.plan(100, 4096, 4096, options=nvfp4_gemm.GemmOptions(wm=2, occupancy="base")).tm
        == 112
    )
    odd = nvfp4_gemm.plan(17, 1003, 1280, options=BASE)
    assert odd.grid[0] == 1 and odd.grid[1] == 8 and odd.tm == 24
    for m in (9, 16, 33, 64, 65, 256, 512, 4096):
        for n, k in [(6144, 4096), (4096, 12288), (5120, 25600), (1000, 768)]:
            q = nvfp4_gemm.plan(m, n, k, options=BASE)
            assert q.grid[0] * q.tm >= m > (q.grid[0] - 1) * q.tm
            assert q.grid[1] * q.tile_n >= n and 1 <= q.splitk <= k // q.kt
            assert q.smem <= nvfp4_gemv.SMEM_LIMIT
            # split-K partials stay below a quarter of the weight bytes
            assert q.splitk == 1 or q.splitk * m * 4 <= 0.25 * 0.5625 * k
    forced = nvfp4_gemm.plan(
        64, 4096, 4096, options=nvfp4_gemm.GemmOptions(splitk=3, kt=256, occupancy="base")
    )
    assert forced.splitk == 3 and forced.kt == 256 and forced.defines()["KT"] == 256
    # a cluster split keeps its partials on chip: one bf16 output, no traffic cap on the split
    cl = nvfp4_gemm.plan(
        64, 4096, 4096, options=nvfp4_gemm.GemmOptions(reduce="cluster", occupancy="base")
    )
    assert cl.splitk == 8 and not cl.partials and cl.out_shape == (64, 4096)
    assert cl.defines()["CLUSTER_RED"] == 1 and cl.smem >= cl.tm * (cl.tile_n + 4) * 4
    with pytest.raises(cbuild.KernelError, match="reduce"):
        nvfp4_gemm.GemmOptions(reduce="atomic")
    # how a fused linear quantizes for the GEMM: not part of the GEMM's plan
    assert nvfp4_gemm.GemmOptions().x_quant == "kernel"
    assert rconfig.Config().gemm_x_quant == "kernel"
    xk = nvfp4_gemm.plan(64, 4096, 4096, options=nvfp4_gemm.GemmOptions(x_quant="xla"))
    assert xk == nvfp4_gemm.plan(64, 4096, 4096)
    with pytest.raises(cbuild.KernelError, match="x_quant='fast'"):
        nvfp4_gemm.GemmOptions(x_quant="fast")
    with pytest.raises(ValueError, match="unknown gemm_x_quant 'fast'"):
        rconfig.Config(gemm_x_quant="fast")
    assert rlayers.gemm_options(None, x_quant="xla").x_quant == "xla"


def test_wide_occupancy_plans():
    """occupancy="wide": the H200 sweep's winners (64-row weight tiles up to M = 16, a K split of
    up to 8 aimed at four CTAs per SM); the same as "base" above one M tile (M > 64)."""
    wide = nvfp4_gemm.GemmOptions(occupancy="wide")
    got = {
        (m, n, k): (p.wr, p.splitk)
        for n, k in [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)]
        for m in (8, 16, 32, 64)
        for p in [nvfp4_gemm.plan(m, n, k, options=wide)]
    }
    # 4096 x 4096 at M = 64: split 8 (the base plan splits 2, capped by the partials' traffic)
    base = nvfp4_gemm.GemmOptions(occupancy="base")
    assert (
        got[(64, 4096, 4096)] == (2, 8)
        and nvfp4_gemm.plan(64, 4096, 4096, options=base).splitk == 2
    )
    assert got[(16, 4096, 4096)] == (1, 8) and got[(8, 4096, 12288)] == (1, 8)
    assert got[(8, 6144, 4096)] == (1, 6)  # 96 tiles of 64 rows: 6 x 96 >= 4 x 132
    assert got[(32, 24576, 4096)] == (2, 3)  # 192 tiles: 3 x 192 >= 4 x 132
    for (m, n, k), (wr, splitk) in got.items():
        p = nvfp4_gemm.plan(m, n, k, options=wide)
        assert wr == (1 if m <= 16 else 2) and 1 <= splitk <= nvfp4_gemm.MAX_SPLITK
        assert p.smem <= nvfp4_gemv.SMEM_LIMIT and nvfp4_gemm.check_shape(m, n, k, wide)[0]
        # at least about four CTAs per SM, unless the split is at its cap
        assert splitk == nvfp4_gemm.MAX_SPLITK or p.grid[1] * splitk >= 4 * 132
    for m in (65, 256, 4096):
        assert nvfp4_gemm.plan(m, 4096, 4096, options=wide) == nvfp4_gemm.plan(
            m, 4096, 4096, options=base
        )
    # "fill16" is the default plan (GemmOptions and Config): "fill" from 16 rows on, "fill"'s
    # 16-row plan below; "fill" plans as "wide" below 9 rows
    assert nvfp4_gemm.DEFAULT_OPTIONS.occupancy == "fill16" == rconfig.Config().gemm_occupancy
    fill = nvfp4_gemm.GemmOptions(occupancy="fill")
    for m in (16, 17, 64, 256):
        assert nvfp4_gemm.plan(m, 4096, 4096) == nvfp4_gemm.plan(m, 4096, 4096, options=fill)
    p8 = nvfp4_gemm.plan(8, 4096, 4096)
    assert p8.m == 8 and p8.tm == 16 and p8.grid == nvfp4_gemm.plan(16, 4096, 4096).grid
    for n, k in [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)]:
        for m in range(1, 9):
            assert nvfp4_gemm.plan(m, n, k, options=fill) == nvfp4_gemm.plan(m, n, k, options=wide)
    # explicit fields still win
    forced = nvfp4_gemm.GemmOptions(occupancy="wide", wr=2, splitk=3)
    p = nvfp4_gemm.plan(16, 4096, 4096, options=forced)
    assert (p.wr, p.splitk) == (2, 3)
    with pytest.raises(cbuild.KernelError, match="occupancy='full', expected one of"):
        nvfp4_gemm.GemmOptions(occupancy="full")


def test_fill_occupancy_plans():
    """occupancy="fill": resident CTAs per SM from shared memory, registers and threads; the K
    split of the balance model; the deepest pipeline that keeps each SM's CTAs resident."""
    # Hopper's limits: a 4-warp CTA of 168 registers fits 3 times (ncu: "Block Limit Registers
    # 3"), 89 KB of shared memory twice ("Block Limit Shared Mem 2"), 59 KB three times
    assert nvfp4_gemm.ctas_per_sm(89088, 128, 168) == 2
    assert nvfp4_gemm.ctas_per_sm(59392, 128, 168) == 3
    assert nvfp4_gemm.ctas_per_sm(1024, 128, 176) == 2  # 176 x 32 x 4 > 65536 / 3
    assert nvfp4_gemm.ctas_per_sm(0, 1024, 32) == 2  # the thread limit
    # the register estimate against ptxas (sm_90): within one allocation unit
    for (tm, wr), regs in {(8, 1): 80, (16, 1): 82, (32, 2): 128, (64, 2): 168}.items():
        est = nvfp4_gemm.est_registers(tm, wr)
        assert est % 8 == 0 and regs <= est <= regs + 8, (tm, wr, est)
    fill = nvfp4_gemm.GemmOptions(occupancy="fill")
    wide = nvfp4_gemm.GemmOptions(occupancy="wide")
    # the M = 64 gate_up GEMM: 2 splits (384 CTAs: 3 on every SM; "wide"'s 3 splits leave 5 on
    # some SMs), resident at once with 2 stages (3 CTAs per SM instead of 2)
    p = nvfp4_gemm.plan(64, 24576, 4096, num_sms=132, options=fill)
    w = nvfp4_gemm.plan(64, 24576, 4096, num_sms=132, options=wide)
    assert (w.stages, w.splitk, p.stages, p.splitk) == (3, 3, 2, 2)
    assert nvfp4_gemm.ctas_per_sm(p.smem, p.threads, nvfp4_gemm.est_registers(p.tm, p.wr)) == 3
    assert (p.wr, p.tm, p.grid) == (w.wr, w.tm, (1, 192, 2))
    # at M = 32 the same split, resident at 3 stages
    p32 = nvfp4_gemm.plan(32, 24576, 4096, num_sms=132, options=fill)
    assert (p32.stages, p32.splitk) == (3, 2)
    for n, k in [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)]:
        for m in (8, 9, 16, 32, 63, 64):
            p = nvfp4_gemm.plan(m, n, k, num_sms=132, options=fill)
            w = nvfp4_gemm.plan(m, n, k, num_sms=132, options=wide)
            assert (p.tm, p.wr, p.warps) == (w.tm, w.wr, w.warps)
            assert p.smem <= nvfp4_gemv.SMEM_LIMIT and nvfp4_gemm.check_shape(m, n, k, fill)[0]
            assert 1 <= p.splitk <= min(nvfp4_gemm.MAX_SPLITK, k // p.kt // 4)
            # each SM's share of the grid is resident at once (as far as 2 stages allow), and
            # no deeper pipeline (<= 4 stages) would keep it so
            regs = nvfp4_gemm.est_registers(p.tm, p.wr)
            share = -(-p.grid[1] * p.splitk // 132)
            most = nvfp4_gemm.ctas_per_sm(2 * p.stage_bytes, p.threads, regs)
            assert nvfp4_gemm.ctas_per_sm(p.smem, p.threads, regs) >= min(share, most)
            if p.stages < 4 and (p.stages + 1) * p.stage_bytes <= nvfp4_gemv.SMEM_LIMIT:
                deeper = (p.stages + 1) * p.stage_bytes
                assert nvfp4_gemm.ctas_per_sm(deeper, p.threads, regs) < min(share, most)
    # the balance model: a single CTA per SM counts as two (4096 x 4096 at M = 64 keeps 8
    # splits, 256 CTAs, rather than 4); explicit fields still win; above one M tile "fill" is
    # the base plan
    assert nvfp4_gemm.fill_splitk(64, 24576, 4096, 192, 132, 8) == 2
    assert nvfp4_gemm.fill_splitk(64, 24576, 4096, 192, 132, 1) == 1
    assert nvfp4_gemm.fill_splitk(64, 4096, 4096, 32, 132, 8) == 8
    forced = nvfp4_gemm.plan(
        64, 24576, 4096, options=nvfp4_gemm.GemmOptions(occupancy="fill", stages=3, splitk=5)
    )
    assert (forced.stages, forced.splitk) == (3, 5)
    base = nvfp4_gemm.GemmOptions(occupancy="base")
    assert nvfp4_gemm.plan(256, 4096, 4096, options=fill) == nvfp4_gemm.plan(
        256, 4096, 4096, options=base
    )
    assert rconfig.Config(gemm_occupancy="fill").gemm_occupancy == "fill"


def test_fill16_occupancy_plans_few_rows_as_sixteen():
    """occupancy="fill16": below 16 rows the plan is "fill"'s 16-row plan with M itself (a
    16-token tile whose rows past M are masked: grid x 1), so batch 8 compiles the kernel of
    batch 16 but for M_TOK; from 16 rows on it is "fill"."""
    fill = nvfp4_gemm.GemmOptions(occupancy="fill")
    fill16 = nvfp4_gemm.GemmOptions(occupancy="fill16")
    for n, k in [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)]:
        sixteen = nvfp4_gemm.plan(16, n, k, options=fill)
        for m in (1, 7, 8, 9, 15):
            p = nvfp4_gemm.plan(m, n, k, options=fill16)
            assert p == dataclasses.replace(sixteen, m=m), (m, n, k, p)
            assert p.grid == (1, sixteen.grid[1], sixteen.splitk) and p.defines()["M_TOK"] == m
            assert p.static_copies and p.tm == 16 and nvfp4_gemm.check_shape(m, n, k, fill16)[0]
        for m in (16, 17, 32, 64, 256):
            assert nvfp4_gemm.plan(m, n, k, options=fill16) == nvfp4_gemm.plan(
                m, n, k, options=fill
            )
    # at 8 rows "fill" plans as "wide" (8-token tiles, loop copies): fill16 is another plan
    eight = nvfp4_gemm.plan(8, 6144, 4096, options=fill)
    assert (eight.tm, eight.static_copies) == (8, False)
    # explicit fields and the K split of split_m still apply to the 16-row plan
    forced = nvfp4_gemm.plan(
        8, 6144, 4096, options=nvfp4_gemm.GemmOptions(occupancy="fill16", splitk=2)
    )
    assert (forced.m, forced.tm, forced.splitk) == (8, 16, 2)
    inv = nvfp4_gemm.GemmOptions(occupancy="fill16", split_m=64)
    assert (
        nvfp4_gemm.plan(8, 6144, 4096, options=inv).splitk == nvfp4_gemm.plan(64, 6144, 4096).splitk
    )
    assert rconfig.Config(gemm_occupancy="fill16").gemm_occupancy == "fill16"


def test_check_shape_and_options_are_validated():
    assert nvfp4_gemm.check_shape(16, 4096, 4096) == (True, "")
    assert "K=200" in nvfp4_gemm.check_shape(16, 64, 200)[1]
    assert (
        "multiple of 256" in nvfp4_gemm.check_shape(16, 64, 384, nvfp4_gemm.GemmOptions(kt=256))[1]
    )
    assert not nvfp4_gemm.check_shape(0, 64, 256)[0]
    huge = nvfp4_gemm.GemmOptions(tm=64, wr=4, warps=16, stages=8, kt=256)
    assert (
        "wm must divide" in nvfp4_gemm.check_shape(256, 64, 256, nvfp4_gemm.GemmOptions(tm=128))[1]
    )
    assert "shared memory" in nvfp4_gemm.check_shape(64, 4096, 4096, huge)[1]
    bad_options = ({"tm": 12}, {"kt": 64}, {"splitk": 9}, {"stages": 1}, {"min_m": 0}, {"wr": 0},
                   {"w_shift": 8}, {"max_m": 4}, {"max_m": 2.5}, {"copies": "unrolled"},
                   {"max_regs": 100}, {"max_regs": 256}, {"max_regs": 16})  # fmt: skip
    for bad in bad_options:
        with pytest.raises(cbuild.KernelError, match=next(iter(bad))):
            nvfp4_gemm.GemmOptions(**bad)
    x = jnp.ones((16, 256), jnp.bfloat16)
    w = nvfp4.quantize_weight(np.ones((32, 256), np.float32))
    with pytest.raises(ValueError, match="gemm_options must be a GemmOptions"):
        kernels.nvfp4_linear(x, w, gemm_options=nvfp4_gemv.DEFAULT_OPTIONS)


def test_dispatch_choice_by_m():
    """One rule: the GEMV below GemmOptions.min_m, the GEMM (W4A4 only) from it on."""
    # the default crossover (measured on the H200: M = 8 is faster on the GEMM), and the
    # decoder's Config field defaults to it
    assert nvfp4_gemm.DEFAULT_MIN_M == 8 == rconfig.Config().gemm_min_m
    assert kernels._supported("w4a4", 7, 4096, 4096, jnp.bfloat16)[0] == "gemv"
    assert kernels._supported("w4a4", 8, 4096, 4096, jnp.bfloat16) == ("gemm", (True, ""))
    kind, (ok, why) = kernels._supported("w4a16", 16, 4096, 4096, jnp.bfloat16)
    assert kind == "gemm" and not ok and "W4A4 only" in why
    # W4A16 keeps the GEMV up to its M = 8, also at and above min_m (the GEMM is W4A4 only)
    for m in range(nvfp4_gemm.DEFAULT_MIN_M, nvfp4_gemv.MAX_M + 1):
        assert kernels._supported("w4a16", m, 4096, 4096, jnp.bfloat16) == ("gemv", (True, ""))
    at9 = nvfp4_gemm.GemmOptions(min_m=9)
    assert kernels._supported("w4a4", 8, 4096, 4096, jnp.bfloat16, at9)[0] == "gemv"
    assert kernels.supported("w4a4", 512, 4096, 4096) == (True, "")
    x = jnp.ones((9, 272), jnp.bfloat16)
    w = nvfp4.quantize_weight(np.ones((32, 272), np.float32))
    with pytest.raises(ValueError, match="K=272"):
        kernels.nvfp4_linear(x, w, impl="cuda")


# ----------------------------------------------------------------------------- CUDA lowering


def _calls(text: str):
    return re.findall(r"stablehlo\.custom_call @([\w$.]+)\((.*?)\) \{(.*?)\} :(.*?)\n", text)


def _fields(attrs: str) -> dict:
    cfg = re.sub(r"kernel_data = \\22.*?\\22", "", attrs, flags=re.DOTALL)
    out = dict(re.findall(r"(\w+) = (\d+)", cfg))
    out["name"] = re.search(r"name = \\22(\w+)\\22", cfg).group(1)
    out["output_indices"] = re.search(r"output_indices = \[([\d, ]*)\]", cfg).group(1)
    return out


@pytest.fixture
def stub_compilers(monkeypatch):
    """NVRTC replaced by stubs (GEMV and GEMM), so lowering is checked without cuda-python."""
    seen = []

    def fake(source, *, name, defines, arch, options=(), use_cache=True):
        seen.append((name, defines))
        if name == nvfp4_dequant.SOURCE:
            entries = {nvfp4_dequant.ENTRY: nvfp4_dequant.N_INPUTS + 1}
        elif name == nvfp4_gemm_wgmma.SOURCE.name:
            entries = {
                nvfp4_gemm_wgmma.ENTRY: nvfp4_gemm_wgmma.N_INPUTS + 1,
                nvfp4_gemm_wgmma.FINISH_ENTRY: nvfp4_gemm_wgmma.FINISH_INPUTS + 1,
            }
        elif name == nvfp4_gemm.SOURCE:
            entries = {
                nvfp4_gemm.ENTRY: nvfp4_gemm.N_INPUTS + 1 + defines.get("EPI_RES", 0),
                nvfp4_gemm.FINISH_ENTRY: nvfp4_gemm.FINISH_INPUTS + 1 + defines.get("EPI_RES", 0),
            }
        elif defines.get("FIN_SPLITK"):  # the finish-quantizer: 7 inputs; y, x_hat, xg
            entries = {nvfp4_quant.FIN_ENTRY: 10}
        elif defines.get("QUANT_ONLY"):
            # codes form: 4 inputs, 3 outputs; the x_hat forms (XHAT_OUT 1..3): 2 outputs
            entries = {nvfp4_quant.ENTRY: 6 if defines.get("XHAT_OUT") else 7}
        else:
            w4a4 = {"nvfp4_gemv_w4a4": 8 + defines.get("EPI_RES", 0)}  # + res [M, N]
            entries = w4a4 if defines["ACT_W4A4"] else {"nvfp4_gemv_w4a16": 6}
        text = ".version 9.0\n.target sm_90\n"
        for entry, nparams in entries.items():
            params = ", ".join(f".param .u64 p{i}" for i in range(nparams))
            text += f".visible .entry {entry}({params})\n{{ ret; }}\n"
        return text

    monkeypatch.setattr(nvfp4_gemm, "compile_ptx", fake)
    monkeypatch.setattr(nvfp4_gemv, "compile_ptx", fake)
    monkeypatch.setattr(nvfp4_quant, "compile_ptx", fake)
    monkeypatch.setattr(nvfp4_gemm_wgmma, "compile_ptx", fake)
    monkeypatch.setattr(nvfp4_dequant, "compile_ptx", fake)
    for mod in (nvfp4_gemm, nvfp4_gemv, nvfp4_quant, nvfp4_gemm_wgmma, nvfp4_dequant):
        mod._build_cached.cache_clear()
    # lowerings are cached by JAX: a decode step lowered before (another test) would not call
    # the lowering rules, so nothing would be built and recorded here
    jax.clear_caches()
    yield seen
    for mod in (nvfp4_gemm, nvfp4_gemv, nvfp4_quant, nvfp4_gemm_wgmma, nvfp4_dequant):
        mod._build_cached.cache_clear()


def _lower_cuda(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m", [9, 16, 17, 64, 65, 256, 512])
def test_cuda_lowering_emits_the_gemm(stub_compilers, m):
    """M = 9..512: one PTX call of the GEMM entry with its 6 operands (the fp16 x_hat first),
    its plan's grid, block and shared memory; split-K plans write float32 partials that a
    second PTX call (the epilogue entry) turns into the bf16 result."""
    rng = np.random.default_rng(m)
    n, k = 256, 1024
    w = nvfp4.quantize_weight(rng.standard_normal((n, k)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    # no upper bound: above DEFAULT_MAX_M the "auto" dispatch takes the dot reference; no
    # wgmma range (from 128 rows the wgmma GEMM by default)
    opts = nvfp4_gemm.GemmOptions(max_m=None, wgmma_min_m=None)
    text = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, gemm_options=opts), x)
    p = nvfp4_gemm.plan(m, n, k, options=opts)
    calls = [c for c in _calls(text) if c[0] == "__gpu$xla.gpu.ptx"]
    assert len(calls) == (1 if p.splitk == 1 else 2), text[:2000]
    _, operands, attrs, types = calls[0]
    assert len(operands.split(",")) == nvfp4_gemm.N_INPUTS
    assert types.strip().startswith(f"(tensor<{m}x{k}xf16>")
    fields = _fields(attrs)
    assert fields["name"] == nvfp4_gemm.ENTRY
    grid = tuple(int(fields[f"grid_{a}"]) for a in "xyz")
    assert grid == p.grid and int(fields["block_x"]) == p.threads
    assert int(fields["shared_mem_bytes"]) == p.smem and fields["output_indices"] == "6"
    out = "x".join(map(str, p.out_shape)) + ("xbf16" if p.splitk == 1 else "xf32")
    assert f"-> tensor<{out}>" in types
    assert re.search(rf"-> tensor<{m}x{n}xbf16>", text)
    if p.splitk > 1:
        _, operands, attrs, types = calls[1]
        fields = _fields(attrs)
        assert fields["name"] == nvfp4_gemm.FINISH_ENTRY and fields["output_indices"] == "4"
        assert int(fields["grid_x"]) * int(fields["block_x"]) >= m * n
        assert types.strip().startswith(f"(tensor<{out}>") and f"-> tensor<{m}x{n}xbf16>" in types
    assert stub_compilers[-1][1]["M_TOK"] == m and stub_compilers[-1][1]["GW_ROWS"] == 0
    assert not any(name == nvfp4_gemv.SOURCE for name, _ in stub_compilers)


@pytest.mark.parametrize(("m", "tm"), [(128, 128), (200, 128), (512, 128), (512, 256)])
def test_wgmma_min_m_lowers_to_the_wgmma_gemm(stub_compilers, m, tm):
    """GemmOptions.wgmma_min_m = 128 (the default): from 128 rows the W4A4 linear is one PTX
    call of the wgmma GEMM (its x_hat operand fp16 stage tiles, its plan's grid, block and
    shared memory, per-row global scales and stacked weights passed through), with a K split
    its finish; below, the mma.sync GEMM as before; with wgmma_min_m None, or above
    wgmma_max_m, the GEMM / the dot as before."""
    rng = np.random.default_rng(m + tm)
    n, k = 512, 2048
    mats = [nvfp4.quantize_weight(rng.standard_normal((n, k)).astype(np.float32)) for _ in range(2)]
    w = nvfp4.stack(mats)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    opts = nvfp4_gemm.GemmOptions(wgmma_min_m=128, wgmma_tm=tm)
    text = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, layer=1, gemm_options=opts), x)
    p = nvfp4_gemm_wgmma.build_linear(m, n, k, tm=tm, gw_rows=w.per_row).plan
    calls = [c for c in _calls(text) if c[0] == "__gpu$xla.gpu.ptx"]
    assert len(calls) == (2 if p.partials else 1), text[:2000]
    _, operands, attrs, types = calls[0]
    fields = _fields(attrs)
    assert fields["name"] == nvfp4_gemm_wgmma.ENTRY and fields["output_indices"] == "6"
    assert len(operands.split(",")) == nvfp4_gemm_wgmma.N_INPUTS
    # x_hat pre-tiled per (token tile, K stage) for the bulk copies: [ceil(M / TM), K / 128, ...]
    tiles = f"{-(-m // tm)}x{k // 128}x{tm * 128}xf16"
    assert types.strip().startswith(f"(tensor<{tiles}>"), types[:200]
    assert tuple(int(fields[f"grid_{a}"]) for a in "xyz") == p.grid
    assert int(fields["block_x"]) == p.threads == 256 and int(fields["shared_mem_bytes"]) == p.smem
    assert p.tm == tm and (p.nwg, p.wr, p.bulk) == (2, 1, 3)
    if p.partials:
        assert _fields(calls[1][2])["name"] == nvfp4_gemm_wgmma.FINISH_ENTRY
    wg_defs = [d for name, d in stub_compilers if name == nvfp4_gemm_wgmma.SOURCE.name]
    assert wg_defs and all(d["TM"] == tm and d["M_TOK"] == m for d in wg_defs), wg_defs
    assert not any(name == nvfp4_gemm.SOURCE for name, _ in stub_compilers)
    assert re.search(rf"-> tensor<{m}x{n}xbf16>", text)
    # below the threshold the mma.sync GEMM; without the option no wgmma call at all
    low = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, layer=1, gemm_options=opts), x[:64])
    assert _fields(_calls(low)[0][2])["name"] == nvfp4_gemm.ENTRY
    default = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, layer=1), x)
    assert nvfp4_gemm_wgmma.ENTRY in default
    off = nvfp4_gemm.GemmOptions(wgmma_min_m=None)
    plain = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, layer=1, gemm_options=off), x)
    assert nvfp4_gemm_wgmma.ENTRY not in plain
    capped = nvfp4_gemm.GemmOptions(wgmma_min_m=64, wgmma_max_m=m - 1)
    text = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, layer=1, gemm_options=capped), x)
    assert nvfp4_gemm_wgmma.ENTRY not in text


def test_wgmma_options_are_checked_and_off_hopper_fall_back(stub_compilers, monkeypatch):
    """Bad wgmma_min_m / wgmma_max_m / wgmma_tm values are refused (GemmOptions, Config); off
    sm_90 the wgmma GEMM is not built and the usual dispatch runs (the dot above max_m): a
    warning says why once for a chosen range, none for the default one; the Config fields
    reach gemm_options, and invariant rows turn the default range off."""
    for bad in (0, -1, 1.5):
        with pytest.raises(nvfp4_gemv.KernelError, match="wgmma_min_m"):
            nvfp4_gemm.GemmOptions(wgmma_min_m=bad)
    with pytest.raises(nvfp4_gemv.KernelError, match="wgmma_max_m=100, expected None or an int"):
        nvfp4_gemm.GemmOptions(wgmma_max_m=100)  # below the default wgmma_min_m = 128
    with pytest.raises(nvfp4_gemv.KernelError, match="wgmma_tm=64, expected one of"):
        nvfp4_gemm.GemmOptions(wgmma_tm=64)
    for field in ("gemm_wgmma_min_m", "gemm_wgmma_max_m"):
        with pytest.raises(ValueError, match=f"{field} must be None, 'default' or an int >= 1"):
            rconfig.Config(**{field: 0})
    assert rconfig.Config().gemm_wgmma_min_m == rconfig.Config().gemm_wgmma_max_m == "default"
    assert nvfp4_gemm.DEFAULT_OPTIONS.wgmma_min_m == nvfp4_gemm.DEFAULT_WGMMA_MIN_M == 128
    assert nvfp4_gemm.DEFAULT_OPTIONS.wgmma_max_m == nvfp4_gemm.DEFAULT_WGMMA_MAX_M == 2048
    opts = rlayers.gemm_options(None, wgmma_min_m=256, wgmma_max_m=None)
    assert (opts.wgmma_min_m, opts.wgmma_max_m) == (256, None)
    assert opts.max_m == nvfp4_gemm.DEFAULT_MAX_M
    assert rlayers.gemm_options(None).wgmma_min_m == 128
    assert rlayers.gemm_options(None, wgmma_min_m=None).wgmma_min_m is None
    assert rlayers.gemm_options(None, split_m=64).wgmma_min_m is None  # invariant rows
    assert rlayers.gemm_options(None, split_m=64, wgmma_min_m=128).wgmma_min_m == 128
    rng = np.random.default_rng(0)
    w = nvfp4.quantize_weight(rng.standard_normal((256, 1024)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((300, 1024)), jnp.bfloat16)
    monkeypatch.setattr(cbuild, "device_arch", lambda device=None: "compute_100")
    with pytest.warns(UserWarning, match="the wgmma GEMM does not run: .*sm_90"):
        text = _lower_cuda(
            lambda x: kernels.nvfp4_linear(
                x, w, gemm_options=nvfp4_gemm.GemmOptions(wgmma_min_m=129)
            ),
            x,
        )
    # the dot path (its weight decoded by the dequantizer kernel, the default), no GEMM
    assert re.findall(r"name = \\22(\w+)\\22", text) == [nvfp4_dequant.ENTRY], text[:2000]
    assert "dot_general" in text
    with warnings.catch_warnings():  # the default range: the same fallback, silently
        warnings.simplefilter("error")
        quiet = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w), x)
    assert re.findall(r"name = \\22(\w+)\\22", quiet) == [nvfp4_dequant.ENTRY]


def test_wgmma_split_m_fixes_the_k_split(stub_compilers):
    """GemmOptions.split_m reaches the wgmma GEMM: every M plans the K split of split_m rows
    (without it the split follows M: 4 at 128 rows, 1 at 512 on a 4096 x 4096 weight)."""
    splits = {m: nvfp4_gemm_wgmma.build_linear(m, 4096, 4096).plan.splitk for m in (128, 512)}
    assert splits == {128: 4, 512: 1}
    for m in (128, 200, 256, 512):
        p = nvfp4_gemm_wgmma.build_linear(m, 4096, 4096, split_m=128).plan
        assert p.splitk == 4 and p.m == m, p
    opts = nvfp4_gemm.GemmOptions(wgmma_min_m=128, split_m=128)
    assert kernels.wgmma_kernel(512, 4096, 4096, opts, False).plan.splitk == 4


def test_wgmma_tm_auto_picks_the_tile_per_shape(stub_compilers):
    """GemmOptions.wgmma_tm / Config.gemm_wgmma_tm "auto": 256-token tiles where they fill whole
    waves without a K split and cost no more (`auto_tm`, 132 SMs): at 512 rows Qwen3-8B's qkv
    and gate_up (measured faster kernel alone on an H100), 128 for o and down (a K split);
    at <= 256 rows always 128; with split_m the choice of split_m rows. "auto" is the default;
    the Config field reaches the prefill's wgmma builds; bad values are refused."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
              "down": (4096, 12288)}  # fmt: skip
    got = {name: nvfp4_gemm_wgmma.auto_tm(512, n, k, 132) for name, (n, k) in shapes.items()}
    assert got == {"qkv": 256, "o": 128, "gate_up": 256, "down": 128}
    for m in (128, 200, 256):
        assert {nvfp4_gemm_wgmma.auto_tm(m, n, k, 132) for n, k in shapes.values()} == {128}
    assert nvfp4_gemm_wgmma.build_linear(512, 24576, 4096, tm="auto").plan.tm == 256
    assert nvfp4_gemm_wgmma.build_linear(512, 4096, 4096, tm="auto").plan.tm == 128
    assert nvfp4_gemm_wgmma.build_linear(512, 24576, 4096, tm="auto", split_m=256).plan.tm == 128
    with pytest.raises(nvfp4_gemv.KernelError, match="tm=64, expected one of"):
        nvfp4_gemm_wgmma.build_linear(512, 4096, 4096, tm=64)
    opts = nvfp4_gemm.GemmOptions(wgmma_tm="auto")
    assert kernels.wgmma_kernel(512, 24576, 4096, opts, False).plan.tm == 256
    assert kernels.wgmma_kernel(512, 4096, 12288, opts, False).plan.tm == 128
    assert rconfig.Config().gemm_wgmma_tm == nvfp4_gemm.DEFAULT_OPTIONS.wgmma_tm == "auto"
    assert rlayers.gemm_options(None, wgmma_tm="256").wgmma_tm == 256
    assert rlayers.gemm_options(None, wgmma_tm="auto").wgmma_tm == "auto"
    with pytest.raises(ValueError, match="unknown gemm_wgmma_tm '64'"):
        rconfig.Config(gemm_wgmma_tm="64")
    from rejax import decode as rdecode
    from rejax.cache import init_cache

    base, params = _tiny_prefill_model()
    tokens = 512
    for tm in ("128", "256"):
        cfg = dataclasses.replace(base, linear_fusion="split", gemm_wgmma_tm=tm)
        p = dataclasses.replace(params, cfg=cfg)
        cache = init_cache(cfg, 1, tokens + 8, jnp.bfloat16)
        ids = jnp.zeros((1, tokens), jnp.int32)
        pos = jnp.arange(tokens, dtype=jnp.int32)[None]
        stub_compilers.clear()
        rdecode.prefill.trace(p, ids, pos, cache).lower(lowering_platforms=("cuda",))
        tms = {d["TM"] for name, d in stub_compilers if name == nvfp4_gemm_wgmma.SOURCE.name}
        assert tms == {int(tm)}, (tm, tms)


def test_config_gemm_wgmma_raster_reaches_the_wgmma_builds(stub_compilers):
    """Config.gemm_wgmma_raster / GemmOptions.wgmma_raster: 0 (the default) builds the wgmma
    GEMM without RASTER (the grid's order); G > 0 reaches every wgmma build of a 512-token
    prefill as RASTER G ("split" and "unfused"), and nothing else changes in the lowering but
    the kernels' text; bad values are refused by name."""
    assert rconfig.Config().gemm_wgmma_raster == nvfp4_gemm.DEFAULT_OPTIONS.wgmma_raster == 0
    assert rlayers.gemm_options(None, wgmma_raster=8).wgmma_raster == 8
    assert kernels.wgmma_kernel(512, 4096, 4096, nvfp4_gemm.GemmOptions(wgmma_raster=8),
                                False).plan.raster == 8  # fmt: skip
    base, params = _tiny_prefill_model()

    def wgmma_builds(cfg):  # (lowered text, the wgmma builds' defines), nothing cached
        nvfp4_gemm_wgmma._build_cached.cache_clear()
        jax.clear_caches()
        stub_compilers.clear()
        text = _prefill_text(params, cfg, 512)
        return text, [d for name, d in stub_compilers if name == nvfp4_gemm_wgmma.SOURCE.name]

    for fusion in ("split", "unfused"):
        cfg = dataclasses.replace(base, linear_fusion=fusion)
        plain, wg = wgmma_builds(cfg)
        assert wg and all("RASTER" not in d for d in wg), fusion
        grouped, wg8 = wgmma_builds(dataclasses.replace(cfg, gemm_wgmma_raster=8))
        assert len(wg8) == len(wg) and all(d.get("RASTER") == 8 for d in wg8), fusion
        assert _names(grouped) == _names(plain)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="gemm_wgmma_raster="):
            rconfig.Config(gemm_wgmma_raster=bad)
        with pytest.raises(nvfp4_gemv.KernelError, match="wgmma_raster="):
            nvfp4_gemm.GemmOptions(wgmma_raster=bad)


def _tiny_prefill_model():
    """(Config, random bf16-initialised Params) of a small NVFP4 Qwen3 for prefill lowerings."""
    from rejax import params as rparams

    base = rconfig.Config(
        quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, num_heads=4,
        num_kv_heads=2,
    )  # fmt: skip
    return base, rparams.init_params(base, 0, jnp.bfloat16)


def _prefill_text(params, cfg, tokens: int) -> str:
    """The CUDA lowering (StableHLO text) of a `tokens`-token prefill at batch 1 of `params`
    under `cfg`."""
    from rejax import decode as rdecode
    from rejax.cache import init_cache

    p = dataclasses.replace(params, cfg=cfg)
    cache = init_cache(cfg, 1, tokens + 8, jnp.bfloat16)
    ids = jnp.zeros((1, tokens), jnp.int32)
    positions = jnp.arange(tokens, dtype=jnp.int32)[None]
    lowered = rdecode.prefill.trace(p, ids, positions, cache).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def _prefill_entries(params, cfg, tokens: int) -> list[str]:
    """Names of the PTX kernels in the CUDA lowering of a `tokens`-token prefill at batch 1 of
    `params` under `cfg`."""
    return re.findall(r"name = \\22(\w+)\\22", _prefill_text(params, cfg, tokens))


def test_config_gemm_wgmma_min_m_reaches_prefill(stub_compilers):
    """Config.gemm_wgmma_min_m / max_m: a 128-token prefill lowers the scanned layer's four
    W4A4 linears (the fused ones of linear_fusion "split", and the plain ones of "unfused") to
    the wgmma GEMM by default; with gemm_wgmma_min_m None, or a range that ends below 128
    rows, or invariant rows, they take the GEMM (the default max_m is 256)."""
    base, params = _tiny_prefill_model()

    def entries(cfg):
        return _prefill_entries(params, cfg, 128)

    for fusion in ("split", "unfused"):
        cfg = dataclasses.replace(base, linear_fusion=fusion)
        on = entries(cfg)
        assert on.count(nvfp4_gemm_wgmma.ENTRY) == 4 and nvfp4_gemm.ENTRY not in on, (fusion, on)
        for change in (
            {"gemm_wgmma_min_m": None},
            {"gemm_wgmma_min_m": 64, "gemm_wgmma_max_m": 127},
            {"invariant_rows": 128},
        ):
            off = entries(dataclasses.replace(cfg, **change))
            assert nvfp4_gemm_wgmma.ENTRY not in off, (fusion, change, off)
            assert off.count(nvfp4_gemm.ENTRY) == 4, (fusion, change, off)
    # a decode step of 16 rows with the threshold at 16: the GEMM chains (gemm_chain, the
    # post-attention block) step aside, so all four linears take the wgmma GEMM
    dec = _decode_step_entries(dataclasses.replace(base, gemm_wgmma_min_m=16), 16)
    assert dec.count(nvfp4_gemm_wgmma.ENTRY) == 4 and nvfp4_gemm.ENTRY not in dec, dec


def test_cuda_lowering_stacked_split_k_and_gemv_below(stub_compilers):
    rng = np.random.default_rng(5)
    n, k = 4096, 2048
    layers = [
        nvfp4.concat_rows([
            nvfp4.quantize_weight(rng.standard_normal((n // 2, k)).astype(np.float32) * s)
            for s in (1.0, 3.0)
        ])
        for _ in range(2)
    ]  # fmt: skip
    stack = nvfp4.stack(layers)
    x = jnp.asarray(rng.standard_normal((12, k)), jnp.bfloat16)
    text = _lower_cuda(lambda x, i: kernels.nvfp4_linear(x, stack, layer=i), x, jnp.int32(1))
    p = nvfp4_gemm.plan(12, n, k, gw_rows=True)
    assert p.splitk > 1  # 32 tiles: split
    gemm, finish = [c for c in _calls(text) if c[0] == "__gpu$xla.gpu.ptx"]
    assert f"-> tensor<{p.splitk}x12x{n}xf32>" in gemm[3] and "bf16" in finish[3]
    assert stub_compilers[-1][1]["GW_ROWS"] == 1 and stub_compilers[-1][1]["SPLITK"] == p.splitk
    # M = 7 stays on the GEMV, M = 8 takes the GEMM; with min_m = 9, M = 8 stays on the GEMV
    text7 = _lower_cuda(lambda x: kernels.nvfp4_linear(x, layers[0]), x[:7])
    assert "nvfp4_gemv_w4a4" in text7 and nvfp4_gemm.ENTRY not in text7
    x8 = x[:8]
    assert nvfp4_gemm.ENTRY in _lower_cuda(lambda x: kernels.nvfp4_linear(x, layers[0]), x8)
    opts = nvfp4_gemm.GemmOptions(min_m=9)
    text8 = _lower_cuda(lambda x: kernels.nvfp4_linear(x, layers[0], gemm_options=opts), x8)
    assert "nvfp4_gemv_w4a4" in text8 and nvfp4_gemm.ENTRY not in text8


def test_cluster_reduce_lowers_to_one_call(stub_compilers):
    rng = np.random.default_rng(9)
    w = nvfp4.quantize_weight(rng.standard_normal((4096, 2048)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((16, 2048)), jnp.bfloat16)
    opts = nvfp4_gemm.GemmOptions(reduce="cluster")
    text = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, gemm_options=opts), x)
    (call,) = [c for c in _calls(text) if c[0] == "__gpu$xla.gpu.ptx"]
    p = nvfp4_gemm.plan(16, 4096, 2048, options=opts)
    assert p.splitk > 1 and int(_fields(call[2])["grid_z"]) == p.splitk
    assert "-> tensor<16x4096xbf16>" in call[3]


def test_rows_above_max_m_take_the_dot_reference_by_choice(stub_compilers, monkeypatch):
    """W4A4 above GemmOptions.max_m (prefill; default 256, Config.gemm_max_m) and above the
    wgmma range (default 128 .. 2048 rows, which takes the wgmma GEMM first): impl="auto"
    lowers the dot reference (the weight decoded by the default dequantizer kernel) without
    building a GEMM or noting a fallback; up to max_m, with no bound, or with impl="cuda" the
    GEMM runs. The split fused linears follow the same rule."""
    import warnings

    from rejax.ops import fused_linear as fl

    assert nvfp4_gemm.DEFAULT_MAX_M == 256 == rconfig.Config().gemm_max_m
    assert nvfp4_gemm.DEFAULT_OPTIONS.max_m == nvfp4_gemm.DEFAULT_MAX_M
    monkeypatch.setattr(_dispatch, "_NOTED", set())
    rng = np.random.default_rng(7)
    n, k = 256, 1024
    w = nvfp4.quantize_weight(rng.standard_normal((n, k)).astype(np.float32))
    params = {"weight": w}

    def entries(m, f):
        stub_compilers.clear()
        for mod in (nvfp4_gemm, nvfp4_gemv, nvfp4_quant, nvfp4_gemm_wgmma):
            mod._build_cached.cache_clear()
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a reference-path note would fail here
            text = _lower_cuda(f, x)
        return re.findall(r"name = \\22(\w+)\\22", text), text

    unbounded = nvfp4_gemm.GemmOptions(max_m=None, x_quant="xla")
    dq = [nvfp4_dequant.ENTRY]  # the default dot_dequant "kernel" decodes the weight
    for m in (257, 512, 2048):  # the wgmma range
        got, _ = entries(m, lambda x: kernels.nvfp4_linear(x, w))
        assert got[0] == nvfp4_gemm_wgmma.ENTRY and nvfp4_dequant.ENTRY not in got, got
    for m in (2049, 2304):
        got, text = entries(m, lambda x: kernels.nvfp4_linear(x, w))
        assert got == dq and "dot_general" in text, got
        got, text = entries(m, lambda x: fl.fused_linear(x, params, kernels="two"))
        # the fused linear's activations from the quantizer kernel (dot_x "kernel", the default)
        assert got == [nvfp4_quant.ENTRY, *dq] and "dot_general" in text, got
        got, _ = entries(m, lambda x: kernels.nvfp4_linear(x, w, gemm_options=unbounded))
        assert got[0] == nvfp4_gemm.ENTRY, got
        got, _ = entries(m, lambda x: kernels.nvfp4_linear(x, w, impl="cuda"))
        assert got[0] == nvfp4_gemm.ENTRY, got
        got, _ = entries(
            m, lambda x: fl.fused_linear(x, params, kernels="two", gemm_options=unbounded)
        )
        assert got[0] == nvfp4_gemm.ENTRY and nvfp4_quant.ENTRY not in got, got
        # with x_quant "kernel" (the default) the quantizer kernel (its x_hat form) feeds the
        # GEMM at any M; "xla" (above) keeps XLA's quantizer
        xk = dataclasses.replace(unbounded, x_quant="kernel")
        got, _ = entries(
            m, lambda x, xk=xk: fl.fused_linear(x, params, kernels="two", gemm_options=xk)
        )
        assert got[:2] == [nvfp4_quant.ENTRY, nvfp4_gemm.ENTRY], got
    got, _ = entries(127, lambda x: kernels.nvfp4_linear(x, w))
    assert got[0] == nvfp4_gemm.ENTRY, got
    low = nvfp4_gemm.GemmOptions(max_m=16)
    got, _ = entries(17, lambda x: kernels.nvfp4_linear(x, w, gemm_options=low))
    assert got == dq, got
    assert _dispatch.noted() == []
    # the decoder: Config.gemm_max_m=8 sends a batch-16 decode step's linears to the dot
    cfg = rconfig.Config(
        quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, gemm_max_m=8,
    )  # fmt: skip
    stub_compilers.clear()
    nvfp4_gemm._build_cached.cache_clear()
    step = _decode_step_entries(cfg, 16)
    assert nvfp4_gemm.ENTRY not in step, step
    step = _decode_step_entries(rconfig.Config(**{**cfg.__dict__, "gemm_max_m": None}), 16)
    assert step.count(nvfp4_gemm.ENTRY) == 4, step
    with pytest.raises(ValueError, match="gemm_max_m must be None or an int >= gemm_min_m=8"):
        rconfig.Config(gemm_max_m=4)


def test_w4a16_above_the_gemv_takes_the_dot_reference(stub_compilers, monkeypatch):
    """W4A16 at M = 12 on CUDA: the one dispatch logs why once and lowers the reference as one
    tensor-core dot, never the sequential block scan the CPU reference uses at this M."""
    monkeypatch.setattr(_dispatch, "_NOTED", set())  # this test's note, not other tests'
    rng = np.random.default_rng(6)
    w = nvfp4.quantize_weight(rng.standard_normal((64, 256)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((12, 256)), jnp.bfloat16)
    with pytest.warns(UserWarning, match="W4A4 only"):
        text = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, act="w4a16"), x)
    assert "__gpu$xla.gpu.ptx" not in text and not stub_compilers
    assert "stablehlo.while" not in text and "dot_general" in text
    assert any("W4A4 only" in why for op, why in _dispatch.noted() if op == "nvfp4_linear")


def test_launch_passes_the_residual_to_both_entries(stub_compilers, monkeypatch):
    """With the residual and a K split, the direct launch gives res (right after xg) to the
    GEMM and to the finish kernel, the workspace between them; a pointer short is refused."""
    kern = nvfp4_gemm.build(8, 4096, 4096, arch="compute_90", num_sms=132, residual=True)
    assert kern.plan.partials and kern.plan.n_inputs == 7
    seen = []
    monkeypatch.setattr(nvfp4_gemm.GemmKernel, "_launch", lambda _, *a: seen.append(a))
    xh, xg, res, wp, ws, wg, layer, y, work = range(1, 10)
    kern.launch(0, [xh, xg, res, wp, ws, wg, layer, y], workspace=work)
    assert seen == [
        (nvfp4_gemm.ENTRY, 0, [xh, xg, res, wp, ws, wg, layer, work]),
        (nvfp4_gemm.FINISH_ENTRY, 0, [work, xg, res, wg, layer, y]),
    ]
    with pytest.raises(nvfp4_gemm.KernelError, match="takes 8 pointers, got 7"):
        kern.launch(0, [xh, xg, wp, ws, wg, layer, y], workspace=work)


def test_impl_ref_on_cuda_never_builds(stub_compilers):
    rng = np.random.default_rng(7)
    w = nvfp4.quantize_weight(rng.standard_normal((64, 256)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((32, 256)), jnp.bfloat16)
    text = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, impl="ref"), x)
    assert "__gpu$xla.gpu.ptx" not in text and not stub_compilers


# ----------------------------------------------------------------------------- NVRTC


GEMM_CONFIGS = [
    {},
    {"tm": 8},
    {"tm": 64, "wr": 1},
    {"kt": 256, "stages": 3},
    {"splitk": 4, "warps": 8},
    {"tm": 32, "wr": 4, "stages": 2},
    {"tm": 128, "wm": 2, "wr": 1},
    {"tm": 48, "wm": 2, "warps": 4},
    {"splitk": 3, "reduce": "cluster"},
]


@needs_nvrtc
def test_nvrtc_compiles_every_tile_config_for_hopper(tmp_path, monkeypatch):
    """Every tile configuration the plan or the benchmark uses compiles for sm_90 with the
    GEMM entry and its 7 parameters, no local memory (register arrays stay in registers), and
    the tensor-core and cp.async instructions it is built on; the split-K epilogue entry sits
    in the same module."""
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    nvfp4_gemm._build_cached.cache_clear()
    shapes = ((17, 1003, False), (64, 4096, True))  # odd N and M; per-row global scales
    problems = [
        {"m": m, "n": n, "k": 1024, "options": nvfp4_gemm.GemmOptions(**c), "gw_rows": gr}
        for i, c in enumerate(GEMM_CONFIGS)
        for m, n, gr in [shapes[i % 2]]
    ]
    kernels_ = nvfp4_gemm.prebuild(problems, arch="compute_90", workers=2)
    for prob, kern in zip(problems, kernels_, strict=True):
        assert cbuild.ptx_target(kern.ptx) == "sm_90"
        assert cbuild.ptx_entries(kern.ptx) == {
            nvfp4_gemm.ENTRY: nvfp4_gemm.N_INPUTS + 1,
            nvfp4_gemm.FINISH_ENTRY: nvfp4_gemm.FINISH_INPUTS + 1,
        }
        assert ".local" not in kern.ptx, prob
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in kern.ptx
        assert "cp.async.cg.shared.global" in kern.ptx
        cluster = kern.plan.splitk > 1 and kern.plan.reduce == "cluster"
        assert (f".reqnctapercluster 1, 1, {kern.plan.splitk}" in kern.ptx) == cluster
        assert ("mapa.shared::cluster" in kern.ptx) == cluster
    nvfp4_gemm._build_cached.cache_clear()


def test_stage_copies_are_static_from_16_token_tiles():
    """ "auto" takes the static copies (and the register cap that keeps the plan's resident
    CTAs) for tiles of >= STATIC_MIN_TM tokens, the loops below; the choice never moves the
    plan's geometry, and the loop kernels keep their defines (and cache keys)."""
    geometry = ("tm", "wm", "wr", "warps", "kt", "stages", "splitk")
    for n, k in ((24576, 4096), (6144, 4096), (4096, 12288)):
        for m in (8, 9, 16, 17, 32, 64, 128, 256):
            auto = nvfp4_gemm.plan(m, n, k, 132)
            loop = nvfp4_gemm.plan(m, n, k, 132, nvfp4_gemm.GemmOptions(copies="loop"))
            static = nvfp4_gemm.plan(m, n, k, 132, nvfp4_gemm.GemmOptions(copies="static"))
            assert all(getattr(auto, f) == getattr(loop, f) == getattr(static, f) for f in geometry)
            assert auto.static_copies == (auto.tm >= nvfp4_gemm.STATIC_MIN_TM)
            assert "STATIC_COPIES" not in loop.defines() and "MAX_REGS" not in loop.defines()
            d = static.defines()
            assert d["STATIC_COPIES"] == 1
            cap = nvfp4_gemm.max_registers(static.smem, static.threads, static.tm, static.wr)
            assert d["MAX_REGS"] == cap and cap % 8 == 0 and cap * static.threads <= 65536
            want = nvfp4_gemm.ctas_per_sm(
                static.smem, static.threads, nvfp4_gemm.est_registers(static.tm, static.wr)
            )
            assert nvfp4_gemm.ctas_per_sm(static.smem, static.threads, cap) >= want
            assert cap == 248 or nvfp4_gemm.ctas_per_sm(static.smem, static.threads, cap + 8) < want
    # 8-token tiles ("fill" at M = 8) keep the loops, measured faster there; the default
    # "fill16" runs M = 8 in the 16-token tile, static
    fill = nvfp4_gemm.GemmOptions(occupancy="fill")
    assert not nvfp4_gemm.plan(8, 4096, 4096, 132, fill).static_copies
    assert nvfp4_gemm.plan(8, 4096, 4096, 132).static_copies
    # an explicit cap: 0 is none (__launch_bounds__), else that many registers, either copies
    nocap = nvfp4_gemm.plan(64, 4096, 4096, 132, nvfp4_gemm.GemmOptions(max_regs=0))
    assert nocap.static_copies and "MAX_REGS" not in nocap.defines()
    capped = nvfp4_gemm.GemmOptions(copies="loop", max_regs=128)
    assert nvfp4_gemm.plan(8, 4096, 4096, 132, capped).defines()["MAX_REGS"] == 128


@needs_nvrtc
@pytest.mark.parametrize(("m", "n"), [(16, 24576), (17, 1003), (64, 4096), (128, 6144)])
def test_static_copies_compile_under_the_cap_without_spills(m, n):
    """The static copies build for the plan's tiles (ragged N and M included) within MAX_REGS,
    with no local memory; the register cap is __maxnreg__ in the PTX."""
    import re

    opts = nvfp4_gemm.GemmOptions(copies="static")
    p = nvfp4_gemm.plan(m, n, 4096, 132, opts)
    src = cbuild.read_source(nvfp4_gemm.SOURCE)
    log = cbuild.ptxas_log(src, p.defines(), name=nvfp4_gemm.SOURCE).replace("\0", "")
    body = log.rsplit(nvfp4_gemm.ENTRY, 1)[1]
    regs = int(re.search(r"Used (\d+) registers", body).group(1))
    assert regs <= p.max_regs
    assert "0 bytes spill stores" in body and "0 bytes stack frame" in body
    ptx = cbuild.compile_ptx(src, name=nvfp4_gemm.SOURCE, defines=p.defines(), arch="compute_90")
    assert f".maxnreg {p.max_regs}" in ptx and ".local" not in ptx


@needs_nvrtc
@pytest.mark.parametrize(
    ("m", "k", "options"),
    [
        (8, 12288, {}),  # Qwen3-8B down_proj at batch 8: a K split through the finish kernel
        (8, 12288, {"reduce": "cluster"}),  # the split added in a cluster: one kernel
        (256, 12288, {}),  # no K split
        (128, 4096, {"wm": 2}),
    ],
)
def test_nvrtc_compiles_the_residual_epilogue(tmp_path, monkeypatch, m, k, options):
    """build(residual=True) adds -DEPI_RES=1: both entries take res [M, N] after xg (8 and 6
    parameters, outputs at 7 and 5), stay in registers and round twice per bf16 store (the
    GEMM's value, then the sum); without it the module is the one of -DEPI_RES=0."""
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    nvfp4_gemm._build_cached.cache_clear()
    opts = nvfp4_gemm.GemmOptions(**options)
    plain = nvfp4_gemm.build(m, 4096, k, arch="compute_90", options=opts)
    res = nvfp4_gemm.build(m, 4096, k, arch="compute_90", options=opts, residual=True)
    zero = nvfp4_gemm.GemmOptions(**options, defines=(("EPI_RES", "0"),))
    assert nvfp4_gemm.build(m, 4096, k, arch="compute_90", options=zero).ptx == plain.ptx
    assert "EPI_RES" not in plain.plan.defines() and res.plan.defines()["EPI_RES"] == 1
    assert cbuild.ptx_entries(res.ptx) == {nvfp4_gemm.ENTRY: 8, nvfp4_gemm.FINISH_ENTRY: 6}
    assert "output_indices = [7]" in res.backend_config()
    assert "output_indices = [5]" in res.backend_config(nvfp4_gemm.FINISH_ENTRY)
    assert ".local" not in res.ptx
    stores = plain.ptx.count("st.global.u16")
    assert stores >= 1 and res.ptx.count("st.global.u16") == stores
    assert plain.ptx.count("cvt.rn.bf16.f32") == stores
    assert res.ptx.count("cvt.rn.bf16.f32") == 2 * stores
    with pytest.raises(nvfp4_gemm.KernelError, match="residual=1, expected a bool"):
        nvfp4_gemm.build(m, 4096, k, arch="compute_90", residual=1)
    nvfp4_gemm._build_cached.cache_clear()


# ----------------------------------------------------------------------------- reference


def _f64(xq, w):
    return (
        np.asarray(nvfp4.dequantize(xq), np.float64) @ np.asarray(nvfp4.dequantize(w), np.float64).T
    )


@pytest.mark.parametrize("m", [9, 16, 17, 65, 256, 512])
def test_reference_matches_float64_at_every_m(m):
    """The reference the GPU kernel is compared with stays within 1.5x the bf16 rounding floor
    of float64 of the same quantized operands at every M (block scan to M = 16, one dot above)."""
    rng = np.random.default_rng(m)
    w = nvfp4.quantize_weight(rng.standard_normal((48, 256)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    y = np.asarray(kernels.nvfp4_linear(x, w), np.float64)
    y64 = _f64(nvfp4.quantize_activation(x), w)
    floor = np.linalg.norm(y64.astype(ml_dtypes.bfloat16).astype(np.float64) - y64)
    assert np.linalg.norm(y - y64) <= 1.5 * floor + 1e-6 * np.linalg.norm(y64)


def test_split_k_epilogue_reference():
    """gemm_finish (the JAX twin of the split-K epilogue kernel) adds partials in split order and
    scales as the GEMM's own epilogue: (acc * 2^(14 - w_shift)) * (global_w[n] * global_x[m]),
    rounded once."""
    rng = np.random.default_rng(8)
    parts = jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32) * 2.0**-14
    xg = jnp.asarray(rng.random(5) + 0.5, jnp.float32)
    wg = jnp.asarray(rng.random((2, 7)) + 0.5, jnp.float32)
    got = kernels.gemm_finish(parts, xg, wg, jnp.int32(1), stacked=True)
    acc = (parts[0] + parts[1]) + parts[2]
    want = ((acc * 128.0) * (wg[1][None, :] * xg[:, None])).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    scalar = kernels.gemm_finish(parts, xg, jnp.float32(2.0), jnp.int32(0), stacked=False)
    want = ((acc * 128.0) * (2.0 * xg[:, None])).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(scalar, np.float32), np.asarray(want, np.float32))


def _decode_step_entries(cfg, batch: int) -> list[str]:
    """Names of the PTX kernels in the CUDA lowering of one decode step of a random model."""
    return re.findall(r"name = \\22(\w+)\\22", decode_step_cuda_text(cfg, batch))


def test_config_gemm_min_m_reaches_the_decoder(stub_compilers):
    """Config.gemm_min_m picks the kernel of the decoder's W4A4 linears: at batch 2 the default
    (8) keeps the four linears of the scanned layer on the GEMV, gemm_min_m=2 sends them to
    the GEMM; a bad value is refused."""
    cfg = rconfig.Config(
        quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
        linear_fusion="unfused",
    )  # fmt: skip
    default = _decode_step_entries(cfg, 2)
    assert default.count("nvfp4_gemv_w4a4") == 4 and nvfp4_gemm.ENTRY not in default, default
    low = _decode_step_entries(rconfig.Config(**{**cfg.__dict__, "gemm_min_m": 2}), 2)
    assert low.count(nvfp4_gemm.ENTRY) == 4 and "nvfp4_gemv_w4a4" not in low, low
    with pytest.raises(ValueError, match="gemm_min_m must be an int >= 1, got 0"):
        rconfig.Config(gemm_min_m=0)
    # linear_fusion="split" (the default): the quantizer kernel, then the linear M picks
    split = rconfig.Config(**{**cfg.__dict__, "linear_fusion": "split"})
    default = _decode_step_entries(split, 2)
    assert default.count(nvfp4_quant.ENTRY) == 4 and default.count("nvfp4_gemv_w4a4") == 4
    assert nvfp4_gemm.ENTRY not in default, default
    low = _decode_step_entries(rconfig.Config(**{**split.__dict__, "gemm_min_m": 2}), 2)
    assert low.count(nvfp4_quant.ENTRY) == 4 and low.count(nvfp4_gemm.ENTRY) == 4, low
    assert "nvfp4_gemv_w4a4" not in low, low


def test_config_gemm_occupancy_reaches_the_decoder(stub_compilers):
    """Config.gemm_occupancy="fill" and "wide" build the decoder's batch-16 GEMMs
    with their plans (64-row weight tiles; fill's splits and pipeline depths), for the unfused
    and the split linears; "base" with the base plan; "fill16" the batch-8 GEMMs with the
    16-token tiles of batch 16; the field offers what GemmOptions does, and a bad value is
    refused."""
    assert rconfig.GEMM_OCCUPANCIES == nvfp4_gemm.OCCUPANCIES
    assert rconfig.Config().gemm_occupancy == nvfp4_gemm.DEFAULT_OPTIONS.occupancy == "fill16"
    base = rconfig.Config(
        quant="nvfp4", hidden_size=1024, intermediate_size=2048, head_dim=64, num_heads=8,
        num_kv_heads=4, linear_fusion="unfused",
    )  # fmt: skip
    for fusion in ("unfused", "split"):
        for occupancy, batch in (("base", 16), ("wide", 16), ("fill", 16), ("fill16", 8)):
            cfg = rconfig.Config(
                **{**base.__dict__, "linear_fusion": fusion, "gemm_occupancy": occupancy}
            )
            stub_compilers.clear()
            nvfp4_gemm._build_cached.cache_clear()  # record every GEMM this lowering builds
            entries = _decode_step_entries(cfg, batch)
            assert entries.count(nvfp4_gemm.ENTRY) == 4, entries
            opts = nvfp4_gemm.GemmOptions(occupancy=occupancy)
            gemms = [d for _, d in stub_compilers if "SPLITK" in d]
            assert len(gemms) >= 4, stub_compilers
            for d in gemms:
                assert d["M_TOK"] == batch, d
                p = nvfp4_gemm.plan(d["M_TOK"], d["N_OUT"], d["K_IN"], options=opts)
                got = (d["WR"], d["SPLITK"], d["STAGES"], d["TM"], d["KT"])
                assert got == (p.wr, p.splitk, p.stages, p.tm, p.kt), (fusion, occupancy, d)
                assert d["WR"] == (2 if occupancy == "base" else 1), d
                # fill16: batch 8 runs the 16-token tile of batch 16, with its static copies
                if occupancy == "fill16":
                    assert (d["TM"], d.get("STATIC_COPIES")) == (16, 1), d
    with pytest.raises(ValueError, match="unknown gemm_occupancy 'full'"):
        rconfig.Config(gemm_occupancy="full")


def test_config_gemm_reduce_reaches_the_decoder(stub_compilers):
    """Config.gemm_reduce="cluster" builds the decoder's batch-16 K-split GEMMs with the cluster
    reduction (no finish kernel: one launch per linear); "finish" (the default) with the finish
    kernel; the field offers what GemmOptions does, and a bad value is refused."""
    assert rconfig.GEMM_REDUCES == nvfp4_gemm.REDUCES
    assert rconfig.Config().gemm_reduce == nvfp4_gemm.DEFAULT_OPTIONS.reduce == "finish"
    base = rconfig.Config(
        quant="nvfp4", hidden_size=1024, intermediate_size=2048, head_dim=64, num_heads=8,
        num_kv_heads=4,
    )  # fmt: skip
    for reduce in ("finish", "cluster"):
        cfg = rconfig.Config(**{**base.__dict__, "gemm_reduce": reduce})
        stub_compilers.clear()
        nvfp4_gemm._build_cached.cache_clear()
        entries = _decode_step_entries(cfg, 16)
        assert entries.count(nvfp4_gemm.ENTRY) == 4, entries
        gemms = [d for _, d in stub_compilers if "SPLITK" in d]
        split = [d for d in gemms if d["SPLITK"] > 1]
        assert split, gemms  # the wide plan splits K at batch 16
        assert all(d["CLUSTER_RED"] == (reduce == "cluster") for d in split), split
        finishes = entries.count(nvfp4_gemm.FINISH_ENTRY)
        assert finishes == (0 if reduce == "cluster" else len(split)), (reduce, entries)
    with pytest.raises(ValueError, match="unknown gemm_reduce 'atomic'"):
        rconfig.Config(gemm_reduce="atomic")


def test_config_gemm_copies_reaches_the_decoder(stub_compilers):
    """Config.gemm_copies reaches every GEMM the decoder builds, fused linears or not: at batch
    16 "auto" (the default) and "static" compile the static copies, "loop" the loops; the field
    offers what GemmOptions does, and a bad value is refused."""
    assert rconfig.GEMM_COPIES == nvfp4_gemm.COPIES
    assert rconfig.Config().gemm_copies == nvfp4_gemm.DEFAULT_OPTIONS.copies == "auto"
    base = rconfig.Config(
        quant="nvfp4", hidden_size=1024, intermediate_size=2048, head_dim=64, num_heads=8,
        num_kv_heads=4,
    )  # fmt: skip
    for copies, fusion in (("auto", "split"), ("loop", "split"), ("static", "split"),
                           ("loop", "unfused")):  # fmt: skip
        cfg = rconfig.Config(**{**base.__dict__, "gemm_copies": copies, "linear_fusion": fusion})
        stub_compilers.clear()
        nvfp4_gemm._build_cached.cache_clear()
        entries = _decode_step_entries(cfg, 16)
        assert entries.count(nvfp4_gemm.ENTRY) == 4, entries
        gemms = [d for _, d in stub_compilers if "SPLITK" in d]
        assert gemms
        static = copies != "loop"
        assert all(("STATIC_COPIES" in d) == static for d in gemms), (copies, gemms)
        assert all(("MAX_REGS" in d) == static for d in gemms), (copies, gemms)
    with pytest.raises(ValueError, match="unknown gemm_copies 'unrolled'"):
        rconfig.Config(gemm_copies="unrolled")


def test_split_m_gives_every_row_count_the_same_k_split():
    """GemmOptions.split_m: the K split is planned as for split_m rows at every M, so a row adds
    its K in the same split order whatever batch it runs in (the default plan changes the split
    with M on the qkv and gate_up shapes); explicit splitk still wins; bad values are refused;
    Config.invariant_rows reaches the decoder's GEMM options."""
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    varies = False
    for n, k in shapes:
        plain = {nvfp4_gemm.plan(m, n, k).splitk for m in (8, 16, 32, 64)}
        varies |= len(plain) > 1
        opts = nvfp4_gemm.GemmOptions(split_m=64)
        fixed = {nvfp4_gemm.plan(m, n, k, options=opts).splitk for m in (8, 16, 32, 64)}
        assert fixed == {nvfp4_gemm.plan(64, n, k).splitk}, (n, k, fixed)
    assert varies  # otherwise this test shows nothing
    both = nvfp4_gemm.GemmOptions(split_m=64, splitk=2)
    assert nvfp4_gemm.plan(16, 6144, 4096, options=both).splitk == 2
    with pytest.raises(nvfp4_gemm.KernelError, match="split_m"):
        nvfp4_gemm.GemmOptions(split_m=0)
    with pytest.raises(ValueError, match="invariant_rows"):
        rconfig.Config(invariant_rows=-1)
    assert rlayers.gemm_options(None, split_m=64).split_m == 64


def test_invariant_rows_pads_float_matmuls_and_plans_the_gemm_split(stub_compilers):
    """Config.invariant_rows: a bf16 decode step at 2 rows runs its linears and the lm_head as
    16-row matmuls (zero-padded rows, sliced back); an NVFP4 step at 16 rows builds its GEMMs
    with the K split of 64 rows."""
    cfg = rconfig.Config(hidden_size=256, intermediate_size=512, head_dim=64, num_layers=2)
    plain = decode_step_cuda_text(cfg, 2)
    padded = decode_step_cuda_text(dataclasses.replace(cfg, invariant_rows=16), 2)
    rows = lambda text: sorted(
        set(re.findall(r"stablehlo\.dot_general[^\n]*: \(tensor<(\d+)x", text))
    )
    assert rows(plain) == ["2"] and rows(padded) == ["16"], (rows(plain), rows(padded))
    # qkv 6144 x 4096: the default plan splits K 6 ways at 16 rows, 8 at 64
    nv = rconfig.Config(quant="nvfp4", hidden_size=4096, intermediate_size=256, head_dim=128,
                        num_heads=32, num_kv_heads=8, num_layers=1)  # fmt: skip
    assert nvfp4_gemm.plan(16, 6144, 4096).splitk != nvfp4_gemm.plan(64, 6144, 4096).splitk
    split = {}
    for invariant in (None, 64):
        stub_compilers.clear()
        decode_step_cuda_text(dataclasses.replace(nv, invariant_rows=invariant), 16)
        split[invariant] = {
            d["SPLITK"] for name, d in stub_compilers
            if name == nvfp4_gemm.SOURCE and d["N_OUT"] == 6144
        }  # fmt: skip
    assert split == {
        None: {nvfp4_gemm.plan(16, 6144, 4096).splitk},
        64: {nvfp4_gemm.plan(64, 6144, 4096).splitk},
    }, split


def test_fill_plan_takes_kt256_for_tiles_of_up_to_16_tokens():
    """The "fill" plan stages K in 256-element steps for M = 9..16 when K allows it (the
    H200 measured KT 256 faster there and slower at M = 32 and 64); other plans keep 128. The
    default "fill16" takes it from 1 row (its 16-token tile)."""
    fill = nvfp4_gemm.GemmOptions(occupancy="fill")
    for n, k in [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)]:
        for m, kt in [(9, 256), (16, 256), (17, 128), (32, 128), (64, 128), (8, 128)]:
            p = nvfp4_gemm.plan(m, n, k, options=fill)
            assert p.kt == kt and p.defines()["KT"] == kt, (m, n, k, p.kt)
            assert nvfp4_gemm.check_shape(m, n, k, fill)[0] and p.splitk <= k // p.kt
        for m, kt in [(1, 256), (8, 256), (16, 256), (17, 128)]:
            p = nvfp4_gemm.plan(m, n, k)
            assert p.kt == kt and p.defines()["KT"] == kt, (m, n, k, p.kt)
            assert nvfp4_gemm.check_shape(m, n, k)[0] and p.splitk <= k // p.kt
    assert nvfp4_gemm.plan(16, 4096, 4224).kt == 128  # K = 33 x 128: not a multiple of 256
    assert nvfp4_gemm.plan(16, 4096, 4096, options=nvfp4_gemm.GemmOptions(kt=128)).kt == 128
    wide = nvfp4_gemm.GemmOptions(occupancy="wide")
    assert nvfp4_gemm.plan(16, 4096, 4096, options=wide).kt == 128


# ----------------------------------------------------------------------------- dot dequantizer


def _stacked_weight(rng, layers: int, n: int, k: int, per_row: bool) -> nvfp4.Nvfp4Tensor:
    ws = [
        nvfp4.quantize_weight(rng.standard_normal((n, k)).astype(np.float32)) for _ in range(layers)
    ]
    g = np.stack([np.asarray(w.global_scale, np.float32) for w in ws])
    if per_row:
        g = g[:, None] * rng.uniform(0.5, 2.0, (layers, n)).astype(np.float32)
    return dataclasses.replace(nvfp4.stack(ws), global_scale=jnp.asarray(g))


@pytest.mark.parametrize("per_row", [False, True])
def test_matmul_q_values_is_the_dot_order(per_row):
    """nvfp4.matmul_q_values (the dot path on given bf16 weight values) equals
    nvfp4_matmul_q(order="dot") bitwise when the values are scaled_values_bf16 of the weight,
    for a scalar and a per-row global scale; and those values are exact (e2m1 * SF)."""
    rng = np.random.default_rng(3)
    w = nvfp4.take(_stacked_weight(rng, 1, 48, 256, per_row), 0)
    xq = nvfp4.quantize_activation(jnp.asarray(rng.standard_normal((20, 256)), jnp.bfloat16))
    got = nvfp4.matmul_q_values(xq, nvfp4.scaled_values_bf16(w), w.global_scale)
    want = nvfp4.nvfp4_matmul_q(xq, w, order="dot")
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    # the bf16 values are exact: e2m1 * SF in float32 unchanged by the cast
    codes = np.asarray(nvfp4.unpack_e2m1(w.packed))
    sf = np.asarray(w.scales.astype(jnp.float32)).repeat(16, axis=1)
    exact = nvfp4.E2M1_VALUES[codes] * sf
    assert np.array_equal(np.asarray(nvfp4.scaled_values_bf16(w), np.float32), exact)


@pytest.mark.parametrize("per_row", [False, True])
def test_dot_with_kernel_reads_the_layer(monkeypatch, per_row):
    """linear.dot_with_kernel on stacked operands: with the kernel's values given as
    scaled_values_bf16 of the layer named by the device index (what the kernel writes), the
    result equals the reference dot of that layer bitwise: the layer's global scale, not
    another's, and unstacked operands too."""
    rng = np.random.default_rng(4)
    n, k, m = 64, 256, 24
    w = _stacked_weight(rng, 3, n, k, per_row)
    xq = nvfp4.quantize_activation(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16))
    xs = jax.lax.bitcast_convert_type(xq.scales, jnp.uint8)
    xg = jnp.broadcast_to(jnp.asarray(xq.global_scale, jnp.float32), (m,))
    ws = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
    seen = []

    def fake_call(config, out, wp3, ws3, layer):
        # the dequantizer kernel's contract: stacked operands, the layer index, bf16 [N, K]
        assert nvfp4_dequant.ENTRY in config and out.shape == (n, k) and layer.shape == ()
        seen.append((wp3.shape, ws3.shape))
        t = nvfp4.Nvfp4Tensor(packed=wp3, scales=jax.lax.bitcast_convert_type(ws3, jnp.float8_e4m3fn),
                              global_scale=jnp.ones((wp3.shape[0],), jnp.float32),
                              shape=(n, k))  # fmt: skip
        return nvfp4.scaled_values_bf16(nvfp4.take(t, layer))

    monkeypatch.setattr(_dispatch, "ptx_call", fake_call)
    kern = nvfp4_dequant.DequantKernel(n=n, k=k, ptx="")
    for layer in (0, 2):
        got = kernels.dot_with_kernel(
            xq.packed, xs, xg, w.packed, ws, w.global_scale, jnp.int32(layer), k=k, kernel=kern
        )
        want = nvfp4.nvfp4_matmul_q(xq, nvfp4.take(w, layer), order="dot")
        assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    assert seen[0] == ((3, n, k // 2), (3, n, k // 16))
    one = nvfp4.take(w, 1)
    got = kernels.dot_with_kernel(
        xq.packed, xs, xg, one.packed, jax.lax.bitcast_convert_type(one.scales, jnp.uint8),
        one.global_scale, jnp.int32(1), k=k, kernel=kern,
    )  # fmt: skip
    want = nvfp4.nvfp4_matmul_q(xq, one, order="dot")
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    assert seen[-1] == ((1, n, k // 2), (1, n, k // 16))  # unstacked: one layer, index 0


def test_dot_dequant_kernel_lowers_above_max_m(stub_compilers):
    """GemmOptions(dot_dequant="kernel") above max_m rows (the wgmma range off, as above
    2048 rows by default): the plain and the fused linear ("two") lower to one dequantizer call
    (the stacked operands in place, its grid) and one dot (as the default does above the
    wgmma range), the fused linear's activations from one quantizer call; "xla" has no
    dequantizer call; at or below max_m the GEMM runs either way."""
    from rejax.ops import fused_linear as fl

    rng = np.random.default_rng(6)
    n, k = 256, 512
    w = _stacked_weight(rng, 2, n, k, False)
    on = nvfp4_gemm.GemmOptions(dot_dequant="kernel", wgmma_min_m=None)
    xla = nvfp4_gemm.GemmOptions(dot_dequant="xla", wgmma_min_m=None)
    for m in (257, 512):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        text = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, layer=1, gemm_options=on), x)
        calls = [c for c in _calls(text) if c[0] == "__gpu$xla.gpu.ptx"]
        assert len(calls) == 1, text[:2000]
        _, _, attrs, types = calls[0]
        fields = _fields(attrs)
        dq = nvfp4_dequant.build(n, k)
        assert fields["name"] == nvfp4_dequant.ENTRY and fields["output_indices"] == "3"
        assert int(fields["grid_x"]) == dq.grid == -(-(n * k // 8) // (256 * 4))
        assert int(fields["block_x"]) == 256
        assert types.strip().startswith(f"(tensor<2x{n}x{k // 2}xui8>, tensor<2x{n}x{k // 16}xui8>")
        assert re.search(rf"-> tensor<{n}x{k}xbf16>", text) and "dot_general" in text
        x_above = jnp.zeros((2049, k), jnp.bfloat16)  # above the default wgmma range
        default = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, layer=1), x_above)
        assert default.count(nvfp4_dequant.ENTRY) == text.count(nvfp4_dequant.ENTRY) > 0
        off = _lower_cuda(lambda x: kernels.nvfp4_linear(x, w, layer=1, gemm_options=xla), x)
        assert nvfp4_dequant.ENTRY not in off and "dot_general" in off
        two = _lower_cuda(lambda x: fl.fused_linear(x, {"weight": w}, layer=1, kernels="two",
                                                    prologue="rmsnorm", norm=jnp.ones((k,)),
                                                    gemm_options=on), x)  # fmt: skip
        # the fused linear's activations from the quantizer kernel (dot_x "kernel", the default)
        names = re.findall(r"name = \\22(\w+)\\22", two)
        assert names == [nvfp4_quant.ENTRY, nvfp4_dequant.ENTRY], two[:2000]
    low = _lower_cuda(
        lambda x: kernels.nvfp4_linear(x, w, layer=1, gemm_options=on),
        jnp.zeros((64, k), jnp.bfloat16),
    )
    assert nvfp4_dequant.ENTRY not in low and nvfp4_gemm.ENTRY in low


def test_config_gemm_dot_dequant(stub_compilers):
    """Config.gemm_dot_dequant="kernel" reaches a 512-token prefill's four W4A4 linears (one
    dequantizer call each, under "split" and "unfused"; the wgmma range off), as the default
    does; "xla" has none; a bad value is refused before any work."""
    assert rconfig.Config().gemm_dot_dequant == nvfp4_gemm.DEFAULT_OPTIONS.dot_dequant == "kernel"
    assert rconfig.GEMM_DOT_DEQUANTS == nvfp4_gemm.DOT_DEQUANTS
    base, params = _tiny_prefill_model()

    def entries(cfg):
        return _prefill_entries(params, cfg, 512)

    for fusion in ("split", "unfused"):
        cfg = dataclasses.replace(base, linear_fusion=fusion, gemm_wgmma_min_m=None)
        on = entries(dataclasses.replace(cfg, gemm_dot_dequant="kernel"))
        assert on.count(nvfp4_dequant.ENTRY) == 4 and nvfp4_gemm.ENTRY not in on, (fusion, on)
        assert entries(cfg).count(nvfp4_dequant.ENTRY) == 4
        assert nvfp4_dequant.ENTRY not in entries(dataclasses.replace(cfg, gemm_dot_dequant="xla"))
    with pytest.raises(ValueError, match="unknown gemm_dot_dequant 'cuda'"):
        rconfig.Config(gemm_dot_dequant="cuda")
    with pytest.raises(cbuild.KernelError, match="dot_dequant='cuda', expected one of"):
        nvfp4_gemm.GemmOptions(dot_dequant="cuda")


def _stream_functions(text: str) -> tuple[set, dict]:
    """(names of the functions called with XLA's stream-1 annotation, {function name: its
    body}) of a lowered module's text."""
    marked = set(re.findall(r'call @([\w.]+)\(.*_xla_stream_annotation = "1"', text))
    bodies = dict(
        re.findall(r"func\.func (?:private |public )?@([\w.]+)(.*?)\n  }", text, re.DOTALL)
    )
    return marked, bodies


def _names(text: str) -> list[str]:
    return re.findall(r"name = \\22(\w+)\\22", text)


def test_config_gemm_dot_stream_marks_the_dequantizer_calls(stub_compilers):
    """Config.gemm_dot_stream="side" reaches a 512-token prefill's four dot-path linears
    ("split" and "unfused", the wgmma range off) and rejax.ops.dot_block's three ("block"):
    each dequantizer call sits alone in a function called with XLA's stream-1 annotation
    (`compute_on("gpu_stream:1")`), and no dot does; the default "main" marks nothing. A bad
    value is refused."""
    assert rconfig.Config().gemm_dot_stream == nvfp4_gemm.DEFAULT_OPTIONS.dot_stream == "main"
    assert rconfig.GEMM_DOT_STREAMS == nvfp4_gemm.DOT_STREAMS
    base, params = _tiny_prefill_model()

    def lowered(cfg):
        return _prefill_text(params, cfg, 512)

    for fusion, finish, n_dq in (("split", "split", 4), ("unfused", "split", 4),
                                 ("split", "block", 4)):  # fmt: skip
        cfg = dataclasses.replace(base, linear_fusion=fusion, gemm_wgmma_min_m=None,
                                  gemm_dot_finish=finish)  # fmt: skip
        side = lowered(dataclasses.replace(cfg, gemm_dot_stream="side"))
        marked, bodies = _stream_functions(side)
        assert _names(side).count(nvfp4_dequant.ENTRY) == n_dq, (fusion, finish)
        assert len(marked) == n_dq, (fusion, finish, marked)
        for name in marked:
            assert _names(bodies[name]) == [nvfp4_dequant.ENTRY], bodies[name][:500]
            assert "dot_general" not in bodies[name]
        for line in side.splitlines():
            if "dot_general" in line:
                assert "_xla_stream_annotation" not in line
        main = lowered(cfg)
        assert _names(main).count(nvfp4_dequant.ENTRY) == n_dq
        assert "_xla_stream_annotation" not in main, (fusion, finish)
    with pytest.raises(ValueError, match="unknown gemm_dot_stream 'gpu1'"):
        rconfig.Config(gemm_dot_stream="gpu1")
    with pytest.raises(cbuild.KernelError, match="dot_stream='gpu1', expected one of"):
        nvfp4_gemm.GemmOptions(dot_stream="gpu1")


def test_config_gemm_dot_x_puts_a_barrier_before_the_dot(stub_compilers):
    """Config.gemm_dot_x="materialized" reaches a 512-token prefill's four W4A4 dot-path
    linears (the dequantizer kernel's, the wgmma range off; "split" and "unfused"): each dot's
    activation operand comes out of an optimization barrier, so XLA cannot fuse their decode
    into its GEMM; the default "fused" has no barrier; "kernel" puts the quantizer kernel in
    front of the fused linears' dots. The values are the same: on the CPU `matmul_q_values`
    with and without the barrier, and `matmul_x_values` on the decoded values, give the same
    bits. A bad value is refused."""
    assert rconfig.Config().gemm_dot_x == nvfp4_gemm.DEFAULT_OPTIONS.dot_x == "kernel"
    assert rconfig.GEMM_DOT_XS == nvfp4_gemm.DOT_XS
    base, params = _tiny_prefill_model()

    def lowered(cfg):
        return _prefill_text(params, cfg, 512)

    for fusion in ("split", "unfused"):
        # gemm_dot_finish "split": every fused linear's own quantizer (not rejax.ops.dot_block)
        cfg = dataclasses.replace(base, linear_fusion=fusion, gemm_wgmma_min_m=None,
                                  gemm_dot_finish="split")  # fmt: skip
        on = lowered(dataclasses.replace(cfg, gemm_dot_x="materialized"))
        names = re.findall(r"name = \\22(\w+)\\22", on)
        assert names.count(nvfp4_dequant.ENTRY) == 4, (fusion, names)
        # one barrier per linear, each of a [512, K] bf16 operand that a dot_general takes
        barriers = re.findall(r"(%\S+) = stablehlo.optimization_barrier (%\S+) : "
                              r"tensor<512x(\d+)xbf16>", on)  # fmt: skip
        assert len(barriers) == 4, (fusion, barriers)
        for out, _, _ in barriers:
            assert re.search(rf"stablehlo.dot_general {re.escape(out)}, ", on), (fusion, out)
        off = lowered(dataclasses.replace(cfg, gemm_dot_x="fused"))
        assert "optimization_barrier" not in off
        assert re.findall(r"name = \\22(\w+)\\22", off).count(nvfp4_dequant.ENTRY) == 4
        # "kernel": the fused linears ("split") quantize with the quantizer kernel's
        # "xhat_bf16" form (XHAT_OUT 3) in front of the dequantizer and the dot, no barrier
        # and no XLA op on the activations; plain linears ("unfused") as "materialized"
        kern = lowered(dataclasses.replace(cfg, gemm_dot_x="kernel"))
        names = re.findall(r"name = \\22(\w+)\\22", kern)
        assert names.count(nvfp4_dequant.ENTRY) == 4, (fusion, names)
        if fusion == "split":
            assert names.count(nvfp4_quant.ENTRY) == 4, names
            assert any(d.get("XHAT_OUT") == 3 for _, d in stub_compilers)
            # no RMSNorm of the 512 rows as XLA ops (the final norm of the last row stays)
            assert "optimization_barrier" not in kern
            assert not re.search(r"stablehlo.rsqrt %\S+ : tensor<512x", kern)
            assert re.search(r"stablehlo.rsqrt %\S+ : tensor<512x", on)
        else:
            assert nvfp4_quant.ENTRY not in names
            assert kern.count("stablehlo.optimization_barrier") == 4
    rng = np.random.default_rng(9)
    xp = jnp.asarray(rng.integers(0, 256, (16, 64), dtype=np.uint8))
    xs = jnp.asarray(rng.integers(0x30, 0x40, (16, 8), dtype=np.uint8)).view(jnp.float8_e4m3fn)
    xq = nvfp4.Nvfp4Tensor(packed=xp, scales=xs, global_scale=jnp.float32(0.5), shape=(16, 128))
    wv = jnp.asarray(rng.standard_normal((32, 128)), jnp.bfloat16)
    plain = nvfp4.matmul_q_values(xq, wv, jnp.float32(2.0))
    barred = jax.jit(lambda q, w: nvfp4.matmul_q_values(q, w, jnp.float32(2.0), x_barrier=True))
    np.testing.assert_array_equal(np.asarray(barred(xq, wv)), np.asarray(plain))
    xv = nvfp4.scaled_values_bf16(xq)
    from_values = nvfp4.matmul_x_values(xv, jnp.full((16,), 0.5, jnp.float32), wv, 2.0)
    np.testing.assert_array_equal(np.asarray(from_values), np.asarray(plain))
    with pytest.raises(ValueError, match="unknown gemm_dot_x 'cuda'"):
        rconfig.Config(gemm_dot_x="cuda")
    with pytest.raises(cbuild.KernelError, match="dot_x='cuda', expected one of"):
        nvfp4_gemm.GemmOptions(dot_x="cuda")


def test_dequant_kernel_checks_and_compiles():
    """The dequantizer refuses a K that is not a multiple of 16 and bad `groups` before NVRTC;
    with NVRTC its PTX has the entry with 3 operands and the result."""
    with pytest.raises(cbuild.KernelError, match="K=40 \\(expected a multiple of 16"):
        nvfp4_dequant.build(64, 40)
    with pytest.raises(cbuild.KernelError, match="groups=0"):
        nvfp4_dequant.build(64, 64, groups=0)
    assert nvfp4_dequant.check_shape(4096, 4096) == (True, "")
    if not cbuild.nvrtc_available():
        pytest.skip("NVRTC (cuda-python) not installed")
    kern = nvfp4_dequant.build(4096, 12288, arch="compute_90")
    assert cbuild.ptx_entries(kern.ptx)[nvfp4_dequant.ENTRY] == nvfp4_dequant.N_INPUTS + 1
