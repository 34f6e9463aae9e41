"""Randomised decode configurations on the GPU against the float64 reference.

Every full GPU run draws CHUNKS x PER_CHUNK (2,048) configurations combining dtype, kv format,
head size, GQA ratio, block size, features (ALiBi, window, soft-cap, sinks, new tokens), lengths
around block and partition boundaries, block tables with repeated and out-of-range ids, host or
device arrays, one-shot decode or a plan (replayed from a graph now and then), partition sizes
and merge forms. Each chunk's seed is printed; `CUPA_FUZZ_SEED=<seed>` replays a chunk. The
draws are sorted by the kernel variant they need, so compiled variants are reused.
Skips without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

import cupa
from cupa.arrays import gpu_available
from cupa.reference import paged_decode_reference

from cases import FP8_REL_BOUND, REL_BOUND, environ, make_case, quantized_case, rel_error

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

CHUNKS = 8
# 2,048 draws in a full run; the emulated AMD builds (tools/device_run.sh emulated) take fewer,
# since every emulated matrix instruction is a few hundred NVIDIA ones.
PER_CHUNK = int(os.environ.get("CUPA_FUZZ_PER_CHUNK", 256))
HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
FORMATS = ("fp8_e4m3", "fp8_e4m3fnuz")


@dataclass
class Draw:
    dtype: str
    kv_format: str | None
    head_size: int
    block_size: int
    num_kv_heads: int
    group: int
    seq_lens: tuple
    new_tokens: tuple | None
    alibi: bool
    window: int | None
    soft_cap: float | None
    sinks: bool
    partition_size: int | None
    merge: str
    kernel: str
    dense: str  # CUPA_DENSE
    wide: str  # CUPA_WIDE
    deep: str  # CUPA_DEEP
    host_arrays: bool
    form: str  # "decode", "plan" or "graph"
    seed: int

    def sort_key(self):
        return (self.kernel, self.dtype, self.kv_format or "", self.head_size, self.group)


def draw(rng) -> Draw:
    dtype = str(rng.choice(["float16", "bfloat16", "float32"]))
    kv_format = str(rng.choice(FORMATS)) if dtype != "float32" and rng.random() < 0.25 else None
    block_size = int(rng.choice([8, 16, 32]))
    partition_size = int(rng.choice([128, 256, 512])) if rng.random() < 0.5 else None
    # Lengths at block and partition boundaries (+-1), zero, one and a few long ones.
    edges = [block_size, partition_size or 256]
    count = int(rng.integers(1, 6))
    lens = []
    for _ in range(count):
        pick = rng.random()
        if pick < 0.15:
            lens.append(int(rng.choice([0, 1])))
        elif pick < 0.7:
            lens.append(max(0, int(rng.choice(edges)) * int(rng.integers(1, 5))
                            + int(rng.integers(-1, 2))))
        else:
            lens.append(int(rng.integers(2, 3000)))
    multi = rng.random() < 0.2
    new_tokens = tuple(int(x) for x in rng.integers(1, 9, count)) if multi else None
    if multi:  # a multi-token sequence has at least its new tokens
        lens = [max(n, t) for n, t in zip(lens, new_tokens)]
    return Draw(dtype=dtype, kv_format=kv_format, head_size=int(rng.choice(HEAD_SIZES)),
                block_size=block_size, num_kv_heads=int(rng.choice([1, 2, 4])),
                group=int(rng.choice([1, 2, 3, 4, 5, 8, 16])), seq_lens=tuple(lens),
                new_tokens=new_tokens, alibi=rng.random() < 0.2,
                window=int(rng.integers(1, 1500)) if rng.random() < 0.2 else None,
                soft_cap=float(rng.uniform(5, 50)) if rng.random() < 0.15 else None,
                sinks=rng.random() < 0.15, partition_size=partition_size,
                merge=str(rng.choice(["auto", "reduce", "cluster"])),
                kernel=str(rng.choice(["auto", "portable"])),
                dense=str(rng.choice(["auto", "always"])), host_arrays=rng.random() < 0.2,
                form=str(rng.choice(["decode", "plan", "graph"], p=[0.6, 0.3, 0.1])),
                seed=int(rng.integers(2**31)),
                wide=str(rng.choice(["auto", "always"])),  # drawn after the rest: earlier
                deep=str(rng.choice(["auto", "never"])))   # draws unchanged


def run_draw(d: Draw):
    """Run one configuration and compare; returns an error text or None."""
    import cupy
    rng = np.random.default_rng(d.seed)
    case = make_case(rng, dtype=d.dtype, head_size=d.head_size, block_size=d.block_size,
                     num_kv_heads=d.num_kv_heads, group=d.group, seq_lens=d.seq_lens,
                     alibi=d.alibi, sliding_window=d.window, logits_soft_cap=d.soft_cap,
                     sinks=d.sinks, new_tokens=d.new_tokens, shared_blocks=rng.random() < 0.5)
    q, k, v, tables, lens = case.args()
    options = case.options()
    fp8 = {}
    if d.kv_format is not None:  # poisoned with the largest codes where no token is
        (k, v), (ref_k, ref_v), (k_scale, v_scale) = quantized_case(
            case, d.kv_format, rng, per_head=rng.random() < 0.5)
        fp8 = dict(kv_format=d.kv_format, k_scale=k_scale, v_scale=v_scale)
    else:
        ref_k, ref_v = k, v
    ref, ref_lse = paged_decode_reference(q, ref_k, ref_v, tables, lens, **options)
    bound = FP8_REL_BOUND if fp8 else REL_BOUND[d.dtype]
    move = (lambda a: a) if d.host_arrays else cupy.asarray
    args = [move(x) for x in (q, k, v, tables, lens)]
    device_options = case.options(move)
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
    got = np.asarray(cupy.asnumpy(out), np.float64)
    if not np.isfinite(got).all():
        return "non-finite output"
    err = rel_error(got, ref)
    if not err <= bound:
        return f"rel error {err:.3g} > {bound}"
    if lse is None:
        return None
    got_lse = np.asarray(cupy.asnumpy(lse), np.float64)  # the plan's, NaN before the run
    finite = np.isfinite(ref_lse)
    if not (np.array_equal(finite, np.isfinite(got_lse))
            and np.array_equal(ref_lse[~finite], got_lse[~finite])
            and np.allclose(got_lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-2)):
        return "lse differs"
    return None


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
