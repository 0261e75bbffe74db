"""Machine instructions (SASS) of a kernel build, offline: NVRTC makes the sm_90 cubin and
nvdisasm (the `nvidia-cuda-nvdisasm` wheel of the test extras, or one on PATH) lists it. No GPU.

    python experiments/sass.py --gemm 64:24576:4096 [--source FILE] [--function NAME]

prints the instruction mix of the GEMM's main loop for that plan (M:N:K). From Python:
`instructions(cubin, function)` lists a function's instructions, `loops` finds its loops (a
backward branch and its target) and `loop_mix` counts the opcodes of the innermost loop that
holds a given opcode (for the GEMM, the K loop: one pipeline stage per trip), with the
instructions of the loops nested in it (the stage copies) counted once.

Static counts, not executed ones: a straight-line body runs once per trip, so for a fully
unrolled stage they are per-stage counts; they say nothing of stalls or of how the warps
interleave. What they do measure is how many issue slots a stage needs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from cuda_ops import build as cbuild

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"(\.L_x_\d+)")


class SassError(RuntimeError):
    pass


def nvdisasm_path() -> str | None:
    """nvdisasm on PATH, else the one the `nvidia-cuda-nvdisasm` wheel installs; None if neither."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for cand in sorted(pathlib.Path(root).glob("*/bin/nvdisasm")):
            if cand.is_file():
                return str(cand)
    return None


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction: index in its function, opcode with modifiers (no predicate), full text."""

    index: int
    op: str
    text: str

    @property
    def base(self) -> str:
        """The opcode without modifiers: IMAD.SHL.U32 -> IMAD."""
        return self.op.split(".")[0]


def disassemble(cubin: bytes) -> str:
    """nvdisasm's listing of `cubin` (raises SassError without nvdisasm)."""
    tool = nvdisasm_path()
    if tool is None:
        raise SassError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the test extras)")
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([tool, "-c", str(path)], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        raise SassError(f"nvdisasm failed: {out.stderr.strip()[:500]}")
    return out.stdout


def instructions(listing: str, function: str) -> tuple[list[Instr], dict[str, int]]:
    """The instructions of `function` in an nvdisasm listing, and its labels -> the index of
    the instruction each precedes."""
    marker = f".text.{function}:"
    if marker not in listing:
        names = re.findall(r"^\.text\.(\w+):", listing, re.MULTILINE)
        raise SassError(f"function {function!r} not in the cubin; it has {names}")
    body = listing.split(marker, 1)[1].split("//------", 1)[0]
    out: list[Instr] = []
    labels: dict[str, int] = {}
    for line in body.splitlines():
        lab = _LABEL.match(line)
        if lab:
            labels[lab.group(1)] = len(out)
            continue
        m = _LINE.match(line)
        if m:
            text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())
            out.append(Instr(len(out), text.split()[0], m.group(2).strip()))
    return out, labels


def loops(instrs: list[Instr], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) instruction index of every loop: a branch to a label at or before it."""
    found = []
    for ins in instrs:
        if ins.base != "BRA":
            continue
        t = _TARGET.search(ins.text)
        if t and labels.get(t.group(1), len(instrs)) <= ins.index:
            found.append((labels[t.group(1)], ins.index))
    return sorted(set(found))


def loop_mix(instrs: list[Instr], labels: dict[str, int], holds: str = "HMMA") -> dict:
    """Opcode counts of the innermost loop that contains an instruction whose opcode starts
    with `holds`: `base` / `ops` over its whole body (the loops nested in it counted once), and
    `straight` over its body without them (what runs exactly once a trip: for the GEMM's K loop,
    one stage's decode and MMAs, without the stage copies' loops). Raises SassError if no loop
    holds such an instruction."""
    all_loops = loops(instrs, labels)
    spans = [(a, b) for a, b in all_loops if any(i.op.startswith(holds) for i in instrs[a : b + 1])]
    if not spans:
        raise SassError(f"no loop holds a {holds} instruction")
    a, b = min(spans, key=lambda s: s[1] - s[0])
    body = instrs[a : b + 1]
    nested = [(c, d) for c, d in all_loops if a <= c and d <= b and (c, d) != (a, b)]
    inner = {j for c, d in nested for j in range(c, d + 1)}
    straight = [i for i in body if i.index not in inner]
    return {
        "span": [a, b],
        "nested": [list(s) for s in nested],
        "total": len(body),
        "ops": dict(collections.Counter(i.op for i in body).most_common()),
        "base": dict(collections.Counter(i.base for i in body).most_common()),
        "straight_total": len(straight),
        "straight": dict(collections.Counter(i.base for i in straight).most_common()),
    }


def function_mix(instrs: list[Instr]) -> dict:
    return {
        "total": len(instrs),
        "base": dict(collections.Counter(i.base for i in instrs).most_common()),
    }


def gemm_stage_mix(m: int, n: int, k: int, options=None, num_sms: int = 132) -> dict:
    """The instruction mix of the GEMM's K loop (`loop_mix`) for its plan of M x N x K under
    `options` (a cuda_ops.nvfp4_gemm.GemmOptions; its `source` and `defines` are honoured, as
    the build does; None: the defaults)."""
    from cuda_ops import nvfp4_gemm

    options = options or nvfp4_gemm.DEFAULT_OPTIONS
    plan = nvfp4_gemm.plan(m, n, k, num_sms, options)
    if options.source:
        text = pathlib.Path(options.source).read_text()
    else:
        text = cbuild.read_source(nvfp4_gemm.SOURCE)
    defines = plan.defines() | dict(options.defines)
    cubin = cbuild.compile_cubin(text, defines, name=nvfp4_gemm.SOURCE)
    instrs, labels = instructions(disassemble(cubin), nvfp4_gemm.ENTRY)
    mix = loop_mix(instrs, labels, "HMMA")
    fields = ("tm", "wr", "warps", "kt", "stages", "splitk")
    mix["plan"] = {f: getattr(plan, f) for f in fields}
    return mix


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm", required=True, help="M:N:K of the GEMM plan to compile")
    ap.add_argument("--source", default=None, help="another revision of nvfp4_gemm.cu")
    args = ap.parse_args(argv)
    from cuda_ops import nvfp4_gemm

    try:
        m, n, k = (int(v) for v in args.gemm.split(":"))
    except ValueError:
        raise SystemExit(f"--gemm {args.gemm!r}: expected M:N:K, e.g. 64:24576:4096") from None
    if args.source and not pathlib.Path(args.source).is_file():
        raise SystemExit(f"--source {args.source!r}: no such file")
    opts = nvfp4_gemm.GemmOptions(source=args.source)
    print(json.dumps(gemm_stage_mix(m, n, k, opts), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
