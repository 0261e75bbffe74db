"""Ops with a CUDA kernel and a pure-JAX reference, behind one dispatch (`_dispatch.py`)."""
