"""Print the Markdown tables of docs/performance.md from the bench's JSON files, so that a run's
tables are written from its files, not copied by hand.

    python3 tools/bench_tables.py main docs/bench/h200.json
    python3 tools/bench_tables.py breadth docs/bench/breadth/h200_group16.json ...

main: the main table (GPU time and eager against SDPA, FlashInfer and the better peer).
breadth: one line per file, cupa's GPU time against the better peer on each shape, the geometric
mean and the shapes at >= 0.95x (BREADTH_FLOOR).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupa.bench.main import better, geomean_vs_better  # noqa: E402

BREADTH_FLOOR = 0.95  # the per-shape goal of the breadth configurations (issue 23)


def ratio(row: dict, peer: str, column: str = "us") -> str:
    figure = row.get(f"{peer}_{column}")
    return f"{figure / row[f'cupa_{column}']:.2f}×" if figure else "-"


def shape_ratio(x: float) -> str:
    """Two decimals, three near the floor, where two would hide which side of it x is on."""
    return f"{x:.3f}" if abs(x - BREADTH_FLOOR) < 0.005 else f"{x:.2f}"


def figure(value) -> str:
    return f"{value:.1f}" if value is not None else "-"


def main_table(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = ["| B × L | KV MB | cupa µs | TB/s | % ceiling | SDPA µs | FlashInfer µs | vs SDPA | "
             "vs FlashInfer | eager: cupa | SDPA | FlashInfer | vs better |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        tbs = r["kv_bytes"] / r["cupa_us"] / 1e6
        eager = better(r, "eager_us")
        lines.append(
            f"| {r['batch']} × {r['seq_len']} | {r['kv_bytes'] / 1e6:.1f} | {r['cupa_us']:.1f} | "
            f"{tbs:.2f} | {100 * tbs / data['copy_tbs']:.1f}% | {figure(r.get('sdpa_us'))} | "
            f"{figure(r.get('flashinfer_us'))} | {ratio(r, 'sdpa')} | {ratio(r, 'flashinfer')} | "
            f"{r['cupa_eager_us']:.1f} | {figure(r.get('sdpa_eager_us'))} | "
            f"{figure(r.get('flashinfer_eager_us'))} | "
            + (f"{eager / r['cupa_eager_us']:.2f}× |" if eager else "- |"))
    lines.append("")
    lines.append(f"geometric mean against the better peer: GPU time "
                 f"{geomean_vs_better(data['rows'], 'us'):.3f}×, eager "
                 f"{geomean_vs_better(data['rows'], 'eager_us'):.3f}×; copy ceiling "
                 f"{data['copy_tbs']:.2f} TB/s")
    return "\n".join(lines)


def breadth_table(paths: list) -> str:
    files = [(p, json.loads(p.read_text())) for p in paths]
    shapes = [f"{r['batch']}×{r['seq_len']}" for r in files[0][1]["rows"]]
    lines = ["| configuration | " + " | ".join(shapes) + f" | geomean | ≥ {BREADTH_FLOOR}× |",
             "|---" + "|---:" * (len(shapes) + 2) + "|"]
    for path, data in files:
        ratios = [better(r, "us") / r["cupa_us"] for r in data["rows"]]
        name = path.stem.split("_", 1)[-1]
        lines.append(f"| {name} | " + " | ".join(map(shape_ratio, ratios))
                     + f" | {geomean_vs_better(data['rows'], 'us'):.3f}× | "
                     f"{sum(x >= BREADTH_FLOOR for x in ratios)} of {len(ratios)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=("main", "breadth"))
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    print(main_table(args.files[0]) if args.table == "main" else breadth_table(args.files))
