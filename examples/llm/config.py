"""Model configuration read from a Hugging Face `config.json`, checked up front.

Anything the engine does not implement is refused here with a message that names the field, so a
checkpoint never loads halfway and then produces wrong text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# architecture name -> (family, q/k/v have a bias by construction)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
}
ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint needs a feature this example engine does not implement."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # Qwen2 always; Llama when attention_bias is set
    o_bias: bool = False            # Llama attention_bias also covers o_proj
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None   # only used to refuse sequences that would need it
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture][0]

    @property
    def max_seq_len(self) -> int:
        """Longest sequence this engine computes exactly like the reference implementation."""
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        return limit


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def parse_config(raw: dict) -> ModelConfig:
    """Build a ModelConfig from the dict of a config.json, or raise UnsupportedModelError."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or raw.get('model_type')!r}: this example supports "
            f"{', '.join(ARCHITECTURES)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU)")

    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // heads
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of "
                                    f"num_key_value_heads={kv_heads}")

    rope_theta = raw.get("rope_theta", 10000.0)
    scaling = raw.get("rope_scaling")
    # transformers >= 5 may write the rope settings under "rope_parameters" instead.
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        rope_theta = params.get("rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}: this "
                                        f"example supports {', '.join(ROPE_TYPES)}")
        scaling = None if rope_type == "default" else dict(scaling, rope_type=rope_type)

    sliding = raw.get("sliding_window")
    family = ARCHITECTURES[arch][0]
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None  # Qwen2 configs carry a window that is switched off
    if family == "llama":
        sliding = None

    qkv_bias = ARCHITECTURES[arch][1] or bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=family == "llama" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_list(raw.get("eos_token_id")),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
    )


def load_config(model_dir) -> ModelConfig:
    """config.json of a checkpoint directory; generation_config.json adds EOS ids when present."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a Hugging Face checkpoint "
                                "directory (config.json + *.safetensors)")
    config = parse_config(json.loads(path.read_text()))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        extra = _as_list(json.loads(gen_path.read_text()).get("eos_token_id"))
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    return config


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """float32 [head_dim // 2] rotary inverse frequencies, with linear or llama3 scaling applied.

    Computed the way the reference implementation does (float32 throughout), so positions rotate
    by bit-identical angles and greedy decoding agrees token for token.
    """
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, blend the band in between.
    low_ff = float(scaling.get("low_freq_factor", 1.0))
    high_ff = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_ff
    high_freq_wavelen = old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(middle, blended, scaled).astype(np.float32)
