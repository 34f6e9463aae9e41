"""Randomised decode configurations on the GPU against the float64 reference.

Every full GPU run draws CHUNKS x PER_CHUNK (2,048) configurations (tests/helpers/fuzz_draws.py)
combining dtype, kv format, head size, GQA ratio, block size, features (ALiBi, window,
soft-cap, sinks, new tokens), lengths around block and partition boundaries, block tables with
repeated and out-of-range ids, host or device arrays, one-shot decode or a plan (replayed from a
graph now and then), partition sizes and merge forms. Each chunk's seed is printed;
`CUPA_FUZZ_SEED=<seed>` replays a chunk. The draws are sorted by the kernel variant they need,
so compiled variants are reused. Skips without a GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import cupa
from cupa.arrays import gpu_available

from cases import environ
from fuzz_draws import Draw, compare, draw, problem

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

CHUNKS = 8
# 2,048 draws in a full run; the emulated AMD builds (tools/device_run.sh emulated) take fewer,
# since every emulated matrix instruction is a few hundred NVIDIA ones.
PER_CHUNK = int(os.environ.get("CUPA_FUZZ_PER_CHUNK", 256))


def run_draw(d: Draw):
    """Run one configuration and compare; returns an error text or None."""
    import cupy
    p = problem(d)
    move = (lambda a: a) if d.host_arrays else cupy.asarray
    args = [move(x) for x in p.args]
    device_options = p.case.options(move)
    fp8 = p.fp8
    q = p.args[0]
    lse = None
    with environ(CUPA_KERNEL=d.kernel, CUPA_MERGE=d.merge, CUPA_DENSE=d.dense, CUPA_WIDE=d.wide,
                 CUPA_DEEP=d.deep):
        if d.form == "decode":  # into a poisoned `out` (decode's own lse is not poisoned)
            out = cupa.decode(*args, **device_options, **fp8, partition_size=d.partition_size,
                              out=move(np.full(q.shape, np.nan, q.dtype)))
        else:
            per_call = {key: device_options.pop(key)
                        for key in ("alibi_slopes", "sinks", "query_start_loc")}
            plan = cupa.plan_decode(*args, **device_options, **per_call, **fp8,
                                    return_lse=True, partition_size=d.partition_size)
            plan.out.fill(np.nan)
            plan.lse.fill(np.nan)
            if d.form == "graph" and not d.host_arrays:
                plan.run(*args, **per_call)  # compiles outside the capture
                plan.out.fill(np.nan)
                plan.lse.fill(np.nan)
                stream = cupy.cuda.Stream(non_blocking=True)
                stream.wait_event(cupy.cuda.get_current_stream().record())
                with stream:
                    stream.begin_capture()
                    plan.run(*args, **per_call)
                    graph = stream.end_capture()
                graph.launch(stream)
                stream.synchronize()
                out, lse = plan.out, plan.lse
            else:
                out, lse = plan.run(*args, **per_call)
    # the plan's lse was NaN before the run
    return compare(p, cupy.asnumpy(out), None if lse is None else cupy.asnumpy(lse))


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_fuzz(chunk):
    seed = int(os.environ.get("CUPA_FUZZ_SEED", 0)) or int(
        np.random.SeedSequence().entropy % 2**31)
    print(f"fuzz chunk {chunk}: CUPA_FUZZ_SEED={seed}")
    rng = np.random.default_rng(seed)
    draws = sorted((draw(rng) for _ in range(PER_CHUNK)), key=Draw.sort_key)
    failures = []
    for d in draws:
        problem = run_draw(d)
        if problem is not None:
            failures.append(f"{problem}: {d}")
    assert not failures, (f"{len(failures)} of {len(draws)} configurations failed (seed {seed})"
                          ":\n" + "\n".join(failures[:10]))
