"""Where an eager decode step of the example engine spends its host time (GPU only).

    python3 tools/engine_host_profile.py [--prompts 8] [--layers 8] [--steps 64]

Builds the bench_generate model shape (Llama-2-7B layers, random fp16 weights, `--layers` of
them: host costs per layer do not depend on the count), prefills `--prompts` prompts of 512
tokens and times `--steps` eager decode steps. Every call of the step's building blocks (the
GEMM, the fused kernels, the cache write, cupa.decode) is wrapped by a host-clock timer, so the
table shows host microseconds per call and per layer of each, beside the launch floor L of
cupa.bench.host and the step's own wall time. The wrappers add ~0.2 us per call.
"""
from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import cupa  # noqa: E402
from cupa.bench.host import host_costs  # noqa: E402

TOTALS: dict = collections.defaultdict(float)
COUNTS: dict = collections.Counter()


def timed(name, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - start
            COUNTS[name] += 1
    return wrapper


def print_array_op_costs(cupy, floor: float) -> None:
    """Host us of the small cupy operations a layer's Python may make, for comparison."""
    from cupa.bench.host import host_us
    x = cupy.empty((8, 4096), dtype=np.float32)
    flat = cupy.empty(8 * 96 * 128, dtype=np.float16)
    ops = {
        "cupy.ascontiguousarray (returns x)": lambda: cupy.ascontiguousarray(x, dtype=np.float32),
        "x.astype(same, copy=False)": lambda: x.astype(np.float32, copy=False),
        "x.dtype == dtype and x.flags.c_contiguous": lambda: (x.dtype == np.float32
                                                              and x.flags.c_contiguous),
        "x.reshape(8, -1)": lambda: x.reshape(8, -1),
        "flat[:n].reshape(8, 32, 128)": lambda: flat[:8 * 32 * 128].reshape(8, 32, 128),
        "x.data.ptr": lambda: x.data.ptr,
    }
    print("| array operation | us a call | in L |")
    print("|---|---:|---:|")
    for name, op in ops.items():
        us = host_us(cupy, op, calls=2000)
        print(f"| {name} | {us:.2f} | {us / floor:.2f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    import cupy

    from bench_generate import LLAMA2_7B
    from llm import blas
    from llm.config import ModelConfig
    from llm.engine import Engine
    from llm.model import Model
    from llm.runtime import make_cache
    from llm.sampling import SamplingParams
    from llm.weights import random_weights

    config = ModelConfig(architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=10000.0,
                         **dict(LLAMA2_7B, num_layers=args.layers))
    model = Model(config, random_weights(config, cupy, np.float16, seed=0), cupy, np.float16)
    floor = host_costs(cupy)["launch_floor"]
    cache = make_cache(model, args.prompts * (512 + 2 * args.steps) // 16 + 64, 16, "gpu")
    engine = Engine(model, cache, attention="paged", backend="gpu", max_batch=args.prompts,
                    graphs=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=2 * args.steps + 8, ignore_eos=True)
    for _ in range(args.prompts):
        engine.add_request(rng.integers(3, config.vocab_size, 512).tolist(), params)
    for _ in range(args.steps // 2 + 1):  # the prefill, then warm-up steps
        engine.step()

    # Class-level wrappers for methods called through instances (the GEMM's __call__), module
    # attributes for cupa.decode, instance attributes for the rest.
    gemm_type = blas.graph_gemm_type()
    gemm_type.__call__ = timed("gemm (GemmEx)", gemm_type.__call__)
    cupa.decode = timed("cupa.decode", cupa.decode)
    cupa.DecodePlan.run_matched = timed("DecodePlan.run_matched", cupa.DecodePlan.run_matched)
    cache.write = timed("cache.write", cache.write)
    for op in ("split_qkv", "add_rms_norm", "silu_mul", "rms_norm", "rope_tables"):
        setattr(model.fused, op, timed(f"fused {op}", getattr(model.fused, op)))
    model.forward = timed("model.forward (all)", model.forward)
    TOTALS.clear()
    COUNTS.clear()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    cupy.cuda.Device().synchronize()
    step_us = (time.perf_counter() - start) / args.steps * 1e6

    layers, steps = args.layers, args.steps
    print(f"{args.prompts} prompts, {layers} layers, {steps} eager steps; launch floor "
          f"L = {floor:.1f} us; step {step_us:.0f} us wall ({step_us / layers:.1f} us a layer)")
    print("| call | calls a layer | us a call | in L | us a layer |")
    print("|---|---:|---:|---:|---:|")
    accounted = 0.0
    for name in sorted(TOTALS, key=TOTALS.get, reverse=True):
        per_call = TOTALS[name] / COUNTS[name] * 1e6
        per_layer = TOTALS[name] / steps / layers * 1e6
        if not name.startswith("model.forward"):
            accounted += per_layer
        print(f"| {name} | {COUNTS[name] / steps / layers:.2f} | {per_call:.1f} | "
              f"{per_call / floor:.2f} | {per_layer:.1f} |")
    forward = TOTALS["model.forward (all)"] / steps / layers * 1e6
    print_array_op_costs(cupy, floor)
    print(f"forward's own Python (forward minus the calls above): {forward - accounted:.1f} us a "
          f"layer; outside the forward (tables, sampling, bookkeeping): "
          f"{step_us - forward * layers:.0f} us a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
