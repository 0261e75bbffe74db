"""The trace reader of experiments/profile_step.py, on a synthetic CUPTI-style trace."""

from __future__ import annotations

import gzip
import importlib.util
import json
import pathlib
import sys

import pytest

_DIR = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("profile_step", _DIR / "profile_step.py")
ps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ps)


def _trace(steps: int) -> dict:
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "XLA Ops"}},
    ]
    events, t = [], 0.0
    for _ in range(steps):  # per step: two layers of (GEMV 10 us, fusion 2 us), lm_head 30 us
        for name, dur in [("nvfp4_gemv_w4a4", 10), ("loop_add_fusion", 2)] * 2 + [
            ("gemm_fusion_dot_4", 30)
        ]:
            events.append({"ph": "X", "pid": 2, "tid": 7, "ts": t, "dur": dur, "name": name})
            # an XLA-op row and a host row over the same time: not kernels, must be ignored
            events.append({"ph": "X", "pid": 2, "tid": 8, "ts": t, "dur": dur, "name": name})
            events.append({"ph": "X", "pid": 1, "tid": 3, "ts": t, "dur": dur, "name": "host"})
            t += dur + 1.0  # 1 us idle after every kernel
    return {"traceEvents": meta + events}


def test_summary_per_step_and_per_layer(tmp_path):
    steps, layers = 4, 2
    path = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump(_trace(steps), f)
    events = ps.kernel_events(ps.load_trace(str(tmp_path)))
    assert len(events) == 5 * steps  # stream kernels only
    s = ps.summarise(events, steps, layers)
    assert s["launches_per_step"] == 5
    assert s["busy_us_per_step"] == pytest.approx(54.0)
    # 54 us of kernels and 5 idle gaps of 1 us per step; the last gap is past the last kernel
    assert s["span_us_per_step"] == pytest.approx((steps * 59 - 1) / steps)
    assert s["classes"]["nvfp4_gemv"]["per_layer"] == 1.0
    assert s["classes"]["nvfp4_gemv"]["us_per_layer"] == pytest.approx(10.0)
    assert s["classes"]["xla_fusion"]["us_per_step"] == pytest.approx(4.0)
    assert s["classes"]["cublas"]["per_step"] == 1.0
    assert s["top"][0]["name"] == "gemm_fusion_dot_4"  # largest time per step first
    assert 0 < s["idle_fraction"] < 0.1
    # the gaps: per step 4 in-step gaps of 1 us, one per (before, after) pair, plus the gap
    # into the next step's first kernel (steps - 1 of them over the run)
    g = {(r["before"], r["after"]): r for r in s["gaps"]}
    assert g[("nvfp4_gemv_w4a4", "loop_add_fusion")]["per_step"] == 2.0
    assert g[("nvfp4_gemv_w4a4", "loop_add_fusion")]["idle_us_per_step"] == pytest.approx(2.0)
    assert g[("loop_add_fusion", "gemm_fusion_dot_4")]["idle_us_per_step"] == pytest.approx(1.0)
    assert g[("gemm_fusion_dot_4", "nvfp4_gemv_w4a4")]["per_step"] == pytest.approx(0.75)
    assert sum(r["idle_us_per_step"] for r in s["gaps"]) == pytest.approx(
        s["span_us_per_step"] - s["busy_us_per_step"]
    )


def test_variant_specs():
    assert ps.parse_variant("nvfp4:8:gemm_min_m=8:attention=live") == (
        "nvfp4",
        8,
        {"gemm_min_m": 8, "attention": "live"},
    )
    for bad in ("nvfp4", "fp16:1", "bf16:1:not_a_field=3"):
        with pytest.raises(SystemExit):
            ps.parse_variant(bad)
    assert ps.classify("nvfp4_quantize_bf16") == "nvfp4_gemv"
    assert ps.classify("rejax_decode_attention_partials") == "attention"
    assert ps.classify("nvfp4_gemm_finish") == "nvfp4_gemm"
    assert ps.classify("nvfp4_dequant_bf16") == "nvfp4_dequant"


def test_variant_optional_int_fields():
    """gemm_max_m / gemm_wgmma_min_m / gemm_wgmma_max_m take an int or 'none' (Config's None);
    the wgmma bounds also 'default'."""
    assert ps.parse_variant("nvfp4:1:gemm_max_m=512:gemm_wgmma_min_m=none") == (
        "nvfp4",
        1,
        {"gemm_max_m": 512, "gemm_wgmma_min_m": None},
    )
    assert ps.parse_variant("nvfp4:8:gemm_max_m=none") == ("nvfp4", 8, {"gemm_max_m": None})
    assert ps.parse_variant("nvfp4:8:gemm_wgmma_max_m=none:gemm_wgmma_min_m=default") == (
        "nvfp4",
        8,
        {"gemm_wgmma_max_m": None, "gemm_wgmma_min_m": "default"},
    )
    assert ps.parse_variant("nvfp4:8:gemm_wgmma_max_m=None") == (
        "nvfp4",
        8,
        {"gemm_wgmma_max_m": None},
    )
    with pytest.raises(SystemExit, match="gemm_max_m takes an int, got 'big'"):
        ps.parse_variant("nvfp4:8:gemm_max_m=big")
    with pytest.raises(SystemExit, match="gemm_max_m takes an int"):
        ps.parse_variant("nvfp4:8:gemm_max_m=default")


def test_variant_int_fields():
    """Any int Config field (e.g. gemm_wgmma_raster) is parsed to an int, so Config's checks
    see the value the user meant; a non-int names the field."""
    assert ps.parse_variant("nvfp4:8:gemm_wgmma_max_m=none:gemm_wgmma_raster=4") == (
        "nvfp4",
        8,
        {"gemm_wgmma_max_m": None, "gemm_wgmma_raster": 4},
    )
    with pytest.raises(SystemExit, match="gemm_wgmma_raster takes an int, got 'four'"):
        ps.parse_variant("nvfp4:8:gemm_wgmma_raster=four")


def test_prefill_phase_smoke(tmp_path):
    """--phase prefill on the tiny CPU config: one result a variant, labelled, no error."""
    out = tmp_path / "p.json"
    args = ["--tiny", "--phase", "prefill", "--steps", "2", "--variant", "nvfp4:1", "--out"]
    assert ps.main([*args, str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert "error" not in r, r
    assert r["phase"] == "prefill" and r["prefill_ms_bench"] > 0


def test_missing_trace_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="no trace file"):
        ps.load_trace(str(tmp_path))


def test_parse_variant_takes_a_sampler():
    """`sampler=NAME` picks the loop's sampler from bench_decode's SAMPLERS; other keys must be
    Config fields; an unknown sampler is refused with the names it could be."""
    assert ps.parse_variant("nvfp4:1:sampler=temp") == ("nvfp4", 1, {"sampler": "temp"})
    assert ps.parse_variant("bf16:64:gemm_min_m=8") == ("bf16", 64, {"gemm_min_m": 8})
    assert ps.parse_variant("bf16:64:xla_autotune=off") == ("bf16", 64, {"xla_autotune": False})
    with pytest.raises(SystemExit, match="xla_autotune takes one of"):
        ps.parse_variant("bf16:64:xla_autotune=maybe")
    with pytest.raises(SystemExit, match="sampler 'hot'"):
        ps.parse_variant("nvfp4:1:sampler=hot")
    with pytest.raises(SystemExit, match="not a Config field"):
        ps.parse_variant("nvfp4:1:samplr=temp")


def test_trace_path_keeps_a_repeated_variants_trace(tmp_path):
    # `--variant X --variant Y --variant X`: the second X must not overwrite the first
    spec = "nvfp4:1:sampler=greedy"
    first = ps.trace_path(str(tmp_path), spec)
    assert pathlib.Path(first).name == "nvfp4_1_sampler-greedy.trace.json.gz"
    pathlib.Path(first).write_text("a")
    second = ps.trace_path(str(tmp_path), spec)
    assert pathlib.Path(second).name == "nvfp4_1_sampler-greedy.2.trace.json.gz"
    pathlib.Path(second).write_text("b")
    assert pathlib.Path(ps.trace_path(str(tmp_path), spec)).name.endswith(".3.trace.json.gz")
    assert ps.trace_path(str(tmp_path), "bf16:1").endswith("bf16_1.trace.json.gz")
