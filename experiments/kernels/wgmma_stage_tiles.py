"""The x_hat operand pre-tiled for bulk copies: each (token tile, K stage) of the wgmma GEMM's
x tile as the contiguous bytes of its shared-memory image (KERNEL_NOTES, "The next wgmma
design"). One `cp.async.bulk` a stage can then fill the x part of a ring slot, instead of the
TM x KT / 8 16-byte `cp.async` copies of `load_stage` in cuda_ops/nvfp4_gemm_wgmma.cu.

The image is `load_stage`'s: 16-byte chunk (token 8 mg + mr of the tile, 8-element column q of
the stage) at byte q * X_COL + mg * 128 + mr * 16, X_COL = TM * 16, i.e. in elements

    tile[q, mg, mr, e] = x_w[m0 + 8 mg + mr, kt * KT + 8 q + e]

for x_w in the kernel's K order (`nvfp4_gemm_wgmma.to_wgmma_order`). Tokens past M are zeros
(`load_stage` zero-fills them). Not used by any kernel yet.
"""

from __future__ import annotations

import numpy as np


def to_stage_tiles(xw, tm: int, kt: int):
    """x_w [M, K] (the kernel's K order; numpy or JAX, any dtype) -> [ceil(M / tm), K / kt,
    tm * kt]: each stage's x image, contiguous. tm a multiple of 8, kt of 8 dividing K."""
    m, k = xw.shape
    if tm % 8 or tm < 8:
        raise ValueError(f"tm={tm}: expected a positive multiple of 8")
    if kt % 8 or kt < 8 or k % kt:
        raise ValueError(f"kt={kt}: expected a multiple of 8 dividing K={k}")
    mt = -(-m // tm)
    pad = mt * tm - m
    if pad:
        xw = _pad_rows(xw, pad)
    # (tile, mg, mr, stage, q, e) -> (tile, stage, q, mg, mr, e)
    y = xw.reshape(mt, tm // 8, 8, k // kt, kt // 8, 8)
    y = y.transpose(0, 3, 4, 1, 2, 5)
    return y.reshape(mt, k // kt, tm * kt)


def from_stage_tiles(tiles, m: int, tm: int, kt: int):
    """The inverse of `to_stage_tiles`: [M, K] again (the padding rows dropped)."""
    mt, stages, size = tiles.shape
    if size != tm * kt:
        raise ValueError(f"tiles of {size} elements, expected tm * kt = {tm * kt}")
    y = tiles.reshape(mt, stages, kt // 8, tm // 8, 8, 8)
    y = y.transpose(0, 3, 4, 1, 2, 5)
    return y.reshape(mt * tm, stages * kt)[:m]


def _pad_rows(x, pad: int):
    if isinstance(x, np.ndarray):
        return np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])
    import jax.numpy as jnp

    return jnp.concatenate([x, jnp.zeros((pad, x.shape[1]), x.dtype)])
