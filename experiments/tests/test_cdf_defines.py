"""experiments/kernels/cdf_defines.py and sampler_cdf_fast_exp.patch without a GPU: the
constants reach the "cdf" builds only (with the CPU mirror's NC), bad specs fail before any
build, and the patch still applies to the tree's sampler.cu and builds with CDF_FAST_EXP."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from cuda_ops import build as cbuild
from cuda_ops import sampler as kernels
from experiments.kernels import cdf_defines
from rejax.ops import sampler as op

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCH = ROOT / "experiments" / "kernels" / "sampler_cdf_fast_exp.patch"


@pytest.fixture
def restore(monkeypatch):
    monkeypatch.setattr(kernels.Plan, "defines", kernels.Plan.defines)
    monkeypatch.setattr(op, "CDF_DRAWS", op.CDF_DRAWS)
    yield
    kernels._build_cached.cache_clear()


def test_parse_accepts_known_constants_and_names_bad_ones():
    assert cdf_defines.parse("NC=2, CDF_FAST_EXP=1") == {"NC": 2, "CDF_FAST_EXP": 1}
    assert cdf_defines.parse("") == {}
    for bad, says in [("NC=5", "NC=5"), ("FOO=1", "'FOO=1'"), ("NC", "'NC'"), ("NC=x", "'NC=x'")]:
        with pytest.raises(ValueError, match=says):
            cdf_defines.parse(bad)


def test_apply_reaches_cdf_builds_only(restore):
    cdf = kernels.plan(64, 151936, 0, variant="cdf", sms=132)
    grid = kernels.plan(64, 151936, 0, variant="grid", sms=132)
    grid_defines = grid.defines()
    assert "NC" not in cdf.defines()
    cdf_defines.apply({"NC": 2})
    cdf_defines.apply({"NC": 3, "CDF_FAST_EXP": 1})  # a second call replaces the first
    assert cdf.defines()["NC"] == 3 and cdf.defines()["CDF_FAST_EXP"] == 1
    assert grid.defines() == grid_defines
    assert op.CDF_DRAWS == 3


def _patched(tmp_path) -> str:
    (tmp_path / "cuda_ops").mkdir()
    shutil.copy(ROOT / "cuda_ops" / "sampler.cu", tmp_path / "cuda_ops" / "sampler.cu")
    r = subprocess.run(["git", "apply", str(PATCH)], cwd=tmp_path, capture_output=True,
                       text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return (tmp_path / "cuda_ops" / "sampler.cu").read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_patch_applies(tmp_path):
    src = _patched(tmp_path)
    assert "cdf_exp(" in src and "CDF_FAST_EXP" in src


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_the_patched_cdf_build_uses_the_hardware_exp(tmp_path, monkeypatch):
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path / "cache"))
    src = _patched(tmp_path)
    d = kernels.plan(64, 151936, 0, variant="cdf", sms=132).defines()
    ex2 = []
    for fast in (0, 1):
        ptx = cbuild.compile_ptx(src, name="sampler.cu", defines=d | {"CDF_FAST_EXP": fast},
                                 arch="compute_90")  # fmt: skip
        ex2.append(ptx.count("ex2.approx"))
    assert ex2[1] > ex2[0]
