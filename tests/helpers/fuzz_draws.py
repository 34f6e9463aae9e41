"""Random decode configurations for the fuzz tests (tests/gpu/test_gpu_fuzz.py on the GPU,
tests/unit/test_amd_kernels_cpu.py's on the CPU build of the AMD kernels): a Draw combines
dtype, kv format, head size, GQA ratio, block size, features (ALiBi, window, soft-cap, sinks,
new tokens), lengths around block and partition boundaries, block tables with repeated and
out-of-range ids, and the GPU run's forms (host or device arrays, decode or a plan or a graph,
partition sizes, merge and kernel forms); `problem` builds its arrays and reference, `compare`
judges a result."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from cupa.problem import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES
from cupa.reference import paged_decode_reference

from cases import FP8_REL_BOUND, REL_BOUND, make_case, quantized_case, rel_error

HEAD_SIZES = SUPPORTED_HEAD_SIZES
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


def fresh_seed() -> int:
    """CUPA_FUZZ_SEED, or a new seed; printed, so that a failure can be replayed."""
    seed = int(os.environ.get("CUPA_FUZZ_SEED", 0)) or int(
        np.random.SeedSequence().entropy % 2**31)
    print(f"CUPA_FUZZ_SEED={seed}")
    return seed


def draw(rng) -> Draw:
    dtype = str(rng.choice(["float16", "bfloat16", "float32"]))
    kv_format = str(rng.choice(FORMATS)) if dtype != "float32" and rng.random() < 0.25 else None
    block_size = int(rng.choice(SUPPORTED_BLOCK_SIZES))
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


@dataclass
class Problem:
    args: list          # query, key cache, value cache, block tables, seq_lens (numpy)
    fp8: dict           # kv_format, k_scale, v_scale, or empty
    ref: np.ndarray     # the float64 reference output and log-sum-exp
    ref_lse: np.ndarray
    bound: float        # ||out - ref|| / ||ref|| allowed
    case: object        # the cases.Case (its keyword options: case.options())


def problem(d: Draw) -> Problem:
    """The draw's arrays (its caches fp8 codes, poisoned with the largest codes where no token
    is, for an fp8 format) and the reference on them."""
    rng = np.random.default_rng(d.seed)
    case = make_case(rng, dtype=d.dtype, head_size=d.head_size, block_size=d.block_size,
                     num_kv_heads=d.num_kv_heads, group=d.group, seq_lens=d.seq_lens,
                     alibi=d.alibi, sliding_window=d.window, logits_soft_cap=d.soft_cap,
                     sinks=d.sinks, new_tokens=d.new_tokens, shared_blocks=rng.random() < 0.5)
    q, k, v, tables, lens = case.args()
    options = case.options()
    fp8 = {}
    if d.kv_format is not None:
        (k, v), (ref_k, ref_v), (k_scale, v_scale) = quantized_case(
            case, d.kv_format, rng, per_head=rng.random() < 0.5)
        fp8 = dict(kv_format=d.kv_format, k_scale=k_scale, v_scale=v_scale)
    else:
        ref_k, ref_v = k, v
    ref, ref_lse = paged_decode_reference(q, ref_k, ref_v, tables, lens, **options)
    return Problem(args=[q, k, v, tables, lens], fp8=fp8, ref=ref,
                   ref_lse=ref_lse, bound=FP8_REL_BOUND if fp8 else REL_BOUND[d.dtype],
                   case=case)


def compare(p: Problem, out, lse=None) -> str | None:
    """What is wrong with a result (host arrays; lse None where the run gave none), or None."""
    got = np.asarray(out, np.float64)
    if not np.isfinite(got).all():
        return "non-finite output"
    err = rel_error(got, p.ref)
    if not err <= p.bound:
        return f"rel error {err:.3g} > {p.bound}"
    if lse is None:
        return None
    got_lse = np.asarray(lse, np.float64)
    finite = np.isfinite(p.ref_lse)
    if not (np.array_equal(finite, np.isfinite(got_lse))
            and np.array_equal(p.ref_lse[~finite], got_lse[~finite])
            and np.allclose(got_lse[finite], p.ref_lse[finite], rtol=1e-3, atol=1e-2)):
        return "lse differs"
    return None
