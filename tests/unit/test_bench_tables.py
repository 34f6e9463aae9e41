"""tools/bench_tables.py, which prints docs/performance.md's tables from the bench's JSON: each
row's ratios come from its own figures, the better peer is the faster of the two, and a ratio
near the breadth floor keeps the third decimal that says which side of it it is on."""

from __future__ import annotations

import json

from tool_module import tool_module


def row(batch, cupa, sdpa, flashinfer, *, eager=(10.0, 20.0, None)):
    return {"batch": batch, "seq_len": 4096, "kv_bytes": 8_600_000, "cupa_us": cupa,
            "sdpa_us": sdpa, "flashinfer_us": flashinfer, "cupa_eager_us": eager[0],
            "sdpa_eager_us": eager[1], "flashinfer_eager_us": eager[2]}


def write(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"copy_tbs": 4.3, "rows": rows}))
    return path


def test_a_breadth_line_is_each_shape_against_its_better_peer(tmp_path):
    tables = tool_module("bench_tables")
    rows = [row(1, 10.0, 9.0, 12.0), row(2, 20.0, 26.0, 19.04), row(4, 30.0, 36.0, None)]
    text = tables.breadth_table([write(tmp_path, "h200_group16.json", rows)])
    header, rule, line = text.splitlines()
    assert header.split(" | ")[1:4] == ["1×4096", "2×4096", "4×4096"]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # 9/10 = 0.90; 19.04/20 = 0.952, near the floor (three decimals); 36/30 = 1.20 (SDPA
    # only); geometric mean (0.9 * 0.952 * 1.2) ** (1/3) = 1.009
    assert cells == ["group16", "0.90", "0.952", "1.20", "1.009×", "2 of 3"]
    assert rule == "|---" + "|---:" * 5 + "|"  # name, 3 shapes, geomean, count


def test_the_main_table_has_a_line_per_shape_and_the_geometric_means(tmp_path):
    tables = tool_module("bench_tables")
    rows = [row(1, 10.0, 11.0, 12.0, eager=(10.0, 30.0, 20.0)),
            row(8, 40.0, 38.0, 50.0, eager=(40.0, 44.0, None))]
    lines = tables.main_table(write(tmp_path, "h200.json", rows)).splitlines()
    assert len(lines) == 2 + 2 + 2
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    assert first[0] == "1 × 4096" and first[2] == "10.0" and first[7:9] == ["1.10×", "1.20×"]
    assert first[-1] == "2.00×"  # eager: the better peer's 20.0 against 10.0
    # GPU time: sqrt(1.1 * 0.95); eager: sqrt(2.0 * 1.1)
    assert lines[-1].startswith("geometric mean against the better peer: GPU time 1.022×, "
                                "eager 1.483×")
