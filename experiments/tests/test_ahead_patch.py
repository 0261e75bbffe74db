"""experiments/kernels/sampler_grid_ahead.patch, sampler_draws_dump.py and ahead_patch_run.sh
without a GPU: the patch applies to the tree's sampler.cu and its grid builds keep their
occupancy with AHEAD 1 and 2; the dump's comparison names what differs; the script refuses bad
arguments before it touches anything."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

from cuda_ops import sampler as kernels
from experiments.kernels import sampler_draws_dump as dd

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "experiments" / "kernels"


def _patched(tmp_path) -> str:
    (tmp_path / "cuda_ops").mkdir()
    shutil.copy(ROOT / "cuda_ops" / "sampler.cu", tmp_path / "cuda_ops" / "sampler.cu")
    r = subprocess.run(["git", "apply", str(KERNELS / "sampler_grid_ahead.patch")], cwd=tmp_path,
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return (tmp_path / "cuda_ops" / "sampler.cu").read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_patch_applies_and_every_sweep_loads_ahead(tmp_path):
    src = _patched(tmp_path)
    assert src.count("nx.start(") == 4 and src.count("nx.next(") == 4


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize(
    "variant,b,bf16", [("cdf", 64, True), ("cdf", 64, False), ("grid", 1, True)]
)
def test_the_patched_grid_builds_keep_their_occupancy(tmp_path, ahead, variant, b, bf16):
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops.build import ptxas_log

    src = _patched(tmp_path)
    p = kernels.plan(b, 151936, 0, variant=variant, bf16=bf16)
    log = ptxas_log(src, p.defines() | {"AHEAD": ahead}, name="sampler.cu")
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    assert len(regs) == 1 and regs[0] * kernels.GRID_THREADS * kernels.GRID_CTAS_PER_SM <= 65536
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log


def test_compare_names_every_difference():
    a = {"x/tokens": np.array([1, 2, 3]), "x/entropy": np.array([0.5, np.nan]), "y": np.zeros(2)}
    same = {k: v.copy() for k, v in a.items()}
    assert dd.compare(a, same) == []  # NaNs compare equal
    b = dict(same, **{"x/tokens": np.array([1, 2, 4])})
    del b["y"]
    b["z"] = np.zeros(1)
    assert dd.compare(a, b) == ["y", "z", "x/tokens"]
    assert dd.compare(a, dict(same, y=np.zeros(3))) == ["y"]


def test_compare_cli_exits_1_on_a_difference(tmp_path, capsys):
    np.savez(tmp_path / "a.npz", t=np.array([1, 2]))
    np.savez(tmp_path / "b.npz", t=np.array([1, 3]))
    assert dd.main(["--compare", str(tmp_path / "a.npz"), str(tmp_path / "a.npz")]) == 0
    assert dd.main(["--compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")]) == 1
    assert "1 differ" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [[], ["--out", "a.npz", "--compare", "a", "b"], ["--out", "a.npz", "--steps", "0"],
             ["--out", "a.npz", "--batch", "65"]],
)  # fmt: skip
def test_dump_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        dd.main(argv)
    assert e.value.code == 2


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("argv", [[], ["out"], ["out", "bogus"], ["out", "same", "nope"]])
def test_the_script_refuses_bad_arguments(tmp_path, argv):
    cmd = ["bash", str(KERNELS / "ahead_patch_run.sh"), *argv]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stderr, r
    assert not (tmp_path / "out").exists()
