"""experiments/random_checkpoint.py: a random checkpoint of a preset's shapes loads and
generates with the bundled tokenizer; an existing checkpoint is not overwritten by accident."""

import json

import pytest

from experiments import random_checkpoint
from rejax import config as rconfig
from rejax import generate
from rejax.checkpoint.reader import load


def test_random_checkpoint_loads_and_generates(tmp_path, monkeypatch):
    small = rconfig.Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                           num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip
    monkeypatch.setitem(rconfig.PRESETS, "test-small", small)
    out = tmp_path / "ck"
    random_checkpoint.main(["--preset", "test-small", "--layers", "2", "--out", str(out)])
    params = load(out)
    assert params.cfg.num_layers == 2 and params.cfg.vocab_size == 512
    assert (params.cfg.hidden_size, params.cfg.intermediate_size) == (64, 128)
    assert params.tokenizer is not None
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert gen_cfg["temperature"] == 0.6
    got = generate(params, "12+7=", max_new_tokens=4, stop=[])
    assert len(got.tokens[0]) == 4 and all(0 <= t < 512 for t in got.tokens[0])
    with pytest.raises(SystemExit, match="already holds a checkpoint"):
        random_checkpoint.main(["--preset", "test-small", "--layers", "2", "--out", str(out)])
    random_checkpoint.main(
        ["--preset", "test-small", "--layers", "3", "--out", str(out), "--overwrite"]
    )
    assert load(out).cfg.num_layers == 3
    with pytest.raises(SystemExit, match="--layers must be positive"):
        random_checkpoint.main(["--preset", "test-small", "--layers", "0", "--out", str(out)])
