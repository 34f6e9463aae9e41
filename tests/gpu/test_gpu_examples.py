"""The example engine on the GPU (cupy + cupa kernels). Skips without a GPU.

float32 compute must give exactly the float64 reference's greedy tokens (as the CPU path does);
float16 / bfloat16 compute must give logits close to it at every step of the engine's own path,
and so must an fp8 KV cache (within a looser bound). Decode steps replayed from CUDA graphs (the
default on the GPU, so the tests above run them) must match eager decode steps: the same greedy
and sampled tokens, close logits, with sequences finishing at different times, batch sizes that
are not graph buckets, and preemption.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from cupa import platform
from cupa.arrays import gpu_available

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")
# The engine's graph steps capture cuBLAS calls made through libcublas (examples/llm/cublas.py),
# and the engine turns graphs off on HIP: on ROCm these tests have nothing to run.
ENGINE_GRAPHS_NEED_CUDA = pytest.mark.skipif(
    platform.is_rocm(), reason="CUDA-only: the example engine's graph steps use cuBLAS "
                               "(examples/llm/cublas.py); on ROCm it decodes eagerly")

# The tiny checkpoints and their reference greedy outputs: the CPU tests' fixtures (built again
# for this module, as they are module-scoped).
from test_examples import (MAX_NEW, MODELS, PROMPTS, ROOT, SamplingParams,  # noqa: E402,F401
                           expected, logits_errors, models, record_logits, reference_greedy,
                           reference_logits, run_engine)
from llm.engine import Engine  # noqa: E402
from llm.runtime import load_model, make_cache  # noqa: E402

# ||logits - ref|| / ||ref|| bound per compute dtype (weights are rounded to the checkpoint dtype
# in the reference too, so this measures activation / KV rounding only).
LOGITS_BOUND = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}
# With an fp8 KV cache: the compute dtype's bound plus the fp8 share, which the numpy backend
# measures at ~0.03 on these models (test_examples bounds it by 0.05 there).
FP8_LOGITS_BOUND = {dtype: bound + 0.05 for dtype, bound in LOGITS_BOUND.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_float32_greedy_matches_reference(models, expected, name):
    seqs, _ = run_engine(models[name]["path"], PROMPTS, backend="gpu", dtype="float32")
    assert [s.output_ids for s in seqs] == expected[name]


@pytest.mark.parametrize("attention", ["paged", "naive"])
def test_gpu_few_blocks_and_naive_path(models, expected, attention):
    seqs, engine = run_engine(models["llama"]["path"], PROMPTS, backend="gpu", dtype="float32",
                              num_blocks=8, block_size=8, attention=attention)
    assert [s.output_ids for s in seqs] == expected["llama"]
    assert engine.cache.num_free_blocks == 8


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "qwen2-bf16-sharded"])
def test_gpu_logits_close_to_float64_reference(models, name, dtype):
    model = models[name]
    steps = {}  # seq_id -> list of host logits, one per generated token

    def record(seqs, logits):
        host = logits.get()
        for row, seq in enumerate(seqs):
            steps.setdefault(seq.seq_id, []).append(host[row].astype(np.float64))

    seqs, engine = run_engine(model["path"], PROMPTS, backend="gpu", dtype=dtype,
                              on_logits=record)
    assert engine.model.dtype.name in (dtype, "float32")  # bf16 may fall back to float32
    worst = 0.0
    for seq in seqs:
        full = seq.prompt_ids + seq.output_ids
        ref = reference_logits(model, full[:-1])[len(seq.prompt_ids) - 1:]
        got = np.stack(steps[seq.seq_id])
        assert got.shape == ref.shape
        worst = max(worst, float(np.max(np.linalg.norm(got - ref, axis=1) /
                                        np.linalg.norm(ref, axis=1))))
    assert worst <= LOGITS_BOUND[engine.model.dtype.name], worst


def _cli_json_args(models):
    """generate.py on the GPU in float32 with --json, for the tiny llama and PROMPTS."""
    args = [sys.executable, str(ROOT / "examples" / "generate.py"), "--model",
            str(models["llama"]["path"]), "--backend", "gpu", "--dtype", "float32",
            "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--json"]
    for prompt in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    return args


def test_gpu_cli_json(models, expected):
    args = _cli_json_args(models)
    result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["output_ids"] for r in records] == expected["llama"]


@pytest.mark.parametrize("attention", ["paged", "naive"])
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_e4m3fnuz"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_fp8_kv_cache_logits_close_to_reference(models, dtype, kv_format, attention):
    # Both formats run on every GPU (software conversion where the hardware has none). float32
    # compute sends float16 queries to cupa's fp8 kernels.
    model, steps = models["llama"], {}
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    seqs, engine = run_engine(model["path"], PROMPTS, backend="gpu", dtype=dtype,
                              kv_format=kv_format, attention=attention, params=params,
                              on_logits=record_logits(steps))
    assert engine.cache.kv_format == kv_format and engine.cache.key_cache(0).dtype == np.uint8
    assert all(len(s.output_ids) == MAX_NEW for s in seqs)
    worst = max(float(e.max()) for e in logits_errors(model, seqs, steps))
    assert worst <= FP8_LOGITS_BOUND[engine.model.dtype.name], worst
    assert engine.cache.num_free_blocks == 64


def test_gpu_cli_fp8(models, expected):
    from cupa.gpu.device import device_info
    from cupa.fp8 import default_kv_format
    from llm.runtime import resolve_kv_format
    assert resolve_kv_format("auto", "gpu") == default_kv_format(device_info().target.arch)
    args = [sys.executable, str(ROOT / "examples" / "generate.py"), "--model",
            str(models["llama"]["path"]), "--backend", "gpu", "--dtype", "float32",
            "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--json", "--kv-format", "fp8_e4m3"]
    for prompt in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "fp8_e4m3, scales K" in result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [len(r["output_ids"]) for r in records] == [MAX_NEW] * len(PROMPTS)
    # The first token comes from prefill (unquantised K/V, float32): exact.
    assert [r["output_ids"][0] for r in records] == [e[0] for e in expected["llama"]]


# --- CUDA-graph decode steps vs eager ones ----------------------------------------------------

# Five prompts (bucket 8) that stop after different numbers of tokens, so the batch shrinks
# through 4, 3, 2 and 1 running sequences (buckets 4, 4, 2, 1).
STAGGERED = [3, 12, 7, 20, 10]
# 4 prompts of one 8-token block each that grow to 3 blocks in an 8-block cache: decode steps run
# out of blocks and preempt (test_examples.test_preemption_recomputes_the_same_tokens).
PREEMPT_PROMPTS = [[1] + [(7 * i + j) % 300 + 3 for j in range(7)] for i in range(4)]
# ||graph logits - eager logits|| / ||eager logits|| per step, bound per compute dtype. In float32
# the paths differ only in summation order (padded rows change cuBLAS's kernel choice; the graph's
# attention plan partitions for the full table width). In float16 the graph's matmuls also write
# float32 directly where eager ones round their output to float16 first (2^-11 relative).
GRAPH_VS_EAGER_BOUND = {"float32": 1e-5, "float16": 2e-3}


def run_graph_case(path, *, graphs, dtype="float32", prompts=PROMPTS, max_new=STAGGERED,
                   num_blocks=64, block_size=16, temperature=0.0, on_logits=None):
    model, _ = load_model(path, backend="gpu", dtype=dtype, progress=False)
    cache = make_cache(model, num_blocks, block_size, "gpu")
    engine = Engine(model, cache, backend="gpu", graphs=graphs, on_logits=on_logits)
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, temperature=temperature,
                                                 top_p=0.95, top_k=40, ignore_eos=True), seed=5)
            for p, n in zip(prompts, max_new)]
    engine.run()
    assert engine.use_graphs is graphs
    assert engine.cache.num_free_blocks == num_blocks
    return seqs, engine


@ENGINE_GRAPHS_NEED_CUDA
def test_gpu_graph_steps_match_eager_and_reference(models):
    model = models["llama"]
    rows_seen = []

    def check_rows(seqs, logits):  # on_logits sees exactly the running sequences' rows
        rows_seen.append(len(seqs))
        assert logits.shape == (len(seqs), model["config"]["vocab_size"])

    graph, engine = run_graph_case(model["path"], graphs=True, on_logits=check_rows)
    eager, eager_engine = run_graph_case(model["path"], graphs=False)
    assert engine.model.fused is not None  # the fused kernels passed their check
    assert [s.output_ids for s in graph] == [s.output_ids for s in eager]
    assert [s.output_ids for s in graph] == [reference_greedy(model, p, n)
                                             for p, n in zip(PROMPTS, STAGGERED)]
    assert 5 in rows_seen and 3 in rows_seen  # batches that are no bucket size
    stats = engine.stats
    assert stats.graph_steps == stats.decode_steps == eager_engine.stats.decode_steps > 0
    assert stats.graph_captures == 4  # buckets 8, 4, 2, 1
    assert eager_engine.stats.graph_steps == 0 and eager_engine.stats.graph_captures == 0
    assert stats.graph_device_time > 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_graph_gemm_matches_cupy(dtype, rng):
    import cupy
    from llm.blas import graph_gemm_type
    from llm.runtime import DTYPES, _gpu_handles
    if not _gpu_handles(DTYPES[dtype]):
        pytest.skip(f"this cupy has no {dtype} matmul")
    stream = cupy.cuda.Stream(non_blocking=True)
    gemm = graph_gemm_type()(stream)  # cuBLAS on CUDA, hipBLAS on ROCm
    gemm.check(DTYPES[dtype])
    with stream:  # the inputs are made on the stream the product runs on
        x = cupy.asarray(rng.standard_normal((7, 256), dtype=np.float32))  # cast by the call
        w = cupy.asarray(rng.standard_normal((320, 256), dtype=np.float32)).astype(DTYPES[dtype])
        got = gemm(x, w)
        want = x.astype(w.dtype).astype(np.float32) @ w.astype(np.float32).T
    # The stream is non-blocking: `.get()` below copies on the null stream, which does not wait
    # for it, so without this the copy can read `want` before the matmul has written it.
    stream.synchronize()
    assert got.dtype == np.float32 and got.shape == (7, 320)
    np.testing.assert_allclose(got.get(), want.get(), rtol=1e-4, atol=1e-3)


@ENGINE_GRAPHS_NEED_CUDA
def test_gpu_graphs_are_the_default_for_paged_only(models):
    model, _ = load_model(models["llama"]["path"], backend="gpu", progress=False)
    cache = make_cache(model, 8, 16, "gpu")
    assert Engine(model, cache, backend="gpu").use_graphs is True
    assert Engine(model, cache, backend="gpu", attention="naive").use_graphs is False
    with pytest.raises(ValueError, match="'naive'"):
        Engine(model, cache, backend="gpu", attention="naive", graphs=True)


@ENGINE_GRAPHS_NEED_CUDA
def test_gpu_graph_steps_with_preemption(models):
    model = models["llama"]
    staggered = [16, 12, 16, 6]  # one preemption; batches of 4, 3, 2 and 1
    graph, engine = run_graph_case(model["path"], graphs=True, prompts=PREEMPT_PROMPTS,
                                   max_new=staggered, num_blocks=8, block_size=8)
    eager, eager_engine = run_graph_case(model["path"], graphs=False, prompts=PREEMPT_PROMPTS,
                                         max_new=staggered, num_blocks=8, block_size=8)
    assert engine.stats.preemptions > 0 and engine.stats.graph_steps > 0
    assert engine.stats.preemptions == eager_engine.stats.preemptions
    assert [s.output_ids for s in graph] == [s.output_ids for s in eager]
    assert [s.output_ids for s in graph] == [reference_greedy(model, p, n)
                                             for p, n in zip(PREEMPT_PROMPTS, staggered)]


@ENGINE_GRAPHS_NEED_CUDA
def test_gpu_graph_steps_sample_like_eager(models):
    path = models["llama"]["path"]
    graph, _ = run_graph_case(path, graphs=True, temperature=0.9)
    eager, _ = run_graph_case(path, graphs=False, temperature=0.9)
    assert [s.output_ids for s in graph] == [s.output_ids for s in eager]


@ENGINE_GRAPHS_NEED_CUDA
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_graph_logits_close_to_eager(models, dtype):
    path, runs = models["llama"]["path"], {}
    for graphs in (True, False):
        steps = {}
        seqs, engine = run_graph_case(path, graphs=graphs, dtype=dtype,
                                      on_logits=record_logits(steps))
        assert engine.model.dtype.name == dtype
        runs[graphs] = (seqs, steps)
    worst = 0.0
    for graph_seq, eager_seq in zip(runs[True][0], runs[False][0]):
        # Compare the steps whose inputs agree: up to the first differing token (a near tie can
        # flip a float16 choice, after which the contexts differ).
        same = next((i for i, (a, b) in enumerate(zip(graph_seq.output_ids, eager_seq.output_ids))
                     if a != b), len(graph_seq.output_ids) - 1)
        got = np.stack(runs[True][1][graph_seq.seq_id][:same + 1])
        ref = np.stack(runs[False][1][eager_seq.seq_id][:same + 1])
        errors = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
        worst = max(worst, float(errors.max()))  # step 0 (prefill) is eager in both
    print(f"graph vs eager logits, {dtype}: worst relative error {worst:.2e}")
    assert worst <= GRAPH_VS_EAGER_BOUND[dtype], worst


@ENGINE_GRAPHS_NEED_CUDA
def test_gpu_prepare_graphs_captures_ahead(models, expected):
    model, _ = load_model(models["llama"]["path"], backend="gpu", dtype="float32",
                          progress=False)
    engine = Engine(model, make_cache(model, 64, 16, "gpu"), backend="gpu")
    engine.prepare_graphs([len(PROMPTS)])
    assert engine.stats.graph_captures == 1 and engine.stats.capture_time > 0
    seqs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert [s.output_ids for s in seqs] == expected["llama"]
    assert engine.stats.graph_captures == 1  # every sequence ran to the end in bucket 8
    assert engine.stats.decode_time > 0


@ENGINE_GRAPHS_NEED_CUDA
def test_gpu_cli_no_graphs(models, expected):
    args = _cli_json_args(models)
    runs = {}
    for extra in ([], ["--no-graphs"]):
        result = subprocess.run(args + extra, capture_output=True, text=True, cwd=ROOT,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        runs[bool(extra)] = [json.loads(line)["output_ids"] for line in result.stdout.splitlines()]
        assert ("from CUDA graphs" in result.stderr) is not bool(extra)
    assert runs[True] == runs[False] == expected["llama"]
