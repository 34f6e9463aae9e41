"""The decode problem the device tools time or profile: the bench's random paged KV (cupa.bench
make_problem), optionally with several new tokens per sequence and an fp8 cache, or one of the
bench's ragged batches by name (cupa.bench.ragged.RAGGED_BATCHES)."""
import numpy as np

import cupa
from cupa.bench.harness import make_problem
from cupa.bench.ragged import RAGGED_BATCHES, ragged_arrays, ragged_batch

FP8_SCALE = 0.02  # N(0, 1) data: codes use the upper range without saturating much


def add_problem_arguments(parser):
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--query-len", type=int, default=1, help="new tokens per sequence")
    parser.add_argument("--kv-format", default=None, help="fp8_e4m3 or fp8_e4m3fnuz")


def batch_shapes(text: str) -> list:
    """'1x4096,128x1024' -> [(1, 4096), (128, 1024)]: the tools' --shapes."""
    shapes = []
    for shape in text.split(","):
        parsed = tuple(int(x) for x in shape.lower().split("x"))
        if len(parsed) != 2:
            raise ValueError(f"--shapes: BATCHxSEQ_LEN, got {shape!r}")
        shapes.append(parsed)
    return shapes


def decode_problem(cupy, rng, batch, seq_len, args):
    """(query, key, value, block_tables, seq_lens, options): the arrays plus the keyword arguments
    cupa.decode needs for them (query_start_loc, kv_format and scales, max_seq_len)."""
    query, key, value, tables, lens, _ = make_problem(cupy, rng, batch, seq_len, args)
    return with_options(cupy, query, key, value, tables, lens, dict(max_seq_len=seq_len), args)


def ragged_problem(cupy, name, args):
    """decode_problem for the bench's ragged batch `name` (RAGGED_BATCHES), with both length
    hints as the bench gives them."""
    arrays = ragged_arrays(cupy, ragged_batch(name, args.block_size), args)
    return with_options(cupy, *arrays, args)


def with_options(cupy, query, key, value, tables, lens, options, args):
    """The problem with args' new tokens per sequence and fp8 cache applied."""
    batch = len(lens)
    if args.query_len > 1:
        query = cupy.random.standard_normal((batch * args.query_len,) + query.shape[1:],
                                            dtype=cupy.float32).astype(query.dtype)
        options["query_start_loc"] = np.arange(0, batch * args.query_len + 1, args.query_len,
                                               dtype=np.int32)
    if args.kv_format:
        key, value = (cupa.quantize_fp8(x, args.kv_format, FP8_SCALE) for x in (key, value))
        options.update(kv_format=args.kv_format, k_scale=FP8_SCALE, v_scale=FP8_SCALE)
    return query, key, value, tables, lens, options
