"""Putting the pieces together: backend -> array module and dtype -> model -> paged KV cache."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from cupa import PagedKVCache
from cupa.api import resolve_backend
from cupa.fp8 import FP8_FORMATS, default_kv_format

from . import blas
from .config import load_config
from .engine import blocks_to_run_together
from .model import Model
from .tensor_parallel import checkpoint_slicer, shard_config
from .weights import load_weights

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def array_module(backend: str):
    if backend == "gpu":
        import cupy
        return cupy
    return np


def _gpu_handles(dtype) -> bool:
    """Whether this cupy can upload, index, stack, matmul and cast `dtype` (the operations the
    model applies to weights; bfloat16 support varies by cupy version).

    On ROCm/HIP bfloat16 is answered without running anything: False. cupy-rocm (14.2) hands a
    bfloat16 matmul to hipBLAS through a type-conversion shim that does not know bfloat16 and
    throws a C++ exception that cupy does not translate, so the process aborts (SIGABRT); a
    try/except probe cannot even see it fail. The model then computes in float32 (compute_dtype)
    rather than keeping bfloat16 weights with its matmuls sent to hipBLAS with explicit types
    (hipblas.py), because every matmul of every step would need that rerouting (eager prefill
    and decode too, not only the graph-captured step), and any one left to cupy would abort;
    float32 reaches cupy's hipBLAS path only with types it knows. It costs twice the weight
    memory and bandwidth of bfloat16. Elsewhere (CUDA) the probe below is safe: a missing
    bfloat16 matmul raises there."""
    if np.dtype(dtype) == DTYPES["bfloat16"] and blas.gpu_is_hip():
        return False
    return _probe_gpu_dtype(dtype)


def _probe_gpu_dtype(dtype) -> bool:
    """Run the model's weight operations on a small `dtype` array (never on HIP in bfloat16:
    see _gpu_handles)."""
    import cupy
    try:
        a = cupy.asarray(np.ones((4, 4), dtype=dtype))
        a = cupy.concatenate([a, a[cupy.asarray([0, 1])]], axis=0)
        (a @ a.T).astype(np.float32) + a.astype(np.float32).sum()
        cupy.cuda.get_current_stream().synchronize()
        return True
    except Exception:
        return False


def compute_dtype(backend: str, checkpoint_dtype: str, requested: str = "auto") -> np.dtype:
    """float32 on numpy (the CPU path computes in float32); on the GPU the checkpoint's dtype
    unless `requested` names another. bfloat16 falls back to float32 where cupy lacks it, and
    always on ROCm/HIP (_gpu_handles says why)."""
    if backend != "gpu":
        if requested not in ("auto", "float32"):
            raise ValueError(f"--dtype {requested}: the numpy backend computes in float32")
        return DTYPES["float32"]
    name = checkpoint_dtype if requested == "auto" else requested
    dtype = DTYPES.get(name.replace("torch.", ""), DTYPES["float16"])
    if dtype == DTYPES["bfloat16"] and not _gpu_handles(dtype):
        import sys
        why = ("on ROCm/HIP, cupy's hipBLAS path aborts on bfloat16 matmuls" if blas.gpu_is_hip()
               else "this cupy has no bfloat16 matmul")
        print(f"note: {why}; computing in float32", file=sys.stderr)
        dtype = DTYPES["float32"]
    return dtype


def load_model(model_dir, *, backend=None, dtype="auto", progress=True,
               group=None) -> tuple[Model, str]:
    """(model, resolved backend) for a checkpoint directory. With a process group of more than
    one rank (collectives.py), this rank's tensor-parallel part of it: its heads and MLP units
    only (tensor_parallel.py), read from the checkpoint without loading the rest, and a model
    that all-reduces its partial sums over the group."""
    backend = resolve_backend(backend)
    config = load_config(model_dir)
    xp = array_module(backend)
    dt = compute_dtype(backend, config.torch_dtype, dtype)
    if group is None or group.world == 1:
        weights = load_weights(model_dir, config, xp, dt, progress=progress)
        return Model(config, weights, xp, dt), backend
    slicer = checkpoint_slicer(config, group.rank, group.world)
    weights = load_weights(model_dir, config, xp, dt, progress=progress, slice_tensor=slicer)
    return Model(shard_config(config, group.world), weights, xp, dt,
                 reduce=group.all_reduce_sum), backend


def block_bytes(model: Model, block_size: int, kv_format=None) -> int:
    """Bytes of one block across all layers, keys and values (fp8: one byte per element)."""
    cfg = model.config
    itemsize = 1 if kv_format else model.dtype.itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * itemsize


def default_num_blocks(model: Model, block_size: int, token_counts, backend: str,
                       memory_fraction: float = 0.8, kv_format=None) -> int:
    """Enough blocks for every request at full length at once, plus the engine's admission
    reserve, so that all of them are admitted together (engine.blocks_to_run_together); capped
    on the GPU by a fraction of free device memory (the engine then waits or preempts instead)."""
    need = blocks_to_run_together(token_counts, block_size) or 1
    if backend == "gpu":
        import cupy
        free, _ = cupy.cuda.Device().mem_info
        per_block = block_bytes(model, block_size, kv_format)
        need = min(need, max(1, int(free * memory_fraction) // per_block))
    return need


def resolve_kv_format(name: str, backend: str):
    """A --kv-format value as a cupa kv_format: 'none' -> None, 'auto' -> the fp8 format with
    hardware conversions on this GPU (cupa.fp8.default_kv_format), None on the CPU or elsewhere."""
    if name == "auto":
        if backend != "gpu":
            return None
        from cupa.gpu.device import device_info
        return default_kv_format(device_info().target.arch)
    return None if name == "none" else name


# Headroom of the calibrated fp8 scale: the largest prompt value maps to half the largest code,
# so decode tokens up to twice as large do not saturate. e4m3 keeps the same relative precision
# (3 mantissa bits) from max_finite down to its smallest normal, about max_finite / 3e4, so the
# headroom costs precision only for values over 10^4 times smaller than the largest.
KV_SCALE_HEADROOM = 2.0


def calibrate_kv_scales(model: Model, prompts, kv_format: str):
    """fp8 (k_scale, v_scale), each float32 [num_kv_heads], from a dense forward over `prompts`:
    scale = KV_SCALE_HEADROOM * max|x| / max_finite per KV head, the max taken over every token
    of every prompt and over all layers (a PagedKVCache has one scale per KV head, shared by its
    layers). Costs one extra prefill of the prompts."""
    xp, cfg = model.xp, model.config
    amax = [np.zeros(cfg.num_kv_heads, np.float32), np.zeros(cfg.num_kv_heads, np.float32)]

    def attend(layer, q, k, v):
        for i, x in enumerate((k, v)):
            head_max = xp.abs(x).max(axis=(0, 2))  # float32 [kv_heads]
            amax[i] = np.maximum(amax[i], head_max.get() if xp is not np else head_max)
        return model.causal_attention(q, k, v)

    for prompt in prompts:
        n = len(prompt)
        model.forward(xp.asarray(np.asarray(prompt, np.int64)), xp.arange(n), attend,
                      last_rows=xp.asarray([n - 1]))
    scales = [KV_SCALE_HEADROOM * m / np.float32(FP8_FORMATS[kv_format].max_finite)
              for m in amax]
    # All-zero (or non-finite) heads get scale 1; a scale must be a positive normal float32.
    return tuple(np.where(np.isfinite(s) & (s >= np.finfo(np.float32).tiny), s, 1)
                 .astype(np.float32) for s in scales)


def make_cache(model: Model, num_blocks: int, block_size: int, backend: str, *, kv_format=None,
               k_scale=None, v_scale=None):
    """The paged KV cache for `model`: rows of the model dtype, stored as that dtype or, with an
    fp8 kv_format, as fp8 codes with per-KV-head scales (quantised by cache.write)."""
    cfg = model.config
    return PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                        dtype=model.dtype.name, backend=backend, kv_format=kv_format,
                        k_scale=k_scale, v_scale=v_scale)
