"""experiments/kernels/sampler_phases.py and sampler_phase_ts.patch without a GPU: the patch
applies; without DIAG_TS the patched kernel is the tree's PTX; with it every stamp site is
there; the analysis recovers known phases, barrier figures and the clock from made-up stamps;
bad arguments are refused before any GPU work."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from experiments.kernels import sampler_phases as sp


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_patch_applies_to_the_tree():
    r = subprocess.run(["git", "apply", "--check", str(sp.PATCH)], cwd=sp.ROOT,
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize(("variant", "sites"), [("cdf", 14), ("grid", 10)])
def test_without_diag_ts_the_patched_kernel_is_the_trees(variant, sites):
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops import sampler as ks
    from cuda_ops.build import compile_ptx, read_source

    p, stamped = sp.build_ptx(1, 151936, variant, 132, "compute_90", diag=True)
    _, plain = sp.build_ptx(1, 151936, variant, 132, "compute_90", diag=False)
    tree = compile_ptx(read_source(ks.SOURCE), name=ks.SOURCE, defines=p.defines(),
                       arch="compute_90")  # fmt: skip
    assert plain == tree
    assert "g_diag_ts" not in plain and "g_diag_ts" in stamped
    # entry, combined, located, exit, and an arrival and a release at every barrier site
    assert stamped.count("%globaltimer") == sites
    assert stamped.count("%clock64") == sites


def _stamps(arrive, release, entry=100, exit_=None, combined=None, ratio=2.0):
    """[1, 1, GRID, SLOTS, 2] stamps from per-CTA cycle counts (barrier 1 only); the globaltimer
    reads cycles / ratio ns (a 2 GHz clock), offset so CTAs share one time base."""
    g = len(arrive)
    s = np.zeros((1, 1, g, sp.SLOTS, 2), np.uint64)
    for c in range(g):
        cyc = {0: entry, 1: arrive[c], 2: release[c]}
        if combined is not None:
            cyc[12] = combined[c]
        if exit_ is not None:
            cyc[14] = exit_[c]
        for k, v in cyc.items():
            s[0, 0, c, k, 0] = v
            s[0, 0, c, k, 1] = int(1_000_000 + v / ratio)
    return s


def test_phases_barriers_and_span_from_known_stamps():
    # 3 CTAs at 2 GHz (2e6 kHz): the sweep to barrier 1 takes 2000 / 4000 / 6000 cycles (1 / 2 /
    # 3 us); all are released at 6400 (the last arrival + 0.2 us); combine 2000 cycles, exit 1000
    arrive = [2100, 4100, 6100]
    release = [6500, 6500, 6500]
    combined = [8500, 8500, 8500]
    exit_ = [9500, 9500, 9500]
    out = sp.analyse(_stamps(arrive, release, combined=combined, exit_=exit_), 2e6)
    ph = out["phases"]
    assert set(ph) == {"entry->arrive1", "arrive1->release1", "release1->combined",
                       "combined->exit"}  # fmt: skip
    assert ph["entry->arrive1"]["median_us"] == pytest.approx(2.0)
    assert ph["entry->arrive1"]["max_us"] == pytest.approx(3.0)
    assert ph["arrive1->release1"]["median_us"] == pytest.approx(1.2)  # 2400 cycles
    assert ph["release1->combined"]["median_us"] == pytest.approx(1.0)
    assert ph["combined->exit"]["n"] == 3
    b = out["barriers"]["barrier1"]
    assert b["arrival_spread_us"] == pytest.approx(2.0, abs=1e-3)  # 4000 cycles = 2000 ns
    assert b["last_arrival_to_first_release_us"] == pytest.approx(0.2, abs=1e-3)
    assert out["span_us"] == pytest.approx(4.7, abs=1e-3)  # (9500 - 100) / 2 ns
    assert sp.stamped_clock_khz(_stamps(arrive, release, exit_=exit_)) == pytest.approx(2e6)


def test_stamps_of_a_later_barrier_order_by_time_not_slot():
    s = _stamps([300], [400], combined=[200], exit_=[500])  # combined before barrier 1
    assert set(sp.analyse(s, 1e6)["phases"]) == {
        "entry->combined", "combined->arrive1", "arrive1->release1", "release1->exit"
    }  # fmt: skip


def test_malformed_stamps_are_refused():
    with pytest.raises(ValueError, match="expected"):
        sp.analyse(np.zeros((1, 1, 3, 8, 2), np.uint64), 1e6)
    with pytest.raises(ValueError, match="entry and its exit"):
        sp.stamped_clock_khz(np.zeros((1, 1, 3, sp.SLOTS, 2), np.uint64))


def test_slot_names():
    names = [sp.slot_name(k) for k in (0, 1, 2, 7, 8, 12, 13, 14)]
    assert names == ["entry", "arrive1", "release1", "arrive4", "release4", "combined",
                     "located", "exit"]  # fmt: skip
    with pytest.raises(ValueError, match="slot 15"):
        sp.slot_name(15)


def test_bad_arguments_are_refused_before_any_gpu_work(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="--batch \\[0\\]"):
        sp.main(["--batch", "0", "--out", str(tmp_path / "x.json")])
    monkeypatch.setitem(sys.modules, "cupy", None)  # no CuPy, as here
    with pytest.raises(SystemExit, match="needs CuPy"):
        sp.main(["--batch", "1", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_geometries_parse_and_bad_ones_are_refused(tmp_path):
    assert sp.parse_geometry("plan") is None
    assert sp.parse_geometry("64x256") == (64, 256, False)
    assert sp.parse_geometry("8x1024c") == (8, 1024, True)
    for bad in ("9x1024c", "0x256", "8x100", "300x256", "x", "8x256cc"):
        with pytest.raises(ValueError, match="geometry"):
            sp.parse_geometry(bad)
    with pytest.raises(SystemExit, match="geometry '9x512c'"):
        sp.main(
            ["--batch", "1", "--geometries", "plan", "9x512c", "--out", str(tmp_path / "x.json")]
        )
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_geometry_builds_override_the_plan_and_the_cluster_one_uses_cluster_barriers():
    pytest.importorskip("cuda.bindings.nvrtc")
    p, ptx = sp.build_ptx(1, 151936, "cdf", 132, "compute_90", diag=True, geometry=(8, 1024, True))
    assert (p.chunks, p.threads) == (8, 1024) and p.chunks * p.chunk >= 151936
    assert ".reqnctapercluster" in ptx and "barrier.cluster.arrive.release" in ptx
    assert "ld.acquire.gpu" not in ptx  # no barrier polls the global counter
    assert ptx.count("%globaltimer") == 14  # the cluster barrier is stamped as the global one
    p, ptx = sp.build_ptx(
        1, 151936, "cdf", 132, "compute_90", diag=False, geometry=(64, 256, False)
    )
    assert (p.chunks, p.threads) == (64, 256) and "barrier.cluster" not in ptx
    assert "ld.acquire.gpu" in ptx
