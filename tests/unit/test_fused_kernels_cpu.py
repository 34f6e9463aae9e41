"""The example engine's fused GPU kernels (examples/llm/fused.py), run on the CPU.

tests/helpers/cuda_on_cpu.py builds the kernel source with the host compiler and runs each
launch's threads as coroutines, so FusedOps (its host code and its kernels) can be checked here
against the array expressions they replace: the Model's own start-up check for each output
dtype, and a whole engine run, prefill and decode steps (these with the step buffers every layer
writes into), against the same engine without them.
The GPU's own arithmetic (fused multiply-adds, its expf / cosf) is what these cannot show;
tests/gpu/test_gpu_examples.py runs the real thing.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuda_on_cpu import compiler_missing, fused_kernels
from llm import fused
from llm.engine import Engine
from llm.runtime import load_model, make_cache
from llm.sampling import SamplingParams
from make_tiny_llama import make_checkpoint

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason=compiler_missing() or "")


@pytest.fixture
def cpu_kernels(monkeypatch):
    """FusedOps launches the CPU build of its kernels, on numpy arrays."""
    kernels = fused_kernels(fused._SOURCE)
    monkeypatch.setattr(fused, "_kernels", lambda: (np, kernels))
    return kernels


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2 checkpoint: it has the qkv bias that split_qkv's kernel adds."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2",
                           tokenizer=False)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_startup_check_passes(cpu_kernels, qwen2, dtype):
    model, _ = load_model(qwen2, backend="numpy", progress=False)
    ops = fused.FusedOps(dtype)
    assert ops.out_dtype == np.dtype(dtype)
    assert model._fused_mismatch(ops) is None


def test_the_startup_check_catches_a_wrong_kernel(monkeypatch, qwen2):
    broken = fused._SOURCE.replace("x * c - partner * s", "x * c + partner * s")
    kernels = fused_kernels(broken)
    monkeypatch.setattr(fused, "_kernels", lambda: (np, kernels))
    model, _ = load_model(qwen2, backend="numpy", progress=False)
    assert "split_qkv" in model._fused_mismatch(fused.FusedOps("float16"))


def test_an_engine_with_the_fused_kernels_matches_the_array_expressions(cpu_kernels, qwen2):
    prompts = [[1, 17, 42, 5, 9], [7]]
    runs = []
    for with_fused in (False, True):
        model, _ = load_model(qwen2, backend="numpy", progress=False)
        if with_fused:
            model.fused = fused.FusedOps(model.dtype)
        logits = []
        engine = Engine(model, make_cache(model, 16, 8, "numpy"), backend="numpy",
                        on_logits=lambda seqs, rows: logits.append(np.array(rows)))
        seqs = engine.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
        runs.append(([s.output_ids for s in seqs], logits))
        # The fused decode steps wrote every layer's outputs into the step buffers.
        assert (engine._step_buffers[1] is not None) == with_fused
    (plain_ids, plain_logits), (fused_ids, fused_logits) = runs
    assert fused_ids == plain_ids
    for want, got in zip(plain_logits, fused_logits):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_split_qkv_keeps_its_views_of_a_given_buffer(cpu_kernels, qwen2, rng):
    """split_qkv into the same buffer returns the same q / k / v views (a decode step's layers
    all split into one), with this call's values; another buffer or no buffer gets its own.
    Checked against the array expressions (Model without fused ops) with fresh inputs."""
    model, _ = load_model(qwen2, backend="numpy", progress=False)
    cfg, ops = model.config, fused.FusedOps("float32")
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    bias = model.weights.layers[0].qkv_bias

    def split(tokens, out):
        qkv = rng.standard_normal((tokens, width), dtype=np.float32)
        positions = rng.integers(0, 200, tokens)
        got = ops.split_qkv(qkv, ops.rope_tables(positions, model.inv_freq), cfg.num_heads,
                            cfg.num_kv_heads, cfg.head_dim, bias=bias, out=out)
        want = model.split_qkv(qkv + bias.astype(np.float32), model.rotary(positions))
        for g, w in zip(got, want):
            assert g.shape == w.shape
            assert np.linalg.norm(g - w) <= 1e-6 * np.linalg.norm(w)
        return got

    a = np.full(2 * width, np.nan, np.float32)
    b = np.full(3 * width, np.nan, np.float32)
    first = split(2, a)
    assert all(view.base is a for view in first)
    again = split(2, a)
    assert all(x is y for x, y in zip(first, again))
    other = split(3, b)
    assert all(view.base is b for view in other)
    back = split(2, a)
    assert all(view.base is a for view in back)
    fresh = split(2, None), split(2, None)
    assert all(x.base is not y.base for x, y in zip(*fresh))
