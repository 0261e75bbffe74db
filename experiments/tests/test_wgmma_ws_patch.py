"""experiments/kernels/wgmma_ws.patch, the warp-specialized wgmma GEMM that lost (WS 1): it
still applies to the tree, and where NVRTC and ptxas are present the patched tree plans and
compiles its TM 128 / 256 kernels without spills or serialized wgmmas, in 384 threads."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCH = ROOT / "experiments" / "kernels" / "wgmma_ws.patch"
FILES = [
    "cuda_ops",
    "experiments/bench_gemm.py",
    "experiments/kernels/check_gemm_wgmma.py",
    "experiments/tests/test_gemm_wgmma.py",
]


def _patched(tmp_path: pathlib.Path) -> pathlib.Path:
    for f in FILES:
        src, dst = ROOT / f, tmp_path / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dst)
    cmd = ["git", "apply", str(PATCH)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    return tmp_path


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_patch_applies(tmp_path):
    tree = _patched(tmp_path)
    cu = (tree / "cuda_ops" / "nvfp4_gemm_wgmma.cu").read_text()
    assert "ws_produce" in cu and "wgmma_ss" in cu
    assert "ws_produce" not in (ROOT / "cuda_ops" / "nvfp4_gemm_wgmma.cu").read_text()


PROBE = """
import json
import cuda_ops.nvfp4_gemm_wgmma as w
out = {}
for tm in (128, 256):
    p = w.plan(512, 24576, 4096, tm=tm, nwg=2, wr=1, bulk=3, ws=1)
    ok, why = w.check_plan(p)
    out[tm] = {"ok": ok, "threads": p.threads, "smem": p.smem, "stages": p.stages,
               "ptx": "m64n%dk16" % tm in w.build_plan(p).ptx, "ptxas": w.ptxas_report(p)}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_patched_kernels_compile(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    if shutil.which("ptxas") is None:
        pytest.skip("needs ptxas")
    tree = _patched(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(tree), REJAX_KERNEL_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=tree, env=env, capture_output=True,
                       text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for tm, v in out.items():
        assert v["ok"] and v["ptx"] and v["threads"] == 384, (tm, v)
        assert v["smem"] <= 227 * 1024 and v["stages"] >= 3, (tm, v)
        rep = v["ptxas"]
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and not rep["serialized"], rep
        assert -(-rep["registers"] // 8) * 8 * 384 <= 65536, rep
