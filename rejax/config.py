"""Model configuration: one frozen, hashable Config passed to jit as a static argument.

Dimension legend (used in einsum strings and shape comments across rejax/):
    B  batch (rows decoded together)        T  new tokens in this call
    S  KV-cache length                      D  model width (hidden_size)
    N  query heads                          K  key/value heads
    G  query heads per kv head (N // K)     H  head dim
    F  feed-forward width                   V  vocabulary size
Only kernels.py and cuda_ops/ use GEMM letters instead (M rows of x, N out features, K in
features), and say so at the top of each file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# Hugging Face `model_type` -> rejax architecture name.
ARCHITECTURES = {"qwen3": "qwen3", "qwen2": "qwen2"}
# Linear quantization modes: None keeps bf16 linears.
QUANT_MODES = (None, "nvfp4", "nvfp4-w4a16")
# How the decoder runs its layers: "scan" (one lax.scan over the stacked weights: compile time
# independent of depth; every decoder linear NVFP4), "unroll" (a Python loop), or "auto" (scan
# when every decoder linear is NVFP4, whose kernel reads the stack in place; unroll when float
# linears are present, which hold one buffer per layer: see rejax/params.py).
LAYER_LOOPS = ("auto", "scan", "unroll")
# Attention over the cache: "einsum" (masked attention over every cache slot, the reference) or
# "live" (rejax.ops.decode_attention: decode steps read only the slots written so far, a Pallas
# kernel on CUDA; prompts use its flash-style prefill_attention). "live" is the default: it reads
# each layer's cache in place, where "einsum" slices the layer out of the stacked cache (a copy
# per layer and step). 36-layer Qwen3-8B on the H200, one run: NVFP4 3.018 vs 3.138 ms/token at
# batch 1 and 5.256 vs 6.063 at batch 8; bf16 at batch 8 4.77 (live) against 5.42 (einsum, an
# earlier call of the same session) (experiments/results/h200_d/).
# "flash" is "live" with the one-launch CUDA decode kernel (cuda_ops/decode_attention.cu: the
# splits combined in the same launch) instead of the two-launch Pallas kernel for decode steps
# over a bf16 cache; prompts, the fp8 cache and every platform other than CUDA run exactly what
# "live" runs. Opt-in: its GPU tests pass (tests/test_decode_attention_cuda_gpu.py), but it
# measured slower than the Pallas kernel (kernel alone, batch 1, S = 33,280: 34 vs 23 us at 8K
# live slots, 78 vs 46 us at 32K; 36-layer NVFP4 decode 2.772 vs 2.574 ms/token at batch 1;
# experiments/results/h200_e/).
# "flash-mma" is "flash" with the kernel's tensor-core main loop (FlashOptions(mma=1, warps=8):
# bf16 mma.sync over cp.async stages; within rounding of "flash", not bitwise). Kernel alone on
# the H200 it streamed at the copy rate from 8K to 32K and ties Pallas at 8K (15.2-15.5 us at
# batch 1; experiments/results/h200_q/). Opt-in: end to end (36-layer Qwen3-8B NVFP4, with
# attention_output "nvfp4", 1024 new tokens, one run) it ties "live" at batch 1 (2.479 vs 2.486
# ms/token) and loses at batch 8 (4.256 vs 4.084; experiments/results/h200_w/).
ATTENTIONS = ("einsum", "live", "flash", "flash-mma")
# the CUDA decode kernel's launch choices under each attention that takes it
FLASH_ATTENTIONS = {"flash": {}, "flash-mma": {"mma": 1, "warps": 8}}
# W4A4 decoder linears: "unfused" (rejax.layers.linear after separate XLA norm / quantize /
# SwiGLU / add ops), "fused" (rejax.ops.fused_linear: those in the GEMV's launch on CUDA;
# bitwise the unfused composition elsewhere) or "split" (rejax.ops.fused_linear with two
# launches on CUDA: the prologue and quantizer once in a kernel of their own, then the plain
# GEMV or GEMM; the residual add after o and down is an XLA op, or with residual_fusion "fused"
# the linear's epilogue). "split" is the default: with its quantizer spread over the grid it
# measured 2.796 vs 3.018 ms/token for "unfused" at batch 1 and 4.883 vs
# 5.256 at batch 8 (36-layer Qwen3-8B, attention "live", one run; experiments/results/h200_d/).
# Elsewhere than CUDA all three are the same composition, bitwise. "fused" is opt-in: it measured
# slower (8-layer Qwen3-8B, batch 1: 0.992 vs 0.957 ms/token; batch 8: 2.29 vs 1.66), because
# every CTA redoes the prologue for all of x (experiments/DECODE_NOTES.md).
# "mixed" is "split" with o_proj as "fused" (its input has no norm in front, so each CTA only
# quantizes the 4096 attention outputs: one quantizer launch fewer per layer); opt-in. 36-layer
# Qwen3-8B NVFP4, batch 1, one process, adjacent triplets twice: split 2.456 / 2.460, mixed
# 2.598 / 2.601, fused 2.864 / 2.867 ms/token: a CTA's own quantizing prologue costs more than
# the grid-wide quantizer launch and its gap (experiments/results/h200_t/).
LINEAR_FUSIONS = ("fused", "split", "unfused", "mixed")
# How a decode step's attention hands its output to o_proj (W4A4 NVFP4 decoders): "bf16" (the
# attention writes bf16, o_proj's quantizer then writes its NVFP4 input) or "nvfp4" (the
# attention writes o_proj's NVFP4 input itself: rejax.ops.decode_attention.decode_attention_nvfp4,
# then rejax.ops.fused_linear.linear_from_codes). "nvfp4" applies where the one-launch CUDA
# kernel runs (attention "flash" / "flash-mma", a bf16 cache, one new token per row), on the
# "split" path, with a static o_proj input scale, at batches the plain W4A4 GEMV serves (below
# gemm_min_m); elsewhere it is "bf16". On CUDA the kernel's QUANT_OUT build stores the codes,
# block scales and global scale instead of bf16: one launch fewer a layer (the o_proj
# quantizer). The bytes are quantize_activation's of the bf16 output, so the decoder is the same
# composition; elsewhere than CUDA bitwise "bf16". Opt-in like "flash-mma": its GPU tests pass;
# with it "flash-mma" measured 2.479 vs 2.486 ms/token for "live" at batch 1 and 4.256 vs 4.084
# at batch 8 (36-layer Qwen3-8B, one run; experiments/results/h200_w/).
ATTENTION_OUTPUTS = ("bf16", "nvfp4")
# How gate_up_proj hands its output to down_proj (W4A4 NVFP4 decoders, the "split" path): "bf16"
# (gate_up writes [gate | up] in bf16, down's quantizer applies SwiGLU and writes its NVFP4
# input) or "nvfp4" (rejax.ops.fused_linear.fused_linear_swiglu: on CUDA the gate_up GEMV's
# epilogue applies SwiGLU and writes down's NVFP4 input, each CTA owning the gate and up rows
# of whole 16-element blocks; then rejax.ops.fused_linear.linear_from_codes). It applies with a
# static down_proj input scale at the GEMV's rows (below gemm_min_m); elsewhere it is "bf16".
# One launch fewer a layer on CUDA (down's quantizer), the same bytes (the quantizer kernel's
# SwiGLU arithmetic); elsewhere than CUDA bitwise "bf16". "nvfp4" is the default: its GPU tests
# pass (bytes equal to the "bf16" path's at Qwen3-8B's gate_up for M = 1..8, the decoder's
# logits bitwise) and it measured 2.461 vs 2.486 ms/token at batch 1 (36-layer Qwen3-8B, 1024
# new tokens, one run, repeats within 0.2%); at batch 8 the GEMM's rows, where it does not
# apply (experiments/results/h200_w/).
GATE_UP_OUTPUTS = ("bf16", "nvfp4")
# How a linear hands the next one its output on the dot path (W4A4 NVFP4 decoders, prefill
# rows above gemm_max_m outside the wgmma range, gemm_dot_dequant and gemm_dot_x "kernel"):
# "split" (XLA scales each dot's float32 sum by the global scales, rounds it to bf16 and adds
# the residual; the next quantizer kernel reads that), "swiglu" (rejax.ops.dot_block.mlp_dot:
# down's SwiGLU quantizer kernel reads gate_up's float32 sum and forms the same bf16 values
# itself, so one fusion over [M, 2F] and its bf16 round trip go) or "block"
# (rejax.ops.dot_block.post_attention_dot: also gate_up's RMSNorm quantizer on o_proj's sum and
# the residual, storing the residual stream). The same bytes on CUDA (GPU-tested), bitwise
# "split" elsewhere. "block" is the default: 36-layer 512-token prefill at batch 8 (4096 rows)
# 146.9 / 147.4 ms against 152.4 / 152.6 for "split" and 147.5 / 147.8 for "swiglu" (bf16
# 133.7; one process, two rounds, H100; experiments/results/dot_finish_h100_s44/).
GEMM_DOT_FINISHES = ("split", "swiglu", "block")
# How o_proj hands gate_up its input (W4A4 NVFP4 decoders, decode steps): "bf16" (o_proj's
# GEMV writes the residual stream y, gate_up's quantizer then applies post_attention_layernorm
# and writes gate_up's NVFP4 input) or "nvfp4" (rejax.ops.fused_linear.linear_norm_out: on CUDA
# the last CTA of o_proj's GEMV to finish reads y back and writes that input itself, with the
# quantizer kernel's arithmetic and summation order; then gate_up runs on the codes,
# linear_swiglu_from_codes / linear_from_codes). It applies where attention_output "nvfp4"
# does, with residual_fusion "fused", a static gate_up input scale and no weight_prefetch;
# elsewhere it is "bf16". One launch fewer a layer on CUDA (gate_up's quantizer: with
# attention "flash-mma" and the other two outputs "nvfp4", 7 launches a layer), the same bytes;
# elsewhere than CUDA bitwise "bf16". Opt-in: its GPU tests pass, but it measured slower, 2.589
# vs 2.479 ms/token at batch 1 under "flash-mma" (36-layer Qwen3-8B, one run): the last CTA's
# read-back and quantization after the others costs more than the launch it saves
# (experiments/results/h200_w/).
O_PROJ_OUTPUTS = ("bf16", "nvfp4")
# KV-cache storage: "bf16" (the activation dtype) or "fp8" (E4M3 codes with one float32 scale per
# slot and kv head, written beside the cache: half the bytes a decode step reads; rejax/cache.py).
# Opt-in: it moves logits (experiments/results/fp8_kv_cache.md).
KV_DTYPES = ("bf16", "fp8")
# A decode step's attention prologue (one new token per row, bf16 cache): "fused"
# (rejax.ops.rope_cache: Qwen3's q/k norms, RoPE and the cache write as one kernel on CUDA, the
# cache updated in place) or "unfused" (the same composition as separate XLA ops: about seven
# launches per layer). Elsewhere than CUDA both are the same composition, bitwise. "fused" is
# the default: its GPU tests pass (tests/test_rope_cache_gpu.py) and, with residual_fusion
# "fused", it measured 2.574 vs 2.729 ms/token at batch 1 (36-layer Qwen3-8B NVFP4) and 1.371 vs
# 1.451 at batch 8 (8 layers, the profile), one session (experiments/results/h200_e/).
ROPE_FUSIONS = ("fused", "unfused")
# The residual adds after o_proj and down_proj on the "split" path: "fused" (the W4A4 GEMV or
# GEMM adds the residual in its epilogue, -DEPI_RES=1: the same bf16 add, two launches fewer per
# layer on CUDA) or "unfused" (an XLA add after the linear). "fused" is the default: its GPU
# tests pass, bitwise against the XLA add (tests/test_quant_kernel_gpu.py,
# tests/test_gemm_gpu.py); measured with rope_fusion above. Elsewhere than CUDA both are the same
# composition, bitwise.
RESIDUAL_FUSIONS = ("fused", "unfused")
# How the NVFP4 GEMM's plan fills the GPU at decode batches (M <= 64), GemmOptions.occupancy
# (cuda_ops.nvfp4_gemm.OCCUPANCIES): "wide" (64-row weight tiles up to M = 16, a K split aimed at
# four CTAs per SM) was the default from the eighth session: faster kernel alone
# (experiments/results/h200_e/), and the 36-layer NVFP4 decode at batch 8 measured 4.428 against
# 4.674 ms/token for "base" (about two CTAs per SM) (experiments/results/h200_f/).
# "fill", the default from the eighteenth to the thirty-fifth session, balances the grid over
# the SMs: the K split of a balance model, then the deepest pipeline that keeps each SM's CTAs
# resident (9-64 rows; "wide" below): 36 layers NVFP4, 4.259 / 7.118 ms/token at batch 16 / 64
# against 4.669 / 7.520 for "wide" (experiments/results/h200_p/). "fill16", the default since the thirty-sixth
# session, plans fewer than 16 rows (batch 8) as 16 ("fill" from 16 rows on): inside the decode
# step on an H100 the 8-row GEMMs were slower than the 16-row ones
# (experiments/results/h100_s34/), and the 36-layer decode at batch 8 measured 3.733 against
# 4.341 ms/token for "fill" (experiments/results/fill16_prefill_h100/).
GEMM_OCCUPANCIES = ("base", "wide", "fill", "fill16")
GEMM_DOT_DEQUANTS = ("xla", "kernel")  # Config.gemm_dot_dequant (GemmOptions.dot_dequant)
GEMM_DOT_XS = ("fused", "materialized", "kernel")  # Config.gemm_dot_x (GemmOptions.dot_x)
GEMM_DOT_STREAMS = ("main", "side")  # Config.gemm_dot_stream (GemmOptions.dot_stream)
GEMM_WGMMA_TMS = ("128", "256", "auto")  # Config.gemm_wgmma_tm (GemmOptions.wgmma_tm)
# How a K-split NVFP4 GEMM adds its partial sums (GemmOptions.reduce, cuda_ops.nvfp4_gemm.REDUCES):
# "finish" (float32 partials in a workspace, a second small kernel adds them in split order) or
# "cluster" (the split's CTAs form a thread-block cluster and add through distributed shared
# memory: one launch per linear). Kernel alone "cluster" measured slower (1.66x against 1.93x
# bf16 at M = 8, experiments/results/h200_e/), and in the 36-layer decode loop too (4.449 /
# 5.890 / 11.223 vs 4.410 / 5.783 / 9.573 ms/token at batch 8 / 16 / 64, h200_g/), so "finish"
# stays the default.
GEMM_REDUCES = ("finish", "cluster")
# How the GEMM writes a stage's global -> shared copies (cuda_ops.nvfp4_gemm.COPIES): "auto"
# (static, unrolled copies from 16-token tiles on: kernel alone 1.06-1.09x faster at M = 16 / 32
# / 64 on an H100, loops at M = 8), "loop" or "static".
GEMM_COPIES = ("auto", "loop", "static")
# How a decode step's linears chain on the GEMM's rows (W4A4, the fused linears, one token a
# row): "split" (each linear's launches: quantizer, GEMM, split-K finish) or "fused" (each
# K-split GEMM's finish inside the next kernel: the next linear's quantizer (down_proj's: the
# next layer's qkv quantizer, its x_hat handed along the layer loop), or for qkv the rope
# kernel; the same bytes: rejax.ops.fused_block and rejax.decoder.cross_layer_chain; 4 launches
# a layer fewer at 32-64 rows with Qwen3-8B's shapes, 3 at 16) or "swiglu_rope" (only the
# chains into kernels without a row statistic: qkv's finish in the rope kernel, gate_up's in
# down's SwiGLU quantizer; the default). Measured on the H100, 36 layers, in one run each
# (experiments/results/h100_chain/): "swiglu_rope" 4.072 / 8.219 ms/token at batch 16 / 64
# against "split" 4.119 / 8.399; "fused" is slower than "split" (4.409 / 8.692 against 4.136 /
# 8.381): its RMSNorm finish-quantizers hold a row to one CTA or reread it. "cluster" is
# "fused" with those as thread-block clusters of 2-8 CTAs a row (each partial read once, the
# row statistic through distributed shared memory; rejax.ops.fused_block.cluster_chunk): not
# yet measured.
GEMM_CHAINS = ("split", "fused", "swiglu_rope", "cluster")
# How the NVFP4 linears quantize their activations for the tensor-core GEMM (decode batches of 8+
# rows): "xla" (XLA ops build the GEMM's operand) or "kernel" (the quantizer kernel writes it;
# the default, faster on the H200): cuda_ops.nvfp4_gemm.X_QUANTS.
GEMM_X_QUANTS = ("xla", "kernel")
# How a fused linear in front of the wgmma GEMM (prefill) builds its x_hat stage tiles: "xla"
# (XLA's quantizer and layout ops) or "kernel" (the quantizer kernel's "xhat_tiles" form; the
# default, faster on the H100): cuda_ops.nvfp4_gemm.WGMMA_X_QUANTS.
GEMM_WGMMA_X_QUANTS = ("xla", "kernel")
# What XLA captures into CUDA command buffers (graphs) in the jitted decode loop
# (rejax.decode.decode_loop; XLA's per-executable compiler options, never a global flag):
# "default" (XLA's own choice: fusions, cuBLAS, custom calls, dynamic-slice fusions,
# conditionals; the loop's while runs from the host, which reads its condition back every step),
# "while" (the same types and WHILE, so the decode loop and the layer scan inside it can run as
# one graph with device-side control flow; XLA converts a while loop only if every thunk in its
# body converts), "while_unroll" ("while", and XLA unrolls loops of known trip count, the layer
# scan, inside the graph: `xla_gpu_command_buffer_unroll_loops`) and "listed" (the control: the
# default types as an explicit list, without WHILE).
# The +WHILE flag measured 1.059 -> 1.025 ms/token at 8 layers NVFP4 batch 1 (commit 112b486).
# A "while" whose list lacked DYNAMIC_SLICE_FUSION lost on the ninth session's decoder (36 layers
# NVFP4: 2.671 vs 2.559 ms/token at batch 1, 4.769 vs 4.422 at batch 8): without that type no
# while loop whose body holds such a fusion can convert. The list now has it.
COMMAND_BUFFERS = ("default", "while", "while_unroll", "listed")
# XLA's default command-buffer types in jax 0.10-0.12 (a list replaces XLA's default list rather
# than adding to it: compiler options take no "+WHILE" form).
_DEFAULT_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL"
# The compiler options each choice sets (None: none).
COMMAND_BUFFER_OPTIONS = {
    "default": None,
    "while": {"xla_gpu_enable_command_buffer": _DEFAULT_TYPES + ",WHILE"},
    "while_unroll": {
        "xla_gpu_enable_command_buffer": _DEFAULT_TYPES + ",WHILE",
        "xla_gpu_command_buffer_unroll_loops": True,
    },
    "listed": {"xla_gpu_enable_command_buffer": _DEFAULT_TYPES},
}
# What Config.xla_autotune=False adds to every program's compiler options: no timed choice of
# matmul algorithms, and cuBLAS for every float matmul (cuBLAS's heuristic picks one algorithm
# per shape without timing). Autotuning off alone leaves XLA's Triton GEMM fusions on their
# default tiling: on the H200 the bf16 lm_head ([64, 4096] x [4096, 151936]) took 4.80 ms
# instead of 0.49 ms, and those fusions rounded rows differently at 32 rows than at 64. cuBLAS
# without autotuning took 0.51 ms and gave every row the same bits at 8, 16, 32 and 64 rows
# (experiments/xla_autotune_probe.py).
NO_AUTOTUNE_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def compiler_options(cfg: Config, command_buffers: dict | None = None) -> dict | None:
    """The per-program XLA compiler options a config asks for (None: none): its
    `command_buffer`'s types (from `command_buffers`, default COMMAND_BUFFER_OPTIONS) and, with
    `xla_autotune=False`, NO_AUTOTUNE_OPTIONS."""
    table = COMMAND_BUFFER_OPTIONS if command_buffers is None else command_buffers
    opts = dict(table[cfg.command_buffer] or {})
    if not cfg.xla_autotune:
        opts.update(NO_AUTOTUNE_OPTIONS)
    return opts or None


# L2 prefetch of the weights that run next, issued by the W4A4 GEMV of the "split" linears
# (cuda_ops.nvfp4_gemv.Prefetch; decode batches below gemm_min_m rows): "none" (the default), or
# "next" optionally followed by ":key=value,..." choices:
#   at=end|start       when each CTA issues them (after its main loop, or at its start)
#   mode=line|last|bulk  prefetch.global.L2 per line, the same with evict_last, or the copy
#                      engine's cp.async.bulk.prefetch.L2
#   ef=0|1             the GEMV's own weight loads as L2 evict_first
#   o=F  gu=F  down=F  qkv=F  qkv_gu=F   the leading fraction of each row (0 = none, 1 = all) of
#                      o_proj (prefetched by qkv's GEMV), gate_up (by o's), down (by gate_up's),
#                      the next layer's qkv (by down's) and gate_up (by qkv's, a second target)
# Prefetches are hints: the numbers are unchanged on every path. Opt-in: on the H200 every
# variant measured slower (36 layers NVFP4, batch 1: 2.692 ms/token at the end of each CTA's
# loop, 2.905 at its start, 6.078 with bulk prefetches, against 2.553 without;
# experiments/results/h200_h/).
WEIGHT_PREFETCH_DEFAULTS = {
    "at": "end", "mode": "line", "ef": 0, "o": 1.0, "gu": 0.5, "down": 1.0, "qkv": 1.0,
    "qkv_gu": 0.0,
}  # fmt: skip
_PREFETCH_CHOICES = {"at": ("end", "start"), "mode": ("line", "last", "bulk"), "ef": (0, 1)}


def weight_prefetch_policy(spec: str) -> dict | None:
    """The choices of a `Config.weight_prefetch` spec ("none" -> None), with defaults filled in;
    raises ValueError naming the bad part of the spec."""
    if not isinstance(spec, str):
        raise ValueError(f"weight_prefetch must be a str, got {spec!r}")  # noqa: TRY004
    if spec == "none":
        return None
    head, _, rest = spec.partition(":")
    if head != "next":
        raise ValueError(
            f"weight_prefetch={spec!r}: expected 'none' or 'next[:key=value,...]' with keys "
            f"{sorted(WEIGHT_PREFETCH_DEFAULTS)}"
        )
    policy = dict(WEIGHT_PREFETCH_DEFAULTS)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in policy:
            raise ValueError(
                f"weight_prefetch={spec!r}: bad item {item!r}, expected key=value with keys "
                f"{sorted(WEIGHT_PREFETCH_DEFAULTS)}"
            )
        if key in ("at", "mode"):
            parsed: Any = value
        else:
            try:
                parsed = int(value) if key == "ef" else float(value)
            except ValueError:
                parsed = None
        choices = _PREFETCH_CHOICES.get(key)
        ok = parsed in choices if choices else parsed is not None and 0.0 <= parsed <= 1.0
        if not ok:
            want = choices if choices else "a fraction in [0, 1]"
            raise ValueError(f"weight_prefetch={spec!r}: {key}={value!r}, expected {want}")
        policy[key] = parsed
    return policy


@dataclasses.dataclass(frozen=True)
class Config:
    """Static description of a Qwen2/Qwen3 decoder.

    `quant` selects the linear format: None (bf16), "nvfp4" (W4A4: NVFP4 weights and
    activations) or "nvfp4-w4a16" (NVFP4 weights, bf16 activations). Embeddings, norms and
    lm_head stay bf16 in every mode (`rejax.params.quantize_head` makes the head NVFP4 W4A16,
    opt-in: the decoder reads the head by its weight's type).
    """

    arch: str = "qwen3"
    vocab_size: int = 256  # V
    hidden_size: int = 64  # D
    intermediate_size: int = 128  # F
    num_layers: int = 2
    num_heads: int = 4  # N
    num_kv_heads: int = 2  # K
    head_dim: int = 16  # H
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2)
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quant: str | None = None
    layer_loop: str = "auto"
    # Layers per iteration of the "scan" layer loop (lax.scan's unroll): each iteration of the
    # scan costs the GPU a few microseconds between layers (the loop's counter and copies, and
    # the launch of the next iteration's command buffer: 4.3 us of idle per iteration on the
    # H200), which k layers per iteration pay L / k times instead of L; the body is compiled k
    # times. 36-layer Qwen3-8B NVFP4 at batch 1, one process: 2.583 / 2.559 / 2.517 ms/token at
    # k = 1 / 2 / 4 (experiments/results/h200_m/), so 4 is the default. The same numbers at any k.
    scan_unroll: int = 4
    # Decode steps per check of the decode loop's predicate (rejax.decode.decode_loop). The
    # loop's while loop is driven by the host: once per iteration it copies the predicate back
    # and waits, so the GPU drains and then idles while the host launches the next iteration's
    # graphs. k steps per iteration run as an inner loop of known trip count (no copy) and
    # check once. 36-layer Qwen3-8B NVFP4, batch 1, kernel timeline: 99 against 238 us of GPU
    # idle per step for k = 8 / 1; timed without the profiler in one process, k = 8 was at most
    # 3 us slower (greedy -21 .. +3 us a step, Temperature + top-p -103 .. -2, batch 64 ReSET -46;
    # experiments/results/h200_s/). Up to k - 1 steps past the last row's stop run masked (their
    # tokens are dropped): a batch that ends on stop tokens pays (k - 1) / 2 steps on average, a
    # cost that only short generations notice (0.35% of a 1000-step loop at k = 8). The same
    # tokens at any k. The largest k' <= k that divides max_new_tokens is used.
    decode_unroll: int = 8
    attention: str = "live"
    linear_fusion: str = "split"
    attention_output: str = "bf16"
    gate_up_output: str = "nvfp4"
    o_proj_output: str = "bf16"
    kv_dtype: str = "bf16"
    rope_fusion: str = "fused"
    residual_fusion: str = "fused"
    # NVFP4 W4A4 linears with at least this many rows (tokens) take the tensor-core GEMM on CUDA,
    # fewer take the GEMV (cuda_ops.nvfp4_gemm.GemmOptions.min_m; the measured crossover)
    gemm_min_m: int = 8
    gemm_occupancy: str = "fill16"
    # ... and at most this many rows (None: no bound); more (prefill) take the dot reference,
    # the weight dequantized for one bf16 dot, measured faster there (GemmOptions.max_m),
    # unless they are in the wgmma range below, which is tried first
    gemm_max_m: int | None = 256
    # NVFP4 W4A4 linears of gemm_wgmma_min_m .. gemm_wgmma_max_m rows (prefill, decode batches
    # of 128+) take the warpgroup-MMA GEMM on CUDA (cuda_ops.nvfp4_gemm_wgmma: 128-token tiles,
    # each weight decoded once per tile, the stage copies on mbarriers; sm_90, elsewhere the
    # GEMM and the dot as before) before the GEMM and the dot (GemmOptions.wgmma_min_m /
    # wgmma_max_m). Kernel alone on an H100 it is 1.95x the GEMM at 128 rows and faster than
    # the dot path up to 2048 (experiments/results/wgmma_bulk_h100/). min None: never; max
    # None: no bound. With invariant_rows set, "default" leaves it off (the GEMM's summation
    # order would change at min rows).
    gemm_wgmma_min_m: int | None | str = "default"
    gemm_wgmma_max_m: int | None | str = "default"
    # How the dot path (above gemm_max_m rows) decodes the weights to bf16: "kernel"
    # (cuda_ops.nvfp4_dequant, one launch a weight; the same bytes; 36-layer 512-token prefill
    # 29.6 against 31.2 ms at batch 1 on an H100, experiments/results/dequant_h100/) or "xla"
    # (XLA's fusions) (GemmOptions.dot_dequant)
    gemm_dot_dequant: str = "kernel"
    # ... and how that dot takes the activations' bf16 values: "kernel" (the fused linears'
    # quantizer kernel writes them; 36-layer 512-token prefill at batch 8 154.7 against
    # 163.7 ms for "fused" on an H100, experiments/results/dot_x_h100/), "fused" (XLA may fuse
    # their decode into its GEMM) or "materialized" (an optimization barrier in front of the
    # dot: 164.0 ms) (GemmOptions.dot_x)
    gemm_dot_x: str = "kernel"
    # ... and where its dequantizer kernel runs: "main" (the compute stream, right before its
    # dot) or "side" (XLA's stream 1, so that it may run beside an earlier dot; the same bytes).
    # "side" measured slower: with JAX 0.11.2 XLA runs it on the main stream (no async pair),
    # batch-8 prefill 153.8 against 152.3 ms (H100, experiments/results/dot_finish_h100_s44/)
    # (GemmOptions.dot_stream)
    gemm_dot_stream: str = "main"
    gemm_dot_finish: str = "block"
    gemm_reduce: str = "finish"
    gemm_copies: str = "auto"
    gemm_chain: str = "swiglu_rope"
    # how a fused linear in front of the GEMM quantizes its activations: "kernel" (the
    # quantizer kernel writes the GEMM's fp16 operand; 8-layer decode at batch 64 2.112 against
    # 2.346 ms/token for "xla", experiments/results/h200_m/) or "xla" (XLA fusions build it)
    gemm_x_quant: str = "kernel"
    # ... and in front of the wgmma GEMM (gemm_wgmma_min_m .. max_m rows): "kernel" (the
    # quantizer kernel writes the stage tiles; 36-layer prefill of 512 tokens 24.3 against
    # 26.2 ms at batch 1 on an H100, experiments/results/xquant_tiles_h100/) or "xla" (XLA's
    # quantizer, wgmma_x_operand and to_stage_tiles fusions) (GemmOptions.wgmma_x_quant)
    gemm_wgmma_x_quant: str = "kernel"
    # the wgmma GEMM's token tile: "auto" (per shape: 256 where its tiles fill whole waves
    # without a K split, `nvfp4_gemm_wgmma.auto_tm`; 36-layer 512-token prefill at batch 1 23.2
    # against 24.4 ms with "128" on an H100, experiments/results/dot_x_h100/), "128" or "256"
    # (GemmOptions.wgmma_tm)
    gemm_wgmma_tm: str = "auto"
    # ... and the order its CTAs take their tiles: 0 (the grid's: each weight tile's token
    # tiles in turn) or groups of that many token tiles, every weight tile within a group, so
    # the CTAs resident at once share those tokens' x_hat in L2 (an experiment for thousands
    # of rows, e.g. gemm_wgmma_max_m None at batch-8 prefill; the same bits; on an H100 that
    # prefill 146.1 against 149.7 ms with groups of 8, the default dot path 144.7: off)
    # (GemmOptions.wgmma_raster, cuda_ops.nvfp4_gemm_wgmma.raster_tiles)
    gemm_wgmma_raster: int = 0
    command_buffer: str = "default"
    weight_prefetch: str = "none"
    # Row-invariant matmuls up to this many rows (None: off): a decode program with fewer rows
    # computes its linears as one with this many would, so a row's numbers do not depend on
    # how many rows run with it. The NVFP4 GEMM plans its K split for this many rows
    # (GemmOptions.split_m; the K order inside a split never depends on M), and float matmuls
    # (bf16 linears, the bf16 lm_head) run on rows zero-padded to it, so they have the full
    # batch's shape (decode is weight-bandwidth bound: about the same time; the same algorithm
    # needs xla_autotune=False on a GPU), and so does a linear's residual add (cuBLAS folds
    # it into the matmul, one rounding of x @ W.T + residual);
    # "live" decode attention
    # splits each row's range as a program of this many rows would. The einsum attention is
    # not covered: cuBLAS's batched matmul measured row-count dependent in bf16 on the H200
    # (experiments/row_invariance_check.py). Slot decoding with compaction (rejax.slots) sets it to its slot count. The GEMV (fewer
    # than gemm_min_m rows) and the quantizer kernel (at most 8 rows) are other arithmetic
    # than the GEMM and XLA's quantizer, so row counts below 9 are not covered.
    invariant_rows: int | None = None
    # Whether XLA autotunes the float matmuls on a GPU (True, XLA's default: it times candidate
    # algorithms for each matmul fusion of each program and keeps the fastest). The pick can
    # differ between two programs with the same matmul shape (a padded fusion, timing noise),
    # and so can the rounding: bf16 slot compaction changed 28 of 512 rows on the H200 until
    # this was off. False compiles every program with cuBLAS's untimed pick per shape
    # (NO_AUTOTUNE_OPTIONS), so a float matmul rounds the same in every program and process;
    # rejax.slots' "auto" compaction needs it on a GPU. (XLA keeps its timed picks per process:
    # a program compiled with it False may reuse one made for the same matmul by a program
    # compiled with it True in the same process.)
    xla_autotune: bool = True

    def __post_init__(self):
        if self.arch not in ARCHITECTURES.values():
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {sorted(ARCHITECTURES)}")
        if self.quant not in QUANT_MODES:
            raise ValueError(f"unknown quant {self.quant!r}; expected one of {QUANT_MODES}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {self.attention!r}; expected one of {ATTENTIONS}")
        if self.linear_fusion not in LINEAR_FUSIONS:
            raise ValueError(
                f"unknown linear_fusion {self.linear_fusion!r}; expected one of {LINEAR_FUSIONS}"
            )
        if self.attention_output not in ATTENTION_OUTPUTS:
            raise ValueError(
                f"unknown attention_output {self.attention_output!r}; expected one of "
                f"{ATTENTION_OUTPUTS}"
            )
        if self.o_proj_output not in O_PROJ_OUTPUTS:
            raise ValueError(
                f"unknown o_proj_output {self.o_proj_output!r}; expected one of {O_PROJ_OUTPUTS}"
            )
        if self.gate_up_output not in GATE_UP_OUTPUTS:
            raise ValueError(
                f"unknown gate_up_output {self.gate_up_output!r}; expected one of {GATE_UP_OUTPUTS}"
            )
        if self.gemm_dot_finish not in GEMM_DOT_FINISHES:
            raise ValueError(
                f"unknown gemm_dot_finish {self.gemm_dot_finish!r}; expected one of "
                f"{GEMM_DOT_FINISHES}"
            )
        if self.rope_fusion not in ROPE_FUSIONS:
            raise ValueError(
                f"unknown rope_fusion {self.rope_fusion!r}; expected one of {ROPE_FUSIONS}"
            )
        if self.residual_fusion not in RESIDUAL_FUSIONS:
            raise ValueError(
                f"unknown residual_fusion {self.residual_fusion!r}; expected one of "
                f"{RESIDUAL_FUSIONS}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown kv_dtype {self.kv_dtype!r}; expected one of {KV_DTYPES}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(
                f"unknown layer_loop {self.layer_loop!r}; expected one of {LAYER_LOOPS}"
            )
        if not (isinstance(self.scan_unroll, int) and self.scan_unroll >= 1):
            raise ValueError(f"scan_unroll must be an int >= 1, got {self.scan_unroll!r}")
        if not (isinstance(self.decode_unroll, int) and self.decode_unroll >= 1):
            raise ValueError(f"decode_unroll must be an int >= 1, got {self.decode_unroll!r}")
        if not (isinstance(self.gemm_min_m, int) and self.gemm_min_m >= 1):
            raise ValueError(f"gemm_min_m must be an int >= 1, got {self.gemm_min_m!r}")
        if self.gemm_dot_x not in GEMM_DOT_XS:
            raise ValueError(
                f"unknown gemm_dot_x {self.gemm_dot_x!r}; expected one of {GEMM_DOT_XS}"
            )
        if self.gemm_dot_stream not in GEMM_DOT_STREAMS:
            raise ValueError(
                f"unknown gemm_dot_stream {self.gemm_dot_stream!r}; expected one of "
                f"{GEMM_DOT_STREAMS}"
            )
        if self.gemm_dot_dequant not in GEMM_DOT_DEQUANTS:
            raise ValueError(
                f"unknown gemm_dot_dequant {self.gemm_dot_dequant!r}; expected one of "
                f"{GEMM_DOT_DEQUANTS}"
            )
        for name in ("gemm_wgmma_min_m", "gemm_wgmma_max_m"):
            v = getattr(self, name)
            if v not in (None, "default") and not (
                isinstance(v, int) and not isinstance(v, bool) and v >= 1
            ):
                raise ValueError(f"{name} must be None, 'default' or an int >= 1, got {v!r}")
        if self.gemm_max_m is not None and not (
            isinstance(self.gemm_max_m, int) and self.gemm_max_m >= self.gemm_min_m
        ):
            raise ValueError(
                f"gemm_max_m must be None or an int >= gemm_min_m={self.gemm_min_m}, "
                f"got {self.gemm_max_m!r}"
            )
        if self.command_buffer not in COMMAND_BUFFERS:
            raise ValueError(
                f"unknown command_buffer {self.command_buffer!r}; expected one of {COMMAND_BUFFERS}"
            )
        if self.gemm_reduce not in GEMM_REDUCES:
            raise ValueError(
                f"unknown gemm_reduce {self.gemm_reduce!r}; expected one of {GEMM_REDUCES}"
            )
        if self.gemm_copies not in GEMM_COPIES:
            raise ValueError(
                f"unknown gemm_copies {self.gemm_copies!r}; expected one of {GEMM_COPIES}"
            )
        if self.gemm_chain not in GEMM_CHAINS:
            raise ValueError(
                f"unknown gemm_chain {self.gemm_chain!r}; expected one of {GEMM_CHAINS}"
            )
        if self.gemm_x_quant not in GEMM_X_QUANTS:
            raise ValueError(
                f"unknown gemm_x_quant {self.gemm_x_quant!r}; expected one of {GEMM_X_QUANTS}"
            )
        if self.gemm_wgmma_tm not in GEMM_WGMMA_TMS:
            raise ValueError(
                f"unknown gemm_wgmma_tm {self.gemm_wgmma_tm!r}; expected one of {GEMM_WGMMA_TMS}"
            )
        if (
            not isinstance(self.gemm_wgmma_raster, int)
            or isinstance(self.gemm_wgmma_raster, bool)
            or self.gemm_wgmma_raster < 0
        ):
            raise ValueError(
                f"gemm_wgmma_raster={self.gemm_wgmma_raster!r}: expected an int >= 0 (0: the "
                "grid's order; G: groups of G token tiles)"
            )
        if self.gemm_wgmma_x_quant not in GEMM_WGMMA_X_QUANTS:
            raise ValueError(
                f"unknown gemm_wgmma_x_quant {self.gemm_wgmma_x_quant!r}; expected one of "
                f"{GEMM_WGMMA_X_QUANTS}"
            )
        if self.gemm_occupancy not in GEMM_OCCUPANCIES:
            raise ValueError(
                f"unknown gemm_occupancy {self.gemm_occupancy!r}; expected one of "
                f"{GEMM_OCCUPANCIES}"
            )
        weight_prefetch_policy(self.weight_prefetch)  # raises on a bad spec
        if self.invariant_rows is not None and not (
            isinstance(self.invariant_rows, int) and self.invariant_rows >= 1
        ):
            raise ValueError(
                f"invariant_rows must be None or an int >= 1, got {self.invariant_rows!r}"
            )
        if not isinstance(self.xla_autotune, bool):
            raise TypeError(f"xla_autotune must be True or False, got {self.xla_autotune!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not isinstance(self.eos_token_ids, tuple):
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def q_per_kv(self) -> int:  # G
        return self.num_heads // self.num_kv_heads


# Presets with the real layer shapes (the paper's models); weights are random in benchmarks.
# The two families differ in architecture, vocabulary, RoPE base, context and Qwen2's qkv bias;
# the models of a family only in widths and depth (dims: D, F, layers, N).
_QWEN3 = {"arch": "qwen3", "vocab_size": 151936, "rope_theta": 1_000_000.0,
          "max_position_embeddings": 40960, "eos_token_ids": (151645, 151643)}  # fmt: skip
_QWEN2 = {"arch": "qwen2", "vocab_size": 152064, "rope_theta": 10_000.0, "attention_bias": True,
          "max_position_embeddings": 131072, "eos_token_ids": (151643,)}  # fmt: skip


def _preset(family: dict, d: int, f: int, layers: int, n: int, kv: int) -> Config:
    return Config(**family, hidden_size=d, intermediate_size=f, num_layers=layers, num_heads=n,
                  num_kv_heads=kv, head_dim=128)  # fmt: skip


QWEN3_8B = _preset(_QWEN3, 4096, 12288, 36, 32, 8)
QWEN3_14B = _preset(_QWEN3, 5120, 17408, 40, 40, 8)
QWEN3_32B = _preset(_QWEN3, 5120, 25600, 64, 64, 8)
R1_DISTILL_QWEN_7B = _preset(_QWEN2, 3584, 18944, 28, 28, 4)
# DeepSeek-R1-Distill-Qwen-14B is built on Qwen2.5-14B: the Qwen2 architecture with RoPE 1e6
R1_DISTILL_QWEN_14B = dataclasses.replace(
    _preset(_QWEN2, 5120, 13824, 48, 40, 8), rope_theta=1_000_000.0
)
PRESETS = {
    "qwen3-8b": QWEN3_8B,
    "qwen3-14b": QWEN3_14B,
    "qwen3-32b": QWEN3_32B,
    "r1-distill-qwen-7b": R1_DISTILL_QWEN_7B,
    "r1-distill-qwen-14b": R1_DISTILL_QWEN_14B,
}


def from_hf_config(hf: Mapping[str, Any], quant: str | None = None) -> Config:
    """Builds a Config from a Hugging Face `config.json` dict.

    Raises ValueError for an unknown `model_type` or a `rope_scaling` kind rejax does not
    implement (named in the message), so unsupported checkpoints never load silently wrong.
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unknown model_type {model_type!r} in config.json; rejax supports {sorted(ARCHITECTURES)}"
        )
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in (None, "default"):
            raise ValueError(f"rope_scaling type {kind!r} is not implemented (only plain RoPE)")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not implemented")
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    arch = ARCHITECTURES[model_type]
    rope_theta = hf.get("rope_theta")
    if rope_theta is None:  # transformers >= 5 may keep it under rope_parameters
        rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10_000.0)
    return Config(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads", num_heads)),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
        quant=quant,
    )
