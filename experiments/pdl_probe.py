"""Programmatic dependent launch (PDL) for a decode step's W4A4 GEMVs: how much of the
per-launch cost it would hide on the H200 ([T2-B] point 5; experiments only).

XLA's PTX custom kernel call takes no PDL option (experiments/DECODE_NOTES.md, twenty-sixth
session), so this measures the kernels outside XLA: one CUDA graph, captured from a stream with
`cuLaunchKernelEx`, of L layers x the four Qwen3-8B GEMVs at M rows (qkv, o, gate_up, down; each
layer its own weights, so they stream from HBM), replayed and timed with CUDA events. Modes:

  plain        the production kernels, launched without the PDL attribute;
  pdl-start    launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, the kernel
               lets its successor launch at once (`griddepcontrol.launch_dependents`) and waits
               (`griddepcontrol.wait`) before anything else: what a kernel that reads its layer
               index from device memory (as ours do in the layer scan) could do;
  pdl-weights  the same, but the wait comes after the first weight loads are issued (weights do
               not depend on the previous kernel): the upper bound, which needs the layer index
               before the wait.

The PDL builds are the production source with those instructions added (`pdl_source`), compiled
through `GemvOptions(source=...)`. Every mode's last outputs must equal plain's bit for bit (the
same arithmetic). Modes alternate for --rounds rounds in one process; the JSON has each round's
median replay time and the per-layer medians.

    PYTHONPATH=. python3 experiments/pdl_probe.py --out experiments/results/pdl_probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from cuda_ops import nvfp4_gemv

MODES = ("plain", "pdl-start", "pdl-weights")
QWEN3_8B = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))  # qkv, o, gate_up, down
_TRIGGER = 'asm volatile("griddepcontrol.launch_dependents;" ::: "memory");'
_WAIT = 'asm volatile("griddepcontrol.wait;" ::: "memory");'
_ENTRY = "  const Layer lw = layer_of(wp_all, ws_all, wg_all, layer);\n"
# where the persistent kernel stages x (after its first weight loads) and where the streaming
# kernel has issued its weight loads (before its x loads)
_PERSISTENT_STAGE = "  stage();\n"
_STREAM_LOADS = "  load_share(q, sw, wp, ws, sh, lane);\n"


def pdl_source(source: str, mode: str) -> str:
    """The GEMV source with PDL instructions for `mode` ("pdl-start" or "pdl-weights"): every
    entry triggers its dependents first; it waits at once ("pdl-start") or after its first weight
    loads are issued ("pdl-weights"). Raises ValueError if an anchor is missing (the source
    changed under the probe)."""
    if mode not in MODES[1:]:
        raise ValueError(f"mode={mode!r}, expected one of {MODES[1:]}")
    for anchor in (_ENTRY, _PERSISTENT_STAGE, _STREAM_LOADS):
        if anchor not in source:
            raise ValueError(f"anchor {anchor.strip()!r} not in the GEMV source")
    head = f"  {_TRIGGER}\n" + (f"  {_WAIT}\n" if mode == "pdl-start" else "")
    out = source.replace(_ENTRY, head + _ENTRY)
    if mode == "pdl-weights":
        out = out.replace(_PERSISTENT_STAGE, f"  {_WAIT}\n" + _PERSISTENT_STAGE)
        out = out.replace(_STREAM_LOADS, _STREAM_LOADS + f"  {_WAIT}\n")
    return out


# ----------------------------------------------------------------------------- driver helpers


def _check(result):
    from cuda.bindings import driver

    status, *values = result
    if status != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {status!r}")
    return values[0] if len(values) == 1 else tuple(values)


class _Device:
    """The first GPU's primary context, a stream and device buffers (freed on close)."""

    def __init__(self):
        from cuda.bindings import driver

        self.drv = driver
        _check(driver.cuInit(0))
        self.dev = _check(driver.cuDeviceGet(0))
        self.ctx = _check(driver.cuDevicePrimaryCtxRetain(self.dev))
        _check(driver.cuCtxSetCurrent(self.ctx))
        self.stream = _check(driver.cuStreamCreate(0))
        self.buffers = []
        attr = driver.CUdevice_attribute
        self.sms = _check(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.dev)
        )
        major = _check(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev)
        )
        minor = _check(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev)
        )
        self.arch = f"compute_{major}{minor}"
        self.name = _check(driver.cuDeviceGetName(128, self.dev)).split(b"\0")[0].decode()

    def alloc(self, nbytes: int, fill32: int | None = None, fill8: int = 0) -> int:
        ptr = int(_check(self.drv.cuMemAlloc(max(nbytes, 4))))
        self.buffers.append(ptr)
        if fill32 is not None:
            _check(self.drv.cuMemsetD32(ptr, fill32, max(nbytes, 4) // 4))
        else:
            _check(self.drv.cuMemsetD8(ptr, fill8, max(nbytes, 4)))
        return ptr

    def upload(self, array: np.ndarray) -> int:
        ptr = self.alloc(array.nbytes)
        _check(self.drv.cuMemcpyHtoD(ptr, array.ctypes.data, array.nbytes))
        return ptr

    def download(self, ptr: int, nbytes: int) -> bytes:
        host = np.empty(nbytes, np.uint8)
        _check(self.drv.cuMemcpyDtoH(host.ctypes.data, ptr, nbytes))
        return host.tobytes()

    def close(self):
        for ptr in self.buffers:
            self.drv.cuMemFree(ptr)
        self.drv.cuStreamDestroy(self.stream)
        self.drv.cuDevicePrimaryCtxRelease(self.dev)


def _launch(d: _Device, kernel, pointers: list[int], pdl: bool) -> None:
    drv = d.drv
    p = kernel.plan
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = p.grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = p.threads, 1, 1
    cfg.sharedMemBytes = p.smem
    cfg.hStream = d.stream
    if pdl:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
    else:
        cfg.numAttrs = 0
    params = (tuple(pointers), tuple(ctypes.c_void_p for _ in pointers))
    _check(drv.cuLaunchKernelEx(cfg, nvfp4_gemv._function(kernel), params, 0))


def _graph(d: _Device, launches) -> object:
    """A CUDA graph captured from d.stream running `launches()`; returns the executable."""
    drv = d.drv
    # relaxed: nothing else runs on the device while the graph is captured
    _check(
        drv.cuStreamBeginCapture(d.stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    )
    launches()
    graph = _check(drv.cuStreamEndCapture(d.stream))
    return _check(drv.cuGraphInstantiate(graph, 0))


def _time(d: _Device, exec_, replays: int) -> float:
    """Median ms of one graph replay (CUDA events), after 3 warm-up replays."""
    drv = d.drv
    start, end = _check(drv.cuEventCreate(0)), _check(drv.cuEventCreate(0))
    for _ in range(3):
        _check(drv.cuGraphLaunch(exec_, d.stream))
    _check(drv.cuStreamSynchronize(d.stream))
    times = []
    for _ in range(replays):
        _check(drv.cuEventRecord(start, d.stream))
        _check(drv.cuGraphLaunch(exec_, d.stream))
        _check(drv.cuEventRecord(end, d.stream))
        _check(drv.cuEventSynchronize(end))
        times.append(float(_check(drv.cuEventElapsedTime(start, end))))
    return statistics.median(times)


def _git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36, help="layers (each its own weights)")
    ap.add_argument("--m", type=int, default=1, help="rows (decode batch), 1..8")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the modes")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not 1 <= args.m <= nvfp4_gemv.MAX_M or args.layers < 1 or args.replays < 1:
        ap.error(f"--m {args.m} (1..{nvfp4_gemv.MAX_M}), --layers {args.layers}, --replays "
                 f"{args.replays}: expected positive values")  # fmt: skip
    d = _Device()
    tmp = pathlib.Path(tempfile.mkdtemp())
    source = nvfp4_gemv.read_source(nvfp4_gemv.SOURCE)
    options = {"plain": nvfp4_gemv.DEFAULT_OPTIONS}
    for mode in MODES[1:]:
        path = tmp / f"nvfp4_gemv_{mode}.cu"
        path.write_text(pdl_source(source, mode))
        options[mode] = nvfp4_gemv.GemvOptions(source=str(path))
    m, L = args.m, args.layers
    layers = d.upload(np.arange(L, dtype=np.int32))
    ops = []  # per shape: (n, k, static pointers, y pointer)
    for n, k in QWEN3_8B:
        wp = d.alloc(L * n * k // 2, fill8=0x1B)
        ws = d.alloc(L * n * k // 16, fill8=0x30)  # E4M3 0.5
        wg = d.alloc(4 * L, fill32=0x3A800000)  # 2**-10
        xp = d.alloc(m * k // 2, fill8=0x2A)
        xs = d.alloc(m * k // 16, fill8=0x38)  # E4M3 1.0
        xg = d.alloc(4 * m, fill32=0x3C000000)  # 2**-7
        y = d.alloc(2 * m * n)
        ops.append((n, k, (xp, xs, xg, wp, ws, wg), y))
    kernels = {
        mode: [
            nvfp4_gemv.build("w4a4", m, n, k, arch=d.arch, num_sms=d.sms, options=o)
            for n, k in QWEN3_8B
        ]
        for mode, o in options.items()
    }
    for kern in (k for ks in kernels.values() for k in ks):
        nvfp4_gemv._function(kern)  # modules loaded before any capture
    execs, outs = {}, {}
    for mode in MODES:

        def run(mode=mode):
            for layer in range(L):
                for kern, (_, _, ptrs, y) in zip(kernels[mode], ops, strict=True):
                    _launch(d, kern, [*ptrs, layers + 4 * layer, y], pdl=mode != "plain")

        execs[mode] = _graph(d, run)
        _check(d.drv.cuGraphLaunch(execs[mode], d.stream))
        _check(d.drv.cuStreamSynchronize(d.stream))
        outs[mode] = [d.download(y, 2 * m * n) for n, _, _, y in ops]
    same = {mode: outs[mode] == outs["plain"] for mode in MODES}
    rounds = []
    for _ in range(args.rounds):
        rounds.append({mode: _time(d, execs[mode], args.replays) for mode in MODES})
        print("  ".join(f"{mode} {rounds[-1][mode]:.3f} ms" for mode in MODES), flush=True)
    per_layer = {mode: 1000 * statistics.median(r[mode] for r in rounds) / L for mode in MODES}
    result = {
        "what": "one CUDA graph of L layers x 4 Qwen3-8B W4A4 GEMVs, median replay (CUDA events)",
        "git_sha": args.git_sha or _git_sha(),
        "device": d.name,
        "arch": d.arch,
        "m": m,
        "layers": L,
        "shapes": QWEN3_8B,
        "replays": args.replays,
        "rounds_ms": rounds,
        "per_layer_us": per_layer,
        "saved_per_layer_us": {mode: per_layer["plain"] - per_layer[mode] for mode in MODES[1:]},
        "outputs_equal_plain": same,
        "cuda_bindings": _cuda_bindings_version(),
    }
    for mode in MODES:
        print(f"{mode}: {per_layer[mode]:.2f} us a layer; outputs equal plain's: {same[mode]}")
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    d.close()
    if not all(same.values()):
        raise SystemExit("a PDL mode's outputs differ from plain's")
    return result


def _cuda_bindings_version() -> str:
    try:
        from importlib.metadata import version

        return version("cuda-bindings")
    except Exception:  # noqa: BLE001 - a version string only
        return "unknown"


if __name__ == "__main__":
    main(sys.argv[1:])
