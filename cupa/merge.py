"""Merging partial attention states (cascade / shared-prefix attention).

Convention: a state is (out, lse) for one set of keys, where `out` is the softmax-weighted
average of that set's values and `lse` the natural log of its softmax denominator — exactly what
`cupa.decode(..., return_lse=True)` returns. Attention over the union of disjoint key sets is

    lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) * out_i

A state with lse = -inf (no keys) contributes nothing; if every state is empty the result is a
zero row with lse = -inf. (FlashInfer's LSE is base 2; cupa's is natural log throughout.)
"""

from __future__ import annotations

import numpy as np

from . import arrays
from .problem import STORAGE_DTYPES
from .validation import check_is_array, dtype_name


def merge_states(out_a, lse_a, out_b, lse_b):
    """Merge two attention states; returns (out, lse). See the module docstring."""
    return merge_states_n([out_a, out_b], [lse_a, lse_b])  # errors name outs[1], lses[1], ...


def merge_states_n(outs, lses):
    """Merge any number of attention states over disjoint key sets; returns (out, lse).

    outs: arrays [..., head_size] of one shape and dtype (float16, bfloat16 or float32);
    lses: float32 arrays of shape outs[0].shape[:-1]. Works on numpy and cupy arrays (device
    arrays stay on the device); the arithmetic is float32.
    """
    for name, states in (("outs", outs), ("lses", lses)):
        if isinstance(states, (str, bytes)) or not hasattr(states, "__iter__"):
            raise TypeError(f"{name}: expected a list of arrays, got {type(states).__name__}")
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs and lses: need the same non-zero number of states, got "
                         f"{len(outs)} and {len(lses)}")
    for i, (o, x) in enumerate(zip(outs, lses)):
        check_is_array(f"outs[{i}]", o)
        check_is_array(f"lses[{i}]", x)
    template = outs[0]  # the result comes back as this kind of array
    on_gpu = any(arrays.is_device_array(x) for x in outs + lses)
    convert = arrays.to_device if on_gpu else arrays.to_host
    xp = arrays.cupy_module() if on_gpu else np
    outs = [convert(o) for o in outs]
    lses = [convert(x) for x in lses]
    shape, dtype = tuple(outs[0].shape), outs[0].dtype
    # The result is cast back to the states' dtype: an integer one would truncate silently.
    if dtype_name(dtype) not in STORAGE_DTYPES or len(shape) < 1:
        raise TypeError(f"outs[0]: expected a float16, bfloat16 or float32 array "
                        f"[..., head_size], got {dtype_name(dtype)} of shape {shape}")
    for i, (o, x) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape or o.dtype != dtype:
            raise ValueError(f"outs[{i}]: expected shape {shape} and dtype {dtype_name(dtype)} "
                             f"(those of outs[0]), got {tuple(o.shape)} {dtype_name(o.dtype)}")
        if tuple(x.shape) != shape[:-1]:
            raise ValueError(f"lses[{i}]: expected shape {shape[:-1]} (outs[0]'s without "
                             f"head_size), got {tuple(x.shape)}")
        if dtype_name(x.dtype) != "float32":
            raise TypeError(f"lses[{i}]: dtype must be float32, got {dtype_name(x.dtype)}")

    top = lses[0]
    for x in lses[1:]:
        top = xp.maximum(top, x)
    # Where every state is empty, subtract 0 instead of -inf so the weights are 0, not NaN.
    shift = xp.where(xp.isneginf(top), xp.float32(0), top)
    weights = [xp.exp(x - shift) for x in lses]
    total = weights[0]
    for w in weights[1:]:
        total = total + w
    merged = xp.zeros(shape, dtype=xp.float32)
    for w, o in zip(weights, outs):
        merged += w[..., None] * o.astype(xp.float32)
    nonempty = total > 0
    merged /= xp.where(nonempty, total, xp.float32(1))[..., None]
    lse = xp.where(nonempty, shift + xp.log(xp.where(nonempty, total, xp.float32(1))),
                   xp.float32(-np.inf)).astype(xp.float32)
    return arrays.like(template, merged.astype(dtype)), arrays.like(template, lse)
