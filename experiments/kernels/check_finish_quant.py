"""EXPERIMENT (device, [T2-C]): the finish-quantizer `nvfp4_finish_quantize` (Config.gemm_chain
"fused") against the two launches it replaces, bit for bit and kernel alone, on one GPU. From
the repository root:

    PYTHONPATH=. python3 experiments/kernels/check_finish_quant.py --out $OUT/finish_quant.json

1. For the pairs of a Qwen3-8B layer whose producer splits K, o_proj -> gate_up (the
   residual added and stored, RMSNorm, K = 4096), gate_up -> down (SwiGLU over 2 x 12288
   columns, K = 12288) and down_proj -> the next layer's qkv (as o_proj -> gate_up, down's
   split), at `--ms` (default 8, 16, 32, 64) with the production GEMM plan's K
   split of the producer, builds its split-K finish kernel and the quantizer's x_hat form (the
   "split" path's launches), and the finish-quantizer at each chunking of `--chunks` ("row":
   one CTA per row, the row kept in shared memory; "1024", "512": the quantizer's chunkings,
   each CTA re-reading the row's partials for the RMSNorm statistic; "c1024", "c512": those
   chunkings with a row's CTAs one thread-block cluster, `FinishIn.cluster`: each partial read
   once, the statistic through distributed shared memory; RMSNorm pairs only). Also qkv -> the rope
   kernel (q/k norm, RoPE, cache write at one slot per row): the finish then the plain rope
   kernel against the rope kernel that reads the partials.
2. Runs both on random partials (a zero row, a saturating block) into NaN-poisoned outputs:
   x_hat, the global scales and (o_proj) the residual stream must be the two launches' bytes,
   and written (rope: q and both caches).
3. Times each alone: one CUDA graph of `--copies` repetitions of the launches on one stream
   (the partials stay in L2, as in the decode step, where the GEMM has just written them),
   CUDA events, median of 25 replays: us per pair of launches / per fused launch.
4. Writes one JSON (versions, git sha from GIT_SHA, device, rows) and exits 1 if any output
   differed.

GEMM letters: M rows, N out features, K in features.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

D, F = 4096, 12288
# (name, producer N, producer K, next K, prologue, residual / y stored)
PAIRS = (
    ("o_gate_up", D, D, D, "rmsnorm", True),
    ("gate_up_down", 2 * F, D, F, "swiglu", False),
    # down_proj -> the next layer's qkv input (in the decoder read at layer + 1: the same work)
    ("down_qkv", D, F, D, "rmsnorm", True),
)
DEFAULT_MS = (8, 16, 32, 64)
DEFAULT_CHUNKS = ("row", "1024", "512", "c1024", "c512")


def kernels(m: int, pair: tuple, chunks, arch=None) -> dict:
    """The pair's kernels at M rows: "finish" (the producer's GEMM, for its finish entry),
    "quant" (the quantizer), "fin_<chunk>" per chunking (CPU: NVRTC only)."""
    from cuda_ops import nvfp4_gemm, nvfp4_gemv, nvfp4_quant

    _, n, kp, k, prologue, residual = pair
    fused = nvfp4_gemv.Fused(prologue=prologue, norm_stacked=True, scale_stacked=True)
    gemm = nvfp4_gemm.build(m, n, kp, arch=arch, residual=residual)
    if not gemm.plan.partials:
        return {"finish": gemm}
    quant = nvfp4_quant.build(m, k, fused, arch=arch, out="xhat")
    out = {"finish": gemm, "quant": quant}
    fin = nvfp4_quant.FinishIn(splitk=gemm.plan.splitk, w_shift=gemm.plan.w_shift,
                               residual=residual, store_y=residual)  # fmt: skip
    for chunk in chunks:
        cluster = chunk.startswith("c")
        size = k if chunk == "row" else int(chunk.removeprefix("c"))
        if k % size or (cluster and (prologue == "swiglu" or not 2 <= k // size <= 8)):
            continue
        out[f"fin_{chunk}"] = nvfp4_quant.build(
            m,
            k,
            fused,
            arch=arch,
            out="xhat",
            chunk=size,
            threads=quant.threads,
            finish=dataclasses.replace(fin, cluster=cluster),
        )  # the quantizer's threads: the RMSNorm sum in its order, the same bytes
    return out


def _operands(torch, m, pair, splitk, seed):
    _, n, _, k, _, residual = pair
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    part = torch.randn((splitk, m, n), generator=g, device="cuda") * 40
    part[:, 0] = 0
    part[:, m - 1, 64:96] = 3e5
    xgp = torch.rand((m,), generator=g, device="cuda") * 1.5e-2 + 5e-3
    res = (torch.randn((m, n), generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    if not residual:
        res = torch.zeros((1, 1), dtype=torch.bfloat16, device="cuda")
    wg = torch.rand((2,), generator=g, device="cuda") * 3e-4 + 1e-4
    xg = torch.tensor([0.05, 0.02], device="cuda")
    nw = (1 + 0.1 * torch.randn((2, k), generator=g, device="cuda")).to(torch.bfloat16)
    layer = torch.tensor(1, dtype=torch.int32, device="cuda")
    return part, xgp, res, wg, xg, nw, layer


def _stream(torch) -> int:
    """The current torch stream, read at each launch: a CUDA graph captures on its own stream,
    so a stream read before the capture would leave the graph empty (and time nothing)."""
    return torch.cuda.current_stream().cuda_stream


def _launchers(torch, ks, ops, m, pair):
    """name -> (outputs, launch()) for the two launches and each fused chunking."""
    from cuda_ops import nvfp4_gemm

    _, n, _, k, _, residual = pair
    part, xgp, res, wg, xg, nw, layer = ops

    def nan(shape, dtype):
        return torch.full(shape, float("nan"), dtype=dtype, device="cuda")

    out = {}
    y = nan((m, n), torch.bfloat16)
    xh, xgo = nan((m, k), torch.float16), nan((m,), torch.float32)
    fin_ops = [part, xgp, *([res] if residual else []), wg, layer, y]
    q_ops = [y, xg, nw, layer, xh, xgo]

    def two():
        ks["finish"]._launch(
            nvfp4_gemm.FINISH_ENTRY, _stream(torch), [t.data_ptr() for t in fin_ops]
        )
        ks["quant"].launch(_stream(torch), [t.data_ptr() for t in q_ops])

    out["two"] = ((y, xh, xgo), two)
    for name, kern in ks.items():
        if not name.startswith("fin_"):
            continue
        fy = nan((m, n) if residual else (1,), torch.bfloat16)
        fxh, fxg = nan((m, k), torch.float16), nan((m,), torch.float32)
        ptrs = [t.data_ptr() for t in (part, xgp, res, wg, xg, nw, layer, fy, fxh, fxg)]
        out[name] = ((fy, fxh, fxg), lambda kern=kern, ptrs=ptrs: kern.launch(_stream(torch), ptrs))
    return out


def check_and_time(torch, m, pair, ks, copies) -> tuple[dict, list]:
    from experiments import bench_kernel as bk

    name, n, _, k, _, residual = pair
    row = {"pair": name, "m": m, "splitk": ks["finish"].plan.splitk, "k": k, "n": n}
    ops = _operands(torch, m, pair, row["splitk"], seed=m * 31 + n)
    runs = _launchers(torch, ks, ops, m, pair)
    for _, fn in runs.values():
        fn()
    torch.cuda.synchronize()
    (y, xh, xg), _ = runs["two"]
    fails = []
    for v, ((fy, fxh, fxg), fn) in runs.items():
        if v == "two":
            continue
        same = bool(torch.equal(fxh.view(torch.int16), xh.view(torch.int16)))
        same &= bool(torch.equal(fxg, xg))
        if residual:
            same &= bool(torch.equal(fy.view(torch.int16), y.view(torch.int16)))
        row[f"{v}_equal"] = same
        if not same:
            fails.append((name, m, v))
    for v, (_, fn) in runs.items():
        row[f"{v}_us"] = 1e6 * bk.time_torch_graph(torch, [fn] * copies)
    for v in runs:
        if v != "two":
            row[f"{v}_speedup"] = row["two_us"] / row[f"{v}_us"]
    return row, fails


def _launch_ptx(kernel, grid, block, stream, ptrs):
    """A direct launch of a PTX kernel object's entry (kernel.ptx, kernel's ENTRY)."""
    import ctypes

    from cuda.bindings import driver

    from cuda_ops import rope_cache as rk
    from cuda_ops.nvfp4_gemv import _drv_check

    key = id(kernel)
    if key not in _MODULES:
        module = _drv_check(driver.cuModuleLoadData(kernel.ptx.encode() + b"\0"), "load")
        fn = _drv_check(driver.cuModuleGetFunction(module, rk.ENTRY.encode()), "function")
        _MODULES[key] = (module, fn, kernel)
    params = (tuple(ptrs), tuple(ctypes.c_void_p for _ in ptrs))
    _drv_check(
        driver.cuLaunchKernel(_MODULES[key][1], grid, 1, 1, block, 1, 1, 0, stream, params, 0),
        "cuLaunchKernel",
    )


_MODULES: dict = {}
ROPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "slots": 64}


def rope_kernels(m: int, arch=None) -> dict:
    """qkv -> rope at M rows: the qkv GEMM (for its finish entry), the plain rope kernel and
    the rope kernel reading the partials; {} where the qkv GEMM does not split K."""
    from cuda_ops import nvfp4_gemm, nvfp4_quant
    from cuda_ops import rope_cache as rk

    n = (ROPE["heads"] + 2 * ROPE["kv_heads"]) * ROPE["head_dim"]
    gemm = nvfp4_gemm.build(m, n, D, arch=arch)
    if not gemm.plan.partials:
        return {}
    shape = rk.Shape(batch=m, heads=ROPE["heads"], kv_heads=ROPE["kv_heads"],
                     head_dim=ROPE["head_dim"], slots=ROPE["slots"], qk_norm=True, eps=1e-6,
                     index_rows=True)  # fmt: skip
    fin = nvfp4_quant.FinishIn(splitk=gemm.plan.splitk, w_shift=gemm.plan.w_shift)
    return {"finish": gemm, "rope": rk.build(shape, arch=arch),
            "rope_fin": rk.build(shape, arch=arch, finish=fin)}  # fmt: skip


def check_rope(torch, m, ks, copies) -> tuple[dict, list]:
    from cuda_ops import nvfp4_gemm
    from experiments import bench_kernel as bk

    gemm = ks["finish"]
    n, s = gemm.plan.n, gemm.plan.splitk
    g = torch.Generator(device="cuda")
    g.manual_seed(m)
    dev = "cuda"
    part = torch.randn((s, m, n), generator=g, device=dev) * 40
    xgp = torch.rand((m,), generator=g, device=dev) * 1.5e-2 + 5e-3
    wg = torch.rand((2,), generator=g, device=dev) * 3e-4 + 1e-4
    hd = ROPE["head_dim"]
    qn, kn = ((1 + 0.1 * torch.randn((2, hd), generator=g, device=dev)).to(torch.bfloat16)
              for _ in range(2))  # fmt: skip
    layer = torch.tensor(1, dtype=torch.int32, device=dev)
    pos = torch.arange(m, dtype=torch.int32, device=dev) + 9
    index = torch.arange(m, dtype=torch.int32, device=dev) % ROPE["slots"]
    inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
    cshape = (2, m, ROPE["slots"], ROPE["kv_heads"], hd)
    cache = torch.randn(cshape, generator=g, device=dev).to(torch.bfloat16)
    rope, fin = ks["rope"], ks["rope_fin"]
    outs = {}
    for v in ("two", "rope_fin"):
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        q = torch.full((m, ROPE["heads"], hd), float("nan"), dtype=torch.bfloat16, device=dev)
        kc, vc = cache.clone(), cache.clone()
        tail = [qn, kn, layer, pos, index, inv, kc, vc, q, kc, vc]
        if v == "two":

            def fn(y=y, tail=tail):
                ptrs = [t.data_ptr() for t in (part, xgp, wg, layer, y)]
                gemm._launch(nvfp4_gemm.FINISH_ENTRY, _stream(torch), ptrs)
                _launch_ptx(rope, rope.grid, 32 * rope.warps, _stream(torch),
                            [t.data_ptr() for t in [y, *tail]])  # fmt: skip
        else:

            def fn(tail=tail):
                _launch_ptx(fin, fin.grid, 32 * fin.warps, _stream(torch),
                            [t.data_ptr() for t in [part, xgp, wg, *tail]])  # fmt: skip

        fn()
        outs[v] = ((q, kc, vc), fn)
    torch.cuda.synchronize()
    row = {"pair": "qkv_rope", "m": m, "splitk": s, "n": n}
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(outs["two"][0], outs["rope_fin"][0], strict=True))  # fmt: skip
    row["rope_fin_equal"] = bool(same) and bool(torch.isfinite(outs["two"][0][0]).all())
    for v, (_, fn) in outs.items():
        row[f"{v}_us"] = 1e6 * bk.time_torch_graph(torch, [fn] * copies)
    row["rope_fin_speedup"] = row["two_us"] / row["rope_fin_us"]
    return row, [] if row["rope_fin_equal"] else [("qkv_rope", m, "rope_fin")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--chunks", default=",".join(DEFAULT_CHUNKS),
                    help="finish-quantizer chunkings: 'row', a multiple of 256, or 'c' and a "
                         "multiple of 256 (a cluster of K / chunk CTAs a row)")  # fmt: skip
    ap.add_argument("--copies", type=int, default=50, help="launch groups per CUDA graph")
    args = ap.parse_args(argv)
    # a graph that captured nothing times nothing: stop rather than report it
    warnings.filterwarnings("error", message="The CUDA Graph is empty")
    try:
        ms = tuple(int(v) for v in args.ms.split(","))
    except ValueError:
        raise SystemExit(f"--ms {args.ms!r}: expected comma-separated ints, e.g. 8,16") from None
    chunks = tuple(args.chunks.split(","))
    for ch in chunks:
        size = ch.removeprefix("c")
        if ch != "row" and (not size.isdigit() or int(size) <= 0 or int(size) % 256):
            raise SystemExit(
                f"--chunks: {ch!r} is not 'row', a positive multiple of 256 or 'c' and one"
            )
    t0 = time.time()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import torch

    from cuda_ops import build as cbuild
    from experiments import bench_kernel as bk

    result = {"git_sha": os.environ.get("GIT_SHA"), "versions": bk._versions(torch),
              "device": str(jax.devices()[0]), "num_sms": cbuild.device_sms(),
              "method": __doc__, "rows": []}  # fmt: skip
    failures = []
    for pair in PAIRS:
        for m in ms:
            ks = kernels(m, pair, chunks)
            if "quant" not in ks:
                result["rows"].append({"pair": pair[0], "m": m, "splitk": 1, "skipped": True})
                continue
            row, fails = check_and_time(torch, m, pair, ks, args.copies)
            failures += fails
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    for m in ms:
        ks = rope_kernels(m)
        if ks:
            row, fails = check_rope(torch, m, ks, args.copies)
            failures += fails
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    result["failures"] = [list(f) for f in failures]
    result["passed"] = not failures
    result["wall_s"] = time.time() - t0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if failures:
        print("FAILED:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    print(f"passed, {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
