"""`cupa.DecodePlan`: a decode whose kernel, grid, workspace and launches are fixed up front.

A plan is made once (`cupa.plan_decode`, or `cupa.decode`'s own plan cache) and run many times.
Making one converts and validates the arrays, plans the partitions and prepares the launches;
running one on the same kind of arrays (cupy arrays of the planned shapes, dtypes and strides)
re-checks nothing that cannot have changed: it compares the arrays' metadata with the plan's in
one tuple comparison, writes the new pointers into the packed arguments and launches.

A plan covers a maximum batch and length: its grid spans `num_seqs` sequences (and
`max_query_len` new tokens each) with partitions enough for the block tables' full capacity, so
between runs, and between graph replays, the contents of the query, block tables, lengths and
query_start_loc may change freely as long as the arrays keep their shapes (for a captured graph:
their memory). Unused batch slots can be given length 0.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from . import arrays
from .fp8 import check_kv_format, dequantize_fp8, kv_scales
from .gpu.device import device_info
from .gpu.launch import DecodeLaunch, kernel_kv_scales
from .gpu.occupancy import resident_workgroups
from .gpu.planner import make_plan
from .problem import KV_STRIDE_ALIGN_BYTES, DecodeInputs, DecodeOptions, DecodeShape, kv_axes
from .reference import paged_decode_reference
from .selftest import first_use_guard
from .validation import (check_arrays, check_cache_alignment, check_decode_args,
                         check_table_contents, query_lens)


@dataclass(frozen=True)
class HostLengths:
    """What a call's host arrays say about its lengths, for the planner (None where they are on
    the device): the longest sequence and the sum of all lengths (from host block_tables and
    seq_lens), the most new tokens of a sequence (from a host query_start_loc)."""
    longest: int | None = None
    total: int | None = None
    most_new: int | None = None


def convert_inputs(backend: str, raw: tuple) -> DecodeInputs:
    """The one conversion: every array as the backend's kind (zero-copy for device arrays)."""
    convert = arrays.to_device if backend == "gpu" else arrays.to_host
    return DecodeInputs(*(convert(x) for x in raw))


def host_contents(backend: str, raw: tuple) -> dict:
    """The tables whose contents can be checked on the host: the numpy ones, or all of them with
    the numpy backend (device arrays are downloaded there anyway)."""
    named = dict(zip(("block_tables", "seq_lens", "query_start_loc"), raw[3:6]))
    return {k: arrays.to_host(v) for k, v in named.items()
            if v is not None and (backend == "numpy" or not arrays.is_device_array(v))}


def check_inputs(inputs: DecodeInputs, options: DecodeOptions, host: dict,
                 out=None) -> tuple[DecodeShape, HostLengths]:
    """Validate one call. Returns the shape and the lengths read from host (numpy) tables when
    the caller passed those (None otherwise: device contents are never read back, which would
    synchronise)."""
    shape = check_decode_args(
        inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
        inputs.seq_lens, query_start_loc=inputs.query_start_loc, scale=options.scale,
        alibi_slopes=inputs.alibi_slopes, out=out, sliding_window=options.sliding_window,
        logits_soft_cap=options.logits_soft_cap, sinks=inputs.sinks,
        kv_format=options.kv_format, kv_layout=options.kv_layout)
    longest = total = most_new = new_tokens = None
    tables, lens, loc = (host.get(k) for k in ("block_tables", "seq_lens", "query_start_loc"))
    if loc is not None:
        new_tokens = query_lens(shape, loc)
        most_new = int(new_tokens.max(initial=1))
    if tables is not None and lens is not None:
        check_table_contents(shape, tables, lens, new_tokens)
        if shape.num_seqs:
            longest = int(np.max(lens))
            total = int(np.sum(lens, dtype=np.int64))
    return shape, HostLengths(longest=longest, total=total, most_new=most_new)


def device_signature(raw: tuple):
    """(shape, dtype, strides) of every array when all are cupy arrays (None stays None), else
    None: what a run compares with its plan instead of validating again."""
    cupy_ndarray = arrays.cupy_ndarray()
    for x in raw:
        if x is not None and type(x) is not cupy_ndarray:
            return None
    # One list comprehension: half the host time of a loop of appends (it runs on every call).
    return tuple([None if x is None else (x.shape, x.dtype, x.strides) for x in raw])


_FLOAT32 = np.dtype(np.float32)


class DecodePlan:
    """A planned decode; make one with `cupa.plan_decode`, call `run` as often as needed.

    Attributes: `shape` (the planned DecodeShape), `backend`, `options`, and on the GPU `out` and
    `lse` (the plan's own output buffers, returned by `run` unless it is given `out`; None for
    the plans `cupa.decode` keeps, which return new arrays), `partition_size`, `max_partitions`,
    `max_query_len`, `kernel` (the phase-1 kernel's name) and `merge` (how the partitions are
    merged).
    """

    def __init__(self, shape: DecodeShape, backend: str, options: DecodeOptions, *, query_dtype,
                 k_scale, v_scale, max_seq_len=None, total_seq_len=None, max_query_len=1,
                 partition_size=None, own_outputs=True, signature=None):
        self.shape, self.backend, self.options = shape, backend, options
        self.fmt = check_kv_format(options.kv_format)
        self.k_scale = self.v_scale = None  # float32 [num_kv_heads] for an fp8 cache
        if self.fmt is not None:
            self.k_scale = kv_scales(k_scale, shape.num_kv_heads, "k_scale")
            self.v_scale = kv_scales(v_scale, shape.num_kv_heads, "v_scale")
        self.max_query_len = int(max_query_len)
        self.query_dtype = np.dtype(query_dtype)
        self.own_outputs = own_outputs
        self.out = self.lse = None
        self._signature = signature  # the planned arrays' device_signature, when all were cupy
        # What an `out` of run must look like: the query's shape and dtype, C-contiguous.
        rows = (shape.num_tokens, shape.num_heads, shape.head_size)
        item = self.query_dtype.itemsize if query_dtype is not None else 0
        self._out_signature = (rows, np.dtype(query_dtype),
                               (item * rows[1] * rows[2], item * rows[2], item))
        self._out_shape, self._lse_shape = rows, rows[:2]
        self._launch_plan = None
        if backend != "gpu":
            return
        cupy = arrays.cupy_module()
        info = device_info()
        self._launch_plan = make_plan(shape, info.multiprocessors, arch=info.target.arch,
                                      partition_size=partition_size, max_seq_len=max_seq_len,
                                      total_seq_len=total_seq_len,
                                      max_query_len=self.max_query_len,
                                      residency=lambda v: resident_workgroups(v, info),
                                      trusted=first_use_guard(info))
        self._launch = DecodeLaunch(self._launch_plan, shape, info.index)
        scales = kernel_kv_scales(self._launch_plan, self.fmt, self.k_scale, self.v_scale,
                                  info.index)
        self._scales_ptr = 0 if scales is None else scales.data.ptr
        self._scales = scales  # kept alive with the plan
        self._workspace = None
        if own_outputs:
            self.out = cupy.empty(self._out_shape, dtype=query_dtype)
            self._workspace = self._launch.new_workspace()
            if options.return_lse:
                self.lse = cupy.empty(self._lse_shape, dtype=np.float32)
        self._lock = threading.Lock()  # the packed arguments are shared by the plan's runs

    @property
    def partition_size(self) -> int | None:
        return self._launch_plan.partition_size if self._launch_plan else None

    @property
    def max_partitions(self) -> int | None:
        return self._launch_plan.max_partitions if self._launch_plan else None

    @property
    def kernel(self) -> str | None:
        return self._launch_plan.variant.partition_name if self._launch_plan else None

    @property
    def merge(self) -> str | None:
        """How the partitions are merged: "single" (one partition, no merge), "cluster" (on
        chip, within thread-block clusters) or "reduce" (the reduce launch)."""
        plan = self._launch_plan
        if plan is None:
            return None
        return "single" if plan.single_partition else "cluster" if plan.cluster_merge else "reduce"

    @property
    def signature(self):
        """The planned arrays' `device_signature` (None unless they were all cupy arrays)."""
        return self._signature

    def run(self, query, key_cache, value_cache, block_tables, seq_lens, *, query_start_loc=None,
            alibi_slopes=None, sinks=None, out=None, stream=None):
        """Decode with the plan's kernel, grid and workspace. The arrays must have the planned
        shapes and dtypes (and alibi_slopes / sinks / query_start_loc exactly when planned).
        Returns `out`, or (out, lse) if the plan was made with return_lse. Without `out` the
        result is the plan's own buffer (overwritten by the next run), or a new array for the
        plans `cupa.decode` keeps. The result is the same kind of array as `query`."""
        raw = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
               alibi_slopes, sinks)
        if self.backend == "gpu" and self._signature is not None:
            fast = device_signature(raw + (out,))
            if fast is not None and fast[:-1] == self._signature and (
                    out is None or fast[-1] == self._out_signature):
                return self.run_matched(raw, out, stream)
        check_arrays(raw, out)
        inputs = convert_inputs(self.backend, raw)
        device_out = out is not None and arrays.is_device_array(out)
        out_view = arrays.to_device(out) if device_out else out
        shape, lengths = check_inputs(inputs, self.options, host_contents(self.backend, raw),
                                      out_view)
        self._check_matches_plan(shape, lengths.most_new)
        if self.backend != "gpu":
            return self._finish(query, out, *self._reference(inputs))
        result = self.run_matched(inputs.as_tuple(), out_view if device_out else None, stream)
        lse = None
        if self.options.return_lse:
            result, lse = result
        if out is None:
            result = arrays.like(query, result)
        else:
            if not device_out:  # a host `out` is filled from the device result
                out[...] = arrays.to_host(result)
            result = out
        return (result, arrays.like(query, lse)) if self.options.return_lse else result

    def run_matched(self, raw: tuple, out=None, stream=None):
        """`run` for the eight arrays of problem.INPUT_NAMES (None where absent) already known
        to match the plan: cupy arrays whose device_signature equals `signature`, and an `out` of the
        query's shape and dtype, C-contiguous (cupa.decode's plan cache has compared them).
        Nothing is checked here."""
        cupy = arrays.cupy_module()
        if stream is not None:
            with stream:
                return self.run_matched(raw, out, None)
        stream_ptr = cupy.cuda.get_current_stream().ptr
        lse, workspace = self.lse, self._workspace
        if not self.own_outputs:  # a plan of cupa.decode: new buffers on this stream per call
            # cupy.ndarray itself, with the shape and dtype objects made once: cupy.empty's
            # argument handling was about a fifth of a cached decode call's Python.
            if out is None:
                out = cupy.ndarray(self._out_shape, self.query_dtype)
            if self.options.return_lse:
                lse = cupy.ndarray(self._lse_shape, _FLOAT32)
            workspace = self._launch.new_workspace()
        elif out is None:
            out = self.out
        pointers = (out.data.ptr, 0 if lse is None else lse.data.ptr,
                    *self._launch.partial_pointers(workspace),
                    raw[0].data.ptr, raw[1].data.ptr, raw[2].data.ptr, self._scales_ptr,
                    raw[3].data.ptr, raw[4].data.ptr,
                    0 if raw[5] is None else raw[5].data.ptr,
                    0 if raw[6] is None else raw[6].data.ptr,
                    0 if raw[7] is None else raw[7].data.ptr)
        if (pointers[6] | pointers[7]) % KV_STRIDE_ALIGN_BYTES:  # what the signature cannot see
            check_cache_alignment("key_cache", pointers[6])
            check_cache_alignment("value_cache", pointers[7])
        with self._lock:
            self._launch(pointers, stream_ptr)
        return (out, lse) if self.options.return_lse else out

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

    def _finish(self, query, out, result, lse):
        """The numpy backend's result as the caller's kind of array, or in the caller's out."""
        if out is None:
            result = arrays.like(query, result)
        elif arrays.is_device_array(out):
            arrays.to_device(out)[...] = arrays.to_device(result)
            result = out
        else:
            out[...] = result
            result = out
        return (result, arrays.like(query, lse)) if self.options.return_lse else result

    def _reference(self, inputs: DecodeInputs):
        key_cache, value_cache = inputs.key_cache, inputs.value_cache
        if self.fmt is not None:  # the oracle works on the dequantised cache
            per_head = [1, 1, 1, 1]
            per_head[kv_axes(self.options.kv_layout)[0]] = -1
            key_cache = dequantize_fp8(key_cache, self.fmt.name, self.k_scale.reshape(per_head))
            value_cache = dequantize_fp8(value_cache, self.fmt.name,
                                         self.v_scale.reshape(per_head))
        out, lse = paged_decode_reference(
            inputs.query, key_cache, value_cache, inputs.block_tables, inputs.seq_lens,
            query_start_loc=inputs.query_start_loc, scale=self.shape.scale,
            alibi_slopes=inputs.alibi_slopes, sliding_window=self.options.sliding_window,
            logits_soft_cap=self.options.logits_soft_cap, sinks=inputs.sinks,
            kv_layout=self.options.kv_layout)
        lse = lse.astype(np.float32) if self.options.return_lse else None
        return out.astype(inputs.query.dtype), lse
