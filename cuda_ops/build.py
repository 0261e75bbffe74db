"""Run-time compilation of rejax's CUDA sources with NVRTC (cuda-python), cached on disk.

Kernels are compiled at first use (when a computation is lowered for CUDA), for the arch of the
GPU that is present (`compute_XY` from its compute capability; `compute_90` when there is none,
e.g. on CPU-only CI), with shape-specialising `-D` constants. PTX is cached on disk under
`$REJAX_KERNEL_CACHE` (default `~/.cache/rejax/kernels`), keyed by a hash of (source, every local
header it includes, defines, arch, NVRTC version), so a second process skips NVRTC entirely.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import re
import tempfile

CACHE_ENV = "REJAX_KERNEL_CACHE"
DEFAULT_ARCH = "compute_90"
DEFAULT_SMS = 132  # the H200's (and H100 SXM's) SMs: launch plans lowered without a GPU
# Hopper is the oldest arch with cvt.rn.f16x2.e4m3x2 (sm_89) and the cache hints we use.
MIN_CC = (8, 9)
SOURCE_DIR = pathlib.Path(__file__).resolve().parent


class KernelError(RuntimeError):
    """A kernel cannot be built or launched here; the message says why and what to do."""


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as err:
        raise KernelError(
            "NVRTC is not available: install the CUDA extra (`pip install rejax[cuda]`, i.e. "
            f"cuda-bindings and nvidia-cuda-nvrtc) ({err})"
        ) from err
    return nvrtc


def _check(result, what: str):
    """Unwraps a cuda-python (status, *values) tuple, raising KernelError on failure."""
    status, *values = result
    if int(status) != 0:
        raise KernelError(f"{what} failed: {status!r}")
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    try:
        return tuple(_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))
    except RuntimeError as err:  # the shared library itself is missing
        raise KernelError(
            f"NVRTC library not found ({err}); install nvidia-cuda-nvrtc matching your CUDA major"
        ) from err


def nvrtc_available() -> bool:
    """Whether NVRTC (cuda-bindings and its shared library) can compile here (no GPU needed)."""
    try:
        nvrtc_version()
    except KernelError:
        return False
    return True


def _first_cuda_device():
    """JAX's first CUDA device, or None where there is none (CPU-only CI lowers for CUDA)."""
    try:
        import jax

        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    return devices[0] if devices else None


def device_arch(device=None) -> str:
    """`compute_XY` for a JAX CUDA device (default: the first), or `compute_90` with none."""
    device = _first_cuda_device() if device is None else device
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return DEFAULT_ARCH
    major, minor = (int(v) for v in str(cc).split("."))
    if (major, minor) < MIN_CC:
        raise KernelError(
            f"GPU compute capability {major}.{minor} is unsupported: the NVFP4 kernel needs "
            f">= {MIN_CC[0]}.{MIN_CC[1]} (E4M3 converts); use impl='ref'"
        )
    return f"compute_{major}{minor}"


def device_sms(device=None) -> int:
    """Streaming multiprocessors of a JAX CUDA device (default: the first; a MIG instance
    reports its own), or `DEFAULT_SMS` with none. Launch plans that need every CTA resident at
    once (the grid sampler's barriers) must be sized by it, not by a constant."""
    device = _first_cuda_device() if device is None else device
    count = getattr(device, "core_count", None)
    return int(count) if count else DEFAULT_SMS


def cache_dir() -> pathlib.Path:
    root = os.environ.get(CACHE_ENV)
    path = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "rejax" / "kernels"
    return path


def _key(source: str, headers: dict, defines: dict, arch: str, version, opts) -> str:
    h = hashlib.sha256()
    parts = [source, *(f"{n}\0{t}" for n, t in sorted(headers.items()))]
    for part in (*parts, repr(sorted(defines.items())), arch, repr(version), repr(opts)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def local_headers(
    source: str, directory: pathlib.Path | tuple[pathlib.Path, ...] = SOURCE_DIR
) -> dict[str, str]:
    """Every `#include "name"` header of `source` found in `directory` (or the first of several
    directories that has it), recursively: name -> text.

    They are handed to NVRTC as in-memory headers and hashed into the cache key, so editing a
    header recompiles every kernel that includes it.
    """
    dirs = (directory,) if isinstance(directory, pathlib.Path) else tuple(directory)
    found: dict[str, str] = {}
    todo = _INCLUDE.findall(source)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = next((d / name for d in dirs if (d / name).is_file()), None)
        if path is None:
            where = ", ".join(f"{d.name}/" for d in dirs)
            raise KernelError(f'#include "{name}": no such header in {where}')
        found[name] = path.read_text()
        todo.extend(_INCLUDE.findall(found[name]))
    return found


def read_source(name: str) -> str:
    return (SOURCE_DIR / name).read_text()


def compile_ptx(
    source: str,
    *,
    name: str = "kernel.cu",
    defines: dict | None = None,
    arch: str | None = None,
    options: tuple[str, ...] = (),
    use_cache: bool = True,
    header_dirs: tuple[pathlib.Path, ...] = (),
) -> str:
    """Compiles CUDA C++ to PTX with NVRTC (disk-cached). Returns the PTX text.

    Args:
        source: CUDA C++ source text.
        name: file name NVRTC reports in diagnostics.
        defines: `-D` constants (name -> int/str), baked into the PTX.
        arch: `compute_XY`; None -> the present GPU's arch (compute_90 with no GPU).
        options: extra NVRTC options.
        use_cache: read/write the on-disk cache.
        header_dirs: directories searched for `#include "..."` headers before this one's
            (an experiment's own headers).
    """
    defines = dict(defines or {})
    arch = arch or device_arch()
    if not re.fullmatch(r"compute_\d+[af]?", arch):
        raise KernelError(f"arch={arch!r}, expected e.g. 'compute_90'")
    version = nvrtc_version()
    opts = (
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "-default-device",
        *(f"-D{k}={v}" for k, v in sorted(defines.items())),
        *options,
    )
    headers = local_headers(source, (*header_dirs, SOURCE_DIR))
    key = _key(source, headers, defines, arch, version, opts)
    path = cache_dir() / f"{key}.ptx"
    if use_cache and path.is_file():
        return path.read_text()
    ptx = _nvrtc_compile(source, name, opts, headers)
    if use_cache:
        _write_atomic(path, ptx)
    return ptx


def _nvrtc_compile(source: str, name: str, opts: tuple[str, ...], headers: dict) -> str:
    nvrtc = _nvrtc()
    names = sorted(headers)
    prog = _check(
        nvrtc.nvrtcCreateProgram(
            source.encode(),
            name.encode(),
            len(names),
            [headers[n].encode() for n in names],
            [n.encode() for n in names],
        ),
        "nvrtcCreateProgram",
    )
    try:
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        if int(status) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            _check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            text = log.decode(errors="replace").strip()
            raise KernelError(f"NVRTC failed to compile {name} with {' '.join(opts)}:\n{text}")
        size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return buf.rstrip(b"\0").decode()


def _write_atomic(path: pathlib.Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError:  # a read-only cache only costs a recompile
        pass


def ptx_entries(ptx: str) -> dict[str, int]:
    """`.entry` names in a PTX module -> number of parameters."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx):
        out[m.group(1)] = len(re.findall(r"\.param\b", m.group(2)))
    return out


def ptx_globals_by_entry(ptx: str) -> dict[str, set[str]]:
    """`.entry` name -> the module-scope `.global` variables its body refers to, through the
    `.func`s it calls. Each custom call loads its own copy of a PTX module, so two entries
    launched as two calls never see one global: a global that two entries refer to is a
    value one kernel leaves that the next cannot read."""
    names = set(
        re.findall(
            r"^\s*(?:\.visible\s+|\.extern\s+)?\.global\s+[^;]*?(\w+)\s*(?:\[[^;]*)?(?:=[^;]*)?;",
            ptx,
            re.MULTILINE,
        )
    )
    heads = list(
        re.finditer(
            r"^\s*(?:\.visible\s+|\.weak\s+)?\.(entry|func)\s+(?:\([^)]*\)\s*)?(\w+)",
            ptx,
            re.MULTILINE,
        )
    )
    refs, calls, kinds = {}, {}, {}
    for i, h in enumerate(heads):
        body = ptx[h.end() : heads[i + 1].start() if i + 1 < len(heads) else len(ptx)]
        words = set(re.findall(r"\b\w+\b", body))
        refs[h.group(2)] = words & names
        calls[h.group(2)] = set(re.findall(r"\bcall(?:\.uni)?\s+(?:\([^)]*\),\s*)?(\w+)", body))
        kinds[h.group(2)] = h.group(1)
    out = {}
    for name, kind in kinds.items():
        if kind != "entry":
            continue
        seen, todo, found = set(), [name], set()
        while todo:
            f = todo.pop()
            if f in seen or f not in refs:
                continue
            seen.add(f)
            found |= refs[f]
            todo.extend(calls[f])
        out[name] = found
    return out


def ptx_target(ptx: str) -> str:
    m = re.search(r"^\s*\.target\s+(\w+)", ptx, re.MULTILINE)
    return m.group(1) if m else ""


def ptx_backend_config(
    entry: str,
    kernel_data: str,
    *,
    grid: tuple[int, int, int],
    block: int,
    outputs: tuple[int, ...] | range,
    smem: int = 0,
) -> str:
    """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call of one PTX entry.

    Args:
        entry: the `.entry` name.
        kernel_data: the module's PTX, already `escape_mlir`-escaped.
        grid: (x, y, z) CTAs.
        block: threads per CTA (1-D).
        outputs: positions of the results in the kernel's parameter list (operands come first).
        smem: dynamic shared memory bytes.
    """
    gx, gy, gz = grid
    outs = ", ".join(str(i) for i in outputs)
    return (
        "{"
        f'name = "{entry}", kernel_type = "ptx", kernel_data = "{kernel_data}", '
        f"grid_x = {gx}, grid_y = {gy}, grid_z = {gz}, "
        f"block_x = {block}, block_y = 1, block_z = 1, "
        f"shared_mem_bytes = {smem}, output_indices = [{outs}]"
        "}"
    )


def escape_mlir(text: str) -> str:
    """`text` as an MLIR string literal body (the PTX in a custom call's backend config):
    backslash, quote, newline and tab escaped, other non-printable bytes as \\XX."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif 32 <= ord(ch) < 127:
            out.append(ch)
        else:
            out.extend(f"\\{b:02X}" for b in ch.encode())
    return "".join(out)


def _nvrtc_offline(
    source: str, defines: dict, arch: str, name: str, header_dirs, extra: tuple[str, ...]
) -> tuple[str, bytes]:
    """NVRTC straight to an `arch` cubin, offline: (its log, the cubin)."""
    nvrtc = _nvrtc()
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *extra]
    opts += [f"-D{k}={v}" for k, v in sorted(defines.items())]
    headers = local_headers(source, (*header_dirs, SOURCE_DIR))
    names = sorted(headers)
    err, prog = nvrtc.nvrtcCreateProgram(
        source.encode(), name.encode(), len(names),
        [headers[n].encode() for n in names], [n.encode() for n in names],
    )  # fmt: skip
    if int(err) != 0:
        raise KernelError(f"nvrtcCreateProgram: {err}")
    try:
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        text = log.decode(errors="replace")
        if int(status) != 0:
            raise KernelError(f"NVRTC failed:\n{text}")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return text, cubin


def ptxas_log(
    source: str,
    defines: dict,
    arch: str = "sm_90",
    name: str = "kernel.cu",
    header_dirs: tuple[pathlib.Path, ...] = (),
) -> str:
    """ptxas's -v report (registers, spills, shared memory) of `source` compiled by NVRTC to a
    cubin for `arch`, offline (no GPU needed); raises KernelError with NVRTC's log on failure.
    `header_dirs`: as compile_ptx's."""
    return _nvrtc_offline(source, defines, arch, name, header_dirs, ("-Xptxas=-v",))[0]


def compile_cubin(
    source: str,
    defines: dict,
    arch: str = "sm_90",
    name: str = "kernel.cu",
    header_dirs: tuple[pathlib.Path, ...] = (),
) -> bytes:
    """The `arch` cubin (ELF) NVRTC makes of `source`, offline: what a disassembler reads to
    count a kernel's machine instructions. Not cached. `header_dirs`: as compile_ptx's."""
    return _nvrtc_offline(source, defines, arch, name, header_dirs, ())[1]
