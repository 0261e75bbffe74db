"""CUDA kernels of rejax, compiled at run time with NVRTC (see BUILD.md).

`build.py` compiles and caches; `nvfp4_gemv.py` plans, builds and launches the small-M NVFP4
GEMV in `nvfp4_gemv.cu`. Importing this package loads neither cuda-python nor NVRTC.
"""
