"""Debug aid: one multi-partition decode through each launch path, checked against the oracle."""
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy  # noqa: E402

import cupa  # noqa: E402

rng = np.random.default_rng(0)
for batch, seq, merge in ((1, 4096, "auto"), (2, 3000, "reduce"), (16, 16384, "auto")):
    os.environ["CUPA_MERGE"] = merge
    from cupa.gpu import dispatch
    dispatch.reload_switches()
    bs, kvh, h, d = 16, 8, 64, 128
    nb = batch * (seq // bs + 1)
    k = cupy.asarray(rng.standard_normal((nb, kvh, bs, d), dtype=np.float32), dtype=cupy.float16)
    v = cupy.asarray(rng.standard_normal((nb, kvh, bs, d), dtype=np.float32), dtype=cupy.float16)
    q = cupy.asarray(rng.standard_normal((batch, h, d), dtype=np.float32), dtype=cupy.float16)
    t = cupy.asarray(rng.permutation(nb).astype(np.int32).reshape(batch, -1))
    lens = cupy.full(batch, seq, dtype=cupy.int32)
    plan = cupa.plan_decode(q, k, v, t, lens)
    print(batch, seq, plan.kernel, plan.merge, plan.max_partitions, flush=True)
    out = cupa.decode(q, k, v, t, lens)
    cupy.cuda.Device().synchronize()
    if batch <= 2:
        ref, _ = cupa.paged_decode_reference(q.get(), k.get(), v.get(), t.get(), lens.get())
        err = np.linalg.norm(out.get().astype(np.float64) - ref) / np.linalg.norm(ref)
        print("  rel err", err, flush=True)
print("ok")
