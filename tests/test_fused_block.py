"""The post-attention block as one op (`rejax.ops.fused_block.post_attention_block`,
Config.gemm_chain "fused") and its finish-quantizer kernel (`nvfp4_finish_quantize`,
cuda_ops/nvfp4_quant.py's `FinishIn`) without a GPU: off CUDA the op is bitwise the three
`fused_linear` calls it replaces, and so is the decoder with it; lowered for CUDA, each K-split
GEMM's finish and the next quantizer are one launch with the operands the kernel reads, and
rows or shapes the chain does not serve lower as before; the kernel compiles for sm_90 without
local memory and leaves every other build alone; bad arguments fail with the value named. The
kernel's bytes against the two launches it replaces are checked on the GPU
(tests/test_fused_block_gpu.py).

GEMM letters: M rows, N out features, K in features. The shapes here split K where Qwen3-8B's
do (1024 x 2048 from 16 rows on, 2048 x 1024 at 8 and 32+ rows): D = 1024, o_proj's K 2048,
F = 1024.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import (
    decode_logits,
    decode_step_cuda_text,
    layer_launches,
    per_linear_scales,
    stacked_linear,
)

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemm, nvfp4_gemv, nvfp4_quant
from rejax import config as rconfig
from rejax.ops import fused_linear as fl
from rejax.ops.fused_block import block_supported, post_attention_block, xhat_input
from rejax.params import init_params

needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)
D, K_O, F = 1024, 2048, 1024
SHAPES = ((D, K_O), (2 * F, D), (D, F))
FIN = "nvfp4_finish_quantize"


def _block(scales=((2e-3, 4e-3), (3e-3, 5e-3), (4e-3, 1e-2))):
    o = stacked_linear(D, K_O, scales[0], seed=1)
    g = stacked_linear(2 * F, D, scales[1], seed=2)
    d = stacked_linear(D, F, scales[2], seed=3)
    return o, g, d


def _inputs(m, seed=5):
    out = jax.random.normal(jax.random.key(seed), (m, K_O), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(seed + 1), (m, D), jnp.bfloat16)
    norm = 1.0 + 0.1 * jax.random.normal(jax.random.key(seed + 2), (2, D), jnp.bfloat16)
    return out, x, norm


def _composed(out, x, o, g, d, norm, li, eps=1e-5):
    h = fl.fused_linear(out, o, layer=li, residual=x, kernels="two")
    gu = fl.fused_linear(h, g, layer=li, prologue="rmsnorm", norm=norm, eps=eps, kernels="two")
    return fl.fused_linear(gu, d, layer=li, prologue="swiglu", residual=h, kernels="two")


@pytest.mark.parametrize(
    ("m", "dynamic", "stacked_norm"), [(16, False, True), (32, False, False), (32, True, True)]
)
def test_block_is_the_fused_linear_composition(m, dynamic, stacked_norm):
    """Off CUDA, bitwise: post_attention_block equals o_proj with the residual, gate_up with
    the RMSNorm prologue and down with the SwiGLU prologue and the residual as three
    `fused_linear` calls, at layer 0 and 1, with static stacked scales or gate_up's dynamic
    one, a stacked or a single norm weight; [B, 1, D] leading dims are kept."""
    o, g, d = _block()
    if dynamic:
        g = {"weight": g["weight"]}
    out, x, norm = _inputs(m)
    norm = norm if stacked_norm else norm[1]
    assert block_supported(m, SHAPES) == (True, "")
    run = jax.jit(
        lambda out, x, li: post_attention_block(out, x, o, g, d, norm=norm, layer=li, eps=1e-5)
    )
    want = jax.jit(lambda out, x, li: _composed(out, x, o, g, d, norm, li))
    for layer in (0, 1):
        li = jnp.int32(layer)
        got = np.asarray(run(out[:, None], x[:, None], li))
        assert got.shape == (m, 1, D)
        ref = np.asarray(want(out, x, li))
        np.testing.assert_array_equal(got[:, 0], ref)
        assert (
            np.isfinite(ref.astype(np.float32)).all() and np.abs(ref.astype(np.float32)).max() > 0
        )


def test_block_supported_says_why():
    assert block_supported(8, SHAPES)[0]
    ok, why = block_supported(4, SHAPES)
    assert not ok and "take the GEMV" in why
    ok, why = block_supported(300, SHAPES)
    assert not ok and "take the dot" in why
    ok, why = block_supported(32, SHAPES, nvfp4_gemm.GemmOptions(x_quant="xla"))
    assert not ok and "x_quant='xla'" in why
    ok, why = block_supported(32, SHAPES, nvfp4_gemm.GemmOptions(reduce="cluster"))
    assert not ok and "reduce='cluster'" in why
    ok, why = block_supported(32, ((512, 512), (1024, 512), (512, 512)))
    assert not ok and "nothing to fuse" in why
    ok, why = block_supported(32, ((D, 2000), (2 * F, D), (D, F)))
    assert not ok and "o_proj" in why and "K=2000" in why


def _entries(text: str) -> list[str]:
    return re.findall(r"name = \\22(\w+)\\22", text)


def _ptx_calls(text: str) -> list[tuple[str, str, str]]:
    """(entry, operand types, result types) of every PTX custom call in StableHLO text."""
    calls = []
    for line in text.splitlines():
        if "custom_call @__gpu$xla.gpu.ptx" in line:
            name = re.search(r"name = \\22(\w+)\\22", line).group(1)
            ops, res = re.search(r"\} : \(([^)]*)\) -> (.*)$", line).groups()
            calls.append((name, ops, res))
    return calls


@needs_nvrtc
def test_block_lowers_to_the_chain(tmp_path, monkeypatch):
    """Lowered for CUDA: at 32 rows (o_proj and gate_up split K) the quantizer, o_proj's
    GEMM writing partials, the finish-quantizer (partials, x's global scale, the residual,
    o_proj's stacked global scales, gate_up's stacked input scales, the stacked norm, the
    layer -> h, x_hat, global scale), gate_up's GEMM, the finish-quantizer of down's input (no
    residual, no y), down's GEMM and its finish: 7 launches where the composition has 9; at 16
    rows (gate_up does not split) 6 against 7; at 4 rows (the GEMV's) and with impl="ref" the
    composition's lowering; impl="cuda" refuses what the chain does not serve. (o_proj's plan
    splits K in 4 at 32 rows, gate_up's in 2.)"""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    o, g, d = _block()
    _, _, norm = _inputs(1)

    def lowered(m, impl="auto", fn=post_attention_block):
        out, x, _ = _inputs(m)
        f = jax.jit(lambda out, x, li: fn(out, x, o, g, d, norm=norm, layer=li, impl=impl))
        return f.trace(out, x, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()

    gemm, quant = nvfp4_gemm.ENTRY, nvfp4_quant.ENTRY
    text = lowered(32)
    assert _entries(text) == [quant, gemm, FIN, gemm, FIN, gemm, nvfp4_gemm.FINISH_ENTRY]
    fins = [c for c in _ptx_calls(text) if c[0] == FIN]
    s_o, s_g = (nvfp4_gemm.plan(32, n, k).splitk for n, k in SHAPES[:2])
    assert (s_o, s_g) == (4, 2)
    assert fins[0][1] == (
        "tensor<4x32x1024xf32>, tensor<32xf32>, tensor<32x1024xbf16>, tensor<2xf32>, "
        "tensor<2xf32>, tensor<2x1024xbf16>, tensor<i32>"
    ), fins[0]
    assert "tensor<32x1024xbf16>, tensor<32x1024xf16>, tensor<32xf32>" in fins[0][2], fins[0]
    assert fins[1][1] == (
        "tensor<2x32x2048xf32>, tensor<32xf32>, tensor<1x1xbf16>, tensor<2xf32>, "
        "tensor<2xf32>, tensor<1xbf16>, tensor<i32>"
    ), fins[1]
    assert "tensor<1xbf16>, tensor<32x1024xf16>, tensor<32xf32>" in fins[1][2], fins[1]
    composed = lowered(32, fn=lambda out, x, o, g, d, norm, layer, impl: _composed(
        out, x, o, g, d, norm, layer, 1e-6))  # fmt: skip
    assert len(_entries(composed)) == 9 and FIN not in _entries(composed)
    assert _entries(lowered(16)) == [quant, gemm, FIN, gemm, quant, gemm]
    # o_proj's finish-quantizer: one 128-thread CTA per row (the quantizer's threads)
    cfg = next(line for line in text.splitlines() if FIN in line and "2x1024xbf16" in line)
    assert "grid_x = 32, grid_y = 1," in cfg and "block_x = 128," in cfg
    text = lowered(32, fn=functools.partial(post_attention_block, norm_chunk=512))
    cfg = next(line for line in text.splitlines() if FIN in line and "2x1024xbf16" in line)
    assert "grid_x = 32, grid_y = 2," in cfg and "block_x = 128," in cfg
    with pytest.raises(ValueError, match="norm_chunk=300: expected a multiple of 256"):
        lowered(32, fn=functools.partial(post_attention_block, norm_chunk=300))
    # norm_cluster: o_proj's finish-quantizer as a cluster of the row's CTAs (at D = 1024 and
    # 32 rows cluster_chunk gives 4 CTAs of 256 elements a row), compile-time cluster dims
    text = lowered(32, fn=functools.partial(post_attention_block, norm_cluster=True))
    assert _entries(text) == [quant, gemm, FIN, gemm, FIN, gemm, nvfp4_gemm.FINISH_ENTRY]
    cfg = next(line for line in text.splitlines() if FIN in line and "2x1024xbf16" in line)
    assert "grid_x = 32, grid_y = 4," in cfg and ".reqnctapercluster 1, 4, 1" in cfg
    text = lowered(32, fn=functools.partial(post_attention_block, norm_cluster=True,
                                            norm_chunk=512))  # fmt: skip
    cfg = next(line for line in text.splitlines() if FIN in line and "2x1024xbf16" in line)
    assert "grid_x = 32, grid_y = 2," in cfg and ".reqnctapercluster 1, 2, 1" in cfg
    with pytest.raises(ValueError, match="norm_chunk=1024 with norm_cluster: 1 CTAs a row"):
        lowered(32, fn=functools.partial(post_attention_block, norm_cluster=True,
                                         norm_chunk=1024))  # fmt: skip
    # down's input at F = 4096: the quantizer's chunks (4 a row) with a static scale, one CTA
    # per row with a dynamic one (its amax pass reads the whole row)
    from rejax.ops import fused_block as fb

    shapes = ((D, K_O), (2 * 4096, D), (D, 4096))
    assert nvfp4_gemm.plan(32, *shapes[1]).partials
    for dynamic, chunks in ((False, 4), (True, 1)):
        fused = tuple(
            nvfp4_gemv.Fused(prologue=p, residual=r, dynamic=dynamic and p == "swiglu")
            for p, r in (("none", True), ("rmsnorm", False), ("swiglu", True))
        )
        chain = fb._build_chain(32, shapes, fused, (False,) * 3, nvfp4_gemm.DEFAULT_OPTIONS,
                                True, None)  # fmt: skip
        assert chain.fin_d.k // chain.fin_d.chunk == chunks, (dynamic, chain.fin_d.chunk)
        assert chain.fin_g.chunk == D and chain.fin_g.threads == 128
    assert FIN not in _entries(lowered(4))
    assert _entries(lowered(32, impl="ref")) == []
    # chain_norm=False: o_proj's GEMM and finish (with the residual) and gate_up's RMSNorm
    # quantizer stay two launches; only gate_up's finish is chained (into down's quantizer)
    no_norm = functools.partial(post_attention_block, chain_norm=False)
    finish = nvfp4_gemm.FINISH_ENTRY
    assert _entries(lowered(32, fn=no_norm)) == [
        quant,
        gemm,
        finish,
        quant,
        gemm,
        FIN,
        gemm,
        finish,
    ]
    # at 16 rows gate_up does not split K: nothing left to chain, the composition's launches
    composed16 = lowered(16, fn=lambda out, x, o, g, d, norm, layer, impl: _composed(
        out, x, o, g, d, norm, layer, 1e-6))  # fmt: skip
    assert _entries(lowered(16, fn=no_norm)) == _entries(composed16)
    assert _entries(composed16)[:5] == [quant, gemm, finish, quant, gemm]
    with pytest.raises(ValueError, match="M=16: gate_up_proj does not split K"):
        lowered(16, impl="cuda", fn=no_norm)
    with pytest.raises(ValueError, match="impl='cuda'.*take the GEMV"):
        lowered(4, impl="cuda")


@needs_nvrtc
@pytest.mark.parametrize("k", [4096, 12288])
def test_finish_quantize_builds_without_local_memory(quant_defines, k):
    """NVRTC compiles `nvfp4_finish_quantize` (RMSNorm with the residual and y stored, in the
    quantizer's chunks and one CTA per row, SwiGLU over 2K partial columns, "none" with a
    dynamic scale and per-row weight scales, one CTA per row; RMSNorm as a cluster of 4-8 CTAs a
    row) to an entry of 10 parameters over [M, K / chunk], the row kept in shared memory
    exactly when one CTA takes it, cluster dims in the PTX exactly for a cluster; ptxas builds
    it for sm_90 without spills or a stack frame; the quantizer's other builds carry no FIN_*
    define (their PTX and cache keys are unchanged)."""
    seen = quant_defines
    source = cbuild.read_source(nvfp4_gemv.SOURCE)
    cases = (  # (prologue, dynamic, finish, chunk: None the quantizer's, or one CTA per row)
        ("rmsnorm", False, nvfp4_quant.FinishIn(splitk=8, residual=True, store_y=True), None),
        ("rmsnorm", False, nvfp4_quant.FinishIn(splitk=8, residual=True, store_y=True), k),
        ("rmsnorm", False, nvfp4_quant.FinishIn(splitk=4, residual=True, store_y=True,
                                                next_layers=36), k),
        ("swiglu", False, nvfp4_quant.FinishIn(splitk=2, w_shift=6), None),
        ("none", True, nvfp4_quant.FinishIn(splitk=3, gw_rows=True, residual=True, store_y=True),
         k),
        # the row's CTAs a cluster (4 and 8 a row at K = 4096; 6 at 12288)
        ("rmsnorm", False, nvfp4_quant.FinishIn(splitk=8, residual=True, store_y=True,
                                                cluster=True), k // 4 if k == 4096 else k // 6),
        ("rmsnorm", True, nvfp4_quant.FinishIn(splitk=4, residual=True, store_y=True,
                                               next_layers=36, cluster=True), k // 8),
    )  # fmt: skip
    try:
        for prologue, dynamic, fin, chunk in cases:
            fused = nvfp4_gemv.Fused(prologue=prologue, dynamic=dynamic, norm_stacked=True,
                                     scale_stacked=not dynamic)  # fmt: skip
            kern = nvfp4_quant.build(64, k, fused, arch="compute_90", out="xhat", finish=fin,
                                     chunk=chunk, threads=128)  # fmt: skip
            # one CTA per row keeps the row in shared memory (each partial read once)
            assert seen[-1].get("FIN_CACHE", 0) == (chunk == k), seen[-1]
            assert seen[-1].get("FIN_CLUSTER", 0) == (k // chunk if fin.cluster else 0)
            # a cluster: compile-time dims (1, C, 1) over the grid's C CTAs of a row
            assert (
                ".reqnctapercluster 1, " + str(k // (chunk or k))
            ) in kern.ptx or not fin.cluster
            assert cbuild.ptx_entries(kern.ptx) == {FIN: 10}
            assert (kern.n_inputs, kern.n_outputs, kern.entry) == (7, 3, FIN)
            cfg = kern.backend_config()
            assert f"grid_x = 64, grid_y = {k // kern.chunk}," in cfg, cfg[-300:]
            assert cfg.endswith("output_indices = [7, 8, 9]}"), cfg[-200:]
            assert seen[-1]["FIN_SPLITK"] == fin.splitk and seen[-1]["FIN_W_SHIFT"] == fin.w_shift
            assert seen[-1].get("FIN_NEXT_LAYERS", 0) == fin.next_layers
            log = cbuild.ptxas_log(source, seen[-1], "sm_90", name=nvfp4_gemv.SOURCE)
            assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
        plain = nvfp4_quant.build(64, k, nvfp4_gemv.PLAIN, arch="compute_90", out="xhat")
        assert not any(key.startswith("FIN_") for key in seen[-1]), seen[-1]
        assert plain.entry == nvfp4_quant.ENTRY and plain.finish is None
    finally:
        nvfp4_quant._build_cached.cache_clear()


def test_finish_in_and_build_errors_name_the_value():
    with pytest.raises(nvfp4_gemv.KernelError, match="splitk=0"):
        nvfp4_quant.FinishIn(splitk=0)
    with pytest.raises(nvfp4_gemv.KernelError, match="w_shift=8"):
        nvfp4_quant.FinishIn(splitk=2, w_shift=8)
    fin = nvfp4_quant.FinishIn(splitk=2)
    with pytest.raises(nvfp4_gemv.KernelError, match="out='xhat' or 'xhat_bf16', got 'codes'"):
        nvfp4_quant.build(16, 4096, nvfp4_gemv.PLAIN, arch="compute_90", finish=fin)
    swiglu = nvfp4_gemv.Fused(prologue="swiglu")
    with pytest.raises(nvfp4_gemv.KernelError, match="not with swiglu"):
        nvfp4_quant.build(16, 4096, swiglu, arch="compute_90", out="xhat",
                          finish=dataclasses.replace(fin, store_y=True))  # fmt: skip
    with pytest.raises(nvfp4_gemv.KernelError, match="finish must be a FinishIn"):
        nvfp4_quant.build(16, 4096, nvfp4_gemv.PLAIN, out="xhat", finish={"splitk": 2})


def test_block_errors_name_the_value():
    o, g, d = _block()
    out, x, norm = _inputs(16)

    def call(**kw):
        args = {"out": out, "x": x, "o_proj": o, "gate_up": g, "down": d, "norm": norm,
                "layer": 0, **kw}  # fmt: skip
        return post_attention_block(**args)

    with pytest.raises(ValueError, match=r"out.shape=\(16, 1024\)"):
        call(out=x)
    with pytest.raises(ValueError, match=r"x.dtype=float32"):
        call(x=x.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"norm.shape=\(3, 1024\)"):
        call(norm=jnp.ones((3, D), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"gate_up_proj \(2048, 1024\), down_proj \(1024, 2048\)"):
        call(down=o)
    with pytest.raises(ValueError, match="pass layer= for a stack only"):
        call(layer=None)
    with pytest.raises(ValueError, match="down_proj needs W4A4 NVFP4 params"):
        call(down={"weight": jnp.zeros((D, F))})
    with pytest.raises(ValueError, match="gemm_options must be a GemmOptions"):
        call(gemm_options={"min_m": 8})
    with pytest.raises(ValueError, match="impl"):
        call(impl="fast")


# ----------------------------------------------------------------------------- decoder

CFG = rconfig.Config(
    quant="nvfp4", hidden_size=D, intermediate_size=F, num_heads=16, num_kv_heads=4,
    head_dim=128, num_layers=2, vocab_size=512, gemm_chain="split",
)  # fmt: skip


def test_config_gemm_chain_validated():
    assert rconfig.Config().gemm_chain == "swiglu_rope"  # measured fastest, see GEMM_CHAINS
    with pytest.raises(ValueError, match="unknown gemm_chain 'one'"):
        rconfig.Config(gemm_chain="one")


@pytest.mark.parametrize("chain", ["fused", "swiglu_rope", "cluster"])
def test_decoder_gemm_chain_fused_is_bitwise_split_off_cuda(chain):
    """The decoder with Config.gemm_chain "fused" or "swiglu_rope" gives the logits of "split"
    bit for bit off CUDA (8 rows, where the chain applies, and 2, where it does not), static
    input scales."""
    params = per_linear_scales(init_params(CFG, 0, jnp.bfloat16))
    for b in (8, 2):
        want = decode_logits(CFG, params, steps=2, b=b)
        fused = dataclasses.replace(params, cfg=dataclasses.replace(CFG, gemm_chain=chain))
        got = decode_logits(fused.cfg, fused, steps=2, b=b)
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(want).all()


@needs_nvrtc
def test_decode_step_lowers_the_chain_with_gemm_chain_fused(tmp_path, monkeypatch):
    """A decode step's scanned layer at 32 rows: with gemm_chain "fused" the qkv GEMM reads the
    x_hat the previous layer wrote (no quantizer in front), the rope kernel reads its partials,
    three finish-quantizers (gate_up's input, down's, the next layer's qkv input) and four
    launches fewer than with "split" (no finish kernel left); layer 0's qkv input is quantized
    once before the loop; at 4 rows (the GEMV's) the same launches."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    split, _ = layer_launches(CFG, batch=32)
    cfg = dataclasses.replace(CFG, gemm_chain="fused")
    fused, body = layer_launches(cfg, batch=32)
    assert split.count(FIN) == 0 and fused.count(FIN) == 3, fused
    assert split.count(nvfp4_gemm.FINISH_ENTRY) == 4 and nvfp4_gemm.FINISH_ENTRY not in fused
    assert len(fused) == len(split) - 4, (fused, split)
    assert fused[:2] == [nvfp4_gemm.ENTRY, "qk_norm_rope_cache"], fused
    # the step's text holds the layer body once: the quantizer before the loop, o_proj's in it
    step = _entries(decode_step_cuda_text(cfg, batch=32))
    assert step[0] == nvfp4_quant.ENTRY and step.count(nvfp4_quant.ENTRY) == 2, step
    rope = [c for c in _ptx_calls(body) if c[0] == "qk_norm_rope_cache"]
    assert len(rope) == 1 and rope[0][1].startswith("tensor<"), rope
    s_qkv = nvfp4_gemm.plan(32, (16 + 8) * 128, D).splitk
    assert rope[0][1].startswith(f"tensor<{s_qkv}x32x3072xf32>, tensor<32xf32>, "), rope[0][1][:80]
    small = layer_launches(dataclasses.replace(CFG, gemm_chain="fused"), batch=4)[0]
    assert small == layer_launches(CFG, batch=4)[0]


def test_cluster_chunk():
    """The fewest CTAs a row (2, 4, 8) that give every SM one; chunks of 256 multiples."""
    from rejax.ops.fused_block import cluster_chunk

    assert [cluster_chunk(m, 4096, 132) for m in (8, 16, 32, 64, 128)] == [
        512,
        512,
        512,
        1024,
        2048,
    ]
    assert cluster_chunk(64, 12288, 132) == 3072 and cluster_chunk(8, 1024, 132) == 256
    assert cluster_chunk(8, 256, 132) == 256  # no cluster: one CTA a row


@needs_nvrtc
def test_decode_step_lowers_gemm_chain_cluster(tmp_path, monkeypatch):
    """gemm_chain "cluster" lowers "fused"'s launches, its two RMSNorm finish-quantizers (gate_up's
    input, the next layer's qkv input) with a cluster of the row's CTAs each."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    fused, _ = layer_launches(dataclasses.replace(CFG, gemm_chain="fused"), batch=32)
    got, body = layer_launches(dataclasses.replace(CFG, gemm_chain="cluster"), batch=32)
    assert got == fused, (got, fused)
    fins = [line for line in body.splitlines() if FIN in line]
    assert sum(".reqnctapercluster 1, 4, 1" in line for line in fins) == 2, len(fins)


@needs_nvrtc
def test_decode_step_lowers_gemm_chain_swiglu_rope(tmp_path, monkeypatch):
    """gemm_chain "swiglu_rope" at 32 rows: the qkv GEMM's partials read by the rope kernel and
    gate_up's by down's finish-quantizer; o_proj's and down's finish kernels and the RMSNorm
    quantizers stay (no x_hat handed between layers): two launches fewer than "split"."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    split, _ = layer_launches(CFG, batch=32)
    got = layer_launches(dataclasses.replace(CFG, gemm_chain="swiglu_rope"), batch=32)[0]
    assert got.count(FIN) == 1 and got.count(nvfp4_gemm.FINISH_ENTRY) == 2, got
    assert got.count(nvfp4_quant.ENTRY) == split.count(nvfp4_quant.ENTRY) - 1, (got, split)
    assert len(got) == len(split) - 2, (got, split)
    assert got[:3] == [nvfp4_quant.ENTRY, nvfp4_gemm.ENTRY, "qk_norm_rope_cache"], got


# ----------------------------------------------------------------------------- pre-attention

HEADS, KV, HD = 16, 4, 128
QKV_N = (HEADS + 2 * KV) * HD


def _pre_inputs(b, slots=12, seed=7):
    qkv = stacked_linear(QKV_N, D, [0.02, 0.03], seed=seed)
    x = jax.random.normal(jax.random.key(seed), (b, D), jnp.bfloat16)
    norm = 1.0 + 0.1 * jax.random.normal(jax.random.key(seed + 1), (2, D), jnp.bfloat16)
    qn = 1.0 + 0.1 * jax.random.normal(jax.random.key(seed + 2), (2, HD), jnp.bfloat16)
    kn = 1.0 + 0.1 * jax.random.normal(jax.random.key(seed + 3), (2, HD), jnp.bfloat16)
    cache = jax.random.normal(jax.random.key(seed + 4), (2, b, slots, KV, HD), jnp.bfloat16)
    positions = jnp.arange(b, dtype=jnp.int32) + 3
    return qkv, x, norm, qn, kn, cache, positions


def _pre(x, qkv, norm, qn, kn, positions, index, kc, vc, li, fn=None, **kw):
    from rejax.ops.fused_block import pre_attention_block

    fn = fn or pre_attention_block
    return fn(x, qkv, qn, kn, positions, index, kc, vc, norm=norm, layer=li, heads=HEADS,
              kv_heads=KV, head_dim=HD, eps=1e-6, theta=1e6, **kw)  # fmt: skip


def _pre_composed(x, qkv, qn, kn, positions, index, kc, vc, *, norm, layer, eps, theta, **_):
    from rejax.ops.rope_cache import rope_cache

    y = fl.fused_linear(x, qkv, layer=layer, prologue="rmsnorm", norm=norm, eps=eps, kernels="two")
    return rope_cache(y, qn, kn, layer, positions, index, kc, vc, heads=HEADS, kv_heads=KV,
                      head_dim=HD, eps=eps, theta=theta)  # fmt: skip


@pytest.mark.parametrize(("qk_norm", "rows_index"), [(True, False), (False, True)])
def test_pre_block_is_fused_linear_then_rope_cache(qk_norm, rows_index):
    """Off CUDA, bitwise: q and both caches equal fused_linear (RMSNorm, qkv) then rope_cache,
    with Qwen3's q/k norms and one slot for all rows, or none (Qwen2) and a slot per row."""
    b = 16
    qkv, x, norm, qn, kn, cache, positions = _pre_inputs(b)
    if not qk_norm:
        qn = kn = None
    index = jnp.arange(b, dtype=jnp.int32) % 5 if rows_index else jnp.int32(4)
    run = jax.jit(lambda x, kc, vc, li: _pre(x, qkv, norm, qn, kn, positions, index, kc, vc, li))
    want = jax.jit(
        lambda x, kc, vc, li: _pre(
            x, qkv, norm, qn, kn, positions, index, kc, vc, li, fn=_pre_composed
        )
    )
    for layer in (0, 1):
        got = run(x, cache, cache * 2, jnp.int32(layer))
        ref = want(x, cache, cache * 2, jnp.int32(layer))
        for g, r in zip(got, ref, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
        assert not np.array_equal(np.asarray(got[1]), np.asarray(cache))  # a slot was written


def test_pre_supported_says_why():
    from cuda_ops import rope_cache as rk
    from rejax.ops.fused_block import pre_supported

    rope = rk.Shape(batch=32, heads=HEADS, kv_heads=KV, head_dim=HD, slots=8, qk_norm=True,
                    eps=1e-6, index_rows=False)  # fmt: skip
    assert pre_supported(32, (QKV_N, D), rope) == (True, "")
    ok, why = pre_supported(4, (QKV_N, D), rope)
    assert not ok and "take the GEMV" in why
    ok, why = pre_supported(32, (QKV_N, 512), rope)
    assert not ok and "does not split K" in why
    ok, why = pre_supported(32, (QKV_N, D), dataclasses.replace(rope, head_dim=48))
    assert not ok and "head_dim=48" in why
    ok, why = pre_supported(32, (QKV_N, D), rope, nvfp4_gemm.GemmOptions(reduce="cluster"))
    assert not ok and "reduce='cluster'" in why


@needs_nvrtc
def test_pre_block_lowers_to_quantizer_gemm_and_rope(tmp_path, monkeypatch):
    """Lowered for CUDA at 32 rows: the quantizer, the qkv GEMM writing partials and the rope
    kernel reading them (partials, x's global scales, the stacked weight global scales, ...,
    both caches aliased to its second and third results): 3 launches where the split path has
    4; at 4 rows the split path's lowering; impl="cuda" refuses the GEMV's rows."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))

    def lowered(b, fn=None, impl="auto"):
        qkv, x, norm, qn, kn, cache, positions = _pre_inputs(b)
        f = jax.jit(lambda x, kc, vc: _pre(x, qkv, norm, qn, kn, positions, jnp.int32(2), kc, vc,
                                           jnp.int32(1), fn=fn, impl=impl))  # fmt: skip
        return f.trace(x, cache, cache).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered(32)
    assert _entries(text) == [nvfp4_quant.ENTRY, nvfp4_gemm.ENTRY, "qk_norm_rope_cache"]
    (rope,) = [line for line in text.splitlines() if "qk_norm_rope_cache" in line]
    s = nvfp4_gemm.plan(32, QKV_N, D).splitk
    assert f": (tensor<{s}x32x{QKV_N}xf32>, tensor<32xf32>, tensor<2xf32>, " in rope, rope[-600:]
    assert "operand_index = 9" in rope and "operand_index = 10" in rope, rope[-600:]
    composed = _entries(lowered(32, fn=_pre_composed))
    assert composed == [nvfp4_quant.ENTRY, nvfp4_gemm.ENTRY, nvfp4_gemm.FINISH_ENTRY,
                        "qk_norm_rope_cache"]  # fmt: skip
    assert _entries(lowered(4)) == _entries(lowered(4, fn=_pre_composed))
    with pytest.raises(ValueError, match="impl='cuda'.*take the GEMV"):
        lowered(4, impl="cuda")


@needs_nvrtc
def test_rope_finish_build(tmp_path, monkeypatch):
    """The rope kernel with the qkv GEMM's finish compiles to 14 parameters without spills, the
    caches aliased to operands 9 and 10; a residual or a stored y is refused."""
    from cuda_ops import rope_cache as rk

    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    shape = rk.Shape(batch=64, heads=32, kv_heads=8, head_dim=128, slots=1536, qk_norm=True,
                     eps=1e-6, index_rows=True)  # fmt: skip
    fin = nvfp4_quant.FinishIn(splitk=5, gw_rows=True)
    kern = rk.build(shape, arch="compute_90", finish=fin)
    assert cbuild.ptx_entries(kern.ptx) == {rk.ENTRY: 14} and kern.aliases == {9: 1, 10: 2}
    assert kern.backend_config().endswith("output_indices = [11, 12, 13]}")
    defines = {"B_ROWS": 64, "N_HEADS": 32, "KV_HEADS": 8, "HEAD_DIM": 128, "S_SLOTS": 1536,
               "QK_NORM": 1, "NORM_EPS": "1e-06f", "INDEX_ROWS": 1, "WARPS": 4, "FIN_SPLITK": 5,
               "FIN_W_SHIFT": 7, "FIN_GW_ROWS": 1}  # fmt: skip
    log = cbuild.ptxas_log(cbuild.read_source(rk.SOURCE), defines, "sm_90", name=rk.SOURCE)
    assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
    with pytest.raises(nvfp4_gemv.KernelError, match="no residual"):
        rk.build(shape, arch="compute_90", finish=dataclasses.replace(fin, residual=True))
    assert rk.build(shape, arch="compute_90").n_inputs == 9


def test_pre_block_errors_name_the_value():
    qkv, x, norm, qn, kn, cache, positions = _pre_inputs(8)

    def call(**kw):
        args = {"x": x, "qkv": qkv, "norm": norm, "qn": qn, "kn": kn, "positions": positions,
                "index": jnp.int32(0), "kc": cache, "vc": cache, "li": 0, **kw}  # fmt: skip
        return _pre(**args)

    with pytest.raises(ValueError, match=r"x \(8, 1\) bfloat16, expected \[B, 1024\]"):
        call(x=x[:, :1])
    with pytest.raises(ValueError, match=r"norm.shape=\(3,\)"):
        call(norm=jnp.ones((3,), jnp.bfloat16))
    with pytest.raises(ValueError, match="qkv_proj N=1024, expected"):
        call(qkv=stacked_linear(D, D, [0.02, 0.03]))
    with pytest.raises(ValueError, match="pass layer= for a stack only"):
        call(li=None)
    with pytest.raises(ValueError, match=r"positions.shape=\(3,\)"):
        call(positions=positions[:3])


# ----------------------------------------------------------------------------- across layers


def _qkv_stack(seed=9):
    qkv = stacked_linear(QKV_N, D, [0.02, 0.03], seed=seed)
    norm = 1.0 + 0.1 * jax.random.normal(jax.random.key(seed + 2), (2, D), jnp.bfloat16)
    return qkv, norm


@pytest.mark.parametrize("m", [16, 32])
def test_block_next_writes_the_next_layers_qkv_input(m):
    """Off CUDA, bitwise: with next_qkv the block returns its y and xhat_input(y) at layer + 1
    (the last layer: itself); pre_attention_block on that x_hat equals it on y."""
    o, g, d = _block()
    out, x, norm = _inputs(m)
    qkv, inorm = _qkv_stack()
    run = jax.jit(lambda out, x, li: post_attention_block(
        out, x, o, g, d, norm=norm, layer=li, next_qkv=qkv, next_norm=inorm))  # fmt: skip
    for layer, nxt in ((0, 1), (1, 1)):
        y, (xh, xg) = run(out, x, jnp.int32(layer))
        want_y = post_attention_block(out, x, o, g, d, norm=norm, layer=jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
        wxh, wxg = jax.jit(lambda y, li: xhat_input(y, qkv, inorm, layer=li, eps=1e-6))(
            y, jnp.int32(nxt)
        )
        np.testing.assert_array_equal(
            np.asarray(xh).view(np.uint16), np.asarray(wxh).view(np.uint16)
        )
        np.testing.assert_array_equal(np.asarray(xg), np.asarray(wxg))
        assert np.asarray(xg)[0] == np.float32(0.03) and xh.dtype == jnp.float16


def test_pre_block_from_xhat_is_the_block_on_x():
    """Off CUDA, bitwise: pre_attention_block(xq=xhat_input(x)) equals pre_attention_block(x),
    at 8 rows (the block-order reference) and 32 (the dot order)."""
    for b in (8, 32):
        qkv, x, norm, qn, kn, cache, positions = _pre_inputs(b)
        for layer in (0, 1):
            li = jnp.int32(layer)
            want = _pre(x, qkv, norm, qn, kn, positions, jnp.int32(2), cache, cache, li)
            xq = xhat_input(x, qkv, norm, layer=li, eps=1e-6)
            got = _pre(None, qkv, norm, qn, kn, positions, jnp.int32(2), cache, cache, li, xq=xq)
            for a, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


@needs_nvrtc
def test_chain_across_layers_lowers(tmp_path, monkeypatch):
    """Lowered for CUDA at 32 rows: the block with next_qkv ends in down's GEMM (partials) and a
    finish-quantizer reading the qkv stacks (its scale [L], the input norm [L, D]) built to read
    them at layer + 1 of L = 2; the pre block on x_hat is the GEMM and the rope kernel;
    xhat_input is one quantizer launch."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    seen = []
    build = nvfp4_quant.build

    def recording(*a, **kw):
        kern = build(*a, **kw)
        seen.append(kern)
        return kern

    monkeypatch.setattr(nvfp4_quant, "build", recording)
    o, g, d = _block()
    out, x, norm = _inputs(32)
    qkv, inorm = _qkv_stack()
    f = jax.jit(lambda out, x: post_attention_block(out, x, o, g, d, norm=norm, layer=jnp.int32(0),
                                                    next_qkv=qkv, next_norm=inorm))  # fmt: skip
    text = f.trace(out, x).lower(lowering_platforms=("cuda",)).as_text()
    gemm = nvfp4_gemm.ENTRY
    assert _entries(text) == [nvfp4_quant.ENTRY, gemm, FIN, gemm, FIN, gemm, FIN], _entries(text)
    last = [c for c in _ptx_calls(text) if c[0] == FIN][-1]
    assert ", tensor<2xf32>, tensor<2x1024xbf16>, tensor<i32>" in last[1], last
    assert "tensor<32x1024xbf16>, tensor<32x1024xf16>, tensor<32xf32>" in last[2], last
    fin_q = [k for k in seen if k.finish is not None and k.finish.next_layers]
    assert len(fin_q) == 1 and fin_q[0].finish.next_layers == 2 and fin_q[0].finish.residual
    assert fin_q[0].chunk == D and fin_q[0].finish.store_y
    qkv_p, xx, nrm, qn, kn, cache, positions = _pre_inputs(32)
    xq = (jnp.zeros((32, D), jnp.float16), jnp.ones((32,), jnp.float32))
    pre = jax.jit(lambda xh, xg: _pre(None, qkv_p, nrm, qn, kn, positions, jnp.int32(2), cache,
                                      cache, jnp.int32(1), xq=(xh, xg)))  # fmt: skip
    text = pre.trace(*xq).lower(lowering_platforms=("cuda",)).as_text()
    assert _entries(text) == [gemm, "qk_norm_rope_cache"], _entries(text)
    q = jax.jit(lambda x: xhat_input(x, qkv_p, nrm, layer=jnp.int32(1), eps=1e-6))
    assert _entries(q.trace(xx).lower(lowering_platforms=("cuda",)).as_text()) == [
        nvfp4_quant.ENTRY
    ]


def test_chain_across_layers_errors_name_the_value():
    o, g, d = _block()
    out, x, norm = _inputs(16)
    qkv, inorm = _qkv_stack()
    with pytest.raises(ValueError, match=r"next_norm.shape=\(1024,\)"):
        post_attention_block(out, x, o, g, d, norm=norm, layer=0, next_qkv=qkv, next_norm=inorm[0])
    qkv_p, xx, nrm, qn, kn, cache, positions = _pre_inputs(8)
    with pytest.raises(ValueError, match=r"xq \(\(8, 512\) float16, \(8,\) float32\)"):
        _pre(None, qkv_p, nrm, qn, kn, positions, jnp.int32(2), cache, cache, jnp.int32(1),
             xq=(jnp.zeros((8, 512), jnp.float16), jnp.ones((8,), jnp.float32)))  # fmt: skip
    with pytest.raises(ValueError, match=r"x \(8, 512\) bfloat16, expected \[M, 1024\]"):
        xhat_input(xx[:, :512], qkv_p, nrm, layer=0, eps=1e-6)
    with pytest.raises(nvfp4_gemv.KernelError, match="next_layers=-1"):
        nvfp4_quant.FinishIn(splitk=2, next_layers=-1)
    from cuda_ops import rope_cache as rk

    shape = rk.Shape(batch=8, heads=HEADS, kv_heads=KV, head_dim=HD, slots=8, qk_norm=True,
                     eps=1e-6, index_rows=False)  # fmt: skip
    with pytest.raises(nvfp4_gemv.KernelError, match="reads no next layer"):
        rk.build(shape, arch="compute_90", finish=nvfp4_quant.FinishIn(splitk=2, next_layers=2))
