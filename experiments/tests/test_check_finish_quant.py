"""experiments/kernels/check_finish_quant.py without a GPU: the kernels it compares build with
NVRTC for both pairs (the producer's production K split, each chunking), a producer that does
not split K is skipped, and bad flags fail before any work."""

from __future__ import annotations

import pytest

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_quant
from experiments.kernels import check_finish_quant as cfq


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_kernels_build_for_both_pairs(tmp_path, monkeypatch):
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    o_gu, gu_down, down_qkv = cfq.PAIRS
    ks = cfq.kernels(32, down_qkv, ("row",), arch="compute_90")
    assert ks["finish"].plan.splitk == 8 and ks["fin_row"].chunk == 4096
    ks = cfq.kernels(32, o_gu, ("row", "1024", "768"), arch="compute_90")
    assert ks["finish"].plan.splitk == 8 and ks["finish"].plan.residual
    assert sorted(ks) == ["fin_1024", "fin_row", "finish", "quant"]  # 768 does not divide K
    assert ks["fin_row"].chunk == 4096 and ks["fin_1024"].chunk == 1024
    assert ks["fin_row"].threads == ks["fin_1024"].threads == ks["quant"].threads == 128
    assert ks["fin_row"].entry == nvfp4_quant.FIN_ENTRY and ks["fin_row"].finish.store_y
    ks = cfq.kernels(32, o_gu, ("c1024", "c512", "c2048", "c256"), arch="compute_90")
    # a cluster of 4 or 8 CTAs a row (2048: 2, also one); 256 would make 16, more than 8
    assert sorted(ks) == ["fin_c1024", "fin_c2048", "fin_c512", "finish", "quant"]
    assert ks["fin_c512"].finish.cluster and ks["fin_c512"].chunk == 512
    assert sorted(cfq.kernels(32, gu_down, ("c1024",), arch="compute_90")) == ["finish", "quant"]
    ks = cfq.kernels(32, gu_down, ("row",), arch="compute_90")
    assert ks["fin_row"].chunk == 12288 and not ks["fin_row"].finish.residual
    assert ks["fin_row"].finish.splitk == ks["finish"].plan.splitk == 2
    assert sorted(cfq.kernels(16, gu_down, ("row",), arch="compute_90")) == ["finish"]


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_rope_kernels_build(tmp_path, monkeypatch):
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    ks = cfq.rope_kernels(16, arch="compute_90")
    assert ks["rope_fin"].finish.splitk == ks["finish"].plan.splitk == 4
    assert (ks["rope"].n_inputs, ks["rope_fin"].n_inputs) == (9, 11)
    assert ks["rope"].grid == ks["rope_fin"].grid == 16 * 48 // 4


def test_bad_flags_fail_first(tmp_path):
    with pytest.raises(SystemExit, match="--chunks: '100'"):
        cfq.main(["--out", str(tmp_path / "x.json"), "--chunks", "row,100"])
    with pytest.raises(SystemExit, match="--chunks: 'cx'"):
        cfq.main(["--out", str(tmp_path / "x.json"), "--chunks", "c1024,cx"])
    with pytest.raises(SystemExit, match="--ms"):
        cfq.main(["--out", str(tmp_path / "x.json"), "--ms", "8,x"])
