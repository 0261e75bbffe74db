"""EXPERIMENT: host side of the one-launch batch-1 post-attention block (`nvfp4_block_tma.cu`,
next to this file): o_proj + residual, RMSNorm + quantization, gate_up + SwiGLU + quantization,
down_proj + residual, with one producer warp per CTA streaming all three matrices through one
TMA ring and the consumer warps meeting at two grid-wide barriers. Plan, NVRTC build, ptxas
report; the device check (`check_block_tma.py`) launches it.

Nothing here imports cuda-python or JAX at module import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib

import numpy as np

from cuda_ops.build import (
    DEFAULT_SMS,
    KernelError,
    compile_ptx,
    escape_mlir,
    ptx_backend_config,
    ptx_entries,
)
from experiments.kernels.nvfp4_gemv_tma import (
    ARCH,
    PRODUCERS,
    SM_SMEM,
    SMEM_LIMIT,
    ptxas_of,
)
from experiments.kernels.nvfp4_gemv_tma import parse_options as tma_parse_options

SOURCE = pathlib.Path(__file__).with_name("nvfp4_block_tma.cu")
ENTRY = "nvfp4_block_tma"
HEADER_DIRS = (SOURCE.parent,)  # tma_ring.cuh; common.cuh from cuda_ops/
WARPS = 16  # consumer warps (rows a stage)
# (ap, as, ag, h, wo_p, wo_s, wo_g, nw, xgu, wgu_p, wgu_s, wgu_g, xgd, wd_p, wd_s, wd_g, layer);
# with a_bf16 (a, xgo, h, ...): one fewer
N_INPUTS = 17
OUTPUTS = ("y2", "y1", "gp", "gs", "dp", "ds")
STATIC_SMEM = 256  # hbuf, the norm's sums and scales (bound)
QWEN3_8B = (4096, 4096, 12288)  # (D, K_O = heads x head_dim, F)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Compile-time geometry of one block (see the kernel's header)."""

    d: int  # hidden size: o's and down's N, gate_up's K
    ko: int  # o's K (attention heads x head_dim)
    f: int  # intermediate size: gate_up's N / 2, down's K
    kch: int = 1024  # code bytes of a row a stage (`plan`: `default_kch` of every K)
    stages: int = 6
    sms: int = DEFAULT_SMS
    producer: str = "tma"
    ef: bool = False
    # per matrix (o, gate_up, down): one weight global scale a row ([L, N]) instead of one a
    # matrix ([L]); `plan` takes one bool for all three
    gw_rows: tuple = (False, False, False)
    eps: float = 1e-6  # the RMSNorm epsilon
    a_bf16: bool = False  # o's input in bf16, quantized in the kernel (no quantizer launch)

    @property
    def n_inputs(self) -> int:
        return N_INPUTS - int(self.a_bf16)

    @property
    def grid(self) -> int:
        """One CTA an SM at most (all resident: the barriers wait for every CTA), none without a
        row group of o."""
        return min(self.sms, self.d // 16)

    @property
    def threads(self) -> int:
        return 32 * (WARPS + 1)

    @property
    def k_max(self) -> int:
        return max(self.ko, self.d, self.f)

    @property
    def stage_bytes(self) -> int:
        return WARPS * (self.kch + self.kch // 8)

    @property
    def smem(self) -> int:
        return self.stages * self.stage_bytes + self.k_max + self.k_max // 16 + 16 * self.stages

    @property
    def weight_bytes(self) -> int:
        """Bytes of o, gate_up and down (codes and block scales) one launch reads."""
        elems = self.d * self.ko + 2 * self.f * self.d + self.d * self.f
        return elems // 2 + elems // 16

    def defines(self) -> dict:
        return {
            "D_MODEL": self.d,
            "K_O": self.ko,
            "F_FF": self.f,
            "KCH": self.kch,
            "STAGES": self.stages,
            "GRID": self.grid,
            "PRODUCER": PRODUCERS.index(self.producer),
            "EF": int(self.ef),
            "GW_ROWS_O": int(self.gw_rows[0]),
            "GW_ROWS_GU": int(self.gw_rows[1]),
            "GW_ROWS_D": int(self.gw_rows[2]),
            "NORM_EPS": f"{float(self.eps)!r}f",
            "A_BF16": int(self.a_bf16),
        }


def check_plan(p: BlockPlan) -> tuple[bool, str]:
    """Whether the kernel can run the plan (the .cu's static_asserts, shared memory)."""
    for name, k in (("d", p.d), ("ko", p.ko), ("f", p.f)):
        if k <= 0 or k % 256:
            return False, f"{name}={k}: a positive multiple of 256 expected"
    if p.kch <= 0 or p.kch % 128 or any((k // 2) % p.kch for k in (p.d, p.ko, p.f)):
        return False, f"kch={p.kch}: a multiple of 128 dividing d / 2, ko / 2 and f / 2 expected"
    if p.producer not in PRODUCERS:
        return False, f"producer={p.producer!r}: one of {PRODUCERS} expected"
    if p.ef and p.producer != "tma":
        return False, "ef (an L2 policy on the bulk copies) needs producer 'tma'"
    if p.stages < 2:
        return False, f"stages={p.stages}: at least 2 expected"
    if len(p.gw_rows) != 3 or not all(isinstance(r, bool) for r in p.gw_rows):
        return False, f"gw_rows={p.gw_rows!r}: a bool or three (o, gate_up, down) expected"
    if p.sms < 1:
        return False, f"sms={p.sms}: at least 1 expected"
    if p.smem + STATIC_SMEM > SMEM_LIMIT:
        return False, f"{p.smem} B of shared memory do not fit a CTA"
    return True, ""


def plan(d: int, ko: int, f: int, **options) -> BlockPlan:
    """The plan for a block of hidden size d, o's K ko and intermediate size f with `options`
    (BlockPlan's fields): kch defaults to the largest multiple of 128 up to 1024 that divides
    every K / 2, stages to 6 or as many as fit. Raises KernelError for a plan the kernel cannot
    run."""
    rows = options.get("gw_rows", False)
    options["gw_rows"] = (bool(rows),) * 3 if isinstance(rows, (bool, int)) else tuple(rows)
    if "kch" not in options and all(k > 0 and k % 256 == 0 for k in (d, ko, f)):
        common = math.gcd(d // 2, ko // 2, f // 2)
        options["kch"] = max(c for c in range(128, 1025, 128) if common % c == 0)
    if "stages" not in options:
        p = BlockPlan(d=d, ko=ko, f=f, **options, stages=1)
        room = (SMEM_LIMIT - STATIC_SMEM - p.smem) // (p.stage_bytes + 16)
        options["stages"] = max(2, min(6, room + 1))
    p = BlockPlan(d=d, ko=ko, f=f, **options)
    ok, why = check_plan(p)
    if not ok:
        raise KernelError(f"nvfp4_block_tma: {why}")
    assert p.smem + STATIC_SMEM + 1024 <= SM_SMEM
    return p


def read_source() -> str:
    return SOURCE.read_text()


@dataclasses.dataclass(frozen=True, eq=False)
class BlockKernel:
    plan: BlockPlan
    ptx: str
    entry: str = ENTRY

    def backend_config(self) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call: the plan's
        operands, then the 6 results (`OUTPUTS`)."""
        p = self.plan
        return ptx_backend_config(
            ENTRY,
            escape_mlir(self.ptx),
            grid=(p.grid, 1, 1),
            block=p.threads,
            outputs=range(p.n_inputs, p.n_inputs + len(OUTPUTS)),
            smem=p.smem,
        )


@functools.cache
def _build_cached(p: BlockPlan) -> BlockKernel:
    ptx = compile_ptx(
        read_source(), name=SOURCE.name, defines=p.defines(), arch=ARCH, header_dirs=HEADER_DIRS
    )
    if ptx_entries(ptx) != {ENTRY: p.n_inputs + len(OUTPUTS)}:
        raise KernelError(f"{SOURCE.name}: unexpected entries {ptx_entries(ptx)}")
    return BlockKernel(plan=p, ptx=ptx)


def build(d: int, ko: int, f: int, **options) -> BlockKernel:
    """Plans and compiles (NVRTC, disk-cached) the block kernel."""
    return _build_cached(plan(d, ko, f, **options))


def ptxas_report(p: BlockPlan) -> dict:
    """ptxas (offline, sm_90) on the plan's PTX: registers, spill bytes, static shared bytes."""
    return ptxas_of(read_source(), p.defines(), SOURCE.name)


# ----------------------------------------------------------------------------- the decode step


def why_not(x, out, lw, kernels: str) -> str:
    """Why the block kernel cannot stand in for the decoder's post-attention block here ("" if
    it can): one token of one row on the two-kernel ("split") path, W4A4 o / gate_up / down
    stacked over the layers with static input scales, and shapes the plan takes."""
    from rejax.ops.fused_linear import fusable

    if tuple(x.shape[:2]) != (1, 1):
        return f"rows x tokens {tuple(x.shape[:2])}: one token of one row only"
    if kernels != "two":
        return f"kernels={kernels!r}: the two-kernel path only"
    att, mlp = lw["self_attn"], lw["mlp"]
    linears = (att["o_proj"], mlp["gate_up_proj"], mlp["down_proj"])
    if not all(fusable(p, "nvfp4") and p.get("input_scale") is not None for p in linears):
        return "o, gate_up and down must be W4A4 with static input scales"
    ws = [p["weight"] for p in linears]
    if any(len(w.stack) != 1 for w in ws):
        return "weights stacked over the layers expected"
    if np.ndim(lw["post_attention_layernorm"]["scale"]) != 2:
        return "a stacked post-attention norm expected"
    d, ko = ws[0].shape
    if ws[1].shape != (2 * ws[2].shape[1], d) or ws[2].shape[0] != d:
        return f"shapes {[w.shape for w in ws]} are not a Qwen block's"
    try:
        plan(d, ko, ws[2].shape[1])
    except KernelError as err:
        return str(err)
    return ""


def block_call(kern: BlockKernel, x, out, lw, i):
    """x + the post-attention block of layer i on the CUDA path: o's input quantized by
    production's quantizer kernel (as fused_linear's two-kernel lowering does), or by the block
    kernel itself (a_bf16), then the block kernel. Returns [1, 1, D] bf16."""
    import jax
    import jax.numpy as jnp

    from cuda_ops import nvfp4_gemv, nvfp4_quant
    from rejax.ops import _dispatch
    from rejax.ops import fused_linear as fl

    p = kern.plan
    att, mlp = lw["self_attn"], lw["mlp"]
    wo, wgu, wd = (q["weight"] for q in (att["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]))
    layers = wo.stack[0]
    li = jnp.asarray(i, jnp.int32).reshape(())

    def stacked(scale):  # a static input scale as [L] (read at the layer in the kernels)
        return jnp.broadcast_to(jnp.asarray(scale, jnp.float32).reshape(-1), (layers,))

    a = out.astype(jnp.bfloat16).reshape(1, p.ko)
    xgo = stacked(att["o_proj"]["input_scale"])
    if p.a_bf16:  # the kernel quantizes o's input itself
        xq = (a.reshape(p.ko), xgo)
    else:  # production's quantizer kernel, as fused_linear's two-kernel lowering runs it
        fused = nvfp4_gemv.Fused(prologue="none", scale_stacked=True)
        quant = nvfp4_quant.build(1, p.ko, fused)
        xq = fl._quant_p.bind(a, xgo, jnp.zeros((1,), jnp.bfloat16), li, k=p.ko, fused=fused,
                              kernel=quant)  # fmt: skip

    def w3(w):
        scales = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
        return w.packed, scales, jnp.asarray(w.global_scale, jnp.float32)

    shapes = {"y2": (p.d, jnp.bfloat16), "y1": (p.d, jnp.bfloat16), "gp": (p.d // 2, jnp.uint8),
              "gs": (p.d // 16, jnp.uint8), "dp": (p.f // 2, jnp.uint8),
              "ds": (p.f // 16, jnp.uint8)}  # fmt: skip
    outs = [jax.ShapeDtypeStruct((shapes[k][0],), shapes[k][1]) for k in OUTPUTS]
    nw = jnp.asarray(lw["post_attention_layernorm"]["scale"], jnp.bfloat16)
    res = _dispatch.ptx_call(
        kern.backend_config(), outs, *xq, x.reshape(p.d), *w3(wo), nw,
        stacked(mlp["gate_up_proj"]["input_scale"]), *w3(wgu),
        stacked(mlp["down_proj"]["input_scale"]), *w3(wd), li,
    )  # fmt: skip
    return res[0].reshape(1, 1, p.d)


# what the installed decoder did each time it traced a post-attention block: "block" (the
# kernel where lowered for CUDA) or why not (bench_decode.py --block-tma records it)
TRACES: dict = {}


def install(**options):
    """Experiments only: makes the decoder's post-attention block (`rejax.decoder.
    _post_attention`: o + residual, then the feed-forward half) this kernel wherever `why_not`
    finds nothing against it, as `jax.lax.platform_dependent`: lowered for CUDA it is the
    block kernel (`options`: BlockPlan's fields), elsewhere production's composition, so the
    same program runs on the CPU as before. JAX keeps lowerings: install before the first
    compile (or call `jax.clear_caches()` after). Returns a function that restores production's
    block. Raises KernelError for options no plan can take."""
    import jax

    from cuda_ops.build import device_sms
    from rejax import decoder

    plan(*QWEN3_8B, **options)  # the options themselves are valid
    original = decoder._post_attention

    def post_attention(x, out, lw, i, cfg, o_kernels, kernels, gemm, prefetch):
        def reference(x, out, lw, i):
            return original(x, out, lw, i, cfg, o_kernels, kernels, gemm, prefetch)

        why = why_not(x, out, lw, kernels)
        if why:
            TRACES[why] = TRACES.get(why, 0) + 1
            return reference(x, out, lw, i)
        linears = (lw["self_attn"]["o_proj"], lw["mlp"]["gate_up_proj"], lw["mlp"]["down_proj"])
        wo, _, wd = (q["weight"] for q in linears)
        (d, ko), f = wo.shape, wd.shape[1]
        gw_rows = tuple(bool(q["weight"].per_row) for q in linears)
        try:
            kern = build(d, ko, f, sms=device_sms(), gw_rows=gw_rows, eps=cfg.rms_norm_eps,
                         **options)  # fmt: skip
        except KernelError as err:
            TRACES[f"build: {err}"] = TRACES.get(f"build: {err}", 0) + 1
            return reference(x, out, lw, i)
        TRACES["block"] = TRACES.get("block", 0) + 1
        return jax.lax.platform_dependent(
            x, out, lw, i, default=reference, cuda=lambda *a: block_call(kern, *a)
        )

    decoder._post_attention = post_attention

    def uninstall():
        decoder._post_attention = original

    return uninstall


OPTION_TYPES = {"kch": int, "stages": int, "ef": bool, "producer": str, "a_bf16": bool}


QKV_OPTION_TYPES = {"kch": int, "stages": int, "ef": bool, "producer": str}


def parse_options(text: str, types: dict | None = None) -> dict:
    """'stages=10,producer=lsu' -> BlockPlan keyword options (`types`: name -> type, default
    `OPTION_TYPES`; QKV_OPTION_TYPES for QkvPlan; 'default' or '': none). Raises ValueError
    naming the bad item."""
    return tma_parse_options(text, OPTION_TYPES if types is None else types)


# ----------------------------------------------------------------------------- pre-attention

QKV_ENTRY = "nvfp4_qkv_tma"
# (x, nw, xg, wp, ws, wg, layer, q_norm, k_norm, positions, index, inv_freq, k_cache, v_cache)
QKV_INPUTS = 14
QKV_OUTPUTS = ("q_out", "k_cache", "v_cache", "qkv", "gp", "gs")
QKV_ALIASES = {12: 1, 13: 2}  # the caches: operand -> result (written in place)
QWEN3_8B_ATTENTION = (4096, 32, 8, 128)  # (D, heads, kv heads, head_dim)


@dataclasses.dataclass(frozen=True)
class QkvPlan:
    """Compile-time geometry of the pre-attention kernel (the .cu's QKV_BLOCK entry): the
    input's RMSNorm and quantization, the qkv GEMV, and rope_cache's work, one row."""

    d: int
    heads: int
    kv_heads: int
    head_dim: int
    slots: int  # the cache's S
    qk_norm: bool = True  # Qwen3's q / k norms (Qwen2: none)
    index_rows: bool = False  # the write slot per row (index [B]) instead of one (index [1])
    kch: int = 1024
    stages: int = 6
    sms: int = DEFAULT_SMS
    producer: str = "tma"
    ef: bool = False
    gw_rows: bool = False  # qkv's global scales per row ([L, N]; a checkpoint's q, k, v shards)
    eps: float = 1e-6

    @property
    def n(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def grid(self) -> int:
        return min(self.sms, self.n // 16)

    @property
    def threads(self) -> int:
        return 32 * (WARPS + 1)

    @property
    def stage_bytes(self) -> int:
        return WARPS * (self.kch + self.kch // 8)

    @property
    def smem(self) -> int:
        return self.stages * self.stage_bytes + self.d + self.d // 16 + 16 * self.stages

    @property
    def weight_bytes(self) -> int:
        return self.n * self.d // 2 + self.n * self.d // 16

    def defines(self) -> dict:
        return {
            "QKV_BLOCK": 1,
            "D_MODEL": self.d,
            "N_HEADS": self.heads,
            "KV_HEADS": self.kv_heads,
            "HEAD_DIM": self.head_dim,
            "S_SLOTS": self.slots,
            "QK_NORM": int(self.qk_norm),
            "INDEX_ROWS": int(self.index_rows),
            "KCH": self.kch,
            "STAGES": self.stages,
            "GRID": self.grid,
            "PRODUCER": PRODUCERS.index(self.producer),
            "EF": int(self.ef),
            "GW_ROWS_O": int(self.gw_rows),
            "NORM_EPS": f"{float(self.eps)!r}f",
        }


def plan_qkv(d: int, heads: int, kv_heads: int, head_dim: int, slots: int, **options) -> QkvPlan:
    """The pre-attention plan (options: QkvPlan's fields; kch defaults to the largest multiple of
    128 up to 1024 dividing D / 2, stages to 6 or as many as fit). Raises KernelError."""
    if d <= 0 or d % 256:
        raise KernelError(f"nvfp4_qkv_tma: d={d}: a positive multiple of 256 expected")
    if head_dim <= 0 or head_dim % 32 or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise KernelError(
            f"nvfp4_qkv_tma: heads={heads}, kv_heads={kv_heads}, head_dim={head_dim}: head_dim "
            "a multiple of 32 and heads a multiple of kv_heads expected"
        )
    if slots < 1:
        raise KernelError(f"nvfp4_qkv_tma: slots={slots}: at least 1 expected")
    options.setdefault("kch", max(c for c in range(128, 1025, 128) if (d // 2) % c == 0))
    if "stages" not in options:
        p = QkvPlan(d, heads, kv_heads, head_dim, slots, **options, stages=1)
        room = (SMEM_LIMIT - STATIC_SMEM - p.smem) // (p.stage_bytes + 16)
        options["stages"] = max(2, min(6, room + 1))
    p = QkvPlan(d, heads, kv_heads, head_dim, slots, **options)
    kch = p.kch
    if kch <= 0 or kch % 128 or (d // 2) % kch:
        raise KernelError(f"nvfp4_qkv_tma: kch={kch}: a multiple of 128 dividing d / 2 expected")
    if p.producer not in PRODUCERS or (p.ef and p.producer != "tma"):
        raise KernelError(f"nvfp4_qkv_tma: producer={p.producer!r} / ef={p.ef}")
    if p.stages < 2 or p.smem + STATIC_SMEM > SMEM_LIMIT or p.sms < 1:
        raise KernelError(f"nvfp4_qkv_tma: stages={p.stages}, sms={p.sms} do not fit")
    return p


@dataclasses.dataclass(frozen=True, eq=False)
class QkvKernel:
    plan: QkvPlan
    ptx: str
    entry: str = QKV_ENTRY

    def backend_config(self) -> str:
        p = self.plan
        return ptx_backend_config(
            QKV_ENTRY,
            escape_mlir(self.ptx),
            grid=(p.grid, 1, 1),
            block=p.threads,
            outputs=range(QKV_INPUTS, QKV_INPUTS + len(QKV_OUTPUTS)),
            smem=p.smem,
        )


@functools.cache
def _build_qkv_cached(p: QkvPlan) -> QkvKernel:
    ptx = compile_ptx(
        read_source(), name=SOURCE.name, defines=p.defines(), arch=ARCH, header_dirs=HEADER_DIRS
    )
    if ptx_entries(ptx) != {QKV_ENTRY: QKV_INPUTS + len(QKV_OUTPUTS)}:
        raise KernelError(f"{SOURCE.name}: unexpected entries {ptx_entries(ptx)}")
    return QkvKernel(plan=p, ptx=ptx)


def build_qkv(d: int, heads: int, kv_heads: int, head_dim: int, slots: int, **options):
    """Plans and compiles (NVRTC, disk-cached) the pre-attention kernel."""
    return _build_qkv_cached(plan_qkv(d, heads, kv_heads, head_dim, slots, **options))


def ptxas_report_qkv(p: QkvPlan) -> dict:
    return ptxas_of(read_source(), p.defines(), SOURCE.name)


def why_not_qkv(x, lw, cfg, positions, index, kv, kernels: str) -> str:
    """Why the pre-attention kernel cannot stand in for the decoder's qkv projection and
    rope_cache here ("" if it can): one token of one row on the two-kernel path, a W4A4 qkv
    stacked over the layers with a static input scale, a bf16 cache, shapes the plan takes."""
    from rejax.ops.fused_linear import fusable

    if tuple(x.shape[:2]) != (1, 1):
        return f"rows x tokens {tuple(x.shape[:2])}: one token of one row only"
    if kernels != "two":
        return f"kernels={kernels!r}: the two-kernel path only"
    p = lw["self_attn"]["qkv_proj"]
    if not (fusable(p, "nvfp4") and p.get("input_scale") is not None):
        return "qkv must be W4A4 with a static input scale"
    if len(p["weight"].stack) != 1 or np.ndim(lw["input_layernorm"]["scale"]) != 2:
        return "stacked weights and input norm expected"
    if np.dtype(kv[0].dtype) != np.dtype("bfloat16") or np.ndim(index) > 1:
        return "a bf16 cache and one write index expected"
    try:
        plan_qkv(x.shape[-1], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv[0].shape[2])
    except KernelError as err:
        return str(err)
    if p["weight"].shape != ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, x.shape[-1]):
        return f"qkv shape {p['weight'].shape} is not the config's"
    return ""


def qkv_call(kern: QkvKernel, x, lw, i, cfg, positions, index, kv):
    """q [1, 1, N, H] and the cache with this token's k, v written, on the CUDA path: the
    pre-attention kernel."""
    import jax
    import jax.numpy as jnp

    from rejax import layers
    from rejax.ops import _dispatch

    p = kern.plan
    att = lw["self_attn"]
    w = att["qkv_proj"]["weight"]
    layers_n = w.stack[0]
    li = jnp.asarray(i, jnp.int32).reshape(())
    xg = jnp.broadcast_to(jnp.asarray(att["qkv_proj"]["input_scale"], jnp.float32).reshape(-1),
                          (layers_n,))  # fmt: skip
    dummy = jnp.zeros((1, p.head_dim), jnp.bfloat16)
    qn = att["q_norm"]["scale"] if p.qk_norm else dummy
    kn = att["k_norm"]["scale"] if p.qk_norm else dummy
    outs = [jax.ShapeDtypeStruct((p.heads * p.head_dim,), jnp.bfloat16),
            jax.ShapeDtypeStruct(kv[0].shape, kv[0].dtype),
            jax.ShapeDtypeStruct(kv[1].shape, kv[1].dtype),
            jax.ShapeDtypeStruct((p.n,), jnp.bfloat16),
            jax.ShapeDtypeStruct((p.d // 2,), jnp.uint8),
            jax.ShapeDtypeStruct((p.d // 16,), jnp.uint8)]  # fmt: skip
    res = _dispatch.ptx_call(
        kern.backend_config(), outs, x.reshape(p.d),
        jnp.asarray(lw["input_layernorm"]["scale"], jnp.bfloat16), xg, w.packed,
        jax.lax.bitcast_convert_type(w.scales, jnp.uint8), jnp.asarray(w.global_scale, jnp.float32),
        li, jnp.asarray(qn, jnp.bfloat16), jnp.asarray(kn, jnp.bfloat16),
        jnp.asarray(positions[:, 0], jnp.int32), jnp.asarray(index, jnp.int32).reshape(-1),
        layers.rope_inv_freq(p.head_dim, cfg.rope_theta), kv[0], kv[1], aliases=QKV_ALIASES,
    )  # fmt: skip
    q = res[0].reshape(1, 1, p.heads, p.head_dim)
    return q, (res[1], res[2], None, None)


def install_qkv(**options):
    """Experiments only: as `install`, for the decoder's qkv projection and rope_cache
    (`rejax.decoder._pre_attention`): lowered for CUDA, one launch of the pre-attention kernel
    (`options`: QkvPlan's fields) where `why_not_qkv` finds nothing against it; elsewhere
    production's. Returns a function that restores production's. Raises KernelError for
    options no plan can take."""
    import jax

    from cuda_ops.build import device_sms
    from rejax import decoder

    plan_qkv(*QWEN3_8B_ATTENTION, 1536, **options)  # the options themselves are valid
    original = decoder._pre_attention

    def pre_attention(x, lw, i, cfg, positions, index, kv, kernels, gemm, prefetch):
        def reference(x, lw, i, positions, index, kv):
            return original(x, lw, i, cfg, positions, index, kv, kernels, gemm, prefetch)

        why = why_not_qkv(x, lw, cfg, positions, index, kv, kernels)
        if not why:
            w = lw["self_attn"]["qkv_proj"]["weight"]
            try:
                kern = build_qkv(
                    x.shape[-1], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                    kv[0].shape[2], qk_norm=cfg.arch == "qwen3", index_rows=np.ndim(index) == 1,
                    sms=device_sms(), gw_rows=bool(w.per_row), eps=cfg.rms_norm_eps, **options,
                )  # fmt: skip
            except KernelError as err:
                why = f"build: {err}"
        if why:
            TRACES[f"qkv: {why}"] = TRACES.get(f"qkv: {why}", 0) + 1
            return reference(x, lw, i, positions, index, kv)
        TRACES["qkv"] = TRACES.get("qkv", 0) + 1
        return jax.lax.platform_dependent(
            x, lw, i, positions, index, kv, default=reference,
            cuda=lambda x, lw, i, positions, index, kv: qkv_call(
                kern, x, lw, i, cfg, positions, index, kv),
        )  # fmt: skip

    decoder._pre_attention = pre_attention

    def uninstall():
        decoder._pre_attention = original

    return uninstall
