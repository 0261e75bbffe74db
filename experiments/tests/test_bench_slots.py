"""experiments/bench_slots.py --small on CPU: both paths give the same tokens, JSON is written."""

import json


def test_bench_slots_small_smoke(tmp_path):
    from experiments import bench_slots

    out = tmp_path / "slots.json"
    result = bench_slots.main(["--small", "--quant", "bf16", "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == json.loads(json.dumps(result["runs"]))
    (run,) = result["runs"]
    assert run["tokens"]["all_identical"], run["tokens"]
    lengths = result["forced_lengths"]
    assert run["slots"]["tokens"] == lengths["total"] == run["slots"]["live_row_steps"]
    # static batches step every row until the batch's longest ends: more steps than the slots
    assert run["slots"]["steps"] < run["static"]["steps"]
    assert 0.5 < run["slots"]["occupancy"] <= 1
