"""Checkpoint weights: a small safetensors reader (bf16 included) and the layout the model uses.

safetensors' own numpy loader has no bfloat16 (numpy lacks it), so the file format is read here
directly: 8 bytes of little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the raw bytes. ml_dtypes supplies the bfloat16 numpy dtype.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .config import ModelConfig

SAFETENSORS_DTYPES = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
}


def read_safetensors_header(path) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, offset of the data section)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def open_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of one file as a read-only numpy view of a memory map (nothing is copied)."""
    header, data_start = read_safetensors_header(path)
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        raw = blob[data_start + begin:data_start + end]
        tensors[name] = raw.view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def checkpoint_tensors(model_dir) -> dict[str, np.ndarray]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json "
                                "(only safetensors checkpoints are supported)")
    tensors = {}
    for name in files:
        tensors.update(open_safetensors(model_dir / name))
    return tensors


def save_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """Write numpy arrays (bfloat16 included) as one safetensors file."""
    names = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
    header, offset = {}, 0
    for name, array in tensors.items():
        nbytes = array.nbytes
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


@dataclass
class LayerWeights:
    """One decoder layer. Matrices keep the checkpoint's [out, in] layout (y = x @ W.T: BLAS and
    cuBLAS read the transposed view directly, so loading needs no transpose copies); q/k/v and
    gate/up are stacked along `out` so each pair or triple takes one matmul."""

    input_norm: object
    qkv: object
    qkv_bias: object | None
    o: object
    o_bias: object | None
    post_norm: object
    gate_up: object
    gate_up_bias: object | None
    down: object
    down_bias: object | None


@dataclass
class ModelWeights:
    embed: object          # [vocab, hidden]
    layers: list[LayerWeights]
    norm: object           # [hidden]
    lm_head: object        # [vocab, hidden] (embed itself when tied)

    def nbytes(self) -> int:
        """Bytes a decode step reads: every layer matrix, the final norm and the LM head."""
        total = self.norm.nbytes + self.lm_head.nbytes
        for layer in self.layers:
            total += sum(x.nbytes for x in vars(layer).values() if x is not None)
        return total


class _Progress:
    """One self-overwriting stderr line: tensors and megabytes loaded so far."""

    def __init__(self, total_tensors, total_bytes, enabled):
        self.total, self.total_bytes, self.enabled = total_tensors, total_bytes, enabled
        self.count, self.bytes = 0, 0
        self.start = self.last = time.perf_counter()

    def advance(self, nbytes):
        self.count += 1
        self.bytes += nbytes
        now = time.perf_counter()
        if self.enabled and now - self.last > 0.2:
            self.last = now
            print(f"\rloading weights: {self.count}/{self.total} tensors, "
                  f"{self.bytes / 2**20:.0f}/{self.total_bytes / 2**20:.0f} MiB "
                  f"({now - self.start:.1f} s)", end="", file=sys.stderr, flush=True)

    def finish(self):
        """End the line (tensors the model does not use, such as a tied lm_head, are skipped)."""
        if self.enabled:
            print(f"\rloading weights: {self.count} tensors, {self.bytes / 2**20:.0f} MiB in "
                  f"{time.perf_counter() - self.start:.1f} s" + " " * 20, file=sys.stderr)


def load_weights(model_dir, config: ModelConfig, xp, dtype, *, progress=True) -> ModelWeights:
    """Load a checkpoint into arrays of module `xp` (numpy or cupy) and dtype `dtype`."""
    tensors = checkpoint_tensors(model_dir)
    prefix = "model."
    needed = [f"{prefix}embed_tokens.weight", f"{prefix}norm.weight"]
    if not config.tie_word_embeddings:
        needed.append("lm_head.weight")
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {missing}")
    total_bytes = sum(t.nbytes for t in tensors.values())
    bar = _Progress(len(tensors), total_bytes, progress)

    def get(name, optional=False):
        if name not in tensors:
            if optional:
                return None
            raise ValueError(f"{model_dir}: checkpoint lacks tensor {name}")
        host = tensors[name]
        bar.advance(host.nbytes)
        # Convert on the host in float32 only when the dtype changes (bf16 -> f16 etc.); a plain
        # upload keeps the peak host memory at one tensor.
        if host.dtype != dtype:
            host = host.astype(np.float32).astype(dtype)
        return xp.ascontiguousarray(xp.asarray(host))

    def fused(names, optional=False):
        parts = [get(n, optional) for n in names]
        if any(p is None for p in parts):
            return None
        return xp.concatenate(parts, axis=0)

    layers = []
    for i in range(config.num_layers):
        p = f"{prefix}layers.{i}."
        attn = [f"{p}self_attn.{x}_proj" for x in "qkv"]
        mlp = [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]
        layers.append(LayerWeights(
            input_norm=get(f"{p}input_layernorm.weight"),
            qkv=fused([n + ".weight" for n in attn]),
            qkv_bias=fused([n + ".bias" for n in attn], optional=not config.qkv_bias),
            o=get(f"{p}self_attn.o_proj.weight"),
            o_bias=get(f"{p}self_attn.o_proj.bias", optional=not config.o_bias),
            post_norm=get(f"{p}post_attention_layernorm.weight"),
            gate_up=fused([n + ".weight" for n in mlp]),
            gate_up_bias=fused([n + ".bias" for n in mlp], optional=not config.mlp_bias),
            down=get(f"{p}mlp.down_proj.weight"),
            down_bias=get(f"{p}mlp.down_proj.bias", optional=not config.mlp_bias),
        ))
    embed = get(f"{prefix}embed_tokens.weight")
    norm = get(f"{prefix}norm.weight")
    lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
    bar.finish()
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)


def random_weights(config: ModelConfig, xp, dtype, *, seed=0, std=0.02) -> ModelWeights:
    """Random weights made directly by `xp` (on the GPU for cupy: no host transfer), for benchmarks.

    Norm weights are 1 and matrices N(0, std), like a freshly initialised model.
    """
    rng = xp.random.default_rng(seed) if hasattr(xp.random, "default_rng") else xp.random
    hidden, inter = config.hidden_size, config.intermediate_size
    qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim

    def matrix(out_features, in_features):
        return (rng.standard_normal((out_features, in_features), dtype=xp.float32) * std
                ).astype(dtype)

    def ones(n):
        return xp.ones(n, dtype=dtype)

    layers = [LayerWeights(
        input_norm=ones(hidden), qkv=matrix(qkv_out, hidden), qkv_bias=None,
        o=matrix(hidden, config.num_heads * config.head_dim), o_bias=None,
        post_norm=ones(hidden), gate_up=matrix(2 * inter, hidden), gate_up_bias=None,
        down=matrix(hidden, inter), down_bias=None) for _ in range(config.num_layers)]
    embed = matrix(config.vocab_size, hidden)
    lm_head = embed if config.tie_word_embeddings else matrix(config.vocab_size, hidden)
    return ModelWeights(embed=embed, layers=layers, norm=ones(hidden), lm_head=lm_head)
