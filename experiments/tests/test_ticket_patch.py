"""experiments/kernels/ticket_acq_rel.patch and ticket_patch_run.sh without a GPU: the patch
applies to the tree; its NORM_OUT GEMV and decode attention builds keep their registers without
spills and trade fence.sc for one acquire-release ticket; the script refuses bad arguments
before it touches anything."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "experiments" / "kernels"
PATCH = KERNELS / "ticket_acq_rel.patch"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_patch_applies_to_the_tree():
    r = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=ROOT, capture_output=True,
                       text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr


def _patched(tmp_path, name) -> str:
    (tmp_path / "cuda_ops").mkdir(exist_ok=True)
    for f in ("nvfp4_gemv.cu", "decode_attention.cu"):
        shutil.copy(ROOT / "cuda_ops" / f, tmp_path / "cuda_ops" / f)
    r = subprocess.run(["git", "apply", str(PATCH)], cwd=tmp_path, capture_output=True,
                       text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return (tmp_path / "cuda_ops" / name).read_text()


def _counts(src, defines, name):
    from cuda_ops.build import compile_ptx, ptxas_log

    log = ptxas_log(src, defines, name=name)
    ptx = compile_ptx(src, name=name, defines=defines, arch="compute_90")
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log
    fences = ptx.count("membar.gl") + ptx.count("fence.sc")
    return regs, fences, ptx.count("atom.acq_rel.gpu")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("m", [1, 4])
def test_the_norm_out_gemv_takes_one_acq_rel_ticket(tmp_path, m):
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops import nvfp4_gemv as g

    p, kw = g._compile_job("w4a4", m, 4096, 4096, "compute_90", 132, g.DEFAULT_OPTIONS, False,
                           None, residual=True, norm_out=g.NormOut())  # fmt: skip
    tree = _counts(kw["source"], p.defines(), g.SOURCE)
    patch = _counts(_patched(tmp_path, g.SOURCE), p.defines(), g.SOURCE)
    assert tree[1] > 0 and tree[2] == 0, tree
    assert patch == (tree[0], 0, 1), (tree, patch)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("mma", [0, 1])
def test_the_attention_combine_takes_one_acq_rel_ticket(tmp_path, mma):
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops import decode_attention as da
    from cuda_ops.build import read_source

    shape = da.flash_shape(1, 36, 1536, 8, 4, 128, options=da.FlashOptions(mma=mma))
    d = da.defines(shape)
    tree = _counts(read_source("decode_attention.cu"), d, "decode_attention.cu")
    patch = _counts(_patched(tmp_path, "decode_attention.cu"), d, "decode_attention.cu")
    assert tree[1] > 0 and tree[2] == 0, tree
    assert patch == (tree[0], 0, 1), (tree, patch)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("argv", [[], ["out"], ["out", "bogus"], ["out", "tests", "nope"]])
def test_the_script_refuses_bad_arguments(tmp_path, argv):
    cmd = ["bash", str(KERNELS / "ticket_patch_run.sh"), *argv]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stderr, r
    assert not (tmp_path / "out").exists()
