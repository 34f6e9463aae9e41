#!/usr/bin/env python3
"""End-to-end generation throughput: cupa paged decode vs a naive attention path (GPU only).

    python examples/bench_generate.py                      # default matrix, all 32 layers
    python examples/bench_generate.py --prompts 32 --output-lens 256 --attention paged
    python examples/bench_generate.py --json /tmp/bench.json
    python examples/bench_generate.py --kv-format fp8_e4m3   # fp8 KV cache (scales calibrated)
    python examples/bench_generate.py --no-graphs            # paged decode launched eagerly

The model is Llama-2-7B-shaped (hidden 4096, 32 heads, MHA, head 128, MLP 11008, vocab 32000,
32 layers; --layers builds fewer) with random fp16 weights made on the GPU. The default matrix is
8/16/32 prompts x 512 input tokens x 256/512 output tokens x 2 attention paths. The same engine
runs both paths; only decode attention differs:
  paged  cupa.decode over the block tables; decode steps replay captured CUDA graphs (one per
         batch bucket, captured before the clock starts) unless --no-graphs
  naive  gather each sequence's blocks into dense arrays, then matmul, softmax, matmul; always
         launched eagerly, since its array shapes change every step (no graph can replay it)
Each row also shows the Hugging Face transformers reference for the same shape where there is
one (HF_TOKENS_PER_S: the full 32-layer model, 512 input tokens) and the ratio to it. The
decode-step time at the largest prompt count is compared with a roofline: bytes a step must read
(weights + the KV of every sequence) over the copy bandwidth measured in this run.
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
from cupa.problem import SUPPORTED_BLOCK_SIZES  # noqa: E402
from llm.cli_args import (OneLineArgumentParser, non_negative_int, positive_int,  # noqa: E402
                          positive_int_list)

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                 num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096)
ATTENTION_PATHS = ("paged", "naive")

# Output tokens/s of Hugging Face transformers' generate() on the full Llama-2-7B shape (fp16),
# keyed by (prompts, input tokens, output tokens): the reference this benchmark is measured
# against. Other shapes (or fewer layers) have none.
HF_TOKENS_PER_S = {(8, 512, 256): 95.6, (16, 512, 256): 235.5, (32, 512, 256): 476.2,
                   (32, 512, 512): 612.4}


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--prompts", type=positive_int_list, default=[8, 16, 32],
                   help="prompt counts, comma-separated (default 8,16,32)")
    p.add_argument("--input-len", type=positive_int, default=512,
                   help="prompt tokens (default 512)")
    p.add_argument("--output-lens", type=positive_int_list, default=[256, 512],
                   help="generated tokens per prompt, comma-separated (default 256,512)")
    p.add_argument("--attention", type=lambda s: [x for x in s.split(",") if x],
                   default=list(ATTENTION_PATHS),
                   help="paths to run: paged,naive (default both)")
    p.add_argument("--naive-prompts", type=positive_int_list, default=None,
                   help="prompt counts of the naive path, comma-separated (default: the same as "
                        "--prompts)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="paged path: replay decode steps from captured CUDA graphs (default; "
                        "--no-graphs launches every kernel from Python). The naive path is "
                        "always eager")
    p.add_argument("--layers", type=positive_int, default=LLAMA2_7B["num_layers"],
                   help="decoder layers to build, of Llama-2-7B's 32 (default 32; fewer run "
                        "faster but have no Hugging Face reference)")
    p.add_argument("--block-size", type=int, default=16, choices=SUPPORTED_BLOCK_SIZES)
    p.add_argument("--kv-format", default="none",
                   choices=("none", "fp8_e4m3", "fp8_e4m3fnuz", "auto"),
                   help="KV-cache storage as in generate.py (default none = fp16); fp8 scales "
                        "are calibrated on each run's prompts, off the clock")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    bad = set(args.attention) - set(ATTENTION_PATHS)
    if bad:
        p.error(f"--attention: unknown {sorted(bad)}; choose from {','.join(ATTENTION_PATHS)}")
    if not args.attention:
        p.error(f"--attention: give at least one of {','.join(ATTENTION_PATHS)}")
    if args.naive_prompts is None:
        args.naive_prompts = args.prompts
    # Counts not in --prompts would silently never run.
    stray = sorted(set(args.naive_prompts) - set(args.prompts))
    if stray:
        p.error(f"--naive-prompts {','.join(map(str, stray))}: not among --prompts "
                f"{','.join(map(str, args.prompts))}")
    if args.layers > LLAMA2_7B["num_layers"]:
        p.error(f"--layers must be from 1 to {LLAMA2_7B['num_layers']}, got {args.layers}")
    # A sequence stops at the model's position limit, which would silently shorten the run.
    longest = args.input_len + max(args.output_lens)
    if longest > LLAMA2_7B["max_position_embeddings"]:
        p.error(f"--input-len {args.input_len} + --output-lens {max(args.output_lens)} = "
                f"{longest} tokens exceeds the model's {LLAMA2_7B['max_position_embeddings']} "
                "positions")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        # Found out now, not after minutes of benchmarking.
        p.error(f"--json {args.json}: the directory {Path(args.json).resolve().parent} "
                "does not exist")
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
            kv_format=None, graphs=True):
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
    graphs = graphs and attention == "paged"
    engine = Engine(model, cache, attention=attention, backend="gpu", max_batch=prompts,
                    graphs=graphs)
    # Every sequence decodes until the end together, so one graph serves the whole run; it is
    # captured here, as a serving engine would at start-up, not on the clock.
    engine.prepare_graphs([prompts])
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
    rate = s.generated_tokens / elapsed
    hf = HF_TOKENS_PER_S.get((prompts, input_len, output_len)) \
        if model.config.num_layers == 32 else None
    return {"prompts": prompts, "input_len": input_len, "output_len": output_len,
            "attention": attention, "graphs": graphs, "kv_format": kv_format or "float16",
            "seconds": elapsed, "output_tokens_per_s": rate,
            "prefill_seconds": s.prefill_time, "decode_steps": s.decode_steps,
            "decode_step_ms": 1e3 * s.decode_time / max(s.decode_steps, 1),
            "decode_tokens_per_s": s.decode_tokens / s.decode_time if s.decode_time else 0.0,
            "graph_steps": s.graph_steps, "capture_seconds": s.capture_time,
            "graph_device_step_ms": (1e3 * s.graph_device_time / s.graph_steps
                                     if s.graph_steps else None),
            "preemptions": s.preemptions, "hf_tokens_per_s": hf,
            "vs_hf": rate / hf if hf else None}


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
            "fraction_of_roofline": 1e3 * seconds / run["decode_step_ms"],
            "times_roofline": run["decode_step_ms"] / (1e3 * seconds)}


def run_label(r) -> str:
    return f"{r['attention']}" + (" (graphs)" if r["graphs"] else " (eager)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not gpu_available():
        print("bench_generate.py needs a GPU (cupy and a visible device); none found, nothing "
              "was run. For a CPU run use examples/generate.py --backend numpy.", file=sys.stderr)
        return 2
    import cupy

    from cupa.gpu.device import device_info
    from llm.config import ModelConfig
    from llm.model import Model
    from llm.runtime import resolve_kv_format
    from llm.weights import random_weights

    config = ModelConfig(architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=10000.0,
                         **dict(LLAMA2_7B, num_layers=args.layers))
    device = device_info().name
    kv_format = resolve_kv_format(args.kv_format, "gpu")
    note = (f"Llama-2-7B shape with {args.layers} of 32 layers (random fp16 weights)"
            if args.layers != 32 else "Llama-2-7B shape, all 32 layers (random fp16 weights)")
    note += f", {kv_format or 'float16'} KV cache"
    print(f"{device}: {note}", file=sys.stderr)
    if "naive" in args.attention:
        print("the naive path runs eagerly (its shapes change every step; no CUDA graph)",
              file=sys.stderr)
    weights = random_weights(config, cupy, np.float16, seed=args.seed)
    model = Model(config, weights, cupy, np.float16)
    bandwidth = copy_bandwidth(cupy)
    print(f"weights {weights.nbytes() / 2**30:.2f} GiB; device copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s (read + write); fused elementwise kernels "
          f"{'on' if model.fused else 'OFF (see the warning above)'}", file=sys.stderr)

    for attention in args.attention:  # compile kernels and warm cupy's caches off the clock
        run_one(model, cupy, prompts=2, input_len=32, output_len=4, attention=attention,
                block_size=args.block_size, seed=args.seed, kv_format=kv_format,
                graphs=args.graphs)

    runs = [(n, o, a) for o in args.output_lens for n in args.prompts for a in args.attention
            if a == "paged" or n in args.naive_prompts]
    results = []
    for n, out_len, attention in runs:
        r = run_one(model, cupy, prompts=n, input_len=args.input_len, output_len=out_len,
                    attention=attention, block_size=args.block_size, seed=args.seed,
                    kv_format=kv_format, graphs=args.graphs)
        results.append(r)
        hf = f", {r['vs_hf']:.1f}x HF" if r["vs_hf"] else ""
        graph = (f" (GPU {r['graph_device_step_ms']:.2f} ms; graph captured in "
                 f"{r['capture_seconds']:.2f} s, off the clock)" if r["graph_steps"] else "")
        print(f"[{len(results)}/{len(runs)}] {n} prompts x {args.input_len} in x {out_len} out, "
              f"{run_label(r)}: {r['output_tokens_per_s']:.0f} output tok/s{hf} in "
              f"{r['seconds']:.1f} s, decode step {r['decode_step_ms']:.2f} ms{graph}",
              file=sys.stderr)

    print(f"\n{note}, {device}, block size {args.block_size}\n")
    print("| prompts | input | output | attention | output tok/s | decode step ms | "
          "speedup vs naive | HF tok/s | vs HF |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    by_key = {(r["prompts"], r["output_len"], r["attention"]): r for r in results}
    for r in results:
        naive = by_key.get((r["prompts"], r["output_len"], "naive"))
        speedup = (f"{r['output_tokens_per_s'] / naive['output_tokens_per_s']:.2f}x"
                   if naive and r["attention"] == "paged" else "")
        hf = (f"{r['hf_tokens_per_s']:.1f} | {r['vs_hf']:.2f}x" if r["hf_tokens_per_s"]
              else " | ")
        print(f"| {r['prompts']} | {r['input_len']} | {r['output_len']} | {run_label(r)} | "
              f"{r['output_tokens_per_s']:.0f} | {r['decode_step_ms']:.2f} | {speedup} | {hf} |")

    biggest = max(args.prompts)
    roof = []
    for r in results:
        if r["prompts"] == biggest and r["output_len"] == max(args.output_lens):
            roof.append(dict(roofline(model, r, bandwidth), attention=r["attention"],
                             graphs=r["graphs"], prompts=biggest, output_len=r["output_len"],
                             graph_device_step_ms=r["graph_device_step_ms"]))
    if roof:
        print(f"\nDecode step at {biggest} prompts vs roofline (weights + KV read per step at "
              f"the average context, over {bandwidth / 1e9:.0f} GB/s measured copy bandwidth):\n")
        print("| attention | avg context | weights GiB | KV GiB | roofline ms | measured ms | "
              "x roofline | GPU ms of a graph replay |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for x in roof:
            gpu = x["graph_device_step_ms"]
            print(f"| {run_label(x)} | {x['avg_context']:.0f} | {x['weight_bytes'] / 2**30:.2f} "
                  f"| {x['kv_bytes'] / 2**30:.2f} | {x['roofline_step_ms']:.2f} | "
                  f"{x['measured_step_ms']:.2f} | {x['times_roofline']:.2f}x | "
                  f"{'' if gpu is None else f'{gpu:.2f}'} |")

    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": device, "model": note, "layers": args.layers, "kv_format": kv_format,
            "block_size": args.block_size, "graphs": args.graphs,
            "copy_bandwidth_bytes_per_s": bandwidth, "results": results, "roofline": roof},
            indent=2))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
