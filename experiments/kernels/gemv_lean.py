"""EXPERIMENT (lost): the batch-1 GEMV with fewer instructions in its loop, against production.

Two bit-exact changes, made here by text substitution on production's sources:
- **prmt tables read from memory.** In SASS a prmt's first table operand must be a register
  (the second may be an immediate). Written as a literal (production), ptxas keeps each low
  table word in a uniform register and copies it into a register before every prmt: 50 copies
  in each 16-word step of the M = 1 loop. Read with __ldg from a module global (`prmt_lo`),
  the word is a register once per thread; the compiler hoists the load out of the loop.
- **One address per row group** (load_tile): the rows at constant offsets from one 64-bit
  address, and no zero-fill of tiles that are never read.
Together: the persistent M = 1 loop goes from 439 to 354 instructions a step (gate_up), 112 to
77 registers. Measured on an H100 (experiments/results/gemv_lean_h100/): persistent M = 1
0.98-0.99x production's time, the streaming M = 1 plan (qkv, o) 1.06-1.08x (slower: the
table load's latency is exposed in a kernel that runs one round of loads), M = 8 0.99-1.02x.
The M = 1 GEMV is not bound by its instruction issue, so production keeps its code.

    python experiments/kernels/gemv_lean.py --count              # SASS counts, both versions
    python experiments/kernels/gemv_lean.py --write-tree DIR     # DIR/cuda_ops/*, lean
    python experiments/kernels/gemv_lean.py --summarize-kernel OUT --json-out F [--git-sha S]
    python experiments/kernels/gemv_lean.py --summarize-decode OUT --json-out F [--git-sha S]

`--write-tree` is how gemv_lean_run.sh builds the lean tree on the device; the summaries read
that script's per-run JSONs (OUT/raw/gemv_lean_{kernel,decode}_{base,new}_{run}.json) and give
per case the median over runs of each tree and the ratio new / base (< 1: the lean one faster).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from cuda_ops import build as cbuild

# production's table reads and load_tile, and the lean versions that replace them
_ACT_PRODUCTION = """// 4 codes (low 16 bits of v, nibble i = element i) -> 4 signed int8 2 * E2M1 values.
__device__ __forceinline__ u32 act_to_s8(u32 v) {
  const u32 pos = prmt(TM_LO, TM_HI, v);
  const u32 neg = prmt(TM_LO, TM_HI, v ^ 0x8888u);"""
_ACT_LEAN = """// EXPERIMENT (experiments/kernels/gemv_lean.py): the tables' low words read once with __ldg
// from a module global, so each is a register (a literal is copied from a uniform register
// before every prmt)
__device__ u32 nvfp4_prmt_lo[3] = {TM_LO, TP_LO, TN_LO};
__device__ __forceinline__ u32 prmt_lo(int table) { return __ldg(&nvfp4_prmt_lo[table]); }

// 4 codes (low 16 bits of v, nibble i = element i) -> 4 signed int8 2 * E2M1 values.
__device__ __forceinline__ u32 act_to_s8(u32 v) {
  const u32 tm_lo = prmt_lo(0);
  const u32 pos = prmt(tm_lo, TM_HI, v);
  const u32 neg = prmt(tm_lo, TM_HI, v ^ 0x8888u);"""
_ROW_PRODUCTION = """  const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 vx = words[i] ^ 0x88888888u;
    wpos[2 * i] = prmt(TP_LO, TP_HI, words[i]);
    wneg[2 * i] = prmt(TN_LO, TN_HI, vx);
    wpos[2 * i + 1] = prmt(TP_LO, TP_HI, words[i] >> 16);
    wneg[2 * i + 1] = prmt(TN_LO, TN_HI, vx >> 16);"""
_ROW_LEAN = """  const u32 words[4] = {q.x, q.y, q.z, q.w};
  const u32 tp_lo = prmt_lo(1), tn_lo = prmt_lo(2);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 vx = words[i] ^ 0x88888888u;
    wpos[2 * i] = prmt(tp_lo, TP_HI, words[i]);
    wneg[2 * i] = prmt(tn_lo, TN_HI, vx);
    wpos[2 * i + 1] = prmt(tp_lo, TP_HI, words[i] >> 16);
    wneg[2 * i + 1] = prmt(tn_lo, TN_HI, vx >> 16);"""
_TILE_PRODUCTION = """#pragma unroll
  for (int r = 0; r < R_ROWS; ++r) {
    if (valid) {
      const size_t n = (size_t)(row0 + r);
      t.q[r] = ld_weights(wp + n * (K_IN / 2) + elem / 2);
      t.s[r] = ld_scales16(ws + n * (K_IN / 16) + elem / 16);
    } else {
      t.q[r] = make_uint4(0, 0, 0, 0);
      t.s[r] = 0;
    }
  }"""
_TILE_LEAN = """  // EXPERIMENT (experiments/kernels/gemv_lean.py): one address per operand, the rows at
  // constant offsets from it; an invalid unit loads nothing (its tile is never read)
  if (!valid) return;
  const u8* q = wp + (size_t)row0 * (K_IN / 2) + elem / 2;
  const u8* s = ws + (size_t)row0 * (K_IN / 16) + elem / 16;
#pragma unroll
  for (int r = 0; r < R_ROWS; ++r) {
    t.q[r] = ld_weights(q + (size_t)r * (K_IN / 2));
    t.s[r] = ld_scales16(s + (size_t)r * (K_IN / 16));
  }"""
# (act, M, N, K) of the counts: the persistent plan at M = 1, 4, 8 and the streaming one at M = 1
COUNT_CASES = (("w4a4", 1, 24576, 4096), ("w4a4", 1, 4096, 12288), ("w4a4", 4, 24576, 4096),
               ("w4a4", 8, 24576, 4096), ("w4a4", 1, 6144, 4096))  # fmt: skip


def _swap(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise ValueError(
            f"{where}: production no longer holds the code this experiment replaces "
            "(update experiments/kernels/gemv_lean.py)"
        )
    return text.replace(old, new)


def lean_common(text: str) -> str:
    """common.cuh with the tables read from memory (production's text in)."""
    text = _swap(text, _ACT_PRODUCTION, _ACT_LEAN, "common.cuh act_to_s8")
    return _swap(text, _ROW_PRODUCTION, _ROW_LEAN, "common.cuh decode_row")


def lean_gemv(text: str) -> str:
    """nvfp4_gemv.cu with the lean load_tile (production's text in)."""
    return _swap(text, _TILE_PRODUCTION, _TILE_LEAN, "nvfp4_gemv.cu load_tile")


def gemv_source(lean: bool) -> str:
    """nvfp4_gemv.cu with common.cuh inlined, production's or lean: one self-contained source,
    so the two versions compile side by side."""
    common = cbuild.read_source("common.cuh")
    text = cbuild.read_source("nvfp4_gemv.cu")
    if lean:
        common, text = lean_common(common), lean_gemv(text)
    include = '#include "common.cuh"'
    if text.count(include) != 1:
        raise ValueError(f"nvfp4_gemv.cu: expected one {include!r}")
    return text.replace(include, common.replace("#pragma once", ""))


def write_tree(root: str) -> None:
    """ROOT/cuda_ops/common.cuh and nvfp4_gemv.cu, lean (the rest of cuda_ops is the caller's)."""
    dest = pathlib.Path(root) / "cuda_ops"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "common.cuh").write_text(lean_common(cbuild.read_source("common.cuh")))
    (dest / "nvfp4_gemv.cu").write_text(lean_gemv(cbuild.read_source("nvfp4_gemv.cu")))


def loop_count(lean: bool, act: str, m: int, n: int, k: int) -> dict:
    """Instruction counts of the GEMV at this plan: its dp4a loop (experiments/sass.loop_mix;
    absent where no loop holds one), the whole function, and ptxas's registers."""
    from cuda_ops import nvfp4_gemv as gemv
    from experiments import sass

    plan, job = gemv._compile_job(act, m, n, k, "sm_90", 132, gemv.DEFAULT_OPTIONS, False, None)
    source = gemv_source(lean)
    cubin = cbuild.compile_cubin(source, job["defines"], name=job["name"])
    instrs, labels = sass.instructions(sass.disassemble(cubin), gemv.ENTRY[act])
    log = cbuild.ptxas_log(source, job["defines"], name=job["name"]).replace("\0", "")
    regs = re.search(r"Used (\d+) registers", log)
    out = {
        "stream": bool(plan.defines()["GEMV_STREAM"]),
        "function": len(instrs),
        "function_imad_u32": sum(i.op == "IMAD.U32" for i in instrs),
        "registers": int(regs.group(1)) if regs else None,
    }
    try:
        mix = sass.loop_mix(instrs, labels, "IDP")
    except sass.SassError:
        mix = None
    if mix is not None:
        out["loop"] = mix["total"]
        out["loop_imad_u32"] = mix["ops"].get("IMAD.U32", 0)
        out["loop_prmt"] = mix["ops"].get("PRMT", 0)
    return out


def count_all() -> list[dict]:
    rows = []
    for act, m, n, k in COUNT_CASES:
        row = {"act": act, "m": m, "n": n, "k": k}
        for name, lean in (("production", False), ("lean", True)):
            row[name] = loop_count(lean, act, m, n, k)
        rows.append(row)
    return rows


def _runs(out: str, kind: str, tree: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(out, "raw", f"gemv_lean_{kind}_{tree}_*.json")))
    return [json.load(open(f)) for f in files]


def summarize_kernel(out: str) -> dict:
    """Per (N, K, M): median CUDA-graph time of our GEMV over the runs of each tree, the ratio
    new / base, and the read floor."""
    cases: dict = {}
    for tree in ("base", "new"):
        for run in _runs(out, "kernel", tree):
            for row in run["rows"]:
                key = (row["n"], row["k"], row["m"])
                case = cases.setdefault(key, {"base": [], "new": [], "floor": []})
                if row.get("nvfp4_w4a4_graph_s") is not None:
                    case[tree].append(row["nvfp4_w4a4_graph_s"] * 1e6)
                if row.get("read_floor_graph_s") is not None:
                    case["floor"].append(row["read_floor_graph_s"] * 1e6)
    rows = []
    for (n, k, m), case in sorted(cases.items()):
        row = {"n": n, "k": k, "m": m, "runs": [len(case["base"]), len(case["new"])]}
        if case["base"] and case["new"]:
            old, new = statistics.median(case["base"]), statistics.median(case["new"])
            row |= {"base_us": old, "new_us": new, "ratio": new / old}
        if case["floor"]:
            row["read_floor_us"] = statistics.median(case["floor"])
        rows.append(row)
    return {"rows": rows}


def summarize_decode(out: str) -> dict:
    """Per (batch, mode): median ms/token over the runs of each tree and the ratio."""
    cases: dict = {}
    for tree in ("base", "new"):
        for run in _runs(out, "decode", tree):
            for r in run["runs"]:
                case = cases.setdefault((r["batch"], r["mode"]), {"base": [], "new": []})
                case[tree].append(r["ms_per_token"])
    rows = []
    for (batch, mode), case in sorted(cases.items()):
        row = {"batch": batch, "mode": mode, "runs": [len(case["base"]), len(case["new"])]}
        if case["base"] and case["new"]:
            old, new = statistics.median(case["base"]), statistics.median(case["new"])
            row |= {"base_ms": old, "new_ms": new, "ratio": new / old}
        rows.append(row)
    return {"rows": rows}


def _device() -> dict:
    try:
        import jax

        return {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}
    except Exception as err:  # noqa: BLE001 - recorded, not fatal
        return {"device_error": repr(err)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--count", action="store_true", help="SASS counts of both versions")
    group.add_argument("--write-tree", metavar="DIR", help="write DIR/cuda_ops/*, lean")
    group.add_argument("--summarize-kernel", metavar="OUT", help="gemv_lean_run.sh's OUT")
    group.add_argument("--summarize-decode", metavar="OUT", help="gemv_lean_run.sh's OUT")
    ap.add_argument("--json-out", default=None, help="write the result here as JSON")
    ap.add_argument("--git-sha", default="unknown")
    args = ap.parse_args(argv)
    if args.write_tree:
        write_tree(args.write_tree)
        return 0
    if args.count:
        result = {"what": "SASS counts (NVRTC, sm_90), production vs lean",
                  "rows": count_all(), "nvrtc": cbuild.nvrtc_version()}  # fmt: skip
    else:
        out = args.summarize_kernel or args.summarize_decode
        if not os.path.isdir(out):
            raise SystemExit(f"{out!r}: no such directory")
        result = summarize_kernel(out) if args.summarize_kernel else summarize_decode(out)
        result |= _device()
    result["git_sha"] = args.git_sha
    text = json.dumps(result, indent=1)
    print(text)
    if args.json_out:
        pathlib.Path(args.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
