"""Speed and row invariance of XLA's bf16 matmuls under different autotuning settings.

The thirteenth session saw the 1-layer decode loop 3.2x (bf16) and 8x (NVFP4) slower with
`Config.xla_autotune=False` (the per-program option `xla_gpu_autotune_level=0`), while the same
flag given process-wide in XLA_FLAGS had cost nothing in bench_slots. This probe times the
decode's float matmul shapes (the lm_head, [M, 4096] x [151936, 4096]^T, and an MLP-sized one)
per setting, each setting in its own process (XLA keeps autotuning results per process), and
checks whether each row's result is bitwise the same at M = 64, 32, 16 and 8 rows (the
compaction sizes). It prints what the compiled HLO calls (cuBLAS or a Triton GEMM fusion).

    python experiments/xla_autotune_probe.py --out probe.json            # all settings
    python experiments/xla_autotune_probe.py --setting opt_level0        # one, in-process
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

# name: (XLA_FLAGS, per-program compiler options, compile with autotuning first in-process)
SETTINGS = {
    "none": ("", {}, False),
    "env_level0": ("--xla_gpu_autotune_level=0", {}, False),
    "opt_level0": ("", {"xla_gpu_autotune_level": 0}, False),
    "opt_level0_after_tuned": ("", {"xla_gpu_autotune_level": 0}, True),
    "opt_level0_no_triton": (
        "",
        {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False},
        False,
    ),
    "env_level0_no_triton": (
        "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false",
        {},
        False,
    ),
    "opt_no_triton": ("", {"xla_gpu_enable_triton_gemm": False}, False),
    "opt_level1": ("", {"xla_gpu_autotune_level": 1}, False),
}
SHAPES = {"lm_head": 151936, "mlp": 12288}
ROWS = (64, 32, 16, 8)


def _run_setting(name: str, d: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    _, opts, tuned_first = SETTINGS[name]
    out = {"setting": name, "shapes": {}}
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (max(ROWS), d), jnp.bfloat16)

    def mm(a, w):
        return jnp.einsum("md,vd->mv", a, w).astype(jnp.float32)

    for shape, v in SHAPES.items():
        w = (jax.random.normal(jax.random.fold_in(key, v), (v, d), jnp.float32) * 0.02).astype(
            jnp.bfloat16
        )
        if tuned_first:  # an autotuned compile of the same fusions first, same process
            jax.jit(mm).lower(x, w).compile()(x, w).block_until_ready()
        res, info = {}, {}
        for m in ROWS:
            lowered = jax.jit(mm).lower(x[:m], w)
            t0 = time.perf_counter()
            compiled = lowered.compile(opts) if opts else lowered.compile()
            compile_s = time.perf_counter() - t0
            text = compiled.as_text()
            calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
            kinds = sorted(set(re.findall(r'"kind":"(__triton[^"]*|__cu[^"]*)"', text)))
            configs = sorted(set(re.findall(r'"triton_gemm_config":\{[^}]*\}', text)))
            xm = x[:m]
            y = compiled(xm, w).block_until_ready()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                compiled(xm, w).block_until_ready()
                times.append(time.perf_counter() - t0)
            res[m] = np.asarray(y)
            info[m] = {
                "us": round(float(np.median(times)) * 1e6, 1),
                "compile_s": round(compile_s, 2),
                "custom_calls": calls,
                "fusion_kinds": kinds,
                "triton_configs": configs[:2],
            }
        for m in ROWS[1:]:
            same = np.all(res[m] == res[ROWS[0]][:m], axis=1)
            info[m]["rows_equal_to_64"] = f"{int(same.sum())}/{m}"
        out["shapes"][shape] = info
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), help="run one setting in-process")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=sorted(SETTINGS))
    ap.add_argument("--d", type=int, default=4096, help="hidden size")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", help="JSON file for all settings")
    args = ap.parse_args(argv)
    if args.setting:
        print(json.dumps(_run_setting(args.setting, args.d, args.repeats)))
        return
    results = []
    for name in args.settings:
        env = dict(os.environ)
        flags = SETTINGS[name][0]
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        t0 = time.time()
        p = subprocess.run(
            [
                sys.executable,
                __file__,
                "--setting",
                name,
                "--d",
                str(args.d),
                "--repeats",
                str(args.repeats),
            ],
            check=False,
            env=env,
            capture_output=True,
            text=True,
        )
        if p.returncode:
            print(f"[{name}] exit {p.returncode}: {p.stderr[-1500:]}")
            results.append({"setting": name, "error": p.stderr[-1500:]})
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        results.append(r)
        for shape, info in r["shapes"].items():
            row = ", ".join(
                f"M{m} {i['us']}us"
                + (f" eq {i['rows_equal_to_64']}" if "rows_equal_to_64" in i else "")
                for m, i in info.items()
            )
            print(
                f"[{name}] {shape}: {row} | calls {info['64']['custom_calls']} "
                f"kinds {info['64']['fusion_kinds']} ({time.time() - t0:.0f}s)"
            )
    if args.out:
        import jax

        with open(args.out, "w") as f:
            json.dump(
                {"jax": jax.__version__, "device": str(jax.devices()[0]), "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
