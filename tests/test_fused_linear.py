"""Fused NVFP4 decode linears (rejax/ops/fused_linear.py): the reference is the unfused
composition bitwise, the fused decoder equals the unfused one, and the CUDA lowering emits one
kernel launch per fused linear."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import decode_step_cuda_text

import rejax
from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemm, nvfp4_gemm_wgmma, nvfp4_gemv, nvfp4_quant
from rejax import layers, nvfp4, sampling
from rejax import params as rparams
from rejax.cache import init_cache
from rejax.config import WEIGHT_PREFETCH_DEFAULTS, Config, weight_prefetch_policy
from rejax.data import TINY_MODEL
from rejax.decode import decode_step, prefill
from rejax.ops import _dispatch
from rejax.ops import fused_linear as fl
from rejax.params import init_params

L, N, K = 3, 64, 256


def _unfused(x, r, i, *, params, norm, prologue):
    """The composition a fused linear stands for: prologue, the NVFP4 linear, the residual add."""
    if prologue == "rmsnorm":
        h = layers.rms_norm(x, layers.take(norm, i), 1e-6)
    elif prologue == "swiglu":
        h = layers.swiglu(x[:, :K], x[:, K:])
    else:
        h = x
    return r + layers.linear(h, params, "nvfp4", layer=i)


def _stacked(per_row: bool, key=0):
    rng = np.random.default_rng(key)
    ws = [jnp.asarray(rng.standard_normal((N, K)) * 0.05, jnp.float32) for _ in range(L)]
    if per_row:  # two shards with their own global scales: one scale per output row
        mats = [
            nvfp4.concat_rows([nvfp4.quantize_weight(w[:40]), nvfp4.quantize_weight(3 * w[40:])])
            for w in ws
        ]
        assert mats[0].per_row
    else:
        mats = [nvfp4.quantize_weight(w) for w in ws]
    return nvfp4.stack(mats)


def _bf16(a):
    return jnp.asarray(a, jnp.float32).astype(jnp.bfloat16)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize("m", [3, 16])  # the GEMV's rows and the GEMM's
def test_reference_is_the_unfused_composition_bitwise(m, prologue, per_row, static):
    rng = np.random.default_rng(1)
    w = _stacked(per_row)
    width = 2 * K if prologue == "swiglu" else K
    x = _bf16(rng.standard_normal((m, width)) * 2)
    x = x.at[0, :16].set(0).at[1, 16:32].set(3e4)  # a zero block and a saturating one
    norm = _bf16(1 + 0.1 * rng.standard_normal((L, K)))
    res = _bf16(rng.standard_normal((m, N)))
    # a static scale per layer, different for each: the kernel operand is the whole stack
    scale = jnp.asarray(0.01 * (1 + np.arange(L)), jnp.float32) if static else None
    params = {"weight": w} | ({"input_scale": scale} if static else {})
    i = jnp.int32(2)
    got = jax.jit(
        lambda x, r, i: fl.fused_linear(
            x, params, layer=i, prologue=prologue, norm=norm, eps=1e-6, residual=r
        )
    )(x, res, i)

    want = jax.jit(functools.partial(_unfused, params=params, norm=norm, prologue=prologue))(
        x, res, i
    )
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_bad_arguments_are_refused():
    w = _stacked(False)
    x = _bf16(np.ones((2, K)))
    with pytest.raises(ValueError, match="prologue="):
        fl.fused_linear(x, {"weight": w}, layer=0, prologue="gelu")
    with pytest.raises(ValueError, match="needs norm="):
        fl.fused_linear(x, {"weight": w}, layer=0, prologue="rmsnorm")
    with pytest.raises(ValueError, match="must end in 512"):
        fl.fused_linear(x, {"weight": w}, layer=0, prologue="swiglu")
    with pytest.raises(ValueError, match="residual.shape"):
        fl.fused_linear(x, {"weight": w}, layer=0, residual=_bf16(np.ones((2, N + 1))))
    with pytest.raises(ValueError, match="bfloat16"):
        fl.fused_linear(x.astype(jnp.float32), {"weight": w}, layer=0)
    with pytest.raises(ValueError, match="one input scale per matrix"):
        fl.fused_linear(x, {"weight": w, "input_scale": jnp.ones((L, 2))}, layer=0)
    with pytest.raises(ValueError, match="pass layer="):
        fl.fused_linear(x, {"weight": w})


def _decode_logits(params, steps=3):
    cfg = params.cfg
    b, p = 2, 5
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, p)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache = init_cache(cfg, b, p + steps, jnp.bfloat16)
    logits, cache = prefill(params, tokens, positions, cache)
    out = [np.asarray(logits)]
    smp = sampling.Greedy()
    st = sampling.sampler_init(smp, b)
    keys = jax.random.split(jax.random.key(0), b)
    pos = jnp.full((b,), p, jnp.int32)
    for i in range(steps):
        _tok, logits, cache, st, _info = decode_step(
            params, logits, cache, pos, smp, st, keys, jnp.int32(i)
        )
        out.append(np.asarray(logits))
        pos = pos + 1
    return np.stack(out)


@pytest.mark.parametrize("fusion", ["fused", "split", "mixed"])
@pytest.mark.parametrize("static", [True, False])
def test_fused_decoder_equals_unfused_bitwise(static, fusion):
    """W4A4 decoder in bf16: prefill and decode-step logits with linear_fusion="fused",
    "split" or "mixed" equal "unfused" exactly on CPU (the fused reference is the
    composition)."""
    params = init_params(Config(quant="nvfp4", linear_fusion=fusion), 7, jnp.bfloat16)
    if static:
        scale = jnp.full((params.cfg.num_layers,), 0.02, jnp.float32)
        weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
        params = dataclasses.replace(params, weights=weights)
    fused = _decode_logits(params)
    unfused_cfg = dataclasses.replace(params.cfg, linear_fusion="unfused")
    unfused = _decode_logits(dataclasses.replace(params, cfg=unfused_cfg))
    assert np.isfinite(fused).all()
    np.testing.assert_array_equal(fused, unfused)


def test_config_refuses_unknown_fusion():
    with pytest.raises(ValueError, match="linear_fusion"):
        Config(linear_fusion="yes")


# ----------------------------------------------------------------------------- CUDA lowering


@pytest.fixture
def stub_compiler(monkeypatch):
    """NVRTC replaced by a stub that returns PTX with the requested entries, so the lowering is
    checked without cuda-python; records the -D constants of every GEMV and quantizer build."""
    seen = []

    def fake_compile(source, *, name, defines, arch, options=(), use_cache=True):
        if name == nvfp4_gemm.SOURCE:
            entries = {
                nvfp4_gemm.ENTRY: nvfp4_gemm.N_INPUTS + 1 + defines.get("EPI_RES", 0),
                nvfp4_gemm.FINISH_ENTRY: nvfp4_gemm.FINISH_INPUTS + 1 + defines.get("EPI_RES", 0),
            }
        elif name == nvfp4_gemm_wgmma.SOURCE.name:
            entries = {
                nvfp4_gemm_wgmma.ENTRY: nvfp4_gemm_wgmma.N_INPUTS + 1,
                nvfp4_gemm_wgmma.FINISH_ENTRY: nvfp4_gemm_wgmma.FINISH_INPUTS + 1,
            }
        else:
            seen.append(defines)
            if defines.get("FIN_SPLITK"):  # 7 inputs; y, x_hat, xg
                entries = {nvfp4_quant.FIN_ENTRY: 10}
            elif defines.get("QUANT_ONLY"):  # outputs: codes, scales, xg; or x_hat (tiles), xg
                entries = {"nvfp4_quantize_bf16": 6 if defines.get("XHAT_OUT") else 7}
            elif defines.get("X_BF16"):
                entries = {"nvfp4_gemv_w4a4_bf16": 9}
            elif defines["ACT_W4A4"]:
                entries = {  # + res [M, N], + (codes, scales) per prefetch target
                    "nvfp4_gemv_w4a4": 8
                    + defines.get("EPI_RES", 0)
                    + 2 * defines.get("PF_TARGETS", 0)
                }
            else:
                entries = {"nvfp4_gemv_w4a16": 6}
        text = ".version 9.0\n.target sm_90\n"
        for entry, nparams in entries.items():
            params = ", ".join(f".param .u64 p{i}" for i in range(nparams))
            text += f".visible .entry {entry}({params})\n{{ ret; }}\n"
        return text

    mods = (nvfp4_gemv, nvfp4_quant, nvfp4_gemm, nvfp4_gemm_wgmma)
    for mod in mods:
        monkeypatch.setattr(mod, "compile_ptx", fake_compile)
        mod._build_cached.cache_clear()
    # lowerings are cached by JAX: a decode step lowered before (another test) would not call
    # the lowering rules, so nothing would be built and recorded here
    jax.clear_caches()
    yield seen
    for mod in mods:
        mod._build_cached.cache_clear()


def test_split_lowers_to_a_quantizer_and_a_gemv_per_linear(stub_compiler):
    """linear_fusion="split": per layer four `nvfp4_quantize_bf16` launches (rmsnorm for qkv
    and gate_up, none for o, swiglu for down; no residual inside: o and down's GEMVs add it)
    and four plain `nvfp4_gemv_w4a4` launches, and no fused GEMV."""
    cfg = Config(
        quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, linear_fusion="split",
        num_layers=3,
    )  # fmt: skip
    text = decode_step_cuda_text(cfg)
    entries = re.findall(r"name = \\22(\w+)\\22", text)
    # the quantizer's operands: x, the whole stack of 3 static input scales (not a slice), the
    # norm weight, the layer index
    quant_ops = re.findall(r"\} : \((tensor<2x\d+xbf16>, tensor<\d+xf32>),", text)
    assert quant_ops and all(o.endswith("tensor<3xf32>") for o in quant_ops), quant_ops
    assert entries.count("nvfp4_quantize_bf16") == 4, entries
    assert entries.count("nvfp4_gemv_w4a4") == 4, entries
    assert "nvfp4_gemv_w4a4_bf16" not in entries
    quant = sorted((d["PRO"], d["EPI_RES"], d["NW_STACK"], d["XG_STACK"]) for d in stub_compiler
                   if d.get("QUANT_ONLY"))  # fmt: skip
    # qkv and gate_up share one build (same K, same prologue): three distinct quantizers, each
    # reading the stacked input scales at the layer (no slice of them launched before it)
    assert quant == [(0, 0, 0, 1), (1, 0, 1, 1), (2, 0, 0, 1)], quant
    assert all(d["M_TOK"] == 1 for d in stub_compiler if d.get("QUANT_ONLY"))


def _ptx_calls(text: str) -> list[tuple[str, list[str]]]:
    """(entry, operand types) of every PTX custom call in lowered StableHLO text."""
    calls = []
    for line in text.splitlines():
        if "custom_call @__gpu$xla.gpu.ptx" in line:
            name = re.search(r"name = \\22(\w+)\\22", line).group(1)
            calls.append((name, re.search(r"\} : \(([^)]*)\) ->", line).group(1).split(", ")))
    return calls


def _bf16_adds(text: str, shape: str) -> int:
    """Number of bf16 adds of `shape` ("MxN", a regex) in lowered StableHLO text."""
    return len(re.findall(rf"stablehlo\.add %\S+, %\S+ : tensor<{shape}xbf16>", text))


# a K split (the finish kernel adds the residual); no max_m, so M = 512 takes the GEMM too
# KT 128: K = 256 leaves no room for a split in 256-element stages (the M <= 16 default)
# the mma.sync GEMM at any M: no row bound, no wgmma range
GEMM_SPLIT = nvfp4_gemm.GemmOptions(splitk=2, kt=128, max_m=None, wgmma_min_m=None)


@pytest.mark.parametrize("prologue", ["none", "swiglu"])  # o_proj, down_proj
@pytest.mark.parametrize("m", [1, 4, 8])
def test_split_residual_is_the_linear_epilogue(stub_compiler, prologue, m):
    """kernels="two" with a residual: the linear after the quantizer takes res [M, N] as an
    operand right after xg and no bf16 add of [M, N] is left after it. Below the GEMM's min_m
    (8) the plain GEMV built with EPI_RES (xp, xs, xg, res, wp, ws, wg, layer); at M = 8 the
    GEMM (x_hat, xg, res, wp, ws, wg, layer) and, with a K split, its finish kernel (partials,
    xg, res, wg, layer)."""
    w = _stacked(False)
    width = 2 * K if prologue == "swiglu" else K
    params = {"weight": w, "input_scale": jnp.full((L,), 0.02, jnp.float32)}
    kw = {"layer": jnp.int32(1), "kernels": "two", "gemm_options": GEMM_SPLIT}
    x, r = jnp.zeros((m, width), jnp.bfloat16), jnp.zeros((m, N), jnp.bfloat16)
    # off by default: the add stays an XLA op after the linear, which builds no EPI_RES
    f = jax.jit(lambda x, r: fl.fused_linear(x, params, prologue=prologue, residual=r, **kw))
    text = f.trace(x, r).lower(lowering_platforms=("cuda",)).as_text()
    assert _bf16_adds(text, f"{m}x{N}") == 1
    linears = [d for d in stub_compiler if not d.get("QUANT_ONLY")]
    # (the GEMM at M >= 8 compiles outside the stub: its builds are not recorded here)
    assert all("EPI_RES" not in d for d in linears), linears
    assert linears or m >= nvfp4_gemm.DEFAULT_MIN_M
    stub_compiler.clear()
    f = jax.jit(
        lambda x, r: fl.fused_linear(
            x, params, prologue=prologue, residual=r, residual_epilogue=True, **kw
        )
    )
    text = f.trace(x, r).lower(lowering_platforms=("cuda",)).as_text()
    calls = _ptx_calls(text)
    names = [name for name, _ in calls]
    res = f"tensor<{m}x{N}xbf16>"
    assert _bf16_adds(text, f"{m}x{N}") == 0, "the residual add is still an XLA op"
    if m < nvfp4_gemm.DEFAULT_MIN_M:
        assert names == [nvfp4_quant.ENTRY, "nvfp4_gemv_w4a4"], names
        assert len(calls[1][1]) == 8 and calls[1][1][3] == res, calls[1][1]
        gemv = [d for d in stub_compiler if not d.get("QUANT_ONLY")]
        assert [d.get("EPI_RES") for d in gemv] == [1], gemv
    else:
        assert names == [nvfp4_quant.ENTRY, nvfp4_gemm.ENTRY, nvfp4_gemm.FINISH_ENTRY], names
        assert len(calls[1][1]) == 7 and calls[1][1][2] == res, calls[1][1]
        assert len(calls[2][1]) == 5 and calls[2][1][2] == res, calls[2][1]
    # without a residual the linear keeps its operands (GEMV 7, GEMM 6) and builds no EPI_RES
    stub_compiler.clear()
    f = jax.jit(lambda x: fl.fused_linear(x, params, **kw))
    text = f.trace(jnp.zeros((m, K), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    sizes = {name: len(ops) for name, ops in _ptx_calls(text)}
    if m < nvfp4_gemm.DEFAULT_MIN_M:
        assert sizes["nvfp4_gemv_w4a4"] == 7, sizes
        assert all("EPI_RES" not in d for d in stub_compiler if not d.get("QUANT_ONLY"))
    else:
        assert sizes[nvfp4_gemm.ENTRY] == 6 and sizes[nvfp4_gemm.FINISH_ENTRY] == 4, sizes


def test_split_decode_step_adds_the_residuals_in_the_linears(stub_compiler):
    """linear_fusion="split", residual_fusion="fused": the o_proj and down_proj linears take the
    residual (res [B, D]
    after xg) and the scanned layer has no bf16 add of [B, D] left, two fewer than the unfused
    decoder's; at batch 2 in the GEMV, at batch 8 in the GEMM."""
    cfg = Config(
        quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, linear_fusion="split",
        num_layers=3, residual_fusion="fused",
    )  # fmt: skip
    # [B, D] or [B, T, D] (the unfused decoder adds before folding T into M)
    unfused = dataclasses.replace(cfg, linear_fusion="unfused")
    assert _bf16_adds(decode_step_cuda_text(unfused, 2), "2x(1x)?256") == 2
    # residual_fusion "unfused" (the default): the split path keeps its two adds
    plain = dataclasses.replace(cfg, residual_fusion="unfused")
    assert _bf16_adds(decode_step_cuda_text(plain, 2), "2x(1x)?256") == 2
    for b, entry, at in ((2, "nvfp4_gemv_w4a4", 3), (8, nvfp4_gemm.ENTRY, 2)):
        text = decode_step_cuda_text(cfg, b)
        ops = [o for name, o in _ptx_calls(text) if name == entry]
        n = 7 if entry == nvfp4_gemm.ENTRY else 8  # the operands with the residual
        assert sorted(len(o) for o in ops) == [n - 1, n - 1, n, n], ops
        assert all(o[at] == f"tensor<{b}x256xbf16>" for o in ops if len(o) == n), ops
        assert _bf16_adds(text, f"{b}x(1x)?256") == 0, b


# (M, GEMM choices) above the GEMV's 8 rows: decode batches and a prefill, two of them with a K
# split (the GEMM's finish kernel then stores the output)
LARGE_M = [
    (9, nvfp4_gemm.DEFAULT_OPTIONS),
    (16, GEMM_SPLIT),
    (64, nvfp4_gemm.DEFAULT_OPTIONS),
    (512, GEMM_SPLIT),
]


def _ssa(line: str) -> tuple[str, list[str]]:
    """(result name, operand names) of one custom call line of lowered StableHLO text."""
    result = re.match(r"\s*(%[\w#]+)", line).group(1)
    return result, re.search(r"@__gpu\$xla\.gpu\.ptx\(([^)]*)\)", line).group(1).split(", ")


@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize("kernels", ["two", "one"])
@pytest.mark.parametrize(("m", "opts"), LARGE_M, ids=[str(m) for m, _ in LARGE_M])
def test_above_eight_rows_the_quantizer_kernel_feeds_the_gemm(stub_compiler, monkeypatch, m,
                                                               opts, kernels, prologue):  # fmt: skip
    """With GemmOptions.x_quant "kernel" (the default), above the GEMV's M (8) kernels "two" and "one" lower
    to the quantizer kernel in its x_hat form (prologue inside, grid [M, K / chunk]), then the
    GEMM (with a K split, and its finish
    kernel) on the quantizer's x_hat and global scale: no GEMV launch, no XLA op on the
    activations (no prologue, quantizer or x_hat transpose: layout ops only), no bf16 dot over
    the dequantized weight (the reference), no reference note. With residual_epilogue the
    residual is an operand of the GEMM (and of the finish kernel) right after xg and no bf16
    [M, N] add is left; without it the add is one XLA op."""
    monkeypatch.setattr(_dispatch, "_NOTED", set())
    w = _stacked(False)
    width = 2 * K if prologue == "swiglu" else K
    params = {"weight": w, "input_scale": jnp.full((L,), 0.02, jnp.float32)}
    norm = jnp.ones((L, K), jnp.bfloat16)
    split = opts is GEMM_SPLIT
    opts = dataclasses.replace(opts, x_quant="kernel")  # the x_hat quantizer
    kw = {"layer": jnp.int32(1), "prologue": prologue, "norm": norm, "kernels": kernels,
          "gemm_options": opts}  # fmt: skip
    x, r = jnp.zeros((m, width), jnp.bfloat16), jnp.zeros((m, N), jnp.bfloat16)
    finish = [nvfp4_gemm.FINISH_ENTRY] if nvfp4_gemm.plan(m, N, K, options=opts).partials else []
    assert bool(finish) == split
    for residual, epilogue in ((False, False), (True, False), (True, True)):
        f = jax.jit(
            lambda x, r, residual=residual, epilogue=epilogue: fl.fused_linear(
                x, params, residual=r if residual else None, residual_epilogue=epilogue, **kw
            )
        )
        text = f.trace(x, r).lower(lowering_platforms=("cuda",)).as_text()
        what = f"M={m} kernels={kernels} prologue={prologue} res={residual} epi={epilogue}"
        calls = _ptx_calls(text)
        assert [name for name, _ in calls] == [nvfp4_quant.ENTRY, nvfp4_gemm.ENTRY, *finish], what
        assert "dot_general" not in text, what  # the reference's dot over the bf16 weight
        # the prologue and the x_hat layout run in the quantizer, not in XLA: besides the
        # kernels, layout ops only (and the residual's add when it is not in the epilogue)
        assert "stablehlo.rsqrt" not in text and "call @silu(" not in text, what
        assert "stablehlo.transpose" not in text and "stablehlo.gather" not in text, what
        ops = set(re.findall(r"= (?:\"?)(stablehlo\.[a-z_]+)", text)) - {"stablehlo.add"}
        layout = {"stablehlo.reshape", "stablehlo.bitcast_convert", "stablehlo.broadcast_in_dim",
                  "stablehlo.constant", "stablehlo.custom_call"}  # fmt: skip
        assert ops <= layout, (what, ops - layout)
        in_kernel = residual and epilogue
        # quantizer (x, xg, norm, layer); GEMM (x_hat, xg, [res,] wp, ws, wg, layer); finish
        # (partials, xg, [res,] wg, layer)
        sizes = [4, 6 + in_kernel, 4 + in_kernel][: len(calls)]
        assert [len(ops) for _, ops in calls] == sizes, what
        assert calls[1][1][0] == f"tensor<{m}x{K}xf16>" and calls[1][1][1] == f"tensor<{m}xf32>"
        lines = [ln for ln in text.splitlines() if "custom_call @__gpu$xla.gpu.ptx" in ln]
        quant, _ = _ssa(lines[0])
        assert _ssa(lines[1])[1][:2] == [f"{quant}#0", f"{quant}#1"], what  # its x_hat, xg
        assert f"-> (tensor<{m}x{K}xf16>, tensor<{m}xf32>)" in lines[0], what
        chunk = nvfp4_quant.default_chunk(K, "xhat")
        assert f"grid_x = {m}, grid_y = {K // chunk}," in lines[0], what
        if in_kernel:
            assert all(ops[2] == f"tensor<{m}x{N}xbf16>" for _, ops in calls[1:]), (what, calls)
        assert _bf16_adds(text, f"{m}x{N}") == (residual and not epilogue), what
    built = [d for d in stub_compiler if d.get("QUANT_ONLY")]
    assert built and all(d["XHAT_OUT"] == 1 for d in built), built
    assert {d["PRO"] for d in built} == {nvfp4_gemv.PROLOGUES.index(prologue)}
    assert [why for op, why in _dispatch.noted() if op == fl.OP] == []
    # impl="cuda" takes the same lowering instead of refusing the shape
    f = jax.jit(lambda x: fl.fused_linear(x, params, impl="cuda", **kw))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    names = [name for name, _ in _ptx_calls(text)]
    assert names == [nvfp4_quant.ENTRY, nvfp4_gemm.ENTRY, *finish]


GEMM_M = [(8, nvfp4_gemm.DEFAULT_OPTIONS), *LARGE_M]  # the GEMM's rows, from its min_m (8)


@pytest.mark.parametrize("x_quant", ["xla", "kernel"])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize(("m", "opts"), GEMM_M, ids=[str(m) for m, _ in GEMM_M])
def test_without_the_xhat_quantizer_the_gemm_path_is_the_former_one(stub_compiler, monkeypatch,
                                                                    caplog, m, opts, prologue,
                                                                    x_quant):  # fmt: skip
    """With GemmOptions.x_quant "xla", or "kernel" (the default) where the quantizer's x_hat
    form does not build, the two-step lowering in front of the GEMM is the one from before that
    form: up to 8 rows the quantizer kernel's codes form (prologue inside), above them the
    prologue and quantizer as XLA ops (the composition's own); then gemm_x_operand's K
    permutation as an XLA op and the GEMM (and its finish kernel), the residual in its
    epilogue. A failed x_hat build is logged, not a reference-path note (the GEMM still runs);
    "xla" does not try it."""
    monkeypatch.setattr(_dispatch, "_NOTED", set())
    opts = dataclasses.replace(opts, x_quant=x_quant)
    fl._note_no_xhat.cache_clear()  # logged once per reason: this test's log
    build = nvfp4_quant.build

    def no_xhat(*args, out="codes", **kw):
        if out == "xhat":
            raise nvfp4_gemv.KernelError("no xhat here")
        return build(*args, out=out, **kw)

    monkeypatch.setattr(nvfp4_quant, "build", no_xhat)
    w = _stacked(False)
    width = 2 * K if prologue == "swiglu" else K
    params = {"weight": w, "input_scale": jnp.full((L,), 0.02, jnp.float32)}
    norm = jnp.ones((L, K), jnp.bfloat16)
    x, r = jnp.zeros((m, width), jnp.bfloat16), jnp.zeros((m, N), jnp.bfloat16)
    finish = [nvfp4_gemm.FINISH_ENTRY] if nvfp4_gemm.plan(m, N, K, options=opts).partials else []
    f = jax.jit(
        lambda x, r: fl.fused_linear(
            x, params, layer=jnp.int32(1), prologue=prologue, norm=norm, residual=r,
            residual_epilogue=True, kernels="two", gemm_options=opts,
        )
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="rejax.ops"):
        text = f.trace(x, r).lower(lowering_platforms=("cuda",)).as_text()
    calls = _ptx_calls(text)
    codes = m <= nvfp4_gemv.MAX_M  # the codes form of the quantizer kernel
    assert [name for name, _ in calls] == [nvfp4_quant.ENTRY] * codes + [nvfp4_gemm.ENTRY, *finish]
    assert "dot_general" not in text
    assert ("stablehlo.rsqrt" in text) == (prologue == "rmsnorm" and not codes)
    assert ("call @silu(" in text) == (prologue == "swiglu" and not codes)
    assert "stablehlo.transpose" in text  # gemm_x_operand's K permutation
    assert [len(ops) for _, ops in calls] == ([4] * codes + [7, 5])[: len(calls)]
    assert all("XHAT_OUT" not in d for d in stub_compiler), stub_compiler
    assert _bf16_adds(text, f"{m}x{N}") == 0
    assert ("no xhat here" in caplog.text) == (x_quant == "kernel")
    assert [why for op, why in _dispatch.noted() if op == fl.OP] == []


@pytest.mark.parametrize("epilogue", [False, True])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
def test_two_step_body_without_the_quantizer_kernel_is_the_composition(monkeypatch, prologue,
                                                                       epilogue):  # fmt: skip
    """The two-step lowering's body at M = 16 (quantizer reference ops, then the linear, the
    residual in its epilogue or after it), run on CPU with the linear's reference: bitwise the
    unfused composition, for static (stacked) and dynamic input scales."""

    def linear_on_cpu(args, **kw):  # the body asks for the kernel, which CPU has not
        return gemv_call(args, **{**kw, "impl": "auto"})

    gemv_call = fl.gemv_call
    monkeypatch.setattr(fl, "gemv_call", linear_on_cpu)
    rng = np.random.default_rng(5)
    m = 16
    w = _stacked(False)
    width = 2 * K if prologue == "swiglu" else K
    x = _bf16(rng.standard_normal((m, width)) * 2).at[3, 16:32].set(3e4)
    norm = _bf16(1 + 0.1 * rng.standard_normal((L, K)))
    res = _bf16(rng.standard_normal((m, N)))
    i = jnp.int32(2)
    weight = (w.packed, jax.lax.bitcast_convert_type(w.scales, jnp.uint8), w.global_scale)
    for scale in (jnp.asarray([0.01, 0.02, 0.03], jnp.float32), None):
        params = {"weight": w} | ({} if scale is None else {"input_scale": scale})
        fused = nvfp4_gemv.Fused(
            prologue=prologue, residual=True, dynamic=scale is None, eps=1e-6,
            norm_stacked=True, scale_stacked=scale is not None,
        )  # fmt: skip
        xg = jnp.ones((1,), jnp.float32) if scale is None else scale
        body = functools.partial(
            fl._two_kernels, n=N, k=K, fused=fused, quant=None, options=nvfp4_gemv.DEFAULT_OPTIONS,
            gemm_options=nvfp4_gemm.DEFAULT_OPTIONS, gw_rows=False, epilogue=epilogue,
        )  # fmt: skip
        got = jax.jit(body)(x, xg, norm, res, *weight, i)

        unfused = functools.partial(_unfused, params=params, norm=norm, prologue=prologue)
        want = jax.jit(unfused)(x, res, i)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("x_quant", ["xla", "kernel"])
@pytest.mark.parametrize("fusion", ["split", "fused"])
def test_decode_step_at_batch_16_takes_the_gemm(stub_compiler, monkeypatch, fusion, x_quant):
    """A decode step at batch 16 lowered for CUDA, linear_fusion "split" or "fused": the four W4A4
    linears of the scanned layer are four GEMM launches (o and down with the residual operand,
    residual_fusion "fused"), no GEMV launch, no bf16 [B, D] add, and no reference note for the
    fused linears. With Config.gemm_x_quant "kernel" (the default) four quantizer launches in
    the x_hat form (rmsnorm for qkv and gate_up, none for o, swiglu for down) write the GEMMs'
    x_hat; with "xla" no quantizer kernel runs (XLA quantizes)."""
    monkeypatch.setattr(_dispatch, "_NOTED", set())
    cfg = Config(
        quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, linear_fusion=fusion,
        num_layers=3, residual_fusion="fused", gemm_x_quant=x_quant,
    )  # fmt: skip
    b = 16
    text = decode_step_cuda_text(cfg, b)
    calls = _ptx_calls(text)
    gemms = [ops for name, ops in calls if name == nvfp4_gemm.ENTRY]
    names = [name for name, _ in calls]
    assert not set(names) & {"nvfp4_gemv_w4a4", "nvfp4_gemv_w4a4_bf16"}, names
    kernel = x_quant == "kernel"
    assert names.count(nvfp4_quant.ENTRY) == 4 * kernel, names
    quant = sorted(d["PRO"] for d in stub_compiler if d.get("QUANT_ONLY") and d.get("XHAT_OUT"))
    assert quant == [0, 1, 2] * kernel, quant  # qkv and gate_up share one build (same K, rmsnorm)
    assert sorted(len(o) for o in gemms) == [6, 6, 7, 7], gemms
    assert all(o[0].endswith("xf16>") and o[1] == f"tensor<{b}xf32>" for o in gemms), gemms
    assert all(o[2] == f"tensor<{b}x256xbf16>" for o in gemms if len(o) == 7), gemms
    assert _bf16_adds(text, f"{b}x(1x)?256") == 0
    assert [why for op, why in _dispatch.noted() if op == fl.OP] == []


def test_split_refuses_unknown_kernels():
    w = _stacked(False)
    x = jnp.zeros((1, w.k), jnp.bfloat16)
    with pytest.raises(ValueError, match="kernels='three'"):
        fl.fused_linear(x, {"weight": w}, layer=0, kernels="three")


def test_decode_step_lowers_to_one_launch_per_fused_linear(stub_compiler):
    """On CUDA each decoder layer's four W4A4 linears are four `nvfp4_gemv_w4a4_bf16` launches
    (norms, SwiGLU, quantization and residuals inside them) and nothing else of them is a custom
    call; the scanned body holds them once."""
    cfg = Config(
        quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, linear_fusion="fused"
    )
    params = rparams.init_params(cfg, 0, jnp.bfloat16)
    scale = jnp.full((cfg.num_layers,), 0.02, jnp.float32)
    weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
    params = dataclasses.replace(params, weights=weights)
    b = 2
    cache = init_cache(cfg, b, 8, jnp.bfloat16)
    smp = sampling.Greedy()
    args = (
        params,
        jnp.zeros((b, cfg.vocab_size), jnp.float32),
        cache,
        jnp.zeros((b,), jnp.int32),
        smp,
        sampling.sampler_init(smp, b),
        jax.random.split(jax.random.key(0), b),
        jnp.int32(0),
    )
    text = decode_step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    entries = re.findall(r"name = \\22(\w+)\\22", text)
    assert entries.count("nvfp4_gemv_w4a4_bf16") == 4, entries
    assert "nvfp4_gemv_w4a4" not in entries  # no unfused launch left
    pro = sorted((d["PRO"], d["EPI_RES"], d["NW_STACK"]) for d in stub_compiler)
    # qkv and gate_up: rmsnorm (stacked norm weight), o: residual, down: swiglu + residual
    assert pro == [(0, 1, 0), (1, 0, 1), (1, 0, 1), (2, 1, 0)], pro
    unfused = dataclasses.replace(params, cfg=dataclasses.replace(cfg, linear_fusion="unfused"))
    args = (unfused, *args[1:])
    text = decode_step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"name = \\22(\w+)\\22", text).count("nvfp4_gemv_w4a4") == 4


def test_the_scanned_layer_holds_kernels_and_layout_ops_only(stub_compiler):
    """The default NVFP4 decode layer (split linears, rope_cache kernel, residual epilogues) on
    CUDA: besides its custom calls the scanned layer body holds only layout ops (reshapes,
    bitcasts, broadcast constants), so XLA has no fusion of its own to launch per layer. RoPE's
    frequencies are a constant, not a float32 power computed in every layer."""
    from _lowering import decode_step_cuda_text

    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, num_layers=4)
    text = decode_step_cuda_text(cfg, 1)
    bodies = [f for f in text.split("func.func")[1:] if "qk_norm_rope_cache" in f]
    assert len(bodies) == 1, len(bodies)  # the scan's body, once for all layers
    ops = {
        op
        for line in bodies[0].splitlines()
        if "custom_call" not in line
        for op in re.findall(r"= (?:\"?)(stablehlo\.[a-z_]+)", line)
    }
    layout = {"stablehlo.reshape", "stablehlo.bitcast_convert", "stablehlo.broadcast_in_dim",
              "stablehlo.constant"}  # fmt: skip
    assert ops <= layout, ops - layout
    entries = re.findall(r"name = \\22(\w+)\\22", bodies[0])
    assert entries.count("nvfp4_quantize_bf16") == 4 and entries.count("nvfp4_gemv_w4a4") == 4
    assert entries.count("qk_norm_rope_cache") == 1, entries


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_prebuild_compiles_exactly_what_build_reads(tmp_path, monkeypatch):
    """`prebuild` compiles the kernels in threads into the disk cache: the builds afterwards
    (as the CUDA lowering calls them) find every kernel there and compile nothing new."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    nvfp4_gemv._build_cached.cache_clear()
    fused = nvfp4_gemv.Fused(prologue="swiglu", residual=True)
    problems = [{"act": "w4a4x", "m": m, "n": 64, "k": 256, "fused": fused} for m in (1, 3)]
    problems += [
        {"act": "w4a4", "m": 2, "n": 64, "k": 256},
        {"act": "w4a4", "m": 2, "n": 64, "k": 256},
    ]
    kernels = nvfp4_gemv.prebuild(problems, arch="compute_90", num_sms=132, workers=2)
    assert [k.entry for k in kernels] == ["nvfp4_gemv_w4a4_bf16"] * 2 + ["nvfp4_gemv_w4a4"] * 2
    assert kernels[0].plan.fused == fused and kernels[2] is kernels[3]
    files = sorted(tmp_path.glob("*.ptx"))
    assert len(files) == 3
    nvfp4_gemv._build_cached.cache_clear()
    again = [nvfp4_gemv.build(**p, arch="compute_90", num_sms=132) for p in problems]
    assert [k.ptx for k in again] == [k.ptx for k in kernels]
    assert sorted(tmp_path.glob("*.ptx")) == files  # nothing compiled anew
    with pytest.raises(nvfp4_gemv.KernelError, match="unsupported shape"):
        nvfp4_gemv.prebuild([{"act": "w4a4", "m": 9, "n": 64, "k": 256}], arch="compute_90")
    nvfp4_gemv._build_cached.cache_clear()


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_quantizer_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    """NVRTC compiles `nvfp4_quantize_bf16` for every prologue, static and dynamic scales (the
    build checks the entry's 7 parameters), and the GEMV entries are left out of its PTX."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    nvfp4_quant._build_cached.cache_clear()
    try:
        for prologue in nvfp4_gemv.PROLOGUES:
            for dynamic in (False, True):
                fused = nvfp4_gemv.Fused(prologue=prologue, dynamic=dynamic, norm_stacked=True)
                kern = nvfp4_quant.build(8, 12288, fused, arch="compute_90")
                entries = cbuild.ptx_entries(kern.ptx)
                assert entries == {"nvfp4_quantize_bf16": 7}, entries
                cfg = kern.backend_config()
                # rows split over the grid: 12288 / 512 chunks of 128 threads each
                assert "grid_x = 8, grid_y = 24," in cfg and "block_x = 128," in cfg, cfg[-300:]
        one_cta = nvfp4_quant.build(1, 4096, nvfp4_gemv.PLAIN, arch="compute_90", chunk=4096,
                                    threads=256)  # fmt: skip
        assert "grid_y = 1," in one_cta.backend_config()
        assert nvfp4_quant.default_chunk(17 * 256) == 256
        for bad in (100, 384, 0):  # not a multiple of 128 / does not divide K / not positive
            with pytest.raises(nvfp4_gemv.KernelError, match=f"chunk={bad}"):
                nvfp4_quant.build(1, 4096, nvfp4_gemv.PLAIN, arch="compute_90", chunk=bad)
        with pytest.raises(nvfp4_gemv.KernelError, match="threads=48"):
            nvfp4_quant.build(1, 4096, nvfp4_gemv.PLAIN, arch="compute_90", threads=48)
        with pytest.raises(nvfp4_gemv.KernelError, match="residual"):
            nvfp4_quant.build(1, 4096, nvfp4_gemv.Fused(residual=True), arch="compute_90")
        with pytest.raises(nvfp4_gemv.KernelError, match="M=0"):
            nvfp4_quant.build(0, 4096, nvfp4_gemv.PLAIN, arch="compute_90")
        # any number of rows (the GEMM's decode batches): one grid row of CTAs each, one CTA a
        # row from ROW_CTA_MIN_M rows
        many = nvfp4_quant.build(256, 4096, nvfp4_gemv.PLAIN, arch="compute_90")
        assert "grid_x = 256, grid_y = 8," in many.backend_config()
        rows = nvfp4_quant.build(512, 4096, nvfp4_gemv.PLAIN, arch="compute_90")
        assert "grid_x = 512, grid_y = 1," in rows.backend_config()
    finally:
        nvfp4_quant._build_cached.cache_clear()


# ----------------------------------------------------------------------------- L2 prefetch

PREFETCH = "next:qkv_gu=0.5,at=start,mode=bulk,ef=1"


def test_prefetch_spec_parses_and_refuses_bad_items():
    """Config.weight_prefetch: "none", "next" with defaults, choices that override them; a bad
    spec is refused when the Config is built, naming the item."""
    assert weight_prefetch_policy("none") is None
    assert weight_prefetch_policy("next") == WEIGHT_PREFETCH_DEFAULTS
    got = weight_prefetch_policy(PREFETCH)
    assert (got["qkv_gu"], got["at"], got["mode"], got["ef"]) == (0.5, "start", "bulk", 1)
    for bad, what in [
        ("next:gu=1.5", "gu='1.5'"),
        ("next:mode=fast", "mode='fast'"),
        ("next:o", "bad item 'o'"),
        ("next:speed=1", "bad item 'speed=1'"),
        ("later", "expected 'none' or 'next"),
        ("next:ef=2", "ef='2'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(what)):
            Config(weight_prefetch=bad)


def test_prefetch_changes_no_number_on_cpu():
    """The prefetch hints take no part in the reference: a decode step of the bundled model
    gives the same logits bit for bit with and without them."""
    params = rejax.load(TINY_MODEL, quant="nvfp4")
    tokens = jnp.asarray([[3, 17, 29, 4, 11]])
    base = rejax.logits(params, tokens)
    cfg = dataclasses.replace(params.cfg, weight_prefetch=PREFETCH)
    hinted = rejax.logits(dataclasses.replace(params, cfg=cfg), tokens)
    np.testing.assert_array_equal(np.asarray(base), np.asarray(hinted))


def test_prefetch_lowers_to_gemv_operands_and_defines(stub_compiler):
    """With weight_prefetch on, each decode GEMV at batch 2 takes the next linear's stacks as
    operands after `layer` (qkv two targets: o and gate_up; o: gate_up; gate_up: down; down:
    the next layer's qkv) and is built with their shapes, layer deltas and row bytes; at batch
    16 (the GEMM) the hints are dropped and nothing is built with them."""
    cfg = Config(
        quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, num_layers=3,
        weight_prefetch=PREFETCH,
    )  # fmt: skip
    text = decode_step_cuda_text(cfg, 2)
    gemvs = [ops for name, ops in _ptx_calls(text) if name == "nvfp4_gemv_w4a4"]
    # qkv [3, 512, 128] codes (q 4x64 + k, v 2x64 = 512 rows of K 256), o [3, 256, 128],
    # gate_up [3, 1024, 128], down [3, 256, 256]
    stacks = sorted(tuple(o[-4::2]) if len(o) >= 11 else tuple(o[-2:-1]) for o in gemvs)
    want_ops = sorted([
        ("tensor<3x256x128xui8>", "tensor<3x1024x128xui8>"),  # qkv -> o, gate_up
        ("tensor<3x1024x128xui8>",),  # o -> gate_up
        ("tensor<3x256x256xui8>",),  # gate_up -> down
        ("tensor<3x512x128xui8>",),  # down -> next qkv
    ])  # fmt: skip
    assert stacks == want_ops, stacks
    builds = [d for d in stub_compiler if d.get("PF_TARGETS")]
    by_n = {d["N_OUT"]: d for d in builds}
    assert sorted(by_n) == [256, 512, 1024] and len(builds) == 4  # o and down share N = 256
    qkv = by_n[512]
    assert (qkv["PF_TARGETS"], qkv["PF0_N"], qkv["PF1_N"], qkv["PF1_CB"]) == (2, 256, 1024, 128)
    assert (qkv["PF_AT"], qkv["PF_MODE"], qkv["LDW_EF"]) == (0, 2, 1)
    down = next(d for d in builds if d["K_IN"] == 512)
    assert (down["PF0_N"], down["PF0_DL"], down["PF0_L"], down["PF0_CB"]) == (512, 1, 3, 128)
    stub_compiler.clear()
    text = decode_step_cuda_text(cfg, 16)
    assert not [d for d in stub_compiler if d.get("PF_TARGETS")]
    gemms = [ops for name, ops in _ptx_calls(text) if name == nvfp4_gemm.ENTRY]
    assert sorted(len(o) for o in gemms) == [6, 6, 7, 7], gemms


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
@pytest.mark.parametrize("mode", nvfp4_gemv.PREFETCH_MODES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (2, 24576, 4096), (4, 4096, 12288)])
def test_prefetch_kernels_compile_for_sm90(tmp_path, monkeypatch, m, n, k, mode):
    """NVRTC compiles the W4A4 GEMV with one and two prefetch targets (streaming and persistent
    variants, each mode, evict_first loads) and the entry takes two operands per target more
    (`build` checks the parameter count)."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    nvfp4_gemv._build_cached.cache_clear()
    try:
        targets = (
            nvfp4_gemv.PrefetchTarget(6144, 4096, 36, 1, 1.0),
            nvfp4_gemv.PrefetchTarget(24576, 4096, 36, 0, 0.3),
        )
        for count, at in ((1, "end"), (2, "start")):
            pf = nvfp4_gemv.Prefetch(targets=targets[:count], at=at, mode=mode, evict_first=True)
            kernel = nvfp4_gemv.build(
                "w4a4", m, n, k, arch="compute_90", num_sms=132, prefetch=pf, residual=True
            )
            assert kernel.plan.n_inputs == 8 + 2 * count
            assert "prefetch" in kernel.ptx and ("L2::cache_hint" in kernel.ptx)
    finally:
        nvfp4_gemv._build_cached.cache_clear()


def test_prefetch_options_are_checked():
    """Bad prefetch choices are refused by name before anything compiles."""
    with pytest.raises(nvfp4_gemv.KernelError, match="fraction"):
        nvfp4_gemv.PrefetchTarget(64, 256, 2, 0, 0.0)
    with pytest.raises(nvfp4_gemv.KernelError, match="Prefetch.mode"):
        nvfp4_gemv.Prefetch(mode="fast")
    with pytest.raises(nvfp4_gemv.KernelError, match="at most 2"):
        nvfp4_gemv.Prefetch(targets=(nvfp4_gemv.PrefetchTarget(64, 256, 2),) * 3)
    with pytest.raises(nvfp4_gemv.KernelError, match="only for act='w4a4'"):
        nvfp4_gemv.build("w4a16", 1, 64, 256, arch="compute_90", prefetch=nvfp4_gemv.Prefetch())
    assert nvfp4_gemv.PrefetchTarget(64, 4096, 2, 0, 0.3).row_bytes() == (640, 80)


def test_mixed_fuses_o_proj_only(stub_compiler):
    """linear_fusion="mixed": per layer o_proj is one `nvfp4_gemv_w4a4_bf16` launch (no norm
    prologue, the residual inside), the other three linears a quantizer and a plain GEMV."""
    cfg = Config(
        quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, num_layers=3,
        linear_fusion="mixed",
    )  # fmt: skip
    entries = re.findall(r"name = \\22(\w+)\\22", decode_step_cuda_text(cfg, 1))
    assert entries.count("nvfp4_quantize_bf16") == 3, entries
    assert entries.count("nvfp4_gemv_w4a4") == 3, entries
    assert entries.count("nvfp4_gemv_w4a4_bf16") == 1, entries
    fused = [d for d in stub_compiler if d.get("X_BF16") and not d.get("QUANT_ONLY")]
    assert [(d["PRO"], d["EPI_RES"], d["K_IN"]) for d in fused] == [(0, 1, 256)], fused


@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "swiglu"])
@pytest.mark.parametrize("m", [128, 200])
def test_wgmma_x_quant_kernel_writes_the_stage_tiles(stub_compiler, monkeypatch, m, prologue):
    """In the wgmma range, GemmOptions.wgmma_x_quant "kernel" (the default) lowers a fused
    linear ("two") to the quantizer kernel's "xhat_tiles" form (compiled for this M and the
    GEMM's token tile, launched over the 8-row groups of whole tiles, its x_hat [tiles, K /
    128, TM * 128] float16 the GEMM's first operand) and the wgmma GEMM, with no XLA op on the
    activations; "xla" keeps XLA's quantizer and layout ops in front of the same GEMM and no
    quantizer kernel. The residual is XLA's add either way."""
    monkeypatch.setattr(_dispatch, "_NOTED", set())
    w = _stacked(False)
    width = 2 * K if prologue == "swiglu" else K
    params = {"weight": w, "input_scale": jnp.full((L,), 0.02, jnp.float32)}
    norm = jnp.ones((L, K), jnp.bfloat16)
    x, r = jnp.zeros((m, width), jnp.bfloat16), jnp.zeros((m, N), jnp.bfloat16)
    tiles = f"{-(-m // 128)}x{K // 128}x{128 * 128}xf16"

    def lowered(opts):
        f = jax.jit(lambda x, r: fl.fused_linear(x, params, layer=jnp.int32(1), prologue=prologue,
                                                 norm=norm, kernels="two", residual=r,
                                                 gemm_options=opts))  # fmt: skip
        return f.trace(x, r).lower(lowering_platforms=("cuda",)).as_text()

    assert nvfp4_gemm.DEFAULT_OPTIONS.wgmma_x_quant == "kernel"
    on = lowered(nvfp4_gemm.DEFAULT_OPTIONS)
    calls = _ptx_calls(on)
    names = [name for name, _ in calls]
    assert names[:2] == [nvfp4_quant.ENTRY, nvfp4_gemm_wgmma.ENTRY], names
    assert calls[1][1][0] == f"tensor<{tiles}>", calls[1][1]
    quant = [d for d in stub_compiler if d.get("XHAT_OUT") == 2]
    assert quant and all(d["XHAT_M"] == m and d["XHAT_TM"] == 128 for d in quant), quant
    assert re.search(rf"grid_x = {-(-m // 128) * 128 // 8},", on)
    assert "stablehlo.rsqrt" not in on and "call @silu(" not in on
    assert "stablehlo.transpose" not in on and _bf16_adds(on, f"{m}x{N}") == 1
    off = lowered(nvfp4_gemm.GemmOptions(wgmma_x_quant="xla"))
    names = [name for name, _ in _ptx_calls(off)]
    assert names[0] == nvfp4_gemm_wgmma.ENTRY and nvfp4_quant.ENTRY not in names, names
    assert "stablehlo.transpose" in off  # the XLA-built tiles
    assert _dispatch.noted() == []
    with pytest.raises(nvfp4_gemv.KernelError, match="wgmma_x_quant='cuda', expected one of"):
        nvfp4_gemm.GemmOptions(wgmma_x_quant="cuda")
