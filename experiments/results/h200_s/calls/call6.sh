#!/usr/bin/env bash
# session 21 call 6 (the machine still warm from call 5, whose 55 s cut left one case): the
# batch-16 decode tests under the decode_unroll 8 default, with the compile caches warm
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
PYTHONPATH=. timeout 80 python3 -m pytest tests/test_kernels_gpu.py -k "batch16 and nvfp4" -p no:cacheprovider -rA 2>&1 | tee $OUT/t_b16_nvfp4.log
