"""Where the grid sampler kernel's time goes, phase by phase ([T2-E] at 1 row).

The kernel alone sits 18-26 us over greedy at 1 row whatever its variant (session 54), while
its sweeps read 300 KB. This builds `rejax_sample_grid` from `cuda_ops/sampler.cu` with
`sampler_phase_ts.patch` applied in a temporary copy and DIAG_TS=1 (thread 0 of every CTA
stamps clock64 and %globaltimer at the entry, at each grid barrier's arrival and release, after
the row's combine, before the draw's loop and before the exit ticket), launches it with CuPy on
bfloat16 "lm" logits (2 x Gumbel, as experiments/bench_sampler.py's), and reports:

- `event_us`: the stamped kernel's time a launch, back-to-back launches between two CUDA
  events (`event_us_plain`: the tree's build, alternated with it, so the stamps' own cost
  shows);
- `span_us`: first entry to last exit stamp (%globaltimer, across CTAs): what is left of
  `event_us` is the launch and the CTAs' start;
- per phase (consecutive stamps of one CTA, clock64 at the device clock, median / max over
  CTAs and launches): the sweeps before each barrier, each barrier's wait, the combine;
- per barrier (%globaltimer across CTAs): the spread of arrivals (the slowest CTA's lag) and
  the time from the last arrival to the first release (the barrier's own latency).

Usage (on a GPU, from the repository root; about a minute):
  PYTHONPATH=. python experiments/kernels/sampler_phases.py --batch 1 64 --out OUT/phases.json

Variants "cdf" (the default for top-p alone) and "grid"; kinds "temperature" (t = 0.6, top-p
0.95), "topk20" (the same with top-k 20: the grid kernel's top-k path, "auto"'s choice for
it, whichever variant is named) and "reset" (ReSET's choice between t = 1.0 and 0.3 by the
row's entropy, top-p 0.95; the state update stays out, as in "auto"'s build without the
state).

`--geometries` times other launch shapes of the same kernel: `plan` (the tree's `grid_plan`),
`CxT` (C CTAs a row of T threads, barriers in global memory) or `CxTc` (the row's C <= 8 CTAs
one thread-block cluster, barriers the cluster's: GRID_CLUSTER). "cdf" draws do not depend on
the launch shape, so every geometry's tokens are compared with the first one's
(`tokens_equal_first`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCH = ROOT / "experiments" / "kernels" / "sampler_phase_ts.patch"
SLOTS = 16  # the patch's DIAG_SLOTS
NAMES = {0: "entry", 12: "combined", 13: "located", 14: "exit"}
KINDS = ("temperature", "reset", "topk20")
VARIANTS = ("cdf", "grid")


def slot_name(k: int) -> str:
    """The patch's slot k: entry, arrive/release of barrier `round`, combined, located, exit."""
    if k in NAMES:
        return NAMES[k]
    if 1 <= k <= 11:
        return f"{'arrive' if k % 2 else 'release'}{(k + 1) // 2}"
    raise ValueError(f"slot {k}: expected 0..14")


def patched_source() -> str:
    """cuda_ops/sampler.cu with the patch applied, in a temporary copy (the tree is untouched)."""
    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "cuda_ops").mkdir()
        shutil.copy(ROOT / "cuda_ops" / "sampler.cu", pathlib.Path(d) / "cuda_ops" / "sampler.cu")
        r = subprocess.run(["git", "apply", str(PATCH)], cwd=d, capture_output=True, text=True,
                           check=False)  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"{PATCH.name} does not apply to cuda_ops/sampler.cu: {r.stderr}")
        return (pathlib.Path(d) / "cuda_ops" / "sampler.cu").read_text()


def parse_geometry(text: str) -> tuple[int, int, bool] | None:
    """`plan` -> None; `CxT` -> (C, T, False); `CxTc` -> (C, T, True) (a cluster of C CTAs)."""
    if text == "plan":
        return None
    cluster = text.endswith("c")
    parts = text.removesuffix("c").split("x")
    try:
        ctas, threads = (int(v) for v in parts)
    except ValueError:
        ctas = threads = 0
    if not (ctas >= 1 and threads in (128, 256, 512, 1024) and ctas <= threads
            and (not cluster or ctas <= 8)):  # fmt: skip
        raise ValueError(f"geometry {text!r}: expected 'plan', 'CxT' or 'CxTc' with T in 128, "
                         f"256, 512, 1024, 1 <= C <= T, and C <= 8 for a cluster ('c')")  # fmt: skip
    return ctas, threads, cluster


def build_ptx(batch: int, vocab: int, variant: str, sms: int, arch: str, diag: bool = True,
              geometry: tuple[int, int, bool] | None = None, top_k: int = 0):  # fmt: skip
    """(plan, PTX) of the bfloat16-logit grid kernel for [batch, vocab] (and `top_k`), patched;
    `geometry` (C, T, cluster) overrides the plan's CTAs a row and threads (None: the plan's)."""
    from cuda_ops import sampler as ks
    from cuda_ops.build import compile_ptx

    p = ks.plan(batch, vocab, top_k, variant, sms=sms, bf16=True)
    defines = p.defines() | ({"DIAG_TS": 1} if diag else {})
    if geometry is not None:
        ctas, threads, cluster = geometry
        per_cta = -(-vocab // ctas)
        chunk = -(-per_cta // 4) * 4  # a multiple of 4 (float4 loads)
        ctas = -(-vocab // chunk)  # no empty trailing chunk
        p = dataclasses.replace(p, chunks=ctas, chunk=chunk, threads=threads)
        defines |= {"CHUNKS": ctas, "GRID": ctas, "CH": chunk, "NTHREADS": threads,
                    "MIN_CTAS": defines["MIN_CTAS"] if threads == p.threads
                    else max(1, 65536 // (threads * 64))}  # fmt: skip
        if cluster:
            defines |= {"GRID_CLUSTER": ctas}
    return p, compile_ptx(patched_source(), name=ks.SOURCE, defines=defines, arch=arch)


def analyse(stamps: np.ndarray, clock_khz: float) -> dict:
    """Phases from stamps [launches, B, GRID, SLOTS, 2] (clock64, %globaltimer ns; 0: not
    stamped): per CTA the stamps in time order, each gap between consecutive ones labelled
    `a->b` (median / max over CTAs and launches, in us at `clock_khz`); per barrier round the
    arrival spread and last-arrival-to-first-release latency (%globaltimer, across the row's
    CTAs; median over launches and rows); the span from the first entry to the last exit."""
    stamps = np.asarray(stamps, dtype=np.uint64)
    if stamps.ndim != 5 or stamps.shape[3] != SLOTS or stamps.shape[4] != 2:
        raise ValueError(f"stamps of shape {stamps.shape}: expected [L, B, GRID, {SLOTS}, 2]")
    to_us = 1e3 / clock_khz
    gaps: dict[str, list[float]] = {}
    n_l, n_b, n_c = stamps.shape[:3]
    for li in range(n_l):
        for b in range(n_b):
            for c in range(n_c):
                cyc = stamps[li, b, c, :, 0]
                present = [k for k in range(SLOTS) if cyc[k]]
                present.sort(key=lambda k: int(cyc[k]))
                for a, z in itertools.pairwise(present):
                    key = f"{slot_name(a)}->{slot_name(z)}"
                    gaps.setdefault(key, []).append((int(cyc[z]) - int(cyc[a])) * to_us)
    phases = {k: {"median_us": float(np.median(v)), "max_us": float(np.max(v)), "n": len(v)}
              for k, v in gaps.items()}  # fmt: skip
    gt = stamps[..., 1].astype(np.int64)  # [L, B, GRID, SLOTS]
    barriers, spans = {}, []
    for rnd in range(1, 6):
        arr, rel = gt[..., 2 * rnd - 1], gt[..., 2 * rnd]
        if not (arr > 0).all():
            continue
        spread = (arr.max(axis=2) - arr.min(axis=2)) / 1e3
        latency = (rel.min(axis=2) - arr.max(axis=2)) / 1e3
        barriers[f"barrier{rnd}"] = {
            "arrival_spread_us": float(np.median(spread)),
            "last_arrival_to_first_release_us": float(np.median(latency)),
        }
    if (gt[..., 0] > 0).all() and (gt[..., 14] > 0).all():
        spans = (gt[..., 14].max(axis=2) - gt[..., 0].min(axis=2)) / 1e3
    steps = np.diff(np.unique(gt[gt > 0]))
    return {
        "phases": phases,
        "barriers": barriers,
        "span_us": float(np.median(spans)) if len(spans) else None,
        "globaltimer_step_ns": int(steps[steps > 0].min()) if (steps > 0).any() else None,
    }


def stamped_clock_khz(stamps: np.ndarray) -> float:
    """The SM clock the stamps ran at (kHz): each CTA's clock64 cycles over its %globaltimer
    nanoseconds from entry to exit, the median over CTAs and launches."""
    s = np.asarray(stamps, dtype=np.uint64).astype(np.float64)
    cyc = s[..., 14, 0] - s[..., 0, 0]
    ns = s[..., 14, 1] - s[..., 0, 1]
    ok = (s[..., 0, 0] > 0) & (s[..., 14, 0] > 0) & (ns > 0)
    if not ok.any():
        raise ValueError("no CTA stamped both its entry and its exit")
    return float(np.median(cyc[ok] / ns[ok]) * 1e6)


def _lm_logits_bf16_bits(b: int, v: int, seed: int) -> np.ndarray:
    import ml_dtypes

    z = 2.0 * np.random.default_rng(seed).gumbel(size=(b, v)).astype(np.float32)
    return z.astype(ml_dtypes.bfloat16).view(np.uint16)


def run(
    batch: int,
    vocab: int,
    variant: str,
    kind: str,
    launches: int,
    stamped: int,
    geometry: str = "plan",
) -> dict:
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    sms = int(props["multiProcessorCount"])
    major, minor = props["major"], props["minor"]
    try:  # cudaDevAttrClockRate (kHz); CUDA 13's device properties lack clockRate
        clock_khz = float(cp.cuda.runtime.deviceGetAttribute(13, 0))
    except Exception:  # noqa: BLE001 - then clock64 is converted at the stamps' own rate
        clock_khz = 0.0
    arch = f"compute_{major}{minor}"
    from cuda_ops import sampler as ks

    geo = parse_geometry(geometry)
    top_k = 20 if kind == "topk20" else 0
    per_sm = ks.GRID_TOPK_CTAS_PER_SM if top_k else max(1, 65536 // ((geo or (0, 256))[1] * 64))
    if geo is not None and not geo[2] and batch * geo[0] > sms * per_sm:
        # the barriers in global memory wait for CTAs that would never start
        raise ValueError(f"geometry {geometry!r} at {batch} rows: {batch * geo[0]} CTAs are "
                         f"not all resident on {sms} SMs")  # fmt: skip
    modules = []
    for diag in (True, False):  # the stamped build, and the tree's for its time alone
        p, ptx = build_ptx(batch, vocab, variant, sms, arch, diag=diag,
                           geometry=geo, top_k=top_k)  # fmt: skip
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        modules.append(cp.RawModule(path=f.name))
    mod = modules[0]
    kern = mod.get_function("rejax_sample_grid")
    logits = cp.asarray(_lm_logits_bf16_bits(batch, vocab, 0))
    if kind in ("temperature", "topk20"):
        thr = cp.full((batch,), -np.inf, cp.float32)
        alt = cp.full((batch,), np.inf, cp.float32)
        t_a = t_b = cp.full((batch,), 0.6, cp.float32)
    else:  # ReSET: t_a when the entropy is at or above thr
        thr = cp.full((batch,), 0.6349, cp.float32)
        alt = cp.full((batch,), np.inf, cp.float32)
        t_a, t_b = cp.full((batch,), 1.0, cp.float32), cp.full((batch,), 0.3, cp.float32)
    top_p = cp.full((batch,), 0.95, cp.float32)
    keys = cp.asarray(np.random.default_rng(1).integers(0, 2**32, (batch, 2), dtype=np.uint32))
    tokens = cp.zeros((batch,), cp.int32)
    entropy = cp.zeros((batch,), cp.float32)
    temperature = cp.zeros((batch,), cp.float32)
    args = (logits, thr, alt, t_a, t_b, top_p, keys, tokens, entropy, temperature)
    grid, block = (p.chunks, batch), (p.threads,)
    ptr = mod.get_global("g_diag_ts")
    ts = cp.ndarray((batch, p.chunks, SLOTS, 2), dtype=cp.uint64, memptr=ptr)

    def timed(k) -> float:
        for _ in range(3):  # warm-up
            k(grid, block, args)
        cp.cuda.Device().synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(launches):
            k(grid, block, args)
        e1.record()
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / launches

    plain = modules[1].get_function("rejax_sample_grid")
    event_us = [timed(kern), timed(plain), timed(kern), timed(plain)]  # alternated
    stamps = []
    for _ in range(stamped):
        ts.fill(0)
        kern(grid, block, args)
        cp.cuda.Device().synchronize()
        stamps.append(cp.asnumpy(ts))
    stamps = np.stack(stamps)
    measured = stamped_clock_khz(stamps)
    out = analyse(stamps, clock_khz or measured)
    return {"batch": batch, "vocab": vocab, "variant": variant, "kind": kind,
            "geometry": geometry, "ctas_per_row": p.chunks, "threads": p.threads, "sms": sms, "clock_khz": clock_khz,
            "stamped_clock_khz": measured,
            "event_us": float(np.median(event_us[0::2])),
            "event_us_plain": float(np.median(event_us[1::2])), "tokens": cp.asnumpy(tokens).tolist(), **out}  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--variants", nargs="+", default=["cdf", "grid"], choices=VARIANTS)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--launches", type=int, default=200, help="timed launches (events)")
    ap.add_argument("--stamped", type=int, default=20, help="launches whose stamps are read")
    ap.add_argument(
        "--geometries",
        nargs="+",
        default=["plan"],
        help="launch shapes: plan, CxT or CxTc (see the module docstring)",
    )
    ap.add_argument("--out", required=True, help="JSON path")
    a = ap.parse_args(argv)
    for g in a.geometries:
        try:
            parse_geometry(g)
        except ValueError as e:
            raise SystemExit(str(e)) from e
    if min(a.batch) < 1 or a.vocab < 1024 or a.launches < 1 or a.stamped < 1:
        raise SystemExit(f"--batch {a.batch} --vocab {a.vocab} --launches {a.launches} "
                         f"--stamped {a.stamped}: expected rows >= 1, V >= 1024, counts >= 1")  # fmt: skip
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"sampler_phases.py needs CuPy and a CUDA GPU ({e})") from e
    results = []
    for variant, kind, b in itertools.product(a.variants, a.kinds, a.batch):
        first = None  # the first geometry's tokens
        for g in a.geometries:
            name = f"{variant} {kind} B={b} {g}"
            try:
                r = run(b, a.vocab, variant, kind, a.launches, a.stamped, g)
            except Exception as e:  # noqa: BLE001 - the other configurations still run
                print(f"{name}: {type(e).__name__}: {e}", flush=True)
                results.append({"batch": b, "variant": variant, "kind": kind, "geometry": g,
                                "error": f"{type(e).__name__}: {e}"})  # fmt: skip
                continue
            first = r["tokens"] if first is None else first
            r["tokens_equal_first"] = r["tokens"] == first
            results.append(r)
            ph = sorted(r["phases"].items(), key=lambda kv: -kv[1]["median_us"])[:6]
            print(f"{name}: tokens equal {r['tokens_equal_first']}, event "
                  f"{r['event_us']:.1f} us, span {r['span_us']} us; "
                  + ", ".join(f"{k} {v['median_us']:.2f}" for k, v in ph), flush=True)  # fmt: skip
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                   "results": results}, f, indent=1)  # fmt: skip
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
