"""experiments/ptxas_report.py: the ptxas -v parser, and one offline build (needs NVRTC)."""

import json
import pathlib
import sys

import pytest

from cuda_ops import build as cbuild

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import ptxas_report


def test_summary_reads_registers_and_spills():
    log = (
        "ptxas info    : Compiling entry function 'nvfp4_gemv_w4a4' for 'sm_90'\n"
        "ptxas         .     24 bytes stack frame, 28 bytes spill stores, 32 bytes spill loads\n"
        "ptxas info    : Used 64 registers, used 1 barriers\n"
    )
    assert ptxas_report.summary(log) == {"registers": 64, "spill_stores": 28, "spill_loads": 32}
    assert ptxas_report.summary("nothing") == {
        "registers": None, "spill_stores": None, "spill_loads": None,
    }  # fmt: skip


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
def test_two_ctas_per_sm_fit_in_64_registers(tmp_path, capsys):
    out = tmp_path / "r.json"
    ptxas_report.main(["--m", "1", "8", "--shapes", "4096:12288", "--options", "rows=2,ctas=2",
                       "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["versions"]["git_sha"] and result["nvrtc"]
    rows = result["rows"]
    one, eight = rows
    assert one["ctas"] == 2 and one["grid"] == 2 * 132 and one["registers"] <= 64
    assert "refused" not in one and "refused" in eight  # M = 8's staged x does not fit twice
    assert capsys.readouterr().out.count("\n") == 2
