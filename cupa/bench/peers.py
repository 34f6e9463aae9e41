"""The bench's peers, each timed on the same data as cupa: torch SDPA on the KV gathered dense,
and FlashInfer's paged batch decode (tensor cores) on the same pages, shared through DLPack. A peer
that is not installed or fails is left out of the table, never fatal.
"""

from __future__ import annotations

import sys

import numpy as np


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

    # [B, nb, Hkv, bs, D] ("HND") or [B, nb, bs, Hkv, D] ("NHD") -> [B, Hkv, nb*bs, D]
    order = (0, 2, 1, 3, 4) if args.kv_layout == "HND" else (0, 3, 1, 2, 4)

    def dense(pages):
        g = pages[idx].permute(*order).reshape(batch, args.kv_heads, -1, args.head_size)
        return g[:, :, :seq_len].contiguous()
    k, v = dense(k_pages), dense(v_pages)
    gqa = args.heads != args.kv_heads
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def flashinfer_page_arrays(block_tables: np.ndarray, seq_lens, block_size: int):
    """FlashInfer's description of a paged batch from cupa's block tables and lengths (an int
    for a uniform batch, or one per sequence): int32 numpy (indptr [B + 1], indices [pages],
    last_page_len [B]). Sequence s owns the first ceil(len / block_size) entries of its table
    row, in order; its last page holds the rest of its tokens (1 to block_size; 0 for an empty
    sequence, which owns no page)."""
    block_tables = np.asarray(block_tables)
    lens = np.broadcast_to(np.asarray(seq_lens, dtype=np.int64), (block_tables.shape[0],))
    pages = -(-lens // block_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    owned = np.arange(block_tables.shape[1])[None, :] < pages[:, None]
    indices = block_tables[owned].astype(np.int32)  # row-major: sequence by sequence
    last = np.where(pages > 0, lens - (pages - 1) * block_size, 0).astype(np.int32)
    return indptr, indices, last


# The head sizes FlashInfer's paged decode is asked for. Version 0.7.2 on the H200 (session 33,
# one process per case): at 80 (MHA) and 96 (GQA 8) its first run faulted with
# CUDA_ERROR_ILLEGAL_ADDRESS, which leaves the process's CUDA context unusable, so no try/except
# can keep the bench going; at 192 it raises cleanly where its plan splits the KV (its merge
# lacks that size) and matches cupa elsewhere.
FLASHINFER_HEAD_SIZES = (64, 128, 192, 256)


def flashinfer_peer(cupy, query, key, value, tables_np, seq_lens, args, fp8_scale=None):
    """FlashInfer BatchDecodeWithPagedKVCacheWrapper (tensor cores, the bench's kv_layout) on
    the same pages, for lengths `seq_lens` (one int for all, or one per sequence, from which its
    plan() chooses the KV split); with fp8_scale, the pages are e4m3 codes (uint8 viewed as
    torch.float8_e4m3fn) of that scale."""
    if args.head_size not in FLASHINFER_HEAD_SIZES:
        raise ValueError(f"head size {args.head_size} is not asked of FlashInfer (it faulted at "
                         f"80 and 96; asked at {FLASHINFER_HEAD_SIZES})")
    try:
        import flashinfer
        import torch
    except Exception:
        return None
    bs = args.block_size
    dev = torch.device("cuda", cupy.cuda.Device().id)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, args.kv_layout,
                                                            use_tensor_cores=True)
    indptr, indices, last = (torch.from_numpy(a).to(dev)
                             for a in flashinfer_page_arrays(tables_np, seq_lens, bs))
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


