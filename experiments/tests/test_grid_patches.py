"""experiments/kernels/grid_patches_run.sh and the grid sampler patches it applies (they lost in
the thirty-third session): the patches still apply, in order, to cuda_ops/sampler.cu as it was
at BASE (the last commit before the grid sweeps' loads ahead landed, which they predate), and
the script refuses bad arguments before it touches anything."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "experiments" / "kernels"
PATCHES = ["sampler_grid_word_skip", "sampler_grid_mass_bounds", "sampler_grid_sums_t1"]
BASE = "cf59efc"  # grid_patches_run.sh's BASE


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_script_names_the_same_base():
    assert f"BASE={BASE}" in (KERNELS / "grid_patches_run.sh").read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_patches_apply_in_order(tmp_path):
    (tmp_path / "cuda_ops").mkdir()
    r = subprocess.run(["git", "show", f"{BASE}:cuda_ops/sampler.cu"], cwd=ROOT,
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"no git history with {BASE}: {r.stderr.strip()}")
    (tmp_path / "cuda_ops" / "sampler.cu").write_text(r.stdout)
    before = (tmp_path / "cuda_ops" / "sampler.cu").read_text()
    for name in PATCHES:
        cmd = ["git", "apply", str(KERNELS / f"{name}.patch")]
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False)
        assert r.returncode == 0, f"{name}.patch: {r.stderr}"
    after = (tmp_path / "cuda_ops" / "sampler.cu").read_text()
    assert after != before and "keep_bounds" in after and "chunk_sums<" in after


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    "argv", [[], ["out"], ["out", "bogus"], ["-n", "4", "out", "tests"], ["-n"]]
)
def test_the_script_refuses_bad_arguments(tmp_path, argv):
    cmd = ["bash", str(KERNELS / "grid_patches_run.sh"), *argv]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stderr, r
    assert not (tmp_path / "out").exists()
