"""`cupa.DecodePlan`: a decode whose kernel, grid, workspace and output buffers are fixed up front.

`cupa.decode` builds a one-shot plan per call. Keeping a plan instead (`cupa.plan_decode`) serves
two needs: repeated decodes without per-call planning and allocation, and CUDA/HIP graph capture,
where every launch argument (pointers, grid, scalars) is frozen into the graph. A plan covers a
maximum batch and length: its grid spans `num_seqs` sequences (and `max_query_len` new tokens
each) with partitions enough for the block tables' full capacity, so between graph replays the
contents of the query, block tables, lengths and query_start_loc may change freely, as long as
the arrays themselves (their memory) stay the same. Unused batch slots can be given length 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import arrays
from .fp8 import check_kv_format, dequantize_fp8, kv_scales
from .validation import (DecodeShape, MAX_QUERY_LEN, check_decode_args, check_table_contents,
                         query_lens)


@dataclass
class DecodeInputs:
    """The arrays of one call, as the backend's kind (cupy or numpy)."""

    query: object
    key_cache: object
    value_cache: object
    block_tables: object
    seq_lens: object
    query_start_loc: object = None
    alibi_slopes: object = None
    sinks: object = None


@dataclass(frozen=True)
class DecodeOptions:
    """What a plan fixes besides shapes: scalars and the presence of the optional arrays."""

    scale: float | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    kv_format: str | None = None
    return_lse: bool = False


def convert_inputs(backend, query, key_cache, value_cache, block_tables, seq_lens,
                   query_start_loc=None, alibi_slopes=None, sinks=None) -> DecodeInputs:
    convert = arrays.to_device if backend == "gpu" else arrays.to_host
    return DecodeInputs(*(convert(x) for x in (query, key_cache, value_cache, block_tables,
                                               seq_lens, query_start_loc, alibi_slopes, sinks)))


def check_inputs(inputs: DecodeInputs, options: DecodeOptions, host_arrays: dict,
                 out=None) -> tuple[DecodeShape, int | None, int | None]:
    """Validate one call. Returns (shape, longest sequence, most new tokens), the last two read
    from host (numpy) arrays when the caller passed those, else None: device contents are never
    read back (no synchronisation)."""
    shape = check_decode_args(
        inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
        inputs.seq_lens, query_start_loc=inputs.query_start_loc, scale=options.scale,
        alibi_slopes=inputs.alibi_slopes, out=out, sliding_window=options.sliding_window,
        logits_soft_cap=options.logits_soft_cap, sinks=inputs.sinks,
        kv_format=options.kv_format)
    longest = most_new = new_tokens = None
    tables, lens, loc = (host_arrays.get(k) for k in ("block_tables", "seq_lens",
                                                       "query_start_loc"))
    if loc is not None:
        new_tokens = query_lens(shape, loc)
        most_new = int(new_tokens.max(initial=1))
    if tables is not None and lens is not None:
        check_table_contents(shape, tables, lens, new_tokens)
        if shape.num_seqs:
            longest = int(np.max(lens))
    return shape, longest, most_new


def host_arrays_of(backend, **named) -> dict:
    """The named arguments that can be checked on the host: the numpy ones, or all of them with
    the numpy backend (device arrays are downloaded there anyway)."""
    return {k: arrays.to_host(v) for k, v in named.items()
            if v is not None and (backend == "numpy" or not arrays.is_device_array(v))}


class DecodePlan:
    """A planned decode; make one with `cupa.plan_decode`, call `run` as often as needed.

    Attributes: `shape` (the planned DecodeShape), `backend`, `options`, and on the GPU `out` and
    `lse` (the plan's own output buffers, returned by `run` unless it is given `out`),
    `partition_size`, `max_partitions`, `max_query_len`, `kernel` (the phase-1 kernel's name) and
    `merge` (how the partitions are merged).
    """

    def __init__(self, shape: DecodeShape, backend: str, options: DecodeOptions, *, query_dtype,
                 k_scale, v_scale, max_seq_len=None, max_query_len=1, partition_size=None,
                 own_outputs=True):
        self.shape, self.backend, self.options = shape, backend, options
        self.fmt = check_kv_format(options.kv_format)
        self.k_scale = self.v_scale = None  # float32 [num_kv_heads] for an fp8 cache
        if self.fmt is not None:
            self.k_scale = kv_scales(k_scale, shape.num_kv_heads, "k_scale")
            self.v_scale = kv_scales(v_scale, shape.num_kv_heads, "v_scale")
        self.max_query_len = int(max_query_len)
        self.out = self.lse = None
        if backend != "gpu":
            return
        from .device import device_info
        from .gpu import allocate_workspace, kernel_kv_scales
        from .occupancy import resident_workgroups
        from .plan import make_plan
        cupy = arrays.cupy_module()
        info = device_info()
        self._device_index = info.index
        self._launch_plan = make_plan(shape, info.multiprocessors, arch=info.target.arch,
                                      partition_size=partition_size, max_seq_len=max_seq_len,
                                      max_query_len=self.max_query_len,
                                      residency=lambda v: resident_workgroups(v, info))
        self._workspace = allocate_workspace(self._launch_plan, shape)
        self._kv_scales = kernel_kv_scales(self._launch_plan, self.fmt, self.k_scale,
                                           self.v_scale, info.index)
        if own_outputs:
            self.out = cupy.empty((shape.num_tokens, shape.num_heads, shape.head_size),
                                  dtype=query_dtype)
        if options.return_lse:
            self.lse = cupy.empty((shape.num_tokens, shape.num_heads), dtype=np.float32)

    @property
    def partition_size(self) -> int | None:
        return self._launch_plan.partition_size if self.backend == "gpu" else None

    @property
    def max_partitions(self) -> int | None:
        return self._launch_plan.max_partitions if self.backend == "gpu" else None

    @property
    def kernel(self) -> str | None:
        return self._launch_plan.variant.partition_name if self.backend == "gpu" else None

    @property
    def merge(self) -> str | None:
        """How the partitions are merged: "single" (one partition, no merge), "cluster" (on
        chip, within thread-block clusters) or "reduce" (the reduce launch)."""
        if self.backend != "gpu":
            return None
        plan = self._launch_plan
        return "single" if plan.single_partition else "cluster" if plan.cluster_merge else "reduce"

    def run(self, query, key_cache, value_cache, block_tables, seq_lens, *, query_start_loc=None,
            alibi_slopes=None, sinks=None, out=None, stream=None):
        """Decode with the plan's kernel, grid and workspace. The arrays must have the planned
        shapes and dtypes (and alibi_slopes / sinks / query_start_loc exactly when planned).
        Returns `out`, or (out, lse) if the plan was made with return_lse; without `out` the
        result is the plan's own buffer, overwritten by the next run."""
        inputs = convert_inputs(self.backend, query, key_cache, value_cache, block_tables,
                                seq_lens, query_start_loc, alibi_slopes, sinks)
        host = host_arrays_of(self.backend, block_tables=block_tables, seq_lens=seq_lens,
                              query_start_loc=query_start_loc)
        device_out = out is not None and arrays.is_device_array(out)
        out_view = arrays.to_device(out) if device_out else out
        shape, _, most_new = check_inputs(inputs, self.options, host, out_view)
        self._check_matches_plan(shape, most_new)
        return self._execute(inputs, query, out, out_view if device_out else None, stream)

    # --- internals ---------------------------------------------------------------------------

    def _check_matches_plan(self, shape: DecodeShape, most_new):
        """Shapes, dtypes and options as planned; lengths need no check (the grid covers the
        tables' whole capacity)."""
        if shape != self.shape:
            changed = [f"{k}: planned {v!r}, got {getattr(shape, k)!r}"
                       for k, v in vars(self.shape).items() if getattr(shape, k) != v]
            raise ValueError("DecodePlan.run: the arguments do not match the plan ("
                             + "; ".join(changed) + "); make a new plan with cupa.plan_decode")
        if most_new is not None and most_new > self.max_query_len:
            raise ValueError(f"query_start_loc: a sequence has {most_new} new tokens, more than "
                             f"the plan's max_query_len={self.max_query_len}")

    def _execute(self, inputs: DecodeInputs, query, out, device_out, stream):
        if self.backend == "gpu":
            result, lse = self._launch(inputs, device_out, stream)
        else:
            result, lse = self._reference(inputs)
        if out is None:
            result = arrays.like(query, result)
        else:
            if device_out is not None and result is not device_out:
                device_out[...] = arrays.to_device(result)
            elif device_out is None:
                out[...] = arrays.to_host(result)
            result = out
        return (result, arrays.like(query, lse)) if self.options.return_lse else result

    def _launch(self, inputs: DecodeInputs, device_out, stream):
        from .gpu import launch
        cupy = arrays.cupy_module()
        target = device_out if device_out is not None else self.out
        with stream if stream is not None else cupy.cuda.get_current_stream():
            if target is None:  # a one-shot plan without own buffers: on the launch stream
                target = cupy.empty(inputs.query.shape, dtype=inputs.query.dtype)
            launch(self._launch_plan, self.shape, self._workspace, self._device_index,
                   out=target, lse=self.lse, query=inputs.query, key_cache=inputs.key_cache,
                   value_cache=inputs.value_cache, kv_scales=self._kv_scales,
                   block_tables=inputs.block_tables, seq_lens=inputs.seq_lens,
                   query_start_loc=inputs.query_start_loc, alibi_slopes=inputs.alibi_slopes,
                   sinks=inputs.sinks)
        return target, self.lse

    def _reference(self, inputs: DecodeInputs):
        from .reference import paged_decode_reference
        key_cache, value_cache = inputs.key_cache, inputs.value_cache
        if self.fmt is not None:  # the oracle works on the dequantised cache
            per_head = (1, -1, 1, 1)
            key_cache = dequantize_fp8(key_cache, self.fmt.name, self.k_scale.reshape(per_head))
            value_cache = dequantize_fp8(value_cache, self.fmt.name,
                                         self.v_scale.reshape(per_head))
        out, lse = paged_decode_reference(
            inputs.query, key_cache, value_cache, inputs.block_tables, inputs.seq_lens,
            query_start_loc=inputs.query_start_loc, scale=self.shape.scale,
            alibi_slopes=inputs.alibi_slopes, sliding_window=self.options.sliding_window,
            logits_soft_cap=self.options.logits_soft_cap, sinks=inputs.sinks)
        lse = lse.astype(np.float32) if self.options.return_lse else None
        return out.astype(inputs.query.dtype), lse


def default_max_query_len(shape: DecodeShape) -> int:
    """Most new tokens a sequence can have when query_start_loc lives on the device: every
    sequence has at least one, so none has more than num_tokens - num_seqs + 1."""
    if not shape.multi_token:
        return 1
    return max(1, min(MAX_QUERY_LEN, shape.num_tokens - shape.num_seqs + 1))
