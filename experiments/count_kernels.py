"""Device kernels one decoder layer launches per decode step, counted from the compiled program.

Source: the optimized HLO of `rejax.decode.decode_step` (the compiled thunks, not a profile).
The layers run under one `lax.scan` (here one layer body per iteration, `Config.scan_unroll`
= 1) whose while loop XLA annotates with its trip count (`known_trip_count` = L); every
instruction of that loop's body computation that runs on the device is one launch on a GPU: a
fusion, a custom call (our GEMV, cuBLAS, a Pallas kernel), or an unfused op (copy, dynamic-update-slice, ...). Parameters, tuples, get-tuple-element,
constants and bitcasts launch nothing. With XLA command buffers the launches are replayed from a
CUDA graph, but each is still a kernel. On CPU the same count describes the CPU program (for
the tool's tests); the numbers that matter come from a CUDA build.

    PYTHONPATH=. python3 experiments/count_kernels.py --out OUT.json            # H200
    PYTHONPATH=. python3 experiments/count_kernels.py --tiny --out OUT.json     # CPU check
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp

from rejax import bench as rbench
from rejax import config as rconfig
from rejax import params as rparams
from rejax import sampling
from rejax.cache import init_cache
from rejax.decode import decode_step

# instructions that launch nothing (views, tuples, constants)
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(")
_WHILE = re.compile(r"= .* while\(.*body=%?([\w.\-]+)")


def computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from HLO text."""
    out, name = {}, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line.strip())
        if m:
            name = m.group(1)
            out[name] = []
        elif name is not None and line.strip() == "}":
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def layer_body(hlo: str, num_layers: int) -> str:
    """Name of the body computation of the while loop that runs `num_layers` times."""
    found = []
    for line in hlo.splitlines():
        m = _WHILE.search(line)
        if m and re.search(rf'"known_trip_count":\{{"n":"{num_layers}"\}}', line):
            found.append(m.group(1))
    if len(found) != 1:
        raise ValueError(
            f"expected one while loop with known_trip_count {num_layers}, found {found}: is the "
            "layer loop a scan (Config.layer_loop)?"
        )
    return found[0]


def _fused_ops(comps: dict[str, list[str]], line: str) -> dict[str, int]:
    """Opcodes inside the computation a fusion calls (what the launch does), free ones left out."""
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if not called or called.group(1) not in comps:
        return {}
    ops = collections.Counter()
    for inner in comps[called.group(1)]:
        m = _INSTRUCTION.match(inner)
        if m and m.group(2) not in _FREE:
            ops[m.group(2)] += 1
    return dict(sorted(ops.items()))


def count_launches(hlo: str, num_layers: int) -> dict:
    """{"total": n, "by_kind": {opcode or custom-call target: n}, "launches": [{"name", "kind",
    "ops"}]} for one layer's body, launches in program order."""
    comps = computations(hlo)
    body = comps[layer_body(hlo, num_layers)]
    kinds = collections.Counter()
    launches = []
    for line in body:
        m = _INSTRUCTION.match(line)
        if not m or m.group(2) in _FREE:
            continue
        op = m.group(2)
        ops = _fused_ops(comps, line) if op == "fusion" else {}
        if op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', line)
            name = re.search(r'"name":"(\w+)"|name = \\?"(\w+)', line)
            op = f"custom-call:{t.group(1) if t else '?'}"
            if name:
                op += f":{name.group(1) or name.group(2)}"
        kinds[op] += 1
        launches.append({"name": m.group(1), "kind": op, "ops": ops})
    return {
        "total": sum(kinds.values()),
        "by_kind": dict(sorted(kinds.items())),
        "launches": launches,
    }


def compiled_decode_step(
    cfg: rconfig.Config, batch: int, slots: int, static_scales: bool = False
) -> str:
    """Optimized HLO of one decode step for random weights of cfg's shapes (abstract: no weights
    are materialized); `static_scales`: every W4A4 linear with a static input scale [L], as
    `experiments/bench_decode.py` times it (the kernels that write a linear's NVFP4 input,
    Config.attention_output / gate_up_output "nvfp4", need one), else per-row dynamic scales."""

    def make():
        params = rparams.random_params(cfg, 0)
        if not static_scales or cfg.quant != "nvfp4":
            return params
        scale = jnp.full((cfg.num_layers,), 4.0 / (6 * 448), jnp.float32)
        weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
        return dataclasses.replace(params, weights=weights)

    params = jax.eval_shape(make)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, slots, jnp.bfloat16))
    smp = sampling.Greedy()
    args = (
        params,
        jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32),
        cache,
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        smp,
        sampling.sampler_init(smp, batch),
        jax.random.split(jax.random.key(0), batch),
        jnp.int32(0),
    )
    return decode_step.trace(*args).lower().compile().as_text()


# One layer body per scan iteration (Config.scan_unroll = 1), so the loop body is one layer's
# launches; the default runs scan_unroll bodies per iteration, the same launches per layer and
# the loop's own machinery once per iteration instead of once per layer.
TINY = rconfig.Config(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=64, quant="nvfp4", scan_unroll=1,
)  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers compiled (any >= 2)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--slots", type=int, default=1536, help="KV-cache slots")
    ap.add_argument(
        "--linear-fusion", nargs="+", default=list(rconfig.LINEAR_FUSIONS),
        choices=list(rconfig.LINEAR_FUSIONS),
    )  # fmt: skip
    ap.add_argument("--attention", nargs="+", default=["einsum"], choices=list(rconfig.ATTENTIONS))
    ap.add_argument(
        "--attention-output", nargs="+", default=[rconfig.Config.attention_output],
        choices=list(rconfig.ATTENTION_OUTPUTS), help="Config.attention_output, one row each",
    )  # fmt: skip
    ap.add_argument(
        "--gate-up-output", nargs="+", default=[rconfig.Config.gate_up_output],
        choices=list(rconfig.GATE_UP_OUTPUTS), help="Config.gate_up_output, one row each",
    )  # fmt: skip
    ap.add_argument(
        "--o-proj-output", nargs="+", default=[rconfig.Config.o_proj_output],
        choices=list(rconfig.O_PROJ_OUTPUTS), help="Config.o_proj_output, one row each",
    )  # fmt: skip
    ap.add_argument(
        "--gemm-chain", nargs="+", default=[rconfig.Config.gemm_chain],
        choices=list(rconfig.GEMM_CHAINS), help="Config.gemm_chain, one row each",
    )  # fmt: skip
    ap.add_argument(
        "--scales", default="static", choices=["static", "dynamic"],
        help="the W4A4 linears' activation global scales: static (as bench_decode.py) or per-row",
    )  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="a tiny NVFP4 config (CPU check)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    base = TINY if args.tiny else dataclasses.replace(
        rconfig.PRESETS[args.preset], num_layers=args.layers, quant="nvfp4", scan_unroll=1
    )  # fmt: skip
    rows = []
    static = args.scales == "static"
    variants = [
        (f, a, ao, go, oo, gc)
        for f in args.linear_fusion
        for a in args.attention
        for ao in args.attention_output
        for go in args.gate_up_output
        for oo in args.o_proj_output
        for gc in args.gemm_chain
    ]
    for fusion, attention, ao, go, oo, gc in variants:
        cfg = dataclasses.replace(base, linear_fusion=fusion, attention=attention,
                                  attention_output=ao, gate_up_output=go,
                                  o_proj_output=oo, gemm_chain=gc)  # fmt: skip
        for b in args.batch:
            slots = min(args.slots, cfg.max_position_embeddings)
            c = count_launches(compiled_decode_step(cfg, b, slots, static), cfg.num_layers)
            rows.append({"linear_fusion": fusion, "attention": attention,
                         "attention_output": ao, "gate_up_output": go, "o_proj_output": oo,
                         "gemm_chain": gc, "batch": b, **c})  # fmt: skip
            print(f"[{fusion} {attention} ao={ao} go={go} oo={oo} gc={gc} b{b}] {c['total']} "
                  f"launches per layer: {c['by_kind']}", flush=True)  # fmt: skip
    out = {
        "source": "optimized HLO of decode_step: instructions of the layer scan's body",
        "scales": args.scales,
        "backend": jax.default_backend(),
        "config": dataclasses.asdict(base),
        "versions": rbench.versions(),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2, default=str)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
