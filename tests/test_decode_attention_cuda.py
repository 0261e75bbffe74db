"""The one-launch CUDA decode attention (cuda_ops/decode_attention.cu) without a GPU: NVRTC
builds, the decode step's CUDA lowering, dispatch and errors, and the NumPy emulation of the
kernel's split / merge arithmetic against the reference (the kernel follows the emulation step
by step, E1..E9). The kernel itself runs in tests/test_decode_attention_cuda_gpu.py."""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import decode_step_cuda_text

from cuda_ops import build as cbuild
from cuda_ops import decode_attention as flash
from rejax.cache import init_cache
from rejax.config import Config
from rejax.decoder import Model
from rejax.ops.decode_attention import decode_attention, decode_attention_ref
from rejax.params import init_params

# emulation vs reference, bf16 out: norm(y - ref) / norm(ref) over rows with a visible key; the
# Pallas kernel's bound (tests/test_decode_attention.py). Measured: <= 5.1e-3 on these cases
# (H = 16), 3.2e-3 at H = 128.
EMU_REL_TOL = 1e-2

_ref = jax.jit(decode_attention_ref)


@jax.jit
def _poison_past_live(x, live):
    """x [L, B, S, K, H] with slots >= live set to NaN (one compile for every live)."""
    past = jnp.arange(x.shape[2])[None, None, :, None, None] >= live
    return jnp.where(past, jnp.nan, x)


needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)


def _rel(y, ref) -> float:
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


# ----------------------------------------------------------------------------- build, lowering


@needs_nvrtc
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_nvrtc_builds_qwen3_8b(batch, tmp_path, monkeypatch):
    """Qwen3-8B (N=32, K=8, H=128, 36 layers, 40,960 slots) compiles for sm_90; the entry has
    7 operands + 3 results (+ 3 aliased NaN operands when poisoned), the grid is (P, K, B)."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    for poison in (False, True):
        shape = flash.flash_shape(batch, 36, 40960, 8, 4, 128, poison=poison)
        kern = flash.build(shape, arch="compute_90")
        assert cbuild.ptx_target(kern.ptx) == "sm_90"
        assert cbuild.ptx_entries(kern.ptx) == {flash.ENTRY: 13 if poison else 10}
        cfg = kern.backend_config()
        grid = re.findall(r"grid_[xyz] = (\d+)", cfg)
        assert grid == [str(shape.splits), "8", str(batch)]
        assert shape.splits == flash.default_splits(batch, 8, 40960, shape.tile)
        outs = "[10, 11, 12]" if poison else "[7, 8, 9]"
        assert f"output_indices = {outs}" in cfg and "block_x = 128" in cfg


@needs_nvrtc
def test_prefetch_option_builds_and_leaves_the_default_ptx_alone(tmp_path, monkeypatch):
    """FlashOptions(prefetch=1) compiles (sm_90, no local memory) to another kernel than the
    default, whose defines, and so cache key and PTX, carry no PREFETCH; a bad value is
    refused."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    plain = flash.flash_shape(1, 36, 33280, 8, 4, 128)
    piped = flash.flash_shape(1, 36, 33280, 8, 4, 128, flash.FlashOptions(prefetch=1))
    assert "PREFETCH" not in flash.defines(plain) and flash.defines(piped)["PREFETCH"] == 1
    assert piped.splits == plain.splits and piped.tile == plain.tile
    a, b = flash.build(plain, arch="compute_90"), flash.build(piped, arch="compute_90")
    assert ".local" not in b.ptx and cbuild.ptx_entries(b.ptx) == {flash.ENTRY: 10}
    assert a.ptx != b.ptx
    ok, why = flash.check_shape(dataclasses.replace(piped, prefetch=2))
    assert not ok and "prefetch=2" in why


@needs_nvrtc
def test_mma_option_builds_with_its_rings_in_dynamic_shared_memory(tmp_path, monkeypatch):
    """FlashOptions(mma=1) compiles (sm_90: mma.sync, ldmatrix, cp.async; no local memory) to
    another kernel, its tile is WARPS x 16 slots, the launch asks for its rings' dynamic shared
    memory, the default build's defines carry no MMA, and bad combinations are refused."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    plain = flash.flash_shape(1, 36, 33280, 8, 4, 128)
    mma = flash.flash_shape(1, 36, 33280, 8, 4, 128, flash.FlashOptions(mma=1, stages=3))
    assert "MMA" not in flash.defines(plain) and "STAGES" not in flash.defines(plain)
    assert flash.defines(mma)["MMA"] == 1 and flash.defines(mma)["STAGES"] == 3
    assert mma.tile == 4 * 16 and plain.tile == 4 * 4 * 2
    # per warp: 3 stages of 16 K rows + 16 V rows of 256 bytes + 16 positions
    assert mma.dynamic_smem_bytes == 4 * 3 * (2 * 16 * 128 * 2 + 16 * 4) == 99072
    assert plain.dynamic_smem_bytes == 0
    kern = flash.build(mma, arch="compute_90")
    assert ".local" not in kern.ptx and cbuild.ptx_entries(kern.ptx) == {flash.ENTRY: 10}
    for op in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "ldmatrix", "cp.async"):
        assert op in kern.ptx, op
    assert "shared_mem_bytes = 99072" in kern.backend_config()
    assert "shared_mem_bytes = 0" in flash.build(plain, arch="compute_90").backend_config()
    for bad, word in (
        (dataclasses.replace(mma, stages=1), "stages=1"),
        (dataclasses.replace(mma, mma=2), "mma=2"),
        (dataclasses.replace(mma, prefetch=1), "prefetch=1"),
        (dataclasses.replace(mma, head_dim=16), "head_dim=16"),
        (dataclasses.replace(mma, warps=16, stages=8), "shared memory"),
    ):
        ok, why = flash.check_shape(bad)
        assert not ok and word in why, (bad, why)


def _flash_calls(text: str) -> int:
    return len(re.findall(r"name = \\22" + flash.ENTRY, text)) + len(
        re.findall(r'name = \\"' + flash.ENTRY, text)
    )


@needs_nvrtc
@pytest.mark.parametrize("attention", ["flash", "flash-mma"])
def test_decode_step_lowering_has_one_flash_call_per_layer(attention):
    """attention="flash" / "flash-mma": the CUDA lowering of a decode step holds one call of the
    CUDA entry per layer (unrolled layers) and no Pallas attention, built with the tensor-core
    loop (its mma.sync) exactly under "flash-mma"; "live" keeps the Pallas kernels."""
    cfg = Config(attention=attention, num_layers=3, layer_loop="unroll", head_dim=32)
    text = decode_step_cuda_text(cfg)
    assert _flash_calls(text) == 3
    assert "rejax_decode_attention_partials" not in text
    assert ("mma.sync" in text) == (attention == "flash-mma")
    live = decode_step_cuda_text(dataclasses.replace(cfg, attention="live"))
    assert _flash_calls(live) == 0
    assert "rejax_decode_attention_partials" in live
    # the fp8 cache keeps the Pallas kernel under "flash" (the decoder asks for it: no
    # fallback warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8 = decode_step_cuda_text(dataclasses.replace(cfg, kv_dtype="fp8"))
    assert _flash_calls(fp8) == 0 and "rejax_decode_attention_partials" in fp8


def _model_steps(cfg, dtype=jnp.bfloat16):
    params = init_params(cfg, 6, dtype)
    b, t, p = 2, 9, 4
    tokens = np.random.default_rng(7).integers(0, 256, (b, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    apply = jax.jit(lambda w, tok, pos, c: Model(cfg, dtype).apply({"params": w}, tok, pos, c))
    cache = init_cache(cfg, b, t + 5, dtype)
    out, cache = apply(params.weights, tokens[:, :p], positions[:, :p], cache)
    logits = [np.asarray(out)]
    for i in range(p, t):
        out, cache = apply(params.weights, tokens[:, i : i + 1], positions[:, i : i + 1], cache)
        logits.append(np.asarray(out))
    return np.concatenate(logits, axis=1)


@pytest.mark.parametrize("attention", ["flash", "flash-mma"])
def test_flash_equals_live_off_cuda(attention):
    """Off CUDA attention="flash" / "flash-mma" runs what "live" runs: the logits of prompt and
    decode steps are bitwise equal (the fp8 cache's routing is checked on the CUDA lowering
    above)."""
    cfg = Config(attention="live", head_dim=32)
    live = _model_steps(cfg)
    fl = _model_steps(dataclasses.replace(cfg, attention=attention))
    np.testing.assert_array_equal(fl, live)


def _problem(seed, b, n, kh, h, s, layers=2):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, n, h)), jnp.bfloat16)
    kc = jnp.asarray(rng.standard_normal((layers, b, s, kh, h)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((layers, b, s, kh, h)), jnp.bfloat16)
    return q, kc, vc


def test_bad_arguments_raise():
    q, kc, vc = _problem(0, 2, 8, 2, 32, 64)
    qp, kp = jnp.zeros((2,), jnp.int32), jnp.zeros((2, 64), jnp.int32)
    args = (q, kc, vc, jnp.int32(0), qp, kp, jnp.int32(5))
    with pytest.raises(ValueError, match="impl='cuda'.*needs the CUDA platform"):
        decode_attention(*args, impl="cuda")
    with pytest.raises(ValueError, match="kernel='triton'"):
        decode_attention(*args, kernel="triton")
    with pytest.raises(ValueError, match="cuda_options=.*FlashOptions"):
        decode_attention(*args, cuda_options={"splits": 4})
    with pytest.raises(ValueError, match="splits=0"):
        decode_attention(*args, impl="cuda", cuda_options=flash.FlashOptions(splits=0))
    with pytest.raises(ValueError, match="head_dim=48"):
        q48, k48, v48 = _problem(1, 2, 8, 2, 48, 64)
        decode_attention(q48, k48, v48, *args[3:], impl="cuda")
    with pytest.raises(ValueError, match="G=16"):
        q16, k16, v16 = _problem(1, 2, 16, 1, 32, 64)
        decode_attention(q16, k16, v16, *args[3:], impl="cuda")
    with pytest.raises(ValueError, match="bfloat16 q, k, v.*float32"):
        f32 = [x.astype(jnp.float32) for x in (q, kc, vc)]
        decode_attention(*f32, *args[3:], impl="cuda")
    with pytest.raises(ValueError, match="attention 'flash2'"):
        Config(attention="flash2")
    with pytest.raises(flash.KernelError, match="head_dim=12"):
        flash.build(flash.flash_shape(1, 1, 64, 1, 1, 12), arch="compute_90")


# ----------------------------------------------------------------------------- split plan


def test_split_plan_covers_the_live_range():
    """Active splits tile [0, live) exactly, each non-empty (split 0 alone when live == 0),
    with at most P of them and whole tiles except the last."""
    for tile, splits, min_tiles in ((32, 64, 2), (64, 3, 1), (16, 1, 2), (256, 8, 2)):
        for live in range(0, 2000, 7):
            per, active = flash.flash_split_plan(live, tile, splits, min_tiles)
            assert 1 <= active <= splits and per >= min_tiles
            bounds = [(p * per * tile, min((p + 1) * per * tile, live)) for p in range(active)]
            covered = [s for a, e in bounds for s in range(a, e)]
            assert covered == list(range(live))
            assert live == 0 or all(a < e for a, e in bounds)


# ----------------------------------------------------------------------------- emulation


def _positions(rng, b, s, live):
    """Left padding, -1 holes, a padded query row (-1), a row whose keys all come after its
    query (no visible key), and stale positions past `live` (visible but for the live bound)."""
    k_pos = np.full((b, s), -1, np.int32)
    q_pos = np.zeros((b,), np.int32)
    for r in range(b):
        pad = int(rng.integers(0, max(1, live // 3))) if live > 1 else 0
        k_pos[r, pad:live] = np.arange(live - pad)
        k_pos[r, :live][rng.random(live) < 0.1] = -1
        q_pos[r] = max(0, live - pad - 1 - int(rng.integers(0, 3)))
        k_pos[r, min(pad + q_pos[r], live - 1)] = q_pos[r] if live else -1
        k_pos[r, live:] = rng.integers(0, 3, s - live)  # stale slots
    if b > 1:
        q_pos[1] = -1  # a padded row
    if b > 2:
        k_pos[2, :live] = np.where(k_pos[2, :live] >= 0, 10_000, -1)  # nothing visible
    return q_pos, k_pos


def _check_emulation(seed, b, n, kh, h, s, lives, options=None):
    q, kc, vc = _problem(seed, b, n, kh, h, s)
    rng = np.random.default_rng(seed)
    shape = flash.flash_shape(b, 2, s, kh, n // kh, h, options)
    assert flash.check_shape(shape) == (True, "")
    worst = 0.0
    for live in lives:
        qp, kp = _positions(rng, b, s, live)
        # slots past live are never read: NaN there reaches the output if they are
        k_nan, v_nan = _poison_past_live(kc, live), _poison_past_live(vc, live)
        ref = np.asarray(
            _ref(q, k_nan, v_nan, jnp.int32(1), jnp.asarray(qp), jnp.asarray(kp), jnp.int32(live)),
            np.float32,
        )
        k1 = np.asarray(k_nan[1], np.float32)
        v1 = np.asarray(v_nan[1], np.float32)
        emu = flash.emulate(np.asarray(q, np.float32), k1, v1, qp, kp, live, shape)
        kpl = kp[:, :live]
        vis = ((kpl >= 0) & (kpl <= qp[:, None])).any(axis=1)
        np.testing.assert_array_equal(emu[~vis], 0, err_msg=f"{live=}")
        if vis.any():
            err = _rel(emu[vis], ref[vis])
            assert err <= EMU_REL_TOL, (live, err)
            worst = max(worst, err)
    return worst


@pytest.mark.parametrize(
    "h,options",
    [
        # KPW = 16 row groups per warp, J = 16 split groups in the combine, P = 3
        (16, flash.FlashOptions(splits=3, warps=2, unroll=1, min_tiles=1)),
        (128, None),  # Qwen3-8B's H, G = 4, the default launch choices
    ],
)
def test_emulation_equals_ref_every_live_length(h, options):
    """Every live length 0..S (S = 160)."""
    s = 160
    n = 8 if h == 128 else 4
    _check_emulation(1, b=3, n=n, kh=2, h=h, s=s, lives=range(s + 1), options=options)


@pytest.mark.parametrize(
    "h,n,kh,options",
    [
        (128, 8, 2, None),  # Qwen3-8B's H and G = 4, default launch choices
        (128, 8, 2, flash.FlashOptions(splits=5, warps=3, unroll=3, min_tiles=1)),
        (64, 8, 1, flash.FlashOptions(splits=4, warps=4, unroll=2, min_tiles=2)),  # G = 8
        (256, 3, 3, flash.FlashOptions(splits=2, warps=1, unroll=5, min_tiles=1)),  # G = 1
    ],
)
def test_emulation_equals_ref_split_boundaries(h, n, kh, options):
    """Lengths at and around tile and split boundaries and lengths that are none (S = 320)."""
    s = 320
    shape = flash.flash_shape(3, 2, s, kh, n // kh, h, options)
    t = shape.tile
    lives = {1, 2, t - 1, t, t + 1, 2 * t - 1, 2 * t + 1, 3 * t, 97, 200, s - 1, s}
    lives = sorted(x for x in lives if 0 < x <= s)
    _check_emulation(2, b=3, n=n, kh=kh, h=h, s=s, lives=lives, options=options)


@needs_nvrtc
def test_direct_call_lowers_for_cuda_with_poison_aliases():
    """`decode_attention_cuda` (GPU tests, bench) lowers to one custom call with 7 operands and
    3 results; poisoned, 3 more NaN operands aliased to the results."""
    from rejax.ops.decode_attention import decode_attention_cuda

    q, kc, vc = _problem(3, 2, 8, 2, 64, 128)
    args = (q, kc, vc, jnp.int32(0), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 128), jnp.int32))
    for poison, operands in ((False, 7), (True, 10)):
        f = jax.jit(lambda *a, poison=poison: decode_attention_cuda(*a, poison=poison))
        text = f.trace(*args, jnp.int32(9)).lower(lowering_platforms=("cuda",)).as_text()
        call = next(x for x in text.splitlines() if "custom_call @__gpu$xla.gpu.ptx" in x)
        assert call.split("(", 1)[1].split(")", 1)[0].count("%") == operands
        assert _flash_calls(text) == 1
        assert ("output_operand_aliases" in call) == poison
