"""The sampler patch waiting for a GPU, without one: sampler_grid_barrier.patch applies to the
tree; its grid builds keep their registers without spills at BAR_ARRIVE 0 and 1 (its default)
and drop the sequentially consistent fences; its run script refuses bad arguments before it
touches anything."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

from cuda_ops import sampler as kernels

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "experiments" / "kernels"
PATCHES = ["sampler_grid_barrier.patch"]
SCRIPTS = {"barrier_patch_run.sh": "same"}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("patch", PATCHES)
def test_the_patch_applies_to_the_tree(patch):
    r = subprocess.run(["git", "apply", "--check", str(KERNELS / patch)], cwd=ROOT,
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr


def _barrier_source(tmp_path) -> str:
    (tmp_path / "cuda_ops").mkdir()
    shutil.copy(ROOT / "cuda_ops" / "sampler.cu", tmp_path / "cuda_ops" / "sampler.cu")
    r = subprocess.run(["git", "apply", str(KERNELS / "sampler_grid_barrier.patch")],
                       cwd=tmp_path, capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return (tmp_path / "cuda_ops" / "sampler.cu").read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("arrive", [0, 1])
@pytest.mark.parametrize(
    ("variant", "b", "window", "top_k"),
    [("cdf", 1, 16, 0), ("cdf", 64, 16, 0), ("cdf", 64, 0, 0), ("grid", 1, 0, 20)],
)
def test_the_barrier_builds_keep_their_registers(tmp_path, arrive, variant, b, window, top_k):
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops.build import ptxas_log

    src = _barrier_source(tmp_path)
    p = kernels.plan(b, 151936, top_k, variant=variant, window=window, bf16=True)
    log = ptxas_log(src, p.defines() | {"BAR_ARRIVE": arrive}, name="sampler.cu")
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    ctas = kernels.GRID_TOPK_CTAS_PER_SM if top_k else kernels.GRID_CTAS_PER_SM
    assert len(regs) == 1 and regs[0] * kernels.GRID_THREADS * ctas <= 65536
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_barrier_patch_drops_the_sc_fences(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops.build import compile_ptx

    src = _barrier_source(tmp_path)
    p = kernels.plan(1, 151936, 0, variant="cdf", window=16, bf16=True)
    fences = {}
    for arrive in (0, 1, 2):
        ptx = compile_ptx(src, name="sampler.cu", defines=p.defines() | {"BAR_ARRIVE": arrive},
                          arch="compute_90")  # fmt: skip
        fences[arrive] = (ptx.count("fence.sc.gpu") + ptx.count("membar.gl"),
                          ptx.count("fence.acq_rel.gpu"), ptx.count("red.release.gpu"))  # fmt: skip
    assert fences[1][0] < fences[0][0] and fences[1][1] > 0, fences
    assert fences[2][0] == fences[1][0] and fences[2][2] > 0, fences


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("argv", [[], ["out"], ["out", "bogus"], ["out", "ok", "nope"]])
def test_the_scripts_refuse_bad_arguments(tmp_path, script, argv):
    argv = [SCRIPTS[script] if a == "ok" else a for a in argv]
    cmd = ["bash", str(KERNELS / script), *argv]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stderr, r
    assert not (tmp_path / "out").exists()
