"""JAX's persistent compilation cache, on by default for rejax's jitted functions.

A second process that runs the same model and shapes loads the compiled executables from disk
instead of compiling them again. rejax turns the cache on, under `~/.cache/rejax/jax` (or
`$XDG_CACHE_HOME/rejax/jax`), when its decode module is imported, unless the user already chose
a cache directory (`jax.config.jax_compilation_cache_dir`, env `JAX_COMPILATION_CACHE_DIR`) or
turned caching off with JAX's own variable `JAX_ENABLE_COMPILATION_CACHE=false`. In code,
`rejax.set_compilation_cache(None)` turns it off and `set_compilation_cache(path)` moves it.
"""

from __future__ import annotations

import os
import pathlib

import jax

_OFF = ("0", "false", "no", "off")


def default_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache"
    return base / "rejax" / "jax"


def set_compilation_cache(path: str | os.PathLike | None) -> None:
    """Turns the persistent compilation cache on at `path`, or off with None."""
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))


def enable_default() -> None:
    """rejax's default: the cache under `default_dir()` unless the user configured JAX's own."""
    if os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").strip().lower() in _OFF:
        return
    if jax.config.jax_compilation_cache_dir:
        return
    set_compilation_cache(default_dir())
