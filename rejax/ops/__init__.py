"""Ops with a CUDA / Pallas kernel and a pure-JAX reference, behind one dispatch (`_dispatch.py`).

Importing this package imports no kernel, Pallas, CUDA or torch code.
"""
