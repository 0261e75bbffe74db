"""experiments/kernels/sampler_fold_step.patch and fold_step_run.sh without a GPU: the patch
applies to the tree, and the script refuses bad arguments before it touches anything."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "experiments" / "kernels"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_patch_applies_to_the_tree():
    r = subprocess.run(["git", "apply", "--check", str(KERNELS / "sampler_fold_step.patch")],
                       cwd=ROOT, capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("argv", [[], ["out"], ["out", "bogus"], ["out", "tests", "nope"]])
def test_the_script_refuses_bad_arguments(tmp_path, argv):
    cmd = ["bash", str(KERNELS / "fold_step_run.sh"), *argv]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stderr, r
    assert not (tmp_path / "out").exists()
