"""experiments/pdl_probe.py without a GPU: the PDL builds of the GEMV source (where the trigger
and the wait go, that every entry gets them, that they compile for sm_90 and leave the
production source alone) and argument checks. The timing itself needs the H200."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemv

_PATH = pathlib.Path(__file__).parents[1] / "pdl_probe.py"
_spec = importlib.util.spec_from_file_location("pdl_probe", _PATH)
pp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pp)

SOURCE = nvfp4_gemv.read_source(nvfp4_gemv.SOURCE)


def test_pdl_source_places_the_trigger_and_the_wait():
    entries = SOURCE.count(pp._ENTRY)
    assert entries >= 6 and pp._TRIGGER not in SOURCE and pp._WAIT not in SOURCE
    start = pp.pdl_source(SOURCE, "pdl-start")
    assert start.count(pp._TRIGGER) == entries and start.count(pp._WAIT) == entries
    # every entry waits before it reads its layer index (the first device read)
    for part in start.split(pp._ENTRY)[:-1]:
        assert part.rstrip().endswith(pp._WAIT)
    weights = pp.pdl_source(SOURCE, "pdl-weights")
    assert weights.count(pp._TRIGGER) == entries
    waits = SOURCE.count(pp._PERSISTENT_STAGE) + SOURCE.count(pp._STREAM_LOADS)
    assert weights.count(pp._WAIT) == waits
    # the streaming kernel waits after its weight loads, before its x loads
    assert pp._STREAM_LOADS + f"  {pp._WAIT}\n" in weights


def test_pdl_source_refuses_a_bad_mode_or_a_changed_source():
    with pytest.raises(ValueError, match="mode='plain'"):
        pp.pdl_source(SOURCE, "plain")
    with pytest.raises(ValueError, match="anchor"):
        pp.pdl_source(SOURCE.replace(pp._PERSISTENT_STAGE, "  run();\n"), "pdl-weights")


@pytest.mark.skipif(not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed")
@pytest.mark.parametrize("mode", ["pdl-start", "pdl-weights"])
def test_pdl_builds_compile_for_sm90(mode, tmp_path, monkeypatch):
    """Both kernel kinds the probe launches (streamed qkv, persistent gate_up at M = 1) compile
    with one trigger and one wait each; the production build has neither."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "gemv.cu"
    path.write_text(pp.pdl_source(SOURCE, mode))
    options = nvfp4_gemv.GemvOptions(source=str(path))
    for n, k, variant in ((6144, 4096, "stream"), (24576, 4096, "persistent")):
        kern = nvfp4_gemv.build("w4a4", 1, n, k, arch="compute_90", num_sms=132, options=options)
        assert kern.plan.variant == variant
        assert kern.ptx.count("griddepcontrol.wait") == 1
        assert kern.ptx.count("griddepcontrol.launch_dependents") == 1
        plain = nvfp4_gemv.build("w4a4", 1, n, k, arch="compute_90", num_sms=132)
        assert "griddepcontrol" not in plain.ptx


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit):
        pp.main(["--m", "9", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
