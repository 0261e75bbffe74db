"""Teacher forcing: full-sequence logits of given token sequences (`rejax.generate.logits`, in
padded batches) and the entropy of the processed (temperature, top-k, top-p) distribution."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rejax.generate import logits as full_logits

# ----------------------------------------------------------------------------------------------
# Teacher forcing


def teacher_forced_logits(params, sequences: Sequence[Sequence[int]], *, max_elems: int = 1 << 27):
    """Yields float32 logits [T_i, V] for each token sequence, computed in padded batches.

    Sequences are right-padded (causal attention keeps padding out of earlier positions) to a
    multiple of 64 and batched so that one batch's logits hold at most `max_elems` floats.
    """
    v = params.cfg.vocab_size
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: dict[int, np.ndarray] = {}
    i = 0
    while i < len(order):
        t_pad = -(-len(sequences[order[i]]) // 64) * 64
        # All sequences of this batch share the padded length of the longest one in it.
        rows = max(1, max_elems // (t_pad * v))
        group = order[i : i + rows]
        t_pad = -(-max(len(sequences[k]) for k in group) // 64) * 64
        batch = np.zeros((len(group), t_pad), np.int32)
        for r, k in enumerate(group):
            batch[r, : len(sequences[k])] = sequences[k]
        z = np.asarray(full_logits(params, batch))
        for r, k in enumerate(group):
            out[k] = z[r, : len(sequences[k])]
        i += len(group)
    for k in range(len(sequences)):
        yield out.pop(k)


def entropy_np(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    e = np.exp(z - m)
    s = e.sum(axis=-1, keepdims=True)
    p = e / s
    return (np.log(s[..., 0]) - (p * (z - m)).sum(axis=-1)).astype(np.float32)


def processed_entropy(
    z: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> np.ndarray:
    """Entropy (nats) of the distribution HF `output_scores` describe: logits / T, then top-k,
    then top-p (HF semantics: drop tokens whose ascending cumulative mass is <= 1 - top_p,
    keep at least one), renormalised; the log is clamped at 1e-12 as the official calibration.

    Args:
      z: float [..., V] raw logits.

    Returns:
      float32 [...].
    """
    z = z.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z >= kth, z, -np.inf)
    if top_p < 1.0:
        order = np.argsort(z, axis=-1)
        zs = np.take_along_axis(z, order, axis=-1)
        ps = np.exp(zs - zs[..., -1:])
        ps /= ps.sum(axis=-1, keepdims=True)
        remove = np.cumsum(ps, axis=-1) <= 1 - top_p
        remove[..., -1] = False
        mask = np.empty_like(remove)
        np.put_along_axis(mask, order, remove, axis=-1)
        z = np.where(mask, -np.inf, z)
    m = z.max(axis=-1, keepdims=True)
    p = np.exp(z - m)
    p /= p.sum(axis=-1, keepdims=True)
    h = -(p * np.log(np.maximum(p, 1e-12))).sum(axis=-1)
    return np.maximum(h, 0.0).astype(np.float32)  # no -0.0 for one-token distributions
