"""experiments/bench_decode_long.py: the step-time integration by hand, and a CPU smoke run of
the tiny config (bf16 and NVFP4 rows, batch 1) that writes the JSON."""

import json

import numpy as np
import pytest

from experiments import bench_decode_long as bdl
from rejax.cache import init_cache
from rejax.config import Config


def test_total_decode_s_sums_every_step():
    # ms = 1 + live / 100 at the measured points: linear, so the interpolated sum is exact.
    # Step t of a 20-token output after a 10-token prompt reads 11 + t slots.
    curve = [{"mean_live": x, "ms_per_step": 1 + x / 100} for x in (5.0, 40.0, 12.0)]
    want = sum(1 + (11 + t) / 100 for t in range(20)) / 1e3
    assert bdl.total_decode_s(curve, 10, 20) == pytest.approx(want, rel=1e-12)
    # past the last point the step time is held constant
    assert bdl.total_decode_s(curve, 100, 3) == pytest.approx(3 * 1.4 / 1e3)


def test_set_live_and_bytes():
    cfg = Config(num_layers=3, kv_dtype="fp8")
    c = bdl.set_live(init_cache(cfg, 2, 10), 4)
    assert int(c.index) == 4 and c.positions.shape == (2, 10)
    np.testing.assert_array_equal(np.asarray(c.positions[1]), [0, 1, 2, 3] + [-1] * 6)
    # 2 (k, v) x 3 layers x 2 rows x 2 kv heads x 5 slots x (16 codes + a 4-byte scale)
    assert bdl.kv_bytes_read(cfg, 2, 5) == 2 * 3 * 2 * 2 * 5 * 20
    assert bdl.kv_bytes_read(Config(num_layers=3), 2, 5) == 2 * 3 * 2 * 2 * 5 * 16 * 2


def test_tiny_smoke(tmp_path):
    out = tmp_path / "long.json"
    result = bdl.main(["--tiny", "--quick", "--no-einsum", "--no-fp8", "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk["table"] == json.loads(json.dumps(result["table"]))
    plan = result["plan"]
    assert plan["long_slots"] == 32 + 64 and plan["short_slots"] == 32 + 16
    assert [r["output_len"] for r in result["table"]] == [16, 32, 64]
    for r in result["table"]:
        assert r["speedup_nvfp4_bf16kv"] == pytest.approx(r["bf16_bf16kv_s"] / r["nvfp4_bf16kv_s"])
    # (a) measured at the same index on both cache sizes; (b) both live lengths
    assert "cache_size_ratio_live_b1" in result["acceptance"]
    assert [r["live"] for r in result["attention_alone"]] == [24, 64]
    assert all(r["kv_bytes_per_layer"] > 0 for r in result["attention_alone"])
    assert "versions" in on_disk and "method" in on_disk


def test_attention_only_measures_b_alone(tmp_path):
    # --attention-only: (b) for every KV dtype and batch over a long-size cache, nothing else
    out = tmp_path / "attn.json"
    result = bdl.main(["--tiny", "--attention-only", "--out", str(out)])
    rows = json.loads(out.read_text())["attention_alone"]
    assert [(r["kv_dtype"], r["batch"], r["live"]) for r in rows] == [
        (kv, b, live) for kv in ("bf16", "fp8") for b in (1, 2) for live in (24, 64)
    ]
    assert all(r["us_per_layer"] > 0 and r["fraction_of_copy"] > 0 for r in rows)
    assert "table" not in result and "acceptance" not in result
    assert result["copy_ceiling_GBps"] > 0
