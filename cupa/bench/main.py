"""`python -m cupa bench`: decode time against the copy ceiling and optional peers, one run.

Every figure comes from the same process, device and data: the copy ceiling (a large
device-to-device copy, bytes read + written), cupa, torch SDPA on the same KV gathered dense, and
FlashInfer's paged batch decode; the ragged batches against FlashInfer (`cupa.bench.ragged`). Two
columns per kernel: GPU time (L2 flushed before every timed launch, median of event-timed
launches; the host's enqueue hidden) and eager time (back-to-back calls, what a user's loop sees,
host included). The host cost per call of cupa's entry points is
measured beside the bare-launch floor (`cupa.bench.host`).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from ..arrays import cupy_module, gpu_available
from ..api import decode
from ..gpu.device import device_info
from ..problem import KV_LAYOUTS
from .features import RAGGED, feature_rows, selected_features
from .harness import Timer, copy_ceiling_tbs, copy_floor_us, eager_us, kv_read_bytes, make_problem
from .host import host_costs
from .peers import flashinfer_peer, prepare_peer, sdpa_peer
from .ragged import RAGGED_BATCHES, ragged_rows, selected_ragged

DEFAULT_SHAPES = ("1x4096", "1x32768", "8x4096", "16x16384", "32x2048", "64x4096", "128x1024",
                  "256x2048")


def add_arguments(parser):
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help="comma-separated BATCHxSEQ_LEN (default: the issue's 8 shapes); "
                             "'none' skips the main table")
    parser.add_argument("--heads", type=int, default=64, help="query heads (default 64)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-layout", default="HND", choices=tuple(KV_LAYOUTS),
                        help="the caches' dimension order, for cupa and the peers (default HND)")
    parser.add_argument("--partition-size", type=int, default=None,
                        help="force cupa's partition size (default: the planner's choice)")
    parser.add_argument("--iters", type=int, default=50, help="timed launches per figure")
    parser.add_argument("--flush", choices=("read", "write"), default="write",
                        help="how L2 is flushed before each timed launch: write a 512 MB buffer "
                             "(default, the usual idiom; leaves dirty lines whose write-back is "
                             "charged to the launch) or read it")
    parser.add_argument("--no-peers", action="store_true", help="time cupa and the ceiling only")
    parser.add_argument("--features", nargs="?", const="all", default=None,
                        metavar="LIST",
                        help="also time sliding window, multi-token decode and the fp8 cache "
                             "against their plain counterparts (cupa/bench/features.py), and the "
                             "ragged batches; optionally a comma-separated subset of "
                             "window,multi_token,fp8,ragged")
    parser.add_argument("--ragged", nargs="?", const="all", default=None, metavar="LIST",
                        help="time the ragged batches against FlashInfer (cupa/bench/ragged.py; "
                             "also part of a bare --features): all, none, or a comma-separated "
                             f"subset of {','.join(RAGGED_BATCHES)}")
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw TB/s against KV size")


def better(row: dict, column: str):
    """The better peer's figure of `column` ('us' or 'eager_us') in a row, or None."""
    figures = [row.get(f"{peer}_{column}") for peer in ("sdpa", "flashinfer")]
    figures = [x for x in figures if x is not None]
    return min(figures) if figures else None


def geomean_vs_better(rows: list, column: str):
    """Geometric mean of better peer / cupa over the rows with a peer, or None."""
    ratios = [better(r, column) / r[f"cupa_{column}"] for r in rows
              if better(r, column) is not None]
    return float(np.exp(np.mean(np.log(ratios)))) if ratios else None


def main(args) -> int:
    features = selected_features(args.features)  # unknown names stop the run before timing
    ragged = selected_ragged(args.ragged, RAGGED in features)
    if not gpu_available():
        print("cupa bench needs a GPU (cupy with a visible device); see `python -m cupa info`",
              file=sys.stderr)
        return 2
    cupy = cupy_module()
    info = device_info()
    timer = Timer(cupy, args.iters, args.flush)
    rng = np.random.default_rng(0)
    print(f"device: {info.name} ({info.target.arch}); measuring copy ceiling...", file=sys.stderr)
    ceiling = copy_ceiling_tbs(cupy, timer)
    print(f"copy ceiling: {ceiling:.2f} TB/s (read + write)")
    shapes = [] if args.shapes.strip().lower() == "none" else [
        tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    rows = []
    header = (f"{'B x L':>12} {'KV MB':>8} {'cupa us':>9} {'TB/s':>6} {'%ceil':>6} "
              f"{'sdpa us':>9} {'fi us':>9} {'vs sdpa':>8} {'vs fi':>7} | eager: "
              f"{'cupa':>9} {'sdpa':>9} {'fi':>9} {'vs best':>8}")
    print(f"{args.dtype}, heads {args.heads}/{args.kv_heads}, head {args.head_size}, "
          f"block {args.block_size}, {args.kv_layout}; median of {args.iters}, L2 flushed "
          f"({args.flush})")
    print(header)
    for n, (batch, seq_len) in enumerate(shapes, 1):
        start = time.perf_counter()
        query, key, value, tables, lens, tables_np = make_problem(cupy, rng, batch, seq_len, args,
                                                                   args.kv_layout)
        out = cupy.empty_like(query)
        kv_bytes = kv_read_bytes(batch * seq_len, args)

        def run_cupa():
            decode(query, key, value, tables, lens, out=out, max_seq_len=seq_len,
                   partition_size=args.partition_size, kv_layout=args.kv_layout)
        cupa_us, cupa_eager = timer.median_us(run_cupa), eager_us(cupy, run_cupa)
        peers, peers_eager = {}, {}
        if not args.no_peers:
            for name, factory in (("sdpa", sdpa_peer), ("flashinfer", flashinfer_peer)):
                launch = prepare_peer(name, factory, cupy, query, key, value, tables_np,
                                      seq_len, args)
                peers[name] = timer.median_us(launch) if launch is not None else None
                peers_eager[name] = eager_us(cupy, launch) if launch is not None else None
        tbs = kv_bytes / (cupa_us * 1e-6) / 1e12
        row = dict(batch=batch, seq_len=seq_len, num_heads=args.heads,
                   num_kv_heads=args.kv_heads, head_size=args.head_size, dtype=args.dtype,
                   block_size=args.block_size, kv_layout=args.kv_layout, kv_bytes=kv_bytes,
                   cupa_us=cupa_us,
                   sdpa_us=peers.get("sdpa"), flashinfer_us=peers.get("flashinfer"),
                   cupa_eager_us=cupa_eager, sdpa_eager_us=peers_eager.get("sdpa"),
                   flashinfer_eager_us=peers_eager.get("flashinfer"))
        rows.append(row)

        def fmt(us):
            return f"{us:9.1f}" if us is not None else f"{'-':>9}"

        def ratio(us, ours):
            return f"{us / ours:7.2f}x" if us is not None else f"{'-':>8}"
        print(f"{batch:>5} x {seq_len:<6} {kv_bytes / 1e6:8.1f} {fmt(cupa_us)} {tbs:6.2f} "
              f"{100 * copy_floor_us(kv_bytes, ceiling) / cupa_us:5.1f}% "
              f"{fmt(row['sdpa_us'])} {fmt(row['flashinfer_us'])} "
              f"{ratio(row['sdpa_us'], cupa_us)} {ratio(row['flashinfer_us'], cupa_us)} | "
              f"eager {fmt(cupa_eager)} {fmt(row['sdpa_eager_us'])} "
              f"{fmt(row['flashinfer_eager_us'])} {ratio(better(row, 'eager_us'), cupa_eager)}",
              flush=True)
        print(f"  [{n}/{len(shapes)} done in {time.perf_counter() - start:.1f} s]",
              file=sys.stderr, flush=True)
        del query, key, value, tables, lens, out

    for column, what in (("us", "GPU time"), ("eager_us", "eager, back-to-back calls")):
        geo = geomean_vs_better(rows, column)
        if geo is not None:
            print(f"geometric mean speed-up over the better peer ({what}): {geo:.3f}x")
    ragged_result = ragged_rows(cupy, timer, args, ceiling, ragged)
    print("host cost per call (device arrays, back to back):", file=sys.stderr)
    host = host_costs(cupy)
    print("host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items())
          + f"  (L = launch_floor; decode {host['decode'] / host['launch_floor']:.2f} L, "
          f"plan_run {host['plan_run'] / host['launch_floor']:.2f} L)")
    result = {"copy_tbs": ceiling, "device": info.name, "flush": args.flush, "rows": rows,
              "host_us": host}
    if ragged:
        result["ragged_rows"] = ragged_result
    if features:
        result["feature_rows"] = feature_rows(cupy, timer, rng, args, features)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot and rows:
        plot(result, args.plot)
    return 0


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("--plot needs matplotlib", file=sys.stderr)
        return
    rows = sorted(result["rows"], key=lambda r: r["kv_bytes"])
    gb = [r["kv_bytes"] / 1e9 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("cupa_us", "cupa"), ("flashinfer_us", "FlashInfer"), ("sdpa_us", "SDPA")):
        pts = [(g, r["kv_bytes"] / (r[key] * 1e-6) / 1e12) for g, r in zip(gb, rows) if r[key]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.axhline(result["copy_tbs"], color="gray", linestyle="--", label="copy ceiling")
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes read (GB)")
    ax.set_ylabel("effective TB/s")
    ax.set_title(f"decode on {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
