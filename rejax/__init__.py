"""rejax: fast, accurate low-bit (NVFP4) reasoning in JAX, with the ReSET sampler.

Public names are imported lazily where they can be: `import rejax` never pulls in torch,
cuda-python or transformers. The function `rejax.generate` is bound at import (the name is also
its module's), so importing rejax loads JAX, Flax and the decoder.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Config": "rejax.config",
    "Nvfp4Tensor": "rejax.nvfp4",
    "quantize_weight": "rejax.nvfp4",
    "quantize_activation": "rejax.nvfp4",
    "dequantize": "rejax.nvfp4",
    "nvfp4_matmul": "rejax.nvfp4",
    "nvfp4_linear": "rejax.ops.linear",
    "Greedy": "rejax.sampling",
    "Temperature": "rejax.sampling",
    "ReSET": "rejax.sampling",
    "sample": "rejax.sampling",
    "load": "rejax.checkpoint",
    "save": "rejax.checkpoint",
    "calibrate_input_scales": "rejax.generate",
    "logits": "rejax.generate",
    "generate": "rejax.generate",
    "Generation": "rejax.generate",
    "Params": "rejax.params",
    "set_compilation_cache": "rejax.compile_cache",
    "shard": "rejax.sharding",
}

__all__ = [
    "Config",
    "Generation",
    "Greedy",
    "Nvfp4Tensor",
    "Params",
    "ReSET",
    "Temperature",
    "calibrate_input_scales",
    "dequantize",
    "generate",
    "load",
    "logits",
    "nvfp4_linear",
    "nvfp4_matmul",
    "quantize_activation",
    "quantize_weight",
    "sample",
    "save",
    "set_compilation_cache",
    "shard",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rejax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


# `rejax.generate` is both a submodule and the public function. Importing the submodule sets
# the package attribute to the module, so bind the function now: a later `import rejax.generate`
# finds the module in sys.modules and leaves this attribute alone.
from rejax.generate import generate


def __dir__():
    return __all__
