"""Tests of the wgmma GEMM experiment (cuda_ops/nvfp4_gemm_wgmma.*), CPU only: the x_hat
K order, a numpy emulation of one warpgroup's data flow (register A fragments from the decode,
the shared-memory x tile through the matrix descriptor), the plans of the device check, and
NVRTC builds of every planned kernel (registers, no spills, no wgmma serialization)."""

import dataclasses
import re

import numpy as np
import pytest

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemm_wgmma as wgm
from experiments import sass as _sass

needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)
needs_nvdisasm = pytest.mark.skipif(
    not cbuild.nvrtc_available() or _sass.nvdisasm_path() is None,
    reason="NVRTC or nvdisasm (the test extras) missing",
)


# ----------------------------------------------------------------------------- K order


@pytest.mark.parametrize("shape", [(256,), (3, 512), (2, 2, 128)])
def test_wgmma_order_is_a_permutation_that_round_trips(shape):
    x = np.arange(np.prod(shape)).reshape(shape)
    y = wgm.to_wgmma_order(x)
    assert y.shape == x.shape
    assert np.array_equal(np.sort(y, axis=-1), np.sort(x, axis=-1))  # a permutation per row
    assert np.array_equal(wgm.from_wgmma_order(y), x)
    assert np.array_equal(wgm.to_wgmma_order(wgm.from_wgmma_order(x)), x)
    # permutes inside 128-element chunks only
    k = shape[-1]
    assert np.array_equal(y.reshape(-1, k // 128, 128) // 128, x.reshape(-1, k // 128, 128) // 128)


def test_wgmma_order_matches_the_kernel_formula():
    """x_w[128c + 16s + 8b + 2t + j] = x[128c + 32t + 8u + 2v + b + 4j], s = 2u + v."""
    x = np.arange(256)
    y = wgm.to_wgmma_order(x)
    for c in range(2):
        for t in range(4):
            for u in range(4):
                for v in range(2):
                    for b in range(2):
                        for j in range(2):
                            dst = 128 * c + 16 * (2 * u + v) + 8 * b + 2 * t + j
                            assert y[dst] == 128 * c + 32 * t + 8 * u + 2 * v + b + 4 * j


def test_wgmma_order_rejects_partial_chunks():
    with pytest.raises(ValueError):
        wgm.to_wgmma_order(np.zeros((2, 192)))
    with pytest.raises(ValueError):
        wgm.from_wgmma_order(np.zeros((2, 64)))


def test_x_operand_holds_the_production_values_in_wgmma_order():
    """wgmma_x_operand (XLA) = to_wgmma_order of the natural x_hat, and the same values as the
    production operand (rejax.ops.linear.gemm_x_operand) up to the two permutations."""
    import jax.numpy as jnp

    from rejax.ops import linear

    rng = np.random.default_rng(0)
    m, k = 3, 512
    xp = jnp.asarray(rng.integers(0, 256, (m, k // 2), dtype=np.uint8))
    xs = jnp.asarray(rng.integers(0x20, 0x78, (m, k // 16), dtype=np.uint8))
    ours = np.asarray(wgm.wgmma_x_operand(xp, xs))
    prod = np.asarray(linear.gemm_x_operand(xp, xs))
    assert ours.dtype == np.float16 and ours.shape == (m, k)
    # production: x_perm[m, 128c + 32u + 8t + jj] = x[m, 128c + 32t + 8u + jj // 2 + 4 (jj % 2)]
    natural = prod.reshape(m, k // 128, 4, 4, 4, 2).transpose(0, 1, 3, 2, 5, 4).reshape(m, k)
    assert np.array_equal(ours, wgm.to_wgmma_order(natural))
    assert np.array_equal(wgm.from_wgmma_order(ours), natural)


# ----------------------------------------------------------------------------- emulation


def _x_chunks(tm, kt, nt, static):
    """load_stage's x tile copies as (thread, token m, column q, shared byte offset): the loop
    from each thread's index, or with `static` (STATIC_COPIES, where nt divides the chunks and
    8 x chunks-a-token divides nt) the unrolled form's per-thread column and advancing group."""
    xch, x_col = kt // 8, 16 * tm
    out = []
    if static:
        assert nt % (8 * xch) == 0 and (tm * xch) % nt == 0
        groups = nt // (8 * xch)
        for tid in range(nt):
            mr, q, mg0 = tid & 7, (tid >> 3) % xch, (tid >> 3) // xch
            for j in range(tm * xch // nt):
                mg = mg0 + j * groups
                out.append((tid, 8 * mg + mr, q, q * x_col + mr * 16 + mg * 128))
        return out
    for tid in range(nt):
        for i in range(tid, tm * xch, nt):
            mr, q, mg = i & 7, (i >> 3) % xch, (i >> 3) // xch
            out.append((tid, 8 * mg + mr, q, q * x_col + mg * 128 + mr * 16))
    return out


@pytest.mark.parametrize(("tm", "kt", "nt"), [(8, 128, 128), (64, 128, 128), (128, 128, 256),
                                              (256, 128, 256), (32, 256, 256)])  # fmt: skip
def test_static_x_tile_copies_are_the_loop_copies(tm, kt, nt):
    """STATIC_COPIES moves the x tile's same chunks to the same places as the loop, each thread the same
    ones (the unrolled form only changes how a thread walks its chunks)."""
    loop, static = _x_chunks(tm, kt, nt, False), _x_chunks(tm, kt, nt, True)
    assert sorted(loop) == sorted(static) and len(loop) == tm * kt // 8
    assert len({c[3] for c in loop}) == len(loop)  # every chunk lands in its own 16 bytes


def _emulate_warpgroup(wd, xn, tm, kt, desc_swap=False):
    """One warpgroup, one stage, as the kernel moves data: wd [64, KT] decoded weights (natural
    K), xn [TM, KT] x_hat (natural K). Returns D [64, TM] = sum over k16 steps of A . B, with
    A assembled from the lanes' decoded pairs per the wgmma register fragment and B read from
    the cp.async image of the x tile at the canonical K-major no-swizzle addresses of the
    step's descriptor."""
    x_col = 16 * tm
    lbo, sbo = (128, x_col) if desc_swap else (x_col, 128)
    xw = wgm.to_wgmma_order(xn)  # the global operand's stage
    smem = np.full(tm * kt, np.nan)  # in fp16 elements
    xch = kt // 8
    for i in range(tm * xch):  # load_stage's x chunk mapping
        mr, q, mg = i % 8, (i // 8) % xch, (i // 8) // xch
        m = 8 * mg + mr
        off = (q * x_col + mg * 128 + mr * 16) // 2
        assert np.isnan(smem[off : off + 8]).all()
        smem[off : off + 8] = xw[m, 8 * q : 8 * q + 8]
    assert not np.isnan(smem).any()
    d = np.zeros((64, tm))
    for h in range(kt // 128):
        for u in range(4):
            for v in range(2):
                a = np.full((64, 16), np.nan)
                for wq in range(4):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        ra, rb = 16 * wq + g, 16 * wq + g + 8
                        base = 128 * h + 32 * t + 8 * u  # code word u of chunk t

                        def pair(row, i, base=base):  # decode8's P_i = (e_i, e_{i+4})
                            return wd[row, base + i], wd[row, base + i + 4]

                        regs = [pair(ra, 2 * v), pair(rb, 2 * v), pair(ra, 2 * v + 1)]
                        regs.append(pair(rb, 2 * v + 1))
                        for r, (lo, hi) in enumerate(regs):  # wgmma A fragment of m64nNk16
                            row, col = 16 * wq + g + 8 * (r % 2), 2 * t + 8 * (r // 2)
                            assert np.isnan(a[row, col : col + 2]).all()
                            a[row, col], a[row, col + 1] = lo, hi
                assert not np.isnan(a).any()
                start = (8 * h + 2 * u + v) * 2 * x_col  # the step's descriptor start
                b = np.empty((16, tm))
                for kk in range(16):
                    for n in range(tm):
                        addr = (
                            start + (n % 8) * 16 + (n // 8) * sbo + (kk % 8) * 2 + (kk // 8) * lbo
                        )
                        b[kk, n] = smem[addr // 2]
                d += a @ b
    return d


@pytest.mark.parametrize("tm,kt", [(8, 128), (16, 128), (32, 256), (64, 128), (256, 128)])
def test_emulated_warpgroup_equals_the_dot(tm, kt):
    rng = np.random.default_rng(tm + kt)
    wd = rng.integers(-6, 7, (64, kt)).astype(np.float64)
    xn = rng.integers(-6, 7, (tm, kt)).astype(np.float64)
    assert np.array_equal(_emulate_warpgroup(wd, xn, tm, kt), wd @ xn.T)


def test_emulation_sees_a_swapped_descriptor():
    """The emulation is sensitive to the descriptor: LBO and SBO exchanged give another sum."""
    rng = np.random.default_rng(1)
    wd = rng.integers(-6, 7, (64, 128)).astype(np.float64)
    xn = rng.integers(-6, 7, (16, 128)).astype(np.float64)
    assert not np.array_equal(_emulate_warpgroup(wd, xn, 16, 128, desc_swap=True), wd @ xn.T)


# ----------------------------------------------------------------------------- plans, builds


def _check_problems():
    from experiments.kernels import check_gemm_wgmma

    return check_gemm_wgmma.problems()


def test_every_checked_problem_has_a_supported_plan():
    probs = _check_problems()
    assert len({(p.n, p.k) for tag, _, p in probs if tag == "model"}) == 4
    for _, _, p in probs:
        assert wgm.check_plan(p) == (True, ""), p
        assert p.tm >= min(p.m, 64) and p.smem <= wgm.SMEM_LIMIT
        assert 1 <= p.splitk <= p.k // p.kt // 4 or p.splitk == 1
    # the default variant has production's "wide" tiles and K split (the same CTAs): 64 rows
    # up to M = 16, 128 above
    from cuda_ops import nvfp4_gemm

    for tag, v, p in probs:
        if v == "wgmma":
            wide = nvfp4_gemm.GemmOptions(occupancy="wide")
            prod = nvfp4_gemm.plan(p.m, p.n, p.k, options=wide)
            assert (p.tile_n, p.splitk, p.grid[1:]) == (prod.tile_n, prod.splitk, prod.grid[1:])
    assert wgm.plan(64, 24576, 4096).grid == (1, 192, 3)
    # two CTAs per SM fit in shared memory at the decode shapes (228 KiB per SM, 1 KiB each)
    for m in (16, 32, 64):
        for opts in ({}, {"nwg": 2, "wr": 1}, {"kt": 256}):
            p = wgm.plan(m, 4096, 4096, **opts)
            assert 2 * (p.smem + 1024) <= 228 * 1024 or (m, opts.get("kt")) == (64, 256), (m, opts)


def test_plan_refusals():
    assert not wgm.check_plan(wgm.plan(16, 4096, 4000))[0]  # K not a multiple of 128
    assert not wgm.check_plan(wgm.plan(16, 4096, 4096, tm=24))[0]
    assert not wgm.check_plan(wgm.plan(16, 4096, 4096, stages=2))[0]
    # PIPE 2 needs three or more commit groups a stage: four code words of one group each
    assert wgm.check_plan(wgm.plan(256, 4096, 4096, tm=128, pipe=2)) == (True, "")
    assert not wgm.check_plan(wgm.plan(256, 4096, 4096, tm=128, pipe=2, group_words=2))[0]
    assert not wgm.check_plan(wgm.plan(256, 4096, 4096, tm=128, pipe=3))[0]


@needs_nvdisasm
def test_pipe2_keeps_two_groups_in_flight_inside_a_stage():
    """PIPE 2 (the wgmma_n128_xb_p2 variant): in the SASS of the 128-token BULK 3 kernel the
    stage's four commit groups wait with depth 1, 2, 2, 1 (two in flight during the middle
    decodes, one across the loop's back edge), against 1, 1, 1, 1 for PIPE 1; the final wait
    drains (0)."""
    import collections

    waits = {}
    for pipe in (1, 2):
        p = wgm.plan(512, 24576, 4096, tm=128, nwg=2, wr=1, bulk=3, pipe=pipe)
        assert ("PIPE" in p.defines()) == (pipe == 2)
        cubin = cbuild.compile_cubin(cbuild.read_source(wgm.SOURCE.name), p.defines(),
                                     arch=wgm.CUBIN_ARCH, name=wgm.SOURCE.name)  # fmt: skip
        listing = _sass.disassemble(cubin)
        waits[pipe] = collections.Counter(
            re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", listing)
        )
    assert waits[1] == {"0x1": 4, "0x0": 1}, waits
    assert waits[2] == {"0x1": 2, "0x2": 2, "0x0": 1}, waits


@needs_nvrtc
def test_every_planned_kernel_compiles_without_spills_or_serialization():
    """Each distinct plan of the device check: NVRTC PTX for sm_90a with both entries, and the
    sm_90a cubin's ptxas -v: no spills, registers for two CTAs per SM, and no
    "wgmma ... serialized" warning (ptxas breaking the async pipeline into waits)."""
    plans = list(dict.fromkeys(p for _, _, p in _check_problems()))
    kernels = wgm.prebuild(plans)
    for p, kern in zip(plans, kernels, strict=True):
        assert cbuild.ptx_target(kern.ptx) == "sm_90a"
        assert "wgmma.mma_async.sync.aligned.m64n" in kern.ptx
        rep = wgm.ptxas_report(p)
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (p, rep)
        regs = -(-rep["registers"] // 8) * 8  # allocated per thread in units of 8
        assert 2 * regs * p.threads <= 65536, (p, rep)  # two CTAs per SM by registers
        assert rep["serialized"] == [], (p, rep)


def test_large_tile_plans():
    """The 128 / 256-token tiles (opt-in, M >= 128): one CTA per SM by shared memory, a K split
    only where the tiles do not fill one wave, M = 200 padding the last tile."""
    from experiments.kernels import check_gemm_wgmma as chk

    assert wgm.plan(256, 4096, 4096).tm == 64  # the plan's own choice stays at 64
    probs = chk.problems(ms=(128, 256), variants=chk.LARGE_M_VARIANTS)
    assert {v for tag, v, _ in probs if tag == "odd_m_large"} == set(chk.LARGE_M_VARIANTS)
    for tag, v, p in probs:
        if v not in chk.LARGE_M_VARIANTS:
            continue  # the extra cases of the default variant
        assert wgm.check_plan(p) == (True, ""), p
        assert p.tm == chk.VARIANTS[v]["tm"] and p.smem <= wgm.SMEM_LIMIT
        assert 2 * (p.smem + 1024) > 228 * 1024  # one CTA per SM
        tiles = p.grid[0] * p.grid[1]
        if chk.VARIANTS[v].get("split_rule") == "wave":  # test_wave_split_rule
            assert p.splitk == wgm.wave_splitk(tiles, p.k // p.kt, wgm.DEFAULT_SMS), (v, p)
        else:
            assert p.splitk == 1 or tiles * p.splitk <= wgm.DEFAULT_SMS, (v, p)
    assert wgm.plan(256, 4096, 4096, tm=128, nwg=2, wr=1).grid == (2, 32, 2)
    assert wgm.plan(256, 24576, 4096, tm=128, nwg=2, wr=1).grid == (2, 192, 1)
    assert wgm.plan(200, 4096, 4096, tm=256, nwg=2, wr=1).grid == (1, 32, 4)


@needs_nvrtc
@pytest.mark.parametrize(
    "variant",
    ["wgmma_n128_wr2", "wgmma_n256", "wgmma_n128_g4", "wgmma_n128_wr2_g4", "wgmma_n128_bulk",
     "wgmma_n128_wr2_bulk", "wgmma_n128_wr2_g4_bulk", "wgmma_n128_xb", "wgmma_n128_wr2_xb",
     "wgmma_n128_xb_p2", "wgmma_n128_wr2_xb_p2", "wgmma_n256_xb_p2", "wgmma_n128_xb_r8",
     "wgmma_n256_xb_r4"],
)  # fmt: skip
def test_large_tile_kernels_compile_without_spills_or_serialization(variant):
    """The largest accumulators (128 floats a thread): no spills, no serialized wgmma, one
    CTA of 256 threads fits the register file."""
    from experiments.kernels import check_gemm_wgmma as chk

    p = wgm.plan(256, 24576, 4096, **chk.VARIANTS[variant])
    kern = wgm.build_plan(p)
    assert f"wgmma.mma_async.sync.aligned.m64n{p.tm}k16" in kern.ptx
    rep = wgm.ptxas_report(p)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert rep["serialized"] == [], rep
    assert -(-rep["registers"] // 8) * 8 * p.threads <= 65536, rep
    if p.group_words != 1:
        assert p.defines()["GROUP_WORDS"] == p.group_words
    else:
        assert "GROUP_WORDS" not in p.defines()  # the first form keeps its defines (cache keys)
    if p.bulk:  # no block barrier in the loop (one after the mbarrier init only)
        assert p.defines()["BULK"] == p.bulk
        assert kern.ptx.count("bar.sync") == 1
        copies = kern.ptx.count("cp.async.bulk.shared::cluster.global")
        if p.bulk == 1:  # three bulk copies a stage (prologue and loop copies), no cp.async
            assert copies >= 3 and copies % 3 == 0, copies
            assert "cp.async.cg" not in kern.ptx and "cp.async.ca" not in kern.ptx
        else:  # x's bulk copy; the weights' 16 / 8-byte cp.async pieces
            assert copies >= 1, copies
            assert "cp.async.cg.shared.global" in kern.ptx and "cp.async.ca" in kern.ptx
            assert "cp.async.mbarrier.arrive.noinc" in kern.ptx
    else:
        assert "BULK" not in p.defines() and "cp.async.bulk" not in kern.ptx


@needs_nvrtc
def test_descriptor_diagnostic_build_compiles():
    import dataclasses

    p = dataclasses.replace(wgm.plan(32, 4096, 4096), desc_swap=True)
    assert wgm.ptxas_report(p)["spill_stores"] == 0
    assert wgm.build_plan(p).plan.desc_swap


def test_wave_split_rule():
    """split_rule "wave" (an experiment): the K split that leaves the least of the last wave
    idle under SPLIT_PENALTY a split, within 1 .. min(MAX_SPLITK, K / KT / 4); "fill" (the
    default) splits only below one wave; a bad rule is refused."""
    assert wgm.wave_splitk(80, 40, 132) == 3  # 240 CTAs in 2 waves: 0.67 of a tile's time
    assert wgm.wave_splitk(160, 40, 132) == 4  # 640 CTAs in 5 waves: 1.25, against 2.0
    assert wgm.wave_splitk(132, 40, 132) == 1  # a full wave stays unsplit
    assert wgm.wave_splitk(80, 12, 132) == 3  # K / KT / 4 = 3 allows it
    assert wgm.wave_splitk(80, 8, 132) == 1  # capped at 2: 160 CTAs take 2 waves, no gain
    for tiles in range(1, 600, 7):  # never worse than the fill rule by the model's cost
        s = wgm.wave_splitk(tiles, 32, 132)
        fill = max(1, min(132 // tiles, 8, 8))

        def cost(v, tiles=tiles):
            return -(-tiles * v // 132) / v + wgm.SPLIT_PENALTY * (v - 1)

        assert 1 <= s <= 8 and cost(s) <= cost(fill) + 1e-9, (tiles, s, fill)
    wave = wgm.plan(256, 5120, 5120, tm=128, nwg=2, wr=1, bulk=3, split_rule="wave")
    fill = wgm.plan(256, 5120, 5120, tm=128, nwg=2, wr=1, bulk=3)
    assert (wave.grid, fill.grid) == ((2, 40, 3), (2, 40, 1))
    with pytest.raises(wgm.KernelError, match="split_rule='best', expected one of"):
        wgm.plan(256, 5120, 5120, tm=128, split_rule="best")


def test_raster_maps_each_cta_to_one_tile():
    """RASTER (`raster_tiles`, the kernel's `cta_tile`): every (token tile, weight tile) exactly
    once, for any group size and grid (a last group smaller than the rest included); 0 is the
    plain grid order; with G > 0 the first G x (weight tiles) CTAs cover only G token tiles and
    each group's weight tiles run in order, G token tiles at a time. The plan passes it to the
    kernel as RASTER and refuses a negative one."""
    for tiles_m, tiles_n in ((32, 48), (9, 5), (1, 7), (16, 192), (5, 1)):
        everything = {(x, y) for x in range(tiles_m) for y in range(tiles_n)}
        plain = wgm.raster_tiles(tiles_m, tiles_n, 0)
        assert plain == [(x, y) for y in range(tiles_n) for x in range(tiles_m)]
        for g in (1, 2, 4, 8, 64):
            order = wgm.raster_tiles(tiles_m, tiles_n, g)
            assert len(order) == tiles_m * tiles_n and set(order) == everything, (tiles_m, g)
            first = order[: min(g, tiles_m) * tiles_n]
            assert {mt for mt, _ in first} == set(range(min(g, tiles_m)))
            assert [nt for _, nt in first[:: min(g, tiles_m)]] == list(range(tiles_n))
    p = wgm.plan(4096, 6144, 4096, tm=128, nwg=2, wr=1, bulk=3, raster=8)
    assert p.defines()["RASTER"] == 8 and "RASTER" not in wgm.plan(4096, 6144, 4096).defines()
    assert wgm.check_plan(dataclasses.replace(p, raster=-1))[0] is False
