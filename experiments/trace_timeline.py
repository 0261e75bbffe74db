"""Host and GPU timeline of a decode loop's profile: where the GPU waits for the host.

Reads a Perfetto / Chrome trace that `profile_step.py --trace-dir DIR` saved (jax.profiler with
CUPTI: kernels on GPU stream threads; XLA's thunks, command-buffer launches and updates and
the loop's predicate copies on the host's Python thread) and prints:

  * steady state: over a window of whole decode steps (the lm_head's matmul marks a step),
    GPU span, idle and the kernel pairs with the most idle, per step;
  * one step's timeline: the host's thunk events (command_buffer_*, cuGraphLaunch,
    command_buffer::update, MemcpyD2H, while.*) beside each GPU kernel that starts after an
    idle gap, so a gap can be matched with the host work it waited for;
  * the command-buffer updates (re-recorded CUDA graphs) with their host time.

    python3 experiments/trace_timeline.py TRACE.json.gz [--step 5] [--skip-ms 5] [--gap-us 3]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json


def names(events: list[dict]) -> tuple[dict, dict]:
    """The trace's process names {pid: name} and thread names {(pid, tid): name}."""
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = str(e.get("args", {}).get("name", ""))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    return pname, tname


def load(path: str) -> tuple[list[dict], list[dict]]:
    """(host events of the Python thread, GPU events), each sorted by start time."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = names(events)
    host, gpu = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if "GPU" in pname.get(e["pid"], ""):
            gpu.append(e)
        elif tname.get((e["pid"], e.get("tid"))) == "python3" and not e["name"].startswith("$"):
            host.append(e)  # "$..." are Python function events
    return sorted(host, key=lambda e: e["ts"]), sorted(gpu, key=lambda e: e["ts"])


def step_marks(gpu: list[dict], marker: str = "gemm_fusion_dot") -> list[float]:
    """Start times of the kernels that occur once per decode step (the lm_head matmul)."""
    return [e["ts"] for e in gpu if e["name"].startswith(marker)]


def steady_state(gpu: list[dict], lo: float, hi: float, top: int = 6) -> dict:
    """GPU span, idle and the idlest kernel pairs per step over the steps that start in
    [lo, hi) (absolute trace times)."""
    marks = [t for t in step_marks(gpu) if lo <= t < hi]
    if len(marks) < 2:
        return {"steps": 0}
    a, b = marks[0], marks[-1]  # whole steps: from one lm_head to the last one
    window = [e for e in gpu if a <= e["ts"] <= b]  # the closing lm_head: its idle before it
    steps = len(marks) - 1
    end, prev, idle = window[0]["ts"], "", 0.0
    pairs: collections.Counter = collections.Counter()
    for e in window:
        gap = e["ts"] - end
        if gap > 0:
            idle += gap
            pairs[(prev[:40], e["name"][:40])] += gap
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e["name"]
    return {
        "steps": steps,
        "span_us_per_step": (b - a) / steps,
        "idle_us_per_step": idle / steps,
        "idle_pairs": [(x, y, t / steps) for (x, y), t in pairs.most_common(top)],
    }


def step_idle(gpu: list[dict], marks: list[float]) -> list[float]:
    """GPU idle (us) inside each step [marks[i], marks[i + 1]): the periodic host round trips
    of a decode loop (one check of the predicate every `decode_unroll` steps) show as the
    steps whose idle stands out."""
    out = []
    for a, b in itertools.pairwise(marks):
        window = [e for e in gpu if a <= e["ts"] < b]
        end, idle = a, 0.0
        for e in window:
            idle += max(0.0, e["ts"] - end)
            end = max(end, e["ts"] + e["dur"])
        out.append(idle + max(0.0, b - end))
    return out


def split_idle(idle: list[float]) -> dict:
    """Ordinary steps' idle (the median) against the outliers above twice it plus 20 us (a
    decode loop's predicate checks): their count, mean extra idle each, and that extra
    averaged over every step."""
    if not idle:
        return {"ordinary_us": 0.0, "outliers": 0, "extra_us": 0.0, "extra_us_per_step": 0.0}
    med = sorted(idle)[len(idle) // 2]
    extra = [x - med for x in idle if x > 2 * med + 20]
    return {
        "ordinary_us": med,
        "outliers": len(extra),
        "extra_us": sum(extra) / len(extra) if extra else 0.0,
        "extra_us_per_step": sum(extra) / len(idle),
    }


def step_timeline(host, gpu, lo: float, hi: float, gap_us: float) -> list[tuple]:
    """(time, 'H' or 'G', duration, text) rows in [lo, hi): every host thunk event and each
    GPU kernel that starts after more than gap_us of GPU idle."""
    rows = [(e["ts"], "H", e["dur"], e["name"][:60]) for e in host if lo <= e["ts"] < hi]
    end = None
    for e in gpu:
        if e["ts"] >= hi:
            break
        if e["ts"] >= lo and (end is None or e["ts"] - end > gap_us):
            idle = 0.0 if end is None else e["ts"] - end
            rows.append((e["ts"], "G", e["dur"], f"{e['name'][:40]} after {idle:.1f} us idle"))
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    return sorted(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument(
        "--step", type=int, default=5,
        help="which step's timeline to print; -1: the steady step with the most GPU idle",
    )  # fmt: skip
    ap.add_argument("--skip-ms", type=float, default=5.0, help="start-up to leave out (ms)")
    ap.add_argument("--gap-us", type=float, default=3.0, help="GPU idle shown in the timeline")
    args = ap.parse_args(argv)
    host, gpu = load(args.trace)
    if not gpu:
        raise SystemExit(f"{args.trace}: no GPU events (a CPU trace?)")
    t0 = gpu[0]["ts"]
    steady = steady_state(gpu, t0 + 1e3 * args.skip_ms, float("inf"))
    print(f"{args.trace}: {steady['steps']} steady steps after {args.skip_ms} ms")
    if steady["steps"]:
        print(
            f"  span {steady['span_us_per_step']:.1f} us/step, GPU idle "
            f"{steady['idle_us_per_step']:.1f} us/step"
        )
        for x, y, t in steady["idle_pairs"]:
            print(f"    {t:7.1f} us/step  {x} -> {y}")
    marks = step_marks(gpu)
    idle = step_idle(gpu, marks)
    lo = t0 + 1e3 * args.skip_ms
    steady_idx = [i for i in range(len(idle)) if marks[i] >= lo]
    if steady_idx:
        print(f"GPU idle per step (us), steady steps {steady_idx[0]}..{steady_idx[-1]}:")
        print("  " + " ".join(f"{idle[i]:.0f}" for i in steady_idx))
        split = split_idle([idle[i] for i in steady_idx])
        print(
            f"  ordinary steps {split['ordinary_us']:.1f} us (median); {split['outliers']} "
            f"outlier steps (> 2x + 20 us) at +{split['extra_us']:.1f} us each, "
            f"{split['extra_us_per_step']:.1f} us a step averaged"
        )
    if args.step < 0 and steady_idx:
        args.step = max(steady_idx, key=lambda i: idle[i])
    if 0 <= args.step and len(marks) > args.step + 1:
        a, b = marks[args.step], marks[args.step + 1]
        print(f"step {args.step} (lm_head to lm_head, {b - a:.1f} us), times from its start:")
        for ts, kind, dur, text in step_timeline(host, gpu, a, b, args.gap_us):
            print(f"  {ts - a:9.1f} {kind} {dur:8.1f}  {text}")
    updates = [e for e in host if e["name"] == "command_buffer::update"]
    when = ", ".join(f"{e['ts'] - t0:.0f}" for e in updates[:12])
    total = sum(e["dur"] for e in updates)
    print(f"command-buffer updates: {len(updates)}, {total:.0f} us host (at {when} us)")
    return {"steady": steady, "updates": len(updates), "step_idle_us": idle, "step": args.step}


if __name__ == "__main__":
    main()
