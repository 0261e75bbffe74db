"""How long the grid kernel's top-k list gets (`cuda_ops/sampler.cu`, `rejax_sample_grid` with
TOP_K > 0), modelled in NumPy.

The kernel lists every token at or above tau, the k-th largest of the values the CTAs publish
(each CTA its threads' 8 largest maxima; thread t of CTA c reads tokens c*chunk + 4t + 4*256*i +
q). This replays that layout on random rows and prints the list length by batch (the grid plan
at 2 CTAs an SM), checking that the list always holds the top-k set. A list of <= 32 tokens is
drawn by one warp; a longer one by `topk_draw`'s block path.

    python experiments/kernels/grid_topk_list_model.py --k 20 --rows 20
"""

from __future__ import annotations

import argparse

import numpy as np

THREADS, PUBLISHED, SMS, CTAS_PER_SM = 256, 8, 132, 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grid_plan(batch: int, vocab: int) -> tuple[int, int]:
    """(CTAs a row, chunk) as cuda_ops.sampler.grid_plan at CTAS_PER_SM."""
    per_row = min(_cdiv(vocab, 4 * THREADS), THREADS, max(1, SMS * CTAS_PER_SM // batch))
    chunk = _cdiv(_cdiv(vocab, per_row), 4) * 4
    return _cdiv(vocab, chunk), chunk


def list_size(z: np.ndarray, batch: int, k: int) -> int:
    """How many tokens of row z the kernel lists (z >= tau); asserts it covers the top k."""
    v = len(z)
    grid, chunk = grid_plan(batch, v)
    ids = np.arange(v)
    cta, off = ids // chunk, ids % chunk
    thread = cta * THREADS + (off // 4) % THREADS
    order = np.lexsort((ids, -z, thread))  # each thread's tokens, its max first
    heads = order[np.r_[True, thread[order][1:] != thread[order][:-1]]]
    published = np.concatenate(
        [np.sort(z[heads][cta[heads] == c])[::-1][:PUBLISHED] for c in range(grid)]
    )
    published = np.sort(published)[::-1]
    tau = published[k - 1] if len(published) >= k else -np.inf
    n = int((z >= tau).sum())
    assert n >= int((z >= np.sort(z)[::-1][k - 1]).sum()), "the list misses a top-k token"
    return n


def rows(kind: str, count: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        z = (2.0 * rng.gumbel(size=vocab)).astype(np.float32)  # "lm": a long right tail
        if kind == "flat":
            z = rng.standard_normal(vocab).astype(np.float32)
        elif kind == "front":  # 25 top tokens in the first chunk
            z[:25] = 30.0 + np.arange(25, dtype=np.float32) * 0.05
        elif kind == "low-ids":  # 40 strong tokens among the first 5000 ids
            z[rng.choice(5000, 40, replace=False)] += 12.0
        yield z


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=20, help="random rows per kind")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    args = ap.parse_args(argv)
    if not 1 <= args.k <= args.vocab:
        ap.error(f"--k={args.k}: expected 1..--vocab ({args.vocab})")
    for kind in ("lm", "flat", "front", "low-ids"):
        zs = list(rows(kind, args.rows, args.vocab))
        for b in args.batch:
            n = [list_size(z, b, args.k) for z in zs]
            print(f"{kind:8s} batch {b:4d} ({grid_plan(b, args.vocab)[0]:3d} CTAs a row): "
                  f"list median {int(np.median(n))}, max {max(n)}")  # fmt: skip


if __name__ == "__main__":
    main()
