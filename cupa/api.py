"""`cupa.decode`: arrays in -> validation -> backend (GPU kernels or numpy reference) -> arrays out."""

from __future__ import annotations

import numpy as np

from . import arrays
from .validation import check_decode_args, check_table_contents

BACKENDS = ("gpu", "numpy")


def resolve_backend(backend: str | None) -> str:
    """'gpu' when cupy sees a device (or when asked), else 'numpy'."""
    if backend is None:
        return "gpu" if arrays.gpu_available() else "numpy"
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "gpu" and not arrays.gpu_available():
        raise RuntimeError("backend='gpu' but no GPU is usable (is cupy installed and a device "
                           "visible? `python -m cupa info` tells)")
    return backend


def decode(query, key_cache, value_cache, block_tables, seq_lens, *, scale=None,
           alibi_slopes=None, sliding_window=None, logits_soft_cap=None, sinks=None, out=None,
           return_lse=False, partition_size=None, max_seq_len=None, stream=None, backend=None):
    """Paged decode attention: one new query token per sequence against its cached K/V.

    query         [num_seqs, num_heads, head_size], float16 / bfloat16 (ml_dtypes) / float32
    key_cache     [num_blocks, num_kv_heads, block_size, head_size], same dtype as query
    value_cache   same shape and dtype as key_cache
    block_tables  int32 [num_seqs, max_blocks_per_seq]: block ids of each sequence, in order
    seq_lens      int32 [num_seqs]: tokens of each sequence (0 gives a zero row, lse = -inf)
    scale         logit scale, default head_size ** -0.5
    alibi_slopes  float32 [num_heads]: adds slope * (j - (seq_len - 1)) to the logit of token j
    sliding_window  W: attend only to the last W positions (j >= seq_len - W); work and bytes
                  scale with W, not with seq_len
    logits_soft_cap c: logits become c * tanh(logit / c) before the softmax (Gemma 2 style;
                  applied to scale * q.k, before ALiBi)
    sinks         float32 [num_heads]: one extra logit per head that joins the softmax
                  denominator only (an "attention sink"; a length-0 sequence then has lse = sink)
    out           optional output array to fill (same shape and dtype as query)
    return_lse    also return float32 [num_seqs, num_heads], the natural log of the softmax
                  denominator (scale and ALiBi included)
    partition_size  tokens per phase-1 partition (default: chosen to fill the device)
    max_seq_len   optional hint of the longest seq_len, used only to choose partitions (a wrong
                  hint costs speed, never correctness)
    stream        cupy stream to launch on (default: the current stream)
    backend       'gpu', 'numpy' or None (GPU when available)

    Returns `out` (and `lse`) as the same kind of array as `query`: numpy in -> numpy out, cupy
    in -> cupy out, another library's device tensor -> that library's tensor via DLPack.

    On the GPU, device-resident tables are not read back for checking (that would synchronise);
    the kernels instead never read past seq_len or the table's capacity, and treat block ids
    outside [0, num_blocks) as empty. Host (numpy) tables are checked fully.
    """
    backend = resolve_backend(backend)
    inputs = (query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, sinks)
    host_tables = not arrays.is_device_array(block_tables) and not arrays.is_device_array(seq_lens)
    convert = arrays.to_device if backend == "gpu" else arrays.to_host
    q, k, v, tables, lens, slopes, sink_logits = (convert(x) for x in inputs)
    device_out = out is not None and arrays.is_device_array(out)
    out_view = arrays.to_device(out) if device_out else out

    shape = check_decode_args(q, k, v, tables, lens, scale=scale, alibi_slopes=slopes,
                              out=out_view, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, sinks=sink_logits)
    if host_tables or backend == "numpy":
        host_lens = arrays.to_host(seq_lens)
        check_table_contents(shape, arrays.to_host(block_tables), host_lens)
        if max_seq_len is None and shape.num_seqs:
            max_seq_len = int(np.max(host_lens))

    if backend == "gpu":
        from .gpu import decode_gpu
        cupy = arrays.cupy_module()
        with stream if stream is not None else cupy.cuda.get_current_stream():
            result, lse = decode_gpu(q, k, v, tables, lens, shape, alibi_slopes=slopes,
                                     sinks=sink_logits, out=out_view if device_out else None,
                                     return_lse=return_lse, partition_size=partition_size,
                                     max_seq_len=max_seq_len)
    else:
        from .reference import paged_decode_reference
        ref_out, ref_lse = paged_decode_reference(
            q, k, v, tables, lens, scale=shape.scale, alibi_slopes=slopes,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sink_logits)
        result = ref_out.astype(q.dtype)
        lse = ref_lse.astype(np.float32) if return_lse else None

    if out is None:
        result = arrays.like(query, result)
    else:
        if device_out and result is not out_view:
            out_view[...] = arrays.to_device(result)
        elif not device_out:
            out[...] = arrays.to_host(result)
        result = out
    return (result, arrays.like(query, lse)) if return_lse else result
