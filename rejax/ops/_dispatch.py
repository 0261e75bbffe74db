"""The one rule that decides, for every rejax op, between its CUDA kernel and its reference.

An op's primitive always lowers to its pure-JAX reference, except when the computation is
lowered for CUDA: then its CUDA lowering asks `use_kernel` whether the kernel applies (the
library can build it and the shape is supported). When it does not, the op lowers to its
reference with GPU-friendly numerics (tensor-core dots, never a sequential scan), and the reason
is logged once per (op, reason). `impl` forces a side: "ref" always takes the reference, "cuda"
takes the kernel or raises an error that says why not.

The launch path of PTX kernels ("ptx": XLA's own custom-kernel call; "callback": a
command-buffer-compatible `buffer_callback`) is probed once per process here too.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import warnings

import jax

_LOG = logging.getLogger("rejax.ops")

IMPLS = ("auto", "ref", "cuda")
LAUNCHES = ("ptx", "callback")
# Environment variable that pins the CUDA launch path ("ptx" or "callback"); unset -> probe.
LAUNCH_ENV = "REJAX_GEMV_LAUNCH"

_NOTED: set = set()


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}, expected one of {IMPLS}")


def note_once(op: str, why: str) -> None:
    """Logs (and warns) once per (op, reason) that an op runs its reference on CUDA."""
    key = (op, why)
    if key in _NOTED:
        return
    _NOTED.add(key)
    message = f"{op}: reference path on CUDA: {why}"
    _LOG.warning(message)
    warnings.warn(message, stacklevel=3)


def noted() -> list[tuple[str, str]]:
    """The (op, reason) pairs logged so far in this process (for tests and reports)."""
    return sorted(_NOTED)


def use_kernel(op: str, impl: str, supported: tuple[bool, str]) -> bool:
    """Inside an op's CUDA lowering: True to emit the kernel, False for the reference.

    Args:
        op: the op's name, for messages.
        impl: "auto", "ref" or "cuda".
        supported: (ok, why) from the op's shape / build check.

    Raises:
        ValueError: impl="cuda" and the kernel cannot run (the message says why).
    """
    check_impl(impl)
    if impl == "ref":
        return False
    ok, why = supported
    if ok:
        return True
    if impl == "cuda":
        raise ValueError(f"{op}(impl='cuda'): {why}")
    note_once(op, why)
    return False


def refuse_off_cuda(op: str, impl: str, platforms) -> None:
    """In an op's default (non-CUDA) lowering: impl="cuda" cannot be honoured there."""
    if impl == "cuda":
        raise ValueError(
            f"{op}(impl='cuda') needs the CUDA platform, but this computation is lowered for "
            f"{tuple(platforms)}; use impl='auto' or 'ref'"
        )


def on_cuda() -> bool:
    """True when JAX's default backend is a CUDA GPU."""
    try:
        return jax.default_backend() == "gpu" and bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def outside_trace(fn):
    """fn() run in a fresh thread, whose JAX trace state (thread-local) is empty: a compile probe
    made from inside a lowering rule neither joins the trace being lowered nor evaluates
    eagerly. Returns fn's result and re-raises its exception."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            result["error"] = err

    t = threading.Thread(target=run, name="rejax-probe")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


@functools.cache
def default_launch() -> str:
    """The launch path the CUDA lowerings use in this process ("ptx" or "callback").

    `REJAX_GEMV_LAUNCH` pins it; otherwise the PTX custom call is probed once on the GPU (one
    tiny GEMV checked against its reference) and "callback" is used if it fails.
    """
    forced = os.environ.get(LAUNCH_ENV)
    if forced:
        if forced not in LAUNCHES:
            raise ValueError(f"{LAUNCH_ENV}={forced!r}, expected one of {LAUNCHES}")
        return forced
    if not on_cuda():
        return "ptx"
    try:
        from cuda_ops import nvfp4_gemv
        from rejax.ops.linear import gemv_call

        # The first call usually comes while a jitted function is being traced: evaluate the
        # probe eagerly instead of staging it into that trace.
        with jax.ensure_compile_time_eval():
            nvfp4_gemv.probe_ptx_launch(gemv_call)
        return "ptx"
    except Exception as err:  # noqa: BLE001 - any failure of the internal target -> fallback
        _LOG.warning("PTX custom call unusable (%s); using buffer_callback", err)
        return "callback"


# ----------------------------------------------------------------------------- PTX custom calls

# XLA's custom kernel call: a PTX entry launched on XLA's stream, the launch geometry and the
# PTX itself in the backend config (`cuda_ops.build.escape_mlir`'s MLIR dictionary text).
PTX_TARGET = "__gpu$xla.gpu.ptx"


def lower_ptx(ctx, *args, backend_config: str, aliases: dict[int, int] | None = None):
    """A lowering rule's body for one PTX kernel call on the primitive's operands.

    `aliases` maps operand positions to the result positions that share their buffer (the
    kernel then updates that operand in place; its output pointer is the operand's).
    """
    extra = {} if not aliases else {"operand_output_aliases": dict(aliases)}
    return jax.ffi.ffi_lowering(PTX_TARGET, api_version=2, backend_config=backend_config, **extra)(
        ctx, *args
    )


def ptx_call(backend_config: str, out, *operands, aliases: dict[int, int] | None = None):
    """The same call from traced code (inside `mlir.lower_fun`), `out` its result shapes;
    `aliases` as in `lower_ptx`."""
    return jax.ffi.ffi_call(
        PTX_TARGET,
        out,
        custom_call_api_version=2,
        legacy_backend_config=backend_config,
        input_output_aliases=dict(aliases) if aliases else None,
    )(*operands)


def on_gpu_stream(fn, stream: int = 1):
    """`fn` as one call that XLA runs on its GPU stream `stream` (`compute_on("gpu_stream:N")`:
    the call carries `_xla_stream_annotation`, and XLA wraps it in an async start / done pair).
    JAX 0.10 spells the function form `compute_on2`; from 0.11 `compute_on` itself takes the
    function (`compute_type`, `out_memory_spaces`)."""
    from jax.experimental import compute_on as co

    form = co.compute_on
    if "out_memory_spaces" not in inspect.signature(form).parameters:
        form = co.compute_on2

    def wrapped(*args):
        out = jax.eval_shape(fn, *args)
        spaces = jax.tree.map(lambda _: jax.memory.Space.Device, out)
        return form(fn, compute_type=f"gpu_stream:{stream}", out_memory_spaces=spaces)(*args)

    return wrapped
