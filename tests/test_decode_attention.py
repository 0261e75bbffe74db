"""Decode attention over the live cache: reference vs today's masked attention, Pallas kernel
(interpret mode on CPU, the real kernel under the gpu marker) vs the reference, one compile
inside a jitted loop as the cache fills."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rejax.cache import dequantize_kv, quantize_kv
from rejax.layers import attention, attention_mask
from rejax.ops.decode_attention import (
    NUM_STAGES,
    NUM_WARPS,
    decode_attention,
    decode_attention_kernel,
    decode_attention_ref,
    default_num_splits,
    prefill_attention,
)

# kernel vs reference, bf16 out (STYLE.md): norm(y - ref) / norm(ref)
KERNEL_REL_TOL = 1e-2

# jitted once per shape: eager op-by-op dispatch would dominate these tests' time
_ref = jax.jit(decode_attention_ref)
_prefill = jax.jit(prefill_attention, static_argnames=("q_chunk", "k_chunk"))
_attention = jax.jit(lambda q, k, v, qp, kp: attention(q, k, v, attention_mask(qp, kp)))


def _rel(y, ref) -> float:
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _positions(rng, b, s, live, left_pad=True):
    """Per-row slot positions over [0, live): left padding, -1 holes; slots >= live empty.

    Returns (q_positions [B], k_positions [B, S]) as int32 numpy arrays.
    """
    k_pos = np.full((b, s), -1, np.int32)
    q_pos = np.zeros((b,), np.int32)
    for r in range(b):
        pad = int(rng.integers(0, max(1, live // 3))) if left_pad and live > 1 else 0
        k_pos[r, pad:live] = np.arange(live - pad)
        holes = rng.random(live) < 0.1  # padding slots inside the live range
        k_pos[r, :live][holes] = -1
        # the query sits at the newest position of the row, or earlier (a shorter row); its
        # own slot is never a hole, so every row with q_pos >= 0 sees a key
        q_pos[r] = max(0, live - pad - 1 - int(rng.integers(0, 3)))
        k_pos[r, pad + q_pos[r]] = q_pos[r]
    return q_pos, k_pos


def _problem(seed, *, b, n, kh, h, s, live, layers=2, dtype=jnp.bfloat16, left_pad=True):
    """Random q and cache with per-row lengths <= live, left padding and -1 holes.

    Slots >= live are empty (-1) and hold random values, as a cache reused across requests does.
    Returns (q, k_cache, v_cache, q_positions, k_positions).
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, n, h)).astype(np.float32)
    k_cache = rng.standard_normal((layers, b, s, kh, h)).astype(np.float32)
    v_cache = rng.standard_normal((layers, b, s, kh, h)).astype(np.float32)
    q_pos, k_pos = _positions(rng, b, s, live, left_pad)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k_cache, dtype),
        jnp.asarray(v_cache, dtype),
        jnp.asarray(q_pos),
        jnp.asarray(k_pos),
    )


def _visible_rows(q_pos, k_pos, live):
    kp = np.asarray(k_pos)[:, :live]
    return ((kp >= 0) & (kp <= np.asarray(q_pos)[:, None])).any(axis=1)


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("live", [1, 37, 96])
def test_ref_equals_masked_attention(dtype, live):
    q, kc, vc, qp, kp = _problem(live, b=5, n=8, kh=2, h=32, s=96, live=live, dtype=dtype)
    qp = qp.at[4].set(-1)  # a padded query row: sees no key
    for layer in (0, 1):
        out = _ref(q, kc, vc, jnp.int32(layer), qp, kp, jnp.int32(live))
        today = attention(q[:, None], kc[layer], vc[layer], attention_mask(qp[:, None], kp))[:, 0]
        vis = _visible_rows(qp, kp, live)
        assert not vis[4] and vis.sum() >= 3
        np.testing.assert_array_equal(np.asarray(out)[vis], np.asarray(today)[vis])
        np.testing.assert_array_equal(np.asarray(out)[~vis], 0)


def test_ref_ignores_slots_past_live():
    live = 40
    q, kc, vc, qp, kp = _problem(1, b=3, n=4, kh=2, h=16, s=64, live=live)
    clean = _ref(q, kc, vc, jnp.int32(1), qp, kp, jnp.int32(live))
    # stale slots past live: NaN keys / values and positions that would be visible
    kc2 = kc.at[:, :, live:].set(jnp.nan)
    vc2 = vc.at[:, :, live:].set(jnp.nan)
    kp2 = kp.at[:, live:].set(0)
    out = _ref(q, kc2, vc2, jnp.int32(1), qp, kp2, jnp.int32(live))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


# ----------------------------------------------------------------------------- kernel (interpret)

# (b, n, kh, h, s, live, block_s, num_splits): live 1, split and block boundaries, lengths that
# are a multiple of no block, the full cache, GQA G = 1, 4, 8, batch up to 8.
# (b, n, kh, h, s, live, block_s, num_splits, poison): live 1, split and block boundaries,
# lengths that are a multiple of no block, the full cache, GQA G = 1, 4, 8, batch up to 8.
# poison: call the kernel entry point with NaN outputs aliased in (as the GPU check does; the
# interpreter starts unaliased outputs as NaN too), so a split read before being written, or
# an output row never written, shows up as NaN.
KERNEL_CASES = [
    (1, 8, 2, 32, 64, 1, 16, 4, False),
    (2, 8, 2, 32, 100, 32, 16, 4, True),  # live = 2 blocks = one split boundary
    (3, 8, 1, 16, 100, 77, 16, 3, False),  # G = 8, 77 = no block multiple
    (8, 4, 4, 16, 48, 48, 16, 2, True),  # G = 1, live = S, batch 8
    (2, 16, 4, 32, 256, 129, 64, None, False),  # default block and splits, one slot past a block
]


@pytest.mark.parametrize("b,n,kh,h,s,live,block_s,splits,poison", KERNEL_CASES)
def test_kernel_interpret_equals_ref(b, n, kh, h, s, live, block_s, splits, poison):
    _check_interpret(b, n, kh, h, s, live, block_s, splits, poison)


def _check_interpret(b, n, kh, h, s, live, block_s, splits, poison, **launch):
    """The interpreted kernel (with launch choices `launch`) against the reference."""
    q, kc, vc, qp, kp = _problem(s + live, b=b, n=n, kh=kh, h=h, s=s, live=live)
    if b > 1:
        qp = qp.at[b - 1].set(-1)  # a padded row
    # slots past live are never read: poison them
    kc = kc.at[:, :, live:].set(jnp.nan)
    vc = vc.at[:, :, live:].set(jnp.nan)
    args = (q, kc, vc, jnp.int32(1), qp, kp, jnp.int32(live))
    ref = decode_attention(*args, impl="ref")
    if poison:
        if splits is None:
            splits = default_num_splits(b, kh, s, block_s)
        out = decode_attention_kernel(
            *args, block_s=block_s, num_splits=splits, interpret=True, poison=True, **launch
        )
    else:
        out = decode_attention(
            *args, impl="interpret", block_s=block_s, num_splits=splits, **launch
        )
    assert out.shape == q.shape and out.dtype == q.dtype
    vis = _visible_rows(qp, kp, live)
    assert vis.any()
    assert _rel(np.asarray(out)[vis], np.asarray(ref)[vis]) <= KERNEL_REL_TOL
    np.testing.assert_array_equal(np.asarray(out)[~vis], 0)


def _per_row_problem(seed, lives, s=96, block_s=16):
    """Rows of different lengths: row r's keys in [0, lives[r]), stale NaN slots past it."""
    b = len(lives)
    q, kc, vc, _, _ = _problem(seed, b=b, n=8, kh=2, h=32, s=s, live=max(lives))
    rng = np.random.default_rng(seed)
    kp = np.full((b, s), -1, np.int32)
    qp = np.zeros((b,), np.int32)
    for r, n in enumerate(lives):
        pad = int(rng.integers(0, max(1, n // 3)))
        kp[r, pad:n] = np.arange(n - pad)
        qp[r] = n - pad - 1
        kc = kc.at[:, r, n:].set(jnp.nan)
        vc = vc.at[:, r, n:].set(jnp.nan)
    # stale positions past a row's live length that its query would see: only `live` hides them
    kp_stale = np.where(np.arange(s)[None, :] >= np.asarray(lives)[:, None], 0, kp)
    return q, kc, vc, jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(kp_stale)


def test_per_row_live_reference_and_kernel():
    lives = [5, 77, 33, 96]
    q, kc, vc, qp, kp, kp_stale = _per_row_problem(21, lives)
    live = jnp.asarray(lives, jnp.int32)
    clean = _ref(q, kc.at[:, :].set(jnp.nan_to_num(kc)), vc.at[:, :].set(jnp.nan_to_num(vc)),
                 jnp.int32(1), qp, kp, jnp.int32(max(lives)))  # fmt: skip
    ref = _ref(q, kc, vc, jnp.int32(1), qp, kp_stale, live)
    # with per-row lengths nothing past a row's own length is read (NaN) or seen (stale
    # positions), and the result is the scalar-live one over clean slots
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(clean))
    out = decode_attention(
        q, kc, vc, jnp.int32(1), qp, kp_stale, live, impl="interpret", block_s=16, num_splits=3
    )
    assert _rel(out, ref) <= KERNEL_REL_TOL


def test_per_row_live_row_does_not_depend_on_other_rows():
    # A row's splits come from its own length: its result is bitwise the same next to rows of
    # other lengths, and in a batch of fewer rows with the same split count (slot compaction)
    lives = [40, 90, 17, 64]
    q, kc, vc, qp, _, kp = _per_row_problem(22, lives)
    live = jnp.asarray(lives, jnp.int32)
    run = jax.jit(
        lambda q, kc, vc, qp, kp, live: decode_attention(
            q, kc, vc, jnp.int32(0), qp, kp, live, impl="interpret", block_s=16, num_splits=4
        )
    )
    full = np.asarray(run(q, kc, vc, qp, kp, live))
    idx = jnp.asarray([3, 0])
    sub = np.asarray(run(q[idx], kc[:, idx], vc[:, idx], qp[idx], kp[idx], live[idx]))
    np.testing.assert_array_equal(sub, full[np.asarray(idx)])
    # the longest row changed: the others keep their bits
    longer = live.at[1].set(96)
    kp2 = kp.at[1].set(jnp.where(jnp.arange(96) < 96, jnp.arange(96), -1))
    again = np.asarray(run(q, kc.at[:, 1].set(0.5), vc.at[:, 1].set(0.5), qp.at[1].set(95), kp2,
                           longer))  # fmt: skip
    np.testing.assert_array_equal(again[[0, 2, 3]], full[[0, 2, 3]])


def _fill_loop(impl, n_steps, counter):
    """A jitted while_loop that writes one token per step into a 2-layer stacked cache and runs
    decode attention over every layer with `lax.scan` (layer and live are traced)."""

    def run(q, kc, vc, kp, live0):
        counter[0] += 1
        b = q.shape[0]

        def step(carry):
            i, live, kc, vc, kp, acc = carry
            new = (jnp.cos(i.astype(jnp.float32) + jnp.arange(q.shape[-1])) * 0.5).astype(kc.dtype)
            kc = kc.at[:, :, live].set(new)
            vc = vc.at[:, :, live].set(-new)
            kp = kp.at[:, live].set(live)
            live = live + 1

            def layer_body(x, layer):
                y = decode_attention(
                    x,
                    kc,
                    vc,
                    layer,
                    jnp.full((b,), live - 1),
                    kp,
                    live,
                    impl=impl,
                    block_s=16,
                    num_splits=3,
                )
                return (x + y).astype(x.dtype), None

            x, _ = jax.lax.scan(layer_body, q, jnp.arange(kc.shape[0], dtype=jnp.int32))
            return i + 1, live, kc, vc, kp, acc + x.astype(jnp.float32)

        init = (jnp.int32(0), live0, kc, vc, kp, jnp.zeros(q.shape, jnp.float32))
        return jax.lax.while_loop(lambda c: c[0] < n_steps, step, init)[-1]

    return jax.jit(run)


def test_kernel_compiles_once_in_while_loop():
    s = 48
    q, kc, vc, _, _ = _problem(3, b=2, n=4, kh=2, h=16, s=s, live=10, left_pad=False)
    count, count_ref = [0], [0]
    f = _fill_loop("interpret", 3, count)
    f_ref = _fill_loop("ref", 3, count_ref)
    for live0 in (10, 15, 31):  # 31 + 3 steps crosses the block boundary at 32
        kp0 = jnp.where(jnp.arange(s) < live0, jnp.arange(s), -1)[None].repeat(2, 0)
        kp0 = kp0.astype(jnp.int32)
        out = f(q, kc, vc, kp0, jnp.int32(live0))
        ref = f_ref(q, kc, vc, kp0, jnp.int32(live0))
        assert _rel(out, ref) <= KERNEL_REL_TOL
    assert count == [1] and count_ref == [1]


# ----------------------------------------------------------------------------- dispatch, errors


def test_auto_on_cpu_is_ref():
    q, kc, vc, qp, kp = _problem(4, b=2, n=4, kh=2, h=16, s=32, live=20)
    args = (q, kc, vc, jnp.int32(0), qp, kp, jnp.int32(20))
    np.testing.assert_array_equal(np.asarray(decode_attention(*args)), np.asarray(_ref(*args)))


def _cuda_kernels(q, kc, vc, qp, kp, impl):
    """Names of the Pallas kernels in the program lowered for CUDA (no GPU needed to lower)."""
    f = jax.jit(lambda *a: decode_attention(*a, impl=impl))
    text = (
        f.trace(q, kc, vc, jnp.int32(0), qp, kp, jnp.int32(3))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    return re.findall(r'name = "(rejax_decode_attention_[a-z]+)"', text)


def test_cuda_lowering_dispatch():
    q, kc, vc, qp, kp = _problem(9, b=2, n=8, kh=2, h=64, s=64, live=20)
    both = ["rejax_decode_attention_partials", "rejax_decode_attention_combine"]
    assert _cuda_kernels(q, kc, vc, qp, kp, "auto") == both
    assert _cuda_kernels(q, kc, vc, qp, kp, "pallas") == both
    assert _cuda_kernels(q, kc, vc, qp, kp, "ref") == []
    f32 = [x.astype(jnp.float32) for x in (q, kc, vc)]
    with pytest.warns(UserWarning, match="bfloat16 or float16"):
        assert _cuda_kernels(*f32, qp, kp, "auto") == []


def test_auto_falls_back_when_the_kernel_does_not_compile(monkeypatch):
    # Pretend to be on a GPU: the probe then compiles the kernel for real, which fails on this
    # CPU, and impl="auto" must emit the reference (with a warning) instead.
    import rejax.ops.decode_attention as da

    monkeypatch.setattr(da, "_on_cuda", lambda: True)
    da._compile_error.cache_clear()
    q, kc, vc, qp, kp = _problem(12, b=1, n=4, kh=2, h=32, s=32, live=20)
    try:
        with pytest.warns(UserWarning, match="does not compile here"):
            assert _cuda_kernels(q, kc, vc, qp, kp, "auto") == []
        # forcing the kernel skips the probe: the failure surfaces where it happens
        both = ["rejax_decode_attention_partials", "rejax_decode_attention_combine"]
        assert _cuda_kernels(q, kc, vc, qp, kp, "pallas") == both
    finally:
        da._compile_error.cache_clear()


def test_pallas_raises_off_cuda():
    q, kc, vc, qp, kp = _problem(5, b=1, n=4, kh=2, h=16, s=32, live=20)
    with pytest.raises(ValueError, match="needs the CUDA platform"):
        decode_attention(q, kc, vc, jnp.int32(0), qp, kp, jnp.int32(20), impl="pallas")


def test_bad_inputs_raise():
    q, kc, vc, qp, kp = _problem(6, b=2, n=4, kh=2, h=16, s=32, live=20)
    one, live = jnp.int32(1), jnp.int32(20)
    with pytest.raises(ValueError, match="impl="):
        decode_attention(q, kc, vc, one, qp, kp, live, impl="cuda")
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(q[:, None], kc, vc, one, qp, kp, live)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        decode_attention(q, kc, vc[0], one, qp, kp, live)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q[:, :3], kc, vc, one, qp, kp, live)
    with pytest.raises(ValueError, match="k_positions must be"):
        decode_attention(q, kc, vc, one, qp, kp[:, :5], live)
    with pytest.raises(ValueError, match="live=33 out of range"):
        decode_attention(q, kc, vc, one, qp, kp, 33)
    with pytest.raises(ValueError, match="layer=2 out of range"):
        decode_attention(q, kc, vc, 2, qp, kp, live)
    with pytest.raises(ValueError, match="integer scalar"):
        decode_attention(q, kc, vc, one, qp, kp, jnp.float32(3.0))
    with pytest.raises(ValueError, match=r"live must be an integer scalar or \[B\]=\(2,\)"):
        decode_attention(q, kc, vc, one, qp, kp, jnp.asarray([20, 20, 20], jnp.int32))
    with pytest.raises(ValueError, match="live=33 out of range"):
        decode_attention(q, kc, vc, one, qp, kp, jnp.asarray([20, 33], jnp.int32))
    with pytest.raises(ValueError, match="power-of-two head dim"):
        decode_attention(
            q[..., :12], kc[..., :12], vc[..., :12], one, qp, kp, live, impl="interpret"
        )
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        f32 = [x.astype(jnp.float32) for x in (q, kc, vc)]
        decode_attention(*f32, one, qp, kp, live, impl="interpret")


# ----------------------------------------------------------------------------- launch choices

# The partials kernel's launch choices. num_warps / num_stages leave the interpreted kernel as it
# is (the interpreter ignores them; test_launch_choices_reach_the_cuda_lowering checks that they
# reach the Triton call); blocks_per_iter and prefetch change the block loop itself.
LAUNCH_VARIANTS = [
    {"num_warps": 8, "num_stages": 3},
    {"num_warps": 2, "num_stages": 1},
    {"blocks_per_iter": 2},
    {"blocks_per_iter": 3},
    {"prefetch": True},
    {"prefetch": True, "blocks_per_iter": 2, "num_stages": 1},
]
# KERNEL_CASES with several blocks per split, plus a long one (18 blocks, 9 per split): groups
# of u blocks that do and do not divide a split, the fully masked prefetch after a split's last
# block, splits with no block (live 1 of 4 splits).
LAUNCH_CASES = [
    KERNEL_CASES[0],
    KERNEL_CASES[2],
    KERNEL_CASES[3],
    (2, 8, 2, 32, 300, 283, 16, 2, True),
    (2, 8, 2, 32, 300, 290, 16, 2, False),
]


def _launch_id(launch: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in launch.items())


@pytest.mark.parametrize("launch", LAUNCH_VARIANTS, ids=_launch_id)
@pytest.mark.parametrize("b,n,kh,h,s,live,block_s,splits,poison", LAUNCH_CASES)
def test_launch_variants_interpret_equal_ref(launch, b, n, kh, h, s, live, block_s, splits, poison):
    _check_interpret(b, n, kh, h, s, live, block_s, splits, poison, **launch)


def _triton_calls(f, *args) -> list[tuple[str, int, int]]:
    """(name, num_warps, num_stages) of each Pallas Triton call in f lowered for CUDA."""
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    found = re.findall(
        r'name = "(rejax_decode_attention_[a-z]+)", num_stages = (\d+) : i32, '
        r"num_warps = (\d+) : i32",
        text,
    )
    return [(name, int(w), int(st)) for name, st, w in found]


def test_launch_choices_reach_the_cuda_lowering():
    # Lowering for CUDA builds each variant's Triton IR (no GPU needed): every variant must
    # lower, and num_warps / num_stages must land on the partials call only.
    q, kc, vc, qp, kp = _problem(15, b=2, n=8, kh=2, h=64, s=64, live=20)
    k8, v8, ks, vs = _fp8(kc, vc)
    args = (jnp.int32(0), qp, kp, jnp.int32(20))
    combine = ("rejax_decode_attention_combine", NUM_WARPS, NUM_STAGES)
    for launch in [{}, *LAUNCH_VARIANTS]:
        f = jax.jit(lambda *a, launch=launch: decode_attention(*a, impl="pallas", **launch))
        warps, stages = launch.get("num_warps", NUM_WARPS), launch.get("num_stages", NUM_STAGES)
        partials = ("rejax_decode_attention_partials", warps, stages)
        assert _triton_calls(f, q, kc, vc, *args) == [partials, combine], launch
        f8 = jax.jit(
            lambda *a, launch=launch: decode_attention(
                *a[:7], k_scale=a[7], v_scale=a[8], impl="pallas", **launch
            )
        )
        assert _triton_calls(f8, q, k8, v8, *args, ks, vs) == [partials, combine], launch


@pytest.mark.parametrize("launch", LAUNCH_VARIANTS[2:], ids=_launch_id)
def test_fp8_launch_variants_interpret_equal_ref(launch):
    b, n, kh, h, s, live, block_s, splits, poison = LAUNCH_CASES[3]
    _check_fp8_interpret(b, n, kh, h, s, live, block_s, splits, poison, **launch)


@pytest.mark.parametrize(
    "launch,message",
    [
        ({"num_warps": 3}, r"num_warps must be a power of two in \[1, 32\], got 3$"),
        ({"num_warps": 0}, r"num_warps must be .* got 0$"),
        ({"num_warps": 64}, r"num_warps must be .* got 64$"),
        ({"num_warps": True}, r"num_warps must be .* got True$"),
        ({"num_stages": 0}, r"num_stages must be an integer in \[1, 8\], got 0$"),
        ({"num_stages": 2.0}, r"num_stages must be .* got 2.0$"),
        ({"blocks_per_iter": 9}, r"blocks_per_iter must be an integer in \[1, 8\], got 9$"),
        ({"blocks_per_iter": 0}, r"blocks_per_iter must be .* got 0$"),
        ({"prefetch": 2}, r"prefetch must be a bool, got 2$"),
        ({"prefetch": "yes"}, r"prefetch must be a bool, got 'yes'$"),
        ({"num_splits": 0}, r"num_splits must be in \[1, 128\], got 0$"),
        ({"num_splits": 129}, r"num_splits must be in \[1, 128\], got 129$"),
    ],
)
def test_bad_launch_choices_raise(launch, message):
    q, kc, vc, qp, kp = _problem(16, b=2, n=4, kh=2, h=16, s=32, live=20)
    args = (q, kc, vc, jnp.int32(1), qp, kp, jnp.int32(20))
    # refused whatever the impl (the reference too), before any lowering
    for impl in ("auto", "ref", "interpret"):
        with pytest.raises(ValueError, match=message):
            decode_attention(*args, impl=impl, **launch)
    kernel_launch = {"block_s": 16, "num_splits": 2, **launch}
    with pytest.raises(ValueError, match=message):
        decode_attention_kernel(*args, interpret=True, **kernel_launch)


def test_kernel_entry_refuses_bad_block_s():
    q, kc, vc, qp, kp = _problem(17, b=1, n=4, kh=2, h=16, s=32, live=20)
    args = (q, kc, vc, jnp.int32(1), qp, kp, jnp.int32(20))
    for bad in (24, 8, 0):
        with pytest.raises(ValueError, match=rf"block_s must be a power of two >= 16, got {bad}$"):
            decode_attention_kernel(*args, block_s=bad, num_splits=2, interpret=True)
    # decode_attention keeps its old rule: impl="auto" takes the reference, "interpret" raises
    ref = decode_attention(*args, impl="ref")
    np.testing.assert_array_equal(np.asarray(decode_attention(*args, block_s=24)), ref)
    with pytest.raises(ValueError, match="block_s must be a power of two >= 16, got 24"):
        decode_attention(*args, impl="interpret", block_s=24)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "b,s,lives",
    [
        (1, 33280, (1, 63, 64, 65, 1000, 8191, 33280)),
        (8, 8192, (1, 129, 4097, 8192)),
        (64, 1536, (1, 777, 1536)),
    ],
)
def test_kernel_equals_ref_gpu(b, s, lives):
    n, kh, h = 32, 8, 128  # Qwen3-8B
    keys = jax.random.split(jax.random.key(b), 3)
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    k_full = jax.random.normal(keys[1], (2, b, s, kh, h), jnp.bfloat16)
    v_full = jax.random.normal(keys[2], (2, b, s, kh, h), jnp.bfloat16)
    rng = np.random.default_rng(s)
    for live in lives:
        qp, kp = _positions(rng, b, s, live)
        if b > 1:
            qp[b - 1] = -1  # a padded row
        qp, kp = jnp.asarray(qp), jnp.asarray(kp)
        # slots past live are never read: poison them
        kc = k_full.at[:, :, live:].set(jnp.nan)
        vc = v_full.at[:, :, live:].set(jnp.nan)
        args = (q, kc, vc, jnp.int32(1), qp, kp, jnp.int32(live))
        out = decode_attention(*args, impl="pallas")
        ref = decode_attention(*args, impl="ref")
        splits = default_num_splits(b, kh, s)
        poisoned = decode_attention_kernel(*args, num_splits=splits, poison=True)
        np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(out))
        vis = _visible_rows(qp, kp, live)
        assert _rel(np.asarray(out)[vis], np.asarray(ref)[vis]) <= KERNEL_REL_TOL, live
        np.testing.assert_array_equal(np.asarray(out)[~vis], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s", [(8, 8192), (64, 1536)])
def test_per_row_live_kernel_gpu(b, s):
    # per-row live lengths: the kernel equals the reference, reads nothing past a row's own
    # length (NaN there), and a row's bits do not depend on the other rows (a gathered half of
    # the batch with the full batch's split count, as slot compaction runs it)
    n, kh, h = 32, 8, 128
    keys = jax.random.split(jax.random.key(b + 1), 3)
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    kc = jax.random.normal(keys[1], (2, b, s, kh, h), jnp.bfloat16)
    vc = jax.random.normal(keys[2], (2, b, s, kh, h), jnp.bfloat16)
    rng = np.random.default_rng(b)
    lives = rng.integers(1, s + 1, b).astype(np.int32)
    lives[0] = s
    kp = np.full((b, s), -1, np.int32)
    qp = np.zeros((b,), np.int32)
    for r, ln in enumerate(lives):
        pad = int(rng.integers(0, max(1, ln // 3)))
        kp[r, pad:ln] = np.arange(ln - pad)
        qp[r] = ln - pad - 1
    mask = jnp.arange(s)[None, :, None, None] >= jnp.asarray(lives)[:, None, None, None]
    kc = jnp.where(mask[None], jnp.nan, kc).astype(jnp.bfloat16)
    vc = jnp.where(mask[None], jnp.nan, vc).astype(jnp.bfloat16)
    qp, kp, live = jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(lives)
    splits = default_num_splits(b, kh, s)
    run = jax.jit(
        lambda q, kc, vc, qp, kp, live: decode_attention(
            q, kc, vc, jnp.int32(1), qp, kp, live, impl="pallas", num_splits=splits
        )
    )
    out = np.asarray(run(q, kc, vc, qp, kp, live))
    ref = np.asarray(decode_attention(q, kc, vc, jnp.int32(1), qp, kp, live, impl="ref"))
    assert np.isfinite(out).all()
    assert _rel(out, ref) <= KERNEL_REL_TOL
    idx = jnp.asarray(np.sort(rng.choice(b, b // 2, replace=False)))
    sub = run(q[idx], kc[:, idx], vc[:, idx], qp[idx], kp[idx], live[idx])
    np.testing.assert_array_equal(np.asarray(sub), out[np.asarray(idx)])


@pytest.mark.gpu
def test_kernel_compiles_once_in_while_loop_gpu():
    s = 4096
    q, kc, vc, _, _ = _problem(7, b=8, n=32, kh=8, h=128, s=s, live=100, left_pad=False)
    count, count_ref = [0], [0]
    f, f_ref = _fill_loop("pallas", 8, count), _fill_loop("ref", 8, count_ref)
    for live0 in (100, 1000, 4000):
        kp0 = jnp.where(jnp.arange(s) < live0, jnp.arange(s), -1)[None].repeat(8, 0)
        kp0 = kp0.astype(jnp.int32)
        out = f(q, kc, vc, kp0, jnp.int32(live0))
        assert _rel(out, f_ref(q, kc, vc, kp0, jnp.int32(live0))) <= KERNEL_REL_TOL
    assert count == [1]


# ----------------------------------------------------------------------------- prefill


def _prefill_problem(seed, *, b, t, s, n, kh, h, dtype):
    """Cache slots [0, T) hold the prompt (left padded per row, -1 holes); the other S - T slots
    are empty. Returns (q, k, v, q_positions, k_positions)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
    k_pos = np.full((b, s), -1, np.int32)
    q_pos = np.full((b, t), -1, np.int32)
    for r in range(b):
        pad = int(rng.integers(0, t // 2))
        q_pos[r, pad:] = np.arange(t - pad)
        k_pos[r, :t] = q_pos[r]
        holes = rng.random(t) < 0.1
        k_pos[r, :t][holes & (np.arange(t) > pad)] = -1
    return q, k, v, jnp.asarray(q_pos), jnp.asarray(k_pos)


@pytest.mark.parametrize(
    "dtype,tol",
    [(jnp.float32, 1e-5), (jnp.bfloat16, KERNEL_REL_TOL)],  # f32: no cast of the weights
)
def test_prefill_equals_masked_attention(dtype, tol):
    # T and S no multiple of the chunks: a padded query chunk, and a last key chunk shifted back
    # to slots 33..52 that overlaps prompt slots 33..36 of the chunk before it
    q, k, v, qp, kp = _prefill_problem(10, b=3, t=37, s=53, n=8, kh=2, h=16, dtype=dtype)
    out = _prefill(q, k, v, qp, kp, q_chunk=16, k_chunk=20)
    today = _attention(q, k, v, qp, kp)
    vis = np.asarray(attention_mask(qp, kp)).any(axis=-1)  # [B, T]
    assert (~vis).any() and vis.sum() > 50  # padded queries and real ones
    assert _rel(np.asarray(out)[vis], np.asarray(today)[vis]) <= tol
    np.testing.assert_array_equal(np.asarray(out)[~vis], 0)


def _largest_intermediate(closed_jaxpr) -> int:
    """Element count of the largest value any equation (at any nesting depth) produces."""

    def walk(jaxpr):
        biggest = 0
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        biggest = max(biggest, walk(sub.jaxpr))
                    elif hasattr(sub, "eqns"):
                        biggest = max(biggest, walk(sub))
        return biggest

    return walk(closed_jaxpr.jaxpr)


def test_prefill_never_materializes_scores():
    b, t, s, n, kh, h = 1, 512, 1024, 8, 2, 8  # q ([B, T, N, H]) smaller than a score chunk
    sd = jax.ShapeDtypeStruct
    args = (
        sd((b, t, n, h), jnp.bfloat16),
        sd((b, s, kh, h), jnp.bfloat16),
        sd((b, s, kh, h), jnp.bfloat16),
        sd((b, t), jnp.int32),
        sd((b, s), jnp.int32),
    )
    jaxpr = jax.make_jaxpr(lambda *a: prefill_attention(*a, q_chunk=64, k_chunk=128))(*args)
    assert _largest_intermediate(jaxpr) == b * n * 64 * 128  # one chunk of scores
    today = jax.make_jaxpr(lambda q, k, v, qp, kp: attention(q, k, v, attention_mask(qp, kp)))
    assert _largest_intermediate(today(*args)) == b * n * t * s  # the check sees [B, N, T, S]


def test_prefill_bad_inputs_raise():
    q, k, v, qp, kp = _prefill_problem(11, b=2, t=8, s=16, n=4, kh=2, h=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        prefill_attention(q[:, :, :3], k, v, qp, kp)
    with pytest.raises(ValueError, match="positions must be"):
        prefill_attention(q, k, v, qp[:, :4], kp)
    with pytest.raises(ValueError, match="k, v must be"):
        prefill_attention(q, k, v[:, :8], qp, kp)
    with pytest.raises(ValueError, match="chunks must be"):
        prefill_attention(q, k, v, qp, kp, k_chunk=0)


@pytest.mark.gpu
def test_prefill_long_prompt_gpu():
    # An 8K-token prompt, Qwen3-8B heads: today's attention holds 8.6 GB of scores here.
    t, n, kh, h = 8192, 32, 8, 128
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, t, kh, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, t, kh, h), jnp.bfloat16)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    out = _prefill(q, k, v, pos, pos)
    assert _rel(out, _attention(q, k, v, pos, pos)) <= KERNEL_REL_TOL


# ----------------------------------------------------------------------------- fp8 cache

# fp8 reference vs the bf16 reference on the same (bf16) cache entries, N(0, 1) data:
# norm(y - ref) / norm(ref). E4M3 rounds each entry by <= 2**-4 relative (about 2**-5.5 rms);
# measured 0.022-0.034 over these problems.
FP8_VS_BF16_REL_TOL = 0.05


def _fp8(kc, vc):
    """(k codes, v codes, k_scale, v_scale) of a stacked cache, as rejax.cache writes them."""
    (k8, ks), (v8, vs) = quantize_kv(kc), quantize_kv(vc)
    return k8, v8, ks, vs


@pytest.mark.parametrize("live", [1, 37, 96])
def test_fp8_ref_near_bf16_ref(live):
    q, kc, vc, qp, kp = _problem(live + 3, b=5, n=8, kh=2, h=32, s=96, live=live)
    k8, v8, ks, vs = _fp8(kc, vc)
    for layer in (0, 1):
        args = (jnp.int32(layer), qp, kp, jnp.int32(live))
        bf16 = _ref(q, kc, vc, *args)
        fp8 = decode_attention(q, k8, v8, *args, k_scale=ks, v_scale=vs, impl="ref")
        # the reference is the bf16 path over the dequantized layer, exactly
        deq = [dequantize_kv(c, s, q.dtype) for c, s in ((k8, ks), (v8, vs))]
        np.testing.assert_array_equal(np.asarray(fp8), np.asarray(_ref(q, *deq, *args)))
        vis = _visible_rows(qp, kp, live)
        assert vis.any()
        assert 0 < _rel(np.asarray(fp8)[vis], np.asarray(bf16)[vis]) <= FP8_VS_BF16_REL_TOL


@pytest.mark.parametrize("b,n,kh,h,s,live,block_s,splits,poison", KERNEL_CASES[1:4])
def test_fp8_kernel_interpret_equals_ref(b, n, kh, h, s, live, block_s, splits, poison):
    _check_fp8_interpret(b, n, kh, h, s, live, block_s, splits, poison)


def _check_fp8_interpret(b, n, kh, h, s, live, block_s, splits, poison, **launch):
    """The interpreted kernel over an fp8 cache (launch choices `launch`) against the reference."""
    q, kc, vc, qp, kp = _problem(s + live + 1, b=b, n=n, kh=kh, h=h, s=s, live=live)
    if b > 1:
        qp = qp.at[b - 1].set(-1)  # a padded row
    k8, v8, ks, vs = _fp8(kc, vc)
    # slots past live are never read: NaN codes and scales there
    k8, v8 = (x.at[:, :, live:].set(jnp.nan) for x in (k8, v8))
    ks, vs = (x.at[:, :, live:].set(jnp.nan) for x in (ks, vs))
    args = (q, k8, v8, jnp.int32(1), qp, kp, jnp.int32(live))
    ref = decode_attention(*args, k_scale=ks, v_scale=vs, impl="ref")
    if poison:
        out = decode_attention_kernel(
            *args, ks, vs, block_s=block_s, num_splits=splits, interpret=True, poison=True,
            **launch,
        )  # fmt: skip
    else:
        out = decode_attention(
            *args, k_scale=ks, v_scale=vs, impl="interpret", block_s=block_s, num_splits=splits,
            **launch,
        )  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    vis = _visible_rows(qp, kp, live)
    assert vis.any()
    assert _rel(np.asarray(out)[vis], np.asarray(ref)[vis]) <= KERNEL_REL_TOL
    np.testing.assert_array_equal(np.asarray(out)[~vis], 0)


def test_fp8_prefill_equals_dequantized_attention():
    q, k, v, qp, kp = _prefill_problem(13, b=2, t=37, s=53, n=8, kh=2, h=16, dtype=jnp.bfloat16)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    out = prefill_attention(q, k8, v8, qp, kp, k_scale=ks, v_scale=vs, q_chunk=16, k_chunk=20)
    kd, vd = dequantize_kv(k8, ks, q.dtype), dequantize_kv(v8, vs, q.dtype)
    today = _attention(q, kd, vd, qp, kp)
    vis = np.asarray(attention_mask(qp, kp)).any(axis=-1)
    assert _rel(np.asarray(out)[vis], np.asarray(today)[vis]) <= KERNEL_REL_TOL
    np.testing.assert_array_equal(np.asarray(out)[~vis], 0)
    with pytest.raises(ValueError, match="k_scale and v_scale must both be"):
        prefill_attention(q, k8, v8, qp, kp, k_scale=ks)


def test_fp8_cuda_lowering_and_bad_scales_raise():
    q, kc, vc, qp, kp = _problem(14, b=2, n=8, kh=2, h=64, s=64, live=20)
    k8, v8, ks, vs = _fp8(kc, vc)
    f = jax.jit(lambda *a: decode_attention(*a[:7], k_scale=a[7], v_scale=a[8]))
    text = (
        f.trace(q, k8, v8, jnp.int32(0), qp, kp, jnp.int32(3), ks, vs)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    names = re.findall(r'name = "(rejax_decode_attention_[a-z]+)"', text)
    assert names == ["rejax_decode_attention_partials", "rejax_decode_attention_combine"]
    args = (q, k8, v8, jnp.int32(0), qp, kp, jnp.int32(20))
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        decode_attention(*args)
    with pytest.raises(ValueError, match="needs both k_scale and v_scale"):
        decode_attention(*args, k_scale=ks)
    with pytest.raises(ValueError, match=r"k_scale must be float32 \[L, B, S, K\]"):
        decode_attention(*args, k_scale=ks[..., :1], v_scale=vs)
    with pytest.raises(ValueError, match="must hold float8_e4m3fn codes"):
        decode_attention(q, kc, vc, *args[3:], k_scale=ks, v_scale=vs)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,lives", [(1, 33280, (1, 65, 8191, 33280)), (8, 8192, (1, 4097))])
def test_fp8_kernel_equals_ref_gpu(b, s, lives):
    n, kh, h = 32, 8, 128  # Qwen3-8B
    keys = jax.random.split(jax.random.key(b + 1), 3)
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    k8, v8, ks, vs = _fp8(
        jax.random.normal(keys[1], (2, b, s, kh, h), jnp.bfloat16),
        jax.random.normal(keys[2], (2, b, s, kh, h), jnp.bfloat16),
    )
    rng = np.random.default_rng(s + 1)
    for live in lives:
        qp, kp = _positions(rng, b, s, live)
        if b > 1:
            qp[b - 1] = -1  # a padded row
        qp, kp = jnp.asarray(qp), jnp.asarray(kp)
        kc, vc = (x.at[:, :, live:].set(jnp.nan) for x in (k8, v8))
        args = (q, kc, vc, jnp.int32(1), qp, kp, jnp.int32(live))
        out = decode_attention(*args, k_scale=ks, v_scale=vs, impl="pallas")
        ref = decode_attention(*args, k_scale=ks, v_scale=vs, impl="ref")
        splits = default_num_splits(b, kh, s)
        poisoned = decode_attention_kernel(*args, ks, vs, num_splits=splits, poison=True)
        np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(out))
        vis = _visible_rows(qp, kp, live)
        assert _rel(np.asarray(out)[vis], np.asarray(ref)[vis]) <= KERNEL_REL_TOL, live
        np.testing.assert_array_equal(np.asarray(out)[~vis], 0)


@pytest.mark.gpu
def test_fp8_kernel_compiles_once_in_while_loop_gpu():
    # the fp8 decoder path inside jitted decode steps: one compile as the cache fills
    import dataclasses

    from rejax.cache import init_cache
    from rejax.config import QWEN3_8B
    from rejax.decode import TRACE_COUNTS, decode_step
    from rejax.params import random_params
    from rejax.sampling import Greedy, sampler_init

    cfg = dataclasses.replace(QWEN3_8B, num_layers=2, attention="live", kv_dtype="fp8")
    params = random_params(dataclasses.replace(cfg, quant="nvfp4"), 0)
    b = 2
    cache = init_cache(params.cfg, b, 300)
    logits = jnp.zeros((b, cfg.vocab_size), jnp.float32)
    keys = jax.random.split(jax.random.key(0), b)
    state = sampler_init(Greedy(), b)
    before = TRACE_COUNTS["decode_step"]
    for step in range(3):
        pos = jnp.full((b,), step, jnp.int32)
        _, logits, cache, state, _ = decode_step(
            params, logits, cache, pos, Greedy(), state, keys, jnp.int32(step)
        )
    assert TRACE_COUNTS["decode_step"] - before == 1
    assert bool(jnp.all(jnp.isfinite(logits)))
