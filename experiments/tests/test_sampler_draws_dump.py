"""experiments/kernels/sampler_draws_dump.py and the grid sampler's loads ahead without a GPU:
every sweep of cuda_ops/sampler.cu's grid kernel loads ahead, its builds keep their occupancy
with AHEAD 1 (the default) and 2 (experiments/kernels/cdf_defines.py); the dump's comparison
names what differs and refuses bad arguments."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from cuda_ops import sampler as kernels
from experiments.kernels import sampler_draws_dump as dd

ROOT = pathlib.Path(__file__).resolve().parents[2]


SRC = (ROOT / "cuda_ops" / "sampler.cu").read_text()


def test_every_grid_sweep_loads_ahead():
    assert SRC.count("nx.start(") == 4 and SRC.count("nx.next(") == 4


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize(
    "variant,b,bf16", [("cdf", 64, True), ("cdf", 64, False), ("grid", 1, True)]
)
def test_the_grid_builds_keep_their_occupancy(ahead, variant, b, bf16):
    pytest.importorskip("cuda.bindings.nvrtc")
    from cuda_ops.build import ptxas_log

    p = kernels.plan(b, 151936, 0, variant=variant, bf16=bf16)
    log = ptxas_log(SRC, p.defines() | {"AHEAD": ahead}, name="sampler.cu")
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    assert len(regs) == 1 and regs[0] * kernels.GRID_THREADS * kernels.GRID_CTAS_PER_SM <= 65536
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log


def test_compare_names_every_difference():
    a = {"x/tokens": np.array([1, 2, 3]), "x/entropy": np.array([0.5, np.nan]), "y": np.zeros(2)}
    same = {k: v.copy() for k, v in a.items()}
    assert dd.compare(a, same) == []  # NaNs compare equal
    b = dict(same, **{"x/tokens": np.array([1, 2, 4])})
    del b["y"]
    b["z"] = np.zeros(1)
    assert dd.compare(a, b) == ["y", "z", "x/tokens"]
    assert dd.compare(a, dict(same, y=np.zeros(3))) == ["y"]


def test_compare_cli_exits_1_on_a_difference(tmp_path, capsys):
    np.savez(tmp_path / "a.npz", t=np.array([1, 2]))
    np.savez(tmp_path / "b.npz", t=np.array([1, 3]))
    assert dd.main(["--compare", str(tmp_path / "a.npz"), str(tmp_path / "a.npz")]) == 0
    assert dd.main(["--compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")]) == 1
    assert "1 differ" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [[], ["--out", "a.npz", "--compare", "a", "b"], ["--out", "a.npz", "--steps", "0"],
             ["--out", "a.npz", "--batch", "65"]],
)  # fmt: skip
def test_dump_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        dd.main(argv)
    assert e.value.code == 2
