"""Launch shapes of the quantizer kernel's "xhat_tiles" and "xhat_bf16" forms
(cuda_ops/nvfp4_quant.py) at prefill rows: chunk (elements of a row per CTA) and threads per CTA.

A profile of the 8-layer prefill (512 tokens, batch 1, `gemm_wgmma_x_quant="kernel"`) put the
form's first design (one CTA a row from 264 rows, each thread storing 16-byte pieces 2 KiB
apart) at 20 us median per call, 7x its bytes' floor; the current one takes 8 rows a CTA and
stores whole 128-byte core matrices.
For each layer input of Qwen3-8B (K 4096 after RMSNorm, K 4096 plain, K 12288 after SwiGLU;
static stacked input scale, stacked norm weights, as the model's) and each M this script:

1. builds the default launch shape and each candidate of each form (`CANDIDATES` for
   "xhat_tiles", `BF16_CANDIDATES` for "xhat_bf16", the dot path's operand at 4096 rows; those
   valid for K);
2. launches each once with its outputs inside guard regions (a store outside them is
   counted and fails the run) and checks that every candidate writes the default's bytes (tiles and global scales) where the
   chunking cannot change them (prologue "none" and "swiglu"; the RMSNorm mean square is
   summed in an order that depends on the threads, so a few bf16 inputs may round the other
   way: reported, not counted as a mismatch);
3. times each alone in a CUDA graph of direct launches over enough distinct input copies to
   read past L2 (median of 25 replays, `bench_kernel.time_torch_graph`), beside the copy
   bandwidth measured in the same run and the floor its bytes set at that bandwidth.

    PYTHONPATH=. python3 experiments/kernels/bench_quant_tiles.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

# (prologue, K) of the decoder's four linears' inputs: qkv and gate_up (RMSNorm), o (none),
# down (SwiGLU of the [M, 2K] gate_up output)
INPUTS = (("rmsnorm", 4096), ("none", 4096), ("swiglu", 12288))
# (chunk, threads) of the "xhat_tiles" form (8 rows a CTA; a chunk past
# nvfp4_quant.TILES_IMG_MAX is built in passes; None: K, one CTA an 8-row group, the row
# statistics read once); the default (`nvfp4_quant.default_chunk`) is 512, 128 threads
CANDIDATES = (
    (1024, 128),
    (512, 128),
    (2048, 128),
    (256, 128),
    (1024, 256),
    (2048, 256),
    (4096, 128),
    (None, 128),
    (None, 256),
)


# (chunk, threads) of the "xhat_bf16" form (bf16 [M, K] in natural K order; chunk K = one CTA a
# row, the default from nvfp4_quant.ROW_CTA_MIN_M rows; None: K)
BF16_CANDIDATES = (
    (None, 128),
    (None, 256),
    (None, 512),
    (4096, 256),
    (2048, 256),
    (1024, 128),
    (512, 64),
)


def candidates(k: int, form: str = "xhat_tiles") -> list[tuple[int, int]]:
    """The (chunk, threads) pairs of `form` valid for K (chunk dividing K)."""
    if form == "xhat_bf16":
        pairs = {(c or k, t) for c, t in BF16_CANDIDATES}
        return sorted((c, t) for c, t in pairs if k % c == 0)
    pairs = {(c or k, t) for c, t in CANDIDATES}
    return sorted((c, t) for c, t in pairs if k % c == 0)


def _time_form(torch, bk, nvfp4_quant, form, fused, prologue, k, width, m, xg, norm, layer, bw,
               tile_m) -> dict:  # fmt: skip
    """One (input, M, form) row: the form's default launch shape and its candidates ("xhat": the
    default only), each checked inside guard regions against the default's bytes and timed."""
    default = nvfp4_quant.build(m, k, fused, out=form, tile_m=tile_m)
    shapes = candidates(k, form) if form != "xhat" else [(default.chunk, default.threads)]
    kernels = {
        (chunk, threads): nvfp4_quant.build(
            m, k, fused, chunk=chunk, threads=threads, out=form, tile_m=tile_m
        )
        for chunk, threads in shapes
    }
    (xh_shape, xh_dtype), _ = default.out_shapes
    dtype = getattr(torch, xh_dtype)
    in_bytes = m * width * 2
    out_bytes = math.prod(xh_shape) * 2 + 4 * m
    copies = int(min(32, max(4, math.ceil((256 << 20) / (in_bytes + out_bytes)))))
    xs = [2.0 * torch.randn((m, width), device="cuda").to(torch.bfloat16) for _ in range(copies)]
    outs = [
        (torch.empty(xh_shape, dtype=dtype, device="cuda"),
         torch.empty((m,), dtype=torch.float32, device="cuda"))
        for _ in range(copies)
    ]  # fmt: skip
    ptrs = [[xs[i].data_ptr(), xg.data_ptr(), norm.data_ptr(), layer.data_ptr(),
             outs[i][0].data_ptr(), outs[i][1].data_ptr()] for i in range(copies)]  # fmt: skip
    _launch_fn(torch, default, ptrs[0])()
    torch.cuda.synchronize()
    want = (outs[0][0].clone(), outs[0][1].clone())
    floor = (in_bytes + out_bytes) / bw
    row = {"form": form, "prologue": prologue, "k": k, "m": m, "bytes": in_bytes + out_bytes,
           "floor_us": floor * 1e6, "default": [default.chunk, default.threads],
           "variants": []}  # fmt: skip
    n_xh = math.prod(xh_shape)
    for (chunk, threads), kern in kernels.items():
        # the check launch: outputs inside guard regions (nothing may land there)
        guard = 1 << 14
        xh_g = torch.full((n_xh + 2 * guard,), 7.0, dtype=dtype, device="cuda")
        g_g = torch.full((m + 2 * guard,), -7.0, dtype=torch.float32, device="cuda")
        ptr0 = [xs[0].data_ptr(), xg.data_ptr(), norm.data_ptr(), layer.data_ptr(),
                xh_g[guard:].data_ptr(), g_g[guard:].data_ptr()]  # fmt: skip
        _launch_fn(torch, kern, ptr0)()
        torch.cuda.synchronize()
        outside = int(
            (xh_g[:guard] != 7.0).sum() + (xh_g[guard + n_xh :] != 7.0).sum()
            + (g_g[:guard] != -7.0).sum() + (g_g[guard + m :] != -7.0).sum()
        )  # fmt: skip
        got = (xh_g[guard : guard + n_xh].view(xh_shape), g_g[guard : guard + m])
        same = bool(
            torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
            and torch.equal(got[1], want[1])
        )
        s = bk.time_torch_graph(torch, [_launch_fn(torch, kern, ptrs[i]) for i in range(copies)])
        row["variants"].append({"chunk": chunk, "threads": threads, "same_bytes": same,
                                "stores_outside": outside, "us": s * 1e6,
                                "x_floor": s / floor})  # fmt: skip
        print(
            f"{form:10s} {prologue:8s} K={k:5d} M={m:5d} chunk={chunk:5d} threads={threads:4d} "
            f"{s * 1e6:8.2f} us  {s / floor:5.2f}x floor  same={same} outside={outside}",
            flush=True,
        )
    xs.clear()
    outs.clear()
    return row


def _launch_fn(torch, kern, ptrs):
    """A no-argument launch of `kern` on torch's current stream with `ptrs`."""

    def fn():
        kern.launch(torch.cuda.current_stream().cuda_stream, ptrs)

    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="512,1024,2048")
    ap.add_argument("--tile-m", type=int, default=128)
    ap.add_argument(
        "--forms",
        default="xhat_tiles",
        help="output forms to time: xhat_tiles and / or xhat_bf16 (their candidates), xhat "
        "(the row-major x_hat, default launch shape only, for its store pattern)",
    )
    ap.add_argument("--inputs", default="rmsnorm,none,swiglu", help="prologues to run")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    from cuda_ops import nvfp4_gemv, nvfp4_quant
    from experiments import bench_kernel as bk

    t0 = time.time()
    bw = bk.copy_bandwidth(torch)
    result = {
        "versions": bk._versions(torch),
        "device": torch.cuda.get_device_name(),
        "method": __doc__,
        "copy_bw_Bps": bw,
        "rows": [],
    }
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    layers = 2
    forms = args.forms.split(",")
    for prologue, k in INPUTS:
        if prologue not in args.inputs.split(","):
            continue
        fused = nvfp4_gemv.Fused(prologue=prologue, norm_stacked=True, scale_stacked=True)
        width = 2 * k if prologue == "swiglu" else k
        norm = torch.ones((layers, k), dtype=torch.bfloat16, device="cuda")
        norm += 0.1 * torch.randn_like(norm)
        xg = torch.tensor([0.05, 0.02], dtype=torch.float32, device="cuda")
        layer = torch.tensor(1, dtype=torch.int32, device="cuda")
        for m in (int(v) for v in args.ms.split(",")):
            for form in forms:
                result["rows"].append(
                    _time_form(
                        torch,
                        bk,
                        nvfp4_quant,
                        form,
                        fused,
                        prologue,
                        k,
                        width,
                        m,
                        xg,
                        norm,
                        layer,
                        bw,
                        args.tile_m,
                    )
                )
                torch.cuda.empty_cache()
                with open(args.out, "w") as f:
                    json.dump({**result, "partial": True}, f, indent=1)
    result["elapsed_s"] = time.time() - t0
    bad = [(r["form"], r["prologue"], r["m"], v["chunk"], v["threads"]) for r in result["rows"]
           for v in r["variants"] if (v["same_bytes"] is False and r["prologue"] != "rmsnorm")
           or v["stores_outside"]]  # fmt: skip
    result["mismatches"] = bad
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("mismatches:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
