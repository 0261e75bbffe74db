"""EXPERIMENT (device): the one-launch post-attention block (experiments/kernels/
nvfp4_block_tma.cu) checked byte for byte against the kernels it fuses, and timed against
production's launches. From the repository root:

    PYTHONPATH=. python3 experiments/kernels/check_block_tma.py --out $OUT/block_tma.json

1. Operands: random NVFP4 weights for o_proj [L, D, KO/2], gate_up [L, 2F, D/2] and down_proj
   [L, D, F/2] (uniform codes, E4M3 block scales 0.125 .. 240, as the GPU tests), a bf16
   attention output a (o's input), residual stream and norm weight. The weight global scales
   and the three static input scales are calibrated with production's kernels so every stage
   sees values of order one (o's output and the residual of standard deviation 1, gate and up
   of 2, each static scale amax / (6 x 448) of what it quantizes), as a checkpoint's
   calibration would.
2. Correctness, per variant (`VARIANTS`), at layer 1 of a 2-deep stack, for each of `GW_ROWS`
   (which matrices have one weight global scale a row: none, gate_up only as in a checkpoint
   whose gate and up shards have a scale each, all), into poisoned results, twice (bitwise
   repeatable). The kernel's y1, gate_up input (gp, gs), down input (dp, ds) and y2 must equal,
   byte for byte, the composition of the kernels it fuses run on its own intermediates:
   production's quantizer kernel on a, nvfp4_gemv_tma's residual build of o (same stage size),
   production's quantizer kernel (RMSNorm prologue) on the block's y1, nvfp4_gemv_tma's SwiGLU
   build of gate_up on those codes, its residual build of down on those. Reported beside them:
   the agreement with production's launches (relative difference of y2, fraction of equal
   bytes; the GEMVs' fp32 sums differ in order). Variants "*_a16" quantize a in the kernel.
3. Timing: one CUDA graph over enough weight copies to read > 256 MiB, CUDA events, median of
   25 replays, per layer: production's five launches (o's quantizer, o GEMV + residual, the
   RMSNorm quantizer, gate_up GEMV + SwiGLU epilogue, down GEMV + residual: the decode step's at
   batch 1 under the defaults); the same with the TMA GEMVs; each variant (o's quantizer and
   the block, or the "_a16" block alone); the copy floor of the weight bytes (the device copy
   bandwidth).
4. Writes one JSON to --out (versions, --git-sha, plans, offline ptxas registers and spills,
   rows, timings, summary) and exits 1 if a check failed.

The CPU-only parts import without a GPU: experiments/tests/test_block_tma.py compiles every
planned kernel with NVRTC and ptxas and runs this harness with fake kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from cuda_ops.build import KernelError
from experiments.kernels import nvfp4_block_tma as blk
from experiments.kernels import nvfp4_gemv_tma as tma
from experiments.kernels.check_gemv_tma import SCALES, _launch_ptx, _seed, _write

# name -> nvfp4_block_tma.plan keyword options
VARIANTS = {
    "tma": {},  # 1024-byte row chunks, 6 stages (110 KB in flight a CTA)
    "tma_s10": {"stages": 10},  # 184 KB in flight: more of the next matrix during a barrier
    "tma_k2048_s5": {"kch": 2048, "stages": 5},
    "tma_ef": {"ef": True},
    "lsu": {"producer": "lsu"},
    "lsu_s10": {"producer": "lsu", "stages": 10},
    # o's input quantized in the kernel (no quantizer launch in front: one launch a layer fewer)
    "tma_a16": {"a_bf16": True},
    "tma_s10_a16": {"stages": 10, "a_bf16": True},
    "lsu_a16": {"producer": "lsu", "a_bf16": True},
}
DEVICE = "cuda"
# (o, gate_up, down): one weight global scale a row; the decoder's NVFP4 checkpoints are the
# second (gate_up's gate and up shards each have one), which the timing uses
GW_ROWS = ((False, False, False), (False, True, False), (True, True, True))
DEFAULT_SHAPE = "x".join(map(str, blk.QWEN3_8B))
DEFAULT_QKV_SHAPE = "x".join(map(str, (*blk.QWEN3_8B_ATTENTION, 1536)))  # a 1,536-slot cache


def problems(shape=blk.QWEN3_8B, variants=tuple(VARIANTS)) -> list:
    """Every (variant, plan) the check builds, with one global scale a matrix and one a row. CPU
    only; raises KernelError for a plan that cannot run."""
    return [(v, blk.plan(*shape, gw_rows=r, **VARIANTS[v])) for v in variants for r in GW_ROWS]


def _scale_of(amax: float) -> float:
    """A static input scale as calibration sets it: the block scale of amax is then 448."""
    return max(amax, 1e-30) / (6.0 * 448.0)


class Block:
    """One problem's operands on the GPU, calibrated, and the launches of the block, of
    production's four kernels and of the TMA composition on them."""

    def __init__(self, torch, d, ko, f, *, layers, copies, gw_rows, eps, seed):
        from cuda_ops import nvfp4_gemv, nvfp4_quant

        self.torch, self.d, self.ko, self.f = torch, d, ko, f
        self.layers, self.gw_rows, self.eps = layers, gw_rows, eps
        dev = DEVICE
        rng = np.random.default_rng(_seed(*seed))
        g = torch.Generator(device=dev).manual_seed(_seed(*seed, "w"))

        def mat(n, k):
            return (torch.randint(0, 256, (layers, n, k // 2), dtype=torch.uint8, device=dev,
                                  generator=g),
                    torch.randint(*SCALES, (layers, n, k // 16), dtype=torch.uint8, device=dev,
                                  generator=g))  # fmt: skip

        self.w = [{"o": mat(d, ko), "gu": mat(2 * f, d), "d": mat(d, f)} for _ in range(copies)]
        rows = {"o": d, "gu": 2 * f, "d": d}
        # per-row factors 0.5 .. 1.5 where a matrix has a scale a row (gw_rows: o, gate_up,
        # down), times the calibrated scale of the matrix
        self.per_row = dict(zip(("o", "gu", "d"), gw_rows, strict=True))
        self.row_factor = {
            m: torch.from_numpy((0.5 + rng.random((layers, n))).astype(np.float32)).to(dev)
            if self.per_row[m] else torch.ones(layers, dtype=torch.float32, device=dev)
            for m, n in rows.items()
        }  # fmt: skip
        self.wg = {m: v.clone() for m, v in self.row_factor.items()}
        # the attention output (o's input) and its static scale, calibrated to its amax
        self.a = torch.randn(ko, generator=g, device=dev).to(torch.bfloat16)
        amax = float(self.a.float().abs().max())
        self.xgo = torch.full((layers,), _scale_of(amax), dtype=torch.float32, device=dev)
        self.h = torch.zeros(d, dtype=torch.bfloat16, device=dev)
        self.nw = (1 + 0.1 * torch.randn(layers, d, generator=g, device=dev)).to(torch.bfloat16)
        self.xgu = torch.ones(layers, dtype=torch.float32, device=dev)
        self.xgd = torch.ones(layers, dtype=torch.float32, device=dev)
        rows_o, rows_gu, rows_d = gw_rows
        self.p_o = nvfp4_gemv.build("w4a4", 1, d, ko, residual=True, gw_rows=rows_o)
        self.p_gu = nvfp4_gemv.build("w4a4", 1, 2 * f, d, swiglu_out="stacked", gw_rows=rows_gu)
        self.p_gu_plain = nvfp4_gemv.build("w4a4", 1, 2 * f, d, gw_rows=rows_gu)
        self.p_d = nvfp4_gemv.build("w4a4", 1, d, f, residual=True, gw_rows=rows_d)
        fused = nvfp4_gemv.Fused(prologue="rmsnorm", eps=eps, norm_stacked=True, scale_stacked=True)
        self.q_norm = nvfp4_quant.build(1, d, fused)
        self.q_o = nvfp4_quant.build(1, ko, nvfp4_gemv.Fused(scale_stacked=True))
        self.no_norm = torch.zeros(1, dtype=torch.bfloat16, device=dev)  # prologue "none"

    # ------------------------------------------------------------------ buffers and launches

    @property
    def stream(self) -> int:
        """The current stream (a graph capture's while one runs)."""
        return self.torch.cuda.current_stream().cuda_stream

    def outs(self):
        """Poisoned results and intermediates: o's input codes (ap, as, ag), y2, y1 (bf16 NaN),
        gp, gs, dp, ds (0xAB), ..."""
        t, dev = self.torch, DEVICE
        nan = float("nan")
        return {
            "ap": t.full((self.ko // 2,), 0xAB, dtype=t.uint8, device=dev),
            "as": t.full((self.ko // 16,), 0xAB, dtype=t.uint8, device=dev),
            "ag": t.full((1,), nan, dtype=t.float32, device=dev),
            "y2": t.full((self.d,), nan, dtype=t.bfloat16, device=dev),
            "y1": t.full((self.d,), nan, dtype=t.bfloat16, device=dev),
            "gp": t.full((self.d // 2,), 0xAB, dtype=t.uint8, device=dev),
            "gs": t.full((self.d // 16,), 0xAB, dtype=t.uint8, device=dev),
            "gg": t.full((1,), nan, dtype=t.float32, device=dev),
            "dp": t.full((self.f // 2,), 0xAB, dtype=t.uint8, device=dev),
            "ds": t.full((self.f // 16,), 0xAB, dtype=t.uint8, device=dev),
            "dg": t.full((1,), nan, dtype=t.float32, device=dev),
            "y_gu": t.full((2 * self.f,), nan, dtype=t.bfloat16, device=dev),
        }

    def _ptr(self, *ts) -> list:
        return [x.data_ptr() for x in ts]

    def gemv(self, kern, which, c, li, xp, xs, xg, out, res=None, xgd=None, swiglu=False):
        """A production (`launch`) or TMA GEMV on matrix `which` of copy c."""
        wp, ws = self.w[c][which]
        head = [xp, xs, xg] + ([res] if res is not None else []) + [wp, ws, self.wg[which], li]
        if swiglu:
            ptrs = self._ptr(*head, xgd, *out)
            p = kern.plan
            if isinstance(kern, tma.TmaKernel):
                kern.launch(self.stream, ptrs)
            else:
                _launch_ptx(kern.ptx, kern.entry, (p.grid, 1), p.threads, p.smem, ptrs, self.stream)
        else:
            kern.launch(self.stream, self._ptr(*head, out))

    def _quant(self, q, k, ptrs):
        from cuda_ops import nvfp4_quant

        _launch_ptx(q.ptx, nvfp4_quant.ENTRY, (1, k // q.chunk), q.threads, 0, self._ptr(*ptrs),
                    self.stream)  # fmt: skip

    def norm_quant(self, li, y1, o):
        """Production's quantizer kernel (RMSNorm prologue) on y1 -> gp, gs, gg."""
        self._quant(self.q_norm, self.d, (y1, self.xgu, self.nw, li, o["gp"], o["gs"], o["gg"]))

    def quant_o(self, li, o):
        """Production's quantizer kernel (no prologue) on the attention output -> ap, as, ag."""
        self._quant(self.q_o, self.ko, (self.a, self.xgo, self.no_norm, li, o["ap"], o["as"],
                                             o["ag"]))  # fmt: skip

    def production(self, c, li, o):
        """The decode step's five launches at batch 1: o's quantizer, o + residual, quantizer,
        gate_up + SwiGLU epilogue, down + residual."""
        self.quant_o(li, o)
        self.gemv(self.p_o, "o", c, li, o["ap"], o["as"], o["ag"], o["y1"], res=self.h)
        self.norm_quant(li, o["y1"], o)
        self.gemv(self.p_gu, "gu", c, li, o["gp"], o["gs"], o["gg"], (o["dp"], o["ds"], o["dg"]),
                  xgd=self.xgd, swiglu=True)  # fmt: skip
        self.gemv(self.p_d, "d", c, li, o["dp"], o["ds"], o["dg"], o["y2"], res=o["y1"])

    def tma_kernels(self, kch, **options):
        rows = self.per_row
        t_o = tma.build(self.d, self.ko, kch=kch, residual=True, gw_rows=rows["o"], **options)
        t_gu = tma.build(2 * self.f, self.d, kch=kch, swiglu="stacked", gw_rows=rows["gu"],
                         **options)  # fmt: skip
        t_d = tma.build(self.d, self.f, kch=kch, residual=True, gw_rows=rows["d"], **options)
        return t_o, t_gu, t_d

    def tma_composition(self, kernels, c, li, o, y1=None):
        """The five launches with the TMA GEMVs; from a given y1 (the block's) when passed."""
        t_o, t_gu, t_d = kernels
        if y1 is None:
            self.quant_o(li, o)
            self.gemv(t_o, "o", c, li, o["ap"], o["as"], o["ag"], o["y1"], res=self.h)
            y1 = o["y1"]
        self.norm_quant(li, y1, o)
        self.gemv(t_gu, "gu", c, li, o["gp"], o["gs"], o["gg"], (o["dp"], o["ds"], o["dg"]),
                  xgd=self.xgd, swiglu=True)  # fmt: skip
        self.gemv(t_d, "d", c, li, o["dp"], o["ds"], o["dg"], o["y2"], res=y1)

    def block(self, kern, c, li, o):
        """The block kernel; without a_bf16 after o's quantizer (two launches)."""
        ws = self.w[c]
        if kern.plan.a_bf16:
            head = (self.a, self.xgo)
        else:
            self.quant_o(li, o)
            head = (o["ap"], o["as"], o["ag"])
        ptrs = self._ptr(*head, self.h, *ws["o"], self.wg["o"], self.nw, self.xgu, *ws["gu"],
                         self.wg["gu"], self.xgd, *ws["d"], self.wg["d"], li,
                         *(o[k] for k in blk.OUTPUTS))  # fmt: skip
        p = kern.plan
        _launch_ptx(kern.ptx, blk.ENTRY, (p.grid, 1), p.threads, p.smem, ptrs, self.stream)

    # ------------------------------------------------------------------ calibration

    def calibrate(self, li):
        """Global and static scales so every stage sees values of order one (production's
        kernels; the same values for every layer)."""
        t = self.torch
        o = self.outs()
        zero = t.zeros(self.d, dtype=t.bfloat16, device=DEVICE)
        h, self.h = self.h, zero
        self.quant_o(li, o)
        self.gemv(self.p_o, "o", 0, li, o["ap"], o["as"], o["ag"], o["y1"], res=self.h)
        t.cuda.synchronize()
        self.wg["o"] = self.row_factor["o"] / float(o["y1"].float().std())
        self.h = t.randn(self.d, device=DEVICE).to(t.bfloat16)
        del h
        self.gemv(self.p_o, "o", 0, li, o["ap"], o["as"], o["ag"], o["y1"], res=self.h)
        t.cuda.synchronize()
        y1 = o["y1"].float()
        normed = y1 * t.rsqrt((y1 * y1).mean() + self.eps) * self.nw[int(li)].float()
        self.xgu.fill_(_scale_of(float(normed.abs().max())))
        self.norm_quant(li, o["y1"], o)
        self.gemv(self.p_gu_plain, "gu", 0, li, o["gp"], o["gs"], o["gg"], o["y_gu"])
        t.cuda.synchronize()
        self.wg["gu"] = self.row_factor["gu"] * (2.0 / float(o["y_gu"].float().std()))
        self.gemv(self.p_gu_plain, "gu", 0, li, o["gp"], o["gs"], o["gg"], o["y_gu"])
        t.cuda.synchronize()
        gate, up = o["y_gu"].float()[: self.f], o["y_gu"].float()[self.f :]
        self.xgd.fill_(_scale_of(float((t.nn.functional.silu(gate) * up).abs().max())))
        self.gemv(self.p_gu, "gu", 0, li, o["gp"], o["gs"], o["gg"], (o["dp"], o["ds"], o["dg"]),
                  xgd=self.xgd, swiglu=True)  # fmt: skip
        zero_res = zero
        self.gemv(self.p_d, "d", 0, li, o["dp"], o["ds"], o["dg"], o["y2"], res=zero_res)
        t.cuda.synchronize()
        self.wg["d"] = self.row_factor["d"] / float(o["y2"].float().std())


def _same(torch, a, b) -> float:
    return float((a.view(torch.uint8) == b.view(torch.uint8)).double().mean())


def _rel(torch, a, b) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def _compare(torch, row, o1, o2, want, prod, names) -> None:
    """Into `row`: run twice the same bytes, each output's fraction of bytes equal to the
    composition's and to production's; ok when repeatable and every output equal to the
    composition's."""
    row["repeatable"] = all(_same(torch, o1[k], o2[k]) == 1.0 for k in names)
    row["equal_to_composition"] = {k: _same(torch, o1[k], want[k]) for k in names}
    row["equal_to_production"] = {k: _same(torch, o1[k], prod[k]) for k in names}
    row["ok"] = row["repeatable"] and all(x == 1.0 for x in row["equal_to_composition"].values())


def _rows(variants, tag: str, one) -> tuple[list, list]:
    """Rows and failures of one(variant, row) -> ok for each variant (an exception is a failed
    row naming it), each row printed as it is done."""
    rows, failures = [], []
    for v in variants:
        row = {"case": tag, "variant": v}
        try:
            row["ok"] = bool(one(v, row))
            if not row["ok"]:
                failures.append(f"{v} {tag}: {row}")
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"[:400]
            failures.append(f"{v} {tag}: {row['error']}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows, failures


def check(torch, prob: Block, variants, sms: int) -> tuple[list, list]:
    """Correctness rows and failures of every variant on `prob` (layer 1)."""
    t = torch
    li = t.tensor(prob.layers - 1, dtype=t.int32, device=DEVICE)
    tag = "gw_rows " + "".join("r" if r else "m" for r in prob.gw_rows)  # a row / a matrix
    prod = prob.outs()
    prob.production(0, li, prod)
    t.cuda.synchronize()

    def one(v, row):
        kern = blk.build(prob.d, prob.ko, prob.f, sms=sms, gw_rows=prob.gw_rows, eps=prob.eps,
                         **VARIANTS[v])  # fmt: skip
        row["plan"] = str(kern.plan)
        o1, o2 = prob.outs(), prob.outs()
        prob.block(kern, 0, li, o1)
        prob.block(kern, 0, li, o2)
        t.cuda.synchronize()
        want = prob.outs()
        kernels = prob.tma_kernels(kern.plan.kch)
        prob.tma_composition(kernels, 0, li, want, y1=o1["y1"])
        first = prob.outs()  # o's input quantized by production's kernel, then TMA's o
        prob.quant_o(li, first)
        prob.gemv(kernels[0], "o", 0, li, first["ap"], first["as"], first["ag"], first["y1"],
                  res=prob.h)  # fmt: skip
        t.cuda.synchronize()
        want["y1"] = first["y1"]
        _compare(t, row, o1, o2, want, prod, blk.OUTPUTS)
        row["y2_rel_to_production"] = _rel(t, o1["y2"], prod["y2"])
        row["y1_rel_to_production"] = _rel(t, o1["y1"], prod["y1"])
        row["finite"] = bool(t.isfinite(o1["y2"]).all() and t.isfinite(o1["y1"]).all())
        return row["ok"] and row["finite"]

    return _rows(variants, tag, one)


def _time_all(torch, bk, prob, weight_bytes: int, production, composition, variants, build,
              launch, skip) -> dict:  # fmt: skip
    """Per-layer device time in CUDA graphs over the problem's weight copies (each copy its own
    buffers): production(c, li, bufs), composition(c, li, bufs), and launch(kernel, c, li,
    bufs) of build(variant) for each variant not in `skip`; production again last (drift)."""
    li = torch.tensor(0, dtype=torch.int32, device=DEVICE)
    copies = len(prob.w)
    bufs = [prob.outs() for _ in range(copies)]

    def graph(fn):
        return bk.time_torch_graph(torch, [lambda c=c: fn(c, li, bufs[c]) for c in range(copies)])

    out = {"copies": copies, "weight_bytes": weight_bytes}
    out["production_s"] = graph(production)
    out["tma_composition_s"] = graph(composition)
    for v in variants:
        if v in skip:
            continue
        try:
            kern = build(v)
            out[f"{v}_s"] = graph(lambda c, li, o, k=kern: launch(k, c, li, o))
        except Exception as err:  # noqa: BLE001
            out[f"{v}_error"] = f"{type(err).__name__}: {err}"[:300]
    out["production_again_s"] = graph(production)
    print(json.dumps(out), flush=True)
    return out


def timing(torch, bk, prob: Block, variants, sms: int, skip=()) -> dict:
    """Per-layer device time of each variant, production's five launches and the TMA
    composition."""
    p0 = blk.plan(prob.d, prob.ko, prob.f)
    kernels = prob.tma_kernels(p0.kch)
    return _time_all(
        torch, bk, prob, p0.weight_bytes, prob.production,
        lambda c, li, o: prob.tma_composition(kernels, c, li, o), variants,
        lambda v: blk.build(prob.d, prob.ko, prob.f, sms=sms, gw_rows=prob.gw_rows,
                            eps=prob.eps, **VARIANTS[v]),
        prob.block, skip,
    )  # fmt: skip


def summarize(tm: dict, variants, copy_bps: float | None) -> dict:
    base = tm["production_s"]
    rows = {}
    for name in ["production", "tma_composition", *variants]:
        s = tm.get(f"{name}_s")
        if s is None:
            continue
        rows[name] = {"us": round(1e6 * s, 2), "over_production": round(s / base, 4),
                      "TBps": round(tm["weight_bytes"] / s / 1e12, 3)}  # fmt: skip
        if copy_bps:
            rows[name]["over_copy_floor"] = round(s / (tm["weight_bytes"] / copy_bps), 4)
    return rows


# ----------------------------------------------------------------------------- pre-attention

QKV_VARIANTS = {"tma": {}, "tma_s10": {"stages": 10}, "lsu": {"producer": "lsu"}}
THETA = 1e6  # Qwen3's rope_theta


class Qkv:
    """The pre-attention kernel's problem (one row): operands, calibration and the launches of
    production's three kernels (the RMSNorm quantizer, the qkv GEMV, qk_norm_rope_cache), of
    the TMA composition and of the kernel."""

    def __init__(self, torch, d, heads, kv_heads, head_dim, *, slots, layers, copies, gw_rows,
                 eps, seed):  # fmt: skip
        from cuda_ops import nvfp4_gemv, nvfp4_quant, rope_cache
        from rejax import layers as rl

        self.torch, self.d, self.gw_rows, self.eps, self.layers = torch, d, gw_rows, eps, layers
        self.heads, self.kv_heads, self.head_dim, self.slots = heads, kv_heads, head_dim, slots
        n = self.n = (heads + 2 * kv_heads) * head_dim
        dev = DEVICE
        rng = np.random.default_rng(_seed(*seed))
        g = torch.Generator(device=dev).manual_seed(_seed(*seed, "w"))
        self.w = [(torch.randint(0, 256, (layers, n, d // 2), dtype=torch.uint8, device=dev,
                                 generator=g),
                   torch.randint(*SCALES, (layers, n, d // 16), dtype=torch.uint8, device=dev,
                                 generator=g)) for _ in range(copies)]  # fmt: skip
        shape = (layers, n) if gw_rows else (layers,)
        self.row_factor = torch.from_numpy((0.5 + rng.random(shape)).astype(np.float32)).to(dev)
        self.wg = self.row_factor.clone()
        self.x = torch.randn(d, generator=g, device=dev).to(torch.bfloat16)
        self.nw = (1 + 0.1 * torch.randn(layers, d, generator=g, device=dev)).to(torch.bfloat16)
        self.xg = torch.ones(layers, dtype=torch.float32, device=dev)
        self.q_norm = (1 + 0.1 * torch.randn(layers, head_dim, generator=g, device=dev)).to(
            torch.bfloat16
        )
        self.k_norm = (1 + 0.1 * torch.randn(layers, head_dim, generator=g, device=dev)).to(
            torch.bfloat16
        )
        self.positions = torch.tensor([777], dtype=torch.int32, device=dev)
        self.index = torch.tensor([555 % slots], dtype=torch.int32, device=dev)
        inv = np.array(rl.rope_inv_freq(head_dim, THETA), np.float32)  # a writable copy
        self.inv_freq = torch.from_numpy(inv).to(dev)
        cache = (layers, 1, slots, kv_heads, head_dim)
        self.cache0 = [torch.randn(cache, generator=g, device=dev).to(torch.bfloat16)
                       for _ in range(2)]  # fmt: skip
        self.p_gemv = nvfp4_gemv.build("w4a4", 1, n, d, gw_rows=gw_rows)
        fused = nvfp4_gemv.Fused(prologue="rmsnorm", eps=eps, norm_stacked=True, scale_stacked=True)
        self.q_norm_k = nvfp4_quant.build(1, d, fused)
        self.rope = rope_cache.build(rope_cache.Shape(batch=1, heads=heads, kv_heads=kv_heads,
                                                      head_dim=head_dim, slots=slots,
                                                      qk_norm=True, eps=eps, index_rows=False))  # fmt: skip

    @property
    def stream(self) -> int:
        return self.torch.cuda.current_stream().cuda_stream

    def outs(self):
        """Fresh caches (copies of the same random ones) and poisoned results."""
        t, dev, nan = self.torch, DEVICE, float("nan")
        return {
            "q_out": t.full((self.heads * self.head_dim,), nan, dtype=t.bfloat16, device=dev),
            "k_cache": self.cache0[0].clone(),
            "v_cache": self.cache0[1].clone(),
            "qkv": t.full((self.n,), nan, dtype=t.bfloat16, device=dev),
            "gp": t.full((self.d // 2,), 0xAB, dtype=t.uint8, device=dev),
            "gs": t.full((self.d // 16,), 0xAB, dtype=t.uint8, device=dev),
            "gg": t.full((1,), nan, dtype=t.float32, device=dev),
        }

    def _ptr(self, *ts) -> list:
        return [x.data_ptr() for x in ts]

    def composition(self, gemv, c, li, o):
        """The quantizer, `gemv` (production's or a TMA build: the same operands), rope_cache."""
        from cuda_ops import nvfp4_quant, rope_cache

        q = self.q_norm_k
        _launch_ptx(q.ptx, nvfp4_quant.ENTRY, (1, self.d // q.chunk), q.threads, 0,
                    self._ptr(self.x, self.xg, self.nw, li, o["gp"], o["gs"], o["gg"]),
                    self.stream)  # fmt: skip
        wp, ws = self.w[c]
        gemv.launch(self.stream, self._ptr(o["gp"], o["gs"], o["gg"], wp, ws, self.wg, li,
                                           o["qkv"]))  # fmt: skip
        r = self.rope
        _launch_ptx(r.ptx, rope_cache.ENTRY, (r.grid, 1), 32 * r.warps, 0,
                    self._ptr(o["qkv"], self.q_norm, self.k_norm, li, self.positions, self.index,
                              self.inv_freq, o["k_cache"], o["v_cache"], o["q_out"],
                              o["k_cache"], o["v_cache"]), self.stream)  # fmt: skip

    def kernel(self, kern, c, li, o):
        wp, ws = self.w[c]
        p = kern.plan
        ptrs = self._ptr(self.x, self.nw, self.xg, wp, ws, self.wg, li, self.q_norm, self.k_norm,
                         self.positions, self.index, self.inv_freq, o["k_cache"], o["v_cache"],
                         o["q_out"], o["k_cache"], o["v_cache"], o["qkv"], o["gp"], o["gs"])  # fmt: skip
        _launch_ptx(kern.ptx, blk.QKV_ENTRY, (p.grid, 1), p.threads, p.smem, ptrs, self.stream)

    def calibrate(self, li):
        """qkv's static input scale from the normed input's amax; its global scales so q, k, v
        come out of standard deviation 1."""
        t = self.torch
        x = self.x.float()
        normed = x * t.rsqrt((x * x).mean() + self.eps) * self.nw[int(li)].float()
        self.xg.fill_(_scale_of(float(normed.abs().max())))
        o = self.outs()
        self.composition(self.p_gemv, 0, li, o)
        t.cuda.synchronize()
        self.wg = self.row_factor / float(o["qkv"].float().std())


def check_qkv(torch, prob: Qkv, variants, sms: int) -> tuple[list, list]:
    """Correctness rows and failures of the pre-attention kernel on `prob` (its last layer):
    bytes against production's quantizer, the TMA GEMV of the same stage size and production's
    rope_cache on its qkv; agreement with production's three kernels reported."""
    t = torch
    li = t.tensor(prob.layers - 1, dtype=t.int32, device=DEVICE)
    tag = "qkv " + ("gw_rows" if prob.gw_rows else "gw")
    prod = prob.outs()
    prob.composition(prob.p_gemv, 0, li, prod)
    t.cuda.synchronize()

    def one(v, row):
        kern = blk.build_qkv(prob.d, prob.heads, prob.kv_heads, prob.head_dim, prob.slots,
                             sms=sms, gw_rows=prob.gw_rows, eps=prob.eps, **QKV_VARIANTS[v])  # fmt: skip
        row["plan"] = str(kern.plan)
        o1, o2 = prob.outs(), prob.outs()
        prob.kernel(kern, 0, li, o1)
        prob.kernel(kern, 0, li, o2)
        want = prob.outs()
        gemv = tma.build(prob.n, prob.d, kch=kern.plan.kch, gw_rows=prob.gw_rows)
        prob.composition(gemv, 0, li, want)
        t.cuda.synchronize()
        _compare(t, row, o1, o2, want, prod, ("q_out", "k_cache", "v_cache", "qkv", "gp", "gs"))
        row["q_rel_to_production"] = _rel(t, o1["q_out"], prod["q_out"])
        return row["ok"]

    return _rows(variants, tag, one)


def timing_qkv(torch, bk, prob: Qkv, variants, sms: int, skip=()) -> dict:
    """Per-layer device time of production's three launches, the TMA composition and each
    variant."""
    p0 = blk.plan_qkv(prob.d, prob.heads, prob.kv_heads, prob.head_dim, prob.slots)
    gemv = tma.build(prob.n, prob.d, kch=p0.kch, gw_rows=prob.gw_rows)
    return _time_all(
        torch, bk, prob, p0.weight_bytes,
        lambda c, li, o: prob.composition(prob.p_gemv, c, li, o),
        lambda c, li, o: prob.composition(gemv, c, li, o), variants,
        lambda v: blk.build_qkv(prob.d, prob.heads, prob.kv_heads, prob.head_dim, prob.slots,
                                sms=sms, gw_rows=prob.gw_rows, eps=prob.eps, **QKV_VARIANTS[v]),
        prob.kernel, skip,
    )  # fmt: skip


def _parse_shape(text: str, n: int, what: str) -> tuple:
    try:
        shape = tuple(int(x) for x in text.split("x"))
        if len(shape) != n:
            raise ValueError
    except ValueError:
        raise SystemExit(f"{text!r}: expected {what}") from None
    return shape


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="block,qkv",
                    help="block (the post-attention kernel), qkv (the pre-attention kernel)")  # fmt: skip
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {sorted(VARIANTS)}")
    ap.add_argument("--qkv-variants", default=",".join(QKV_VARIANTS),
                    help=f"of {sorted(QKV_VARIANTS)}")  # fmt: skip
    ap.add_argument("--shape", default=DEFAULT_SHAPE, help="D x KO x F (hidden, o's K, FFN)")
    ap.add_argument("--qkv-shape", default=DEFAULT_QKV_SHAPE,
                    help="D x heads x kv_heads x head_dim x cache slots")  # fmt: skip
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument("--eps", type=float, default=1e-6, help="the RMSNorm epsilon")
    ap.add_argument("--git-sha", default=None, help="the commit measured")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if not parts or any(p not in ("block", "qkv") for p in parts):
        raise SystemExit(f"--parts {args.parts!r}: a comma-separated subset of block,qkv expected")
    variants, qkv_variants = args.variants.split(","), args.qkv_variants.split(",")
    for flag, vs, known in (("--variants", variants, VARIANTS),
                            ("--qkv-variants", qkv_variants, QKV_VARIANTS)):  # fmt: skip
        for v in vs:
            if v not in known:
                raise SystemExit(f"{flag}: {v!r} is not one of {sorted(known)}")
    shape = _parse_shape(args.shape, 3, "--shape D x KO x F like 4096x4096x12288")
    qkv_shape = _parse_shape(args.qkv_shape, 5, "--qkv-shape D x heads x kv x head_dim x slots")
    try:
        problems(shape, variants)  # every plan valid before any GPU work
        for v in qkv_variants:
            blk.plan_qkv(*qkv_shape, **QKV_VARIANTS[v])
    except KernelError as err:
        raise SystemExit(f"--shape / --variants: {err}") from err
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    from cuda_ops import build as cbuild
    from experiments import bench_kernel as bk

    t0 = time.time()
    sms = cbuild.device_sms()
    result = {
        "versions": bk._versions(torch),
        "git_sha": args.git_sha,
        "device": torch.cuda.get_device_name(),
        "sms": sms,
        "parts": parts,
        "shape": shape,
        "qkv_shape": qkv_shape,
        "method": __doc__,
        "variants": {v: VARIANTS[v] for v in variants},
        "qkv_variants": {v: QKV_VARIANTS[v] for v in qkv_variants},
        "ptxas": {},
        "rows": [],
    }
    for v in variants if "block" in parts else ():
        rep = blk.ptxas_report(blk.plan(*shape, sms=sms, **VARIANTS[v]))
        result["ptxas"][v] = {k: x for k, x in rep.items() if k != "log"}
    for v in qkv_variants if "qkv" in parts else ():
        rep = blk.ptxas_report_qkv(blk.plan_qkv(*qkv_shape, sms=sms, **QKV_VARIANTS[v]))
        result["ptxas"][f"qkv_{v}"] = {k: x for k, x in rep.items() if k != "log"}
    _write(args.out, {**result, "partial": True})
    failures = []
    if not args.no_time:
        result["copy_bandwidth_Bps"] = bk.copy_bandwidth(torch)
    if "block" in parts:
        for gw_rows in GW_ROWS:
            prob = Block(torch, *shape, layers=2, copies=1, gw_rows=gw_rows, eps=args.eps,
                         seed=(shape, gw_rows))  # fmt: skip
            prob.calibrate(torch.tensor(1, dtype=torch.int32, device=DEVICE))
            rows, fails = check(torch, prob, variants, sms)
            result["rows"] += rows
            failures += fails
            del prob
            _write(args.out, {**result, "partial": True})
        if not args.no_time:
            bytes_ = blk.plan(*shape).weight_bytes
            prob = Block(torch, *shape, layers=1, copies=bk._copies(bytes_), gw_rows=GW_ROWS[1],
                         eps=args.eps, seed=(shape, "time"))  # fmt: skip
            prob.calibrate(torch.tensor(0, dtype=torch.int32, device=DEVICE))
            failed = {f.split(" ")[0] for f in failures}
            result["timing"] = timing(torch, bk, prob, variants, sms, skip=failed)
            result["summary"] = summarize(result["timing"], variants, result["copy_bandwidth_Bps"])
            print(json.dumps(result["summary"], indent=1))
            del prob
            _write(args.out, {**result, "partial": True})
    if "qkv" in parts:
        d, heads, kvh, hd, slots = qkv_shape
        qkv_failures = []
        for gw_rows in (False, True):
            prob = Qkv(torch, d, heads, kvh, hd, slots=slots, layers=2, copies=1,
                       gw_rows=gw_rows, eps=args.eps, seed=(qkv_shape, gw_rows))  # fmt: skip
            prob.calibrate(torch.tensor(1, dtype=torch.int32, device=DEVICE))
            rows, fails = check_qkv(torch, prob, qkv_variants, sms)
            result["rows"] += rows
            qkv_failures += fails
            del prob
            _write(args.out, {**result, "partial": True})
        failures += qkv_failures
        if not args.no_time:
            nbytes = blk.plan_qkv(*qkv_shape).weight_bytes
            prob = Qkv(torch, d, heads, kvh, hd, slots=slots, layers=1,
                       copies=bk._copies(nbytes), gw_rows=True, eps=args.eps,
                       seed=(qkv_shape, "time"))  # fmt: skip
            prob.calibrate(torch.tensor(0, dtype=torch.int32, device=DEVICE))
            failed = {f.split(" ")[0] for f in qkv_failures}
            tm = timing_qkv(torch, bk, prob, qkv_variants, sms, skip=failed)
            result["timing_qkv"] = tm
            result["summary_qkv"] = summarize(tm, qkv_variants, result["copy_bandwidth_Bps"])
            print(json.dumps(result["summary_qkv"], indent=1))
    result["failures"] = failures
    result["wall_s"] = time.time() - t0
    _write(args.out, result)
    print(f"{len(failures)} failures" + "".join(f"\n  {f}" for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
