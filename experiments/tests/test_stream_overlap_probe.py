"""experiments/stream_overlap_probe.py without a GPU: "stream1" marks every dequantizer call with
the stream annotation and "serial" none, the dot stays unmarked, and bad arguments are refused.
The timing itself needs a GPU."""

from __future__ import annotations

import importlib.util
import pathlib

import jax.numpy as jnp
import pytest

_PATH = pathlib.Path(__file__).parents[1] / "stream_overlap_probe.py"
_spec = importlib.util.spec_from_file_location("stream_overlap_probe", _PATH)
sop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sop)


def _deq(wp, ws, layer):
    del ws, layer
    return (wp.astype(jnp.float32) * 2.0).astype(jnp.bfloat16)


@pytest.mark.parametrize("inner", [1, 3])
def test_only_stream1_marks_the_dequantizer_calls(inner):
    assert sop.dry_run(inner=inner) == {"calls": inner, "marked": inner}
    args = sop._inputs(16, inner)
    for variant, marked in (("serial", 0), ("stream1", inner), ("dot", 0)):
        text = sop.build(variant, inner, _deq).trace(*args).lower(lowering_platforms=("cuda",))
        text = text.as_text()
        assert text.count('_xla_stream_annotation = "1"') >= marked, variant
        # the dot itself is never on the annotated stream
        dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        assert len(dots) == (0 if variant == "dequant" else inner), variant
        assert not any("_xla_stream_annotation" in line for line in dots), variant
        if not marked:
            assert "_xla_stream_annotation" not in text, variant


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(ValueError, match="variant='both'"):
        sop.build("both", 1, _deq)
    with pytest.raises(SystemExit):
        sop.main(["--inner", "0"])
    assert "--m, --inner, --reps must be >= 1, got 4096, 0, 20" in capsys.readouterr().err
