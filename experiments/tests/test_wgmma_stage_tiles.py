"""The wgmma GEMM's BULK operands (cuda_ops/nvfp4_gemm_wgmma.py): the pre-tiled x_hat and
weight layouts equal the shared-memory images that the kernel's cp.async copies write
(load_stage's and load_weight_stage's address formulas, replayed piece by piece), so a bulk copy
of a tile fills a ring slot exactly as the per-thread copies do."""

import numpy as np
import pytest

from cuda_ops import nvfp4_gemm_wgmma as st


def _load_stage_image(xw, m0, kt_index, tm, kt):
    """The bytes load_stage (cuda_ops/nvfp4_gemm_wgmma.cu, its loop form) writes for one stage:
    chunk i is token 8 mg + mr, column q; it lands at q * X_COL + mg * 128 + mr * 16 bytes and
    holds x_w[m, kt_index * KT + 8 q .. + 8] (zeros past M)."""
    m_tok, _ = xw.shape
    raw = xw.view(np.uint8)  # 2 bytes an element
    x_col = tm * 16
    image = np.zeros(tm * kt * 2, np.uint8)
    for i in range(tm * kt // 8):
        mr, q, mg = i & 7, (i >> 3) % (kt // 8), (i >> 3) // (kt // 8)
        m = m0 + 8 * mg + mr
        dst = q * x_col + mg * 128 + mr * 16
        if m < m_tok:
            src = kt_index * kt * 2 + q * 16
            image[dst : dst + 16] = raw[m, src : src + 16]
    return image


@pytest.mark.parametrize(("m", "k", "tm", "kt"), [(256, 512, 128, 128), (200, 256, 128, 128),
                                                 (40, 384, 64, 128), (16, 512, 16, 256)])  # fmt: skip
def test_stage_tiles_are_load_stages_image(m, k, tm, kt):
    rng = np.random.default_rng(m + k)
    xw = rng.standard_normal((m, k)).astype(np.float16)
    tiles = st.to_stage_tiles(xw, tm, kt)
    assert tiles.shape == (-(-m // tm), k // kt, tm * kt)
    for t in range(tiles.shape[0]):
        for s in range(tiles.shape[1]):
            want = _load_stage_image(xw, t * tm, s, tm, kt)
            assert np.array_equal(np.ascontiguousarray(tiles[t, s]).view(np.uint8), want), (t, s)
    assert np.array_equal(st.from_stage_tiles(tiles, m, tm, kt), xw)


def test_stage_tiles_in_jax_match_numpy():
    import jax.numpy as jnp

    xw = np.arange(40 * 256, dtype=np.float32).reshape(40, 256).astype(np.float16)
    got = np.asarray(st.to_stage_tiles(jnp.asarray(xw), 64, 128))
    assert np.array_equal(got, st.to_stage_tiles(xw, 64, 128))


def test_stage_tiles_refuse_bad_tiles():
    x = np.zeros((8, 256), np.float16)
    with pytest.raises(ValueError, match="tm=12"):
        st.to_stage_tiles(x, 12, 128)
    with pytest.raises(ValueError, match="kt=96: expected a multiple of 8 dividing K=256"):
        st.to_stage_tiles(x, 8, 96)
    with pytest.raises(ValueError, match="expected tm \\* kt = 1024"):
        st.from_stage_tiles(np.zeros((1, 2, 512)), 8, 8, 128)


def _load_weight_stage_image(wp, ws, n0, kt_index, rows, kt):
    """The bytes load_weight_stage (cuda_ops/gemm_common.cuh, KT 128: no chunk swizzle) writes
    for one stage: 16-byte code chunk c of row r at r * KT/2 + 16 c, 8-byte scale piece c at
    the scales' r * KT/16 + 8 c; rows past N zero."""
    n = wp.shape[0]
    wpitch, spitch = kt // 2, kt // 16
    codes, scales = np.zeros(rows * wpitch, np.uint8), np.zeros(rows * spitch, np.uint8)
    for i in range(rows * (wpitch // 16)):
        r, c = i // (wpitch // 16), i % (wpitch // 16)
        if n0 + r < n:
            src = kt_index * wpitch + 16 * c
            codes[r * wpitch + 16 * c : r * wpitch + 16 * c + 16] = wp[n0 + r, src : src + 16]
    for i in range(rows * (spitch // 8)):
        r, c = i // (spitch // 8), i % (spitch // 8)
        if n0 + r < n:
            src = kt_index * spitch + 8 * c
            scales[r * spitch + 8 * c : r * spitch + 8 * c + 8] = ws[n0 + r, src : src + 8]
    return codes, scales


@pytest.mark.parametrize(("n", "k", "tile_n"), [(512, 384, 256), (200, 256, 128), (64, 128, 64)])
def test_weight_stage_tiles_are_load_weight_stages_image(n, k, tile_n):
    rng = np.random.default_rng(n + k)
    wp = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    ws = rng.integers(0, 256, (n, k // 16), dtype=np.uint8)
    tp, ts = st.weight_stage_tiles(wp, ws, tile_n)
    nb = -(-n // tile_n)
    assert tp.shape == (nb, k // 128, tile_n * 64) and ts.shape == (nb, k // 128, tile_n * 8)
    for b in range(nb):
        for s in range(k // 128):
            codes, scales = _load_weight_stage_image(wp, ws, b * tile_n, s, tile_n, 128)
            assert np.array_equal(tp[b, s], codes), (b, s)
            assert np.array_equal(ts[b, s], scales), (b, s)


def test_weight_stage_tiles_stack_layers_and_match_jax():
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    wp = rng.integers(0, 256, (3, 200, 128), dtype=np.uint8)
    ws = rng.integers(0, 256, (3, 200, 16), dtype=np.uint8)
    tp, ts = st.weight_stage_tiles(wp, ws, 128)
    assert tp.shape == (3, 2, 2, 128 * 64) and ts.shape == (3, 2, 2, 128 * 8)
    for layer in range(3):  # each layer tiled alone, the layers one after another
        one = st.weight_stage_tiles(wp[layer], ws[layer], 128)
        assert np.array_equal(tp[layer], one[0]) and np.array_equal(ts[layer], one[1])
    jp, js = st.weight_stage_tiles(jnp.asarray(wp), jnp.asarray(ws), 128)
    assert np.array_equal(np.asarray(jp), tp) and np.array_equal(np.asarray(js), ts)


def test_weight_stage_tiles_refuse_bad_operands():
    wp, ws = np.zeros((64, 128), np.uint8), np.zeros((64, 16), np.uint8)
    with pytest.raises(ValueError, match=r"scales \(64, 8\), expected \(64, 16\)"):
        st.weight_stage_tiles(wp, ws[:, :8], 64)
    with pytest.raises(ValueError, match="kt=96"):
        st.weight_stage_tiles(wp, ws, 64, kt=96)
    with pytest.raises(ValueError, match="tile_n=12"):
        st.weight_stage_tiles(wp, ws, 12)
