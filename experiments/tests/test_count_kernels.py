"""The kernel-launch counter of experiments/count_kernels.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parents[1] / "count_kernels.py"
_spec = importlib.util.spec_from_file_location("count_kernels", _PATH)
ck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ck)

HLO = """HloModule m

%fused_a (x: bf16[4]) -> bf16[4] {
  %x = bf16[4] parameter(0)
  %m = bf16[4] multiply(%x, %x)
  ROOT %n = bf16[4] negate(%m)
}

%body.7 (p: (s32[], bf16[4])) -> (s32[], bf16[4]) {
  %p = (s32[], bf16[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[4] get-tuple-element(%p), index=1
  %c = s32[] constant(1)
  %f1 = bf16[4] fusion(%x), kind=kLoop, calls=%fused_a
  %g = bf16[4] custom-call(%f1), custom_call_target="__gpu$xla.gpu.ptx", backend_config={name = \\"nvfp4_gemv_w4a4\\"}
  %b = bf16[2,2] bitcast(%g)
  %f2 = s32[] fusion(%i, %c), kind=kLoop, calls=%fused_b
  ROOT %t = (s32[], bf16[4]) tuple(%f2, %g)
}

%cond.8 (p: (s32[], bf16[4])) -> pred[] {
  %p = (s32[], bf16[4]) parameter(0)
  ROOT %lt = pred[] fusion(%p), kind=kLoop, calls=%fused_c
}

ENTRY %main (a: bf16[4]) -> bf16[4] {
  %a = bf16[4] parameter(0)
  %w = (s32[], bf16[4]) while(%init), condition=%cond.8, body=%body.7, backend_config={"known_trip_count":{"n":"3"}}
  %other = (s32[], bf16[4]) while(%init), condition=%cond.8, body=%cond.8, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = bf16[4] get-tuple-element(%w), index=1
}
"""


def test_counts_the_layer_body_launches_only():
    c = ck.count_launches(HLO, 3)
    assert c["total"] == 3
    assert c["by_kind"] == {"custom-call:__gpu$xla.gpu.ptx:nvfp4_gemv_w4a4": 1, "fusion": 2}
    # each launch in program order, a fusion with the ops of the computation it calls
    assert [(x["name"], x["kind"]) for x in c["launches"]] == [
        ("f1", "fusion"),
        ("g", "custom-call:__gpu$xla.gpu.ptx:nvfp4_gemv_w4a4"),
        ("f2", "fusion"),
    ]
    assert c["launches"][0]["ops"] == {"multiply": 1, "negate": 1}
    assert c["launches"][2]["ops"] == {}  # fused_b is not in the text


def test_a_missing_layer_loop_is_an_error():
    with pytest.raises(ValueError, match="known_trip_count 4"):
        ck.count_launches(HLO, 4)


def test_compiled_tiny_decode_step_is_counted():
    cfg = dataclasses.replace(ck.TINY, linear_fusion="unfused")
    c = ck.count_launches(ck.compiled_decode_step(cfg, 1, 16), cfg.num_layers)
    assert c["total"] > 4 and sum(c["by_kind"].values()) == c["total"]


def test_rows_per_nvfp4_output_choice(tmp_path):
    """--attention-output / --gate-up-output: one row per value, labelled, with static scales
    by default (the kernels that write NVFP4 inputs need them). Compiled on CPU the program is
    the reference composition either way, so the totals agree there; the launches they save
    show in a CUDA build (tests/test_attention_nvfp4.py and tests/test_gate_up_swiglu.py count
    the CUDA lowering's custom calls)."""
    out = ck.main([
        "--tiny", "--batch", "3", "--attention", "flash", "--linear-fusion", "split",
        "--attention-output", "bf16", "nvfp4", "--gate-up-output", "nvfp4",
        "--out", str(tmp_path / "c.json"),
    ])  # fmt: skip
    got = [(r["attention_output"], r["gate_up_output"], r["batch"]) for r in out["rows"]]
    assert got == [("bf16", "nvfp4", 3), ("nvfp4", "nvfp4", 3)]
    assert out["scales"] == "static" and out["rows"][0]["total"] == out["rows"][1]["total"]
    with pytest.raises(SystemExit):
        ck.main(["--tiny", "--gate-up-output", "fp4", "--out", str(tmp_path / "x.json")])


def test_rows_per_gemm_chain(tmp_path):
    """--gemm-chain: one row per value, labelled (on CPU the same reference program: the
    launches it saves show in a CUDA build, tests/test_fused_block.py)."""
    out = ck.main(["--tiny", "--batch", "8", "--linear-fusion", "split", "--gemm-chain", "split",
                   "fused", "--out", str(tmp_path / "c.json")])  # fmt: skip
    assert [(r["gemm_chain"], r["batch"]) for r in out["rows"]] == [("split", 8), ("fused", 8)]
    with pytest.raises(SystemExit):
        ck.main(["--tiny", "--gemm-chain", "one", "--out", str(tmp_path / "x.json")])
