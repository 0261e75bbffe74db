"""experiments/ncu_sass_segments.py on a small source-page CSV written here."""

import pytest

from experiments import ncu_sass_segments as seg

HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"'


def _csv(rows):
    body = [f'"{a}","{src}","{w}","{e}"' for a, src, w, e in rows]
    return "\n".join(["==PROF== Connected", '{"some": "json"}', HEADER, *body])


def test_segments_group_equal_counts_and_rank_shares():
    rows = [
        ("0x0", "MOV R1, c[0x0][0x28]", 1, 10),
        ("0x10", "FFMA R2, R3, R4, R5", 40, 1000),  # a loop body of three, 1000 times
        ("0x20", "@P0 FFMA R2, R3, R4, R5", 30, 1000),
        ("0x30", "MUFU.EX2 R6, R7", 20, 1000),
        ("0x40", "EXIT", 9, 10),
    ]
    total, segs = seg.segments(seg.read_rows(_csv(rows)), min_share=0.05)
    assert total == 3020
    (loop,) = segs  # the two 10-count rows hold 0.7% of instructions but 9% of stalls...
    assert (loop.start, loop.stop, loop.count) == (1, 4, 1000)
    assert loop.share == pytest.approx(3000 / 3020)
    assert dict(loop.opcodes) == {"FFMA": 2, "MUFU.EX2": 1}  # a predicate is not the opcode
    assert loop.stall_share == pytest.approx(90 / 100)
    # ...so a lower threshold lists them (stall share counts twice the threshold)
    _, segs = seg.segments(seg.read_rows(_csv(rows)), min_share=0.004)
    assert [(s.start, s.stop) for s in segs] == [(0, 1), (1, 4), (4, 5)]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="no per-SASS table"):
        seg.read_rows("==PROF== nothing here\n")
    with pytest.raises(ValueError, match="SourceCounters"):
        seg.read_rows('"Address","Source"\n"0x0","MOV"\n')
    with pytest.raises(SystemExit):
        seg.main(["x.csv", "--min-share", "2"])


def test_main_prints_each_file(tmp_path, capsys):
    path = tmp_path / "k.csv"
    path.write_text(_csv([("0x0", "IADD3 R1, R2, R3, RZ", 1, 7)]))
    seg.main([str(path)])
    out = capsys.readouterr().out
    assert "7 warp instructions" in out and "IADD3 1" in out
