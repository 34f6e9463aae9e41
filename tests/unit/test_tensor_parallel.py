"""Tensor parallelism of the example engine, on the CPU.

No GPU and no NCCL here: N ranks run as N threads of this process (collectives.ThreadGroup),
each with its own model shard, KV cache and Engine, meeting at a barrier for every all-reduce
and broadcast. Checked: the shards put together are the full weights; the ranks' partial o and
down outputs sum to the unsharded ones and the logits equal the unsharded forward's; the engine
gives the same tokens with N=2 as with N=1; the errors; the launcher's bookkeeping (rank
variables, spawned processes with a stand-in for the NCCL group). The NCCL group itself is
checked against a fake cupyx.distributed only: the real one has not run (see README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

import generate  # noqa: E402
from llm import collectives, launcher  # noqa: E402
from llm.collectives import (NCCL_ENVIRONMENT, minimum_over_ranks,  # noqa: E402
                             run_simulated_ranks, thread_groups)
from llm.config import ModelConfig, load_config  # noqa: E402
from llm.engine import Engine  # noqa: E402
from llm.launcher import (LaunchError, NotEnoughGpusError, RankEnvironment,  # noqa: E402
                          check_visible_gpus, environment_rank, host_ranks)
from llm.model import Model  # noqa: E402
from llm.runtime import load_model, make_cache  # noqa: E402
from llm.sampling import SamplingParams  # noqa: E402
from llm.tensor_parallel import (check_tensor_parallel, checkpoint_slicer,  # noqa: E402
                                 shard_config, shard_weights)
from llm.weights import (LayerWeights, ModelWeights, load_weights, open_safetensors,  # noqa: E402
                         save_safetensors)
from make_tiny_llama import make_checkpoint  # noqa: E402

# float32 logits of the sharded forward against the unsharded one, ||a - b|| / ||b||. Sharding
# changes only the order of float32 additions: each rank sums its heads' (or MLP units') share
# of a projection and the all-reduce adds the N partial sums, where the unsharded matmul sums
# all terms in one pass. Each reordering costs a few ulp (2^-24 relative) of a sum of at most
# a few hundred terms; through a few layers of norms that stays below 1e-6 (measured: at most
# 7e-7, here and on the tiny checkpoints), so 1e-5 leaves room and still catches any wrong
# shard (which is off by O(1)).
SHARDED_BOUND = 1e-5


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --- a small random model (hidden 64, 8 heads of 16) ---------------------------------------------

def small_config(num_kv_heads=4, biases=False, layers=3) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=101, hidden_size=64,
                       intermediate_size=96, num_layers=layers, num_heads=8,
                       num_kv_heads=num_kv_heads, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=10000.0, qkv_bias=biases, o_bias=biases, mlp_bias=biases)


def random_model_weights(config: ModelConfig, rng) -> ModelWeights:
    """float32 weights with O(1) activations (rows / sqrt(fan-in)), the biases the config says."""
    hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    qkv_out = (config.num_heads + 2 * config.num_kv_heads) * d

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def vector(n, offset=0.0):
        return (offset + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n, wanted):
        return vector(n) if wanted else None

    layers = [LayerWeights(
        input_norm=vector(hidden, 1.0), qkv=matrix(qkv_out, hidden),
        qkv_bias=bias(qkv_out, config.qkv_bias),
        o=matrix(hidden, config.num_heads * d), o_bias=bias(hidden, config.o_bias),
        post_norm=vector(hidden, 1.0), gate_up=matrix(2 * inter, hidden),
        gate_up_bias=bias(2 * inter, config.mlp_bias), down=matrix(hidden, inter),
        down_bias=bias(hidden, config.mlp_bias)) for _ in range(config.num_layers)]
    return ModelWeights(embed=matrix(config.vocab_size, hidden), layers=layers,
                        norm=vector(hidden, 1.0), lm_head=matrix(config.vocab_size, hidden))


SHARDING_CASES = [(world, kv, biases) for world in (2, 4) for kv in (4, 8)
                  for biases in (False, True)]


# --- 1. the shards put together are the full weights ---------------------------------------------

@pytest.mark.parametrize("world, kv_heads, biases", SHARDING_CASES)
def test_shards_concatenate_to_the_full_weights(world, kv_heads, biases, rng):
    config = small_config(kv_heads, biases)
    full = random_model_weights(config, rng)
    part = shard_config(config, world)
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size) == \
        (8 // world, kv_heads // world, 96 // world)
    assert (part.hidden_size, part.head_dim, part.vocab_size) == (64, 16, 101)
    shards = [shard_weights(full, config, rank, world, np) for rank in range(world)]
    d, inter = config.head_dim, config.intermediate_size
    q_rows, kv_rows, units = part.num_heads * d, part.num_kv_heads * d, part.intermediate_size
    full_q, full_kv = config.num_heads * d, config.num_kv_heads * d

    def joined(pick, axis=0):
        return np.concatenate([pick(s) for s in shards], axis=axis)

    for i, layer in enumerate(full.layers):
        mine = [s.layers[i] for s in shards]
        for m in mine:  # each shard is a rank model's own layout
            assert m.qkv.shape == ((part.num_heads + 2 * part.num_kv_heads) * d, 64)
            assert m.gate_up.shape == (2 * units, 64) and m.o.shape == (64, q_rows)
            assert m.down.shape == (64, units)
        fused = {"qkv": (layer.qkv, [m.qkv for m in mine]),
                 "gate_up": (layer.gate_up, [m.gate_up for m in mine])}
        if biases:
            fused["qkv_bias"] = (layer.qkv_bias, [m.qkv_bias for m in mine])
            fused["gate_up_bias"] = (layer.gate_up_bias, [m.gate_up_bias for m in mine])
        for name, (want, parts) in fused.items():
            if name.startswith("qkv"):  # q rows by head, then k, then v, each by KV head
                pieces = [(slice(0, q_rows), slice(0, full_q)),
                          (slice(q_rows, q_rows + kv_rows), slice(full_q, full_q + full_kv)),
                          (slice(q_rows + kv_rows, None), slice(full_q + full_kv, None))]
            else:  # gate rows by unit, then up
                pieces = [(slice(0, units), slice(0, inter)),
                          (slice(units, None), slice(inter, None))]
            for mine_rows, full_rows in pieces:
                np.testing.assert_array_equal(
                    np.concatenate([p[mine_rows] for p in parts]), want[full_rows],
                    err_msg=f"layer {i} {name}")
        np.testing.assert_array_equal(joined(lambda s: s.layers[i].o, axis=1), layer.o)
        np.testing.assert_array_equal(joined(lambda s: s.layers[i].down, axis=1), layer.down)
        # Added after the reduce: once in total, by rank 0.
        for name in ("o_bias", "down_bias"):
            biases_of = [getattr(m, name) for m in mine]
            assert all(b is None for b in biases_of[1:])
            assert biases_of[0] is getattr(layer, name)
        assert all(m.input_norm is layer.input_norm and m.post_norm is layer.post_norm
                   for m in mine)
    for s in shards:  # replicated
        assert s.embed is full.embed and s.lm_head is full.lm_head and s.norm is full.norm


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    """The tiny Llama checkpoint with attention_bias and mlp_bias: every bias there is."""
    path = make_checkpoint(tmp_path_factory.mktemp("tp") / "biased", tokenizer=False, seed=5)
    config = json.loads((path / "config.json").read_text())
    config.update(attention_bias=True, mlp_bias=True)
    (path / "config.json").write_text(json.dumps(config))
    tensors = {k: np.array(v) for k, v in open_safetensors(path / "model.safetensors").items()}
    rng = np.random.default_rng(11)
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], 64
    sizes = {"self_attn.q_proj": heads * d, "self_attn.k_proj": kv * d,
             "self_attn.v_proj": kv * d, "self_attn.o_proj": config["hidden_size"],
             "mlp.gate_proj": config["intermediate_size"],
             "mlp.up_proj": config["intermediate_size"], "mlp.down_proj": config["hidden_size"]}
    for i in range(config["num_hidden_layers"]):
        for module, size in sizes.items():
            tensors[f"model.layers.{i}.{module}.bias"] = \
                (0.1 * rng.standard_normal(size)).astype(np.float32)
    save_safetensors(path / "model.safetensors", tensors)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny float32 Llama checkpoint (2 layers, 4 / 2 heads of 64, MLP 512, vocab 320)."""
    return make_checkpoint(tmp_path_factory.mktemp("tp") / "llama", tokenizer=False)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """The same size as Qwen2: q/k/v biases, bfloat16 weights."""
    return make_checkpoint(tmp_path_factory.mktemp("tp") / "qwen2", arch="qwen2",
                           dtype="bfloat16", tokenizer=False, seed=1)


def test_loading_a_rank_from_the_checkpoint_equals_sharding_the_full_weights(biased_llama):
    """load_weights(slice_tensor=checkpoint_slicer) reads each tensor's share; it must give
    what shard_weights cuts from the full weights, biases included."""
    config = load_config(biased_llama)
    assert config.qkv_bias and config.o_bias and config.mlp_bias
    full = load_weights(biased_llama, config, np, np.float32, progress=False)
    for rank in range(2):
        loaded = load_weights(biased_llama, config, np, np.float32, progress=False,
                              slice_tensor=checkpoint_slicer(config, rank, 2))
        cut = shard_weights(full, config, rank, 2, np)
        for name in ("embed", "norm", "lm_head"):
            np.testing.assert_array_equal(getattr(loaded, name), getattr(cut, name))
        for i, (a, b) in enumerate(zip(loaded.layers, cut.layers)):
            for field, value in vars(b).items():
                other = getattr(a, field)
                if value is None:
                    assert other is None, f"rank {rank} layer {i} {field}"
                else:
                    np.testing.assert_array_equal(other, value,
                                                  err_msg=f"rank {rank} layer {i} {field}")
        assert (cut.layers[0].o_bias is None) == (rank != 0)


# --- 2. the simulated N-rank forward equals the unsharded one ------------------------------------

def recording(reduce, calls):
    """A reduce hook that records each partial it gets (before the sum) and its result."""
    def hook(y):
        partial = y.copy()
        out = reduce(y)
        calls.append((partial, out.copy()))
        return out
    return hook


def prefill_logits(model, prompts):
    """Logits of every token of each prompt: dense causal attention, one forward per prompt,
    then the prompts of one length together (num_seqs > 1)."""
    outs = []
    for prompt in prompts:
        ids = np.asarray(prompt, np.int64)
        outs.append(model.forward(ids, np.arange(len(ids)), lambda layer, q, k, v:
                                  model.causal_attention(q, k, v)))
    same = [p for p in prompts if len(p) == len(prompts[0])]
    ids = np.concatenate(same).astype(np.int64)
    positions = np.concatenate([np.arange(len(p)) for p in same])
    outs.append(model.forward(ids, positions, lambda layer, q, k, v:
                              model.causal_attention(q, k, v, num_seqs=len(same))))
    return outs


@pytest.mark.parametrize("world, kv_heads, biases", SHARDING_CASES)
def test_simulated_ranks_sum_to_the_unsharded_forward(world, kv_heads, biases, rng):
    config = small_config(kv_heads, biases)
    weights = random_model_weights(config, rng)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 9, 5, 1, 5)]
    full_calls = []
    full = Model(config, weights, np, np.float32, reduce=recording(lambda y: y, full_calls))
    want = prefill_logits(full, prompts)

    def rank_main(group):
        calls = []
        model = Model(shard_config(config, world),
                      shard_weights(weights, config, group.rank, world, np), np, np.float32,
                      reduce=recording(group.all_reduce_sum, calls))
        return prefill_logits(model, prompts), calls

    ranks = run_simulated_ranks(world, rank_main)
    # Two all-reduces a layer (o, then down), per forward, in the same order on every rank.
    assert len(full_calls) == 2 * config.num_layers * len(want)
    assert all(len(calls) == len(full_calls) for _, calls in ranks)
    for index, (_, unsharded) in enumerate(full_calls):
        partials = [calls[index][0] for _, calls in ranks]
        assert rel(sum(p.astype(np.float64) for p in partials), unsharded) < SHARDED_BOUND
        # The partials are partial: no rank alone has the sum.
        assert min(rel(p, unsharded) for p in partials) > 1e-2
        for _, calls in ranks:  # every rank continues with the same bits
            np.testing.assert_array_equal(calls[index][1], ranks[0][1][index][1])
    for got, expected in zip(ranks[0][0], want):
        assert rel(got, expected) < SHARDED_BOUND
    for logits, _ in ranks[1:]:
        for a, b in zip(logits, ranks[0][0]):
            np.testing.assert_array_equal(a, b)


def run_engines(path, world, prompts, params, *, num_blocks=64, block_size=16, seed=0):
    """Generate with `world` simulated ranks (None: the plain one-process engine); per rank
    (sequences, engine, logits per sequence of every step)."""
    def one(group):
        model, backend = load_model(path, backend="numpy", progress=False, group=group)
        cache = make_cache(model, num_blocks, block_size, backend)
        steps = {}

        def record(seqs, logits):
            for row, seq in enumerate(seqs):
                steps.setdefault(seq.seq_id, []).append(np.array(logits[row], np.float64))

        engine = Engine(model, cache, backend=backend, on_logits=record, group=group)
        seqs = engine.generate(prompts, params, seed=seed)
        return seqs, engine, steps

    if world is None:
        return [one(None)]
    return run_simulated_ranks(world, one)


PROMPTS = [[1, 17, 42], [1], [1, 5, 9, 200, 33, 7, 81, 64, 99], list(range(3, 23)), [1, 250]]


@pytest.mark.parametrize("name", ["tiny", "tiny_qwen2", "biased_llama"])
def test_engine_logits_of_every_step_equal_the_single_rank_ones(name, request):
    """Prefill and every decode step (paged cache, cupa.decode on each rank's heads): rank 0's
    logits against one process's."""
    path = request.getfixturevalue(name)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ((single_seqs, _, single),) = run_engines(path, None, PROMPTS, params)
    ranks = run_engines(path, 2, PROMPTS, params)
    for seqs, engine, steps in ranks:
        assert [s.output_ids for s in seqs] == [s.output_ids for s in single_seqs]
        for seq in seqs:
            assert len(steps[seq.seq_id]) == 8
            errors = [rel(a, b) for a, b in zip(steps[seq.seq_id], single[seq.seq_id])]
            assert max(errors) < SHARDED_BOUND, (seq.seq_id, errors)


# --- 3. greedy tokens: N=2 == N=1 -----------------------------------------------------------------

def test_greedy_tokens_with_two_ranks_equal_one_rank(tiny):
    # Four 8-token prompts in 8 blocks of 8 tokens: all are admitted, each grows to 3 blocks,
    # so the newest get preempted and recomputed; the ranks must take every such decision alike.
    prompts = [[1] + [(7 * i + j) % 300 + 3 for j in range(7)] for i in range(4)] + PROMPTS
    params = SamplingParams(max_new_tokens=16)
    ((single_seqs, single_engine, _),) = run_engines(tiny, None, prompts, params, num_blocks=8,
                                                     block_size=8)
    ranks = run_engines(tiny, 2, prompts, params, num_blocks=8, block_size=8)
    want = [s.output_ids for s in single_seqs]
    assert single_engine.stats.preemptions > 0 and all(len(w) == 16 for w in want)
    for rank, (seqs, engine, _) in enumerate(ranks):
        assert [s.output_ids for s in seqs] == want, f"rank {rank}"
        assert [s.finish_reason for s in seqs] == [s.finish_reason for s in single_seqs]
        # Each rank's cache holds its own KV head (2 KV heads / 2 ranks), and the same blocks.
        assert engine.cache.num_kv_heads == 1 and engine.model.config.num_heads == 2
        assert engine.cache.key_cache(0).shape[1] == 1
        assert engine.stats.preemptions == single_engine.stats.preemptions
        assert engine.stats.decode_steps == single_engine.stats.decode_steps
        assert engine.cache.num_free_blocks == 8


def test_sampled_tokens_agree_on_every_rank(tiny):
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=40)
    ranks = run_engines(tiny, 2, PROMPTS, params, seed=7)
    ((single, _, _),) = run_engines(tiny, None, PROMPTS, params, seed=7)
    tokens = [[s.output_ids for s in seqs] for seqs, _, _ in ranks]
    assert tokens[0] == tokens[1]
    # Rank 0 samples from logits within SHARDED_BOUND of one process's, with the same
    # generators: the same tokens unless a uniform draw falls within ~1e-6 of a boundary.
    assert tokens[0] == [s.output_ids for s in single]


def test_every_rank_appends_rank_0s_choice(tiny, rng):
    """The broadcast, not equal logits, makes the ranks agree: given different logits, every
    rank appends the tokens rank 0 chose from its own."""
    logits = [rng.standard_normal((3, 320)).astype(np.float32) for _ in range(2)]
    assert (logits[0].argmax(1) != logits[1].argmax(1)).any()

    def rank_main(group):
        model, backend = load_model(tiny, backend="numpy", progress=False, group=group)
        engine = Engine(model, make_cache(model, 8, 16, backend), backend=backend, group=group)
        seqs = [engine.add_request([1, 2], SamplingParams(max_new_tokens=4)) for _ in range(3)]
        engine._sample_and_append(seqs, logits[group.rank])
        return [s.output_ids for s in seqs]

    assert run_simulated_ranks(2, rank_main) == [[[t] for t in logits[0].argmax(1)]] * 2


# --- the collectives ------------------------------------------------------------------------------

def test_thread_group_sums_and_broadcasts(rng):
    world = 3
    parts = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(world)]
    root_ids = rng.integers(0, 1000, 6)

    def rank_main(group):
        summed = group.all_reduce_sum(parts[group.rank].copy())
        ids = root_ids.copy() if group.rank == 1 else np.zeros(6, np.int64)
        return summed, group.broadcast(ids, root=1), minimum_over_ranks(group, 10 - group.rank)

    results = run_simulated_ranks(world, rank_main)
    want = parts[0].copy()
    for p in parts[1:]:
        want += p
    for summed, ids, smallest in results:
        np.testing.assert_array_equal(summed, want)  # the same bits everywhere
        np.testing.assert_array_equal(ids, root_ids)
        assert smallest == 8


def test_a_failing_rank_stops_the_others_instead_of_hanging():
    def rank_main(group):
        if group.rank == 1:
            raise KeyError("rank 1 broke")
        group.all_reduce_sum(np.ones(3))  # would wait for rank 1 forever
        return "unreachable"

    start = time.perf_counter()
    with pytest.raises(KeyError, match="rank 1 broke"):
        run_simulated_ranks(2, rank_main)
    assert time.perf_counter() - start < 30


def test_all_reduce_refuses_a_strided_array():
    (group,) = thread_groups(1)
    with pytest.raises(ValueError, match="C-contiguous"):
        group.all_reduce_sum(np.ones((4, 4))[:, :2])


class FakeCommunicator:
    def __init__(self, calls):
        self.calls = calls

    def all_reduce(self, in_array, out_array, op="sum", stream=None):
        self.calls.append(("all_reduce", in_array is out_array, op, stream))
        out_array *= 2  # what two ranks of equal parts would sum to

    def broadcast(self, array, root=0, stream=None):
        self.calls.append(("broadcast", root, stream))

    def stop(self):
        self.calls.append(("stop",))


def test_nccl_group_calls_cupyx_distributed_in_place_on_the_current_stream(monkeypatch):
    """NcclGroup against a fake cupyx.distributed and cupy device (NCCL itself is unrun)."""
    import cupy
    import cupyx
    calls = []
    fake = types.SimpleNamespace(init_process_group=lambda n, rank, **kw: (
        calls.append(("init", n, rank, kw)), FakeCommunicator(calls))[1])
    monkeypatch.setattr(cupyx, "distributed", fake, raising=False)
    monkeypatch.setitem(sys.modules, "cupyx.distributed", fake)

    class FakeDevice:
        def __init__(self, index):
            self.index = index

        def use(self):
            calls.append(("device", self.index, os.environ.get("NCCL_NVLS_ENABLE")))

    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    group = collectives.NcclGroup(rank=3, world=4, local_rank=1, host="10.0.0.1", port=29511)
    x = np.arange(6, dtype=np.float32)  # stands in for a device array
    assert group.all_reduce_sum(x) is x and x.tolist() == [0, 2, 4, 6, 8, 10]
    group.broadcast(x, root=0)
    group.close()
    # The device is chosen before NCCL starts, with NVLS (multicast) off; the collectives run
    # in place on the stream current at the call (stream=None): in a graph capture, the
    # capture stream.
    assert calls == [("device", 1, "0"),
                     ("init", 4, 3, {"backend": "nccl", "host": "10.0.0.1", "port": 29511}),
                     ("all_reduce", True, "sum", None), ("broadcast", 0, None), ("stop",)]


# --- 4. errors, and N=1 unchanged -----------------------------------------------------------------

@pytest.mark.parametrize("heads, kv_heads, inter, world, names", [
    (8, 4, 100, 3, ["num_heads (num_attention_heads)=8", "num_kv_heads (num_key_value_heads)=4",
                    "intermediate_size=100", "are not a multiple of 3"]),
    (8, 2, 96, 4, ["num_kv_heads (num_key_value_heads)=2 is not a multiple of 4"]),
    (12, 6, 100, 6, ["intermediate_size=100 is not a multiple of 6"]),
])
def test_indivisible_sizes_name_the_numbers(heads, kv_heads, inter, world, names):
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64,
                         intermediate_size=inter, num_layers=1, num_heads=heads,
                         num_kv_heads=kv_heads, head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=1e4)
    for check in (lambda: check_tensor_parallel(config, world),
                  lambda: shard_config(config, world),
                  lambda: checkpoint_slicer(config, 0, world)):
        with pytest.raises(ValueError) as info:
            check()
        assert all(n in str(info.value) for n in names), str(info.value)
    check_tensor_parallel(config, 1)  # one rank always fits
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        check_tensor_parallel(config, 0)


def test_fewer_gpus_than_ranks_is_a_clear_error(monkeypatch):
    import cupy
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(NotEnoughGpusError, match=r"--tensor-parallel 2 needs 2 GPUs on this "
                                                 r"host .* only 1 is visible \(visible devices: "
                                                 r"3\)"):
        check_visible_gpus(2, 2)
    check_visible_gpus(1, 2)  # one rank of this host: enough

    def no_driver():
        raise RuntimeError("cudaErrorNoDevice")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_driver)
    with pytest.raises(NotEnoughGpusError, match="only 0 are visible"):
        check_visible_gpus(1, 1)


def test_generate_refuses_more_ranks_than_gpus(tiny, monkeypatch, capsys):
    """--backend gpu --tensor-parallel 2 on a host with one GPU (simulated): one error line,
    before any process starts or any weight is read."""
    import cupy

    from cupa import arrays
    monkeypatch.setattr(arrays, "gpu_available", lambda: True)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(launcher, "spawn_ranks", lambda *a, **k: pytest.fail("spawned"))
    for name in ("RANK", "WORLD_SIZE", "NNODES"):
        monkeypatch.delenv(name, raising=False)
    status = generate.main(["--model", str(tiny), "--backend", "gpu", "--tensor-parallel", "2",
                            "--prompt-ids", "1,2,3"])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: --tensor-parallel 2 needs 2 GPUs on this host (one process per GPU), but only "
        "1 is visible"]


def test_one_rank_is_todays_path(tiny, monkeypatch, capsys):
    """--tensor-parallel 1 (the default): no launcher, no group, no reduce hook; the same
    tokens as without the flag."""
    monkeypatch.setattr(generate, "run_tensor_parallel", lambda *a: pytest.fail("launched"))
    made = []
    original = generate.Engine

    def engine(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(generate, "Engine", engine)
    outputs = []
    for flags in ([], ["--tensor-parallel", "1"]):
        assert generate.main(["--model", str(tiny), "--backend", "numpy", "--json", "--quiet",
                              "--prompt-ids", "1,17,42", "--max-new-tokens", "6", *flags]) == 0
        outputs.append(capsys.readouterr().out)
        assert made[-1].group is None and made[-1].model.reduce is None
        assert made[-1].model.config.num_heads == 4 and made[-1].cache.num_kv_heads == 2
    assert outputs[0] == outputs[1] and len(json.loads(outputs[0])["output_ids"]) == 6
    model, _ = load_model(tiny, backend="numpy", progress=False)
    assert model.reduce is None
    # A group of one rank is one GPU too: no sharding, no collectives.
    (group,) = thread_groups(1)
    model, _ = load_model(tiny, backend="numpy", progress=False, group=group)
    assert model.reduce is None and model.config.num_heads == 4
    assert Engine(model, make_cache(model, 4, 16, "numpy"), group=group).group is None


# --- 5. the command line --------------------------------------------------------------------------

def run_cli(script, *args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, **(env or {})))


def test_cli_tensor_parallel_on_numpy_simulates_the_ranks(tiny):
    """--tensor-parallel 2 on the numpy backend runs the two ranks as threads: the same JSON
    as one rank, printed once."""
    args = ["--model", str(tiny), "--backend", "numpy", "--max-new-tokens", "8", "--json",
            "--prompt-ids", "1,17,42", "--prompt-ids", "1,5,9,200,33", "--ignore-eos"]
    one = run_cli("generate.py", *args, "--tensor-parallel", "1")
    two = run_cli("generate.py", *args, "--tensor-parallel", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    records = [json.loads(line) for line in one.stdout.splitlines()]
    assert len(records) == 2 and all(len(r["output_ids"]) == 8 for r in records)
    assert two.stdout == one.stdout
    assert "simulated as threads" in two.stderr and "tensor parallel 2" in two.stderr
    assert "heads 4/2" in two.stderr  # the whole model's heads in the header
    assert two.stderr.count("generated 16 tokens") == 1  # rank 0 alone prints


def test_cli_indivisible_heads_are_refused_in_one_line(tiny):
    result = run_cli("generate.py", "--model", str(tiny), "--backend", "numpy",
                     "--prompt-ids", "1,2", "--tensor-parallel", "4")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: tensor parallel over 4 ranks: num_kv_heads (num_key_value_heads)=2 is not a "
        "multiple of 4 (every rank must hold whole query heads, whole KV heads and whole MLP "
        "units)"]
    bad = run_cli("generate.py", "--model", str(tiny), "--prompt-ids", "1", "--tensor-parallel",
                  "0")
    assert bad.returncode == 2 and "--tensor-parallel: must be an integer >= 1" in bad.stderr


def test_bench_flag_parses_and_checks_the_shape():
    import bench_generate
    args = bench_generate.parse_args(["--tensor-parallel", "2", "--shape", "llama2-70b",
                                      "--layers", "20"])
    assert (args.tensor_parallel, args.shape, args.layers) == (2, "llama2-70b", 20)
    assert bench_generate.parse_args([]).layers == 32  # the 7B default is unchanged
    config = shard_config(bench_generate.bench_config(args), 2)
    assert (config.num_heads, config.num_kv_heads, config.intermediate_size) == (32, 4, 14336)
    with pytest.raises(SystemExit):
        bench_generate.parse_args(["--tensor-parallel", "3"])  # 32 heads, MLP 11008
    result = run_cli("bench_generate.py", "--tensor-parallel", "16", "--shape", "llama2-70b")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: --tensor-parallel 16 --shape llama2-70b: tensor parallel over 16 ranks: "
        "num_kv_heads (num_key_value_heads)=8 is not a multiple of 16 (every rank must hold "
        "whole query heads, whole KV heads and whole MLP units)"]


# --- the launcher ---------------------------------------------------------------------------------

def test_environment_rank_reads_torchrun_variables():
    assert environment_rank(2, {}) is None
    where = environment_rank(4, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                 "MASTER_ADDR": "node0", "MASTER_PORT": "1234"})
    assert where == RankEnvironment(3, 4, 1, "node0", 1234)
    assert where.variables() == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                 "MASTER_ADDR": "node0", "MASTER_PORT": "1234",
                                 **NCCL_ENVIRONMENT}
    assert NCCL_ENVIRONMENT == {"NCCL_NVLS_ENABLE": "0"}
    for environ, message in [
            ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, "WORLD_SIZE=2 but "
                                                                    "--tensor-parallel 4"),
            ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "a"}, r"RANK=4 is not in \[0, 4\)"),
            ({"RANK": "1", "WORLD_SIZE": "4"}, "MASTER_ADDR is not"),
            ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
            ({"WORLD_SIZE": "4"}, "RANK is not set")]:
        with pytest.raises(LaunchError, match=message):
            environment_rank(4, environ)


def test_host_ranks_on_one_host_and_on_several():
    one = host_ranks(4, {}, free_port=lambda: 40123)
    assert one == [RankEnvironment(r, 4, r, "127.0.0.1", 40123) for r in range(4)]
    second = host_ranks(8, {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.1.1"})
    assert [(w.rank, w.local_rank) for w in second] == [(4 + i, i) for i in range(4)]
    assert {(w.master_addr, w.master_port, w.world) for w in second} == \
        {("10.1.1.1", launcher.DEFAULT_MASTER_PORT, 8)}
    for environ, message in [({"NNODES": "3"}, "must split evenly"),
                             ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "a"},
                              r"NODE_RANK=2 is not in \[0, NNODES=2\)"),
                             ({"NNODES": "2"}, "needs MASTER_ADDR")]:
        with pytest.raises(LaunchError, match=message):
            host_ranks(8, environ)


class StandInGroup:
    """What a spawned rank gets instead of NcclGroup (no GPU): its place, nothing to reduce."""

    def __init__(self, where):
        self.rank, self.world = where.rank, where.world

    def close(self):
        pass


def report_environment(argv, group):
    """A rank program: write what the rank sees, then exit with the status argv asks for."""
    out_dir, statuses, sleeps = Path(argv[0]), argv[1].split(","), argv[2].split(",")
    seen = {name: os.environ.get(name) for name in
            ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
             "NCCL_NVLS_ENABLE")}
    (out_dir / f"rank{group.rank}.json").write_text(json.dumps(dict(seen, group=group.rank)))
    time.sleep(float(sleeps[group.rank]))
    return int(statuses[group.rank])


def test_spawned_ranks_get_their_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the launcher sets it; restored afterwards
    ranks = host_ranks(2, {}, free_port=lambda: 40999)
    status = launcher.spawn_ranks(ranks, report_environment, [str(tmp_path), "0,0", "0,0"],
                                  make_group=StandInGroup)
    assert status == 0
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "40999",
                        "NCCL_NVLS_ENABLE": "0", "group": rank}
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # and in the launcher's own environment


def test_a_failing_rank_process_stops_the_others(tmp_path, monkeypatch):
    """Rank 1 exits with status 3 at once while rank 0 would run for a minute (as if waiting
    in a collective): the launcher stops rank 0 and returns 3."""
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)  # restored afterwards
    ranks = host_ranks(2, {}, free_port=lambda: 40998)
    start = time.perf_counter()
    status = launcher.spawn_ranks(ranks, report_environment, [str(tmp_path), "0,3", "60,0"],
                                  make_group=StandInGroup)
    assert status == 3 and time.perf_counter() - start < 45
