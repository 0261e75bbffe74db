"""experiments/kernels/wgmma_stage_tiles.py: the pre-tiled x_hat layout equals the shared-memory
image that the wgmma GEMM's load_stage writes (its address formula, replayed chunk by chunk)."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))
import wgmma_stage_tiles as st


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
