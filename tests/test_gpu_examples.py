"""The example engine on the GPU (cupy + cupa kernels). Skips without a GPU.

float32 compute must give exactly the float64 reference's greedy tokens (as the CPU path does);
float16 / bfloat16 compute must give logits close to it at every step of the engine's own path,
and so must an fp8 KV cache (within a looser bound).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from cupa.arrays import gpu_available

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

# The tiny checkpoints and their reference greedy outputs: the CPU tests' fixtures (built again
# for this module, as they are module-scoped).
from test_examples import (MAX_NEW, MODELS, PROMPTS, ROOT, SamplingParams,  # noqa: E402,F401
                           expected, logits_errors, models, record_logits, reference_logits,
                           run_engine)

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


def test_gpu_cli_json(models, expected):
    args = [sys.executable, str(ROOT / "examples" / "generate.py"), "--model",
            str(models["llama"]["path"]), "--backend", "gpu", "--dtype", "float32",
            "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--json"]
    for prompt in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
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
    from cupa.device import device_info
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
