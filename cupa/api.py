"""`cupa.decode` and `cupa.plan_decode`.

The data flow: arrays in -> one conversion -> validation -> plan (cached) -> compiled variant ->
launch -> arrays out. `decode` is a plan plus its `run`: a call on cupy arrays whose shapes,
dtypes, strides and options were seen before takes the cached plan and only launches.
"""

from __future__ import annotations

import threading

import numpy as np

from . import arrays
from .decode_plan import (DecodePlan, check_inputs, convert_inputs, device_signature,
                          host_contents)
from .fp8 import check_kv_format
from .gpu import dispatch
from .problem import MAX_QUERY_LEN, DecodeOptions, default_max_query_len
from .validation import check_arrays, check_kv_layout, check_partition_size

# Plans kept by `decode`, most recent last. A plan holds no device memory but its fp8 factors
# (outputs and workspace are allocated per call), so the bound is about host memory only.
PLAN_CACHE_SIZE = 256
_plans: dict = {}
_plans_lock = threading.Lock()

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


def decode(query, key_cache, value_cache, block_tables, seq_lens, *, query_start_loc=None,
           max_query_len=None, scale=None, alibi_slopes=None, sliding_window=None,
           logits_soft_cap=None, sinks=None, kv_format=None, k_scale=None, v_scale=None,
           kv_layout=None, out=None, return_lse=False, partition_size=None, max_seq_len=None,
           total_seq_len=None, stream=None, backend=None):
    """Paged decode attention: each new query token against its sequence's cached K/V.

    query         [num_tokens, num_heads, head_size], float16 / bfloat16 (ml_dtypes) / float32:
                  one new token per sequence (num_tokens = num_seqs), or several per sequence
                  with query_start_loc
    key_cache     [num_blocks, num_kv_heads, block_size, head_size] ("HND"), or with kv_layout
                  "NHD" [num_blocks, block_size, num_kv_heads, head_size]; same dtype as query
                  (or uint8 fp8 codes with kv_format). Strided views are read in place (K and V
                  halves of one allocation, say): each row of head_size elements contiguous,
                  every other stride a positive multiple of 16 bytes
    value_cache   same shape, dtype and strides as key_cache
    block_tables  int32 [num_seqs, max_blocks_per_seq]: block ids of each sequence, in order
    seq_lens      int32 [num_seqs]: tokens of each sequence, its new tokens included (0 gives
                  zero rows, lse = -inf)
    query_start_loc  int32 [num_seqs + 1]: multi-token decode (speculative decoding). Sequence s
                  owns query rows query_start_loc[s] .. query_start_loc[s + 1] - 1, 1 to 16 of
                  them; its token i of q_len sits at position p = seq_len - q_len + i and sees
                  positions <= p (causal among the new tokens). A workgroup applies each K/V
                  row it reads to all its (new token, head) rows: up to 64 on the tensor-core
                  path, 8 on the portable one (README, "Multi-token decode").
    max_query_len the most new tokens of any sequence; only needed when query_start_loc is on
                  the device (default: the most its shape allows, at most 16). Host arrays are
                  read instead. A too small value leaves rows unwritten.
    scale         logit scale, default head_size ** -0.5
    alibi_slopes  float32 [num_heads]: adds slope * (j - p) to the logit of position j
    sliding_window  W: each token attends only to its last W positions (j > p - W); work and
                  bytes scale with W, not with seq_len
    logits_soft_cap c: logits become c * tanh(logit / c) before the softmax (Gemma 2 style;
                  applied to scale * q.k, before ALiBi)
    sinks         float32 [num_heads]: one extra logit per head that joins the softmax
                  denominator only (an "attention sink"; a length-0 sequence then has lse = sink)
    kv_format     None (the cache holds the query dtype), 'fp8_e4m3' (OCP e4m3fn) or
                  'fp8_e4m3fnuz' (AMD MI300): the caches hold uint8 codes, value = code * scale;
                  float16 / bfloat16 queries only. See `cupa.quantize_fp8`.
    k_scale, v_scale  fp8 scales of K and V: a float, or float32 [num_kv_heads] per KV head
                  (default 1.0)
    kv_layout     the caches' dimension order: "HND" (None, the default) or "NHD"
    out           optional output array to fill (same shape and dtype as query)
    return_lse    also return float32 [num_tokens, num_heads], the natural log of the softmax
                  denominator (scale and ALiBi included)
    partition_size  tokens per phase-1 partition (default: chosen to fill the device)
    max_seq_len   optional hint of the longest seq_len, used only to choose partitions (a wrong
                  hint costs speed, never correctness)
    total_seq_len optional hint of the sum of seq_lens, likewise only for partitions: below
                  num_seqs x max_seq_len the batch is ragged, and the long sequences get more
                  partitions (docs/performance.md, "Ragged batches"). Host seq_lens and
                  block_tables give both hints by themselves. Like every option it is part of
                  the plan cache's key, so a loop whose total changes every step should round it
                  (as the example engine rounds max_seq_len to 256 tokens).
    stream        cupy stream to launch on (default: the current stream). As with any CUDA
                  stream, the caller orders the work that produced the inputs before it (a
                  non-blocking stream does not wait for the default stream's copies); cupa's own
                  buffers are allocated on it.
    backend       'gpu', 'numpy' or None (GPU when available)

    Returns `out` (and `lse`) as the same kind of array as `query`: numpy in -> numpy out, cupy
    in -> cupy out, another library's device tensor -> that library's tensor via DLPack.

    On the GPU, device-resident tables are not read back for checking (that would synchronise);
    the kernels instead never read past seq_len or the table's capacity, and treat block ids
    outside [0, num_blocks) as empty. Host (numpy) tables are checked fully.
    """
    raw = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
           alibi_slopes, sinks)
    key = _cache_key(raw, out, backend, k_scale, v_scale,
                     (scale, sliding_window, logits_soft_cap, kv_format, kv_layout, return_lse,
                      partition_size, max_seq_len, total_seq_len, max_query_len))
    try:
        plan = _plans.get(key) if key is not None else None
    except TypeError:  # an unhashable option: not cached (validation will name it)
        key = plan = None
    if plan is not None:
        return plan.run_matched(raw, out, stream)
    # Planning allocates nothing for a decode plan; the outputs and workspace of each call are
    # allocated under the launch stream, so the memory pool hands their blocks on only to work
    # ordered after the launch.
    plan, inputs = _plan(raw, query_start_loc=query_start_loc, max_query_len=max_query_len,
                         scale=scale, sliding_window=sliding_window,
                         logits_soft_cap=logits_soft_cap, kv_format=kv_format, k_scale=k_scale,
                         v_scale=v_scale, kv_layout=kv_layout, out=out, return_lse=return_lse,
                         partition_size=partition_size, max_seq_len=max_seq_len,
                         total_seq_len=total_seq_len, backend=backend, own_outputs=False)
    if key is not None:
        _remember(key, plan)
        return plan.run_matched(raw, out, stream)
    # Host arrays: run on their converted (uploaded) copies, and answer in the caller's kind.
    converted = inputs.as_tuple()
    result = plan.run(*converted[:5], query_start_loc=converted[5], alibi_slopes=converted[6],
                      sinks=converted[7], out=out, stream=stream)
    if return_lse:
        result, lse = result
        return (result if out is not None else arrays.like(query, result),
                arrays.like(query, lse))
    return result if out is not None else arrays.like(query, result)


def plan_decode(query, key_cache, value_cache, block_tables, seq_lens, *, query_start_loc=None,
                max_query_len=None, scale=None, alibi_slopes=None, sliding_window=None,
                logits_soft_cap=None, sinks=None, kv_format=None, k_scale=None, v_scale=None,
                kv_layout=None, return_lse=False, partition_size=None, max_seq_len=None,
                total_seq_len=None, backend=None) -> DecodePlan:
    """Fix a decode's kernel, grid, workspace and output buffers for repeated runs and graph
    capture; returns a `cupa.DecodePlan` whose `run(query, key_cache, value_cache, block_tables,
    seq_lens, query_start_loc=..., alibi_slopes=..., sinks=...)` decodes.

    Arguments as for `cupa.decode`; the arrays give the shapes and dtypes (a maximum batch, and
    block tables as wide as the longest sequence may get), and their contents only feed the
    length hints when they are host arrays. scale, sliding_window, logits_soft_cap, kv_format,
    k_scale, v_scale, kv_layout, return_lse and partition_size are fixed by the plan, and so are
    the caches' strides; whether alibi_slopes, sinks and query_start_loc are given is fixed too
    (their contents may change between runs).

    Graph capture (cupy): make the plan, run it once outside the capture (this compiles the
    kernels), then capture `plan.run(...)` on a non-default stream; replaying the graph decodes
    whatever the captured arrays hold at that time. max_seq_len (a hint for partitioning)
    should then be the longest length the graph will see, and total_seq_len, if given, a typical
    sum of the lengths.
    """
    raw = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
           alibi_slopes, sinks)
    plan, _ = _plan(raw, query_start_loc=query_start_loc, max_query_len=max_query_len,
                    scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                    kv_format=kv_format, k_scale=k_scale, v_scale=v_scale,
                    kv_layout=kv_layout, out=None,
                    return_lse=return_lse, partition_size=partition_size,
                    max_seq_len=max_seq_len, total_seq_len=total_seq_len, backend=backend,
                    own_outputs=True)
    return plan


def clear_plan_cache() -> None:
    """Forget the plans `cupa.decode` keeps (for tests, and after changing CUPA_* switches)."""
    with _plans_lock:
        _plans.clear()


def _scale_key(scale):
    """A hashable stand-in for an fp8 scale argument, or a marker that it has none."""
    if scale is None or isinstance(scale, (int, float, np.floating, np.integer)):
        return scale
    if isinstance(scale, np.ndarray):
        return (scale.dtype.str, scale.shape, scale.tobytes())
    return _UNCACHEABLE


_UNCACHEABLE = object()


def _cache_key(raw, out, backend, k_scale, v_scale, options: tuple):
    """The plan cache's key for a call (`options`: its other keyword arguments), or None where
    a call is not cached: host arrays (their contents are checked and uploaded on every call),
    the numpy backend, device scale arrays."""
    if backend not in (None, "gpu") or not arrays.gpu_available():
        return None
    signature = device_signature(raw + (out,))
    if signature is None:
        return None
    if k_scale is not None or v_scale is not None:  # fp8 scales, as hashable stand-ins
        k_scale, v_scale = _scale_key(k_scale), _scale_key(v_scale)
        if k_scale is _UNCACHEABLE or v_scale is _UNCACHEABLE:
            return None
    # Hashed once, by the lookup in `decode` (an unhashable option makes it uncached there).
    return (signature, options, k_scale, v_scale, arrays.cupy_module().cuda.runtime.getDevice(),
            dispatch.switches())


def _remember(key, plan) -> None:
    with _plans_lock:
        if len(_plans) >= PLAN_CACHE_SIZE:
            _plans.pop(next(iter(_plans)))
        _plans[key] = plan


def _plan(raw, *, query_start_loc, max_query_len, scale, sliding_window, logits_soft_cap,
          kv_format, k_scale, v_scale, kv_layout, out, return_lse, partition_size,
          max_seq_len, total_seq_len, backend, own_outputs):
    """Shared front half of `decode` and `plan_decode`: arrays in -> one conversion ->
    validation -> plan. Returns (plan, converted inputs)."""
    check_arrays(raw, out)
    check_partition_size(partition_size)
    backend = resolve_backend(backend)
    fmt = check_kv_format(kv_format)
    kv_layout = check_kv_layout(kv_layout)
    if fmt is None and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale / v_scale: only meaningful with an fp8 kv_format")
    inputs = convert_inputs(backend, raw)
    options = DecodeOptions(scale=scale, sliding_window=sliding_window,
                            logits_soft_cap=logits_soft_cap,
                            kv_format=None if fmt is None else fmt.name,
                            return_lse=bool(return_lse), kv_layout=kv_layout)
    out_view = arrays.to_device(out) if out is not None and arrays.is_device_array(out) else out
    shape, lengths = check_inputs(inputs, options, host_contents(backend, raw), out_view)
    if max_seq_len is None:
        max_seq_len = lengths.longest
    if total_seq_len is None:
        total_seq_len = lengths.total
    most_new = lengths.most_new
    if max_query_len is not None:
        if isinstance(max_query_len, bool) or int(max_query_len) != max_query_len \
                or not 1 <= int(max_query_len) <= MAX_QUERY_LEN:
            raise ValueError(f"max_query_len: must be an int from 1 to {MAX_QUERY_LEN}, got "
                             f"{max_query_len!r}")
    if most_new is None:  # query_start_loc is on the device (or absent)
        most_new = (default_max_query_len(shape) if max_query_len is None
                    else int(max_query_len))
    plan = DecodePlan(shape, backend, options, query_dtype=inputs.query.dtype, k_scale=k_scale,
                      v_scale=v_scale, max_seq_len=max_seq_len, total_seq_len=total_seq_len,
                      max_query_len=most_new,
                      partition_size=partition_size, own_outputs=own_outputs,
                      signature=device_signature(raw) if backend == "gpu" else None)
    return plan, inputs
