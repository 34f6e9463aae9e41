"""Putting the pieces together: backend -> array module and dtype -> model -> paged KV cache."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from cupa import PagedKVCache
from cupa.api import resolve_backend

from .config import load_config
from .model import Model
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
    model applies to weights; bfloat16 support varies by cupy version)."""
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
    unless `requested` names another. bfloat16 falls back to float32 where cupy lacks it."""
    if backend != "gpu":
        if requested not in ("auto", "float32"):
            raise ValueError(f"--dtype {requested}: the numpy backend computes in float32")
        return DTYPES["float32"]
    name = checkpoint_dtype if requested == "auto" else requested
    dtype = DTYPES.get(name.replace("torch.", ""), DTYPES["float16"])
    if dtype == DTYPES["bfloat16"] and not _gpu_handles(dtype):
        import sys
        print("note: this cupy has no bfloat16 matmul; computing in float32", file=sys.stderr)
        dtype = DTYPES["float32"]
    return dtype


def load_model(model_dir, *, backend=None, dtype="auto", progress=True) -> tuple[Model, str]:
    """(model, resolved backend) for a checkpoint directory."""
    backend = resolve_backend(backend)
    config = load_config(model_dir)
    xp = array_module(backend)
    dt = compute_dtype(backend, config.torch_dtype, dtype)
    weights = load_weights(model_dir, config, xp, dt, progress=progress)
    return Model(config, weights, xp, dt), backend


def block_bytes(model: Model, block_size: int) -> int:
    """Bytes of one block across all layers, keys and values."""
    cfg = model.config
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * model.dtype.itemsize


def default_num_blocks(model: Model, block_size: int, token_counts, backend: str,
                       memory_fraction: float = 0.8) -> int:
    """Enough blocks for every request at full length at once, capped on the GPU by a fraction
    of free device memory (the engine then waits or preempts instead)."""
    need = sum(math.ceil(n / block_size) for n in token_counts) or 1
    if backend == "gpu":
        import cupy
        free, _ = cupy.cuda.Device().mem_info
        need = min(need, max(1, int(free * memory_fraction) // block_bytes(model, block_size)))
    return need


def make_cache(model: Model, num_blocks: int, block_size: int, backend: str):
    cfg = model.config
    return PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                             cfg.head_dim, dtype=model.dtype.name, backend=backend)
