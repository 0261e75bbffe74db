"""Activation quantization on the GPU vs the CPU: are the NVFP4 codes and scales bit-identical?

`rejax.nvfp4.quantize_activation` is tested bit-exact against torchao on the CPU (CI). This
script runs it on the GPU three ways (the jitted function called eagerly, inside an outer jit,
and inside an outer jit whose bf16 input is computed in the same jit) and compares every byte
with the CPU result; for mismatches it prints the intermediate values (block scale, output
scale, scaled value) on both devices so the differing step is visible.

    PYTHONPATH=. python3 experiments/gpu_quant_check.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from rejax import nvfp4


def _intermediates(x, input_scale):
    """The quantizer's steps, as `_quantize_activation_arrays` computes them."""
    m, k = x.shape
    xf = x.astype(jnp.float32).reshape(m, k // 16, 16)
    block_amax = jnp.max(jnp.abs(xf), axis=-1)
    g = nvfp4.dynamic_global_scale(x)[:, None] if input_scale is None else input_scale
    sf = nvfp4._div_rn(nvfp4._div_rn(block_amax, 6.0), g)
    sf32 = nvfp4.e4m3_to_f32(jnp.clip(sf, 0.0, 448.0).astype(jnp.float8_e4m3fn))
    nonzero = sf32 > 0
    out_scale = nvfp4._div_rn(nvfp4._div_rn(1.0, g), jnp.where(nonzero, sf32, 1.0))
    out_scale = jnp.where(nonzero, out_scale, 0.0)
    scaled = jnp.clip(xf * out_scale[..., None], -6.0, 6.0)
    return {"sf": sf, "sf32": sf32, "out_scale": out_scale, "scaled": scaled.reshape(m, k)}


def _bytes(t):
    return {
        "packed": np.asarray(t.packed).view(np.uint8),
        "scales": np.asarray(t.scales).view(np.uint8),
        "global_scale": np.atleast_1d(np.asarray(t.global_scale, np.float32)).view(np.uint8),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    cases = []
    for m, k, static in [(8, 4096, None), (1, 4096, None), (64, 5120, None), (8, 4096, 0.003)]:
        x_np = (rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, (m, 1))).astype(np.float32)
        x_bf = jnp.asarray(x_np, jnp.bfloat16)
        ref = _bytes(nvfp4.quantize_activation(jax.device_put(x_bf, cpu), static))

        def quant(a, static=static):
            return nvfp4.quantize_activation(a, static)

        def quant_from_f32(a, static=static):
            return nvfp4.quantize_activation(a.astype(jnp.bfloat16), static)

        def steps(a, static=static):
            return _intermediates(a, static)

        variants = {
            "gpu_eager": (quant, x_bf),
            "gpu_in_jit": (jax.jit(quant), x_bf),
            "gpu_in_jit_from_f32": (jax.jit(quant_from_f32), jnp.asarray(x_np)),
        }
        for name, (fn, arg) in variants.items():
            got = _bytes(fn(arg))
            diff = {f: int((got[f] != ref[f]).sum()) for f in ref}
            case = {"m": m, "k": k, "static": static, "variant": name, "differing_bytes": diff}
            if diff["packed"]:
                idx = np.argwhere(got["packed"] != ref["packed"])[:6]
                gi = jax.jit(steps)(x_bf)
                ci = jax.jit(steps)(jax.device_put(x_bf, cpu))
                examples = []
                for r, byte in idx:
                    for e in (2 * byte, 2 * byte + 1):
                        b = e // 16
                        examples.append(
                            {
                                "row": int(r),
                                "elem": int(e),
                                "x": float(x_np[r, e]),
                                "x_bf16": float(np.asarray(x_bf[r, e], np.float32)),
                                **{
                                    f"{d}_{key}": float(np.asarray(v[key][r, b], np.float32))
                                    for d, v in (("gpu", gi), ("cpu", ci))
                                    for key in ("sf", "sf32", "out_scale")
                                },
                                "gpu_scaled": float(gi["scaled"][r, e]),
                                "cpu_scaled": float(ci["scaled"][r, e]),
                                "gpu_byte": int(got["packed"][r, byte]),
                                "cpu_byte": int(ref["packed"][r, byte]),
                            }
                        )
                case["examples"] = examples
            print(json.dumps({k2: v for k2, v in case.items() if k2 != "examples"}), flush=True)
            for ex in case.get("examples", [])[:4]:
                print("   ", json.dumps(ex), flush=True)
            cases.append(case)
    ok = all(not any(c["differing_bytes"].values()) for c in cases)
    with open(args.out, "w") as f:
        json.dump(
            {
                "all_equal": ok,
                "cases": cases,
                "jax": jax.__version__,
                "device": str(jax.devices()[0].device_kind),
            },
            f,
            indent=1,
        )
    print("ALL EQUAL" if ok else "MISMATCHES", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
