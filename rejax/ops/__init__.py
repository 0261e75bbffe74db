"""Kernel-backed ops, each with its pure-JAX reference beside the binding.

Import the op modules directly (e.g. `from rejax.ops.decode_attention import decode_attention`);
this package imports nothing at load time so that `import rejax` stays light.
"""
