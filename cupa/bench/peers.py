"""The bench's peers, each timed on the same data as cupa: torch SDPA on the KV gathered dense,
and FlashInfer's paged batch decode (tensor cores) on the same pages, shared through DLPack. A peer
that is not installed or fails is left out of the table, never fatal.
"""

from __future__ import annotations

import sys

def sdpa_peer(cupy, query, key, value, tables_np, seq_len, args):
    """torch SDPA on the same KV gathered into dense [B, Hkv, L, D] (gather not timed)."""
    try:
        import torch
        import torch.nn.functional as F
    except Exception:
        return None
    q = torch.from_dlpack(query).unsqueeze(2)  # [B, H, 1, D]
    k_pages, v_pages = torch.from_dlpack(key), torch.from_dlpack(value)
    idx = torch.from_dlpack(cupy.asarray(tables_np)).long()
    batch = idx.shape[0]

    def dense(pages):  # [B, nb, Hkv, bs, D] -> [B, Hkv, nb*bs, D]
        g = pages[idx].permute(0, 2, 1, 3, 4).reshape(batch, args.kv_heads, -1, args.head_size)
        return g[:, :, :seq_len].contiguous()
    k, v = dense(k_pages), dense(v_pages)
    gqa = args.heads != args.kv_heads
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def flashinfer_peer(cupy, query, key, value, tables_np, seq_len, args, fp8_scale=None):
    """FlashInfer BatchDecodeWithPagedKVCacheWrapper (tensor cores, HND) on the same pages; with
    fp8_scale, the pages are e4m3 codes (uint8 viewed as torch.float8_e4m3fn) of that scale."""
    try:
        import flashinfer
        import torch
    except Exception:
        return None
    batch, blocks = tables_np.shape
    bs = args.block_size
    dev = torch.device("cuda", cupy.cuda.Device().id)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND",
                                                            use_tensor_cores=True)
    indptr = torch.arange(0, batch * blocks + 1, blocks, dtype=torch.int32, device=dev)
    indices = torch.from_dlpack(cupy.asarray(tables_np.reshape(-1)))
    last = torch.full((batch,), seq_len - (blocks - 1) * bs, dtype=torch.int32, device=dev)
    q_dtype = getattr(torch, args.dtype)
    kv_dtype = q_dtype if fp8_scale is None else torch.float8_e4m3fn
    wrapper.plan(indptr, indices, last, args.heads, args.kv_heads, args.head_size, bs,
                 q_data_type=q_dtype, kv_data_type=kv_dtype)
    q, k, v = (torch.from_dlpack(x) for x in (query, key, value))
    if fp8_scale is None:
        return lambda: wrapper.run(q, (k, v))
    k, v = k.view(kv_dtype), v.view(kv_dtype)
    return lambda: wrapper.run(q, (k, v), k_scale=fp8_scale, v_scale=fp8_scale)


def prepare_peer(name, factory, *a):
    """The peer's launch function, run once (compiling what it compiles), or None."""
    try:
        launch = factory(*a)
        if launch is not None:
            launch()
        return launch
    except Exception as exc:  # a peer that fails is reported and left out, never fatal
        print(f"  [{name} unavailable: {type(exc).__name__}: {str(exc)[:200]}]", file=sys.stderr)
        return None


