"""Host side of the fused sampler (`sampler.cu`): launch plan, build, backend configs.

Three variants (`VARIANTS`) of the same sampler, bound by `rejax.ops.sampler` as
`__gpu$xla.gpu.ptx` custom calls on XLA's stream:

- "split": three kernels (statistics, top-p histogram, boundary resolution), each
  a grid of chunks x B blocks whose last block per row combines through global scratch.
- "merge": "split" where top-k (k <= `MERGE_MAX_K`) needs no resolve sweep: each histogram
  block lists its chunk's top-k candidates and resolve's first block draws from them
  (`TOPK_MERGE` in sampler.cu); and where top-p ranks a collected boundary bin by a
  histogram of sub-bins instead of a block-wide sort, and the histogram skips the noise of
  tokens that cannot win (the cluster kernel's bound; `TOPP_SUBHIST`); its statistics sum
  one tempered softmax when both temperatures are equal. The same tokens as "split".
  (`rejax.ops.sampler`'s default, "auto", takes "grid" for top-p alone, and "merge" or
  "split" by batch rows for top-k.)
- "cluster": one kernel, a thread-block cluster of `CLUSTER` CTAs per row that combine through
  distributed shared memory between cluster barriers (sampler.cu's last section).
- "reject": the cluster kernel that first draws over every token with the same noise and keeps
  that draw when the top-p keep rule keeps it (then it is the Gumbel-max over the kept tokens,
  the token every variant draws); only a rejected draw runs the histogram path (`REJECT`).
- "grid": "reject"'s first draw and keep test in one launch over a grid of `GRID` CTAs per row
  (up to `GRID_THREADS`; all of them resident, `grid_plan`) that meet at barriers in global
  scratch, so one row runs on every SM. It tests the 4 best-scoring draws in one sweep and
  takes the best kept one; if all are rejected, the best score among the tokens ranked above
  them, tested again, until one is kept (`GRIDSYNC`). With top-k: each CTA publishes its
  threads' 8 largest maxima; the k-th largest published value has k distinct tokens at or above
  it, so the tokens at or above it (listed in one sweep) hold the top-k set, and CTA 0 draws
  from that list as the split kernels' last block does (`GRID_TOPK_CTAS_PER_SM` CTAs an SM).
- "cdf": "grid" whose first draws come from the inverse CDF of the tokens' tempered weights in
  vocabulary order instead of Gumbel-max, so no sweep scores the vocabulary's noise: the
  statistics sweep also sums each token's weight in fixed point (per CTA and per 128-token
  sub-block, exact integers), the CTA whose chunk holds a draw finds its sub-block and token,
  and the keep test of the NC draws is "grid"'s; the first kept draw is a draw from the kept
  tokens (rejection sampling), and all NC rejected fall back to "grid"'s climb (`GRID_CDF`).
  The same distribution and kept set as the other variants, different tokens for a key. With
  top-k it is "grid".

Nothing here imports cuda-python at module import; NVRTC is reached only by `build`.
"""

from __future__ import annotations

import dataclasses
import functools

from cuda_ops.build import (
    DEFAULT_SMS,
    KernelError,
    compile_ptx,
    device_arch,
    device_sms,
    escape_mlir,
    ptx_backend_config,
    ptx_entries,
    read_source,
)

__all__ = [
    "CLUSTER_ENTRIES",
    "CLUSTER_VARIANTS",
    "ENTRIES",
    "GRID_ENTRIES",
    "GRID_STATE_ENTRIES",
    "GRID_VARIANTS",
    "MAX_BATCH",
    "MAX_VOCAB",
    "NMAX",
    "VARIANTS",
    "SamplerKernel",
    "build",
    "check_shape",
    "entries",
]

SOURCE = "sampler.cu"
# entry -> (number of operands, number of results); parameters are operands then results
ENTRIES = {
    "rejax_sample_stats": (5, 2),  # logits, thr, alt, t_a, t_b -> stats [B, 4], arg [B, 2]
    "rejax_sample_hist": (5, 1),  # logits, stats, arg, top_p, keys -> plan [B, 8]
    "rejax_sample_resolve": (6, 1),  # logits, stats, arg, top_p, keys, plan -> tokens [B]
}
# the cluster variant's one kernel: logits, thr, alt, t_a, t_b, top_p, keys -> tokens [B],
# entropy [B], temperature [B]
CLUSTER_ENTRIES = {"rejax_sample_cluster": (7, 3)}
# the grid variant's one kernel: the same operands and results as the cluster kernel; built with
# ReSET's state (`window` > 0, RESET_STATE), also the state's 9 arrays and the two newline masks
# in (ring, n_ring, ring_pos, s_sum, s_n, g_sum, g_n, y1, y2, nl_mask, dnl_mask) and the new
# state's 9 arrays out; built to fold the step into the row keys (`step_rows` > 0, FOLD_STEP),
# one more operand last: the int32 step [step_rows]
GRID_ENTRIES = {"rejax_sample_grid": (7, 3)}
GRID_STATE_ENTRIES = {"rejax_sample_grid": (18, 12)}
VARIANTS = ("split", "cluster", "merge", "reject", "grid", "cdf")
GRID_VARIANTS = ("grid", "cdf")  # one launch over a grid of CTAs per row (GRIDSYNC)
LOGITS_DTYPES = ("float32", "bfloat16")  # the logits the kernels read (bfloat16: as float32)
CLUSTER_VARIANTS = ("cluster", "reject")  # one launch: a thread-block cluster per row
MERGE_MAX_K = 32  # the largest top-k the "merge" variant merges (sampler.cu: CAND / 2)
CLUSTER = 8  # CTAs per row in the cluster variant (the portable maximum)
# Plans take the device's SMs (`build`: cuda_ops.build.device_sms; DEFAULT_SMS, the H200's 132,
# without a GPU): the grid kernel's barriers need every CTA of a row resident, which a constant
# SM count would not keep on a device with fewer SMs (a MIG instance, H100 PCIe).
# The cluster kernel is built for 64 registers a thread, so 1024 / threads CTAs fit an SM (its
# 33 KB of shared memory allows 6): 1024 threads while every CTA can have an SM of its own
# (B <= 16), 512 while all rows fit one wave at 2 CTAs per SM (B <= 33), else 256 (4 per SM,
# one wave up to B = 66).
CLUSTER_REGS = 64
PLAN_WORDS = 8
THREADS = 512
NB = 2048  # histogram bins (sampler.cu); NB / THREADS bins per thread
NMAX = 2048  # the boundary bin is collected and sorted when it holds <= NMAX tokens
MAX_BATCH = 1024  # module-global scratch is sized by the batch: 16 KiB + 16 B * NMAX per row
MAX_VOCAB = 1 << 24
# The grid kernel: GRID_THREADS threads and at most 64 registers a thread (launch bounds), so
# GRID_CTAS_PER_SM CTAs fit an SM; a row's CTAs wait for each other at barriers, so the plan keeps
# every CTA of the launch resident whenever a row has more than one (B x GRID <= SMs x that).
GRID_THREADS = 256
GRID_CTAS_PER_SM = 4
GRID_TOPK_CTAS_PER_SM = 2  # with top-k: 33 KB of shared memory a CTA (the list, topk_draw's)
GRID_MIN_TOKENS = 4  # tokens a thread at least (one float4): the CTAs of a row at small batch
# "cdf" without top-k: at most CDF_ROW_CTAS CTAs a row, and up to CDF_SMALL_BATCH rows about
# CDF_SMALL_CTAS_PER_SM CTAs an SM in all: fewer, longer sweeps against fewer partials to
# combine after each barrier. Kernel alone, H200, bfloat16 lm logits, us a launch against the
# plan of 4 CTAs an SM up to 149 a row (experiments/results/s55/, sampler_phases.py
# --geometries; Temperature / ReSET): 1 row 64 CTAs 17.4-17.8 / 18.2-18.5 against 18.4-18.5 /
# 18.9-19.0 (149); 2 rows 64: 18.5 / 19.5 against 21.1 / 21.8 (149); 4 rows 64: 21.0 / 22.3,
# 32: 20.2 / 22.0 against 25.3 / 26.3 (132); 8 rows 32: 22.6 / 24.6 against 26.5 / 27.5 (66).
# From 16 rows the plan was as fast or faster (16 rows 16 or 24 CTAs, 32 rows 8 or 12, 64 rows
# 4 or 6: within 1 us or slower).
CDF_ROW_CTAS = 64
CDF_SMALL_BATCH = 8
CDF_SMALL_CTAS_PER_SM = 2
GRID_TAU_MAX_K = 64  # sampler.cu TAU_K_MAX: a larger top-k selects over every live token
SPLIT_BLOCKS_PER_SM = 4  # "split" / "merge": 4 blocks of 512 threads an SM, one wave of them
MAX_CHUNKS = 128


def entries(variant: str = "split", top_k: int = 0, window: int = 0, step_rows: int = 0) -> dict:
    """The variant's kernel entries: name -> (number of operands, number of results) ("grid"
    with ReSET's state of `window` entropies: GRID_STATE_ENTRIES; with the step folded in,
    `step_rows` > 0: one operand more)."""
    _check_variant(variant)
    if variant in GRID_VARIANTS:
        e = GRID_STATE_ENTRIES if window else GRID_ENTRIES
        return {k: (n + (step_rows > 0), m) for k, (n, m) in e.items()}
    return CLUSTER_ENTRIES if variant in CLUSTER_VARIANTS else ENTRIES


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}, expected one of {VARIANTS}")


def check_shape(batch: int, vocab: int, top_k: int = 0) -> tuple[bool, str]:
    """(True, "") if the kernels support [batch, vocab] logits and top_k, else (False, why)."""
    if not 1 <= batch <= MAX_BATCH:
        return False, f"batch={batch} (the sampler kernel handles 1..{MAX_BATCH} rows)"
    if not 2 <= vocab <= MAX_VOCAB:
        return False, f"V={vocab} (the sampler kernel handles 2..{MAX_VOCAB} tokens)"
    if not 0 <= top_k <= vocab:
        return False, f"top_k={top_k} (expected 0..V={vocab})"
    return True, ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Launch geometry: a grid of `chunks` x `batch` blocks of `threads` threads (the cluster
    variant: `cluster` = chunks CTAs per row form one cluster)."""

    batch: int
    vocab: int
    chunks: int
    chunk: int
    top_k: int = 0
    threads: int = THREADS
    nmax: int = NMAX
    variant: str = "split"
    window: int = (
        0  # "grid" / "cdf": ReSET's state update in the kernel, a ring of `window` entropies
    )
    bf16: bool = False  # bfloat16 logits (read as their exact float32 values)
    # "grid" / "cdf": > 0 folds an int32 step operand of this many rows (1: shared, or batch)
    # into the row keys in the launch, fold_in(keys[r], step) (FOLD_STEP)
    step_rows: int = 0

    @property
    def cluster(self) -> int:
        return self.chunks if self.variant in CLUSTER_VARIANTS else 0

    def defines(self) -> dict:
        d = {
            "TOP_K": self.top_k,
            "B_ROWS": self.batch,
            "V_SIZE": self.vocab,
            "CHUNKS": self.chunks,
            "CH": self.chunk,
            "NTHREADS": self.threads,
            "NMAX": self.nmax,
        }
        if self.bf16:
            d |= {"LOGITS_BF16": 1}
        if self.variant in CLUSTER_VARIANTS:
            d |= {"CLUSTER": self.cluster, "MIN_CTAS": self.ctas_per_sm}
        if self.variant == "reject" and self.top_k == 0:
            d |= {"REJECT": 1}
        if self.variant in GRID_VARIANTS:
            ctas = GRID_TOPK_CTAS_PER_SM if self.top_k else GRID_CTAS_PER_SM
            d |= {"GRIDSYNC": 1, "GRID": self.chunks, "MIN_CTAS": ctas}
            if self.variant == "cdf" and not self.top_k:
                d |= {"GRID_CDF": 1}
            if self.window:
                d |= {"RESET_STATE": 1, "W_RING": self.window}
            if self.step_rows:
                d |= {"FOLD_STEP": 1, "STEP_ROWS": self.step_rows}
        if self.variant == "merge" and 0 < self.top_k <= MERGE_MAX_K:
            d |= {"TOPK_MERGE": 1}
        elif self.variant == "merge" and self.top_k == 0:
            d |= {"TOPP_SUBHIST": 1}
        return d

    @property
    def ctas_per_sm(self) -> int:
        """CTAs per SM the cluster kernel is built for (launch bounds: CLUSTER_REGS registers)."""
        return 65536 // (self.threads * CLUSTER_REGS)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(
    batch: int,
    vocab: int,
    top_k: int = 0,
    variant: str = "split",
    window: int = 0,
    sms: int = DEFAULT_SMS,
    bf16: bool = False,
    step_rows: int = 0,
) -> Plan:
    """The launch plan on a device of `sms` SMs.
    "split" and "merge": about one wave of blocks over the whole batch, at least 4 chunks
    per row.
    "cluster" and "reject": `CLUSTER` chunks per row (trailing ones may be empty when V < 4
    CLUSTER).
    "grid" and "cdf": `grid_plan`'s chunks per row (with top-k for `GRID_TOPK_CTAS_PER_SM` CTAs an SM;
    "cdf" without top-k at most `CDF_ROW_CTAS` a row, `CDF_SMALL_CTAS_PER_SM` an SM up to
    `CDF_SMALL_BATCH` rows);
    `window` > 0 builds it with ReSET's state update (a ring of `window` entropies; top-p
    alone). `bf16`: for bfloat16 logits (the same launch geometry). `step_rows` 1 or `batch`
    ("grid" / "cdf"): the row keys are base keys and the launch folds in an int32 step operand
    of that many rows."""
    _check_variant(variant)
    if step_rows and (variant not in GRID_VARIANTS or step_rows not in (1, batch)):
        raise ValueError(f"step_rows={step_rows!r} (the step folded in the launch) needs variant "
                         f"'grid' or 'cdf' and 1 or batch={batch} rows, got variant={variant!r}")  # fmt: skip
    if window and (variant not in GRID_VARIANTS or top_k):
        raise ValueError(f"window={window} (ReSET's state in the kernel) needs variant 'grid' "
                         f"or 'cdf' without top-k, got variant={variant!r}, top_k={top_k}")  # fmt: skip
    if variant == "cdf" and not top_k:
        fill = CDF_SMALL_CTAS_PER_SM if batch <= CDF_SMALL_BATCH else GRID_CTAS_PER_SM
        chunks, chunk = grid_plan(batch, vocab, sms, ctas_per_sm=fill, row_max=CDF_ROW_CTAS)
        return Plan(batch=batch, vocab=vocab, chunks=chunks, chunk=chunk, top_k=top_k,
                    threads=GRID_THREADS, variant=variant, window=window, bf16=bf16,
                    step_rows=step_rows)  # fmt: skip
    if variant in GRID_VARIANTS:
        ctas = GRID_TOPK_CTAS_PER_SM if top_k else GRID_CTAS_PER_SM
        chunks, chunk = grid_plan(batch, vocab, sms, ctas_per_sm=ctas)
        return Plan(batch=batch, vocab=vocab, chunks=chunks, chunk=chunk, top_k=top_k,
                    threads=GRID_THREADS, variant=variant, window=window, bf16=bf16,
                    step_rows=step_rows)  # fmt: skip
    if variant in CLUSTER_VARIANTS:
        chunk = _cdiv(_cdiv(vocab, CLUSTER), 4) * 4
        return Plan(batch=batch, vocab=vocab, chunks=CLUSTER, chunk=chunk, top_k=top_k,
                    threads=cluster_threads(batch, sms), variant=variant, bf16=bf16)  # fmt: skip
    chunks = max(4, min(MAX_CHUNKS, sms * SPLIT_BLOCKS_PER_SM // batch))
    chunks = min(chunks, vocab)
    chunk = _cdiv(_cdiv(vocab, chunks), 4) * 4  # a multiple of 4 (the histogram's float4 loads)
    chunks = _cdiv(vocab, chunk)  # no empty trailing chunk
    return Plan(batch=batch, vocab=vocab, chunks=chunks, chunk=chunk, top_k=top_k, variant=variant,
                bf16=bf16)  # fmt: skip


def grid_plan(
    batch: int,
    vocab: int,
    sms: int = DEFAULT_SMS,
    ctas_per_sm: int = GRID_CTAS_PER_SM,
    row_max: int = GRID_THREADS,
) -> tuple[int, int]:
    """(CTAs per row, chunk length) of the grid kernel: a chunk of at least `GRID_MIN_TOKENS`
    tokens a thread, at most `row_max` (<= `GRID_THREADS`: one partial per thread in the
    combines) CTAs a row, and at most `ctas_per_sm` CTAs per SM in all, so all B x CTAs are
    resident at once (the kernel is built for `GRID_CTAS_PER_SM` or, with top-k,
    `GRID_TOPK_CTAS_PER_SM`; `ctas_per_sm` must not exceed it) whenever a row has more than
    one CTA."""
    most = _cdiv(vocab, GRID_MIN_TOKENS * GRID_THREADS)
    per_row = min(most, row_max, GRID_THREADS, max(1, sms * ctas_per_sm // batch))
    chunk = _cdiv(_cdiv(vocab, per_row), 4) * 4  # a multiple of 4 (float4 loads)
    return _cdiv(vocab, chunk), chunk  # no empty trailing chunk


def cluster_threads(batch: int, sms: int = DEFAULT_SMS) -> int:
    """Threads per CTA of the cluster kernel for B rows on `sms` SMs (CLUSTER_REGS' comment)."""
    ctas = batch * CLUSTER
    return 1024 if ctas <= sms else 512 if ctas <= 2 * sms else 256


@dataclasses.dataclass(frozen=True, eq=False)
class SamplerKernel:
    """The compiled kernels for one (batch, vocab) and their launch configs."""

    plan: Plan
    ptx: str

    @functools.cached_property
    def _escaped(self) -> str:
        return escape_mlir(self.ptx)

    def backend_config(self, entry: str) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` call of one entry."""
        p = self.plan
        n_in, n_out = entries(p.variant, p.top_k, p.window, p.step_rows)[entry]
        return ptx_backend_config(
            entry,
            self._escaped,
            grid=(p.chunks, p.batch, 1),
            block=p.threads,
            outputs=range(n_in, n_in + n_out),
        )


@functools.cache
def _build_cached(
    batch: int,
    vocab: int,
    top_k: int,
    variant: str,
    arch: str,
    window: int,
    sms: int,
    bf16: bool = False,
    step_rows: int = 0,
) -> SamplerKernel:
    p = plan(batch, vocab, top_k, variant, window, sms, bf16, step_rows)
    ptx = compile_ptx(read_source(SOURCE), name=SOURCE, defines=p.defines(), arch=arch)
    # every entry the op calls, with its operands and results as parameters (a custom call
    # passing another count would hand the kernel the wrong buffers)
    want = {
        k: n_in + n_out for k, (n_in, n_out) in entries(variant, top_k, window, step_rows).items()
    }
    got = {k: n for k, n in ptx_entries(ptx).items() if k in want}
    if got != want:
        raise KernelError(f"PTX entries {got}, expected {want} parameters ({p.defines()})")
    return SamplerKernel(plan=p, ptx=ptx)


def build(
    batch: int,
    vocab: int,
    top_k: int = 0,
    *,
    variant: str = "split",
    arch: str | None = None,
    window: int = 0,
    sms: int | None = None,
    logits_dtype: str = "float32",
    step_rows: int = 0,
) -> SamplerKernel:
    """Plans and compiles (NVRTC, disk-cached) the sampler kernels for [batch, vocab] logits
    of `logits_dtype` ("float32" or "bfloat16") (top_k > 0: top-k before top-p) of one of
    `VARIANTS` ("grid" with `window` > 0: with ReSET's state update for a ring of `window`
    entropies; with `step_rows` 1 or `batch`: folding that int32 step operand into the row
    keys), for a device of `sms` SMs (None: the first CUDA device's, `DEFAULT_SMS` without
    one).

    Raises KernelError when NVRTC is missing or the shape is unsupported, ValueError for an
    unknown variant.
    """
    _check_variant(variant)
    ok, why = check_shape(batch, vocab, top_k)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window={window!r}, expected an int >= 0")
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype={logits_dtype!r}, expected one of {LOGITS_DTYPES}")
    sms = device_sms() if sms is None else sms
    if not isinstance(sms, int) or sms < 1:
        raise ValueError(f"sms={sms!r}, expected a positive int (the device's SMs)")
    bf16 = logits_dtype == "bfloat16"
    if not isinstance(step_rows, int) or step_rows < 0:
        raise ValueError(f"step_rows={step_rows!r}, expected an int >= 0")
    plan(batch, vocab, top_k, variant, window, 1, bf16, step_rows)  # the arguments' checks
    return _build_cached(batch, vocab, top_k, variant, arch or device_arch(), int(window), sms,
                         bf16, step_rows)  # fmt: skip
