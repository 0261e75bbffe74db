"""CPU tests of the fused sampler op (`rejax.ops.sampler`, kernels in `cuda_ops/sampler.cu`).

No GPU here, so: the CUDA lowering is checked to emit the three PTX custom calls with their
launch configs (NVRTC compiles the kernels for sm_90); the kernels' algorithm is checked through
its NumPy mirror `emulate` (kept set == the definition on every path, chi-square over 10^5 draws,
pruning exact); the op's reference (the CPU path of the default method) is checked to give the
tokens of the "radix" method; and ReSET's (thr, alt) encoding is checked against `_policy`.
"""

from __future__ import annotations

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
    pytest.importorskip("cuda.bindings.nvrtc")
    b, v = 3, 1000
    masks = {"nl_mask": jnp.zeros(v, bool), "dnl_mask": jnp.zeros(v, bool)}
    for smp in (
        Temperature(0.6, top_p=0.9, top_p_method="kernel"),
        ReSET(top_p=0.95, top_p_method="kernel", **masks),
        Temperature(0.6, top_k=20, top_p_method="kernel"),
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


def test_cuda_lowering_falls_back_where_the_kernel_does_not_serve():
    v = 300
    masks = {"nl_mask": jnp.zeros(v, bool), "dnl_mask": jnp.zeros(v, bool)}
    for smp in (
        ReSET(include_current=True, **masks),  # figure semantics: the "radix" path
        Temperature(0.6, top_p=0.9, top_p_method="radix"),
    ):
        assert "__gpu$xla.gpu.ptx" not in _lower_cuda(smp, 2, v)


# ----------------------------------------------------------------------------- CPU path


def test_default_cpu_path_gives_the_radix_tokens():
    # method "kernel" off a GPU must reproduce "radix" bit for bit
    rng = np.random.default_rng(0)
    b, v = 4, 200
    masks = {"nl_mask": jnp.zeros(v, bool).at[3].set(True), "dnl_mask": jnp.zeros(v, bool)}
    run = jax.jit(sample, static_argnames="top_p_method")
    for smp in (Temperature(jnp.array([0.6, 1.0, 1e-7, 2.0]), top_p=0.9, top_k=7),
                ReSET(t_high=1.0, t_low=0.1, top_p=0.95, **masks)):  # fmt: skip
        sa = sb = sampler_init(smp, b)
        for step in range(3):
            z = jnp.asarray(rng.normal(size=(b, v)) * rng.uniform(0.5, 4), jnp.float32)
            key = jax.random.fold_in(jax.random.key(1), step)
            ta, sa, ia = run(key, z, sa, smp, top_p_method="kernel")
            tb, sb, ib = run(key, z, sb, smp, top_p_method="radix")
            np.testing.assert_array_equal(np.asarray(ta), np.asarray(tb))
            for x, y in zip(jax.tree.leaves((sa, ia)), jax.tree.leaves((sb, ib))):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


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
    }


@pytest.mark.parametrize("name", list(_em_cases()) + [f"topk:{n}" for n in _topk_cases()])
def test_emulation_keeps_the_definition(name):
    if name.startswith("topk:"):
        z, t, top_p, k, nmax, path = _topk_cases()[name[5:]]
    else:
        (z, t, top_p, nmax, path), k = _em_cases()[name], 0
    em = op.emulate(z, -np.inf, np.inf, t, t, top_p, _keys(4), top_k=k, nmax=nmax, chunks=5)
    if path is not None:
        assert em["path"] == path
    zt = np.asarray(z, np.float32) / np.float32(t)
    live = zt > -np.inf
    if k:  # the top-k rule on the tempered logits (ties at the k-th kept)
        live &= zt >= np.sort(zt)[::-1][min(k, live.sum()) - 1]
        assert (em["probs"][~live] == 0).all()
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


def test_pruning_never_changes_the_winner():
    for name in ("peaked", "flat", "tiny_top_p", "masked"):
        z, t, top_p, nmax, _ = _em_cases()[name]
        for tt in (t, 0.05):  # low temperatures prune nearly everything
            args = (z, -np.inf, np.inf, tt, tt, top_p, _keys(3000, seed=4))
            a = op.emulate(*args, nmax=nmax)["tokens"]
            b = op.emulate(*args, nmax=nmax, prune=False)["tokens"]
            np.testing.assert_array_equal(a, b, err_msg=f"{name} t={tt}")


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
    with pytest.raises(ValueError, match="top-p method='kernel' is invalid"):
        sampling.top_p_mask(jax.nn.softmax(z), 0.9, method="kernel")  # a sampler path, not a mask
