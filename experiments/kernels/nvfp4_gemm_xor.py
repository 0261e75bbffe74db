"""EXPERIMENT ([T2-C]): the NVFP4 W4A4 GEMM with weight codes repacked once so that its
register decode needs about half the instructions.

Production's GEMM (`cuda_ops/nvfp4_gemm.cu`) turns each 32-bit word of 8 E2M1 codes (nibble c =
element c) into four fp16x2 registers P_i = (e_i, e_{i+4}) x 2^-14 by placing each code's
magnitude bits (e1 e0 m) at fp16 bits 11..9 and its sign at bit 15 (+16 for the high half), then
multiplies by the block scale (`decode8`). Magnitude and sign need different shifts, so each P_i
costs two shifts and two masks: about 15.5 integer instructions a word in ptxas's output, against
4 HMUL2 and, at M = 8, 2 HMMA (experiments/sass.py). The fifteenth session measured the GEMM's
M-independent part (the decode, its shared-memory reads, the loads) at about twice its bytes'
time, and the eighteenth that the GEMM is bound by each SM's instruction stream.

The repack. Every P_i bit is a copy of one code bit, so the decode is a linear map over GF(2)
from the word's 32 bits to the 32 bits the four P_i keep (mask M = 0x8E008E00). Production's word
layout needs 8 shifts for it. A stored word v' = R w (R an invertible 32 x 32 matrix over GF(2),
applied once at load time) can be decoded with

    P_0 = (v' << 6) & M,  P_1 = (v' << 9) & M,  P_2 = (v' ^ (v' >> 3)) & M,  P_3 = (v' ^ (v' << 2)) & M

which is 4 shifts and 4 three-input LOP3s: 8 instructions a word. Why not fewer: four masks of
maps from a span of v' and three shifts are linearly dependent (P_3 = P_1 ^ P_2 if C_3 = C_1 + C_2),
and an exhaustive search of every 3-shift choice (shifts and rotations in -31..31, every XOR of
two) found none whose 32 x 32 decode matrix is invertible; with 4 shifts in -16..16 there are 307
combinations, on two shift sets ({-3, 2, 6, 9} and {-3, 4, 7, 9}). `COMBOS` is one of them.

The decoded P_i are bit for bit production's, so the GEMM's outputs must equal production's bit
for bit on the repacked codes: the device check (`check_gemm_xor.py`) compares exactly that, and
times both. The kernel source is production's with `decode8`'s body replaced (`source_text`),
so the plan, the launch and every other instruction are production's.

If it wins, the production step is the repack behind `Nvfp4Tensor` (a layout flag at load), and
the GEMV's decode must read the same words (it decodes nibbles to int8 through prmt tables, so
it would first undo R: the cost there has to be measured too).
"""

from __future__ import annotations

import functools
import hashlib
import pathlib

import numpy as np

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemm

# P_i = M & XOR over s in COMBOS[i] of (v << s) (s < 0: v >> -s, zero fill); 0 is v itself
COMBOS = ((6,), (9,), (0, -3), (0, 2))
MASK = 0x8E008E00
MAG = 0x0E000E00
SGN = 0x80008000
# fp16 bit of nibble bit j (m, e0, e1, s) in the low half; +16 in the high half
_FP16_BIT = (9, 10, 11, 15)
_MASK_BITS = tuple(b for b in range(32) if MASK >> b & 1)

_DECODE8_PRODUCTION = """__device__ __forceinline__ void decode8(u32 v, u32 scale2, u32 (&p)[4]) {
  const u32 mag = 0x0E000E00u, sgn = 0x80008000u;
  p[0] = hmul2(((v << 9) & mag) | ((v << 12) & sgn), scale2);
  p[1] = hmul2(((v << 5) & mag) | ((v << 8) & sgn), scale2);
  p[2] = hmul2(((v << 1) & mag) | ((v << 4) & sgn), scale2);
  p[3] = hmul2(((v >> 3) & mag) | (v & sgn), scale2);
}"""


def _term(s: int) -> str:
    return "v" if s == 0 else (f"(v << {s})" if s > 0 else f"(v >> {-s})")


def _decode8_xor() -> str:
    lines = [
        "// EXPERIMENT (experiments/kernels/nvfp4_gemm_xor.py): v is a word repacked at load time",
        "// (v = R w over GF(2)), so that four shifts and four masks give production's P_i bits",
        "__device__ __forceinline__ void decode8(u32 v, u32 scale2, u32 (&p)[4]) {",
        f"  const u32 m = 0x{MASK:08X}u;",
    ]
    for i, combo in enumerate(COMBOS):
        expr = " ^ ".join(_term(s) for s in combo)
        lines.append(f"  p[{i}] = hmul2(({expr}) & m, scale2);")
    lines.append("}")
    return "\n".join(lines)


VARIANTS = {
    # name -> (decode, copies): "production" is production's decode with the stage copies as
    # loops (GemmOptions(copies="loop"): production's code before it took the static copies
    # from 16-token tiles on, which this experiment measured); "static" is production's static
    # copies (GemmOptions(copies="static"), in cuda_ops/nvfp4_gemm.cu since)
    "production": ("production", "loop"),
    "xor": ("xor", "loop"),
    "static": ("production", "static"),
    "xor_static": ("xor", "static"),
    # the static copies under __launch_bounds__(threads) and no register cap: the PTX keeps
    # .maxntid (the capped kernels carry .maxnreg instead); at M = 8 the static copies measured
    # 0.90x the loops' speed with 54 registers, under a cap (80) that did not bind. At larger
    # tiles the registers may cost CTAs (gate_up at M = 64: 179 registers, 2 CTAs an SM, not 3)
    "static_nocap": ("production", "static"),
}
REPACKED = {name: spec[0] == "xor" for name, spec in VARIANTS.items()}
# Every variant but "production" runs under __maxnreg__ at the most registers that keep the
# plan's resident CTAs (nvfp4_gemm.max_registers; production's static copies take it, "xor"
# gets it as MAX_REGS): __launch_bounds__' minimum-CTAs form made ptxas rematerialize more than
# it had to (at M = 8 the repacked decode then saved 28 instructions a stage instead of 58).
# Under the cap "xor" alone spills 48 bytes at gate_up, M = 64 (168 registers); "xor_static"
# does not.


def source_text(variant: str = "xor") -> str:
    """Production's GEMM source, with decode8 reading repacked words for the "xor" variants."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}, expected one of {sorted(VARIANTS)}")
    text = cbuild.read_source(nvfp4_gemm.SOURCE)
    if VARIANTS[variant][0] != "xor":
        return text
    # decode8 lives in a header the GEMMs share: inline the headers, then replace it
    for name, body in cbuild.local_headers(text).items():
        text = text.replace(f'#include "{name}"', body)
    if text.count(_DECODE8_PRODUCTION) != 1:
        raise cbuild.KernelError(
            "cuda_ops/gemm_common.cuh's decode8 is not the one this experiment replaces; update "
            "_DECODE8_PRODUCTION (and the repack)"
        )
    return text.replace(_DECODE8_PRODUCTION, _decode8_xor())


def source_path(variant: str = "xor") -> pathlib.Path:
    """The variant's source as a file (GemmOptions.source takes a path), in the kernel cache."""
    text = source_text(variant)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = cbuild.cache_dir() / f"nvfp4_gemm_{variant}_{digest}.cu"
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def resident_ctas(plan: nvfp4_gemm.GemmPlan) -> int:
    """The CTAs per SM production's plan counts on (its shared memory, threads and estimated
    registers)."""
    regs = nvfp4_gemm.est_registers(plan.tm, plan.wr)
    return nvfp4_gemm.ctas_per_sm(plan.smem, plan.threads, regs)


def max_registers(plan: nvfp4_gemm.GemmPlan) -> int:
    """The most registers per thread at which `resident_ctas(plan)` CTAs still fit an SM."""
    return nvfp4_gemm.max_registers(plan.smem, plan.threads, plan.tm, plan.wr)


def options(
    variant: str,
    m: int,
    n: int,
    k: int,
    num_sms: int = 132,
    base: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
) -> nvfp4_gemm.GemmOptions:
    """`base` with the variant's copies, source and register cap: the same geometry as
    production's plan of M x N x K, the same launch."""
    import dataclasses

    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}, expected one of {sorted(VARIANTS)}")
    decode, copies = VARIANTS[variant]
    opts = dataclasses.replace(base, copies=copies)
    if variant == "static_nocap":
        return dataclasses.replace(opts, max_regs=0)
    if decode != "xor":
        return opts
    opts = dataclasses.replace(opts, source=str(source_path(variant)))
    if copies == "loop":  # the static copies' plan sets the cap itself
        regs = max_registers(nvfp4_gemm.plan(m, n, k, num_sms, opts))
        opts = dataclasses.replace(opts, max_regs=regs)
    return opts


# ----------------------------------------------------------------------------- GF(2) algebra


def _shift_rows(s: int) -> np.ndarray:
    """[32, 32] over GF(2): (v << s)[p] = v[p - s] (s < 0: a right shift), zero fill."""
    a = np.zeros((32, 32), np.uint8)
    for p in range(32):
        if 0 <= p - s < 32:
            a[p, p - s] = 1
    return a


def decode_matrix(combos=COMBOS) -> np.ndarray:
    """[32, 32]: row (i, b) for P_i's masked bit b (i major, b ascending) over the stored bits."""
    rows = []
    for combo in combos:
        mat = np.zeros((32, 32), np.uint8)
        for s in combo:
            mat ^= _shift_rows(s)
        rows.extend(mat[b] for b in _MASK_BITS)
    return np.stack(rows)


def target_matrix() -> np.ndarray:
    """[32, 32] permutation: row (i, b) -> the original word's bit that production's P_i holds
    at fp16 bit b (nibble i in the low half, nibble i + 4 in the high half)."""
    t = np.zeros((32, 32), np.uint8)
    rows = [(i, b) for i in range(4) for b in _MASK_BITS]
    for r, (i, b) in enumerate(rows):
        half, pos = divmod(b, 16)
        nibble = i + 4 * half
        t[r, 4 * nibble + _FP16_BIT.index(pos)] = 1
    return t


def gf2_inverse(a: np.ndarray) -> np.ndarray:
    """Inverse over GF(2); raises ValueError if singular."""
    n = a.shape[0]
    aug = np.concatenate([a.astype(np.uint8) % 2, np.eye(n, dtype=np.uint8)], axis=1)
    for c in range(n):
        piv = next((r for r in range(c, n) if aug[r, c]), None)
        if piv is None:
            raise ValueError(f"singular over GF(2) (column {c})")
        aug[[c, piv]] = aug[[piv, c]]
        for r in range(n):
            if r != c and aug[r, c]:
                aug[r] ^= aug[c]
    return aug[:, n:]


@functools.cache
def repack_matrix() -> np.ndarray:
    """R with stored = R w: decode(R w) = production's P_i bits of w."""
    return (gf2_inverse(decode_matrix()) @ target_matrix()) % 2


@functools.cache
def _byte_tables() -> np.ndarray:
    """[4, 256] uint32: R applied to byte value x at byte position j of the word."""
    r = repack_matrix().astype(np.uint64)
    cols = (r * (np.uint64(1) << np.arange(32, dtype=np.uint64))[:, None]).sum(0)  # R e_q as word
    tables = np.zeros((4, 256), np.uint32)
    for j in range(4):
        for x in range(256):
            acc = 0
            for bit in range(8):
                if x >> bit & 1:
                    acc ^= int(cols[8 * j + bit])
            tables[j, x] = acc
    return tables


def repack_words(words: np.ndarray) -> np.ndarray:
    """uint32 words of 8 codes (production's layout) -> the stored words (any shape)."""
    w = np.asarray(words, np.uint32)
    t = _byte_tables()
    out = np.zeros(w.shape, np.uint32)
    for j in range(4):
        out ^= t[j][(w >> np.uint32(8 * j)) & np.uint32(0xFF)]
    return out


def repack_codes(codes: np.ndarray) -> np.ndarray:
    """Nvfp4Tensor codes uint8 [..., K/2] (K/2 % 4 == 0) -> the repacked codes, same shape. The
    GEMM reads 16-byte chunks as four little-endian words, so words are 4 aligned bytes."""
    c = np.ascontiguousarray(np.asarray(codes, np.uint8))
    if c.shape[-1] % 4:
        raise ValueError(f"codes' last dim {c.shape[-1]} is not a multiple of 4 (K % 8 != 0)")
    return repack_words(c.view("<u4")).view(np.uint8).reshape(c.shape)


def repack_codes_jax(codes):
    """As repack_codes, in JAX (on the device, for weights already there)."""
    import jax
    import jax.numpy as jnp

    if codes.shape[-1] % 4:
        raise ValueError(f"codes' last dim {codes.shape[-1]} is not a multiple of 4 (K % 8 != 0)")
    w = jax.lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], -1, 4), jnp.uint32)
    t = jnp.asarray(_byte_tables())
    out = jnp.zeros_like(w)
    for j in range(4):
        out = out ^ t[j][(w >> (8 * j)) & 0xFF]
    return jax.lax.bitcast_convert_type(out, jnp.uint8).reshape(codes.shape)


def decode_production(words: np.ndarray) -> np.ndarray:
    """Production decode8's P_i bits (before the scale), [..., 4] uint32."""
    v = np.asarray(words, np.uint32)
    sh = lambda x, s: (x << np.uint32(s)) if s >= 0 else (x >> np.uint32(-s))
    p = [
        (sh(v, 9) & MAG) | (sh(v, 12) & SGN),
        (sh(v, 5) & MAG) | (sh(v, 8) & SGN),
        (sh(v, 1) & MAG) | (sh(v, 4) & SGN),
        (sh(v, -3) & MAG) | (v & SGN),
    ]
    return np.stack(p, -1).astype(np.uint32)


def decode_xor(words: np.ndarray) -> np.ndarray:
    """The variant's decode8 bits of stored words (before the scale), [..., 4] uint32."""
    v = np.asarray(words, np.uint32)
    out = []
    for combo in COMBOS:
        acc = np.zeros_like(v)
        for s in combo:
            acc ^= (v << np.uint32(s)) if s >= 0 else (v >> np.uint32(-s))
        out.append(acc & np.uint32(MASK))
    return np.stack(out, -1).astype(np.uint32)


def stage_mix(m: int, n: int, k: int, variants=("xor", "static", "xor_static"), num_sms=132):
    """Per-stage instruction counts (experiments/sass.py) of production and of each variant for
    production's plan of M x N x K: the K loop's straight-line body (`stage`), the copy loops
    nested in it (`copy_loops`: static instructions of loops whose trips the count does not
    see; 0 when the copies unroll) and the opcode mix. Needs nvdisasm."""
    from experiments import sass

    out = {"m": m, "n": n, "k": k}
    for name in ("production", *variants):
        mix = sass.gemm_stage_mix(m, n, k, options(name, m, n, k, num_sms), num_sms)
        out["plan"] = mix["plan"]
        out[name] = {
            "stage": mix["straight_total"],
            "copy_loops": mix["total"] - mix["straight_total"],
            "ops": mix["straight"],
        }
    return out


# ----------------------------------------------------------------------------- the search


def _rank_rows(rows) -> int:
    """Rank over GF(2) of rows given as int bitmasks."""
    piv: dict[int, int] = {}
    for x in rows:
        while x:
            h = x.bit_length() - 1
            if h not in piv:
                piv[h] = x
                break
            x ^= piv[h]
    return len(piv)


def _combo_rows(combo) -> list[int]:
    rows = []
    for b in _MASK_BITS:
        r = 0
        for s in combo:
            if 0 <= b - s < 32:
                r ^= 1 << (b - s)
        rows.append(r)
    return rows


def search(n_shifts: int, lo: int = -31, hi: int = 31, limit: int | None = None) -> list:
    """Every decode with `n_shifts` shifted copies of the stored word (shifts in lo..hi, not 0)
    whose four P_i are masks of one copy, of the word, or of the XOR of two of them (what one
    three-input LOP3 gives), and whose 32 x 32 decode matrix is invertible: a list of
    (shifts, combos). Pure Python: n_shifts = 3 over -31..31 takes minutes."""
    import itertools

    found = []
    shifts_all = [s for s in range(lo, hi + 1) if s != 0]
    for shifts in itertools.combinations(shifts_all, n_shifts):
        terms = (0, *shifts)
        combos = [(t,) for t in terms] + list(itertools.combinations(terms, 2))
        rows = {cb: _combo_rows(cb) for cb in combos}
        for four in itertools.combinations(combos, 4):
            used = {s for cb in four for s in cb}
            if not set(shifts) <= used:
                continue  # a shift no P uses: counted by a smaller n_shifts
            if _rank_rows([r for cb in four for r in rows[cb]]) == 32:
                found.append((shifts, four))
                if limit is not None and len(found) >= limit:
                    return found
    return found


SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))  # Qwen3-8B's four linears
MIX_MS = (8, 16, 32, 64)


def main(argv=None) -> int:
    import argparse
    import json
    import os
    import subprocess

    ap = argparse.ArgumentParser(description="the decode search and the per-stage mix")
    ap.add_argument("--search", type=int, default=None, help="search decodes with this many shifts")
    ap.add_argument("--range", default="-31:31", help="shift range lo:hi for --search")
    ap.add_argument("--mix", default=None, help="M:N:K: per-stage instruction mix (nvdisasm)")
    ap.add_argument("--mix-out", default=None,
                    help="write the per-stage counts of SHAPES x MIX_MS to this JSON")  # fmt: skip
    args = ap.parse_args(argv)
    if args.search is not None:
        lo, hi = (int(v) for v in args.range.split(":"))
        found = search(args.search, lo, hi)
        print(json.dumps({"n_shifts": args.search, "range": [lo, hi], "found": len(found),
                          "first": [[list(s), [list(c) for c in cb]] for s, cb in found[:10]]}))  # fmt: skip
    if args.mix is not None:
        m, n, k = (int(v) for v in args.mix.split(":"))
        print(json.dumps(stage_mix(m, n, k), indent=1))
    if args.mix_out is not None:
        from experiments import sass

        rows = []
        for n, k in SHAPES:
            for m in MIX_MS:
                r = stage_mix(m, n, k)
                rows.append(r)
                cells = {v: (r[v]["stage"], r[v]["copy_loops"]) for v in VARIANTS}
                print(n, k, m, r["plan"], cells, flush=True)
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True
        )
        out = {
            "git_sha": sha.stdout.strip() or None,
            "nvrtc": ".".join(map(str, cbuild.nvrtc_version())),
            "nvdisasm": sass.nvdisasm_path() and os.path.basename(sass.nvdisasm_path()),
            "arch": "sm_90",
            "num_sms": 132,
            "method": (
                "static SASS counts (experiments/sass.py): 'stage' = the K loop's body without "
                "the loops nested in it (one pipeline stage per warp, as executed once per trip); "
                "'copy_loops' = static instructions of those nested loops (production's stage "
                "copies), which run a thread-dependent number of trips on top"
            ),
            "combos": [list(c) for c in COMBOS],
            "rows": rows,
        }
        with open(args.mix_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
