#!/usr/bin/env python3
"""End-to-end generation throughput: cupa paged decode vs a naive attention path (GPU only).

    python examples/bench_generate.py                      # default matrix, all 32 layers
    python examples/bench_generate.py --prompts 32 --output-lens 256 --attention paged
    python examples/bench_generate.py --json /tmp/bench.json
    python examples/bench_generate.py --kv-format fp8_e4m3   # fp8 KV cache (scales calibrated)
    python examples/bench_generate.py --no-graphs            # paged decode launched eagerly
    python examples/bench_generate.py --shape llama2-70b --layers 20 --attention paged \
        --tensor-parallel 2                                   # 70B-shaped layers on 2 GPUs

The model is Llama-2-7B-shaped (hidden 4096, 32 heads, MHA, head 128, MLP 11008, vocab 32000,
32 layers; --layers builds fewer) with random fp16 weights made on the GPU; --shape llama2-70b
has Llama-2-70B's layers (hidden 8192, 64 heads, 8 KV heads, MLP 28672, 80 of them).
--tensor-parallel N splits the model over N GPUs, one process each (rank 0 prints; each rank
makes random weights of its own part only). The default matrix is 8/16/32 prompts x 512 input
tokens x 256/512 output tokens x 2 attention paths. The same engine runs both paths; only decode
attention differs:
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
                          positive_int_list, report)
from llm.tensor_parallel import ROOT_RANK, check_tensor_parallel, shard_config  # noqa: E402

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                 num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096)
LLAMA2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
                  num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=4096)
SHAPES = {"llama2-7b": LLAMA2_7B, "llama2-70b": LLAMA2_70B}
ATTENTION_PATHS = ("paged", "naive")

# Output tokens/s of Hugging Face transformers' generate() on the full Llama-2-7B shape (fp16,
# one GPU), keyed by (prompts, input tokens, output tokens): the reference this benchmark is
# measured against. Other shapes (or fewer layers, or tensor parallel) have none.
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
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b",
                   help="the layer shape (default llama2-7b; llama2-70b: 8192 hidden, 64 / 8 "
                        "heads, MLP 28672, 80 layers)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="decoder layers to build, of the shape's (default all: 32 for "
                        "llama2-7b, whose full model has a Hugging Face reference, 80 for "
                        "llama2-70b, which needs several GPUs; fewer run faster)")
    p.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each (default 1); heads, "
                        "KV heads and the MLP width must be multiples of N")
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
    shape = SHAPES[args.shape]
    if args.layers is None:
        args.layers = shape["num_layers"]
    if args.layers > shape["num_layers"]:
        p.error(f"--layers must be from 1 to {shape['num_layers']}, got {args.layers}")
    # A sequence stops at the model's position limit, which would silently shorten the run.
    longest = args.input_len + max(args.output_lens)
    if longest > shape["max_position_embeddings"]:
        p.error(f"--input-len {args.input_len} + --output-lens {max(args.output_lens)} = "
                f"{longest} tokens exceeds the model's {shape['max_position_embeddings']} "
                "positions")
    try:
        check_tensor_parallel(bench_config(args), args.tensor_parallel)
    except ValueError as e:
        p.error(f"--tensor-parallel {args.tensor_parallel} --shape {args.shape}: {e}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        # Found out now, not after minutes of benchmarking.
        p.error(f"--json {args.json}: the directory {Path(args.json).resolve().parent} "
                "does not exist")
    return args


def bench_config(args):
    """The (unsharded) config of the benchmark's model."""
    from llm.config import ModelConfig
    return ModelConfig(architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=10000.0,
                       **dict(SHAPES[args.shape], num_layers=args.layers))


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
            kv_format=None, graphs=True, hf_reference=True, group=None):
    """One timed run. hf_reference: the model is the full Llama-2-7B on one GPU, the shape
    HF_TOKENS_PER_S was measured on. group: this rank's process group (tensor parallel)."""
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
                    graphs=graphs, group=group)
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
    hf = HF_TOKENS_PER_S.get((prompts, input_len, output_len)) if hf_reference else None
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


def main(argv=None, group=None) -> int:
    """The benchmark; with `group` (set by the launcher), one tensor-parallel rank of it: every
    rank runs the same runs in lock-step, rank 0 alone prints and writes."""
    args = parse_args(argv)
    if not gpu_available():
        print("bench_generate.py needs a GPU (cupy and a visible device); none found, nothing "
              "was run. For a CPU run use examples/generate.py --backend numpy.", file=sys.stderr)
        return 2
    if args.tensor_parallel > 1 and group is None:
        from llm.launcher import LaunchError, run_tensor_parallel
        try:
            return run_tensor_parallel(args.tensor_parallel, "gpu", main,
                                       sys.argv[1:] if argv is None else argv)
        except (LaunchError, RuntimeError) as e:  # too few GPUs, launch variables that clash
            return report(e)
    import cupy

    from cupa.gpu.device import device_info
    from llm.model import Model
    from llm.runtime import resolve_kv_format
    from llm.weights import random_weights

    printing = group is None or group.rank == ROOT_RANK
    world = 1 if group is None else group.world

    def say(text):
        if printing:
            print(text, file=sys.stderr)

    config = bench_config(args)
    shape_name = {"llama2-7b": "Llama-2-7B", "llama2-70b": "Llama-2-70B"}[args.shape]
    all_layers = SHAPES[args.shape]["num_layers"]
    device = device_info().name
    kv_format = resolve_kv_format(args.kv_format, "gpu")
    note = (f"{shape_name} shape with {args.layers} of {all_layers} layers (random fp16 weights)"
            if args.layers != all_layers
            else f"{shape_name} shape, all {all_layers} layers (random fp16 weights)")
    note += f", {kv_format or 'float16'} KV cache"
    if world > 1:
        note += f", tensor parallel over {world} GPUs"
    say(f"{device}: {note}")
    if "naive" in args.attention:
        say("the naive path runs eagerly (its shapes change every step; no CUDA graph)")
    # Each rank makes random weights of its own part only (of the rank's config), with a seed
    # of its own: no rank ever holds the whole model. The all-reduces add o's and down's bias
    # once (random_weights makes none).
    rank_config = shard_config(config, world)
    weights = random_weights(rank_config, cupy, np.float16, seed=args.seed + (group.rank
                                                                              if group else 0))
    model = Model(rank_config, weights, cupy, np.float16,
                  reduce=group.all_reduce_sum if group is not None else None)
    hf_reference = args.shape == "llama2-7b" and args.layers == all_layers and world == 1
    bandwidth = copy_bandwidth(cupy)
    say(f"weights {weights.nbytes() / 2**30:.2f} GiB{' per GPU' if world > 1 else ''}; device "
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write); fused elementwise kernels "
        f"{'on' if model.fused else 'OFF (see the warning above)'}")

    for attention in args.attention:  # compile kernels and warm cupy's caches off the clock
        run_one(model, cupy, prompts=2, input_len=32, output_len=4, attention=attention,
                block_size=args.block_size, seed=args.seed, kv_format=kv_format,
                graphs=args.graphs, hf_reference=hf_reference, group=group)

    runs = [(n, o, a) for o in args.output_lens for n in args.prompts for a in args.attention
            if a == "paged" or n in args.naive_prompts]
    results = []
    for n, out_len, attention in runs:
        r = run_one(model, cupy, prompts=n, input_len=args.input_len, output_len=out_len,
                    attention=attention, block_size=args.block_size, seed=args.seed,
                    kv_format=kv_format, graphs=args.graphs, hf_reference=hf_reference,
                    group=group)
        results.append(r)
        hf = f", {r['vs_hf']:.1f}x HF" if r["vs_hf"] else ""
        graph = (f" (GPU {r['graph_device_step_ms']:.2f} ms; graph captured in "
                 f"{r['capture_seconds']:.2f} s, off the clock)" if r["graph_steps"] else "")
        say(f"[{len(results)}/{len(runs)}] {n} prompts x {args.input_len} in x {out_len} out, "
            f"{run_label(r)}: {r['output_tokens_per_s']:.0f} output tok/s{hf} in "
            f"{r['seconds']:.1f} s, decode step {r['decode_step_ms']:.2f} ms{graph}")
    if not printing:
        return 0

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
        # A rank reads its own weights and KV heads, all ranks at once: the roofline of a step
        # is one GPU's (the all-reduces are not in it).
        per_gpu = " of one GPU (its part of the weights and KV heads)" if world > 1 else ""
        print(f"\nDecode step at {biggest} prompts vs roofline{per_gpu} (weights + KV read per "
              f"step at the average context, over {bandwidth / 1e9:.0f} GB/s measured copy "
              f"bandwidth):\n")
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
            "device": device, "model": note, "shape": args.shape, "layers": args.layers,
            "tensor_parallel": world, "kv_format": kv_format,
            "block_size": args.block_size, "graphs": args.graphs,
            "copy_bandwidth_bytes_per_s": bandwidth, "results": results, "roofline": roof},
            indent=2))
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
