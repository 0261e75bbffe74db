"""experiments/bench_slots.py --small on CPU: all three paths give the same tokens, the step
model matches the driver, JSON is written."""

import json

import numpy as np


def test_bench_slots_small_smoke(tmp_path):
    from experiments import bench_slots

    out = tmp_path / "slots.json"
    # 4 slots: "auto" compaction (down to 16 rows) would not compact, so the sizes are given
    argv = ["--small", "--quant", "bf16", "--out", str(out), "--time-budget", "1000",
            "--compact-sizes", "2", "1"]  # fmt: skip
    result = bench_slots.main(argv)
    assert json.loads(out.read_text())["runs"] == json.loads(json.dumps(result["runs"]))
    (run,) = result["runs"]
    lengths = result["forced_lengths"]
    assert result["length_scale"] == 1.0  # a generous budget keeps the lengths
    pred = run["time_budget"]["predicted"]
    for name in ("refill", "compact"):
        r = run[name]
        assert r["vs_static"]["all_identical"], (name, r["vs_static"])
        assert r["vs_static"]["rows_identical"] == result["rows"] == 12
        assert r["tokens_per_s"] > 0 and r["wall_ratio_vs_static"] > 0
        assert r["live_row_steps"] == r["tokens"] == lengths["total"]
        # the host model of the schedule is the driver's schedule, step for step
        assert r["steps_by_size"] == r["modelled_steps_by_size"] == pred[name]["steps_by_size"]
        # static batches step every row until the batch's longest ends: more steps
        assert r["steps"] < run["static"]["steps"] == pred["static"]["steps_by_size"][4]
    assert list(run["refill"]["steps_by_size"]) == [4]
    assert list(run["compact"]["steps_by_size"]) == [4, 2, 1]
    assert run["compact"]["occupancy"] > run["refill"]["occupancy"] > 0.5
    assert run["compact"]["row_occupancy"] > run["refill"]["row_occupancy"]


def test_schedule_model_hand_case():
    from experiments.bench_slots import schedule

    # 3 slots, one row per refill: step 1 ends row 0 (row 3 takes its slot), steps 2-3 until
    # one row is left, then row 3's last 6 steps at size 1 (tests/test_slots.py, the same case)
    assert schedule(np.array([1, 2, 3, 8]), 3, 1, 256, (3, 1)) == {3: 3, 1: 6}
    assert schedule(np.array([1, 2, 3, 8]), 3, 1, 256, (3,)) == {3: 9}
    assert schedule(np.array([5, 5]), 4, 1, 2, (4, 2, 1)) == {2: 5}  # compacted before a step


def test_bench_slots_compact_sizes_and_one_prefill(tmp_path):
    """--compact-sizes 2 drains through 4 and 2 rows only (the model agrees); --static-prefill
    one (a prefill per static batch) keeps every row's tokens on the CPU; a size outside
    [1, slots) is refused before anything compiles."""
    import pytest

    from experiments import bench_slots

    base = ["--small", "--quant", "bf16", "--time-budget", "1000"]
    result = bench_slots.main(
        [*base, "--compact-sizes", "2", "--static-prefill", "one", "--out", str(tmp_path / "a")]
    )
    (run,) = result["runs"]
    assert list(run["compact"]["steps_by_size"]) == [4, 2]
    assert run["compact"]["steps_by_size"] == run["compact"]["modelled_steps_by_size"]
    assert run["refill"]["vs_static"]["all_identical"]
    assert run["compact"]["vs_static"]["all_identical"]
    with pytest.raises(SystemExit, match="--compact-sizes"):
        bench_slots.main([*base, "--compact-sizes", "4", "--out", str(tmp_path / "b")])
