"""Tensor-parallel sharding: which part of the model each of `world` ranks holds.

Megatron-style, as pure functions of (config or weights, rank, world), numpy/cupy agnostic:

- Attention by heads: rank r holds query heads [r * H/N, (r + 1) * H/N) and KV heads
  [r * KV/N, (r + 1) * KV/N). Query head h reads KV head h // (H / KV), so contiguous shares keep
  every query head on the rank of its KV head; each rank's paged KV cache holds its KV heads only
  and cupa.decode runs on its heads only. Rows of the fused q/k/v projection are split by head,
  columns of the output projection by the same heads.
- MLP by column, then by row: rows of gate and of up (and their biases) by intermediate unit,
  the matching columns of down.
- The output projection and the down projection then give partial sums over the rank's heads or
  units; the model all-reduces them (Model's `reduce` hook) before the residual add. Their
  biases are added once in total: rank 0 keeps them, the other ranks have none.
- Everything else is replicated: embedding, norms and the LM head (every rank computes the full
  logits; rank 0 samples).

A rank's model is the unsharded config with num_heads, num_kv_heads and intermediate_size
divided by N (shard_config), and its weights come either from sharding full weights
(shard_weights) or, without ever holding the full tensors, from slicing each checkpoint tensor
as it is loaded (checkpoint_slicer, used by weights.load_weights).
"""

from __future__ import annotations

import dataclasses

from .config import ModelConfig
from .weights import LayerWeights, ModelWeights

# The rank that keeps the biases added after a reduce (o_proj, down_proj), and that samples.
ROOT_RANK = 0


def check_tensor_parallel(config: ModelConfig, world: int) -> None:
    """ValueError naming the numbers unless `config` splits over `world` ranks: whole query
    heads, whole KV heads and whole MLP units on every rank."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor parallel: the number of ranks must be an integer >= 1, "
                         f"got {world!r}")
    sizes = {"num_heads (num_attention_heads)": config.num_heads,
             "num_kv_heads (num_key_value_heads)": config.num_kv_heads,
             "intermediate_size": config.intermediate_size}
    bad = [f"{name}={value}" for name, value in sizes.items() if value % world]
    if bad:
        raise ValueError(f"tensor parallel over {world} ranks: {', '.join(bad)} "
                         f"{'is' if len(bad) == 1 else 'are'} not a multiple of {world} (every "
                         f"rank must hold whole query heads, whole KV heads and whole MLP units)")


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's model: heads, KV heads and MLP width divided by `world`."""
    check_tensor_parallel(config, world)
    return dataclasses.replace(config, num_heads=config.num_heads // world,
                               num_kv_heads=config.num_kv_heads // world,
                               intermediate_size=config.intermediate_size // world)


def share(total: int, rank: int, world: int) -> slice:
    """Rank `rank`'s contiguous share of `total` items (total divisible by world)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    size = total // world
    return slice(rank * size, (rank + 1) * size)


def head_share(heads: int, head_dim: int, rank: int, world: int) -> slice:
    """The rows (or columns) of a rank's heads in a [heads * head_dim, ...] projection."""
    part = share(heads, rank, world)
    return slice(part.start * head_dim, part.stop * head_dim)


def _offset(part: slice, by: int) -> slice:
    return slice(part.start + by, part.stop + by)


def fused_qkv_rows(config: ModelConfig, rank: int, world: int) -> list[slice]:
    """The row ranges of a rank's q, k and v in the fused [(H + 2 KV) * d, hidden] projection
    (q rows first, then k, then v): concatenated, they are the rank's own fused projection."""
    d = config.head_dim
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    kv = head_share(config.num_kv_heads, d, rank, world)
    return [head_share(config.num_heads, d, rank, world), _offset(kv, q_size),
            _offset(kv, q_size + kv_size)]


def fused_gate_up_rows(config: ModelConfig, rank: int, world: int) -> list[slice]:
    """The row ranges of a rank's gate and up halves in the fused [2 * inter, hidden] one."""
    units = share(config.intermediate_size, rank, world)
    return [units, _offset(units, config.intermediate_size)]


def shard_layer(layer: LayerWeights, config: ModelConfig, rank: int, world: int,
                xp) -> LayerWeights:
    """One rank's part of a decoder layer of the unsharded `config` (xp: numpy or cupy)."""
    qkv_rows = fused_qkv_rows(config, rank, world)
    gate_up_rows = fused_gate_up_rows(config, rank, world)
    head_columns = head_share(config.num_heads, config.head_dim, rank, world)
    unit_columns = share(config.intermediate_size, rank, world)

    def rows(array, parts):
        if array is None:
            return None
        return xp.ascontiguousarray(xp.concatenate([array[p] for p in parts], axis=0))

    def root_only(bias):
        return bias if rank == ROOT_RANK else None

    return LayerWeights(
        input_norm=layer.input_norm,
        qkv=rows(layer.qkv, qkv_rows), qkv_bias=rows(layer.qkv_bias, qkv_rows),
        o=xp.ascontiguousarray(layer.o[:, head_columns]), o_bias=root_only(layer.o_bias),
        post_norm=layer.post_norm,
        gate_up=rows(layer.gate_up, gate_up_rows),
        gate_up_bias=rows(layer.gate_up_bias, gate_up_rows),
        down=xp.ascontiguousarray(layer.down[:, unit_columns]),
        down_bias=root_only(layer.down_bias))


def shard_weights(weights: ModelWeights, config: ModelConfig, rank: int, world: int,
                  xp) -> ModelWeights:
    """One rank's weights from the full weights of `config` (embedding, norms and LM head are
    the same arrays: replicated)."""
    check_tensor_parallel(config, world)
    return ModelWeights(embed=weights.embed, norm=weights.norm, lm_head=weights.lm_head,
                        layers=[shard_layer(layer, config, rank, world, xp)
                                for layer in weights.layers])


def checkpoint_slicer(config: ModelConfig, rank: int, world: int):
    """slice_tensor(name, array) -> the rank's part of a checkpoint tensor (Hugging Face names,
    [out, in] matrices), a view of it, or None for a bias only the root rank adds. load_weights
    applies it to each memory-mapped tensor before converting and uploading, so no rank ever
    holds a full sharded matrix. The rules are shard_layer's, per unfused tensor."""
    check_tensor_parallel(config, world)
    d = config.head_dim
    q_part = head_share(config.num_heads, d, rank, world)
    kv_part = head_share(config.num_kv_heads, d, rank, world)
    units = share(config.intermediate_size, rank, world)
    row_parts = {"self_attn.q_proj": q_part, "self_attn.k_proj": kv_part,
                 "self_attn.v_proj": kv_part, "mlp.gate_proj": units, "mlp.up_proj": units}
    column_parts = {"self_attn.o_proj": q_part, "mlp.down_proj": units}

    def slice_tensor(name: str, array):
        module, _, kind = name.rpartition(".")        # "model.layers.3.mlp.up_proj", "weight"
        role = ".".join(module.split(".")[3:]) if name.startswith("model.layers.") else ""
        if role in row_parts:
            return array[row_parts[role]]
        if role in column_parts:
            if kind == "bias":
                return array if rank == ROOT_RANK else None
            return array[:, column_parts[role]]
        return array  # norms, embedding, LM head: replicated

    return slice_tensor
