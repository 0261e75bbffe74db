"""rejax.ops.rope_cache on CPU: the reference against the decoder's former composition, the
decoder with rope_fusion "fused" against "unfused" bitwise, the CUDA lowering (one aliased
kernel per layer), argument checks, and the kernel's NVRTC build."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import decode_step_cuda_text

from cuda_ops import build as cbuild
from cuda_ops import rope_cache as kmod
from rejax import layers
from rejax.cache import init_cache, write_kv
from rejax.config import Config
from rejax.decoder import forward
from rejax.ops.rope_cache import rope_cache
from rejax.params import init_params

N, KV, H, L, S = 4, 2, 32, 3, 16


def _operands(b, seed=0, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 5)
    qkv = jax.random.normal(ks[0], (b, (N + 2 * KV) * H), jnp.float32).astype(dtype)
    qn = (1 + 0.3 * jax.random.normal(ks[1], (L, H))).astype(dtype)
    kn = (1 + 0.3 * jax.random.normal(ks[2], (L, H))).astype(dtype)
    kc = jax.random.normal(ks[3], (L, b, S, KV, H), jnp.float32).astype(dtype)
    vc = jax.random.normal(ks[4], (L, b, S, KV, H), jnp.float32).astype(dtype)
    return qkv, qn, kn, kc, vc


def _composition(qkv, qn, kn, layer, positions, index, kc, vc, theta, qk_norm=True):
    # what rejax/decoder.py did before the op, on [B, T = 1, ...] tensors
    b = qkv.shape[0]
    q = qkv[:, None, : N * H].reshape(b, 1, N, H)
    k = qkv[:, None, N * H : (N + KV) * H].reshape(b, 1, KV, H)
    v = qkv[:, None, (N + KV) * H :].reshape(b, 1, KV, H)
    if qk_norm:
        q = layers.rms_norm(q, qn[layer], 1e-6)
        k = layers.rms_norm(k, kn[layer], 1e-6)
    q = layers.rope(q, positions[:, None], theta)
    k = layers.rope(k, positions[:, None], theta)
    kc, vc = write_kv(kc, vc, k, v, index, layer)
    return q[:, 0], kc, vc


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("index", [5, "rows"])
def test_reference_is_the_decoders_composition_bitwise(qk_norm, index):
    b = 3
    qkv, qn, kn, kc, vc = _operands(b)
    pos = jnp.array([7, -1, 200], jnp.int32)
    idx = jnp.array([2, 0, 15], jnp.int32) if index == "rows" else jnp.int32(index)
    norms = (qn, kn) if qk_norm else (None, None)
    got = jax.jit(lambda *a: rope_cache(*a, heads=N, kv_heads=KV, head_dim=H, eps=1e-6, theta=1e4))(
        qkv, *norms, jnp.int32(1), pos, idx, kc, vc
    )
    want = _composition(qkv, qn, kn, 1, pos, idx, kc, vc, 1e4, qk_norm)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    # only this layer's slot of each row changed
    changed = np.any(np.asarray(got[1] != kc), axis=(3, 4))
    rows = [2, 0, 15] if index == "rows" else [index] * b
    expect = np.zeros((L, b, S), bool)
    expect[1, np.arange(b), rows] = True
    np.testing.assert_array_equal(changed, expect)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
@pytest.mark.parametrize("per_row", [False, True])
def test_decoder_fused_equals_unfused_bitwise(arch, per_row):
    """A prompt, then four one-token steps: logits and caches of "fused" and "unfused" equal."""
    cfg = Config(arch=arch, num_layers=2, attention_bias=arch == "qwen2")
    params = init_params(cfg, 0, jnp.bfloat16)
    prompt = jnp.array([[3, 4, 5, 6], [0, 0, 7, 8]], jnp.int32)
    pos = jnp.array([[0, 1, 2, 3], [-1, -1, 0, 1]], jnp.int32)
    outs = []
    for fusion in ("fused", "unfused"):
        c = dataclasses.replace(cfg, rope_fusion=fusion)
        step = jax.jit(lambda t, p, cache, c=c: forward(params.weights, t, p, cache, c))
        cache = init_cache(c, 2, 12, jnp.bfloat16)
        if per_row:
            cache = dataclasses.replace(cache, index=jnp.zeros((2,), jnp.int32))
        logits, cache = step(prompt, pos, cache)
        seen = [logits[:, -1]]
        p = pos[:, -1:]
        for _ in range(4):
            p = p + 1
            tok = jnp.argmax(seen[-1], -1).astype(jnp.int32)[:, None]
            logits, cache = step(tok, p, cache)
            seen.append(logits[:, 0])
        outs.append((seen, cache))
    (a, ca), (b, cb) = outs
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in ((ca.k, cb.k), (ca.v, cb.v)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_decode_step_lowers_to_one_aliased_kernel_per_layer():
    """On CUDA the decode step holds one `qk_norm_rope_cache` call (the scanned body once),
    its two cache operands aliased to its outputs, and no cos / sin / rsqrt of the rotation
    and norms left in XLA; "unfused" has no such call."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, num_layers=2,
                 rope_fusion="fused")  # fmt: skip
    text = decode_step_cuda_text(cfg)
    entries = re.findall(r"name = \\22(\w+)\\22", text)
    assert entries.count("qk_norm_rope_cache") == 1, entries
    call = next(ln for ln in text.splitlines() if "qk_norm_rope_cache" in ln)
    assert "output_operand_aliases" in call
    aliases = re.findall(r"output_tuple_indices = \[(\d)\], operand_index = (\d)", call)
    assert sorted(aliases) == [("1", "7"), ("2", "8")], aliases
    assert "stablehlo.cosine" not in text
    unfused = decode_step_cuda_text(dataclasses.replace(cfg, rope_fusion="unfused"))
    assert "qk_norm_rope_cache" not in unfused and "stablehlo.cosine" in unfused
    # the q and k norms' rsqrt are gone (the final norm's stays)
    assert unfused.count("stablehlo.rsqrt") == text.count("stablehlo.rsqrt") + 2


def test_fp8_cache_and_prompts_keep_the_composition():
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, kv_dtype="fp8", rope_fusion="fused")  # fmt: skip
    assert "qk_norm_rope_cache" not in decode_step_cuda_text(cfg)


def test_bad_arguments_are_refused():
    qkv, qn, kn, kc, vc = _operands(2)
    kw = {"heads": N, "kv_heads": KV, "head_dim": H, "eps": 1e-6, "theta": 1e4}
    pos, i0 = jnp.zeros((2,), jnp.int32), jnp.int32(0)
    with pytest.raises(ValueError, match=r"qkv.shape=\(2, 255\)"):
        rope_cache(qkv[:, :-1], qn, kn, i0, pos, i0, kc, vc, **kw)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        rope_cache(qkv, qn, None, i0, pos, i0, kc, vc, **kw)
    with pytest.raises(ValueError, match="k_cache.shape"):
        rope_cache(qkv, qn, kn, i0, pos, i0, kc[:, :1], vc, **kw)
    with pytest.raises(ValueError, match="v_cache.shape"):
        rope_cache(qkv, qn, kn, i0, pos, i0, kc, vc[..., :1, :], **kw)
    with pytest.raises(ValueError, match="positions.shape"):
        rope_cache(qkv, qn, kn, i0, pos[:1], i0, kc, vc, **kw)
    with pytest.raises(ValueError, match="index.shape"):
        rope_cache(qkv, qn, kn, i0, pos, jnp.zeros((3,), jnp.int32), kc, vc, **kw)
    with pytest.raises(ValueError, match="q_norm.shape"):
        rope_cache(qkv, qn[0], kn, i0, pos, i0, kc, vc, **kw)
    with pytest.raises(ValueError, match="impl="):
        rope_cache(qkv, qn, kn, i0, pos, i0, kc, vc, impl="fast", **kw)
    with pytest.raises(ValueError, match="rope_fusion"):
        Config(rope_fusion="yes")
    ok, why = kmod.check_shape(kmod.Shape(1, 4, 2, 16, 8, True, 1e-6, False))
    assert not ok and "head_dim=16" in why


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    """NVRTC compiles the kernel for Qwen3-8B (norms, one or per-row slots), Qwen2 (no norms)
    and the bundled model's head_dim 32; the build checks the entry's 12 parameters."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    kmod._build_cached.cache_clear()
    try:
        for shape in (
            kmod.Shape(1, 32, 8, 128, 1536, True, 1e-6, False),
            kmod.Shape(64, 32, 8, 128, 33280, True, 1e-6, True),
            kmod.Shape(8, 28, 4, 128, 512, False, 1e-6, False),
            kmod.Shape(2, 4, 2, 32, 64, True, 1e-5, True),
        ):
            kern = kmod.build(shape, arch="compute_90")
            assert cbuild.ptx_entries(kern.ptx) == {kmod.ENTRY: 12}
            cfg = kern.backend_config()
            warps = shape.batch * (shape.heads + 2 * shape.kv_heads)
            assert f"grid_x = {-(-warps // 4)}," in cfg and "block_x = 128," in cfg
            assert "output_indices = [9, 10, 11]" in cfg
        with pytest.raises(cbuild.KernelError, match="unsupported shape"):
            kmod.build(kmod.Shape(1, 4, 2, 48, 8, True, 1e-6, False), arch="compute_90")
    finally:
        kmod._build_cached.cache_clear()


def _elements(type_text: str) -> int:
    dims = re.findall(r"(\d+)x", type_text)
    return int(np.prod([int(d) for d in dims])) if dims else 1


@pytest.mark.parametrize("attention", ["live", "flash", "flash-mma"])
def test_layer_body_with_every_decode_fusion_is_only_kernels(attention):
    """With linear_fusion "split", residual_fusion and rope_fusion "fused", the scanned layer of
    the CUDA decode step is its kernels (4 quantizers, 4 linears, rope_cache, and attention:
    the 2 Pallas kernels of "live" or the one CUDA launch of "flash") and no XLA op on an
    activation-sized tensor: what is left is reshapes, bitcasts and the rotation's constant
    [H / 2] frequencies. Also the live length is computed once, outside the layer loop."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64, num_layers=2,
                 rope_fusion="fused", residual_fusion="fused", attention=attention)  # fmt: skip
    text = decode_step_cuda_text(cfg, batch=1)
    body = next(f for f in re.split(r"\n  func\.func ", text) if f.startswith("private @closed"))
    names = re.findall(r"name = \\22(\w+)\\22", body)
    ptx = ["nvfp4_gemv_w4a4", "nvfp4_quantize_bf16", "qk_norm_rope_cache"]
    if attention != "live":
        ptx = sorted([*ptx, "rejax_flash_decode"])
    assert sorted(set(names)) == ptx, names
    launches = 11 if attention == "live" else 10
    assert len(names) == len(ptx) - 3 + 9 and body.count("stablehlo.custom_call") == launches
    assert not re.search(r"stablehlo\.(add|maximum) .*: tensor<i32>", body), "live in the layer"
    free = ("reshape", "constant", "bitcast_convert", "custom_call", "return", "broadcast_in_dim",
            "output_operand_alias", "tuple", "get_tuple_element")  # fmt: skip
    for line in body.splitlines():
        op = re.search(r"= (stablehlo\.(\w+))", line)
        if not op or op.group(2) in free:
            continue
        result = line.rsplit("->", 1)[-1] if "->" in line else line.rsplit(":", 1)[-1]
        assert _elements(result) <= cfg.head_dim // 2, line.strip()
