"""experiments/bench_decode.py: the variants one process runs (several --command-buffer and
--gemm-occupancy values on the same weights) and a bad value refused by argparse."""

import argparse
import dataclasses

import pytest

from experiments import bench_decode as bd
from rejax import config as rconfig


def _args(**kw):
    base = {
        "xla_autotune": ["on"],
        "command_buffer": ["default"],
        "head": ["bf16"],
        "weight_prefetch": ["none"],
        "gemm_occupancy": [rconfig.Config.gemm_occupancy],
    }
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def base():
    return bd.random_params(dataclasses.replace(bd.TINY, quant="nvfp4"))


def test_variants_cross_command_buffers_and_gemm_occupancies(base):
    args = _args(command_buffer=["default", "while"], gemm_occupancy=["fill", "wide"])
    got = [(label, p.cfg.command_buffer, p.cfg.gemm_occupancy) for _, _, label, p in
           bd._variants(base, args, "nvfp4")]  # fmt: skip
    assert got == [
        ("head=bf16 prefetch=none", "default", "fill"),
        ("head=bf16 prefetch=none occ=wide", "default", "wide"),
        ("head=bf16 prefetch=none cb=while", "while", "fill"),
        ("head=bf16 prefetch=none cb=while occ=wide", "while", "wide"),
    ]
    # every variant shares the weights; bf16 takes the command buffers but not the occupancy
    assert all(p.weights is base.weights for *_, p in bd._variants(base, args, "nvfp4"))
    bf16 = [(label, p.cfg.command_buffer) for _, _, label, p in bd._variants(base, args, None)]
    assert bf16 == [("bf16", "default"), ("bf16 cb=while", "while")]


def test_bad_choices_are_refused_before_any_work(tmp_path):
    for flag, value in (("--gemm-occupancy", "full"), ("--command-buffer", "graph")):
        with pytest.raises(SystemExit):
            bd.main(["--tiny", flag, value, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
