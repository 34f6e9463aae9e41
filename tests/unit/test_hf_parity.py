"""Greedy output of the example engine equals Hugging Face transformers' greedy `generate`.

Needs torch and transformers (the `hf` extra: `pip install -e '.[hf]'`; they are used here only,
never by the examples). Without them the tests skip, except in CI (CI set), which installs them:
there they fail. Tiny random checkpoints of each supported architecture are written by
examples/make_tiny_llama.py; transformers loads them in float32 and generates one prompt at a
time on one CPU thread, the engine runs all prompts as one continuous batch.
"""

from __future__ import annotations

import os

import pytest

from cupa.arrays import gpu_available
from llm.engine import Engine
from llm.runtime import load_model, make_cache
from llm.sampling import SamplingParams
from make_tiny_llama import make_checkpoint

IN_CI = bool(os.environ.get("CI"))
try:
    import torch
    import transformers
    MISSING = None
except ImportError as exc:  # the message names the missing module
    torch = transformers = None
    MISSING = f"needs torch and transformers (pip install -e '.[hf]'): {exc}"

PROMPTS = [[1, 17, 42], [1], [1, 5, 9, 200, 33, 7, 81, 64, 99], list(range(3, 40))]
MAX_NEW = 20
CHECKPOINTS = {
    "llama-gqa": dict(arch="llama"),
    "llama3-rope-tied": dict(arch="llama", rope_scaling="llama3", tie=True, seed=3),
    "mistral": dict(arch="mistral", seed=2),
    "qwen2-bias-bf16": dict(arch="qwen2", dtype="bfloat16", seed=1),
}
BACKENDS = ["numpy", pytest.param("gpu", marks=pytest.mark.skipif(
    not gpu_available(), reason="needs cupy and a GPU"))]


@pytest.fixture(scope="module", autouse=True)
def hf_stack():
    """torch and transformers present (in CI their absence fails); torch on one thread while
    these tests run: the models are tiny, and torch's thread pool on a loaded 2-core machine
    turns 50 ms generations into seconds."""
    if MISSING:
        if IN_CI:
            pytest.fail(MISSING + "; CI installs them (.ci/run)")
        pytest.skip(MISSING)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_checkpoint(root / name, **opts) for name, opts in CHECKPOINTS.items()}


def hf_greedy(path, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_equals_transformers(checkpoints, name, backend):
    path = checkpoints[name]
    # float32 on the GPU too: equality of greedy tokens is only meaningful at matching precision.
    model, backend = load_model(path, backend=backend, dtype="float32", progress=False)
    engine = Engine(model, make_cache(model, 64, 16, backend),
                    eos_ids=model.config.eos_token_ids, backend=backend)
    seqs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [s.output_ids for s in seqs] == hf_greedy(path, PROMPTS)
