"""Quick check of the decode kernel the planner picks here (CUPA_EMULATE=<gfx> for the emulated
AMD builds) against the float64 reference, over a small spread of shapes and features; prints
one line per case with the relative error and the variant that ran.

    CUPA_EMULATE=gfx942 python3 tools/matrix_check.py
"""
import itertools
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy  # noqa: E402

import cupa  # noqa: E402
from cupa.api import plan_decode  # noqa: E402
from cupa.reference import paged_decode_reference  # noqa: E402

BOUND = {"float16": 2e-3, "bfloat16": 1.6e-2}


def case(rng, dtype, head_size, heads, kv_heads, block_size, lens, **features):
    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    per_seq = max(-(-n // block_size) for n in lens) + 1
    blocks = len(lens) * per_seq + 3
    key = rng.standard_normal((blocks, kv_heads, block_size, head_size)).astype(np_dtype)
    value = rng.standard_normal((blocks, kv_heads, block_size, head_size)).astype(np_dtype)
    tables = rng.permutation(blocks)[:len(lens) * per_seq].reshape(len(lens), per_seq)
    tables = tables.astype(np.int32)
    for s, n in enumerate(lens):  # NaN past each sequence's end
        for t in range(n, per_seq * block_size):
            key[tables[s, t // block_size], :, t % block_size] = np.nan
            value[tables[s, t // block_size], :, t % block_size] = np.nan
    query = rng.standard_normal((len(lens), heads, head_size)).astype(np_dtype)
    seq_lens = np.array(lens, np.int32)
    ref, ref_lse = paged_decode_reference(query.astype(np.float64), key.astype(np.float64),
                                          value.astype(np.float64), tables, seq_lens, **features)
    args = [cupy.asarray(a) for a in (query, key, value, tables, seq_lens)]
    out, lse = cupa.decode(*args, return_lse=True, **features)
    plan = plan_decode(*args, **features)
    out = cupy.asnumpy(out).astype(np.float64)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    lse = cupy.asnumpy(lse)
    lse_err = np.nanmax(np.abs(lse - ref_lse)) if np.isfinite(ref_lse).all() else 0.0
    return err, lse_err, plan.kernel


def main():
    rng = np.random.default_rng(7)
    bad = 0
    rows = []
    for dtype, head_size, (heads, kv), block, lens in itertools.product(
            ("float16", "bfloat16"), (64, 128, 256), ((8, 8), (8, 1), (32, 2), (64, 1)), (16,),
            ((1, 37, 300),)):
        rows.append((dtype, head_size, heads, kv, block, lens, {}))
    for feats in ({"sliding_window": 50}, {"logits_soft_cap": 20.0},
                  {"alibi_slopes": np.linspace(0.1, 0.5, 8).astype(np.float32)},
                  {"sinks": np.linspace(-1, 1, 8).astype(np.float32)}):
        rows.append(("float16", 128, 8, 2, 8, (5, 700), feats))
    rows.append(("bfloat16", 128, 8, 2, 32, (1000, 17), {"partition_size": 256}))
    for dtype, head_size, heads, kv, block, lens, feats in rows:
        try:
            err, lse_err, name = case(rng, dtype, head_size, heads, kv, block, lens, **feats)
            ok = err < BOUND[dtype] and lse_err < 1e-2
        except Exception as exc:  # noqa: BLE001
            err, lse_err, name, ok = float("nan"), float("nan"), repr(exc)[:200], False
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {dtype:8} d{head_size} {heads}/{kv} b{block} {lens} "
              f"{sorted(feats)} err {err:.2e} lse {lse_err:.1e} {name}", flush=True)
    print("bad:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
