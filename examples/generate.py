#!/usr/bin/env python3
"""Generate text with a Llama / Mistral / Qwen2 checkpoint on cupa's paged KV cache.

    python examples/make_tiny_llama.py --out /tmp/tiny
    python examples/generate.py --model /tmp/tiny --prompt-ids 1,2,3 --prompt-ids 4,5 \\
        --max-new-tokens 16
    python examples/generate.py --model ~/Llama-3.2-1B --prompt "The capital of France is" \\
        --prompt "Once upon a time" --temperature 0.7 --top-p 0.9 --seed 1

All prompts run as one continuous batch. Text (or token ids) streams to stdout as it is generated
(to stderr with --json, which prints one JSON object per prompt on stdout and nothing else).
Runs on the GPU through cupy when one is present, else on numpy (float32).

--tensor-parallel N splits the model over N GPUs, one process each (NCCL; several hosts: see
the README), rank 0 printing; on the numpy backend it simulates the N ranks as threads of this
process, which gives the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # cupa from a source checkout

from cupa.validation import SUPPORTED_BLOCK_SIZES  # noqa: E402
from llm.cli_args import (OneLineArgumentParser, non_negative_float, non_negative_int,  # noqa: E402
                          one_line_warnings, positive_int, probability, report)
from llm.config import (ConfigError, InvalidPromptError, check_prompt_ids,  # noqa: E402
                        load_config)
from llm.collectives import minimum_over_ranks  # noqa: E402
from llm.engine import Engine  # noqa: E402
from llm.launcher import LaunchError, run_tensor_parallel  # noqa: E402
from llm.runtime import (block_bytes, calibrate_kv_scales, default_num_blocks,  # noqa: E402
                         load_model, make_cache, resolve_backend, resolve_kv_format)
from llm.sampling import SamplingParams  # noqa: E402
from llm.tensor_parallel import ROOT_RANK, check_tensor_parallel  # noqa: E402
from llm.tokenizer import TextStream, load_tokenizer, tokenizers_available  # noqa: E402
from llm.weights import CheckpointError  # noqa: E402

KV_FORMATS = ("none", "fp8_e4m3", "fp8_e4m3fnuz", "auto")


def parse_ids(text: str):
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}")
    if not ids:
        raise argparse.ArgumentTypeError("empty --prompt-ids")
    return ("ids", ids)


def parse_kv_scale(text: str):
    """'calibrate' or a positive scale (kept within a range whose reciprocal float32 holds)."""
    if text == "calibrate":
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1e-30 < value < 1e30:
        raise argparse.ArgumentTypeError(f"expected 'calibrate' or a positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--prompt", dest="prompts", action="append", type=lambda s: ("text", s),
                   default=[], help="prompt text (repeatable; needs `pip install tokenizers`)")
    p.add_argument("--prompt-ids", dest="prompts", action="append", type=parse_ids,
                   help="prompt as comma-separated token ids, e.g. 1,2,3 (repeatable)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 = greedy (default)")
    p.add_argument("--top-p", type=probability, default=1.0, help="in (0, 1]; 1 = no limit")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="0 = no limit")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--block-size", type=int, default=16, choices=SUPPORTED_BLOCK_SIZES)
    p.add_argument("--num-blocks", type=positive_int, default=None,
                   help="KV-cache blocks (default: enough for every prompt at full length, "
                        "capped at 80%% of free GPU memory); fewer make sequences wait or be "
                        "preempted")
    p.add_argument("--kv-format", default="none", choices=KV_FORMATS,
                   help="KV-cache storage: 'none' (default) = the compute dtype; 'fp8_e4m3' (OCP "
                        "e4m3fn) or 'fp8_e4m3fnuz' (AMD MI300) = one byte per element, half "
                        "the memory of fp16 (twice the blocks); 'auto' = the fp8 format this GPU "
                        "converts in hardware (python -m cupa info), else none")
    p.add_argument("--kv-scale", type=parse_kv_scale, default="calibrate",
                   help="fp8 only: one scale for K and V (stored code = x / scale), or "
                        "'calibrate' (default): per KV head, 2 x max|K| (resp. |V|) / the "
                        "format's largest value, the max taken over all prompt tokens and all "
                        "layers (the cache has one scale set for every layer) in an extra "
                        "prefill pass")
    p.add_argument("--backend", choices=("gpu", "numpy"), default=None,
                   help="default: gpu when cupy sees a device, else numpy")
    p.add_argument("--dtype", choices=("auto", "float16", "bfloat16", "float32"), default="auto",
                   help="GPU compute dtype (default: the checkpoint's); numpy always uses float32")
    p.add_argument("--max-batch", type=positive_int, default=256,
                   help="most sequences decoded at once")
    p.add_argument("--no-graphs", action="store_true",
                   help="launch every decode step's kernels from Python instead of replaying "
                        "captured CUDA graphs (graphs are the default on a CUDA GPU; the numpy "
                        "backend never uses them)")
    p.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each: query and KV heads and "
                        "the MLP are divided, so num_attention_heads, num_key_value_heads and "
                        "intermediate_size must be multiples of N (default 1). On the numpy "
                        "backend the N ranks are simulated as threads of this process")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per prompt on stdout (streaming goes to stderr)")
    p.add_argument("--quiet", action="store_true", help="no streaming output")
    return p


class Streamer:
    """Prints each new token as it comes: text through the tokenizer, else ' id'. With several
    prompts, a '[i] ' tag starts a new line whenever the stream switches sequence."""

    def __init__(self, tokenizer, out, tagged: bool):
        self.tokenizer, self.out, self.tagged = tokenizer, out, tagged
        self.streams, self.current = {}, None

    def __call__(self, seq, token):
        if token is None:
            return
        if self.tokenizer is not None:
            stream = self.streams.setdefault(seq.seq_id, TextStream(self.tokenizer))
            delta = stream.push(seq.output_ids)
        else:
            delta = f" {token}"
        if not delta:
            return
        if self.tagged and self.current != seq.seq_id:
            self.out.write(("\n" if self.current is not None else "") + f"[{seq.seq_id}] ")
            self.current = seq.seq_id
        self.out.write(delta)
        self.out.flush()

    def end(self):
        if self.current is not None or not self.tagged:
            self.out.write("\n")
            self.out.flush()


def _scales(values) -> str:
    """A short text for per-head scales: one number if they are all equal, else min..max."""
    lo, hi = float(values.min()), float(values.max())
    return f"{lo:.3g}" if lo == hi else f"{lo:.3g}..{hi:.3g}"


def memory_bytes(backend: str) -> int | None:
    """Total memory the KV cache could ever occupy: the GPU's, or the host's RAM (None when the
    platform does not say)."""
    if backend == "gpu":
        import cupy
        return cupy.cuda.Device().mem_info[1]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def rank_report(group, error) -> int:
    """report(error), naming the rank in a tensor-parallel run (where each rank reports)."""
    return report(error if group is None else f"rank {group.rank} of {group.world}: {error}")


def main(argv=None, group=None) -> int:
    """The program; with `group` (a collectives process group, set by the launcher), one
    tensor-parallel rank of it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.prompts:
        parser.error("give at least one --prompt or --prompt-ids")
    # The argument types have range-checked every number; check() is the engine's own guard.
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos)
    try:
        params.check()
    except ValueError as e:
        parser.error(str(e))

    try:
        # The cheap checks first: a missing directory, a bad config.json or prompt ids outside
        # the vocabulary are reported before any weight is read.
        config = load_config(args.model)
        tokenizer = load_tokenizer(args.model)
        if any(kind == "text" for kind, _ in args.prompts) and tokenizer is None:
            why = (f"{args.model} has no tokenizer.json" if tokenizers_available() else
                   "the `tokenizers` package is not installed (pip install tokenizers)")
            parser.error(f"--prompt needs a tokenizer but {why}; pass --prompt-ids instead")
        prompts = [tokenizer.encode(p) if kind == "text" else p for kind, p in args.prompts]
        check_prompt_ids(prompts, config)
        check_tensor_parallel(config, args.tensor_parallel)
        if args.tensor_parallel > 1 and group is None:
            # The ranks (threads on numpy, else one process per GPU) each run main(argv, group).
            backend = resolve_backend(args.backend)
            if backend != "gpu":
                print(f"note: numpy backend: the {args.tensor_parallel} tensor-parallel ranks "
                      "are simulated as threads of this process", file=sys.stderr)
            return run_tensor_parallel(args.tensor_parallel, backend, main,
                                       sys.argv[1:] if argv is None else argv)
        model, backend = load_model(args.model, backend=args.backend, dtype=args.dtype,
                                    progress=group is None or group.rank == ROOT_RANK,
                                    group=group)
    # Only errors about the user's input: config.json, the checkpoint, the prompts, files that
    # cannot be read, options this backend refuses (ValueError, RuntimeError: e.g. --backend gpu
    # without a GPU, or fewer GPUs than --tensor-parallel).
    except (ConfigError, CheckpointError, InvalidPromptError, OSError, ValueError,
            RuntimeError, LaunchError) as e:
        return rank_report(group, e)
    # Tensor parallel: every rank runs the rest with the same arguments (so the same requests,
    # scheduling and collectives); rank 0 alone prints.
    printing = group is None or group.rank == ROOT_RANK

    kv_format = resolve_kv_format(args.kv_format, backend)
    if kv_format is None and args.kv_scale != "calibrate":
        parser.error(f"--kv-scale needs an fp8 KV cache, but --kv-format {args.kv_format} "
                     f"stores {model.dtype.name} here")
    k_scale = v_scale = None
    if kv_format and args.kv_scale == "calibrate":
        k_scale, v_scale = calibrate_kv_scales(model, prompts, kv_format)
    elif kv_format:
        k_scale = v_scale = args.kv_scale
    # A sequence stops at the model's longest sequence, so no block past it is ever needed.
    lengths = [min(len(p) + args.max_new_tokens, model.config.max_seq_len) for p in prompts]
    if args.num_blocks is not None:  # 0 is refused by its type: it must not mean the default
        num_blocks = args.num_blocks
    else:
        num_blocks = default_num_blocks(model, args.block_size, lengths, backend,
                                        kv_format=kv_format)
        if group is not None:  # the same cache size on every rank: the same scheduling
            num_blocks = minimum_over_ranks(group, num_blocks)
    need, limit = num_blocks * block_bytes(model, args.block_size, kv_format), memory_bytes(backend)
    blocks_from = "--num-blocks" if args.num_blocks is not None else "the default for the prompts"
    if limit is not None and need > limit:
        return rank_report(group, f"a KV cache of {num_blocks} blocks ({blocks_from}) needs "
                                  f"{need / 2**30:.1f} GiB, more than the {limit / 2**30:.1f} "
                                  f"GiB of memory here: lower --num-blocks or --max-new-tokens")
    try:
        cache = make_cache(model, num_blocks, args.block_size, backend, kv_format=kv_format,
                           k_scale=k_scale, v_scale=v_scale)
    except MemoryError:
        return rank_report(group, f"a KV cache of {num_blocks} blocks ({blocks_from}, "
                                  f"{need / 2**30:.1f} GiB) could not be allocated: lower "
                                  "--num-blocks or --max-new-tokens")
    cfg = model.config
    log = sys.stderr if args.json else sys.stdout
    storage = (f"{kv_format}, scales K {_scales(cache.k_scale)} V {_scales(cache.v_scale)}"
               if kv_format else model.dtype.name)
    world = 1 if group is None else group.world
    # A rank's model has heads / N: the header shows the whole model's.
    split = f" | tensor parallel {world} (per rank heads {cfg.num_heads}/{cfg.num_kv_heads})" \
        if world > 1 else ""
    if printing:
        print(f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads "
              f"{cfg.num_heads * world}/{cfg.num_kv_heads * world}, vocab {cfg.vocab_size} | "
              f"backend {backend}, {model.dtype.name} | {len(prompts)} prompts, KV cache "
              f"{num_blocks} blocks x {args.block_size} tokens ({storage}){split}",
              file=sys.stderr)

    streamer = None if args.quiet or not printing else Streamer(tokenizer, log,
                                                                 tagged=len(prompts) > 1)
    if streamer is not None and len(prompts) == 1 and tokenizer is not None:
        log.write(tokenizer.decode(prompts[0]))
    engine = Engine(model, cache, eos_ids=cfg.eos_token_ids, max_batch=args.max_batch,
                    on_token=streamer, backend=backend, graphs=False if args.no_graphs else None,
                    group=group)
    start = time.perf_counter()
    seqs = [engine.add_request(p, params, seed=args.seed) for p in prompts]
    engine.run()
    elapsed = time.perf_counter() - start
    if streamer is not None:
        streamer.end()
    if not printing:
        return 0

    for i, seq in enumerate(seqs):
        if seq.finish_reason == "cache_too_small":
            print(f"warning: prompt {i} ({len(seq.prompt_ids)} tokens) stopped after "
                  f"{len(seq.output_ids)} new tokens: the KV cache ({num_blocks} blocks of "
                  f"{args.block_size}) is full; raise --num-blocks", file=sys.stderr)
        if args.json:
            record = {"prompt_ids": seq.prompt_ids, "output_ids": seq.output_ids,
                      "finish_reason": seq.finish_reason}
            if tokenizer is not None:
                record["output_text"] = tokenizer.decode(seq.output_ids)
            print(json.dumps(record), flush=True)
        elif len(seqs) > 1:
            body = (tokenizer.decode(seq.output_ids) if tokenizer is not None
                    else " ".join(map(str, seq.output_ids)))
            print(f"--- prompt {i} ({len(seq.prompt_ids)} tokens -> {len(seq.output_ids)}, "
                  f"{seq.finish_reason}) ---\n{body}", file=log)

    s = engine.stats
    rate = s.generated_tokens / elapsed if elapsed > 0 else float("inf")
    decode_rate = s.decode_tokens / s.decode_time if s.decode_time > 0 else float("nan")
    graphs = (f", {s.graph_steps} from CUDA graphs ({s.graph_captures} captured in "
              f"{s.capture_time:.2f} s)" if s.graph_captures else "")
    print(f"generated {s.generated_tokens} tokens in {elapsed:.2f} s: {rate:.1f} tokens/s "
          f"(prefill {s.prefill_tokens} tokens in {s.prefill_time:.2f} s; decode {s.decode_steps} "
          f"steps{graphs}, {decode_rate:.1f} tokens/s; {s.preemptions} preemptions)", file=log)
    return 0


if __name__ == "__main__":
    one_line_warnings()
    sys.exit(main())
