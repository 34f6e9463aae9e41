"""Argument checks for `cupa.decode`: shapes, dtypes and (for host arrays) contents.

Every error names the argument, what was expected and what arrived. The checks here read only
metadata (shape, dtype, strides), so they cost nothing on device arrays; `check_table_contents`
reads values and is run only on host (numpy) tables, where it needs no device synchronisation.
"""

from __future__ import annotations

import numpy as np

from .problem import (DEFAULT_KV_LAYOUT, FP8_QUERY_DTYPES, INPUT_NAMES, KV_LAYOUTS,
                      KV_STRIDE_ALIGN_BYTES, MAX_KV_BLOCK_STRIDE_BYTES, MAX_KV_TOKEN_STRIDE,
                      MAX_QUERY_LEN, REQUIRED_INPUTS, SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES,
                      SUPPORTED_HEAD_SIZES, DecodeShape, kv_axes)

# numpy builds a dtype's name anew on every access (~10 us per decode call for the six arrays
# validated): names are remembered per dtype object.
_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """'float16' / 'bfloat16' / 'float32' / ... for numpy, ml_dtypes and cupy dtypes alike."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
        return name
    except TypeError:  # an unhashable dtype-like
        return np.dtype(dtype).name


# What makes an object an array argument besides shape and dtype: the interchange protocols.
ARRAY_PROTOCOLS = ("__cuda_array_interface__", "__dlpack__", "__array_interface__", "__array__")


def check_is_array(name, x):
    """A TypeError for what cannot be an array argument: None, strings, mappings, objects
    without shape and dtype. Lists, tuples and numbers are converted like numpy does."""
    if isinstance(x, (list, tuple, int, float, np.generic)):
        return
    array_like = (hasattr(x, "shape") and hasattr(x, "dtype")) or any(
        hasattr(x, protocol) for protocol in ARRAY_PROTOCOLS)
    if x is None or isinstance(x, (str, bytes, dict)) or not array_like:
        raise TypeError(f"{name}: expected an array (numpy, cupy or a DLPack / CUDA array "
                        f"interface tensor), got {type(x).__name__}")


def check_arrays(raw: tuple, out=None) -> None:
    """check_is_array on a call's arrays (the eight of problem.INPUT_NAMES, None where an
    optional one is absent) and its `out`."""
    for index, (name, x) in enumerate(zip(INPUT_NAMES, raw)):
        if x is not None or index < REQUIRED_INPUTS:
            check_is_array(name, x)
    if out is not None:
        check_is_array("out", out)


def _number(value, kind):
    """int(value) or float(value), or None where it is no number (the caller's check then
    names the argument: 'sliding_window: must be a positive int ...')."""
    if isinstance(value, (str, bytes)):
        return float("nan") if kind is float else None
    try:
        return kind(value)
    except (TypeError, ValueError):
        return float("nan") if kind is float else None


def check_partition_size(partition_size) -> None:
    """A forced partition size: a positive int or None (checked on every backend)."""
    if partition_size is None:
        return
    if isinstance(partition_size, bool) or _number(partition_size, int) != partition_size \
            or int(partition_size) < 1:
        raise ValueError(f"partition_size: must be a positive int or None, got "
                         f"{partition_size!r}")


def _shape_error(name, expected, actual):
    return ValueError(f"{name}: expected shape {expected}, got {tuple(actual)}")


def _require_c_contiguous(name, array):
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (got strides {tuple(array.strides)} "
                         f"for shape {tuple(array.shape)}); pass a contiguous copy")


def check_kv_layout(kv_layout) -> str:
    """The caches' dimension order: a name of problem.KV_LAYOUTS (None: the default)."""
    if kv_layout is None:
        return DEFAULT_KV_LAYOUT
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: must be one of {tuple(KV_LAYOUTS)} or None, got "
                         f"{kv_layout!r}")
    return kv_layout


def device_pointer(array) -> int:
    """A device array's address (cupy's `data.ptr`), or 0 for a host array: the numpy backend
    reads host arrays as they are, and the GPU backend uploads them into aligned copies."""
    if isinstance(array, np.ndarray):
        return 0
    return int(array.data.ptr)


def check_cache_alignment(name, pointer: int) -> None:
    """The kernels read cache rows in 16-byte units from the array's first element on."""
    if pointer % KV_STRIDE_ALIGN_BYTES:
        raise ValueError(f"{name}: its first element must be {KV_STRIDE_ALIGN_BYTES}-byte "
                         f"aligned, got address {pointer:#x} (a view that starts inside a row?)")


def _cache_strides(key_cache, value_cache, kv_layout: str):
    """The caches' element strides (block, KV head, token), or None for a contiguous cache of
    the default layout (DecodeShape.kv_strides). Any view whose rows (head_size elements) are
    contiguous and whose strides keep every row 16-byte aligned will do, K and V alike; the
    bounds are problem.py's."""
    itemsize = key_cache.dtype.itemsize
    strides = tuple(int(s) for s in key_cache.strides)
    if tuple(int(s) for s in value_cache.strides) != strides:
        raise ValueError(f"value_cache: strides must equal key_cache's {strides} (bytes), got "
                         f"{tuple(value_cache.strides)}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_cache_alignment(name, device_pointer(cache))
    if kv_layout == DEFAULT_KV_LAYOUT and key_cache.flags.c_contiguous:
        return None
    shape = tuple(int(d) for d in key_cache.shape)
    head_axis, token_axis = kv_axes(kv_layout)
    where = f"key_cache / value_cache (kv_layout={kv_layout!r}): "
    if strides[3] != itemsize:
        raise ValueError(f"{where}each row of head_size elements must be contiguous (last "
                         f"stride {itemsize} bytes), got strides {strides}; pass a copy")
    picked = (strides[0], strides[head_axis], strides[token_axis])
    for axis_name, stride in zip(("block", "KV head", "token"), picked):
        if stride <= 0 or stride % KV_STRIDE_ALIGN_BYTES:
            raise ValueError(f"{where}the {axis_name} stride must be a positive multiple of "
                             f"{KV_STRIDE_ALIGN_BYTES} bytes, got {stride} (strides {strides})")
    if picked[0] > MAX_KV_BLOCK_STRIDE_BYTES:
        raise ValueError(f"{where}the block stride must be below 2^32 bytes, got {picked[0]}")
    strides = tuple(s // itemsize for s in picked)
    if strides[2] > MAX_KV_TOKEN_STRIDE:
        raise ValueError(f"{where}the token stride must be below 2^24 elements, got "
                         f"{strides[2]}")
    return strides


def _check_per_head(name, array, num_heads):
    if array is None:
        return
    if tuple(array.shape) != (num_heads,):
        raise _shape_error(name, f"[{num_heads}]", array.shape)
    if dtype_name(array.dtype) != "float32":
        raise TypeError(f"{name}: dtype must be float32, got {dtype_name(array.dtype)}")


def check_decode_args(query, key_cache, value_cache, block_tables, seq_lens, *,
                      query_start_loc=None, scale=None, alibi_slopes=None, out=None,
                      sliding_window=None, logits_soft_cap=None, sinks=None,
                      kv_format=None, kv_layout=DEFAULT_KV_LAYOUT) -> DecodeShape:
    """Validate metadata of the decode arguments and return the problem's shape.

    kv_format: None or the name of an fp8 format (already checked by the caller); kv_layout:
    a name of problem.KV_LAYOUTS (likewise, check_kv_layout)."""
    if query.ndim != 3:
        raise _shape_error("query", "[num_tokens, num_heads, head_size]", query.shape)
    num_tokens, num_heads, head_size = (int(d) for d in query.shape)
    num_seqs = num_tokens
    if query_start_loc is not None:
        if query_start_loc.ndim != 1 or int(query_start_loc.shape[0]) < 1:
            raise _shape_error("query_start_loc", "[num_seqs + 1]", query_start_loc.shape)
        if dtype_name(query_start_loc.dtype) != "int32":
            raise TypeError(f"query_start_loc: dtype must be int32, got "
                            f"{dtype_name(query_start_loc.dtype)}")
        _require_c_contiguous("query_start_loc", query_start_loc)
        num_seqs = int(query_start_loc.shape[0]) - 1
    dtype = dtype_name(query.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query: dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"query: head_size must be one of {SUPPORTED_HEAD_SIZES}, got {head_size}")

    if key_cache.ndim != 4:
        dims = f"[{', '.join(KV_LAYOUTS[kv_layout])}]"
        if kv_layout != DEFAULT_KV_LAYOUT:
            dims += f" (kv_layout={kv_layout!r})"
        raise _shape_error("key_cache", dims, key_cache.shape)
    head_axis, token_axis = kv_axes(kv_layout)
    num_blocks, kv_head_size = int(key_cache.shape[0]), int(key_cache.shape[3])
    num_kv_heads, block_size = int(key_cache.shape[head_axis]), int(key_cache.shape[token_axis])
    if tuple(value_cache.shape) != tuple(key_cache.shape):
        raise _shape_error("value_cache", f"{tuple(key_cache.shape)} (same as key_cache)",
                           value_cache.shape)
    if kv_format is not None and dtype not in FP8_QUERY_DTYPES:
        raise TypeError(f"kv_format={kv_format!r}: an fp8 cache needs a query of dtype "
                        f"{' or '.join(FP8_QUERY_DTYPES)}, got {dtype}")
    cache_dtype = dtype if kv_format is None else "uint8"
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if dtype_name(cache.dtype) != cache_dtype:
            what = (f"must match query ({dtype})" if kv_format is None
                    else f"must be uint8 (fp8 codes, kv_format={kv_format!r})")
            raise TypeError(f"{name}: dtype {what}, got {dtype_name(cache.dtype)}")
    if kv_head_size != head_size:
        raise ValueError(f"key_cache: head_size (last dim) must equal query's {head_size}, "
                         f"got {kv_head_size}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"key_cache: block_size (dim {token_axis}) must be one of "
                         f"{SUPPORTED_BLOCK_SIZES}, got {block_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}, query dim 1) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}, key_cache dim {head_axis})")
    if num_blocks < 1:
        raise ValueError("key_cache: needs at least one block, got num_blocks=0")
    kv_strides = _cache_strides(key_cache, value_cache, kv_layout)

    if block_tables.ndim != 2 or int(block_tables.shape[0]) != num_seqs:
        raise _shape_error("block_tables", f"[{num_seqs}, max_blocks_per_seq]", block_tables.shape)
    if dtype_name(block_tables.dtype) != "int32":
        raise TypeError(f"block_tables: dtype must be int32, got {dtype_name(block_tables.dtype)}")
    if int(block_tables.shape[1]) < 1:
        raise ValueError("block_tables: needs at least one column, got max_blocks_per_seq=0")
    _require_c_contiguous("block_tables", block_tables)
    if seq_lens.ndim != 1 or int(seq_lens.shape[0]) != num_seqs:
        raise _shape_error("seq_lens", f"[{num_seqs}]", seq_lens.shape)
    if dtype_name(seq_lens.dtype) != "int32":
        raise TypeError(f"seq_lens: dtype must be int32, got {dtype_name(seq_lens.dtype)}")
    _require_c_contiguous("query", query)
    _require_c_contiguous("seq_lens", seq_lens)

    _check_per_head("alibi_slopes", alibi_slopes, num_heads)
    _check_per_head("sinks", sinks, num_heads)
    window = 0
    if sliding_window is not None:
        window = _number(sliding_window, int)
        if isinstance(sliding_window, bool) or window != sliding_window \
                or not 1 <= window < 2**31:
            raise ValueError(f"sliding_window: must be a positive int (tokens) or None, got "
                             f"{sliding_window!r}")
    soft_cap = 0.0
    if logits_soft_cap is not None:
        soft_cap = _number(logits_soft_cap, float)
        if not (np.isfinite(soft_cap) and soft_cap > 0):
            raise ValueError(f"logits_soft_cap: must be a positive finite float or None, got "
                             f"{logits_soft_cap!r}")
    if out is not None:
        if tuple(out.shape) != tuple(query.shape):
            raise _shape_error("out", tuple(query.shape), out.shape)
        if dtype_name(out.dtype) != dtype:
            raise TypeError(f"out: dtype must match query ({dtype}), got {dtype_name(out.dtype)}")
        _require_c_contiguous("out", out)

    if scale is None:
        scale = head_size ** -0.5
    given, scale = scale, _number(scale, float)
    if not np.isfinite(scale):
        raise ValueError(f"scale: must be finite (a float, or None for head_size ** -0.5), "
                         f"got {given!r}")

    return DecodeShape(num_seqs=num_seqs, num_tokens=num_tokens, num_heads=num_heads,
                       num_kv_heads=num_kv_heads,
                       head_size=head_size, num_blocks=num_blocks, block_size=block_size,
                       max_blocks_per_seq=int(block_tables.shape[1]), dtype=dtype, scale=scale,
                       has_alibi=alibi_slopes is not None, sliding_window=window,
                       logits_soft_cap=soft_cap, has_sinks=sinks is not None,
                       multi_token=query_start_loc is not None, kv_format=kv_format,
                       kv_strides=kv_strides)


def query_lens(shape: DecodeShape, query_start_loc: np.ndarray) -> np.ndarray:
    """New tokens per sequence from a host query_start_loc, checked: starts at 0, ends at the
    query's rows, and 1..MAX_QUERY_LEN tokens per sequence."""
    loc = np.asarray(query_start_loc, dtype=np.int64)
    if loc[0] != 0 or loc[-1] != shape.num_tokens:
        raise ValueError(f"query_start_loc: must start at 0 and end at the query's rows "
                         f"({shape.num_tokens}), got {int(loc[0])} ... {int(loc[-1])}")
    lens = np.diff(loc)
    bad = np.flatnonzero((lens < 1) | (lens > MAX_QUERY_LEN))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"query_start_loc: sequence {i} has {int(lens[i])} new tokens "
                         f"(query_start_loc[{i}:{i + 2}] = {loc[i:i + 2].tolist()}); each "
                         f"needs 1 to {MAX_QUERY_LEN}")
    return lens


def check_table_contents(shape: DecodeShape, block_tables: np.ndarray, seq_lens: np.ndarray,
                         new_tokens: np.ndarray | None = None):
    """Value checks on host tables: lengths in range, every used block id inside the cache, and
    (multi-token) every sequence at least as long as its new tokens."""
    seq_lens = np.asarray(seq_lens)
    if shape.num_seqs == 0:
        return
    if new_tokens is not None and (seq_lens < new_tokens).any():
        i = int(np.argmax(seq_lens < new_tokens))
        raise ValueError(f"seq_lens[{i}] = {int(seq_lens[i])} is less than the sequence's "
                         f"{int(new_tokens[i])} new tokens (seq_lens count them)")
    if seq_lens.min() < 0:
        bad = int(np.argmin(seq_lens))
        raise ValueError(f"seq_lens[{bad}]: must be >= 0, got {int(seq_lens[bad])}")
    if seq_lens.max() > shape.capacity:
        bad = int(np.argmax(seq_lens))
        raise ValueError(f"seq_lens[{bad}] = {int(seq_lens[bad])} exceeds the block table's "
                         f"capacity {shape.capacity} (= {shape.max_blocks_per_seq} blocks x "
                         f"block_size {shape.block_size})")
    used_blocks = -(-seq_lens // shape.block_size)
    columns = np.arange(shape.max_blocks_per_seq)[None, :]
    used = columns < used_blocks[:, None]
    ids = np.asarray(block_tables)[used]
    if ids.size and (ids.min() < 0 or ids.max() >= shape.num_blocks):
        seq, col = np.argwhere(used & ((block_tables < 0) | (block_tables >= shape.num_blocks)))[0]
        raise ValueError(f"block_tables[{seq}, {col}] = {int(block_tables[seq, col])} is not a "
                         f"block of the cache (0 <= id < {shape.num_blocks}) but is used by "
                         f"seq_lens[{seq}] = {int(seq_lens[seq])}")
