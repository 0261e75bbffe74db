"""Test configuration: CPU by default; tests marked `gpu` skip unless JAX sees a CUDA GPU."""

import jax
import pytest


def _has_cuda() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); none visible to JAX")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
