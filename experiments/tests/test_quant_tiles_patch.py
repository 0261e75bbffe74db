"""experiments/kernels/quant_tiles_rows_inner.patch (the "xhat_tiles" quantizer's row
statistics with the 8 rows as the inner loop; not yet run on a GPU): it still applies to the
tree's cuda_ops/nvfp4_gemv.cu, and the patched source builds the tiles form for sm_90 without
a stack frame or spills."""

import pathlib
import shutil
import subprocess

import pytest

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemv, nvfp4_quant

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCH = ROOT / "experiments" / "kernels" / "quant_tiles_rows_inner.patch"


def _patched(tmp_path) -> str:
    (tmp_path / "cuda_ops").mkdir()
    shutil.copy(ROOT / "cuda_ops" / "nvfp4_gemv.cu", tmp_path / "cuda_ops" / "nvfp4_gemv.cu")
    r = subprocess.run(["git", "apply", str(PATCH)], cwd=tmp_path, capture_output=True,
                       text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return (tmp_path / "cuda_ops" / "nvfp4_gemv.cu").read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_patch_applies_and_turns_the_loops(tmp_path):
    before = (ROOT / "cuda_ops" / "nvfp4_gemv.cu").read_text()
    after = _patched(tmp_path)
    assert after != before and "The rows are\n  // the inner loop" in after


@pytest.mark.skipif(
    shutil.which("git") is None or not cbuild.nvrtc_available(), reason="needs git and NVRTC"
)
@pytest.mark.parametrize("prologue", ["rmsnorm", "swiglu"])
def test_the_patched_tiles_form_builds(tmp_path, prologue):
    source = _patched(tmp_path)
    fused = nvfp4_gemv.Fused(prologue=prologue, dynamic=True, norm_stacked=True)
    defines = (
        nvfp4_quant._GEMV_DUMMIES
        | fused.defines()
        | {"K_IN": 4096, "NTHREADS": 128, "QUANT_ONLY": 1, "QCHUNK": 512}
        | {"XHAT_OUT": 2, "XHAT_TM": 128, "XHAT_M": 300, "M_TOK": 8}
    )
    log = cbuild.ptxas_log(source, defines, arch="sm_90", name=nvfp4_gemv.SOURCE)
    assert "0 bytes stack frame" in log and "0 bytes spill stores" in log, log
