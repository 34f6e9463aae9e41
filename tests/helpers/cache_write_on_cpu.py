"""cupa's KV-cache write kernel (kernels/cache_write.cu) in its emulated AMD build, run on the
CPU like decode_on_cpu.py's decode kernels: one workgroup per token row, the launch's threads
and scalars from `gpu.launch.cache_write_form`, as `PagedKVCache.write` launches it on a GPU."""

from __future__ import annotations

import numpy as np

from cupa.fp8 import check_kv_format, kv_scales
from cupa.gpu import catalogue
from cupa.gpu.device import Target
from cupa.gpu.launch import cache_write_form
from cuda_on_cpu import cpu_kernels


def cache_write_on_cpu(arch: str, key, value, key_cache, value_cache, slots, *, kv_format=None,
                       k_scale=None, v_scale=None, place=None, sanitize=False):
    """Write rows key, value [num_tokens, num_kv_heads, head_size] into copies of the caches
    [num_blocks, num_kv_heads, block_size, head_size] at int64 `slots` (block * block_size +
    offset; negative or past the cache: skipped); returns the written caches. `place` and
    `sanitize` as for decode_on_cpu."""
    num_blocks, num_kv_heads, block_size, head_size = key_cache.shape
    fmt = check_kv_format(kv_format)
    variant = catalogue.CacheWriteVariant(np.dtype(key.dtype).name, kv_format)
    defines = tuple(Target(arch, emulated=True).defines()) + ("-DCUPA_CPU=1",)
    kernel = cpu_kernels(catalogue.module_source(variant), defines,
                         sanitize=sanitize)[variant.write_name]
    threads, fixed = cache_write_form(num_kv_heads=num_kv_heads, head_size=head_size,
                                      block_size=block_size, num_blocks=num_blocks,
                                      storage_itemsize=key_cache.itemsize)
    arrays = {"key": np.ascontiguousarray(key), "value": np.ascontiguousarray(value),
              "key_cache": np.array(key_cache), "value_cache": np.array(value_cache),
              "slots": np.ascontiguousarray(slots, dtype=np.int64)}
    tail = []
    if fmt is not None:
        arrays["inv_k_scale"] = np.float32(1) / kv_scales(k_scale, num_kv_heads, "k_scale")
        arrays["inv_v_scale"] = np.float32(1) / kv_scales(v_scale, num_kv_heads, "v_scale")
    if place is not None:
        arrays = {name: place(name, a, writable=name.endswith("_cache"))
                  for name, a in arrays.items()}
    if fmt is not None:
        tail = [arrays["inv_k_scale"], arrays["inv_v_scale"], np.int32(fmt.kernel_id)]
    row_strides = [np.int64(s // arrays["key"].itemsize) for s in
                   (*arrays["key"].strides[:2], *arrays["value"].strides[:2])]
    pointers = [arrays[name] for name in ("key", "value", "key_cache", "value_cache", "slots")]
    kernel((len(arrays["slots"]), 1, 1), (threads, 1, 1),
           [*pointers, *fixed, *row_strides, *tail])
    return arrays["key_cache"], arrays["value_cache"]
