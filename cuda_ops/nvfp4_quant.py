"""Host side of the stand-alone activation quantizer `nvfp4_quantize_bf16` (in `nvfp4_gemv.cu`,
compiled with QUANT_ONLY): build and launch configuration.

The kernel runs the fused GEMV's prologue and quantizer once per row of x, each row split into
`chunk`-element pieces over the grid (grid [M, K / chunk], any M >= 1; every CTA recomputes the
row's statistics from L2 and quantizes its piece). Its device code is the fused kernel's
(`Fused` in cuda_ops/nvfp4_gemv.py describes the prologue), so the codes and scales are
`rejax.nvfp4.quantize_activation`'s: bitwise for prologue "none"; "rmsnorm" sums the mean square
in its own order and "swiglu" uses CUDA's expf, so a few bf16 inputs of the quantizer may round
the other way (tests/test_quant_kernel_gpu.py). Two output forms (`OUTS`, a compile-time choice):

* "codes": what the W4A4 GEMV reads, codes uint8 [M, K/2], E4M3 scales uint8 [M, K/16] and the
  global scale float32 [M];
* "xhat" (-DXHAT_OUT=1): what the tensor-core GEMM reads, x_hat = e2m1(code) * SFx as float16
  [M, K] in the GEMM's permuted K order (exactly `rejax.ops.linear.gemm_x_operand` of those
  codes and scales: the values are exact in fp16) and the global scale float32 [M], so no XLA
  fusion builds the GEMM's operand. Each thread quantizes 8 elements per round and stores them
  as one 16-byte run of x_hat;
* "xhat_tiles" (-DXHAT_OUT=2): the same x_hat values as the wgmma GEMM's stage tiles, float16
  [ceil(M / tile_m), K / 128, tile_m * 128] (`cuda_ops.nvfp4_gemm_wgmma.to_stage_tiles` of its
  `wgmma_x_operand`; the last tile's padding rows zero), and the global scale float32 [M]: the
  wgmma GEMM's x operand with no XLA fusion. A CTA takes 8 rows (one 8-token core-matrix
  group) of a `chunk` (default 512), builds their part of the tiles in shared memory and stores
  whole 128-byte core matrices; the grid covers the last tile's padding rows (zeros). A chunk
  past `TILES_IMG_MAX` elements (e.g. K: one CTA an 8-row group, so that the row statistics are
  read once, not once per chunk) is built and stored in passes of at most that many.
* "xhat_bf16" (-DXHAT_OUT=3): the same values as bf16 [M, K] in natural K order (exact), what
  the dot path's bf16 dot takes for its activations (`GemmOptions.dot_x` "kernel"), and the
  global scale float32 [M]; chunking and threads as "xhat".

With `finish=FinishIn(...)` the "xhat" form reads no x: it forms each x value as a K-split
GEMM's finish kernel would store it (`nvfp4_gemm_finish`: that GEMM's float32 partials added in
split order, its scales, its residual) and runs the prologue and quantizer on those values,
entry `nvfp4_finish_quantize` (`FIN_ENTRY`): the finish and the next linear's quantizer in one
launch, the same bytes as the two launches (the row statistics do not depend on the chunking),
optionally also storing the finish's y (the decoder's residual stream). With one CTA per row
(chunk = K; prologue "none" / "rmsnorm") the CTA forms the row once in shared memory
(FIN_CACHE), so each partial is read once, as by the finish kernel; with smaller chunks every
CTA re-reads the row's partials for the RMSNorm statistic. The "xhat_bf16" form takes a finish
too: `FinishIn.dot` is the dot path's producer, one float32 sum (XLA's bf16 dot) that the kernel
scales by the global scales and rounds to bf16 as `rejax.nvfp4.matmul_x_values` does (adding
the residual where there is one), then the next linear's quantizer runs on those values
(`rejax.ops.dot_block`: down's SwiGLU input from gate_up's sum, gate_up's RMSNorm input from
o_proj's).

Measured on the H200 (Qwen3-8B NVFP4; experiments/results/h200_c/ and h200_d/): with one CTA
per row (chunk = K, 256 threads) the "codes" kernel took 6.9 us per call in a profile of the
8-layer decode step, a row's whole quantization serialised on one SM, and linear_fusion "split"
was slower than "unfused" (36 layers, batch 1: 3.580 vs 3.158 ms/token). Spread over the grid
(by default 512 elements per 128-thread CTA where K % 512 == 0, else 256: one quant4 round per
thread) it takes 2.3 us, and "split" became the faster path (2.796 vs 3.018 ms/token). The
"xhat" form takes by default 1024 elements per 128-thread CTA where K % 1024 == 0 (else 512 or
256 with 64 or 32 threads): one quant8 round per thread, as many elements per thread as the
16-byte stores need (not yet measured against other chunkings).

Measured on an H100 (experiments/results/xquant_tiles_h100/): the "xhat_tiles" form's first
design, one CTA a row storing 16-byte pieces 2 KiB apart, took 20 us for 512 rows of K = 4096
(7x the bytes' floor, in every launch shape tried; ncu: 1.57 M L2 write sectors where the bytes
need 131 K, L2 74% busy). With 8 rows a CTA and 512-element chunks: 7.8 us ("none"), 16.2 us
(RMSNorm: every CTA re-reads its 8 rows for the statistic) and 24.2 us (SwiGLU, K = 12288).
Longer chunks (up to a whole row, the image in passes; the same bytes) measured slower where it
matters (experiments/results/tiles_chunk_h100_s46/): a whole row at 512 rows took 36.4 against
12.6 us (RMSNorm; 64 CTAs), and the SwiGLU input at 4096 rows 188 against 124 us; only the
RMSNorm input from 2048 rows gained, 59 against 70 us at 4096 rows with 1024-element chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

from cuda_ops.build import (
    KernelError,
    compile_ptx,
    device_arch,
    escape_mlir,
    ptx_backend_config,
    ptx_entries,
    read_source,
)
from cuda_ops.nvfp4_gemv import K_MULTIPLE, SOURCE, Fused, _drv_check

__all__ = [
    "DOT_W_SHIFT",
    "ENTRY",
    "FIN_ENTRY",
    "MAX_ROWS",
    "N_INPUTS",
    "OUTS",
    "FinishIn",
    "QuantKernel",
    "build",
    "check_shape",
    "default_chunk",
    "default_threads",
]

ENTRY = "nvfp4_quantize_bf16"
FIN_ENTRY = "nvfp4_finish_quantize"
# operands (partials, the producer's x global scale, residual, the producer's weight global
# scale, the next linear's input scale, norm weight, layer) then the outputs (y, x_hat, global
# scale per row)
FIN_INPUTS = 7
FIN_OUTPUTS = 3
# operands (x, xg, norm weight, layer) then the outputs: "codes" (codes, scales, global scale
# per row), "xhat" (x_hat, global scale per row)
N_INPUTS = 4
N_OUTPUTS = 3
OUTS = ("codes", "xhat", "xhat_tiles", "xhat_bf16")
TILE_MS = (128, 256)  # "xhat_tiles": the wgmma GEMM's token tiles
TILE_GROUP = 8  # "xhat_tiles": rows a CTA (one 8-token core-matrix group: whole 128-byte stores)
# "xhat_tiles": elements of one pass of the tile image (16 bytes of shared memory each); longer
# chunks take several passes
TILES_IMG_MAX = 2048
XHAT_OUTPUTS = 2
# FinishIn.w_shift of the dot path's float32 sum (no fp16 weight offset: a factor 2^0)
DOT_W_SHIFT = 14
THREADS = 128
# rows are grid x (one CTA row per activation row): CUDA's limit
MAX_ROWS = 2**31 - 1
# the GEMV part of the source is not compiled (QUANT_ONLY), but its constants must be valid
_GEMV_DUMMIES = {
    "ACT_W4A4": 1, "M_TOK": 1, "N_OUT": 1, "R_ROWS": 1, "SPP": 1, "GRID": 1, "GEMV_STREAM": 0,
    "KSPLIT": 1, "RING_D": 0, "GW_ROWS": 0,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FinishIn:
    """The producer of a finish-quantizer's x: a K-split W4A4 GEMM whose float32 partials
    [splitk, M, X] (X = K, or 2K for the "swiglu" prologue) the kernel adds as that GEMM's
    finish kernel does (`cuda_ops.nvfp4_gemm.GemmPlan`'s splitk, w_shift, gw_rows, residual);
    or (`FinishIn.dot`) the dot path's one float32 sum [M, X], y = bf16(sum * (global_w *
    global_x)) as `rejax.nvfp4.matmul_x_values` forms it.

    Attributes:
        splitk: the producer's K split (its partials' leading dim), >= 1.
        w_shift: the producer's GemmPlan.w_shift (its fp16 weight offset 2^(w_shift - 14)), 0..7;
            `DOT_W_SHIFT` (14, splitk 1) for the dot path's sum.
        gw_rows: the producer's weight global scale is per row ([(L,) X]).
        residual: the finish adds a bf16 residual [M, X] (the producer's EPI_RES).
        store_y: also store the finish's y, bf16 [M, X] (prologue "none" / "rmsnorm").
        next_layers: 0, or L: the quantized linear is the next layer's (down_proj -> the next
            layer's qkv), so the norm weight and input scale are read at layer + 1 of their
            L-layer stacks (clamped to L - 1; the producer's weight scale at the layer).
        cluster: a row's K / chunk CTAs (2..8; prologue "none" / "rmsnorm") run as one
            thread-block cluster: each forms its chunk of x once into shared memory and the
            row statistics read the row through distributed shared memory (each partial read
            once, the row spread over K / chunk CTAs rather than one; FIN_CLUSTER).
    """

    splitk: int
    w_shift: int = 7
    gw_rows: bool = False
    residual: bool = False
    store_y: bool = False
    next_layers: int = 0
    cluster: bool = False

    def __post_init__(self):
        if not isinstance(self.splitk, int) or self.splitk < 1:
            raise KernelError(f"FinishIn.splitk={self.splitk!r}, expected an int >= 1")
        if not isinstance(self.w_shift, int) or not (
            0 <= self.w_shift <= 7 or self.w_shift == DOT_W_SHIFT
        ):
            raise KernelError(
                f"FinishIn.w_shift={self.w_shift!r}, expected an int in 0..7 or {DOT_W_SHIFT}"
            )
        if self.w_shift == DOT_W_SHIFT and self.splitk != 1:
            raise KernelError(f"FinishIn.w_shift={DOT_W_SHIFT} (the dot path's sum) takes "
                              f"splitk=1, got {self.splitk}")  # fmt: skip
        if not isinstance(self.next_layers, int) or self.next_layers < 0:
            raise KernelError(f"FinishIn.next_layers={self.next_layers!r}, expected an int >= 0")

    @classmethod
    def dot(cls, gw_rows: bool) -> FinishIn:
        """The dot path's producer: XLA's float32 sum [M, X] of a bf16 dot, whose weight
        global scale is per row (`gw_rows`, [(L,) X]) or one ([(L,)])."""
        return cls(splitk=1, w_shift=DOT_W_SHIFT, gw_rows=bool(gw_rows))

    def defines(self) -> dict:
        return {
            "FIN_SPLITK": self.splitk,
            "FIN_W_SHIFT": self.w_shift,
            "FIN_GW_ROWS": int(self.gw_rows),
            "FIN_RES": int(self.residual),
            "FIN_STORE_Y": int(self.store_y),
        } | ({"FIN_NEXT_LAYERS": self.next_layers} if self.next_layers else {})


def check_shape(m: int, k: int) -> tuple[bool, str]:
    """(True, "") if the quantizer kernel takes [m, k] activations (any M rows, one grid row of
    CTAs each; K a multiple of 256), else (False, why)."""
    if not 1 <= m <= MAX_ROWS:
        return False, f"M={m} rows (the quantizer kernel takes 1..{MAX_ROWS})"
    if k < K_MULTIPLE or k % K_MULTIPLE:
        return False, f"K={k} (expected a positive multiple of {K_MULTIPLE})"
    return True, ""


# From this many rows (two CTAs per SM of the default GPU) the quantizer takes one CTA a row
# by default (chunk = K): every CTA recomputes its row's statistics (the whole row's prologue,
# e.g. 12 times for down_proj's SwiGLU input at K = 12288 in 1024-element chunks), which costs
# little at decode rows but grows with M, and M rows alone fill the GPU. Only linears of more
# rows than the default GemmOptions.max_m (256) reach it; not yet measured.
ROW_CTA_MIN_M = 264


def default_chunk(k: int, out: str = "codes", m: int | None = None) -> int:
    """Elements of a row one CTA quantizes. "codes" and "xhat_tiles": 512 where K allows, else
    256 (K % 256 == 0). "xhat" and "xhat_bf16": 1024, 512 or 256, the largest dividing K. From
    `ROW_CTA_MIN_M` rows `m` (all but "xhat_tiles"): K (one CTA a row)."""
    if out == "xhat_tiles":  # 8 rows a CTA (H100: 512 beat 1024 at 300 and 512 rows)
        return 512 if k % 512 == 0 else 256
    if m is not None and m >= ROW_CTA_MIN_M:
        return k
    sizes = (1024, 512, 256) if out != "codes" else (512, 256)
    return next(c for c in sizes if k % c == 0)


def default_threads(chunk: int, out: str = "codes") -> int:
    """Threads of a CTA: "codes" and "xhat_tiles" 128; "xhat" and "xhat_bf16" one per 8
    elements of the chunk, at most 128."""
    return min(THREADS, chunk // 8) if out in ("xhat", "xhat_bf16") else THREADS


@dataclasses.dataclass(frozen=True, eq=False)
class QuantKernel:
    """A compiled quantizer specialisation: M rows of K inputs, `chunk` elements per CTA, output
    form `out` (`OUTS`), "xhat_tiles" with `tile_m`-token tiles."""

    m: int
    k: int
    fused: Fused
    ptx: str
    chunk: int
    threads: int
    out: str = "codes"
    finish: FinishIn | None = None
    tile_m: int = 0

    @property
    def rows(self) -> int:
        """CTA rows of the grid: M, or for "xhat_tiles" M padded to whole tiles."""
        if self.out == "xhat_tiles":
            return -(-self.m // self.tile_m) * self.tile_m
        return self.m

    @property
    def grid(self) -> tuple[int, int, int]:
        """(row CTAs, chunks a row, 1): "xhat_tiles" takes `TILE_GROUP` rows a CTA."""
        rows = self.rows // TILE_GROUP if self.out == "xhat_tiles" else self.rows
        return (rows, self.k // self.chunk, 1)

    @property
    def out_shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        """(shape, dtype name) of the x_hat forms' two outputs."""
        if self.out == "xhat_tiles":
            xh = (self.rows // self.tile_m, self.k // 128, self.tile_m * 128)
        else:
            xh = (self.m, self.k)
        dtype = "bfloat16" if self.out == "xhat_bf16" else "float16"
        return ((xh, dtype), ((self.m,), "float32"))

    @property
    def entry(self) -> str:
        return ENTRY if self.finish is None else FIN_ENTRY

    @property
    def n_inputs(self) -> int:
        """Operands of the entry before its outputs."""
        return N_INPUTS if self.finish is None else FIN_INPUTS

    @property
    def n_outputs(self) -> int:
        """Outputs of the entry, after its operands."""
        if self.finish is not None:
            return FIN_OUTPUTS
        return N_OUTPUTS if self.out == "codes" else XHAT_OUTPUTS

    def backend_config(self) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call."""
        return ptx_backend_config(
            self.entry,
            escape_mlir(self.ptx),
            grid=self.grid,
            block=self.threads,
            outputs=range(self.n_inputs, self.n_inputs + self.n_outputs),
        )

    def launch(self, stream: int, pointers: list[int]) -> None:
        """Launches on `stream` (no sync, no allocation): pointers to the entry's operands, then
        its outputs (n_inputs + n_outputs device pointers), as XLA passes them."""
        import ctypes

        from cuda.bindings import driver

        want = self.n_inputs + self.n_outputs
        if len(pointers) != want:
            raise KernelError(f"{self.entry} takes {want} pointers, got {len(pointers)}")
        fn = _function(self)
        params = (tuple(pointers), tuple(ctypes.c_void_p for _ in pointers))
        _drv_check(
            driver.cuLaunchKernel(fn, *self.grid, self.threads, 1, 1, 0, stream, params, 0),
            "cuLaunchKernel",
        )


_FUNCTIONS: dict = {}
_LOCK = threading.Lock()


def _function(kernel: QuantKernel):
    """CUfunction of `kernel`'s entry in the current CUDA context (module loaded once)."""
    from cuda.bindings import driver

    ctx = _drv_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    key = (int(ctx), id(kernel))
    with _LOCK:
        if key not in _FUNCTIONS:
            module = _drv_check(driver.cuModuleLoadData(kernel.ptx.encode() + b"\0"), "load")
            fn = _drv_check(
                driver.cuModuleGetFunction(module, kernel.entry.encode()), "cuModuleGetFunction"
            )
            _FUNCTIONS[key] = (module, fn, kernel)  # the kernel stays alive with its id() key
        return _FUNCTIONS[key][1]


@functools.cache
def _build_cached(
    m, k, fused, arch, chunk, threads, out="codes", finish=None, tile_m=0
) -> QuantKernel:
    if fused.residual:
        raise KernelError("the quantizer has no residual epilogue (Fused.residual=True)")
    sizes = {"K_IN": k, "NTHREADS": threads, "QUANT_ONLY": 1, "QCHUNK": chunk}
    # XHAT_OUT and FIN_* only when set: the other kernels keep their defines and cache keys
    form = {"XHAT_OUT": 1} if out == "xhat" else {"XHAT_OUT": 3} if out == "xhat_bf16" else {}
    if out == "xhat_tiles":  # the real rows: the grid covers the last tile's padding rows too
        form = {"XHAT_OUT": 2, "XHAT_TM": tile_m, "XHAT_M": m, "M_TOK": TILE_GROUP}
    if finish is not None:
        form |= finish.defines()
        if finish.cluster:  # the row's CTAs a cluster, each chunk in its CTA's shared memory
            form["FIN_CLUSTER"] = k // chunk
        elif chunk == k and fused.prologue != "swiglu":
            # one CTA per row: the row formed once into shared memory (each partial read once)
            form["FIN_CACHE"] = 1
    defines = _GEMV_DUMMIES | fused.defines() | sizes | form
    ptx = compile_ptx(read_source(SOURCE), name=SOURCE, defines=defines, arch=arch)
    kernel = QuantKernel(
        m=m,
        k=k,
        fused=fused,
        ptx=ptx,
        chunk=chunk,
        threads=threads,
        out=out,
        finish=finish,
        tile_m=tile_m,
    )
    entries = ptx_entries(ptx)
    if entries.get(kernel.entry) != kernel.n_inputs + kernel.n_outputs:
        raise KernelError(f"PTX entry {kernel.entry} missing or with wrong parameters: {entries}")
    return kernel


def build(
    m: int,
    k: int,
    fused: Fused,
    *,
    arch: str | None = None,
    chunk: int | None = None,
    threads: int | None = None,
    out: str = "codes",
    finish: FinishIn | None = None,
    tile_m: int = 128,
) -> QuantKernel:
    """Compiles (NVRTC, disk-cached) the quantizer for M rows of K inputs after `fused.prologue`
    ("swiglu": x holds 2K columns), static (xg[0]) or per-row dynamic (`fused.dynamic`) global
    scale; each CTA takes `chunk` elements of a row (default `default_chunk(k, out, m)`; K means
    one CTA per row; "xhat": a multiple of 256) with `threads` threads (a multiple of 32;
    default `default_threads(chunk, out)`). `out`: the output form, "codes" (codes, scales,
    global scale: the GEMV's operands), "xhat" (the GEMM's fp16 x_hat and the global scale),
    "xhat_bf16" (the same values as bf16 in natural K order, the dot path's operand) or
    "xhat_tiles" (the wgmma GEMM's x_hat stage tiles of `tile_m` tokens, `TILE_MS`, and the
    global scale; compiled for this M). `finish`: x is not an operand but a K-split GEMM's
    finish of its partials, or the dot path's float32 sum (`FinishIn`; the entry `FIN_ENTRY`,
    "xhat" and "xhat_bf16" forms).

    Raises KernelError when NVRTC is missing or the shape, chunking or form is unsupported.
    """
    if out not in OUTS:
        raise KernelError(f"out={out!r}, expected one of {OUTS}")
    if finish is not None:
        if not isinstance(finish, FinishIn):
            raise KernelError(f"finish must be a FinishIn, got {type(finish).__name__}")
        if out not in ("xhat", "xhat_bf16"):
            raise KernelError(f"finish= writes x_hat: out='xhat' or 'xhat_bf16', got {out!r}")
        if finish.store_y and fused.prologue == "swiglu":
            raise KernelError("FinishIn.store_y stores the linear's input rows: not with swiglu")
        if finish.cluster and fused.prologue == "swiglu":
            raise KernelError("FinishIn.cluster: prologue 'none' or 'rmsnorm', got 'swiglu'")
    if out == "xhat_tiles" and tile_m not in TILE_MS:
        raise KernelError(f"tile_m={tile_m!r}, expected one of {TILE_MS}")
    ok, why = check_shape(m, k)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    if not isinstance(fused, Fused):
        raise KernelError(f"fused must be a Fused, got {type(fused).__name__}")
    chunk = default_chunk(k, out, m) if chunk is None else chunk
    step = 256 if out != "codes" else 128  # full warps: 8 (x_hat forms) or 4 elements a thread
    if chunk <= 0 or chunk % step or k % chunk:
        raise KernelError(f"chunk={chunk}: expected a positive multiple of {step} dividing K={k}")
    if finish is not None and finish.cluster and not 2 <= k // chunk <= 8:
        raise KernelError(f"FinishIn.cluster: chunk={chunk} makes {k // chunk} CTAs a row of "
                          f"K={k}, expected 2..8 (a cluster)")  # fmt: skip
    threads = default_threads(chunk, out) if threads is None else threads
    if threads <= 0 or threads % 32 or threads > 1024:
        raise KernelError(f"threads={threads}: expected a multiple of 32 in [32, 1024]")
    tile = tile_m if out == "xhat_tiles" else 0  # one cache entry for the other forms
    return _build_cached(m, k, fused, arch or device_arch(), chunk, threads, out, finish, tile)
