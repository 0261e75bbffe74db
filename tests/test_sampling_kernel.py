"""CPU tests of the fused sampler op (`rejax.ops.sampler`, kernels in `cuda_ops/sampler.cu`).

No GPU here, so: the CUDA lowering is checked to emit the three PTX custom calls with their
launch configs (NVRTC compiles the kernels for sm_90), and the "cluster" variant its one call
(a cluster of 8 CTAs per row; ptxas reports no spills); the kernels' algorithm is checked
through its NumPy mirror `emulate` (kept set == the definition on every path, for the cluster
kernel's filters too, chi-square over 10^5 draws, pruning exact); the op's reference (the CPU
path of the default method) is checked to give the tokens of the "radix" method, through
`sample_kernel` for every variant; and ReSET's (thr, alt) encoding is checked against `_policy`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import _assert_draws_match, _top_p_numpy

from cuda_ops import sampler as kernels
from cuda_ops.build import ptx_entries
from rejax import sampling
from rejax.ops import sampler as op
from rejax.sampling import ReSET, SamplerState, Temperature, sample, sampler_init

# ----------------------------------------------------------------------------- CUDA lowering


def _backend_configs(hlo: str) -> list[dict]:
    out = []
    for part in hlo.split("backend_config = ")[1:]:
        name = re.search(r"name = [^a-z]*(rejax_sample_\w+)", part)
        if name is None:
            continue
        cfg = {"name": name.group(1)}
        cfg["outputs"] = [int(x) for x in re.search(r"output_indices = \[([\d, ]*)\]", part)
                          .group(1).split(",")]  # fmt: skip
        for k in ("grid_x", "grid_y", "block_x", "shared_mem_bytes"):
            cfg[k] = int(re.search(rf"{k} = (\d+)", part).group(1))
        out.append(cfg)
    return out


def _lower_cuda(sampler, b, v):
    f = jax.jit(lambda k, z, s: sample(k, z, s, sampler)[0])
    z = jnp.zeros((b, v), jnp.float32)
    traced = f.trace(jax.random.key(0), z, sampler_init(sampler, b))
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering_emits_the_three_kernels():
    # the "split" variant (the default's pick for top-k above 20 at 3 rows; named here)
    pytest.importorskip("cuda.bindings.nvrtc")
    b, v = 3, 1000
    masks = {"nl_mask": jnp.zeros(v, bool), "dnl_mask": jnp.zeros(v, bool)}
    for smp in (
        Temperature(0.6, top_p=0.9, top_p_method="kernel-split"),
        ReSET(top_p=0.95, top_p_method="kernel-split", **masks),
        Temperature(0.6, top_k=40, top_p_method="kernel"),
    ):
        hlo = _lower_cuda(smp, b, v)
        assert hlo.count("__gpu$xla.gpu.ptx") == 3
        cfgs = _backend_configs(hlo)
        assert [c["name"] for c in cfgs] == list(kernels.ENTRIES)
        plan = kernels.plan(b, v)
        for c in cfgs:
            n_in, n_out = kernels.ENTRIES[c["name"]]
            assert (c["grid_x"], c["grid_y"], c["block_x"]) == (plan.chunks, b, kernels.THREADS)
            assert c["outputs"] == list(range(n_in, n_in + n_out))
    # NVRTC output: sm_90 PTX with the three entries, one parameter per operand and result
    kern = kernels.build(b, v, arch="compute_90")
    assert re.search(r"^\s*\.target\s+sm_90\b", kern.ptx, re.MULTILINE)
    entries = ptx_entries(kern.ptx)
    assert entries == {name: sum(io) for name, io in kernels.ENTRIES.items()}


def _lower_cuda_variant(sampler, b, v, variant):
    f = jax.jit(lambda k, z, s: op.sample_kernel(k, z, s, sampler, variant=variant)[0])
    z = jnp.zeros((b, v), jnp.float32)
    traced = f.trace(jax.random.key(0), z, sampler_init(sampler, b))
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("b", [1, 3, 64])
def test_cuda_lowering_cluster_variant_is_one_call(b):
    pytest.importorskip("cuda.bindings.nvrtc")
    v = 1000
    masks = {"nl_mask": jnp.zeros(v, bool), "dnl_mask": jnp.zeros(v, bool)}
    for smp in (Temperature(0.6, top_p=0.9), ReSET(top_p=0.95, **masks),
                Temperature(0.6, top_k=20)):  # fmt: skip
        assert _lower_cuda_variant(smp, b, v, "split").count("__gpu$xla.gpu.ptx") == 3
        hlo = _lower_cuda_variant(smp, b, v, "cluster")
        assert hlo.count("__gpu$xla.gpu.ptx") == 1
        (cfg,) = _backend_configs(hlo)
        assert cfg["name"] == "rejax_sample_cluster"
        n_in, n_out = kernels.CLUSTER_ENTRIES[cfg["name"]]
        assert (cfg["grid_x"], cfg["grid_y"], cfg["block_x"]) == (
            kernels.CLUSTER,
            b,
            kernels.cluster_threads(b),
        )
        assert cfg["outputs"] == list(range(n_in, n_in + n_out))
        assert cfg["shared_mem_bytes"] == 0  # static shared memory only (< 48 KiB)
    for k in (0, 20):  # the PTX: one entry, 10 parameters, a compile-time cluster of 8 CTAs
        kern = kernels.build(b, v, k, variant="cluster", arch="compute_90")
        assert ptx_entries(kern.ptx) == {"rejax_sample_cluster": 10}
        assert re.search(r"\.reqnctapercluster\s+8,\s*1,\s*1", kern.ptx)
        assert kern.plan.chunks * kern.plan.chunk >= v > (kern.plan.chunks - 1) * kern.plan.chunk


@pytest.mark.parametrize("b", [1, 3, 64, 600])
def test_cuda_lowering_grid_variant(b):
    # one call of the grid kernel, GRID x B CTAs of GRID_THREADS (with top-k: fewer CTAs an SM)
    pytest.importorskip("cuda.bindings.nvrtc")
    v = 151936
    masks = {"nl_mask": jnp.zeros(v, bool), "dnl_mask": jnp.zeros(v, bool)}
    for smp in (Temperature(0.6, top_p=0.9), ReSET(top_p=0.95, **masks)):
        hlo = _lower_cuda_variant(smp, b, v, "grid")
        (cfg,) = _backend_configs(hlo)
        assert cfg["name"] == "rejax_sample_grid"
        grid, _ = kernels.grid_plan(b, v)
        assert (cfg["grid_x"], cfg["grid_y"], cfg["block_x"]) == (grid, b, kernels.GRID_THREADS)
        n_in, n_out = kernels.GRID_ENTRIES[cfg["name"]]
        assert cfg["outputs"] == list(range(n_in, n_in + n_out))
    hlo = _lower_cuda_variant(Temperature(0.6, top_k=20), b, v, "grid")
    (cfg,) = _backend_configs(hlo)
    grid, _ = kernels.grid_plan(b, v, ctas_per_sm=kernels.GRID_TOPK_CTAS_PER_SM)
    assert cfg["name"] == "rejax_sample_grid" and (cfg["grid_x"], cfg["grid_y"]) == (grid, b)
    d = kernels.plan(b, v, 20, "grid").defines()
    assert (d["TOP_K"], d["MIN_CTAS"]) == (20, kernels.GRID_TOPK_CTAS_PER_SM)


@pytest.mark.parametrize("b", [1, 2, 7, 8, 33, 64, 65, 132, 528, 529, 1024])
@pytest.mark.parametrize("v", [10, 4099, 151936])
@pytest.mark.parametrize("sms", [kernels.DEFAULT_SMS, 114, 16, 1])  # H200, H100 PCIe, MIG 1g
def test_grid_plan_covers_the_row_and_keeps_every_cta_resident(b, v, sms):
    # a row's CTAs wait for each other at barriers: with more than one a row, all B x GRID CTAs
    # must be resident at once on the device's SMs (GRID_CTAS_PER_SM per SM; with top-k
    # GRID_TOPK_CTAS_PER_SM); one partial per thread in the combines
    for top_k, ctas in [(0, kernels.GRID_CTAS_PER_SM), (20, kernels.GRID_TOPK_CTAS_PER_SM)]:
        grid, chunk = kernels.grid_plan(b, v, sms, ctas_per_sm=ctas)
        assert 1 <= grid <= kernels.GRID_THREADS and chunk % 4 == 0
        assert grid * chunk >= v > (grid - 1) * chunk  # every token, no empty chunk
        if grid > 1:
            assert b * grid <= sms * ctas
        d = kernels.plan(b, v, min(top_k, v), "grid", sms=sms).defines()
        assert (d["GRIDSYNC"], d["GRID"], d["MIN_CTAS"], d["CH"], d["NTHREADS"]) == (
            1, grid, ctas, chunk, kernels.GRID_THREADS)  # fmt: skip


@pytest.mark.parametrize("sms", [kernels.DEFAULT_SMS, 114, 16, 1])
def test_cdf_plan_at_few_rows_uses_fewer_ctas_a_row(sms):
    # "cdf" for top-p alone: at most CDF_ROW_CTAS CTAs a row and, up to CDF_SMALL_BATCH rows,
    # CDF_SMALL_CTAS_PER_SM an SM in all (faster on the H200 at 1-8 rows); from 9 rows, and
    # "grid" and "cdf" with top-k at every batch, grid_plan's default; every CTA resident
    v = 151936
    for b in (1, 2, 4, 7, 8, 9, 16, 64, 1024):
        small = b <= kernels.CDF_SMALL_BATCH
        fill = kernels.CDF_SMALL_CTAS_PER_SM if small else kernels.GRID_CTAS_PER_SM
        for window in (0, 16):
            p = kernels.plan(b, v, 0, "cdf", window=window, sms=sms)
            want = kernels.grid_plan(b, v, sms, ctas_per_sm=fill, row_max=kernels.CDF_ROW_CTAS)
            assert (p.chunks, p.chunk) == want
            assert p.chunks <= kernels.CDF_ROW_CTAS and p.chunks * p.chunk >= v
            assert p.chunks == 1 or b * p.chunks <= sms * fill <= sms * kernels.GRID_CTAS_PER_SM
            assert p.defines()["MIN_CTAS"] == kernels.GRID_CTAS_PER_SM
        if b >= kernels.CDF_SMALL_BATCH + 1:
            assert kernels.plan(b, v, 0, "cdf", sms=sms).chunks == kernels.grid_plan(b, v, sms)[0]
        topk = kernels.plan(b, v, 20, "cdf", sms=sms)
        assert dataclasses.replace(topk, variant="grid") == kernels.plan(b, v, 20, "grid", sms=sms)
    on_h200 = [kernels.plan(b, v, 0, "cdf").chunks for b in (1, 2, 4, 8, 16, 64)]
    assert on_h200 == [64, 64, 64, 33, 33, 8]


def test_grid_launch_is_planned_for_the_devices_sms(monkeypatch):
    # the lowering plans the grid kernel for the device it runs on: on 16 SMs (a MIG slice) one
    # row gets at most 16 x GRID_CTAS_PER_SM CTAs, all resident (132 SMs' 149 would wait at the
    # first barrier for CTAs that never start); the kernel cache keeps the two builds apart
    pytest.importorskip("cuda.bindings.nvrtc")
    b, v = 1, 151936
    big = kernels.build(b, v, variant="grid", arch="compute_90", sms=kernels.DEFAULT_SMS)
    small = kernels.build(b, v, variant="grid", arch="compute_90", sms=16)
    assert big.plan.chunks > 16 * kernels.GRID_CTAS_PER_SM >= small.plan.chunks > 1
    monkeypatch.setattr(kernels, "device_sms", lambda: 16)
    (cfg,) = _backend_configs(_lower_cuda_variant(Temperature(0.6, top_p=0.9), b, v, "grid"))
    assert (cfg["grid_x"], cfg["grid_y"]) == (small.plan.chunks, b)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="sms="):
            kernels.build(b, v, variant="grid", arch="compute_90", sms=bad)


@pytest.mark.parametrize(
    "variant,b,bf16",
    [("grid", 1, False), ("cdf", 1, False), ("cdf", 64, False), ("cdf", 1024, False),
     ("grid", 64, True), ("cdf", 64, True)],
)  # fmt: skip
@pytest.mark.parametrize("top_k", [0, 20])
def test_grid_kernel_fits_its_occupancy(top_k, variant, b, bf16):
    # the plan's residency assumes GRID_CTAS_PER_SM (with top-k GRID_TOPK_CTAS_PER_SM) CTAs of
    # GRID_THREADS per SM: registers (launch bounds) and static shared memory must allow it
    # ("cdf" keeps a chunk's sub-block sums in shared memory: the most at one CTA a row); the
    # same for the build reading bfloat16 logits
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops.build import ptxas_log, read_source

    p = kernels.plan(b, 151936, top_k, variant=variant, bf16=bf16)
    assert ("GRID_CDF" in p.defines()) == (variant == "cdf" and not top_k)
    assert ("LOGITS_BF16" in p.defines()) == bf16
    ctas = kernels.GRID_TOPK_CTAS_PER_SM if top_k else kernels.GRID_CTAS_PER_SM
    log = ptxas_log(read_source("sampler.cu"), p.defines(), name="sampler.cu")
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    smem = [int(x) for x in re.findall(r"(\d+) bytes smem", log)]
    assert len(regs) == 1 and regs[0] * kernels.GRID_THREADS * ctas <= 65536
    assert smem[0] <= 48 * 1024 and ctas * (smem[0] + 1024) <= 228 * 1024, log
    if top_k or variant == "cdf":  # no spills
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log


@pytest.mark.parametrize(
    ("variant", "b", "window", "top_k"),
    [("cdf", 1, 16, 0), ("cdf", 64, 0, 0), ("grid", 1, 0, 20), ("grid", 8, 0, 0)],
)
def test_grid_barriers_arrive_without_sequentially_consistent_fences(variant, b, window, top_k):
    # grid_barrier arrives with fence.acq_rel + a relaxed add and polls with acquire loads: the
    # PTX keeps one fence.sc (the exit's counter reset), not two per barrier site
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops.build import compile_ptx, read_source

    p = kernels.plan(b, 151936, top_k, variant=variant, window=window, bf16=True)
    ptx = compile_ptx(read_source("sampler.cu"), name="sampler.cu", defines=p.defines(),
                      arch="compute_90")  # fmt: skip
    assert ptx.count("fence.sc.gpu") + ptx.count("membar.gl") == 1, variant
    assert ptx.count("fence.acq_rel.gpu") >= 2 and "ld.acquire.gpu" in ptx


@pytest.mark.parametrize("variant", kernels.CLUSTER_VARIANTS)
@pytest.mark.parametrize("b,top_k", [(1, 0), (1, 20), (24, 0), (24, 20), (64, 0), (64, 20)])
def test_cluster_kernel_fits_its_occupancy_without_spills(b, top_k, variant):
    # 1024 / 512 / 256 threads for 1 / 2 / 4 CTAs per SM: <= 64 registers, no spills, static
    # shared memory under 48 KiB (and room for the CTAs per SM)
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops.build import ptxas_log, read_source

    p = kernels.plan(b, 151936, top_k, variant=variant)
    assert p.threads == {1: 1024, 24: 512, 64: 256}[b] and p.ctas_per_sm * p.threads == 1024
    log = ptxas_log(read_source("sampler.cu"), p.defines(), name="sampler.cu")
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    smem = [int(x) for x in re.findall(r"(\d+) bytes smem", log)]
    assert len(regs) == 1 and regs[0] <= kernels.CLUSTER_REGS, log
    assert spills == [("0", "0")], log
    assert smem[0] < 48 * 1024 and p.ctas_per_sm * (smem[0] + 1024) <= 228 * 1024, log


def test_bfloat16_logits_build_their_own_kernels_and_bad_dtypes_raise():
    # the op builds the kernels for its logits' dtype (bfloat16: LOGITS_BF16, the same launch
    # plan); a dtype the kernels do not read is refused by name
    pytest.importorskip("cuda.bindings.nvrtc")
    f32 = kernels.build(64, 151936, variant="cdf", arch="compute_90", sms=132)
    bf16 = kernels.build(64, 151936, variant="cdf", arch="compute_90", sms=132,
                         logits_dtype="bfloat16")  # fmt: skip
    assert "LOGITS_BF16" in bf16.plan.defines() and "LOGITS_BF16" not in f32.plan.defines()
    assert dataclasses.replace(bf16.plan, bf16=False) == f32.plan
    # the vector loads read 8 bytes (4 logits) instead of 16, the scalar ones 2 instead of 4
    assert bf16.ptx.count("ld.global.nc.v2.u32") == f32.ptx.count("ld.global.nc.v4.f32") > 0
    assert "ld.global.nc.u16" in bf16.ptx and "ld.global.nc.v4.f32" not in bf16.ptx
    with pytest.raises(ValueError, match="logits_dtype='float16'"):
        kernels.build(64, 151936, variant="cdf", arch="compute_90", logits_dtype="float16")


@pytest.mark.parametrize("variant", kernels.VARIANTS)
@pytest.mark.parametrize("top_k", [0, 20])
def test_no_module_global_is_shared_between_kernels(variant, top_k):
    # each custom call loads its own copy of the PTX module, so a __device__ global written by
    # one kernel is not the one the next kernel reads ("merge" top-k once drew -1 on the H200
    # that way: resolve read empty candidate lists)
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops.build import compile_ptx, ptx_globals_by_entry, read_source

    d = kernels.plan(4, 151936, top_k, variant=variant).defines()
    by_entry = ptx_globals_by_entry(
        compile_ptx(read_source("sampler.cu"), defines=d, arch="compute_90")
    )
    assert set(by_entry) == set(kernels.entries(variant, top_k))
    assert (
        by_entry[min(by_entry)] or variant in kernels.CLUSTER_VARIANTS
    )  # the parser finds globals
    seen: dict[str, str] = {}
    for entry, names in sorted(by_entry.items()):
        for g in names:
            assert g not in seen, f"{g} is used by {seen[g]} and {entry}"
            seen[g] = entry


def test_cuda_lowering_falls_back_where_the_kernel_does_not_serve():
    v = 300
    masks = {"nl_mask": jnp.zeros(v, bool), "dnl_mask": jnp.zeros(v, bool)}
    for smp in (
        ReSET(include_current=True, **masks),  # figure semantics: the "radix" path
        Temperature(0.6, top_p=0.9, top_p_method="radix"),
    ):
        assert "__gpu$xla.gpu.ptx" not in _lower_cuda(smp, 2, v)


# ----------------------------------------------------------------------------- CPU path


def _same_steps(step_a, step_b, seed: int) -> None:
    """step_a and step_b, each (key, logits, state, sampler) -> (tokens, state, info), give the
    same tokens, states and infos bit for bit over 3 steps of Temperature + top-k and ReSET."""
    rng = np.random.default_rng(seed)
    b, v = 4, 200
    masks = {"nl_mask": jnp.zeros(v, bool).at[3].set(True), "dnl_mask": jnp.zeros(v, bool)}
    for smp in (Temperature(jnp.array([0.6, 1.0, 1e-7, 2.0]), top_p=0.9, top_k=7),
                ReSET(t_high=1.0, t_low=0.1, top_p=0.95, **masks)):  # fmt: skip
        sa = sb = sampler_init(smp, b)
        for step in range(3):
            z = jnp.asarray(rng.normal(size=(b, v)) * rng.uniform(0.5, 4), jnp.float32)
            key = jax.random.fold_in(jax.random.key(1), step)
            ta, sa, ia = step_a(key, z, sa, smp)
            tb, sb, ib = step_b(key, z, sb, smp)
            np.testing.assert_array_equal(np.asarray(ta), np.asarray(tb))
            for x, y in zip(jax.tree.leaves((sa, ia)), jax.tree.leaves((sb, ib))):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_default_cpu_path_gives_the_radix_tokens():
    # method "kernel" off a GPU must reproduce "radix" bit for bit
    run = jax.jit(sample, static_argnames="top_p_method")
    _same_steps(
        functools.partial(run, top_p_method="kernel"),
        functools.partial(run, top_p_method="radix"),
        seed=0,
    )


@pytest.mark.parametrize("variant", op.VARIANTS)
def test_sample_kernel_is_the_kernel_method_on_cpu(variant):
    # op.sample_kernel(variant=...) off a GPU: sample(top_p_method="kernel") bit for bit
    run = jax.jit(sample, static_argnames="top_p_method")
    run_op = jax.jit(op.sample_kernel, static_argnames="variant")
    _same_steps(
        functools.partial(run_op, variant=variant),
        functools.partial(run, top_p_method="kernel"),
        seed=2,
    )
    with pytest.raises(ValueError, match="not served by the fused kernel"):
        op.sample_kernel(jax.random.key(0), jnp.zeros((2, 200)), sampler_init(sampling.Greedy(), 2),
                         sampling.Greedy(), variant=variant)  # fmt: skip


def test_policy_threshold_encodes_the_policy():
    # high == (h >= thr) | (h > alt) for every state kind and for h at the exact ties
    rng = np.random.default_rng(3)
    b, w = 12, 4
    cfg = ReSET(window=w, tau_0=0.6)
    ring = rng.uniform(0, 2, size=(b, w)).astype(np.float32)
    n_ring = np.array([0, 0, 0, 1, 2, 4, 4, 4, 3, 0, 4, 1], np.int32)
    s_n = np.array([0, 0, 2, 1, 2, 4, 7, 5, 3, 0, 0, 1], np.int32)
    g_n = np.array([0, 3, 5, 1, 2, 4, 9, 9, 3, 7, 4, 1], np.int32)  # some with an empty ring
    ring = np.where(np.arange(w)[None] < n_ring[:, None], ring, 0)
    g_mean = rng.uniform(0, 2, b).astype(np.float32)
    g_mean[[1, 9]] = 0.2, 1.5  # empty rings: tau = H_t when H_t > H-bar, on both sides of tau_0
    state = SamplerState(
        ring=jnp.asarray(ring), n_ring=jnp.asarray(n_ring), ring_pos=jnp.asarray(n_ring % w),
        s_sum=jnp.asarray(rng.uniform(0, 2, b) * s_n, jnp.float32), s_n=jnp.asarray(s_n),
        g_sum=jnp.asarray(g_mean * g_n, jnp.float32), g_n=jnp.asarray(g_n),
        y1=jnp.full((b,), -1, jnp.int32), y2=jnp.full((b,), -1, jnp.int32),
    )  # fmt: skip
    thr, alt = sampling._policy_threshold(state, cfg)
    g_mean = np.asarray(state.g_sum) / np.maximum(g_n, 1).astype(np.float32)
    cands = [np.full(b, x, np.float32) for x in np.linspace(0, 2.5, 26)]
    cands += [np.asarray(thr), np.asarray(jnp.where(jnp.isinf(alt), 0.3, alt)), g_mean]
    cands += [np.nextafter(c, np.float32(9), dtype=np.float32) for c in cands[-3:]]
    for h in cands:
        h = jnp.asarray(h, jnp.float32)
        _, high, _ = sampling._policy(h, state, cfg)
        np.testing.assert_array_equal(np.asarray((h >= thr) | (h > alt)), np.asarray(high))


# ----------------------------------------------------------------------------- emulation


def _keys(n, seed=0):
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)))


def _em_cases():
    rng = np.random.default_rng(5)
    normal = rng.normal(size=3000).astype(np.float32)
    return {  # name: (logits, t, top_p, nmax, path)
        "peaked": (np.r_[[9.0, 8.0, 7.5], rng.normal(size=497)], 0.6, 0.95, 2048, "whole"),
        "flat": (normal, 1.0, 0.95, 2048, "collect"),
        "flat_large": (normal, 1.0, 0.95, 3, "large"),
        "ties": (np.repeat([2.0, 1.0, 0.0, -1.0], 60), 1.0, 0.8, 2048, "collect"),
        "ties_large": (np.repeat([2.0, 1.0, 0.0, -1.0], 60), 1.0, 0.8, 8, "large"),
        "equal": (np.zeros(4000), 1.0, 0.3, 512, "large"),
        "top_p_1": (normal * 2, 0.8, 1.0, 2048, "full"),
        "tiny_top_p": (np.r_[[3.0, 3.0], rng.normal(size=300)], 1.0, 1e-3, 2048, "collect"),
        # the boundary token's mass above equals the limit exactly (2 of 4 kept, not 3)
        "half": (np.zeros(4), 1.0, 0.5, 2048, "collect"),
        "masked": (np.r_[np.full(100, -np.inf), rng.normal(size=200)], 0.3, 0.9, 2048, None),
    }


def _topk_cases():
    rng = np.random.default_rng(6)
    normal = rng.normal(size=3000).astype(np.float32)
    steps = np.repeat(np.arange(30, 0, -1, dtype=np.float32) * 0.25, 40)  # 30 tie groups of 40
    return {  # name: (logits, t, top_p, k, nmax, path)
        "k20": (normal, 0.6, 0.95, 20, 2048, "topk_list"),
        "k20_full": (normal, 0.6, 1.0, 20, 2048, "topk_list"),
        "k20_select": (normal * 0.02, 1.0, 0.9, 20, 24, "topk_select"),
        "k20_large": (normal, 1.0, 0.9, 20, 8, "topk_large"),
        "ties_at_k": (steps, 1.0, 0.9, 50, 2048, "topk_list"),  # 80 tokens >= the 50th
        "equal": (np.zeros(3000, np.float32), 1.0, 0.5, 20, 512, "topk_large"),
        "few_live": (np.r_[normal[:5], [-np.inf] * 40], 1.0, 0.8, 20, 64, "topk_list"),
        # the top 25 all in the first chunk: its own k-th largest is the row's
        "one_chunk": (
            np.r_[10.0 + np.arange(25, dtype=np.float32) * 0.05, normal[25:]],
            1.0,
            0.9,
            20,
            2048,
            "topk_list",
        ),
        # 100 tokens tied at the top in the first chunk: more than a chunk lists ("merge"
        # falls back to the split list)
        "chunk_ties": (
            np.r_[np.full(100, 5.0, np.float32), normal[100:]],
            1.0,
            0.9,
            20,
            2048,
            "topk_list",
        ),
    }


def _merged_path(path, k):
    # the "merge" variant draws from the chunks' candidates where the split one lists (k <= 32,
    # no chunk over its capacity: every case but chunk_ties)
    return "topk_merge" if path == "topk_list" and k <= kernels.MERGE_MAX_K else path


@pytest.mark.parametrize("variant", op.VARIANTS)
@pytest.mark.parametrize("name", list(_em_cases()) + [f"topk:{n}" for n in _topk_cases()])
def test_emulation_keeps_the_definition(name, variant):
    if name.startswith("topk:"):
        z, t, top_p, k, nmax, path = _topk_cases()[name[5:]]
    else:
        (z, t, top_p, nmax, path), k = _em_cases()[name], 0
    chunks = kernels.CLUSTER if variant in kernels.CLUSTER_VARIANTS else 5
    prune = "bound" if variant in kernels.CLUSTER_VARIANTS else True
    em = op.emulate(z, -np.inf, np.inf, t, t, top_p, _keys(4), top_k=k, nmax=nmax, chunks=chunks,
                    prune=prune, variant=variant)  # fmt: skip
    if variant == "merge" and name != "topk:chunk_ties":
        path = _merged_path(path, k)
    if path is not None:
        assert em["path"] == path
    zt = np.asarray(z, np.float32) / np.float32(t)
    live = zt > -np.inf
    if k:  # the top-k rule on the tempered logits (ties at the k-th kept)
        live &= zt >= np.sort(zt)[::-1][min(k, live.sum()) - 1]
        np.testing.assert_array_equal(em["probs"] > 0, live)  # the whole top-k set, no more
    want = _top_p_numpy(em["probs"][None], np.array([top_p], np.float32))[0] & live
    np.testing.assert_array_equal(em["keep"], want)
    assert want[em["tokens"]].all()


_N = 100_000


@pytest.mark.parametrize(
    "name", ["peaked", "ties", "ties_large", "tiny_top_p", "top_p_1", "topk:k20", "topk:ties_at_k"]
)
def test_emulation_draws_follow_the_truncated_softmax(name):
    # 10^5 draws (one key each) against the exact truncated softmax; p > 1e-4 (fixed keys)
    if name.startswith("topk:"):
        z, t, top_p, k, nmax, _ = _topk_cases()[name[5:]]
        if name == "topk:ties_at_k":
            z, k = z[::10], 5  # 30 groups of 4: the k-th falls inside the second group
    else:
        (z, t, top_p, nmax, _), k = _em_cases()[name], 0
    z = np.asarray(z, np.float32)
    if name.startswith("ties"):  # 4 groups of 15 (the keep cut inside one group)
        z = z[::4]
    if not k:
        z = z[:80]  # at most 80 candidates per draw: the noise is 8e6 Threefry calls
    em = op.emulate(z, -np.inf, np.inf, t, t, top_p, _keys(_N, seed=9), top_k=k, nmax=nmax)
    p = np.exp((z.astype(np.float64) - z.max()) / t)
    want = np.where(em["keep"], p, 0.0)
    _assert_draws_match(em["tokens"], want / want.sum(), name)


@pytest.mark.parametrize("name", ["peaked", "flat", "ties", "tiny_top_p", "top_p_1", "masked"])
def test_cdf_emulation_draws_follow_the_truncated_softmax(name):
    # the "cdf" variant's draws (4 inverse-CDF draws over 3 chunks, the first kept one, else the
    # climb's Gumbel-max over the kept tokens): 10^5 draws against the exact truncated softmax;
    # draws land in every chunk, and some rows fall back ("tiny_top_p" mostly)
    z, t, top_p, nmax, _ = _em_cases()[name]
    z = np.asarray(z, np.float32)[:240]
    em = op.emulate(z, -np.inf, np.inf, t, t, top_p, _keys(_N, seed=11), nmax=nmax, chunks=3,
                    variant="cdf")  # fmt: skip
    p = np.exp((z.astype(np.float64) - z.max()) / t)
    want = np.where(em["keep"], p, 0.0)
    _assert_draws_match(em["tokens"], want / want.sum(), name)
    draws = em["draws"]
    assert draws.shape == (_N, op.CDF_DRAWS) and (draws >= 0).all() and (draws < len(z)).all()
    # each draw alone follows the untruncated weights (p > 1e-4)
    _assert_draws_match(draws[:, 1], p / p.sum(), f"{name} draw 1")
    if top_p >= 1:
        np.testing.assert_array_equal(em["tokens"], draws[:, 0])


def test_cdf_draws_follow_the_weights_and_skip_masked_tokens():
    # the inverse-CDF search over integer weights: draws follow the softmax (a weight of a few
    # 2**-40 units included), masked tokens are never drawn, and the draws do not depend on the
    # launch plan (no chunk enters); an all-masked row has no draw
    rng = np.random.default_rng(5)
    z = rng.normal(size=50).astype(np.float32) * 3
    z[10:20] = -np.inf
    z[23] = -np.inf
    z[30] = z.max() - np.float32(27.0)  # weight about 2**-39: a few units
    keys = _keys(20000, seed=2)
    d = op.cdf_draws(z, z.max(), np.float32(1.0), keys)
    assert not np.isin(d, np.r_[10:20, 23]).any()
    p = np.exp(z.astype(np.float64) - z.max())
    _assert_draws_match(d.ravel(), p / p.sum(), "cdf draws")
    assert (op.cdf_draws(np.full(8, -np.inf, np.float32), -np.inf, 1.0, keys[:3]) == -1).all()
    for chunks in (1, 3, 7):
        em = op.emulate(z, -np.inf, np.inf, 1.0, 1.0, 0.9, keys[:500], chunks=chunks,
                        variant="cdf")  # fmt: skip
        np.testing.assert_array_equal(em["draws"], d[:500])


def test_pruning_never_changes_the_winner():
    for name in ("peaked", "flat", "tiny_top_p", "masked"):
        z, t, top_p, nmax, _ = _em_cases()[name]
        for tt in (t, 0.05):  # low temperatures prune nearly everything
            args = (z, -np.inf, np.inf, tt, tt, top_p, _keys(3000, seed=4))
            a = op.emulate(*args, nmax=nmax)["tokens"]
            b = op.emulate(*args, nmax=nmax, prune=False)["tokens"]
            np.testing.assert_array_equal(a, b, err_msg=f"{name} t={tt}")


def test_bound_pruning_never_changes_the_winner():
    # the cluster kernel computes a token's noise only where gumbel_bound lets it reach the top
    # token's least score: the winners of 3000 keys equal those without pruning
    rng = np.random.default_rng(8)
    cases = {n: _em_cases()[n] for n in ("peaked", "flat", "tiny_top_p", "masked", "top_p_1")}
    cases["near_ties"] = (np.r_[[5.0] * 3, 5.0 - rng.exponential(0.02, 40), rng.normal(size=200)],
                          1.0, 0.99, 2048, None)  # fmt: skip
    for name, (z, t, top_p, nmax, _) in cases.items():
        for tt in (t, 0.05, 3.0):  # low temperatures prune nearly everything
            args = (z, -np.inf, np.inf, tt, tt, top_p, _keys(3000, seed=4))
            a = op.emulate(*args, nmax=nmax, prune="bound", variant="cluster")["tokens"]
            b = op.emulate(*args, nmax=nmax, prune=False)["tokens"]
            np.testing.assert_array_equal(a, b, err_msg=f"{name} t={tt}")


def test_gumbel_bound_bounds_the_noise():
    # every lo: gumbel_of_bits(hi, lo) <= gumbel_bound(hi), near the branch point and the ends too
    rng = np.random.default_rng(10)
    edges = [0, 1, 2, 3, (1 << 24) - 1, 1 << 24, (1 << 31) - 2, (1 << 31) - 1, 1 << 31,
             (1 << 31) + 1, (1 << 32) - 2, (1 << 32) - 1]  # fmt: skip
    hi = np.r_[np.array(edges, np.uint64), rng.integers(0, 1 << 32, 200_000, dtype=np.uint64),
               rng.integers(0, 1 << 20, 50_000, dtype=np.uint64)].astype(np.uint32)  # fmt: skip
    bound = op.gumbel_bound(hi)
    for lo in (0, 1 << 9, 0x7FFFFFFF, 0xFFFFFFFF):
        g = op.gumbel_of_bits(hi, np.full_like(hi, lo))
        assert (g <= bound).all(), hi[g > bound][:5]
    g = op.gumbel_of_bits(hi, rng.integers(0, 1 << 32, hi.size, dtype=np.uint64).astype(np.uint32))
    assert (g <= bound).all()
    # and it prunes: within log(-log(3/4) / (1/4)) = 0.14 of the noise where the noise is large
    # (u < 1/4, noise > 1.25), which is where tokens far below the top need it
    small = (hi >= (1 << 20)) & (hi < (1 << 30))  # (below 2**20 the low word adds > 1e-6)
    assert (bound[small] - g[small]).max() < 0.15


def _reject_cases():
    rng = np.random.default_rng(12)
    cases = {n: _em_cases()[n][:4] for n in ("peaked", "flat", "ties", "tiny_top_p", "half",
                                             "masked")}  # fmt: skip
    # the first draw often lands just outside the nucleus: a flat head, top-p 0.5
    cases["flat_head"] = (np.r_[np.zeros(40), rng.normal(size=400) - 4.0], 1.0, 0.5, 2048)
    # one token holds nearly all mass: the draw is kept unless it lands in the tail
    cases["one_top"] = (np.r_[[12.0], rng.normal(size=2000)], 1.0, 0.9, 2048)
    # many equal keys at the boundary: the id order decides the keep test
    cases["tie_cut"] = (np.r_[np.full(64, 2.0), rng.normal(size=300)], 1.0, 0.37, 2048)
    return cases


@pytest.mark.parametrize("name", list(_reject_cases()))
def test_reject_first_draw_is_kept_only_when_the_kept_draw_equals_it(name):
    # the "reject" kernel's shortcut: its draw over every token passes its integer-mass test
    # exactly when that token is in the kept set, and then it is the cluster kernel's token
    z, t, top_p, nmax = _reject_cases()[name]
    args = (z, -np.inf, np.inf, t, t, top_p, _keys(1500, seed=13))
    kw = {"nmax": nmax, "chunks": kernels.CLUSTER, "prune": "bound"}
    rej = op.emulate(*args, variant="reject", **kw)
    clu = op.emulate(*args, variant="cluster", **kw)
    first, acc = rej["first"], rej["accepted"]
    np.testing.assert_array_equal(acc, clu["keep"][first])
    np.testing.assert_array_equal(first[acc], clu["tokens"][acc])
    np.testing.assert_array_equal(rej["tokens"], clu["tokens"])
    if name in ("flat_head", "tie_cut", "one_top"):  # both outcomes happen
        assert 0 < acc.mean() < 1, acc.mean()
    if name == "tie_cut":  # the boundary cuts the tie group of 64: draws on both sides of it
        tied = first < 64
        assert acc[tied].any() and not acc[tied].all()


def test_reject_variant_adds_the_shortcut_to_the_cluster_kernel():
    # the "reject" plan is the cluster kernel's plus REJECT=1 for top-p without top-k
    for k in (0, 20):
        p, c = kernels.plan(4, 151936, k, "reject"), kernels.plan(4, 151936, k, "cluster")
        extra = {"REJECT": 1} if k == 0 else {}
        assert p.defines() == c.defines() | extra and p.cluster == kernels.CLUSTER
    assert kernels.entries("reject") == kernels.CLUSTER_ENTRIES
    src = kernels.read_source(kernels.SOURCE)
    assert (
        "#if REJECT" in src and "s_keep = xb && kx > KEY_LO && (float)ab < tp * (float)total" in src
    )


def test_cluster_constants_match_the_kernel_source():
    # the bounds checked above are the NumPy mirror's; these are the kernel's own numbers
    from cuda_ops.build import read_source

    src = read_source("sampler.cu")
    assert re.search(r"#define PRUNE_SCORE \((-[\d.]+)f\)", src).group(1) == str(op._PRUNE_SCORE)
    body = src[src.index("float gumbel_bound(u32 hi)") :]
    body = body[: body.index("}")]
    assert "return 0.36652f;" in body and "22.18071f + 1e-4f - __logf((float)hi)" in body
    assert "logf(den) - 21.487563f - 0.01f" in src  # zt_cut
    # the largest top-k the grid kernel cuts at tau
    assert int(re.search(r"#define TAU_K_MAX (\d+)", src).group(1)) == kernels.GRID_TAU_MAX_K
    assert "klo) * den) - 1e-3f" in src and "BIN_BITS)) * den) + 1e-3f" in src  # bin_window


@pytest.mark.parametrize("t", [0.05, 0.3, 0.6, 1.0, 2.0])
def test_cluster_filters_keep_every_binned_token(t):
    # zt_cut passes every token with mass; bin_window(b) holds every token of top-p bin b
    rng = np.random.default_rng(int(t * 100))
    for kind in ("normal", "gumbel", "peaked"):
        z = rng.normal(size=20000) if kind == "normal" else 2 * rng.gumbel(size=20000)
        z = z.astype(np.float32)
        if kind == "peaked":
            z[:5] += 15.0
        zt = (z - z.max()) * (np.float32(1) / np.float32(t))
        den = np.sum(np.exp(zt), dtype=np.float32)
        _, keys, q = op._probs(zt, zt > -np.inf, den)
        bins = op._bins(keys)
        assert (zt[q > 0] >= op.zt_cut(den)).all(), kind
        assert (zt[q == 0] < op.zt_cut(den) + 1).any() or (q > 0).all()
        for b in np.unique(bins[bins > 0]):
            zlo, zhi = op.bin_window(int(b), den)
            inb = zt[bins == b]
            assert (inb >= zlo).all() and (inb <= zhi).all(), (kind, b)


def test_emulation_reset_choice_and_greedy():
    z = np.random.default_rng(1).normal(size=700).astype(np.float32)
    h = float(sampling.entropy(jnp.asarray(z)[None])[0])
    hi = op.emulate(z, h - 0.01, np.inf, 1.0, 0.0, 0.9, _keys(5))
    lo = op.emulate(z, h + 0.01, np.inf, 1.0, 0.0, 0.9, _keys(5))
    alt = op.emulate(z, h + 0.01, h - 0.01, 1.0, 0.0, 0.9, _keys(5))
    assert abs(hi["entropy"] - h) < 1e-5
    assert hi["temperature"] == 1.0 and hi["path"] != "greedy"
    assert lo["temperature"] == 0.0 and lo["path"] == "greedy"
    assert (lo["tokens"] == np.argmax(z)).all()
    assert alt["temperature"] == 1.0


def test_philox_is_the_standard_one():
    # the kernels' noise is Philox-4x32-10: Random123's known-answer vectors
    kat = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]  # fmt: skip
    for (c0, c1, c2, c3), (k0, k1), want in kat:
        got = op.philox(np.uint32(c0), np.uint32(k0), np.uint32(k1), c1, c2, c3)
        assert tuple(int(x) for x in got) == want


def test_op_rejects_bad_arguments():
    z = jnp.zeros((2, 10), jnp.float32)
    v = jnp.ones((2,), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(ValueError, match="kind='greedy'"):
        op.sample_top_p(z, v, v, v, v, v, keys, kind="greedy")
    with pytest.raises(ValueError, match="top_k=11"):
        op.sample_top_p(z, v, v, v, v, v, keys, kind="temperature", top_k=11)
    with pytest.raises(ValueError, match="impl='gpu'"):
        op.sample_top_p(z, v, v, v, v, v, keys, kind="temperature", impl="gpu")
    with pytest.raises(ValueError, match="variant='fused'"):
        op.sample_top_p(z, v, v, v, v, v, keys, kind="temperature", variant="fused")
    with pytest.raises(ValueError, match="variant='fused'"):
        kernels.plan(2, 10, variant="fused")
    with pytest.raises(ValueError, match="top-p method='kernel' is invalid"):
        sampling.top_p_mask(jax.nn.softmax(z), 0.9, method="kernel")  # a sampler path, not a mask


def _bound_variants(fn, *args) -> list:
    """The `variant` parameter of every sampler primitive in fn's jaxpr ("grid-state" for
    ReSET's draw-and-update primitive)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    names = {"rejax_sample_top_p": "", "rejax_sample_reset": "-state"}
    return [
        e.params["variant"] + names[e.primitive.name]
        for e in jaxpr.eqns
        if e.primitive.name in names
    ]


@pytest.mark.parametrize(
    "rows,top_k,want",
    [(1, 0, "cdf"), (7, 0, "cdf"), (64, 0, "cdf"), (1, 20, "grid"), (64, 20, "grid"),
     (1, 21, "split"), (31, 21, "split"), (32, 21, "merge"), (64, 32, "merge"), (64, 33, "split"),
     (64, 64, "split")],
)  # fmt: skip
def test_auto_variant_picks_by_rows_and_top_k(rows, top_k, want):
    """The default variant "auto" binds "cdf" for top-p alone, "grid" for top-k up to 20, and
    for a larger k "merge" where the H200 measured it faster (k <= 32 from 32 rows) and "split"
    elsewhere; `sample` binds the same pick, ReSET as top-p alone with its state update in the
    launch ("cdf-state"); a named variant is kept ("kernel-grid": "grid" without the state)."""
    assert op.VARIANT == "auto"
    assert op.choose_variant("auto", rows, top_k) == want
    assert op.choose_variant("cluster", rows, top_k) == "cluster"
    vocab = 64
    z = jnp.zeros((rows, vocab), jnp.float32)
    smp = sampling.Temperature(t=0.6, top_p=0.95, top_k=top_k if top_k <= vocab else 0)
    key = jax.random.key(0)
    if top_k <= vocab:
        got = _bound_variants(lambda k, x: sample(k, x, sampler_init(smp, rows), smp), key, z)
        assert got == [want]
    if top_k == 0:
        reset = sampling.ReSET(t_high=1.0, t_low=0.1, top_p=0.95, nl_mask=jnp.zeros(vocab, bool),
                               dnl_mask=jnp.zeros(vocab, bool))  # fmt: skip
        got = _bound_variants(lambda k, x: sample(k, x, sampler_init(reset, rows), reset), key, z)
        assert got == [f"{want}-state"]
        named = dataclasses.replace(reset, top_p_method="kernel-grid")
        got = _bound_variants(lambda k, x: sample(k, x, sampler_init(named, rows), named), key, z)
        assert got == ["grid"]
        named = dataclasses.replace(reset, top_p_method="kernel-cdf-state")
        got = _bound_variants(lambda k, x: sample(k, x, sampler_init(named, rows), named), key, z)
        assert got == ["cdf-state"]
    with pytest.raises(ValueError, match="variant='fused'"):
        op.choose_variant("fused", rows, top_k)


# ----------------------------------------------------------------------------- grid-state


def _reset_trace(v=64, b=3, steps=12):
    """ReSET with newline masks that the draws hit (tokens 0-9 single, 10-14 double newlines)
    and logits that favour them, so step boundaries occur."""
    nl = jnp.zeros(v, bool).at[:10].set(True)
    dnl = jnp.zeros(v, bool).at[10:15].set(True)
    smp = ReSET(t_high=1.0, t_low=0.3, tau_0=3.0, window=4, top_p=0.9, nl_mask=nl, dnl_mask=dnl)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((steps, b, v)).astype(np.float32)
    z[:, :, :15] += 2.0
    return smp, jnp.asarray(z)


@pytest.mark.parametrize("method", ["kernel-grid-state", "kernel-grid"])
def test_grid_state_method_is_the_grid_path_on_cpu(method):
    # "kernel-grid-state" (ReSET's update inside the op) gives the tokens, entropies and every
    # state array of "kernel-grid" (the update in XLA after the op), bit for bit, step by step
    smp, z = _reset_trace()
    b = z.shape[1]
    runs = {}
    for m in (method, "kernel-grid"):
        s = dataclasses.replace(smp, top_p_method=m)
        state, out = sampler_init(s, b), []
        for i in range(z.shape[0]):
            tok, state, info = jax.jit(sample)(jax.random.key(i), z[i], state, s)
            out.append((np.asarray(tok), np.asarray(info["entropy"]), state))
        runs[m] = out
    for (ta, ha, sa), (tb, hb, sb) in zip(runs[method], runs["kernel-grid"], strict=True):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(ha, hb)
        for f in dataclasses.fields(SamplerState):
            np.testing.assert_array_equal(getattr(sa, f.name), getattr(sb, f.name), f.name)
    # the trace crossed step boundaries (s_n went back to 0 after the first token)
    assert any((np.asarray(st.s_n) == 0).any() for _, _, st in runs[method][1:])


def test_sample_reset_step_vmaps_over_rows():
    # vmap over a leading dim folds it into the rows (the masks stay shared)
    smp, z = _reset_trace(b=2)
    state = sampler_init(smp, 2)
    thr, alt = sampling._policy_threshold(state, smp)
    ones = jnp.ones((2,), jnp.float32)
    keys = jax.random.split(jax.random.key(3), 2)

    def step(zz, kk):
        return op.sample_reset_step(zz, thr, alt, ones, 0.3 * ones, 0.9 * ones, kk, state,
                                    smp.nl_mask, smp.dnl_mask)  # fmt: skip

    zs = jnp.stack([z[0], z[1], z[2]])
    ks = jnp.stack([keys, keys, keys])
    got = jax.vmap(step)(zs, ks)
    for i in range(3):
        want = step(zs[i], ks[i])
        np.testing.assert_array_equal(np.asarray(got[0][i]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[3].ring[i]), np.asarray(want[3].ring))
        np.testing.assert_array_equal(np.asarray(got[3].y2[i]), np.asarray(want[3].y2))
    with pytest.raises(ValueError, match="nl_mask must be bool"):
        op.sample_reset_step(z[0], thr, alt, ones, ones, ones, keys, state,
                             smp.nl_mask[:-1], smp.dnl_mask)  # fmt: skip


def test_cuda_lowering_grid_state_is_one_call():
    # ReSET under "grid-state": one grid kernel with the state in and out (18 operands, 12
    # results, the state's in place), built with RESET_STATE and the ring's width; Temperature
    # runs plain "grid"
    pytest.importorskip("cuda.bindings.nvrtc")
    b, v, w = 4, 151936, 32
    masks = {"nl_mask": jnp.zeros(v, bool), "dnl_mask": jnp.zeros(v, bool)}
    reset = ReSET(top_p=0.95, window=w, **masks)
    hlo = _lower_cuda_variant(reset, b, v, op.STATE_VARIANT)
    (cfg,) = _backend_configs(hlo)
    assert cfg["name"] == "rejax_sample_grid" and cfg["outputs"] == list(range(18, 30))
    # the state is updated in place: operands 7..15 alias results 3..11 (no copies in a loop)
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", hlo)
    assert sorted((int(o), int(i)) for i, o in aliases) == [(7 + k, 3 + k) for k in range(9)]
    assert (cfg["grid_x"], cfg["grid_y"]) == (kernels.grid_plan(b, v)[0], b)
    kern = kernels.build(b, v, 0, variant="grid", window=w, arch="compute_90")
    assert ptx_entries(kern.ptx) == {"rejax_sample_grid": 30}
    assert kern.plan.defines()["RESET_STATE"] == 1 and kern.plan.defines()["W_RING"] == w
    (cfg,) = _backend_configs(_lower_cuda_variant(Temperature(0.6, top_p=0.9), b, v, "grid-state"))
    assert cfg["outputs"] == [7, 8, 9]
    with pytest.raises(ValueError, match="needs variant 'grid'"):
        kernels.plan(b, v, 20, "grid", window=w)
    with pytest.raises(ValueError, match="variant='fused'"):
        op.sample_kernel(jax.random.key(0), jnp.zeros((b, v)), sampler_init(reset, b), reset,
                         variant="fused")  # fmt: skip


def test_grid_state_kernel_fits_its_occupancy():
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops.build import ptxas_log, read_source

    p = kernels.plan(1, 151936, 0, variant="grid", window=32)
    log = ptxas_log(read_source("sampler.cu"), p.defines(), name="sampler.cu")
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    assert len(regs) == 1 and regs[0] * kernels.GRID_THREADS * kernels.GRID_CTAS_PER_SM <= 65536
