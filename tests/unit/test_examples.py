"""The example LLM engine (examples/llm) against a plain dense forward written here.

The reference below shares no code with examples/llm: it reads the checkpoint with the official
safetensors loader, runs every layer in float64 over the whole sequence (no cache, no paging) and
picks tokens greedily. The engine must produce the same tokens for several prompts of different
lengths batched together, also when the KV cache is so small that sequences wait and get
preempted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

import cupa

ROOT = Path(__file__).resolve().parents[2]

from llm.config import UnsupportedModelError, parse_config  # noqa: E402
from llm.engine import Engine  # noqa: E402
from llm.runtime import (KV_SCALE_HEADROOM, calibrate_kv_scales, load_model,  # noqa: E402
                         make_cache, resolve_kv_format)
from llm.sampling import SamplingParams, sample  # noqa: E402
from make_tiny_llama import make_checkpoint  # noqa: E402

PROMPTS = [[1, 17, 42], [1], [1, 5, 9, 200, 33, 7, 81, 64, 99], list(range(3, 23)),
           [1, 250, 251]]
MAX_NEW = 10

# name -> make_checkpoint options. Weights are always written in float32 too, for the reference.
MODELS = {
    "llama": dict(arch="llama"),
    "qwen2-bf16-sharded": dict(arch="qwen2", dtype="bfloat16", shards=2, seed=1),
    "mistral-fp16": dict(arch="mistral", dtype="float16", seed=2),
    "llama3-rope-tied": dict(arch="llama", rope_scaling="llama3", tie=True, seed=3),
}


# --- the independent float64 reference --------------------------------------------------------

def reference_inv_freq(cfg):
    dim = cfg["head_dim"]
    inv = np.array([cfg["rope_theta"] ** (-(2 * i) / dim) for i in range(dim // 2)])
    scaling = cfg.get("rope_scaling")
    if scaling:  # llama3: per frequency, by wavelength band
        f, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        out = []
        for freq in inv:
            wavelen = 2 * math.pi / freq
            if wavelen < old / hi:
                out.append(freq)
            elif wavelen > old / lo:
                out.append(freq / f)
            else:
                t = (old / wavelen - lo) / (hi - lo)
                out.append((1 - t) * freq / f + t * freq)
        inv = np.array(out)
    return inv


def reference_logits(model, ids):
    """float64 logits [len(ids), vocab] of a dense causal forward over the whole sequence."""
    cfg, w = model["config"], model["tensors"]
    n, heads, kv_heads, d = (len(ids), cfg["num_attention_heads"], cfg["num_key_value_heads"],
                             cfg["head_dim"])
    eps = cfg["rms_norm_eps"]

    def norm(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    def proj(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    angles = np.arange(n)[:, None] * reference_inv_freq(cfg)[None, :]   # [n, d/2]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(x):  # pairs (x_i, x_{i+d/2}) rotate by angle_i
        a, b = x[..., :d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    mask = np.tril(np.ones((n, n), dtype=bool))
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope(proj(h, p + "self_attn.q_proj").reshape(n, heads, d))
        k = rope(proj(h, p + "self_attn.k_proj").reshape(n, kv_heads, d))
        v = proj(h, p + "self_attn.v_proj").reshape(n, kv_heads, d)
        attn = np.empty((n, heads, d))
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(d)
            scores = np.where(mask, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            attn[:, head] = probs @ v[:, kv]
        x = x + proj(attn.reshape(n, heads * d), p + "self_attn.o_proj")
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = proj(h, p + "mlp.gate_proj"), proj(h, p + "mlp.up_proj")
        x = x + proj(gate / (1 + np.exp(-gate)) * up, p + "mlp.down_proj")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return norm(x, w["model.norm.weight"]) @ head.T


def reference_greedy(model, prompt, max_new, eos=()):
    ids = list(prompt)
    for _ in range(max_new):
        token = int(np.argmax(reference_logits(model, ids)[-1]))
        ids.append(token)
        if token in eos:
            break
    return ids[len(prompt):]


def build_model(root: Path, name: str):
    """Write checkpoint `name` (its own dtype) plus a float32 twin for the reference, which gets
    the float32 weights rounded to the checkpoint dtype, in float64."""
    options = MODELS[name]
    path = make_checkpoint(root / name, **options)
    twin = make_checkpoint(root / (name + "-f32"), **dict(options, dtype="float32", shards=1),
                           tokenizer=False)
    rounding = {"float32": np.float32, "float16": np.float16,
                "bfloat16": ml_dtypes.bfloat16}[options.get("dtype", "float32")]
    tensors = {k: v.astype(rounding).astype(np.float64)
               for k, v in load_file(twin / "model.safetensors").items()}
    config = json.loads((path / "config.json").read_text())
    return {"path": path, "config": config, "tensors": tensors}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_model(root, name) for name in MODELS}


@pytest.fixture(scope="module")
def expected(models):
    """Reference greedy outputs (EOS ignored) of every model and prompt."""
    return {name: [reference_greedy(m, p, MAX_NEW) for p in PROMPTS] for name, m in models.items()}


def run_engine(path, prompts, *, num_blocks=64, block_size=16, attention="paged", backend="numpy",
               params=None, seed=0, dtype="auto", kv_format=None, **engine_kwargs):
    """Generate `prompts` as one batch; an fp8 kv_format gets scales calibrated on the prompts
    (as generate.py does by default)."""
    model, backend = load_model(path, backend=backend, dtype=dtype, progress=False)
    scales = {}
    if kv_format:
        scales = dict(zip(("k_scale", "v_scale"), calibrate_kv_scales(model, prompts, kv_format)))
    cache = make_cache(model, num_blocks, block_size, backend, kv_format=kv_format, **scales)
    engine = Engine(model, cache, attention=attention, backend=backend, **engine_kwargs)
    params = params or SamplingParams(max_new_tokens=MAX_NEW)
    seqs = engine.generate(prompts, params, seed=seed)
    return seqs, engine


# --- engine vs reference -----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_batch_matches_dense_reference(models, expected, name):
    seqs, engine = run_engine(models[name]["path"], PROMPTS)
    assert [s.output_ids for s in seqs] == expected[name]
    assert all(s.finish_reason == "length" for s in seqs)
    assert engine.cache.num_free_blocks == 64  # every sequence freed its blocks


def test_few_blocks_wait_and_preempt(models, expected):
    # 8 blocks of 8 tokens: far fewer than the 5 sequences need together, so prompts wait for
    # blocks to free up - same tokens as with a roomy cache.
    seqs, engine = run_engine(models["llama"]["path"], PROMPTS, num_blocks=8, block_size=8)
    assert [s.output_ids for s in seqs] == expected["llama"]
    assert engine.cache.num_free_blocks == 8


def test_preemption_recomputes_the_same_tokens(models):
    # Four 8-token prompts fit one block each and are all admitted; each grows to 3 blocks, so
    # the 8-block cache runs out mid-decode and the newest sequences are preempted, then
    # recomputed from prompt + output when blocks free up.
    model = models["llama"]
    prompts = [[1] + [(7 * i + j) % 300 + 3 for j in range(7)] for i in range(4)]
    seqs, engine = run_engine(model["path"], prompts, num_blocks=8, block_size=8,
                              params=SamplingParams(max_new_tokens=16))
    assert engine.stats.preemptions > 0
    assert [s.output_ids for s in seqs] == [reference_greedy(model, p, 16) for p in prompts]
    assert engine.cache.num_free_blocks == 8


def test_max_batch_limits_running(models, expected):
    seqs, _ = run_engine(models["llama"]["path"], PROMPTS, max_batch=2)
    assert [s.output_ids for s in seqs] == expected["llama"]


def test_naive_attention_path_matches(models, expected):
    seqs, _ = run_engine(models["qwen2-bf16-sharded"]["path"], PROMPTS, attention="naive",
                         block_size=8)
    assert [s.output_ids for s in seqs] == expected["qwen2-bf16-sharded"]


def test_eos_stops_a_sequence_early(models, expected):
    ref = expected["llama"][2]
    eos = ref[4]
    stop = ref.index(eos)
    seqs, _ = run_engine(models["llama"]["path"], PROMPTS, eos_ids=[eos])
    assert seqs[2].output_ids == ref[:stop + 1] and seqs[2].finish_reason == "stop"
    for seq, want in zip(seqs, expected["llama"]):  # the others stop at their own first `eos`
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert seq.output_ids == want[:cut]


def test_prompt_larger_than_cache_is_reported_not_raised(models, expected):
    long_prompt = list(range(3, 60))
    seqs, _ = run_engine(models["llama"]["path"], [long_prompt] + PROMPTS[:2], num_blocks=4,
                         block_size=8)
    assert seqs[0].finish_reason == "cache_too_small" and seqs[0].output_ids == []
    assert [s.output_ids for s in seqs[1:]] == expected["llama"][:2]


# --- fp8 KV cache ------------------------------------------------------------------------------

def record_logits(steps):
    """An on_logits hook appending each sequence's float64 host logits to steps[seq_id]."""
    def record(seqs, logits):
        host = logits.get() if hasattr(logits, "get") else np.asarray(logits)
        for row, seq in enumerate(seqs):
            steps.setdefault(seq.seq_id, []).append(host[row].astype(np.float64))
    return record


def logits_errors(model, seqs, steps):
    """Per sequence, ||logits - ref|| / ||ref|| of every step against the float64 reference on
    the engine's own tokens (so errors do not compound through diverging tokens)."""
    errors = []
    for seq in seqs:
        full = seq.prompt_ids + seq.output_ids
        ref = reference_logits(model, full[:-1])[len(seq.prompt_ids) - 1:]
        got = np.stack(steps[seq.seq_id])
        assert got.shape == ref.shape
        errors.append(np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1))
    return errors


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_e4m3fnuz"])
def test_fp8_kv_cache_stays_close_to_float(models, expected, kv_format):
    model, steps = models["llama"], {}
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    seqs, engine = run_engine(model["path"], PROMPTS, params=params, kv_format=kv_format,
                              on_logits=record_logits(steps))
    cache = engine.cache
    assert cache.kv_format == kv_format and cache.key_cache(0).dtype == np.uint8
    assert all(len(s.output_ids) == MAX_NEW for s in seqs)
    # Greedy tokens may drift once fp8 rounding flips a near tie; the first ones must not.
    assert [s.output_ids[:3] for s in seqs] == [e[:3] for e in expected["llama"]]
    errors = logits_errors(model, seqs, steps)
    # Step 0 comes from prefill, whose attention uses the unquantised K/V: float32-exact.
    assert max(e[0] for e in errors) < 1e-4
    # Decode steps read K/V through 3 mantissa bits: a few percent (measured ~0.03).
    assert max(e.max() for e in errors) < 0.05
    assert cache.num_free_blocks == 64


def test_fp8_naive_path_reads_the_same_codes(models):
    path = models["qwen2-bf16-sharded"]["path"]
    paged, _ = run_engine(path, PROMPTS, kv_format="fp8_e4m3", block_size=8)
    naive, _ = run_engine(path, PROMPTS, kv_format="fp8_e4m3", block_size=8, attention="naive")
    assert [s.output_ids for s in naive] == [s.output_ids for s in paged]


def test_fp8_with_preemption_runs_to_completion(models):
    # As test_preemption_recomputes_the_same_tokens, on an fp8 cache. The recompute attends over
    # unquantised K/V where the decode steps read codes, so tokens may differ slightly from an
    # unpreempted run; the run must still finish every sequence and free every block.
    model = models["llama"]
    prompts = [[1] + [(7 * i + j) % 300 + 3 for j in range(7)] for i in range(4)]
    seqs, engine = run_engine(model["path"], prompts, num_blocks=8, block_size=8,
                              kv_format="fp8_e4m3",
                              params=SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert engine.stats.preemptions > 0
    assert all(len(s.output_ids) == 16 for s in seqs)
    assert [s.output_ids[0] for s in seqs] == [reference_greedy(model, p, 1)[0] for p in prompts]
    assert engine.cache.num_free_blocks == 8


def test_fp8_calibrated_scales_map_the_prompt_max_to_half_the_range(models):
    # One prefill (max_new_tokens=1: no decode step), then every KV head's largest stored code,
    # over all layers, is the format's largest value / KV_SCALE_HEADROOM.
    kv_format, fmt_max = "fp8_e4m3", 448.0
    _, engine = run_engine(models["llama"]["path"], PROMPTS, kv_format=kv_format,
                           params=SamplingParams(max_new_tokens=1))
    cache = engine.cache
    assert cache.k_scale.shape == (cache.num_kv_heads,) and (cache.k_scale > 0).all()
    for codes_of in (cache.key_cache, cache.value_cache):  # unused blocks hold zeros
        codes = np.stack([codes_of(layer) for layer in range(cache.num_layers)])
        values = np.abs(cupa.dequantize_fp8(codes, kv_format))      # code values, unscaled
        head_max = values.max(axis=(0, 1, 3, 4))
        np.testing.assert_array_equal(head_max, fmt_max / KV_SCALE_HEADROOM)


def test_resolve_kv_format():
    assert resolve_kv_format("none", "numpy") is None
    assert resolve_kv_format("auto", "numpy") is None  # no GPU: no fp8 hardware to prefer
    assert resolve_kv_format("fp8_e4m3fnuz", "numpy") == "fp8_e4m3fnuz"


# --- sampling ----------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_batch_independent(models):
    path = models["llama"]["path"]
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=40)
    batch, _ = run_engine(path, PROMPTS, params=params, seed=7)
    again, _ = run_engine(path, PROMPTS, params=params, seed=7, num_blocks=8, block_size=8)
    assert [s.output_ids for s in batch] == [s.output_ids for s in again]
    other, _ = run_engine(path, PROMPTS, params=params, seed=8)
    assert [s.output_ids for s in batch] != [s.output_ids for s in other]


def test_top_k_one_is_greedy(models, expected):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.5, top_k=1)
    seqs, _ = run_engine(models["llama"]["path"], PROMPTS, params=params, seed=3)
    assert [s.output_ids for s in seqs] == expected["llama"]


def test_top_p_and_top_k_filters(rng):
    logits = np.log(np.array([0.6, 0.25, 0.1, 0.05]))
    top_p = SamplingParams(temperature=1.0, top_p=0.5)
    assert {sample(logits, top_p, rng) for _ in range(200)} == {0}
    top_p = SamplingParams(temperature=1.0, top_p=0.8)
    assert {sample(logits, top_p, rng) for _ in range(400)} == {0, 1}
    top_k = SamplingParams(temperature=1.0, top_k=3)
    assert {sample(logits, top_k, rng) for _ in range(400)} == {0, 1, 2}


# --- command line ------------------------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_json(models, expected):
    path = models["llama"]["path"]
    args = ["--model", str(path), "--backend", "numpy", "--max-new-tokens", str(MAX_NEW),
            "--ignore-eos", "--json"]
    for prompt in PROMPTS[:3]:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    result = run_cli(*args, "--num-blocks", "6", "--block-size", "8")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3  # nothing but the JSON objects on stdout
    records = [json.loads(line) for line in lines]
    assert [r["prompt_ids"] for r in records] == PROMPTS[:3]
    assert [r["output_ids"] for r in records] == expected["llama"][:3]
    assert "tokens/s" in result.stderr


def test_cli_text_prompt(models):
    pytest.importorskip("tokenizers")
    result = run_cli("--model", str(models["llama"]["path"]), "--backend", "numpy",
                     "--prompt", "Hello, world", "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                     "--temperature", "0.8", "--seed", "1", "--json")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert records[0]["prompt_ids"][:3] == [1, 3 + ord("H"), 3 + ord("e")]  # <s> then bytes
    assert len(records[0]["output_ids"]) <= 4 and "output_text" in records[0]


@pytest.mark.parametrize("scale", [None, "0.02"])
def test_cli_fp8_kv_format(models, expected, scale):
    args = ["--model", str(models["llama"]["path"]), "--backend", "numpy", "--max-new-tokens",
            str(MAX_NEW), "--ignore-eos", "--json", "--kv-format", "fp8_e4m3"]
    args += ["--kv-scale", scale] if scale else []
    for prompt in PROMPTS[:3]:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "fp8_e4m3, scales K" in result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [len(r["output_ids"]) for r in records] == [MAX_NEW] * 3
    assert [r["output_ids"][:3] for r in records] == [e[:3] for e in expected["llama"][:3]]


@pytest.mark.parametrize("options, messages", [
    (["--kv-format", "bogus"], ["--kv-format", "invalid choice", "bogus", "fp8_e4m3fnuz"]),
    (["--kv-format", "fp8_e4m3", "--kv-scale", "-1"], ["'calibrate' or a positive number"]),
    (["--kv-scale", "0.5"], ["--kv-scale needs an fp8 KV cache"]),
])
def test_cli_rejects_bad_kv_options(models, options, messages):
    result = run_cli("--model", str(models["llama"]["path"]), "--prompt-ids", "1,2",
                     "--backend", "numpy", *options)
    assert result.returncode == 2 and result.stdout == ""
    assert all(m in result.stderr for m in messages), result.stderr


def test_cli_unsupported_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    result = run_cli("--model", str(tmp_path), "--prompt-ids", "1,2", "--backend", "numpy")
    assert result.returncode == 2
    assert "unsupported architecture" in result.stderr and "LlamaForCausalLM" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MixtralForCausalLM"]}, "unsupported architecture"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_config_is_refused(models, change, message):
    raw = dict(models["llama"]["config"], **change)
    with pytest.raises(UnsupportedModelError, match=message):
        parse_config(raw)


def test_text_stream_handles_multibyte_characters(models):
    pytest.importorskip("tokenizers")
    from llm.tokenizer import TextStream, load_tokenizer
    tokenizer = load_tokenizer(models["llama"]["path"])
    text = "naïve café ✓ 日本"
    ids = tokenizer.encode(text)
    stream, pieces = TextStream(tokenizer), []
    for i in range(1, len(ids) + 1):
        pieces.append(stream.push(ids[:i]))
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


# --- CUDA-graph bookkeeping (the GPU replay itself is tested in test_gpu_examples.py) -----------

from llm.graphs import (StepLayout, StepRows, batch_buckets, bucket_for,  # noqa: E402
                        graph_blocker, resolve_graphs, table_width)


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(33) == (1, 2, 4, 8, 16, 24, 32, 33)  # the last bucket is max_batch
    big = batch_buckets(256)
    assert big[:9] == (1, 2, 4, 8, 16, 24, 32, 48, 64) and big[-3:] == (192, 224, 256)
    assert list(big) == sorted(set(big))
    assert batch_buckets(300)[-2:] == (256, 300)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_batch"):
            batch_buckets(bad)


def test_bucket_for_picks_the_smallest_that_fits():
    buckets = batch_buckets(48)
    assert [bucket_for(b, buckets) for b in (1, 2, 3, 5, 8, 9, 17, 33, 48)] == \
        [1, 2, 4, 8, 8, 16, 24, 48, 48]
    for bad in (0, 49):
        with pytest.raises(ValueError, match="largest graph bucket"):
            bucket_for(bad, buckets)


def test_table_width_covers_the_longest_sequence_within_the_cache():
    assert table_width(4096, 16, 10_000) == 256
    assert table_width(4097, 16, 10_000) == 257
    assert table_width(131072, 16, 100) == 100  # a sequence cannot hold more blocks than exist
    assert table_width(5, 16, 3) == 1


def test_graphs_option_resolution():
    assert graph_blocker(True, "paged") is None  # on CUDA and ROCm alike
    assert "numpy" in graph_blocker(False, "paged")
    assert "'naive'" in graph_blocker(True, "naive")
    assert resolve_graphs(None, None) is True
    assert resolve_graphs(None, "why") is False
    assert resolve_graphs(False, "why") is False and resolve_graphs(True, None) is True
    with pytest.raises(ValueError, match="graphs=True: why"):
        resolve_graphs(True, "why")
    with pytest.raises(ValueError, match="True, False or None"):
        resolve_graphs("yes", None)


def test_engine_graphs_argument_on_numpy(models):
    model, _ = load_model(models["llama"]["path"], backend="numpy", progress=False)
    cache = make_cache(model, 8, 16, "numpy")
    assert Engine(model, cache).use_graphs is False  # default: only where possible
    assert Engine(model, cache, graphs=False).use_graphs is False
    for attention in ("paged", "naive"):
        with pytest.raises(ValueError, match="graphs=True: CUDA graphs need the GPU backend"):
            Engine(model, cache, attention=attention, graphs=True)
    with pytest.raises(ValueError, match="graphs"):
        Engine(model, cache, graphs=1)


def test_step_rows_pack_rows_then_padding(models):
    # A numpy cache holds the real tables; packing must reproduce cache.tables() row by row and
    # pad the rest of the bucket: slot -1 (not written), length 0 (zero attention), token 0.
    model, _ = load_model(models["llama"]["path"], backend="numpy", progress=False)
    cache = make_cache(model, 32, 8, "numpy")
    engine = Engine(model, cache, graphs=False)
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=4)) for p in PROMPTS[:3]]
    engine.step()  # prefill: every sequence has one output token and its prompt cached
    slots = cache.extend([s.seq_id for s in seqs], 1)
    rows = StepRows.gather(seqs, slots, cache)
    assert rows.token_ids == [s.output_ids[-1] for s in seqs] == [s.last_token for s in seqs]
    assert rows.positions == [s.num_tokens - 1 for s in seqs]

    width = table_width(model.config.max_seq_len, cache.block_size, cache.num_blocks)
    layout = StepLayout(max_batch=8, width=width)
    buffer = np.full(layout.nbytes, 0x55, dtype=np.uint8)
    arrays = layout.views(buffer, 4)
    rows.pack_into(arrays)
    tables, lens = cache.tables([s.seq_id for s in seqs], max_blocks=width)
    np.testing.assert_array_equal(arrays.block_tables[:3], tables)
    np.testing.assert_array_equal(arrays.seq_lens[:3], lens)
    np.testing.assert_array_equal(arrays.slots[:3], slots)
    assert (arrays.token_ids[3], arrays.positions[3], arrays.slots[3], arrays.seq_lens[3]) == \
        (0, 0, -1, 0)
    assert (arrays.block_tables[3] == -1).all()
    # A bucket's arrays are the leading rows of the largest bucket's, and the upload covers them.
    wider = layout.views(buffer, 8)
    np.testing.assert_array_equal(wider.block_tables[:4], arrays.block_tables)
    np.testing.assert_array_equal(wider.slots[:4], arrays.slots)
    end = arrays.block_tables.ctypes.data + arrays.block_tables.nbytes - buffer.ctypes.data
    assert end == layout.upload_bytes(4) <= layout.nbytes
    assert all(a.dtype == np.int64 for a in (arrays.token_ids, arrays.positions, arrays.slots))
    assert arrays.seq_lens.dtype == arrays.block_tables.dtype == np.int32
    assert arrays.block_tables.flags.c_contiguous

    with pytest.raises(ValueError, match="do not fit"):
        rows.pack_into(layout.views(buffer, 2))
    narrow = StepLayout(max_batch=8, width=1)
    with pytest.raises(ValueError, match="table width 1"):
        StepRows([1], [20], np.array([3]), [21], [np.array([0, 1, 2], np.int32)]).pack_into(
            narrow.views(np.zeros(narrow.nbytes, np.uint8), 1))


def test_cli_no_graphs_is_accepted_on_numpy(models, expected):
    args = ["--model", str(models["llama"]["path"]), "--backend", "numpy", "--max-new-tokens",
            str(MAX_NEW), "--ignore-eos", "--json", "--no-graphs", "--prompt-ids",
            ",".join(map(str, PROMPTS[0]))]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["output_ids"] == expected["llama"][0]


def test_prefill_groups_batch_consecutive_equal_lengths():
    from llm.engine import prefill_groups
    assert prefill_groups([4, 4, 4, 2, 4], num_heads=2) == [(0, 3, 4), (12, 1, 2), (14, 1, 4)]
    # A group's scores (heads x length^2 each) stay within the budget; one prompt always goes.
    assert prefill_groups([4] * 5, num_heads=2, budget=2 * 16 * 2) == [(0, 2, 4), (8, 2, 4),
                                                                        (16, 1, 4)]
    assert prefill_groups([100], num_heads=8, budget=10) == [(0, 1, 100)]
    assert prefill_groups([], num_heads=8) == []


def test_batched_causal_attention_equals_one_sequence_at_a_time(rng):
    from llm.model import causal_attention
    length, heads, kv_heads, dim = 6, 4, 2, 8
    q = rng.standard_normal((3 * length, heads, dim), dtype=np.float32)
    k, v = (rng.standard_normal((3 * length, kv_heads, dim), dtype=np.float32) for _ in range(2))
    batched = causal_attention(np, q, k, v, 0.3, num_seqs=3)
    for s in range(3):
        rows = slice(s * length, (s + 1) * length)
        np.testing.assert_allclose(batched[rows], causal_attention(np, q[rows], k[rows], v[rows],
                                                                   0.3), rtol=1e-6, atol=1e-7)


class _ReservingAheadEngine(Engine):
    """An eager engine that reserves the next step's slots the way graph steps do (between the
    forward and sampling, while the GPU would be busy), so the CPU can check that doing so
    changes nothing."""

    decoding = False

    def _decode_eager(self, seqs, slots):
        self.decoding = True
        try:
            super()._decode_eager(seqs, slots)
        finally:
            self.decoding = False

    def _sample_and_append(self, seqs, logits, argmax=None):
        if self.decoding:
            self._reserve_ahead(seqs)
        super()._sample_and_append(seqs, logits, argmax)


@pytest.mark.parametrize("case", ["staggered", "preemption", "eos"])
def test_reserving_decode_slots_ahead_changes_nothing(models, expected, case):
    path = models["llama"]["path"]
    prompts, lengths, blocks, kwargs = {
        "staggered": (PROMPTS, [3, 12, 7, 20, 10], (64, 16), {}),
        "preemption": ([[1] + [(7 * i + j) % 300 + 3 for j in range(7)] for i in range(4)],
                       [16, 12, 16, 6], (8, 8), {}),
        "eos": (PROMPTS, [MAX_NEW] * 5, (9, 8), {"eos_ids": [expected["llama"][2][4]]}),
    }[case]
    runs = []
    for engine_type in (Engine, _ReservingAheadEngine):
        model, _ = load_model(path, backend="numpy", progress=False)
        cache = make_cache(model, *blocks, "numpy")
        engine = engine_type(model, cache, **kwargs)
        seqs = [engine.add_request(p, SamplingParams(max_new_tokens=n,
                                                     ignore_eos="eos_ids" not in kwargs))
                for p, n in zip(prompts, lengths)]
        engine.run()
        runs.append(([s.output_ids for s in seqs], [s.finish_reason for s in seqs],
                     engine.stats.preemptions, engine.stats.decode_steps,
                     cache.num_free_blocks))
    assert runs[0] == runs[1]
    assert runs[0][4] == blocks[0]
