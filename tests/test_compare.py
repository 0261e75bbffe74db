"""`rejax compare` on the bundled model: JAX against the Torch path on the same weights (CPU)."""

import json

import pytest

from rejax import cli


def test_compare_on_the_bundled_model(capsys, tmp_path):
    out = tmp_path / "compare.json"
    rc = cli.main(
        ["compare", "--quant", "bf16", "--steps", "8", "--repeats", "1", "--out", str(out)]
    )
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    r = json.loads(out.read_text())
    assert (r["quant"], r["steps"], r["model"]) == ("bf16", 8, "tiny")
    # Same bf16 weights, same recipe: layer vs torch_ref (bf16) tolerance of STYLE.md.
    assert 0 < r["logits_rel_error"] <= 1e-2
    assert r["top1_agreement"] == 1.0 and r["top1_agreement_count"] == [8, 8]
    assert r["trace_is_jax_argmax"]
    assert r["entropy_max_abs_diff"] < 1e-3
    # Both policies read the same logits: they must make every decision alike.
    assert r["reset_agreement_same_logits"] == 1.0
    assert 0.0 <= r["reset_agreement_own_logits"] <= 1.0
    assert r["reset_settings"]["tau_0"] == pytest.approx(7.699e-05)  # the model's reset.json
    assert r["jax_ms_per_token"] > 0 and r["torch_forward_ms"] > 0
    assert "top-1 agreement on the trace" in stdout and "100.0% (8/8)" in stdout


def test_compare_rejects_an_empty_prompt(capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_model", lambda *a: pytest.fail("loaded the model"))
    rc = cli.main(["compare", "--prompt", " "])
    assert rc == 2 and "--prompt is empty (' ')" in capsys.readouterr().err


def test_compare_has_no_sampling_options(capsys):
    # compare walks a greedy trace; only ReSET's threshold settings shape its decisions.
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--top-p", "0.9"])
    assert e.value.code == 2 and "unrecognized arguments: --top-p" in capsys.readouterr().err
