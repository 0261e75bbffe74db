"""Decoder tests: layer math, HF transformers parity, KV cache, padding, NVFP4 linears."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rejax.cache import init_cache, write_kv
from rejax.config import Config
from rejax.decoder import Model
from rejax.layers import attention, attention_mask, rms_norm, rope
from rejax.params import Params, init_params, linear_paths

# The module, not the `rejax.generate` function the package exports.
gen = importlib.import_module("rejax.generate")


# fp32 HF parity: max |ours - theirs| / max |theirs|.
LOGITS_RTOL = 1e-4


def _max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# ----------------------------------------------------------------------------- layer math


def test_rms_norm_matches_formula():
    x = jax.random.normal(jax.random.key(0), (3, 8), jnp.float32) * 3
    scale = jnp.linspace(0.5, 1.5, 8)
    want = x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(rms_norm(x, scale, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_rope_rotate_half_convention():
    # Position p rotates pair (i, i + H/2) by p * theta^(-2i/H).
    h, theta = 8, 100.0
    x = jax.random.normal(jax.random.key(1), (1, 2, 1, h))
    pos = jnp.array([[0, 3]])
    y = np.asarray(rope(x, pos, theta))
    np.testing.assert_allclose(y[0, 0], np.asarray(x[0, 0]), rtol=1e-6)
    for i in range(h // 2):
        ang = 3 * theta ** (-2 * i / h)
        a, b = float(x[0, 1, 0, i]), float(x[0, 1, 0, i + h // 2])
        np.testing.assert_allclose(y[0, 1, 0, i], a * np.cos(ang) - b * np.sin(ang), rtol=1e-5)
        np.testing.assert_allclose(
            y[0, 1, 0, i + h // 2], b * np.cos(ang) + a * np.sin(ang), rtol=1e-5
        )


def test_attention_gqa_matches_repeated_heads():
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(kq, (2, 3, 4, 8))
    k = jax.random.normal(kk, (2, 5, 2, 8))
    v = jax.random.normal(kv, (2, 5, 2, 8))
    qpos = jnp.array([[2, 3, 4], [0, 1, -1]])
    kpos = jnp.array([[0, 1, 2, 3, 4], [-1, -1, 0, 1, -1]])
    mask = attention_mask(qpos, kpos)
    out = np.asarray(attention(q, k, v, mask))
    q, mask = np.asarray(q), np.asarray(mask)
    kr, vr = np.repeat(np.asarray(k), 2, axis=2), np.repeat(np.asarray(v), 2, axis=2)
    for b in range(2):
        for t in range(3):
            if qpos[b, t] < 0:
                continue
            for n in range(4):
                s = (kr[b, :, n] @ q[b, t, n]) / np.sqrt(8)
                s = np.where(mask[b, t], s, -np.inf)
                p = np.exp(s - s.max())
                p /= p.sum()
                np.testing.assert_allclose(out[b, t, n], p @ vr[b, :, n], rtol=1e-5, atol=1e-6)


def test_cache_write_places_entries_at_index():
    kc = jnp.zeros((1, 6, 1, 2))
    new = jnp.ones((1, 2, 1, 2))
    k2, _ = write_kv(kc, kc, new, new, jnp.int32(3))
    assert np.asarray(k2)[0, :, 0, 0].tolist() == [0, 0, 0, 1, 1, 0]
    # the stacked cache [L, B, S, K, H]: only layer 1's slots 3..4 change
    stacked = jnp.zeros((3, 1, 6, 1, 2))
    k3, _ = write_kv(stacked, stacked, new, new, jnp.int32(3), layer=jnp.int32(1))
    k3 = np.asarray(k3)
    assert k3[1, 0, :, 0, 0].tolist() == [0, 0, 0, 1, 1, 0]
    assert not k3[0].any() and not k3[2].any()
    cache = init_cache(Config(num_layers=3), 2, 7)
    assert cache.k.shape == (3, 2, 7, 2, 16) and cache.v.shape == cache.k.shape


# ----------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("arch,tie", [("qwen3", False), ("qwen3", True), ("qwen2", False)])
def test_logits_match_transformers_fp32(hf_tiny, arch, tie):
    import torch

    model, params = hf_tiny(arch, tie)
    assert params.cfg.arch == arch and params.cfg.tie_word_embeddings == tie
    tokens = np.random.default_rng(0).integers(0, 256, (2, 11))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got = gen.logits(params, tokens)
    assert got.dtype == jnp.float32 and got.shape == (2, 11, 256)
    assert float(np.abs(want).max()) > 1.0  # a non-trivial random model
    rel = _max_rel(got, want)
    assert rel <= LOGITS_RTOL, f"{arch} tie={tie}: max relative logit difference {rel:.2e}"


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_greedy_matches_transformers_generate(hf_tiny, arch):
    import torch

    from rejax.sampling import Greedy

    model, params = hf_tiny(arch, False)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [200, 1, 2, 3, 4]]
    out = gen.generate(params, prompts, max_new_tokens=12, sampler=Greedy(), stop=[])
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p)),
                do_sample=False,
                max_new_tokens=12,
                eos_token_id=None,
                pad_token_id=0,
            )
        want = ref[0, len(p) :].tolist()
        assert out.tokens[i] == want, f"row {i}: ours {out.tokens[i]} vs transformers {want}"
        assert out.finish_reason[i] == "length"
    assert len(set(map(tuple, out.tokens))) > 1  # the rows really differ


# ----------------------------------------------------------------------------- KV cache


@jax.jit
def _apply(params, tokens, positions, cache=None):
    return Model(params.cfg, params.weights["embed_tokens"]["embedding"].dtype).apply(
        {"params": params.weights}, jnp.asarray(tokens), jnp.asarray(positions), cache
    )


def test_cache_decode_equals_full_sequence():
    params = init_params(Config(), 0, jnp.float32)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 9)).astype(np.int32)
    pos = np.broadcast_to(np.arange(9, dtype=np.int32), (2, 9))
    full, _ = _apply(params, tokens, pos)
    cache = init_cache(params.cfg, 2, 12, jnp.float32)
    first, cache = _apply(params, tokens[:, :5], pos[:, :5], cache)
    np.testing.assert_allclose(first, full[:, :5], rtol=1e-5, atol=1e-5)
    for t in range(5, 9):
        step, cache = _apply(params, tokens[:, t : t + 1], pos[:, t : t + 1], cache)
        np.testing.assert_allclose(step[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
    assert int(cache.index) == 9
    assert np.asarray(cache.positions)[0].tolist() == list(range(9)) + [-1, -1, -1]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_unpadded_rows(side):
    params = init_params(Config(arch="qwen2", attention_bias=True), 3, jnp.float32)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (7, 3, 5)]
    t, extra = 8, 4
    tokens = np.zeros((3, t), np.int32)
    pos = np.full((3, t), -1, np.int32)
    for r, p in enumerate(prompts):
        sl = slice(t - len(p), t) if side == "left" else slice(0, len(p))
        tokens[r, sl], pos[r, sl] = p, np.arange(len(p))
    cache = init_cache(params.cfg, 3, t + extra, jnp.float32)
    logits, cache = _apply(params, tokens, pos, cache)
    nxt = rng.integers(0, 256, (3, extra)).astype(np.int32)
    lengths = np.array([len(p) for p in prompts])
    steps = []
    for i in range(extra):
        out, cache = _apply(
            params, nxt[:, i : i + 1], (lengths + i)[:, None].astype(np.int32), cache
        )
        steps.append(np.asarray(out[:, 0]))
    for r, p in enumerate(prompts):
        seq = np.concatenate([p, nxt[r]])[None]
        ref, _ = _apply(params, seq, np.arange(seq.shape[1], dtype=np.int32)[None])
        ref = np.asarray(ref[0])
        got_prompt = np.asarray(logits[r])[pos[r] >= 0]
        np.testing.assert_allclose(got_prompt, ref[: len(p)], rtol=1e-5, atol=1e-5)
        for i in range(extra):
            np.testing.assert_allclose(steps[i][r], ref[len(p) + i], rtol=1e-5, atol=1e-5)


def test_cache_too_short_raises():
    params = init_params(Config(), 0, jnp.float32)
    cache = init_cache(params.cfg, 1, 4, jnp.float32)
    tok = np.zeros((1, 5), np.int32)
    with pytest.raises(ValueError, match="cache"):
        _apply(params, tok, np.arange(5, dtype=np.int32)[None], cache)


def _init_shapes(cfg):
    # Shapes and dtypes only: no compile, no device arrays.
    return jax.eval_shape(lambda: init_params(cfg, 0).weights)


def test_init_params_tree_matches_contract():
    cfg = Config(tie_word_embeddings=False)
    w = _init_shapes(cfg)
    assert w["embed_tokens"]["embedding"].shape == (256, 64)
    assert w["lm_head"]["weight"].shape == (256, 64)
    attn = w["layers"]["self_attn"]
    qkv = attn["qkv_proj"]["weight"]  # float: one [N_out, K_in] array per layer
    assert len(qkv) == 2 and qkv[1].shape == (64 + 2 * 32, 64)
    assert attn["o_proj"]["weight"][0].shape == (64, 64)
    assert attn["q_norm"]["scale"].shape == (2, 16)  # stacked [L, H]
    assert w["layers"]["mlp"]["gate_up_proj"]["weight"][0].shape == (2 * 128, 64)
    assert w["layers"]["mlp"]["down_proj"]["weight"][0].shape == (64, 128)
    assert w["layers"]["input_layernorm"]["scale"].shape == (2, 64)
    assert w["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    assert len(linear_paths(w)) == 4
    assert "lm_head" not in _init_shapes(Config(tie_word_embeddings=True))
    w2 = _init_shapes(Config(arch="qwen2", attention_bias=True))["layers"]
    assert w2["self_attn"]["qkv_proj"]["bias"].shape == (2, 128)
    assert "bias" not in w2["self_attn"]["o_proj"] and "q_norm" not in w2["self_attn"]
    # NVFP4: every linear one stacked Nvfp4Tensor
    wq = init_params(Config(quant="nvfp4"), 0).weights["layers"]["mlp"]["gate_up_proj"]["weight"]
    assert wq.stack == (2,) and wq.shape == (256, 64) and wq.packed.shape == (2, 256, 32)


def test_logits_bad_input():
    params = init_params(Config(max_position_embeddings=16), 0, jnp.float32)
    with pytest.raises(ValueError, match="outside"):
        gen.logits(params, [[1, 256]])
    with pytest.raises(ValueError, match="T > 0"):
        gen.logits(params, np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        gen.logits(params, np.zeros((1, 17), np.int32))


def test_bf16_model_runs_and_tracks_fp32():
    p32 = init_params(Config(), 4, jnp.float32)
    p16 = dataclasses.replace(
        p32, weights=jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), p32.weights)
    )
    tokens = np.random.default_rng(3).integers(0, 256, (1, 12))
    a, b = gen.logits(p32, tokens), gen.logits(p16, tokens)
    assert b.dtype == jnp.float32
    # bf16 activations and weights: logits agree to bf16 precision.
    assert _max_rel(b, a) < 5e-2


# ----------------------------------------------------------------------------- NVFP4 linears

# Reference NVFP4 path vs a dequantize-then-float model on the same quantized values:
# ||ours - twin|| / ||twin|| over the logits. Both round each linear to bf16; they differ only in
# float32 summation order, whose rare bf16 flips can flip an activation code downstream.
NVFP4_TWIN_RTOL = 1e-3  # measured 0.0 (bit-identical logits) on these tiny models
# The float32 model on dequantized weights vs the twin (which rounds linears to bf16): 3.1e-3.
BF16_ROUNDING_RTOL = 1e-2


def _dequant_twin(calls):
    """nvfp4_linear stand-in: dequantize W (and fake-quantize x for W4A4), then a float dot."""
    from rejax.nvfp4 import dequantize, quantize_activation, take

    def fake(x, w, *, input_scale=None, act="w4a4", impl="auto", layer=None, gemm_options=None):
        calls.append((act, input_scale is not None))
        if layer is not None:
            w = take(w, layer)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if act == "w4a4":
            x2 = dequantize(quantize_activation(x2, input_scale))
        y = jnp.dot(x2.astype(jnp.float32), dequantize(w).T, precision="highest")
        return y.astype(jnp.bfloat16).reshape(*lead, w.shape[0])

    return fake


def _fresh_logits(params, tokens):
    """Logits through a newly jitted forward (so a monkeypatched kernel is traced)."""
    fn = jax.jit(
        lambda p, t: Model(p.cfg, jnp.float32).apply(
            {"params": p.weights}, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape)
        )[0]
    )
    return np.asarray(fn(params, jnp.asarray(tokens, jnp.int32)))


def _rel_norm(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
    "quant,calibrated", [("nvfp4", False), ("nvfp4", True), ("nvfp4-w4a16", False)]
)
def test_nvfp4_reference_equals_dequantized_twin(monkeypatch, quant, calibrated):
    import rejax.layers
    from rejax.nvfp4 import Nvfp4Tensor, dequantize, take

    cfg = Config(num_layers=1)
    params = init_params(dataclasses.replace(cfg, quant=quant), 5, jnp.float32)
    w = params.weights["layers"]["mlp"]["gate_up_proj"]["weight"]
    assert isinstance(w, Nvfp4Tensor) and w.shape == (256, 64) and w.stack == (1,)
    tokens = np.random.default_rng(4).integers(0, 256, (2, 10))
    if calibrated:
        params = gen.calibrate_input_scales(params, [list(tokens[0]), list(tokens[1][:6])])
    ours = _fresh_logits(params, tokens)
    calls = []
    monkeypatch.setattr(rejax.layers, "nvfp4_linear", _dequant_twin(calls))
    twin = _fresh_logits(params, tokens)
    act = "w4a4" if quant == "nvfp4" else "w4a16"
    assert calls == [(act, calibrated)] * 4  # every (fused) decoder linear, with its input_scale
    rel = _rel_norm(ours, twin)
    assert rel <= NVFP4_TWIN_RTOL, f"{quant} calibrated={calibrated}: {rel:.2e}"
    # The quantization is real: the float model with the original weights is much further off.
    float_params = init_params(cfg, 5, jnp.float32)
    assert _rel_norm(_fresh_logits(float_params, tokens), twin) > 5 * max(rel, 1e-3)
    if quant == "nvfp4-w4a16":
        # W4A16 = the bf16/float model on dequantized weights (activations unquantized).
        from rejax.params import map_linears

        def deq(_, p):
            w = p["weight"]
            return {**p, "weight": tuple(dequantize(take(w, i)) for i in range(w.stack[0]))}

        dq = map_linears(params.weights, deq)
        plain = Params(weights=dq, cfg=cfg)
        assert _rel_norm(_fresh_logits(plain, tokens), twin) <= BF16_ROUNDING_RTOL


def test_calibrate_input_scales_sets_amax_over_6x448():
    params = init_params(Config(quant="nvfp4", num_layers=2), 6, jnp.float32)
    texts = [[1, 2, 3, 4], [200, 201, 7, 9]]
    cal = gen.calibrate_input_scales(params, texts)
    for block, name in linear_paths(cal.weights):
        s = cal.weights["layers"][block][name]["input_scale"]
        assert s.shape == (2,) and s.dtype == jnp.float32 and bool((s > 0).all())
    # the fused qkv_proj of layer 0 sees rms_norm(embedding): its scale is that amax / (6 * 448)
    emb = params.weights["embed_tokens"]["embedding"]
    scale = params.weights["layers"]["input_layernorm"]["scale"][0]
    amax = max(float(jnp.abs(rms_norm(emb[jnp.array(t)], scale, 1e-6)).max()) for t in texts)
    attn = cal.weights["layers"]["self_attn"]
    np.testing.assert_allclose(float(attn["qkv_proj"]["input_scale"][0]), amax / 2688, rtol=1e-6)
    assert "input_scale" not in params.weights["layers"]["self_attn"]["qkv_proj"]  # not mutated
    with pytest.raises(ValueError, match="nvfp4"):
        gen.calibrate_input_scales(
            dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, quant=None)), texts
        )
    with pytest.raises(ValueError, match="nvfp4"):
        gen.calibrate_input_scales(
            dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, quant="nvfp4-w4a16")),
            texts,
        )
    with pytest.raises(ValueError, match="empty"):
        gen.calibrate_input_scales(params, [[]])


def _adds_by_shape(jaxpr) -> set:
    """Output shapes of every `add` in a jaxpr (its sub-jaxprs included)."""
    shapes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("add", "add_any"):
            shapes.add(tuple(eqn.outvars[0].aval.shape))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            shapes |= _adds_by_shape(sub)
    return shapes


@pytest.mark.parametrize("rows", [5, 8, 11])
def test_linear_residual_add_runs_on_the_padded_rows(rows):
    """`linear(..., residual=r, invariant_rows=8)`: residual + x @ W.T + b for any row count,
    and with fewer than 8 rows the residual add runs on the 8 zero-padded rows, in front of the
    slice (XLA may fuse the add into the matmul's epilogue, as it does in the unpadded 8-row
    program, so a padded program must have the same add)."""
    from rejax.layers import linear

    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(6), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, 1, 4)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((rows, 1, 6)), jnp.float32)
    p = {"weight": w, "bias": b}
    got = linear(x, p, invariant_rows=8, residual=r)
    want = np.asarray(r) + (np.asarray(x) @ np.asarray(w).T + np.asarray(b))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert got.shape == (rows, 1, 6)
    adds = _adds_by_shape(
        jax.make_jaxpr(lambda a, c: linear(a, p, invariant_rows=8, residual=c))(x, r).jaxpr
    )
    if rows < 8:
        assert adds == {(8, 6)}, adds  # bias and residual on the padded rows, none after
    else:
        assert adds == {(rows, 1, 6)}, adds
