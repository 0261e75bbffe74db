"""experiments/hlo_loop_copies.py on a small optimized-HLO text: copies per while loop."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

_DIR = pathlib.Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("hlo_loop_copies", _DIR / "hlo_loop_copies.py")
hc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hc)

# an outer loop whose predicate the host reads, holding an inner loop of known trip count;
# the outer body copies a counter, the inner body the logits (bf16) and a flag, and a fused
# copy inside a fusion computation is not a top-level copy of any loop
HLO = """HloModule jit__decode_loop, entry_computation_layout={()->s32[]}

%fused_computation (param_0: bf16[2,8]) -> bf16[2,8] {
  %param_0 = bf16[2,8]{1,0} parameter(0)
  ROOT %copy.9 = bf16[2,8]{0,1} copy(%param_0)
}

%inner_body (p: (s32[], bf16[2,8], pred[2])) -> (s32[], bf16[2,8], pred[2]) {
  %p = (s32[], bf16[2,8]{1,0}, pred[2]{0}) parameter(0)
  %copy.5 = bf16[2,8]{1,0} copy(%gte.1), metadata={op_name="jit(_decode_loop)/while/body/while/body/copy"}
  %copy.6 = pred[2]{0} copy(%gte.2)
  %fusion.1 = bf16[2,8]{0,1} fusion(%copy.5), kind=kLoop, calls=%fused_computation
  ROOT %t = (s32[], bf16[2,8]{1,0}, pred[2]{0}) tuple(%gte.0, %copy.5, %copy.6)
}

%inner_cond (p.1: (s32[], bf16[2,8], pred[2])) -> pred[] {
  %p.1 = (s32[], bf16[2,8]{1,0}, pred[2]{0}) parameter(0)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%outer_body (q: (s32[], bf16[2,8], pred[2])) -> (s32[], bf16[2,8], pred[2]) {
  %q = (s32[], bf16[2,8]{1,0}, pred[2]{0}) parameter(0)
  %copy.3 = s32[] copy(%zero)
  %while.2 = (s32[], bf16[2,8]{1,0}, pred[2]{0}) while(%init), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"8"}}
  ROOT %r = (s32[], bf16[2,8]{1,0}, pred[2]{0}) tuple(%copy.3, %x, %y)
}

%outer_cond (q.1: (s32[], bf16[2,8], pred[2])) -> pred[] {
  %q.1 = (s32[], bf16[2,8]{1,0}, pred[2]{0}) parameter(0)
  ROOT %c = pred[] compare(%a.1, %b.1), direction=LT
}

ENTRY %main.1 (a: bf16[2,8]) -> s32[] {
  %a = bf16[2,8]{1,0} parameter(0)
  %while.1 = (s32[], bf16[2,8]{1,0}, pred[2]{0}) while(%t0), condition=%outer_cond, body=%outer_body
  ROOT %out = s32[] get-tuple-element(%while.1), index=0
}
"""


def test_loops_outermost_first_with_their_copies(tmp_path, capsys):
    loops = hc.loop_copies(HLO)
    assert [(lp["while"], lp["depth"], lp["known_trip_count"]) for lp in loops] == [
        ("while.1", 0, None), ("while.2", 1, 8)]  # fmt: skip
    outer, inner = loops
    assert [c["name"] for c in outer["body_copies"]] == ["copy.3"]
    assert outer["body_copies"][0]["bytes"] == 4 and outer["condition_copies"] == []
    assert [(c["name"], c["shape"], c["bytes"]) for c in inner["body_copies"]] == [
        ("copy.5", "bf16[2,8]", 32), ("copy.6", "pred[2]", 2)]  # fmt: skip
    assert inner["body_copies"][0]["op_name"].endswith("while/body/copy")
    out = tmp_path / "loops.json"
    path = tmp_path / "m.after_optimizations.txt"
    path.write_text(HLO)
    assert hc.main([str(path), "--json", str(out)]) == loops
    assert json.loads(out.read_text()) == loops
    text = capsys.readouterr().out
    assert "while while.1 (in main.1; predicate read by the host): 1 copies" in text
    assert "  while while.2 (in outer_body; trip count 8): 2 copies in its body" in text


def test_not_a_module():
    with pytest.raises(ValueError, match="no ENTRY"):
        hc.loop_copies("%x = s32[] constant(0)\n")
