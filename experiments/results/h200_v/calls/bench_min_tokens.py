"""bench_sampler with cuda_ops.sampler.GRID_MIN_TOKENS set: python3 this.py T <bench args>"""

import runpy
import sys

import cuda_ops.sampler as kernels

kernels.GRID_MIN_TOKENS = int(sys.argv[1])
print(
    "GRID_MIN_TOKENS", kernels.GRID_MIN_TOKENS, [kernels.grid_plan(b, 151936) for b in (1, 8, 64)]
)
sys.argv = ["experiments/bench_sampler.py", *sys.argv[2:]]
runpy.run_path("experiments/bench_sampler.py", run_name="__main__")
