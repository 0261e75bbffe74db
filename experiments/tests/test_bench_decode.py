"""experiments/bench_decode.py: the variants one process runs (several --command-buffer and
--gemm-occupancy values on the same weights) and a bad value refused by argparse."""

import argparse
import dataclasses
import json

import numpy as np
import pytest

from experiments import bench_decode as bd
from rejax import config as rconfig


def _args(**kw):
    base = {
        "xla_autotune": ["on"],
        "attention": [rconfig.Config.attention],
        "command_buffer": ["default"],
        "head": ["bf16"],
        "weight_prefetch": ["none"],
        "gemm_occupancy": [rconfig.Config.gemm_occupancy],
        "linear_fusion": [rconfig.Config.linear_fusion],
        "attention_output": [rconfig.Config.attention_output],
        "gate_up_output": [rconfig.Config.gate_up_output],
        "o_proj_output": [rconfig.Config.o_proj_output],
        "gemm_chain": [rconfig.Config.gemm_chain],
        "gemm_wgmma_min_m": [rconfig.Config.gemm_wgmma_min_m],
        "gemm_wgmma_max_m": [rconfig.Config.gemm_wgmma_max_m],
        "gemm_wgmma_raster": [rconfig.Config.gemm_wgmma_raster],
        "gemm_dot_dequant": [rconfig.Config.gemm_dot_dequant],
        "gemm_dot_stream": [rconfig.Config.gemm_dot_stream],
        "gemm_dot_finish": [rconfig.Config.gemm_dot_finish],
        "decode_unroll": [rconfig.Config.decode_unroll],
        "scan_unroll": [rconfig.Config.scan_unroll],
    }
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def base():
    return bd.random_params(dataclasses.replace(bd.TINY, quant="nvfp4"))


def test_variants_cross_command_buffers_and_gemm_occupancies(base):
    args = _args(command_buffer=["default", "while"], gemm_occupancy=["fill16", "wide"])
    got = [(label, p.cfg.command_buffer, p.cfg.gemm_occupancy) for _, _, label, p in
           bd._variants(base, args, "nvfp4")]  # fmt: skip
    assert got == [
        ("head=bf16 prefetch=none", "default", "fill16"),
        ("head=bf16 prefetch=none occ=wide", "default", "wide"),
        ("head=bf16 prefetch=none cb=while", "while", "fill16"),
        ("head=bf16 prefetch=none cb=while occ=wide", "while", "wide"),
    ]
    # every variant shares the weights; bf16 takes the command buffers but not the occupancy
    assert all(p.weights is base.weights for *_, p in bd._variants(base, args, "nvfp4"))
    bf16 = [(label, p.cfg.command_buffer) for _, _, label, p in bd._variants(base, args, None)]
    assert bf16 == [("bf16", "default"), ("bf16 cb=while", "while")]


def test_variants_cross_decode_and_scan_unrolls(base):
    """--decode-unroll and --scan-unroll: one variant per value (labelled unless Config's
    default), for bf16 and NVFP4 alike, on the same weights."""
    du, su = rconfig.Config.decode_unroll, rconfig.Config.scan_unroll
    args = _args(decode_unroll=[du, 1], scan_unroll=[su, 9])
    got = [(label, p.cfg.decode_unroll, p.cfg.scan_unroll) for _, _, label, p in
           bd._variants(base, args, "nvfp4")]  # fmt: skip
    assert got == [
        ("head=bf16 prefetch=none", du, su),
        ("head=bf16 prefetch=none su=9", du, 9),
        ("head=bf16 prefetch=none du=1", 1, su),
        ("head=bf16 prefetch=none du=1 su=9", 1, 9),
    ]
    assert all(p.weights is base.weights for *_, p in bd._variants(base, args, "nvfp4"))
    bf16 = [label for _, _, label, _ in bd._variants(base, args, None)]
    assert bf16 == ["bf16", "bf16 su=9", "bf16 du=1", "bf16 du=1 su=9"]


def test_variants_cross_linear_fusions(base):
    """--linear-fusion: one NVFP4 variant per value (labelled unless Config's default), in the
    order given, repeats kept (adjacent A/B pairs); bf16 runs once."""
    lf = rconfig.Config.linear_fusion
    args = _args(linear_fusion=[lf, "mixed", lf, "fused"])
    got = [(label, p.cfg.linear_fusion) for _, _, label, p in bd._variants(base, args, "nvfp4")]
    assert got == [
        ("head=bf16 prefetch=none", lf),
        ("head=bf16 prefetch=none lf=mixed", "mixed"),
        ("head=bf16 prefetch=none", lf),
        ("head=bf16 prefetch=none lf=fused", "fused"),
    ]
    assert [label for _, _, label, _ in bd._variants(base, args, None)] == ["bf16"]


def test_variants_cross_gemm_wgmma_min_m(base):
    """--gemm-wgmma-min-m: one NVFP4 variant per value (labelled unless 'default'), innermost;
    --gemm-wgmma-max-m reaches every one (labelled unless 'default'); bf16 runs once; argparse
    takes ints, 'none' and 'default'."""
    args = _args(gemm_wgmma_min_m=["default", None], gemm_occupancy=["fill16", "wide"])
    got = [(label, p.cfg.gemm_wgmma_min_m, p.cfg.gemm_occupancy) for _, _, label, p in
           bd._variants(base, args, "nvfp4")]  # fmt: skip
    assert got == [
        ("head=bf16 prefetch=none", "default", "fill16"),
        ("head=bf16 prefetch=none wg=None", None, "fill16"),
        ("head=bf16 prefetch=none occ=wide", "default", "wide"),
        ("head=bf16 prefetch=none occ=wide wg=None", None, "wide"),
    ]
    assert [label for _, _, label, _ in bd._variants(base, args, None)] == ["bf16"]
    args = _args(gemm_wgmma_min_m=[128], gemm_wgmma_max_m=[None])
    got = [(label, p.cfg.gemm_wgmma_min_m, p.cfg.gemm_wgmma_max_m) for _, _, label, p in
           bd._variants(base, args, "nvfp4")]  # fmt: skip
    assert got == [("head=bf16 prefetch=none wg=128 wgmax=None", 128, None)]
    # several --gemm-wgmma-max-m values: one variant each, in the order given, each once per
    # --gemm-wgmma-raster value (innermost of the two)
    args = _args(gemm_wgmma_max_m=["default", None], gemm_wgmma_raster=[0, 8])
    got = [(label, p.cfg.gemm_wgmma_max_m, p.cfg.gemm_wgmma_raster) for _, _, label, p in
           bd._variants(base, args, "nvfp4")]  # fmt: skip
    assert got == [
        ("head=bf16 prefetch=none", "default", 0),
        ("head=bf16 prefetch=none ras=8", "default", 8),
        ("head=bf16 prefetch=none wgmax=None", None, 0),
        ("head=bf16 prefetch=none wgmax=None ras=8", None, 8),
    ]
    assert bd._raster("8") == 8 and bd._raster("0") == 0
    for bad in ("-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="an int >= 0"):
            bd._raster(bad)
    assert bd._max_m("none") is None and bd._max_m("256") == 256
    assert bd._wgmma_rows("default") == "default" and bd._wgmma_rows("none") is None
    assert bd._wgmma_rows("128") == 128
    with pytest.raises(argparse.ArgumentTypeError, match="an int, 'none' or 'default', got 'x'"):
        bd._wgmma_rows("x")


def test_variants_cross_gemm_dot_dequant(base):
    """--gemm-dot-dequant: one NVFP4 variant per value (labelled unless the default "kernel"),
    innermost; bf16 runs once."""
    args = _args(gemm_dot_dequant=["xla", "kernel"], gemm_wgmma_min_m=["default", 128])
    got = [(label, p.cfg.gemm_dot_dequant, p.cfg.gemm_wgmma_min_m) for _, _, label, p in
           bd._variants(base, args, "nvfp4")]  # fmt: skip
    assert got == [
        ("head=bf16 prefetch=none dq=xla", "xla", "default"),
        ("head=bf16 prefetch=none", "kernel", "default"),
        ("head=bf16 prefetch=none wg=128 dq=xla", "xla", 128),
        ("head=bf16 prefetch=none wg=128", "kernel", 128),
    ]
    assert [label for _, _, label, _ in bd._variants(base, args, None)] == ["bf16"]


def test_variants_cross_gemm_dot_stream_and_finish_innermost(base):
    """--gemm-dot-stream x --gemm-dot-finish: one NVFP4 variant per pair (labelled unless the
    defaults "main" / "block"), the finish innermost so its values run adjacent, repeats kept;
    bf16 runs once."""
    assert (rconfig.Config.gemm_dot_stream, rconfig.Config.gemm_dot_finish) == ("main", "block")
    args = _args(gemm_dot_stream=["main", "side"], gemm_dot_finish=["block", "split", "block"])
    got = [(label, p.cfg.gemm_dot_stream, p.cfg.gemm_dot_finish) for _, _, label, p in
           bd._variants(base, args, "nvfp4")]  # fmt: skip
    assert got == [
        ("head=bf16 prefetch=none", "main", "block"),
        ("head=bf16 prefetch=none df=split", "main", "split"),
        ("head=bf16 prefetch=none", "main", "block"),
        ("head=bf16 prefetch=none ds=side", "side", "block"),
        ("head=bf16 prefetch=none ds=side df=split", "side", "split"),
        ("head=bf16 prefetch=none ds=side", "side", "block"),
    ]
    assert all(p.weights is base.weights for *_, p in bd._variants(base, args, "nvfp4"))
    assert [label for _, _, label, _ in bd._variants(base, args, None)] == ["bf16"]


def test_variants_cross_attentions(base):
    """--attention: one variant per value (labelled unless Config's default), for bf16 and
    NVFP4 alike, on the same weights, in the order given."""
    at = rconfig.Config.attention
    args = _args(attention=[at, "flash-mma", at])
    got = [(label, p.cfg.attention) for _, _, label, p in bd._variants(base, args, "nvfp4")]
    assert got == [
        ("head=bf16 prefetch=none", at),
        ("head=bf16 prefetch=none attn=flash-mma", "flash-mma"),
        ("head=bf16 prefetch=none", at),
    ]
    assert all(p.weights is base.weights for *_, p in bd._variants(base, args, "nvfp4"))
    bf16 = [(label, p.cfg.attention) for _, _, label, p in bd._variants(base, args, None)]
    assert bf16 == [("bf16", at), ("bf16 attn=flash-mma", "flash-mma"), ("bf16", at)]


def test_variants_cross_attentions_and_attention_outputs(base):
    """--attention-output: one NVFP4 variant per value, innermost (so "bf16" / "nvfp4" of one
    attention run adjacent), labelled " ao=CHOICE" unless Config's default; bf16 runs once per
    attention."""
    ao = rconfig.Config.attention_output
    args = _args(attention=["flash-mma", "flash"], attention_output=[ao, "nvfp4"])
    got = [(label, p.cfg.attention, p.cfg.attention_output)
           for _, _, label, p in bd._variants(base, args, "nvfp4")]  # fmt: skip
    assert got == [
        ("head=bf16 prefetch=none attn=flash-mma", "flash-mma", ao),
        ("head=bf16 prefetch=none attn=flash-mma ao=nvfp4", "flash-mma", "nvfp4"),
        ("head=bf16 prefetch=none attn=flash", "flash", ao),
        ("head=bf16 prefetch=none attn=flash ao=nvfp4", "flash", "nvfp4"),
    ]
    bf16 = [label for _, _, label, _ in bd._variants(base, args, None)]
    assert bf16 == ["bf16 attn=flash-mma", "bf16 attn=flash"]


def test_variants_cross_gate_up_and_o_proj_outputs_innermost(base):
    """gate_up_output ("nvfp4" by default: the other value labelled), then o_proj_output
    ("bf16" by default) innermost."""
    assert rconfig.Config.gate_up_output == "nvfp4" and rconfig.Config.o_proj_output == "bf16"
    args = _args(attention_output=["bf16", "nvfp4"], gate_up_output=["nvfp4", "bf16"],
                 o_proj_output=["bf16", "nvfp4"])  # fmt: skip
    got = [(label, p.cfg.attention_output, p.cfg.gate_up_output, p.cfg.o_proj_output)
           for _, _, label, p in bd._variants(base, args, "nvfp4")]  # fmt: skip
    pre = "head=bf16 prefetch=none"
    assert got == [
        (pre, "bf16", "nvfp4", "bf16"),
        (f"{pre} oo=nvfp4", "bf16", "nvfp4", "nvfp4"),
        (f"{pre} go=bf16", "bf16", "bf16", "bf16"),
        (f"{pre} go=bf16 oo=nvfp4", "bf16", "bf16", "nvfp4"),
        (f"{pre} ao=nvfp4", "nvfp4", "nvfp4", "bf16"),
        (f"{pre} ao=nvfp4 oo=nvfp4", "nvfp4", "nvfp4", "nvfp4"),
        (f"{pre} ao=nvfp4 go=bf16", "nvfp4", "bf16", "bf16"),
        (f"{pre} ao=nvfp4 go=bf16 oo=nvfp4", "nvfp4", "bf16", "nvfp4"),
    ]


def test_variants_cross_gemm_chain_innermost(base):
    """gemm_chain ("swiglu_rope" by default: "split" labelled ' gc=split') innermost, after
    o_proj_output; bf16 runs once."""
    assert rconfig.Config.gemm_chain == "swiglu_rope"
    args = _args(o_proj_output=["bf16", "nvfp4"], gemm_chain=["swiglu_rope", "split"])
    got = [(label, p.cfg.o_proj_output, p.cfg.gemm_chain)
           for _, _, label, p in bd._variants(base, args, "nvfp4")]  # fmt: skip
    pre = "head=bf16 prefetch=none"
    assert got == [
        (pre, "bf16", "swiglu_rope"),
        (f"{pre} gc=split", "bf16", "split"),
        (f"{pre} oo=nvfp4", "nvfp4", "swiglu_rope"),
        (f"{pre} oo=nvfp4 gc=split", "nvfp4", "split"),
    ]
    assert [label for *_, label, _ in bd._variants(base, args, None)] == ["bf16"]


def test_bad_choices_are_refused_before_any_work(tmp_path):
    for flag, value in (
        ("--linear-fusion", "all"),
        ("--attention", "flash-fast"),
        ("--attention-output", "fp4"),
        ("--gate-up-output", "fp8"),
        ("--o-proj-output", "int4"),
        ("--gemm-occupancy", "full"),
        ("--command-buffer", "graph"),
        ("--decode-unroll", "0"),
        ("--scan-unroll", "x"),
        ("--logits-dtypes", "float16"),
    ):
        with pytest.raises(SystemExit):
            bd.main(["--tiny", flag, value, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_gemv_tma_spec_is_checked_and_installed(tmp_path, monkeypatch):
    # --gemv-tma installs the experiment's GEMV for the process (checked before any work; the
    # install itself is tested in test_gemv_tma.py) and records its options in the JSON
    from experiments.kernels import nvfp4_gemv_tma

    for spec in ("stages=one", "depth=3", "stages=1", "producer=dma"):
        with pytest.raises(SystemExit, match="--gemv-tma"):
            bd.main(["--tiny", "--gemv-tma", spec, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
    seen = []
    monkeypatch.setattr(nvfp4_gemv_tma, "install", lambda **kw: seen.append(kw))
    out = tmp_path / "tma.json"
    bd.main(["--tiny", "--modes", "nvfp4", "--batch", "1", "--repeats", "1", "--no-breakdown",
             "--gemv-tma", "stages=4,producer=lsu", "--out", str(out)])  # fmt: skip
    assert seen == [{"stages": 4, "producer": "lsu"}]
    assert json.loads(out.read_text())["gemv_tma"] == {"stages": 4, "producer": "lsu"}
    assert nvfp4_gemv_tma.parse_options("default") == {}


def test_block_tma_spec_is_checked_and_installed(tmp_path):
    # --block-tma installs the experiment's post-attention block for the process (checked before
    # any work); off CUDA the installed step runs production's composition, so the tiny run
    # completes and records the options
    from rejax import decoder

    for spec in ("stages=one", "warps=8", "stages=1", "producer=dma"):
        with pytest.raises(SystemExit, match="--block-tma"):
            bd.main(["--tiny", "--block-tma", spec, "--out", str(tmp_path / "x.json")])
    for spec in ("a_bf16=1", "stages=1"):  # a_bf16 is the post-attention block's only
        with pytest.raises(SystemExit, match="--qkv-tma"):
            bd.main(["--tiny", "--qkv-tma", spec, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
    import jax

    from experiments.kernels import nvfp4_block_tma

    original, pre_original = decoder._post_attention, decoder._pre_attention
    out = tmp_path / "block.json"
    jax.clear_caches()  # this process may have compiled the tiny step already (JAX keeps it)
    nvfp4_block_tma.TRACES.clear()
    try:
        bd.main(["--tiny", "--modes", "nvfp4", "--batch", "1", "--repeats", "1",
                 "--no-breakdown", "--block-tma", "stages=4", "--qkv-tma", "default",
                 "--out", str(out)])  # fmt: skip
        assert decoder._post_attention is not original
        assert decoder._pre_attention is not pre_original
    finally:
        decoder._post_attention, decoder._pre_attention = original, pre_original
        jax.clear_caches()
    result = json.loads(out.read_text())
    assert result["block_tma"] == {"stages": 4} and result["gemv_tma"] is None
    assert result["qkv_tma"] == {}
    # the decode step took both kernels (the prompt's many tokens took neither)
    traces = result["runs"][0]["block_tma_traces"]
    assert traces["block"] >= 1 and traces["qkv"] >= 1, traces
    assert any("one token of one row" in k for k in traces)


def test_logits_dtypes_time_each_carry(tmp_path):
    # --logits-dtypes head float32: one run per carry and sampler, each recording its dtype
    out = tmp_path / "dtypes.json"
    bd.main(["--tiny", "--modes", "nvfp4", "--batch", "1", "--repeats", "1", "--no-breakdown",
             "--samplers", "greedy", "temp", "--logits-dtypes", "head", "float32",
             "--out", str(out)])  # fmt: skip
    runs = [r for r in json.loads(out.read_text())["runs"] if "error" not in r]
    got = sorted((r["logits_dtype"], r["sampler"]) for r in runs)
    assert got == [("float32", "greedy"), ("float32", "temp"), ("head", "greedy"), ("head", "temp")]


def test_over_greedy_takes_the_greedy_runs_beside_each_run():
    def run(sampler, ms, batch=64, variant="v", dtype="head"):
        return {"mode": "nvfp4", "variant": variant, "batch": batch, "logits_dtype": dtype,
                "sampler": sampler, "ms_per_token": ms}  # fmt: skip

    runs = [run("greedy", 7.0), run("temp", 7.1), run("greedy", 7.02), run("reset", 7.08),
            run("temp", 7.09), run("greedy", 7.04), {"mode": "nvfp4", "error": "x"},
            run("temp", 2.0, batch=1), run("greedy", 1.99, batch=1), run("temp", 5.0, variant="w")]  # fmt: skip
    got = bd.over_greedy(runs)
    assert got.keys() == {"v b64 head temp", "v b64 head reset", "v b1 head temp"}
    np.testing.assert_allclose(got["v b64 head temp"], [90.0, 60.0], atol=1e-9)  # 7.01, 7.03
    np.testing.assert_allclose(got["v b64 head reset"], [50.0], atol=1e-9)  # 7.03: 7.02 / 7.04
    np.testing.assert_allclose(got["v b1 head temp"], [10.0], atol=1e-9)  # the greedy after it
    assert runs[1]["over_greedy_us"] == pytest.approx(90.0) and "over_greedy_us" not in runs[-1]


def test_alternated_samplers_report_over_greedy(tmp_path):
    out = tmp_path / "alt.json"
    bd.main(["--tiny", "--modes", "nvfp4", "--batch", "1", "--repeats", "1", "--no-breakdown",
             "--samplers", "greedy", "temp", "greedy", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert [r["sampler"] for r in result["runs"]] == ["greedy", "temp", "greedy"]
    ((name, us),) = result["over_greedy_us"].items()
    assert name.endswith(" b1 head temp") and len(us) == 1 and np.isfinite(us[0])
