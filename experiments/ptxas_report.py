"""Registers and spills of GEMV builds, offline: NVRTC compiles the planned kernel to an sm_90
cubin with `-Xptxas=-v` and this prints what ptxas reports (no GPU needed).

    python experiments/ptxas_report.py --m 1 --shapes 4096:12288,24576:4096 \
        --options "" "rows=2,ctas=2" "rows=1,ctas=2"

Each line: shape, M, the plan (rows, threads, CTAs per SM, grid, shared memory) and ptxas's
registers / spill bytes. A plan whose shared memory does not fit its CTAs per SM is reported as
refused. `--out` writes the rows with the versions and the NVRTC release.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemv


def ptxas_verbose(source: str, defines: dict, arch: str = "sm_90") -> str:
    """ptxas's -v report of `source` compiled by NVRTC to a cubin for `arch`."""
    return cbuild.ptxas_log(source, defines, arch)


def summary(log: str) -> dict:
    """{'registers': int, 'spill_stores': int, 'spill_loads': int} from a ptxas -v report."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_stores": int(spills.group(1)) if spills else None,
        "spill_loads": int(spills.group(2)) if spills else None,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--act", default="w4a4", choices=["w4a4", "w4a16"])
    ap.add_argument("--m", type=int, nargs="+", default=[1])
    ap.add_argument("--shapes", default="4096:12288", help="N:K,N:K,...")
    ap.add_argument(
        "--options", nargs="+", default=[""], help="GemvOptions fields per variant, e.g. ctas=2"
    )
    ap.add_argument("--num-sms", type=int, default=nvfp4_gemv.DEFAULT_SMS)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from bench_kernel import parse_gemv_options

    rows = []
    source = cbuild.read_source(nvfp4_gemv.SOURCE)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split(":"))
        for m in args.m:
            for spec in args.options:
                opts = nvfp4_gemv.GemvOptions(**parse_gemv_options(spec))
                row = {"n": n, "k": k, "m": m, "options": spec}
                try:
                    plan, kw = nvfp4_gemv._compile_job(
                        args.act, m, n, k, "compute_90", args.num_sms, opts, False, None
                    )
                except cbuild.KernelError as err:
                    row["refused"] = str(err)
                else:
                    row.update(rows_per_warp=plan.rows, threads=plan.threads, ctas=plan.ctas,
                               grid=plan.grid, smem=plan.smem, variant=plan.variant)  # fmt: skip
                    row.update(summary(ptxas_verbose(source, kw["defines"])))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        from rejax.bench import versions

        result = {
            "versions": versions(),
            "nvrtc": ".".join(str(v) for v in cbuild.nvrtc_version()),
            "arch": "sm_90 (cubin by NVRTC, ptxas -v)",
            "num_sms": args.num_sms,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
