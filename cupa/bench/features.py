"""`python -m cupa bench --features`: what the optional features cost, as ratios from one run.

- sliding window: a 32k context with W = 4096 against a plain 4k context (goal: close to 1);
- multi-token decode: 4 new tokens per sequence against 1 (goal: <= 1.3x);
- fp8 KV cache: the fp8 cache against the float16 one (goal: >= 1.8x faster when the float16 KV
  is >= 1 GB), and FlashInfer's fp8 decode as a peer when it runs;
- ragged batches (cupa/bench/ragged.py, rows of their own in the JSON).
Each pair is timed back to back on the same device with the same Timer as the main table.
"""

from __future__ import annotations

from ..api import decode
from ..fp8 import quantize_fp8
from .harness import Timer, kv_read_bytes, make_problem
from .peers import flashinfer_peer, prepare_peer

WINDOW = 4096
WINDOW_CONTEXT = 32768
WINDOW_BATCHES = (1, 8)
MULTI_TOKEN_SHAPES = ((1, 32768), (8, 4096), (32, 2048), (64, 4096))
QUERY_LEN = 4
FP8_SHAPES = ((8, 4096), (16, 16384), (64, 4096), (256, 2048))
FP8_FORMAT = "fp8_e4m3"


def _problem(cupy, rng, batch, seq_len, args, query_len=1):
    query, key, value, tables, lens, tables_np = make_problem(cupy, rng, batch, seq_len, args,
                                                              args.kv_layout)
    if query_len > 1:
        query = cupy.random.standard_normal((batch * query_len,) + query.shape[1:],
                                            dtype=cupy.float32).astype(query.dtype)
    return query, key, value, tables, lens, tables_np


def _time_decode(timer, cupy, problem, args, **options):
    query, key, value, tables, lens, _ = problem
    out = cupy.empty_like(query)
    return timer.median_us(lambda: decode(query, key, value, tables, lens, out=out,
                                          kv_layout=args.kv_layout, **options))


def window_rows(cupy, timer, rng, args):
    rows = []
    for batch in WINDOW_BATCHES:
        long = _problem(cupy, rng, batch, WINDOW_CONTEXT, args)
        windowed = _time_decode(timer, cupy, long, args, sliding_window=WINDOW,
                                max_seq_len=WINDOW_CONTEXT)
        full = _time_decode(timer, cupy, long, args, max_seq_len=WINDOW_CONTEXT)
        del long
        short = _problem(cupy, rng, batch, WINDOW, args)
        plain = _time_decode(timer, cupy, short, args, max_seq_len=WINDOW)
        del short
        rows.append(dict(feature="sliding_window", batch=batch, seq_len=WINDOW_CONTEXT,
                         window=WINDOW, windowed_us=windowed, full_context_us=full,
                         plain_window_len_us=plain, ratio=windowed / plain))
        print(f"  window {WINDOW} on {batch} x {WINDOW_CONTEXT}: {windowed:8.1f} us; plain "
              f"{batch} x {WINDOW}: {plain:8.1f} us ({windowed / plain:.2f}x); whole "
              f"{WINDOW_CONTEXT}: {full:8.1f} us", flush=True)
    return rows


def multi_token_rows(cupy, timer, rng, args):
    rows = []
    for batch, seq_len in MULTI_TOKEN_SHAPES:
        one = _problem(cupy, rng, batch, seq_len, args)
        single = _time_decode(timer, cupy, one, args, max_seq_len=seq_len)
        query = cupy.random.standard_normal((batch * QUERY_LEN,) + one[0].shape[1:],
                                            dtype=cupy.float32).astype(one[0].dtype)
        # query_start_loc on the device, as a serving loop keeps it: a host array would add an
        # upload to every timed call (~3.5 us on the H200), which the 1-token row does not have.
        loc = cupy.arange(0, batch * QUERY_LEN + 1, QUERY_LEN, dtype=cupy.int32)
        several = _time_decode(timer, cupy, (query,) + one[1:], args,
                               query_start_loc=loc, max_query_len=QUERY_LEN, max_seq_len=seq_len)
        del one, query
        rows.append(dict(feature="multi_token", batch=batch, seq_len=seq_len,
                         query_len=QUERY_LEN, single_us=single, multi_us=several,
                         ratio=several / single))
        print(f"  {QUERY_LEN} new tokens on {batch} x {seq_len}: {several:8.1f} us; 1 token: "
              f"{single:8.1f} us ({several / single:.2f}x)", flush=True)
    return rows


def fp8_rows(cupy, timer, rng, args):
    """fp8 against float16, also timed under the other L2 flush: the write flush leaves L2
    full of dirty lines whose write-back (~9 us on the H200) lands in every timed launch, the
    same for both caches, which weighs on the ratio (docs/perf-log.md v14)."""
    other_flush = "read" if timer.flush_mode == "write" else "write"
    timers = (timer, Timer(cupy, timer.iters, other_flush))
    rows = []
    for batch, seq_len in FP8_SHAPES:
        problem = _problem(cupy, rng, batch, seq_len, args)
        query, key, value, tables, lens, tables_np = problem
        half, half_other = (_time_decode(t, cupy, problem, args, max_seq_len=seq_len)
                            for t in timers)
        scale = 0.02  # N(0, 1) data: codes use the upper range without saturating much
        key8, value8 = quantize_fp8(key, FP8_FORMAT, scale), quantize_fp8(value, FP8_FORMAT, scale)
        del key, value, problem
        fp8, fp8_other = (_time_decode(t, cupy, (query, key8, value8, tables, lens, None), args,
                                       kv_format=FP8_FORMAT, k_scale=scale, v_scale=scale,
                                       max_seq_len=seq_len) for t in timers)
        peer = None if args.no_peers else _flashinfer_fp8(cupy, timer, query, key8, value8,
                                                         tables_np, seq_len, scale, args)
        kv_bytes = kv_read_bytes(batch * seq_len, args)
        rows.append(dict(feature="fp8", batch=batch, seq_len=seq_len, kv_format=FP8_FORMAT,
                         fp16_kv_bytes=kv_bytes, fp16_us=half, fp8_us=fp8,
                         flashinfer_fp8_us=peer, speedup=half / fp8, other_flush=other_flush,
                         fp16_us_other_flush=half_other, fp8_us_other_flush=fp8_other,
                         speedup_other_flush=half_other / fp8_other))
        peer_text = f"; FlashInfer fp8 {peer:8.1f} us" if peer is not None else ""
        print(f"  fp8 cache on {batch} x {seq_len} ({kv_bytes / 1e9:.2f} GB as float16): "
              f"{fp8:8.1f} us; float16 {half:8.1f} us ({half / fp8:.2f}x faster){peer_text}\n"
              f"    L2 flushed by {other_flush}ing instead: {fp8_other:8.1f} us; float16 "
              f"{half_other:8.1f} us ({half_other / fp8_other:.2f}x faster)", flush=True)
        del key8, value8, query
    return rows


def _flashinfer_fp8(cupy, timer, query, key8, value8, tables_np, seq_len, scale, args):
    """FlashInfer's paged decode on the same fp8 pages, if it runs."""
    launch = prepare_peer("FlashInfer fp8", flashinfer_peer, cupy, query, key8, value8, tables_np,
                   seq_len, args, scale)
    return timer.median_us(launch) if launch is not None else None


FEATURE_PARTS = {"window": window_rows, "multi_token": multi_token_rows, "fp8": fp8_rows}
# The ragged batches (cupa/bench/ragged.py) come with the features: they have rows of their own.
RAGGED = "ragged"


def selected_features(spec: str | None) -> list[str]:
    """The names `--features` asks for ("all", or a comma-separated subset), checked before
    anything is timed."""
    if not spec:
        return []
    known = [*FEATURE_PARTS, RAGGED]
    wanted = known if spec == "all" else [name.strip() for name in spec.split(",")]
    unknown = set(wanted) - set(known)
    if unknown:
        raise SystemExit(f"--features: unknown {sorted(unknown)}; choose from {known}")
    return wanted


def feature_rows(cupy, timer, rng, args, wanted: list[str]) -> list[dict]:
    """The rows of the features in `wanted` (selected_features), the ragged batches aside."""
    wanted = [name for name in wanted if name in FEATURE_PARTS]
    if not wanted:
        return []
    print(f"features ({args.dtype}, heads {args.heads}/{args.kv_heads}, head {args.head_size}, "
          f"block {args.block_size}):")
    if args.dtype not in ("float16", "bfloat16") and "fp8" in wanted:
        print("  [fp8 rows skipped: fp8 caches serve float16 / bfloat16 queries]")
        wanted.remove("fp8")
    rows = []
    for name in wanted:
        rows += FEATURE_PARTS[name](cupy, timer, rng, args)
    return rows
