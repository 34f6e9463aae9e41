"""`python -m cupa bench`: decode time against the copy ceiling and optional peers, one run.

Every figure comes from the same process, device and data: the copy ceiling (a large
device-to-device copy, bytes read + written), cupa, torch SDPA on the same KV gathered dense, and
FlashInfer's paged batch decode (tensor cores) on the same pages shared through DLPack. L2 is
flushed before every timed launch; each time is the median of many events-timed launches.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

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
                             "against their plain counterparts (cupa/bench_features.py); "
                             "optionally a comma-separated subset of window,multi_token,fp8")
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw TB/s against KV size")


# The read flush reads every word of the flush buffer and writes nothing (the branch never
# fires, but the compiler cannot know that, so the loads stay).
_FLUSH_KERNELS = r"""
extern "C" __global__ void cupa_read_flush(const unsigned int* p, unsigned long long n,
                                           unsigned int* sink) {
    unsigned int acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        acc ^= p[i];
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Holds the stream for `cycles` clocks: after the read flush, so that the host has enqueued the
// timed launch before the start event fires (the read is shorter than an eager cupa.decode call's
// host time; the write flush takes long enough by itself).
extern "C" __global__ void cupa_hold(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
"""
HOLD_CYCLES = 1 << 20  # ~0.5 ms at 2 GHz


class Timer:
    """Median device time of a launch, with L2 flushed before each one by streaming a 512 MB
    buffer through it.

    flush="write" (default, the usual `cache.zero_()` idiom and every table in docs/performance.md)
    fills the buffer, which leaves L2 full of dirty lines written back during the timed launch;
    flush="read" reads it, leaving clean lines. The two differ by a few percent, mostly for the
    peers (docs/perf-log.md, v7).
    The flush also hides the host-side cost of enqueueing the launch: the host records the start
    event and launches while the GPU is still busy with the flush (after the read flush, with a
    0.5 ms hold: the read alone is shorter than an eager call's host time)."""

    def __init__(self, cupy, iters, flush="write"):
        self.cupy = cupy
        self.iters = iters
        self.flush_buffer = cupy.ones(512 << 20, dtype=cupy.uint8)
        self.start = cupy.cuda.Event()
        self.stop = cupy.cuda.Event()
        if flush not in ("read", "write"):
            raise ValueError(f"flush: 'read' or 'write', got {flush!r}")
        self.flush_mode = flush
        if flush == "read":
            self._reader = cupy.RawKernel(_FLUSH_KERNELS, "cupa_read_flush")
            self._hold = cupy.RawKernel(_FLUSH_KERNELS, "cupa_hold")
            self._sink = cupy.zeros(1, dtype=cupy.uint32)

    def flush(self):
        if self.flush_mode == "write":
            self.flush_buffer.fill(1)
            return
        words = self.flush_buffer.view(self.cupy.uint32)
        self._reader((1024,), (256,), (words, np.uint64(words.size), self._sink))
        self._hold((1,), (1,), (np.int64(HOLD_CYCLES),))

    def median_us(self, launch, warmup=3):
        for _ in range(warmup):
            launch()
        times = []
        for _ in range(self.iters):
            self.flush()
            self.start.record()
            launch()
            self.stop.record()
            self.stop.synchronize()
            times.append(self.cupy.cuda.get_elapsed_time(self.start, self.stop) * 1e3)
        return float(np.median(times))


def copy_ceiling_tbs(cupy, timer, nbytes=4 << 30):
    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    us = timer.median_us(lambda: dst.__setitem__(Ellipsis, src))
    del src, dst
    return 2 * nbytes / (us * 1e-6) / 1e12


def make_problem(cupy, rng, batch, seq_len, args):
    """Random query and paged KV (blocks in shuffled order) of exactly batch x seq_len tokens."""
    import ml_dtypes
    np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
                "float32": np.float32}[args.dtype]
    bs = args.block_size
    blocks_per_seq = -(-seq_len // bs)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.kv_heads, bs, args.head_size)
    key = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(np_dtype)
    value = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(np_dtype)
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
    query = cupy.random.standard_normal((batch, args.heads, args.head_size),
                                        dtype=cupy.float32).astype(np_dtype)
    lens = np.full(batch, seq_len, np.int32)
    return query, key, value, cupy.asarray(tables), cupy.asarray(lens), tables


def sdpa_peer(cupy, query, key, value, tables_np, seq_len, args):
    """torch SDPA on the same KV gathered into dense [B, Hkv, L, D] (gather not timed)."""
    try:
        import torch
        import torch.nn.functional as F
    except Exception:
        return None
    q = torch.from_dlpack(query).unsqueeze(2)  # [B, H, 1, D]
    k_pages, v_pages = torch.from_dlpack(key), torch.from_dlpack(value)
    idx = torch.from_dlpack(cupy.asarray(tables_np)).long()
    batch = idx.shape[0]

    def dense(pages):  # [B, nb, Hkv, bs, D] -> [B, Hkv, nb*bs, D]
        g = pages[idx].permute(0, 2, 1, 3, 4).reshape(batch, args.kv_heads, -1, args.head_size)
        return g[:, :, :seq_len].contiguous()
    k, v = dense(k_pages), dense(v_pages)
    gqa = args.heads != args.kv_heads
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def flashinfer_peer(cupy, query, key, value, tables_np, seq_len, args, fp8_scale=None):
    """FlashInfer BatchDecodeWithPagedKVCacheWrapper (tensor cores, HND) on the same pages; with
    fp8_scale, the pages are e4m3 codes (uint8 viewed as torch.float8_e4m3fn) of that scale."""
    try:
        import flashinfer
        import torch
    except Exception:
        return None
    batch, blocks = tables_np.shape
    bs = args.block_size
    dev = torch.device("cuda", cupy.cuda.Device().id)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND",
                                                            use_tensor_cores=True)
    indptr = torch.arange(0, batch * blocks + 1, blocks, dtype=torch.int32, device=dev)
    indices = torch.from_dlpack(cupy.asarray(tables_np.reshape(-1)))
    last = torch.full((batch,), seq_len - (blocks - 1) * bs, dtype=torch.int32, device=dev)
    q_dtype = getattr(torch, args.dtype)
    kv_dtype = q_dtype if fp8_scale is None else torch.float8_e4m3fn
    wrapper.plan(indptr, indices, last, args.heads, args.kv_heads, args.head_size, bs,
                 q_data_type=q_dtype, kv_data_type=kv_dtype)
    q, k, v = (torch.from_dlpack(x) for x in (query, key, value))
    if fp8_scale is None:
        return lambda: wrapper.run(q, (k, v))
    k, v = k.view(kv_dtype), v.view(kv_dtype)
    return lambda: wrapper.run(q, (k, v), k_scale=fp8_scale, v_scale=fp8_scale)


def _peer(name, factory, *a):
    try:
        launch = factory(*a)
        if launch is not None:
            launch()
        return launch
    except Exception as exc:  # a peer that fails is reported and left out, never fatal
        print(f"  [{name} unavailable: {type(exc).__name__}: {str(exc)[:200]}]", file=sys.stderr)
        return None


def main(args) -> int:
    from . import arrays, decode
    from .device import device_info
    if not arrays.gpu_available():
        print("cupa bench needs a GPU (cupy with a visible device); see `python -m cupa info`",
              file=sys.stderr)
        return 2
    cupy = arrays.cupy_module()
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
              f"{'sdpa us':>9} {'fi us':>9} {'vs sdpa':>8} {'vs fi':>7}")
    print(f"{args.dtype}, heads {args.heads}/{args.kv_heads}, head {args.head_size}, "
          f"block {args.block_size}; median of {args.iters}, L2 flushed ({args.flush})")
    print(header)
    for n, (batch, seq_len) in enumerate(shapes, 1):
        start = time.perf_counter()
        query, key, value, tables, lens, tables_np = make_problem(cupy, rng, batch, seq_len, args)
        out = cupy.empty_like(query)
        kv_bytes = 2 * batch * seq_len * args.kv_heads * args.head_size * query.dtype.itemsize

        def run_cupa():
            decode(query, key, value, tables, lens, out=out, max_seq_len=seq_len,
                   partition_size=args.partition_size)
        cupa_us = timer.median_us(run_cupa)
        peers = {}
        if not args.no_peers:
            for name, factory in (("sdpa", sdpa_peer), ("flashinfer", flashinfer_peer)):
                launch = _peer(name, factory, cupy, query, key, value, tables_np, seq_len, args)
                peers[name] = timer.median_us(launch) if launch is not None else None
        tbs = kv_bytes / (cupa_us * 1e-6) / 1e12
        row = dict(batch=batch, seq_len=seq_len, num_heads=args.heads,
                   num_kv_heads=args.kv_heads, head_size=args.head_size, dtype=args.dtype,
                   block_size=args.block_size, kv_bytes=kv_bytes, cupa_us=cupa_us,
                   sdpa_us=peers.get("sdpa"), flashinfer_us=peers.get("flashinfer"))
        rows.append(row)

        def fmt(us):
            return f"{us:9.1f}" if us is not None else f"{'-':>9}"

        def ratio(us):
            return f"{us / cupa_us:7.2f}x" if us is not None else f"{'-':>8}"
        print(f"{batch:>5} x {seq_len:<6} {kv_bytes / 1e6:8.1f} {fmt(cupa_us)} {tbs:6.2f} "
              f"{100 * tbs / ceiling:5.1f}% {fmt(row['sdpa_us'])} {fmt(row['flashinfer_us'])} "
              f"{ratio(row['sdpa_us'])} {ratio(row['flashinfer_us'])}", flush=True)
        print(f"  [{n}/{len(shapes)} done in {time.perf_counter() - start:.1f} s]",
              file=sys.stderr, flush=True)
        del query, key, value, tables, lens, out

    best = [min(x for x in (r["sdpa_us"], r["flashinfer_us"]) if x is not None) / r["cupa_us"]
            for r in rows if r["sdpa_us"] is not None or r["flashinfer_us"] is not None]
    if best:
        geo = float(np.exp(np.mean(np.log(best))))
        print(f"geometric mean speed-up over the better peer: {geo:.3f}x")
    result = {"copy_tbs": ceiling, "device": info.name, "flush": args.flush, "rows": rows}
    if args.features:
        from .bench_features import feature_rows
        result["feature_rows"] = feature_rows(cupy, timer, rng, args)
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
