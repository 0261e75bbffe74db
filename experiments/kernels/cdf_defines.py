"""The "cdf" sampler built with other compile-time constants ([T2-E], 64 rows), in this process.

`CDF_DEFINES="NAME=VALUE,..."` adds `-D` constants to every "cdf" build of `cuda_ops.sampler`
(the other variants' builds are untouched), so the GPU tests and benchmarks run unchanged on
the variant:

    CDF_DEFINES=NC=2 python3 experiments/kernels/cdf_defines.py experiments/bench_sampler.py ...
    CDF_DEFINES=CDF_FAST_EXP=1 python3 -m pytest -p cdf_defines tests/test_sampling_gpu.py
        (with this folder on PYTHONPATH: a pytest plugin, the patch applies at import)

Constants measured with it:
  NC            the first draws tested in the keep sweep (sampler.cu: 4). The CPU mirror's
                `CDF_DRAWS` is set to match. Every draw stays exact (all NC rejected: the climb).
  CDF_FAST_EXP  1: the statistics sweep's and the draw walk's exp as the hardware's exp2 (a
                constant of sampler_cdf_fast_exp.patch: apply it first; the tree ignores it).
  AHEAD         trips of logits each grid sweep loads ahead (sampler.cu: 1).
"""

from __future__ import annotations

import os
import runpy
import sys

KNOWN = {"NC": range(1, 5), "CDF_FAST_EXP": range(2), "AHEAD": range(1, 5)}


def parse(spec: str) -> dict[str, int]:
    """ "NAME=VALUE,..." -> {NAME: VALUE}, each NAME in KNOWN and VALUE in its range."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in KNOWN or not value.lstrip("-").isdigit():
            raise ValueError(
                f"CDF_DEFINES item {item!r}, expected NAME=INT with NAME in {sorted(KNOWN)}"
            )
        if int(value) not in KNOWN[name]:
            raise ValueError(f"CDF_DEFINES {name}={value}, expected one of {list(KNOWN[name])}")
        out[name] = int(value)
    return out


def apply(extra: dict[str, int]) -> None:
    """Adds `extra` to the "cdf" builds' constants (this process), the CPU mirror's NC with it."""
    from cuda_ops import sampler as kernels
    from rejax.ops import sampler as op

    base = getattr(kernels.Plan.defines, "base", kernels.Plan.defines)

    def defines(self) -> dict:
        d = base(self)
        return d | extra if d.get("GRID_CDF") else d

    defines.base = base
    kernels.Plan.defines = defines
    kernels._build_cached.cache_clear()
    op.CDF_DRAWS = extra.get("NC", 4)


_extra = parse(os.environ.get("CDF_DEFINES", ""))
if _extra:
    apply(_extra)

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(
            "usage: CDF_DEFINES=NAME=VALUE,... python3 experiments/kernels/cdf_defines.py SCRIPT [ARGS...]"
        )
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
