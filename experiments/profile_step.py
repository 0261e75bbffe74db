"""Device-kernel timeline of the jitted decode loop: what each kernel of a decode step costs.

For each variant (quant, batch and Config fields), a random-weight model (`bench_decode.py`'s
`random_params`) runs `rejax.decode.decode_loop` once to compile, then once more under
`jax.profiler.trace` (CUPTI: every kernel, including those replayed from XLA command buffers).
The Perfetto trace is read back and summarised per decode step:

  * busy_us: the sum of kernel durations per step; span_us: first kernel start to last kernel
    end over the profiled loop, per step (span - busy = the GPU idle between kernels);
  * per kernel name: launches per step, mean and total microseconds per step, and a class
    (nvfp4 GEMV / GEMM, attention, cuBLAS, XLA fusion, copy, other);
  * per class: launches and microseconds per step and per decoder layer.

    PYTHONPATH=. python3 experiments/profile_step.py --out OUT.json \
        --variant nvfp4:1 --variant nvfp4:8 --variant nvfp4:8:gemm_min_m=8 --variant bf16:8
    PYTHONPATH=. python3 experiments/profile_step.py --tiny --out OUT.json   # CPU smoke

`--trace-dir DIR` keeps each variant's trace; `experiments/trace_timeline.py` reads one back
with the host's side (graph launches and updates, the loop's predicate copies) beside the GPU's.

`--phase prefill` profiles one prefill of `--prompt-len` tokens instead (figures per prefill:
"step" below reads "prefill").

A variant is QUANT:BATCH[:FIELD=VALUE...] with Config fields (linear_fusion, attention,
gemm_min_m, kv_dtype, layer_loop). On CPU the trace holds no device kernels; the smoke run only
checks that the pipeline works.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd
import trace_timeline

from rejax import bench as rbench
from rejax import config as rconfig
from rejax import sampling

_INT_FIELDS = {"gemm_min_m", "scan_unroll", "decode_unroll"}
_OPT_INT_FIELDS = {"gemm_max_m", "gemm_wgmma_min_m", "gemm_wgmma_max_m"}  # an int or "none"
_BOOLS = {"on": True, "off": False, "true": True, "false": False}


def _int(spec: str, key: str, val: str) -> int:
    try:
        return int(val)
    except ValueError:
        raise SystemExit(f"--variant {spec!r}: {key} takes an int, got {val!r}") from None


def parse_variant(spec: str) -> tuple[str, int, dict]:
    """'nvfp4:8:gemm_min_m=8' -> ('nvfp4', 8, {'gemm_min_m': 8}). Besides Config fields,
    `sampler=NAME` picks the decode loop's sampler from bench_decode's SAMPLERS (default
    greedy)."""
    parts = spec.split(":")
    if len(parts) < 2:
        raise SystemExit(f"--variant {spec!r}: expected QUANT:BATCH[:FIELD=VALUE...]")
    quant, batch = parts[0], int(parts[1])
    if quant not in ("bf16", "nvfp4"):
        raise SystemExit(f"--variant {spec!r}: quant must be bf16 or nvfp4")
    fields = {}
    defaults = {f.name: f.default for f in dataclasses.fields(rconfig.Config)}
    names = set(defaults)
    for kv in parts[2:]:
        key, _, val = kv.partition("=")
        if key == "sampler":
            if val not in bd.SAMPLERS:
                raise SystemExit(
                    f"--variant {spec!r}: sampler {val!r} is not one of {sorted(bd.SAMPLERS)}"
                )
            fields[key] = val
            continue
        if key not in names:
            raise SystemExit(f"--variant {spec!r}: {key!r} is not a Config field")
        if isinstance(defaults[key], bool):
            if val not in _BOOLS:
                raise SystemExit(f"--variant {spec!r}: {key} takes one of {sorted(_BOOLS)}")
            fields[key] = _BOOLS[val]
        elif key in _OPT_INT_FIELDS:
            if val == "default" and defaults[key] == "default":  # the wgmma range's default
                fields[key] = val
            else:
                fields[key] = None if val.lower() == "none" else _int(spec, key, val)
        elif key in _INT_FIELDS or type(defaults[key]) is int:
            fields[key] = _int(spec, key, val)
        else:
            fields[key] = val
    return quant, batch, fields


def classify(name: str) -> str:
    n = name.lower()
    if "nvfp4_gemv" in n or "nvfp4_quantize" in n:
        return "nvfp4_gemv"
    if "nvfp4_gemm" in n:
        return "nvfp4_gemm"
    if "nvfp4_dequant" in n:
        return "nvfp4_dequant"
    if "sampler" in n or "rejax_sample" in n:
        return "sampler"
    if "rope_cache" in n:
        return "rope"
    if "attention" in n or "flash" in n or "triton" in n or "pallas" in n or "decode_attn" in n:
        return "attention"
    if "gemm" in n or "cublas" in n or "cutlass" in n or "sm90_xmma" in n or "nvjet" in n:
        return "cublas"
    if "fusion" in n or "reduce" in n:
        return "xla_fusion"
    if "copy" in n or "memcpy" in n or "memset" in n or "dynamic_update_slice" in n:
        return "copy"
    return "other"


def trace_path(trace_dir: str, spec: str) -> str:
    """Where `--trace-dir` keeps a variant's trace: its spec as a file name; a variant run
    again in the same process gets `.2`, `.3`, ... rather than overwriting the first."""
    name = spec.replace(":", "_").replace("=", "-")
    path, n = os.path.join(trace_dir, f"{name}.trace.json.gz"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(trace_dir, f"{name}.{n}.trace.json.gz")
    return path


def load_trace(log_dir: str) -> dict:
    paths = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
    paths += glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise RuntimeError(f"no trace file under {log_dir}")
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        return json.load(f)


def kernel_events(trace: dict) -> list[dict]:
    """Complete events on GPU stream threads (the CUPTI kernel records)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = trace_timeline.names(events)
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        p = pname.get(e["pid"], "")
        t = tname.get((e["pid"], e.get("tid")), "")
        if "GPU" in p and "Stream" in t:
            out.append(e)
    return out


def summarise(events: list[dict], steps: int, layers: int) -> dict:
    if not events:
        return {"kernels": 0}
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    by = collections.defaultdict(list)
    for e in events:
        by[e["name"]].append(float(e["dur"]))
    rows = []
    for name, durs in by.items():
        rows.append({
            "name": name[:160],
            "class": classify(name),
            "per_step": len(durs) / steps,
            "mean_us": statistics.fmean(durs),
            "median_us": statistics.median(durs),
            "us_per_step": sum(durs) / steps,
        })  # fmt: skip
    rows.sort(key=lambda r: -r["us_per_step"])
    classes = collections.defaultdict(lambda: {"per_step": 0.0, "us_per_step": 0.0})
    for r in rows:
        c = classes[r["class"]]
        c["per_step"] += r["per_step"]
        c["us_per_step"] += r["us_per_step"]
    for c in classes.values():
        c["per_layer"] = c["per_step"] / layers
        c["us_per_layer"] = c["us_per_step"] / layers
    busy = sum(r["us_per_step"] for r in rows)
    return {
        "gaps": gaps(events, steps),
        "kernels": len(events),
        "launches_per_step": len(events) / steps,
        "busy_us_per_step": busy,
        "span_us_per_step": (end - start) / steps,
        "idle_fraction": 1 - busy * steps / max(end - start, 1e-9),
        "classes": dict(classes),
        "top": rows[:60],
    }


def gaps(events: list[dict], steps: int, top: int = 12) -> list[dict]:
    """GPU idle time between consecutive kernels (on any stream, in start order), summed per
    (kernel before, kernel after) pair: per step, the pairs with the most idle, each with its
    count per step and its largest single gap. Where the idle of a step goes."""
    ev = sorted(events, key=lambda e: e["ts"])
    pairs = collections.defaultdict(lambda: [0, 0.0, 0.0])  # count, total us, max us
    end = ev[0]["ts"] + ev[0]["dur"] if ev else 0.0
    prev = ev[0]["name"] if ev else ""
    for e in ev[1:]:
        idle = e["ts"] - end
        if idle > 0:
            p = pairs[(prev[:80], e["name"][:80])]
            p[0] += 1
            p[1] += idle
            p[2] = max(p[2], idle)
        if e["ts"] + e["dur"] >= end:
            end, prev = e["ts"] + e["dur"], e["name"]
    rows = [
        {"before": a, "after": b, "per_step": c / steps, "idle_us_per_step": t / steps,
         "max_us": m}
        for (a, b), (c, t, m) in pairs.items()
    ]  # fmt: skip
    rows.sort(key=lambda r: -r["idle_us_per_step"])
    return rows[:top]


def run_variant(spec, cfg0, args):
    quant, batch, fields = parse_variant(spec)
    fields = dict(fields)
    sampler_name = fields.pop("sampler", "greedy")
    cfg = dataclasses.replace(cfg0, quant=None if quant == "bf16" else "nvfp4", **fields)
    params = bd.random_params(cfg, seed=0)
    t0 = time.perf_counter()
    # the product's timing harness compiles and times the loop; its cache is reused below
    run, cache = bd._run_generation(
        params, batch, args.prompt_len, args.steps, 1, sampler=sampler_name
    )
    compile_s = time.perf_counter() - t0
    logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
    sampler = bd.SAMPLERS[sampler_name]()
    if isinstance(sampler, sampling.ReSET) and sampler.nl_mask is None:
        # random weights have no tokenizer: empty newline sets, as rejax.bench times it
        none = jnp.zeros((cfg.vocab_size,), bool)
        sampler = dataclasses.replace(sampler, nl_mask=none, dnl_mask=none)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        jax.random.key(0), jnp.arange(batch, dtype=jnp.uint32)
    )
    never = jnp.zeros((cfg.vocab_size,), bool)
    done = jnp.zeros((batch,), bool)
    lengths = jnp.full((batch,), args.prompt_len, jnp.int32)

    def loop(c):
        return bd.rgen.decode_loop(
            params, logits, c, lengths, sampler, sampling.sampler_init(sampler, batch), keys,
            never, done, max_new_tokens=args.steps,
        )  # fmt: skip

    if args.phase == "prefill":
        # one prefill of the whole prompt (compiled by the harness above and the cache's fill)
        tokens = jnp.zeros((batch, args.prompt_len), jnp.int32)
        positions = jnp.broadcast_to(
            jnp.arange(args.prompt_len, dtype=jnp.int32), (batch, args.prompt_len)
        )

        def traced(c):
            return bd.rgen.prefill(params, tokens, positions, c)[0]
    else:

        def traced(c):
            return loop(c).tokens

    c = jax.tree_util.tree_map(jnp.copy, cache)
    jax.block_until_ready(traced(c))  # warm (same shapes as the timed run)
    c = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, cache))
    log_dir = tempfile.mkdtemp(prefix="rejax_prof_")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(traced(c))
    trace = load_trace(log_dir)
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        with gzip.open(trace_path(args.trace_dir, spec), "wt") as f:
            json.dump(trace, f)
    per = 1 if args.phase == "prefill" else args.steps  # the summary's unit: a prefill / a step
    summary = summarise(kernel_events(trace), per, cfg.num_layers)
    res = {
        "phase": args.phase,
        "variant": spec,
        "quant": quant,
        "batch": batch,
        "fields": fields,
        "sampler": sampler_name,
        "layers": cfg.num_layers,
        "steps": args.steps,
        "ms_per_token_bench": run["ms_per_token"],
        "prefill_ms_bench": run.get("prefill_ms"),
        "harness_s": compile_s,
        **summary,
    }
    unit = "prefill" if args.phase == "prefill" else "step"
    print(
        f"[{spec}] {run['ms_per_token']:.3f} ms/token, prefill {run['prefill_ms']:.2f} ms; "
        f"kernels/{unit} "
        f"{summary.get('launches_per_step', 0):.0f}, busy {summary.get('busy_us_per_step', 0):.0f}"
        f" us, span {summary.get('span_us_per_step', 0):.0f} us",
        flush=True,
    )
    for name, c in sorted(summary.get("classes", {}).items(), key=lambda kv: -kv[1]["us_per_step"]):
        print(f"   {name:12s} {c['per_layer']:6.2f}/layer {c['us_per_layer']:8.2f} us/layer")
    for g in summary.get("gaps", [])[:6]:
        print(
            f"   idle {g['idle_us_per_step']:7.1f} us/step ({g['per_step']:.2f}x, max "
            f"{g['max_us']:.1f}) {g['before'][:40]} -> {g['after'][:40]}"
        )
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke)")
    ap.add_argument("--variant", action="append", default=None, help="QUANT:BATCH[:F=V...]")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    ap.add_argument(
        "--phase",
        choices=["decode", "prefill"],
        default="decode",
        help="what is profiled: the decode loop (figures per step) or one prefill of "
        "--prompt-len tokens (figures per prefill)",
    )
    ap.add_argument("--trace-dir", default=None, help="also keep each variant's trace here")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = bd.TINY if args.tiny else rconfig.PRESETS[args.preset]
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    if args.tiny:
        args.prompt_len = min(args.prompt_len, 16)
    variants = args.variant or ["nvfp4:1", "bf16:1"]
    for v in variants:
        parse_variant(v)  # fail before any work
    results = []
    for v in variants:
        try:
            results.append(run_variant(v, cfg, args))
        except Exception as e:  # noqa: BLE001 (keep the other variants)
            print(f"[{v}] failed: {type(e).__name__}: {e}", flush=True)
            results.append({"variant": v, "error": f"{type(e).__name__}: {e}"})
        with open(args.out, "w") as f:
            json.dump({"versions": rbench.versions(), "device": str(jax.devices()[0]),
                       "config": dataclasses.asdict(cfg), "results": results}, f, indent=1,
                      default=str)  # fmt: skip
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    sys.exit(main())
