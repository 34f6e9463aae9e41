"""Checkpoint weights: a small safetensors reader (bf16 included) and the layout the model uses.

safetensors' own numpy loader has no bfloat16 (numpy lacks it), so the file format is read here
directly: 8 bytes of little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the raw bytes. ml_dtypes supplies the bfloat16 numpy dtype.

The reader trusts nothing in the file: the header length, every byte range and the tensors'
names, dtypes and shapes (against what config.json implies) are checked before a single weight
is built, and the data is memory-mapped, never read whole. A bad file raises CheckpointError
naming the file and the tensor instead of failing later inside numpy.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as config.json describes it: a malformed or truncated
    safetensors file, a missing tensor, a wrong shape or dtype. The message names the file and,
    where there is one, the tensor."""


class CheckpointWarning(UserWarning):
    """A checkpoint that loads but looks wrong: non-finite weights, tensors nothing uses."""


# Bytes per element of every dtype the safetensors format defines, so that the byte range of any
# tensor can be checked, also of one this engine cannot read.
SAFETENSORS_ITEMSIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8,
}
# The dtypes read into numpy (ml_dtypes supplies bfloat16) and written by save_safetensors.
SAFETENSORS_DTYPES = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
}
# The dtypes a weight the model uses may be stored as (it is converted to the compute dtype),
# each with (unsigned view, mask clearing the sign, the bits of +infinity): a value is NaN or
# infinite exactly when its bits without the sign reach +infinity's (all exponent bits set).
# Integer operations on the raw bits run several times faster than np.isfinite on bfloat16.
FLOAT_BITS = {
    "F16": (np.uint16, 0x7FFF, 0x7C00),
    "BF16": (np.uint16, 0x7FFF, 0x7F80),
    "F32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    "F64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}
WEIGHT_DTYPES = tuple(FLOAT_BITS)
# A checkpoint is one file, or shards listed by an index (the Hugging Face names).
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The format's own limit (the reference implementation refuses longer headers); it also keeps a
# garbage length from becoming a huge read.
MAX_HEADER_BYTES = 100 * 2**20
# Names at most listed in one message; longer lists end with "and N more".
MAX_NAMES_SHOWN = 5
# Tensors a checkpoint may carry that the model deliberately does not read, so they get no
# "unused" warning: older Llama exports saved the rotary inverse frequencies, which the model
# computes itself; a tied lm_head is the embedding (Hugging Face ignores both the same way).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _names(names) -> str:
    names = list(names)
    shown = ", ".join(names[:MAX_NAMES_SHOWN])
    more = len(names) - MAX_NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header, its byte range already checked against the file."""

    file: Path
    name: str
    dtype: str               # the safetensors name: "BF16", "F32", ...
    shape: tuple[int, ...]
    begin: int               # absolute byte offsets in `file`
    end: int


def _check_entry(path, name, info, data_size) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, relative to the data section, or
    CheckpointError."""
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is {info!r}, not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(f"{where}: header entry lacks {key!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in SAFETENSORS_ITEMSIZES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}")

    def is_count(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_count, offsets))
            or offsets[0] > offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end] with "
                              "0 <= begin <= end")
    begin, end = offsets
    need = math.prod(shape) * SAFETENSORS_ITEMSIZES[dtype]
    if end - begin != need:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes "
                              f"but {dtype} x {shape} needs {need}")
    if end > data_size:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] run past the end of the "
                              f"data section ({data_size} bytes): the file is truncated or "
                              "corrupt")
    return dtype, tuple(shape), begin, end


def read_safetensors_header(path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, every byte range checked against the file size and
    against each other, or CheckpointError naming the file (and the tensor).

    Layout: 8 bytes of little-endian header length, that many bytes of JSON, then the data."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file (an "
                              "8-byte header length comes first)")
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CheckpointError(f"{path}: header length {length} does not fit in the file of "
                                  f"{size} bytes: not a safetensors file, or truncated")
        text = f.read(length)
    try:
        header = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for binary garbage
        raise CheckpointError(f"{path}: the header is not valid JSON ({e}): not a safetensors "
                              "file, or truncated") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data_start, data_size = 8 + length, size - 8 - length
    entries = {}
    for name, info in header.items():
        dtype, shape, begin, end = _check_entry(path, name, info, data_size)
        entries[name] = TensorEntry(path, name, dtype, shape, data_start + begin, data_start + end)
    # Overlapping ranges mean a corrupt header (two tensors would share bytes). Empty tensors
    # occupy no bytes and cannot overlap anything.
    ranges = sorted((e for e in entries.values() if e.end > e.begin), key=lambda e: e.begin)
    for before, after in zip(ranges, ranges[1:]):
        if after.begin < before.end:
            raise CheckpointError(f"{path}: tensors {before.name} and {after.name} overlap "
                                  f"(bytes {after.begin}..{before.end} of the file)")
    return entries


def map_tensors(entries: dict[str, TensorEntry]) -> dict[str, np.ndarray]:
    """Read-only numpy views of a memory map of each file (nothing is read until used). The
    entries must come from read_safetensors_header, and their dtypes be in SAFETENSORS_DTYPES."""
    maps, tensors = {}, {}
    for name, entry in entries.items():
        if entry.file not in maps:
            maps[entry.file] = np.memmap(entry.file, dtype=np.uint8, mode="r")
        raw = maps[entry.file][entry.begin:entry.end]
        tensors[name] = raw.view(SAFETENSORS_DTYPES[entry.dtype]).reshape(entry.shape)
    return tensors


def open_safetensors(path) -> dict[str, np.ndarray]:
    """Every tensor of one file as a read-only numpy view of a memory map (nothing is copied)."""
    entries = read_safetensors_header(path)
    for entry in entries.values():
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {entry.name} has dtype {entry.dtype}, which "
                                  f"this reader does not support ({', '.join(SAFETENSORS_DTYPES)})")
    return map_tensors(entries)


def checkpoint_source(model_dir) -> Path:
    """The file that defines the checkpoint: the shard index if there is one, else
    model.safetensors; FileNotFoundError when neither exists."""
    model_dir = Path(model_dir)
    for name in (INDEX_FILE, SINGLE_FILE):
        if (model_dir / name).is_file():
            return model_dir / name
    raise FileNotFoundError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                            "checkpoints are supported)")


def _shard_names(index: Path) -> tuple[list[str], dict[str, str]]:
    """(shard file names, tensor name -> shard) of a model.safetensors.index.json."""
    try:
        raw = json.loads(index.read_bytes())
    except ValueError as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v for v in weight_map.values()):
        raise CheckpointError(f"{index}: lacks a 'weight_map' object of tensor name -> file name")
    for tensor, shard in weight_map.items():
        # A shard must be a file next to the index: a path could name any file on the machine.
        if Path(shard).name != shard:
            raise CheckpointError(f"{index}: tensor {tensor} maps to {shard!r}, which is not a "
                                  "file name in the checkpoint directory")
        if not (index.parent / shard).is_file():
            raise CheckpointError(f"{index}: tensor {tensor} maps to shard {shard}, which does "
                                  "not exist")
    return sorted(set(weight_map.values())), weight_map


def read_checkpoint(model_dir) -> tuple[Path, dict[str, TensorEntry]]:
    """(the checkpoint's defining file, every tensor's entry) of model.safetensors or of the
    shards listed in model.safetensors.index.json, all headers checked."""
    source = checkpoint_source(model_dir)
    if source.name == SINGLE_FILE:
        return source, read_safetensors_header(source)
    shards, weight_map = _shard_names(source)
    entries = {}
    for shard in shards:
        for name, entry in read_safetensors_header(source.parent / shard).items():
            if name in entries:
                raise CheckpointError(f"{entry.file}: tensor {name} is also in "
                                      f"{entries[name].file}")
            entries[name] = entry
    for tensor, shard in weight_map.items():
        if tensor not in entries or entries[tensor].file.name != shard:
            raise CheckpointError(f"{source}: tensor {tensor} is mapped to {shard}, which has no "
                                  "such tensor")
    return source, entries


@dataclass(frozen=True)
class ExpectedTensor:
    shape: tuple[int, ...]
    meaning: str             # where the shape comes from, e.g. "[hidden_size]"


def expected_tensors(config: ModelConfig) -> dict[str, ExpectedTensor]:
    """Every tensor the model reads from a checkpoint, with the shape config.json implies (the
    Hugging Face names; matrices are [out_features, in_features])."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    q_means, kv_means = "num_attention_heads*head_dim", "num_key_value_heads*head_dim"
    expected = {"model.embed_tokens.weight": ExpectedTensor((vocab, hidden),
                                                            "[vocab_size, hidden_size]"),
                "model.norm.weight": ExpectedTensor((hidden,), "[hidden_size]")}
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = ExpectedTensor((vocab, hidden), "[vocab_size, hidden_size]")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": ((hidden,), "[hidden_size]"),
            "post_attention_layernorm.weight": ((hidden,), "[hidden_size]"),
            "self_attn.q_proj.weight": ((q_out, hidden), f"[{q_means}, hidden_size]"),
            "self_attn.k_proj.weight": ((kv_out, hidden), f"[{kv_means}, hidden_size]"),
            "self_attn.v_proj.weight": ((kv_out, hidden), f"[{kv_means}, hidden_size]"),
            "self_attn.o_proj.weight": ((hidden, q_out), f"[hidden_size, {q_means}]"),
            "mlp.gate_proj.weight": ((inter, hidden), "[intermediate_size, hidden_size]"),
            "mlp.up_proj.weight": ((inter, hidden), "[intermediate_size, hidden_size]"),
            "mlp.down_proj.weight": ((hidden, inter), "[hidden_size, intermediate_size]"),
        }
        if config.qkv_bias:
            layer["self_attn.q_proj.bias"] = ((q_out,), f"[{q_means}]")
            layer["self_attn.k_proj.bias"] = ((kv_out,), f"[{kv_means}]")
            layer["self_attn.v_proj.bias"] = ((kv_out,), f"[{kv_means}]")
        if config.o_bias:
            layer["self_attn.o_proj.bias"] = ((hidden,), "[hidden_size]")
        if config.mlp_bias:
            layer["mlp.gate_proj.bias"] = ((inter,), "[intermediate_size]")
            layer["mlp.up_proj.bias"] = ((inter,), "[intermediate_size]")
            layer["mlp.down_proj.bias"] = ((hidden,), "[hidden_size]")
        expected.update({p + k: ExpectedTensor(*v) for k, v in layer.items()})
    return expected


def _layer_indices(names) -> set[int]:
    indices = set()
    for name in names:
        parts = name.split(".")
        if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            indices.add(int(parts[2]))
    return indices


def _head_dim_note(config: ModelConfig) -> str:
    """A hint for a shape error when config.json's head_dim is not hidden_size / heads."""
    derived = config.hidden_size / config.num_heads
    if config.head_dim == derived:
        return ""
    return (f"; note config.json head_dim={config.head_dim} differs from "
            f"hidden_size/num_attention_heads={derived:g}")


def check_checkpoint(source: Path, entries: dict[str, TensorEntry], config: ModelConfig,
                     config_name: str = "config.json") -> list[str]:
    """Check the tensors against what config.json implies; CheckpointError for a layer count
    that differs, a missing tensor, a wrong dtype or shape. Returns the names of the tensors the
    model does not use (the caller warns about them)."""
    layers = _layer_indices(entries)
    found = max(layers) + 1 if layers else 0
    if found != config.num_layers:
        raise CheckpointError(f"{source}: the checkpoint has {found} decoder layers "
                              f"(model.layers.N) but {config_name} says num_hidden_layers="
                              f"{config.num_layers}")
    expected = expected_tensors(config)
    missing = [name for name in expected if name not in entries]
    if missing:
        raise CheckpointError(f"{source}: lacks tensor(s) {_names(missing)}, which {config_name} "
                              "implies")
    for name, want in expected.items():
        entry = entries[name]
        if entry.dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{entry.file}: tensor {name} has dtype {entry.dtype}; a "
                                  f"weight must be one of {', '.join(WEIGHT_DTYPES)}")
        if entry.shape != want.shape:
            raise CheckpointError(
                f"{entry.file}: tensor {name} has shape {list(entry.shape)} but {config_name} "
                f"implies {list(want.shape)} = {want.meaning}{_head_dim_note(config)}")
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    return [name for name in entries if name not in expected and name not in ignored
            and not name.endswith(IGNORED_SUFFIXES)]


def has_non_finite(array, dtype: str, chunk_elements=1 << 22) -> bool:
    """Whether a (memory-mapped) array of safetensors dtype `dtype` (one of FLOAT_BITS) holds a
    NaN or an infinity. Read in chunks through one small buffer, so no temporary grows with the
    tensor."""
    unsigned, magnitude, infinity = FLOAT_BITS[dtype]
    bits = array.reshape(-1).view(unsigned)
    buffer = np.empty(min(chunk_elements, bits.size), unsigned)
    for start in range(0, bits.size, chunk_elements):
        part = bits[start:start + chunk_elements]
        out = buffer[:part.size]
        np.bitwise_and(part, unsigned(magnitude), out=out)
        if out.max() >= infinity:
            return True
    return False


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


def load_weights(model_dir, config: ModelConfig, xp, dtype, *, progress=True,
                 slice_tensor=None) -> ModelWeights:
    """Load a checkpoint into arrays of module `xp` (numpy or cupy) and dtype `dtype`.

    Every header, byte range, tensor name, dtype and shape is checked before anything is built
    (CheckpointError); tensors the model does not use and weights holding NaN or infinity are
    reported with a CheckpointWarning. slice_tensor(name, array) -> the part of each tensor to
    load, or None to drop it (one tensor-parallel rank's: tensor_parallel.checkpoint_slicer);
    it is applied to the memory map, so only that part is read, converted and uploaded. The
    checks are against the full `config` either way."""
    model_dir = Path(model_dir)
    source, entries = read_checkpoint(model_dir)
    unused = check_checkpoint(source, entries, config, str(model_dir / "config.json"))
    if unused:
        warnings.warn(f"{source}: ignoring {len(unused)} tensor(s) that "
                      f"{model_dir / 'config.json'} does not use: {_names(unused)}",
                      CheckpointWarning, stacklevel=2)
    needed = expected_tensors(config)
    tensors = map_tensors({name: entries[name] for name in needed})

    def part(name):
        """What to load of a tensor: all of it, or the slice's view (None: nothing)."""
        return tensors[name] if slice_tensor is None else slice_tensor(name, tensors[name])

    total_bytes = sum(p.nbytes for p in map(part, tensors) if p is not None)
    bar = _Progress(sum(part(name) is not None for name in tensors), total_bytes, progress)
    non_finite = []

    def get(name):
        """The tensor as an xp array of `dtype`; None for one the config does not use (a bias)."""
        if name not in tensors:
            return None
        host = part(name)
        if host is None:
            return None
        host = np.ascontiguousarray(host)  # a column share is a strided view (else no copy)
        bar.advance(host.nbytes)
        if has_non_finite(host, entries[name].dtype):
            non_finite.append(name)
        # Convert on the host in float32 only when the dtype changes (bf16 -> f16 etc.); a plain
        # upload keeps the peak host memory at one tensor.
        if host.dtype != dtype:
            host = host.astype(np.float32).astype(dtype)
        return xp.ascontiguousarray(xp.asarray(host))

    def fused(names):
        parts = [get(n) for n in names]
        return None if parts[0] is None else xp.concatenate(parts, axis=0)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = [f"{p}self_attn.{x}_proj" for x in "qkv"]
        mlp = [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]
        layers.append(LayerWeights(
            input_norm=get(f"{p}input_layernorm.weight"),
            qkv=fused([n + ".weight" for n in attn]),
            qkv_bias=fused([n + ".bias" for n in attn]),
            o=get(f"{p}self_attn.o_proj.weight"),
            o_bias=get(f"{p}self_attn.o_proj.bias"),
            post_norm=get(f"{p}post_attention_layernorm.weight"),
            gate_up=fused([n + ".weight" for n in mlp]),
            gate_up_bias=fused([n + ".bias" for n in mlp]),
            down=get(f"{p}mlp.down_proj.weight"),
            down_bias=get(f"{p}mlp.down_proj.bias"),
        ))
    embed = get("model.embed_tokens.weight")
    norm = get("model.norm.weight")
    lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
    bar.finish()
    if non_finite:
        files = sorted({str(entries[n].file) for n in non_finite})
        warnings.warn(f"{', '.join(files)}: {len(non_finite)} tensor(s) hold NaN or infinity, "
                      f"so the output will be garbage: {_names(non_finite)}", CheckpointWarning,
                      stacklevel=2)
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
