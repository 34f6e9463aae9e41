#!/usr/bin/env python3
"""End-to-end generation throughput: cupa paged decode vs a naive attention path (GPU only).

    python examples/bench_generate.py                      # default matrix, 8 of 32 layers
    python examples/bench_generate.py --layers 32 --prompts 32 --output-lens 256
    python examples/bench_generate.py --json /tmp/bench.json
    python examples/bench_generate.py --kv-format fp8_e4m3   # fp8 KV cache (scales calibrated)

The model is Llama-2-7B-shaped (hidden 4096, 32 heads, MHA, head 128, MLP 11008, vocab 32000)
with random fp16 weights made on the GPU; by default only 8 of its 32 layers are built so the
default matrix (8/16/32 prompts x 512 input tokens x 256/512 output tokens x 2 attention paths)
finishes in a few minutes. The same engine runs both paths; only decode attention differs:
  paged  cupa.decode over the block tables
  naive  gather each sequence's blocks into dense arrays, then matmul, softmax, matmul
It also reports the decode-step time at the largest prompt count against a roofline: bytes a step
must read (weights + the KV of every sequence) over the copy bandwidth measured in this run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # cupa from a source checkout

from cupa.arrays import gpu_available  # noqa: E402

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                 num_heads=32, num_kv_heads=32, head_dim=128)


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--prompts", type=int_list, default=[8, 16, 32],
                   help="prompt counts, comma-separated (default 8,16,32)")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--output-lens", type=int_list, default=[256, 512],
                   help="generated tokens per prompt, comma-separated (default 256,512)")
    p.add_argument("--attention", type=lambda s: s.split(","), default=["paged", "naive"],
                   help="paths to run: paged,naive (default both)")
    p.add_argument("--layers", type=int, default=8,
                   help="decoder layers to build, of Llama-2-7B's 32 (default 8, for time)")
    p.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32))
    p.add_argument("--kv-format", default="none",
                   choices=("none", "fp8_e4m3", "fp8_e4m3fnuz", "auto"),
                   help="KV-cache storage as in generate.py (default none = fp16); fp8 scales "
                        "are calibrated on each run's prompts, off the clock")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    bad = set(args.attention) - {"paged", "naive"}
    if bad:
        p.error(f"--attention: unknown {sorted(bad)}; choose from paged,naive")
    return args


def copy_bandwidth(cupy, nbytes=2 << 30, repeats=10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write traffic."""
    src = cupy.ones(nbytes, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    dst[...] = src  # warm up
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        dst[...] = src
    stop.record()
    stop.synchronize()
    seconds = cupy.cuda.get_elapsed_time(start, stop) / 1e3
    del src, dst
    return 2 * nbytes * repeats / seconds


def run_one(model, cupy, *, prompts, input_len, output_len, attention, block_size, seed,
            kv_format=None):
    from llm.engine import Engine
    from llm.runtime import calibrate_kv_scales, make_cache
    from llm.sampling import SamplingParams
    rng = np.random.default_rng(seed)
    prompt_ids = [rng.integers(3, model.config.vocab_size, input_len).tolist()
                  for _ in range(prompts)]
    scales = {}
    if kv_format:
        scales = dict(zip(("k_scale", "v_scale"),
                          calibrate_kv_scales(model, prompt_ids, kv_format)))
    blocks = prompts * (math.ceil((input_len + output_len) / block_size) + 1)
    cache = make_cache(model, blocks, block_size, "gpu", kv_format=kv_format, **scales)
    engine = Engine(model, cache, attention=attention, backend="gpu", max_batch=prompts)
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    for ids in prompt_ids:
        engine.add_request(ids, params)
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    engine.run()
    cupy.cuda.Device().synchronize()
    elapsed = time.perf_counter() - start
    s = engine.stats
    del engine, cache
    cupy.get_default_memory_pool().free_all_blocks()
    return {"prompts": prompts, "input_len": input_len, "output_len": output_len,
            "attention": attention, "kv_format": kv_format or "float16", "seconds": elapsed,
            "output_tokens_per_s": s.generated_tokens / elapsed,
            "prefill_seconds": s.prefill_time, "decode_steps": s.decode_steps,
            "decode_step_ms": 1e3 * s.decode_time / max(s.decode_steps, 1),
            "decode_tokens_per_s": s.decode_tokens / s.decode_time if s.decode_time else 0.0,
            "preemptions": s.preemptions}


def roofline(model, run, bandwidth):
    """Bytes one decode step must read at the run's average context, and the time at
    `bandwidth`: all weights once (the LM head included) + every sequence's K and V."""
    cfg = model.config
    context = run["input_len"] + run["output_len"] / 2
    itemsize = 1 if run["kv_format"].startswith("fp8") else model.dtype.itemsize
    kv_bytes = (run["prompts"] * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
                * itemsize)
    weight_bytes = model.weights.nbytes()
    seconds = (weight_bytes + kv_bytes) / bandwidth
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "avg_context": context,
            "roofline_step_ms": 1e3 * seconds,
            "measured_step_ms": run["decode_step_ms"],
            "fraction_of_roofline": 1e3 * seconds / run["decode_step_ms"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not gpu_available():
        print("bench_generate.py needs a GPU (cupy and a visible device); none found, nothing "
              "was run. For a CPU run use examples/generate.py --backend numpy.", file=sys.stderr)
        return 2
    import cupy

    from cupa.device import device_info
    from llm.config import ModelConfig
    from llm.model import Model
    from llm.runtime import resolve_kv_format
    from llm.weights import random_weights

    config = ModelConfig(architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=4096, **dict(LLAMA2_7B, num_layers=args.layers))
    device = device_info().name
    kv_format = resolve_kv_format(args.kv_format, "gpu")
    note = (f"Llama-2-7B shape with {args.layers} of 32 layers (random fp16 weights)"
            if args.layers != 32 else "Llama-2-7B shape, all 32 layers (random fp16 weights)")
    note += f", {kv_format or 'float16'} KV cache"
    print(f"{device}: {note}", file=sys.stderr)
    weights = random_weights(config, cupy, np.float16, seed=args.seed)
    model = Model(config, weights, cupy, np.float16)
    bandwidth = copy_bandwidth(cupy)
    print(f"weights {weights.nbytes() / 2**30:.2f} GiB; device copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s (read + write)", file=sys.stderr)

    for attention in args.attention:  # compile kernels and warm cupy's caches off the clock
        run_one(model, cupy, prompts=2, input_len=32, output_len=4, attention=attention,
                block_size=args.block_size, seed=args.seed, kv_format=kv_format)

    results = []
    shapes = [(n, o) for o in args.output_lens for n in args.prompts]
    total = len(shapes) * len(args.attention)
    for n, out_len in shapes:
        for attention in args.attention:
            r = run_one(model, cupy, prompts=n, input_len=args.input_len, output_len=out_len,
                        attention=attention, block_size=args.block_size, seed=args.seed,
                        kv_format=kv_format)
            results.append(r)
            print(f"[{len(results)}/{total}] {n} prompts x {args.input_len} in x {out_len} out, "
                  f"{attention}: {r['output_tokens_per_s']:.0f} output tok/s, decode step "
                  f"{r['decode_step_ms']:.2f} ms ({r['seconds']:.1f} s)", file=sys.stderr)

    print(f"\n{note}, {device}, block size {args.block_size}\n")
    print("| prompts | input | output | attention | output tok/s | decode step ms | "
          "speedup vs naive |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    by_key = {(r["prompts"], r["output_len"], r["attention"]): r for r in results}
    for r in results:
        naive = by_key.get((r["prompts"], r["output_len"], "naive"))
        speedup = (f"{r['output_tokens_per_s'] / naive['output_tokens_per_s']:.2f}x"
                   if naive and r["attention"] == "paged" else "")
        print(f"| {r['prompts']} | {r['input_len']} | {r['output_len']} | {r['attention']} | "
              f"{r['output_tokens_per_s']:.0f} | {r['decode_step_ms']:.2f} | {speedup} |")

    biggest = max(args.prompts)
    roof = []
    for r in results:
        if r["prompts"] == biggest and r["output_len"] == max(args.output_lens):
            roof.append(dict(roofline(model, r, bandwidth), attention=r["attention"],
                             prompts=biggest, output_len=r["output_len"]))
    if roof:
        print(f"\nDecode step at {biggest} prompts vs roofline (weights + KV read per step at "
              f"the average context, over {bandwidth / 1e9:.0f} GB/s measured copy bandwidth):\n")
        print("| attention | avg context | weights GiB | KV GiB | roofline ms | measured ms | "
              "fraction |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for x in roof:
            print(f"| {x['attention']} | {x['avg_context']:.0f} | {x['weight_bytes'] / 2**30:.2f} "
                  f"| {x['kv_bytes'] / 2**30:.2f} | {x['roofline_step_ms']:.2f} | "
                  f"{x['measured_step_ms']:.2f} | {x['fraction_of_roofline']:.0%} |")

    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": device, "model": note, "layers": args.layers, "kv_format": kv_format,
            "block_size": args.block_size, "copy_bandwidth_bytes_per_s": bandwidth,
            "results": results, "roofline": roof}, indent=2))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
