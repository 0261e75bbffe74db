"""Tests of the repacked-decode / static-copy GEMM experiment (experiments/kernels/
nvfp4_gemm_xor.py, check_gemm_xor.py) and of experiments/sass.py, CPU only: the GF(2) repack
against production's decode, the variant sources, NVRTC + ptxas of the planned builds, the
instruction counts nvdisasm reads off the cubins, and the device check's arguments."""

import dataclasses

import numpy as np
import pytest

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemm
from experiments import sass
from experiments.kernels import check_gemm_xor as check
from experiments.kernels import nvfp4_gemm_xor as xor

needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)
needs_nvdisasm = pytest.mark.skipif(
    sass.nvdisasm_path() is None, reason="nvdisasm not installed (nvidia-cuda-nvdisasm)"
)
GATE_UP = (24576, 4096)


# ----------------------------------------------------------------------------- the repack


def test_decode_matrix_is_invertible_and_the_repack_inverts_it():
    d = xor.decode_matrix()
    r = xor.repack_matrix()
    assert np.array_equal((d @ r) % 2, xor.target_matrix())
    t = xor.target_matrix()
    assert np.array_equal(t.sum(0), np.ones(32)) and np.array_equal(t.sum(1), np.ones(32))


def test_decode_of_repacked_words_is_production_decode():
    """Every map is linear over GF(2): the 32 basis words prove it for all 2^32; random words and
    every code value at every nibble check the implementation beyond that."""
    basis = np.uint32(1) << np.arange(32, dtype=np.uint32)
    assert np.array_equal(xor.decode_xor(xor.repack_words(basis)), xor.decode_production(basis))
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    nibbles = np.array([v << (4 * c) for c in range(8) for v in range(16)], dtype=np.uint64).astype(
        np.uint32
    )
    for w in (words, nibbles, np.array([0, 0xFFFFFFFF], np.uint32)):
        assert np.array_equal(xor.decode_xor(xor.repack_words(w)), xor.decode_production(w))


def test_production_decode_model_matches_the_e2m1_values():
    """decode_production is the kernel's arithmetic: P_i read as fp16 is e2m1 x 2^-14."""
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    for code in range(16):
        word = np.array([code | (code << 16)], np.uint32)  # nibbles 0 and 4
        p0 = xor.decode_production(word)[0, 0]
        lo, hi = np.array([p0 & 0xFFFF, p0 >> 16], np.uint16).view(np.float16).astype(float)
        want = (-1 if code & 8 else 1) * lut[code & 7] * 2.0**-14
        assert lo == want and hi == want


def test_a_wrong_combo_breaks_the_decode(monkeypatch):
    """The test above fails for a decode that differs from the one the repack was built for."""
    words = np.random.default_rng(1).integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    stored = xor.repack_words(words)
    monkeypatch.setattr(xor, "COMBOS", ((6,), (9,), (0, -3), (0, 4)))
    assert not np.array_equal(xor.decode_xor(stored), xor.decode_production(words))


def test_repack_codes_round_trips_the_byte_layout():
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 256, (3, 64), dtype=np.uint8)
    out = xor.repack_codes(codes)
    assert out.shape == codes.shape and out.dtype == np.uint8
    words = codes.view("<u4")
    assert np.array_equal(out.view("<u4"), xor.repack_words(words))
    with pytest.raises(ValueError, match="multiple of 4"):
        xor.repack_codes(codes[:, :6])


def test_jax_repack_equals_numpy():
    import jax.numpy as jnp

    codes = np.random.default_rng(3).integers(0, 256, (5, 128), dtype=np.uint8)
    got = np.asarray(xor.repack_codes_jax(jnp.asarray(codes)))
    assert np.array_equal(got, xor.repack_codes(codes))


def test_the_search_finds_the_chosen_decode_and_none_with_two_shifts():
    assert xor.search(2) == []
    shifts = tuple(sorted({s for cb in xor.COMBOS for s in cb} - {0}))
    found = xor.search(4, min(shifts), max(shifts))
    assert any(set(four) == set(xor.COMBOS) for _, four in found)


# ----------------------------------------------------------------------------- sources and builds


def test_variant_sources_change_only_their_parts():
    prod = cbuild.read_source(nvfp4_gemm.SOURCE)
    for name, (decode, _) in xor.VARIANTS.items():
        text = xor.source_text(name)
        assert ("p[0] = hmul2(((v << 6)) & m, scale2);" in text) == (decode == "xor")
        if decode != "xor":
            assert text == prod
        else:  # production with its shared header inlined and decode8 replaced
            inlined = prod
            for header, body in cbuild.local_headers(prod).items():
                inlined = inlined.replace(f'#include "{header}"', body)
            assert "#include" not in inlined and inlined != prod
            assert text.replace(xor._decode8_xor(), xor._DECODE8_PRODUCTION) == inlined
    with pytest.raises(ValueError, match="variant="):
        xor.source_text("nope")


def test_options_carry_copies_source_and_the_plans_ctas():
    geometry = ("tm", "wm", "wr", "warps", "kt", "stages", "splitk")
    base = nvfp4_gemm.plan(64, *GATE_UP, 132)
    for name, (decode, copies) in xor.VARIANTS.items():
        opts = xor.options(name, 64, *GATE_UP)
        assert opts.copies == copies and bool(opts.source) == (decode == "xor")
        plan = nvfp4_gemm.plan(64, *GATE_UP, 132, opts)
        assert all(getattr(plan, f) == getattr(base, f) for f in geometry)  # production's plan
        assert plan.static_copies == (copies == "static")
        regs = plan.defines().get("MAX_REGS")
        if name in ("production", "static_nocap"):
            assert regs is None  # __launch_bounds__, no cap: .maxntid in the PTX
            continue
        assert int(regs) == xor.max_registers(plan)  # every other variant runs under the cap
        assert nvfp4_gemm.ctas_per_sm(plan.smem, plan.threads, int(regs)) >= xor.resident_ctas(plan)
        assert int(regs) == 255 or nvfp4_gemm.ctas_per_sm(
            plan.smem, plan.threads, int(regs) + 8
        ) < xor.resident_ctas(plan)
    assert xor.options("static", 64, *GATE_UP) == nvfp4_gemm.GemmOptions(copies="static")


@needs_nvrtc
@pytest.mark.parametrize("m", [8, 17, 64])
@pytest.mark.parametrize("shape", [(4096, 4096), GATE_UP, (4096, 12288)])
def test_variants_build_without_spills(shape, m):
    import re

    n, k = shape
    for v in ("xor", "static", "xor_static", "static_nocap"):
        opts = xor.options(v, m, n, k)
        plan = nvfp4_gemm.plan(m, n, k, 132, opts)
        log = cbuild.ptxas_log(xor.source_text(v), plan.defines())
        body = log.rsplit(nvfp4_gemm.ENTRY, 1)[1]
        regs = int(re.search(r"Used (\d+) registers", body).group(1))
        spills = int(re.search(r"(\d+) bytes spill stores", body).group(1))
        # "xor" alone spills 48 bytes at gate_up, M = 64, under its 168-register cap (NVRTC
        # 13.5); the static copies free the registers, so "xor_static" does not
        limit = 64 if (v, m, shape) == ("xor", 64, GATE_UP) else 0
        assert spills <= limit, (v, m, shape, body)
        # the plan's resident CTAs fit the registers (without the cap they need not: gate_up's
        # static copies at M = 64 take 179 registers, 2 CTAs an SM where the plan counts 3)
        if v != "static_nocap":
            assert nvfp4_gemm.ctas_per_sm(plan.smem, plan.threads, regs) >= xor.resident_ctas(plan)


@needs_nvrtc
def test_check_builds_every_case_with_the_same_plan():
    cl = check.cases(((4096, 4096),), (8,), with_extra=False) + [check.EXTRA[3]]
    kernels = check.build_all(cl, check.DEFAULT_VARIANTS, num_sms=132)
    assert len(kernels) == len(cl) * (1 + len(check.DEFAULT_VARIANTS))
    for case in cl:
        geometry = {
            dataclasses.replace(kernels[(case, v)].plan, static_copies=False, max_regs=0)
            for v in ("production", *check.DEFAULT_VARIANTS)
        }
        assert len(geometry) == 1  # same geometry; only the copies, source and cap differ


# ----------------------------------------------------------------------------- SASS counts


def test_loops_and_mix_of_a_listing():
    listing = """
.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
.L_x_1:
        /*0020*/                   LDGSTS.E [R2], desc[UR4][R6.64] ;
        /*0030*/              @P0  BRA `(.L_x_1) ;
        /*0040*/                   IMAD.SHL.U32 R3, R3, 0x2, RZ ;
        /*0050*/              @!P1 BRA `(.L_x_0) ;
        /*0060*/                   EXIT ;
//--------------------- .text.other
"""
    instrs, labels = sass.instructions(listing, "k")
    assert [i.op for i in instrs][:3] == ["MOV", "HMMA.16816.F32", "LDGSTS.E"]
    assert sass.loops(instrs, labels) == [(1, 5), (2, 3)]
    mix = sass.loop_mix(instrs, labels, "HMMA")
    assert mix["span"] == [1, 5] and mix["nested"] == [[2, 3]]
    assert mix["total"] == 5 and mix["straight_total"] == 3
    assert mix["straight"] == {"HMMA": 1, "IMAD": 1, "BRA": 1}
    with pytest.raises(sass.SassError, match="no loop"):
        sass.loop_mix(instrs, labels, "WGMMA")
    with pytest.raises(sass.SassError, match="not in the cubin"):
        sass.instructions(listing, "missing")


@needs_nvrtc
@needs_nvdisasm
@pytest.mark.parametrize("m", [8, 64])
def test_stage_instruction_counts(m):
    """Per stage: the same HMMAs, HMUL2s and LDSs; the repacked decode saves at least 5 integer
    instructions a word (production spends about 15.5, the variant 8); the static copies leave
    no loop in the stage and fewer instructions than production's straight part alone."""
    r = xor.stage_mix(m, *GATE_UP)
    prod, x, st, xs = (r[v] for v in ("production", "xor", "static", "xor_static"))
    for v in (x, st, xs):
        for op in ("HMMA", "HMUL2"):
            assert v["ops"].get(op) == prod["ops"].get(op), (op, v["ops"], prod["ops"])
    words = prod["ops"]["HMUL2"] // 4  # 4 P_i (4 HMUL2) per decoded word
    integer = lambda mix: sum(mix["ops"].get(op, 0) for op in ("LOP3", "IMAD", "SHF"))
    assert integer(x) <= integer(prod) - 5 * words
    assert integer(xs) <= integer(st) - 5 * words
    assert prod["copy_loops"] > 0 and st["copy_loops"] == 0 and xs["copy_loops"] == 0
    assert st["stage"] < prod["stage"] and xs["stage"] < x["stage"]


# ----------------------------------------------------------------------------- the check's CLI


def test_check_argument_errors():
    assert check.parse_shapes("4096:4096,24576:4096") == ((4096, 4096), (24576, 4096))
    for bad in ("4096", "4096:100", "a:b"):
        with pytest.raises(SystemExit, match="--shapes"):
            check.parse_shapes(bad)
    assert check.parse_variants("xor,static") == ("xor", "static")
    for bad in ("production", "nope", ""):
        with pytest.raises(SystemExit, match="--variants"):
            check.parse_variants(bad)
    with pytest.raises(SystemExit, match="--ms"):
        check.main(["--out", "/dev/null", "--ms", "65"])
    cl = check.cases(((4096, 4096),), (8, 16))
    assert cl[:2] == [
        ("model", 4096, 4096, 8, False, False),
        ("model", 4096, 4096, 16, False, False),
    ]
    assert cl[2:] == list(check.EXTRA)


def test_judge_flags_every_kind_of_difference():
    import torch

    y = torch.randn(4, 8).to(torch.bfloat16)
    r, why = check.judge(torch, y, y.clone(), y.clone(), True)
    assert why is None and r["passed"] and r["frac_bitwise_equal_production"] == 1.0
    off = y.clone()
    off[1, 2] = off[1, 2] * 2 + 1  # one output differs
    r, why = check.judge(torch, y, off, off.clone(), True)
    assert not r["passed"] and "0.968750 of the outputs" in why
    assert check.judge(torch, y, y.clone(), off, True)[1] == "not bitwise repeatable"
    assert "unwritten" in check.judge(torch, y, y.clone(), y.clone(), False)[1]


def test_generated_cuda_decode_is_the_numpy_model():
    """The kernel's decode8 text, evaluated on words, is decode_xor (the tests above check
    decode_xor against production)."""
    import re

    text = xor._decode8_xor()
    exprs = re.findall(r"p\[(\d)\] = hmul2\((.*), scale2\);", text)
    assert [int(i) for i, _ in exprs] == [0, 1, 2, 3]
    mask = int(re.search(r"const u32 m = 0x([0-9A-F]+)u;", text).group(1), 16)
    v = np.random.default_rng(4).integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
    got = []
    for _, expr in exprs:
        py = re.sub(r"(<<|>>) (\d+)", r"\1 np.uint32(\2)", expr)
        got.append(eval(py, {"np": np, "v": v, "m": np.uint32(mask)}))
    assert np.array_equal(np.stack(got, -1), xor.decode_xor(v))


def _fake_build(case_list, variants, num_sms=None):
    class Fake:
        def __init__(self, plan, name):
            self.plan, self.name = plan, name

    out = {}
    for case in case_list:
        _, n, k, m, _residual, gw_rows = case
        plan = nvfp4_gemm.plan(m, n, k, 132, gw_rows=gw_rows)
        for v in ("production", *variants):
            out[(case, v)] = Fake(plan, v)
    return out


@pytest.mark.parametrize("broken", [None, "static"])
def test_check_main_runs_on_the_cpu_with_fake_kernels(monkeypatch, tmp_path, broken):
    """The check's whole correctness flow with fake launches: every kernel returns the same
    bits, except `broken`, which differs in one output of one case: main fails on it alone."""
    import json

    import torch

    def fake_run(c, kernel, ptrs, m, n):
        g = torch.Generator().manual_seed(m * 100003 + n)
        y = torch.randn((m, n), generator=g).to(torch.bfloat16)
        if kernel.name == broken and (m, n) == (16, 4096):
            y[0, 0] = y[0, 0] + 1
        return y, True

    monkeypatch.setattr(check, "build_all", _fake_build)
    monkeypatch.setattr(check, "_run", fake_run)
    out = tmp_path / "x.json"
    rc = check.main(["--out", str(out), "--shapes", "4096:4096", "--ms", "8,16", "--no-time"])
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 2 + len(check.EXTRA)
    if broken is None:
        assert rc == 0 and res["passed"] and res["failures"] == []
    else:
        assert rc == 1 and not res["passed"]
        # (4096, 16) is both the model row and the "residual" extra case
        assert {(f[0], f[4]) for f in res["failures"]} == {("model", broken), ("residual", broken)}
