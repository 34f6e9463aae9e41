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

from cupa.validation import SUPPORTED_HEAD_SIZES

# architecture name -> (family, q/k/v have a bias by construction)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
}
ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """config.json (or generation_config.json) is unreadable or inconsistent; the message names
    the file and the field."""


class UnsupportedModelError(ConfigError):
    """The checkpoint needs a feature this example engine does not implement."""


class InvalidPromptError(ValueError):
    """A prompt holds no tokens, or ids outside the model's vocabulary."""


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


def _is_int(value) -> bool:
    # JSON true/false arrive as bool, which Python counts as int: a size of `true` is a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


class _Fields:
    """Typed reads of one config dict; every error names the file and the key."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def fail(self, message: str, cls=ConfigError):
        raise cls(f"{self.source}: {message}")

    def positive_int(self, key: str, default=None) -> int:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                self.fail(f"lacks {key!r} (a positive integer)")
            return default
        if not _is_int(value) or value < 1:
            self.fail(f"{key} must be a positive integer, got {value!r}")
        return value

    def positive_number(self, key: str, value, default: float) -> float:
        """`value` (read from `key`, possibly of a nested object) as a positive finite float."""
        if value is None:
            return default
        if not _is_number(value) or value <= 0:
            self.fail(f"{key} must be a positive number, got {value!r}")
        return float(value)

    def token_ids(self, key: str) -> list[int]:
        """An id or a list of ids (eos_token_id may be either), each a non-negative integer."""
        value = self.raw.get(key)
        if value is None:
            return []
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not all(_is_int(v) and v >= 0 for v in values):
            self.fail(f"{key} must be a non-negative integer or a list of them, got {value!r}")
        return values

    def flag(self, key: str) -> bool:
        value = self.raw.get(key, False)
        if value is None:
            return False
        if not isinstance(value, bool):
            self.fail(f"{key} must be true or false, got {value!r}")
        return value


def _rope_scaling(fields: _Fields, scaling) -> dict | None:
    """The rope scaling dict with 'rope_type' set, None for plain rope; the numbers
    rope_inv_freq reads are checked here so it cannot fail on a missing or zero factor."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        fields.fail(f"rope_scaling must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        fields.fail(f"unsupported rope_scaling type {rope_type!r}: this example supports "
                    f"{', '.join(ROPE_TYPES)}", UnsupportedModelError)
    if rope_type == "default":
        return None
    if scaling.get("factor") is None:
        fields.fail(f"rope_scaling of type {rope_type!r} lacks 'factor'")
    fields.positive_number("rope_scaling factor", scaling["factor"], 1.0)
    if rope_type == "llama3":
        # The defaults are rope_inv_freq's.
        low = fields.positive_number("rope_scaling low_freq_factor",
                                     scaling.get("low_freq_factor"), 1.0)
        high = fields.positive_number("rope_scaling high_freq_factor",
                                      scaling.get("high_freq_factor"), 4.0)
        fields.positive_number("rope_scaling original_max_position_embeddings",
                               scaling.get("original_max_position_embeddings"), 8192)
        if high <= low:  # the blend between the two bands divides by high - low
            fields.fail(f"rope_scaling high_freq_factor={high} must be larger than "
                        f"low_freq_factor={low}")
    return dict(scaling, rope_type=rope_type)


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the dict of a config.json, or raise ConfigError (its subclass
    UnsupportedModelError for what the engine does not implement). `source` names the file in
    messages."""
    fields = _Fields(raw if isinstance(raw, dict) else {}, source)
    if not isinstance(raw, dict):
        fields.fail(f"expected a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None) if isinstance(archs, list) else None
    if arch is None:
        fields.fail(f"unsupported architecture {archs or raw.get('model_type')!r}: this example "
                    f"supports {', '.join(ARCHITECTURES)}", UnsupportedModelError)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        fields.fail(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU)",
                    UnsupportedModelError)

    vocab = fields.positive_int("vocab_size")
    hidden = fields.positive_int("hidden_size")
    intermediate = fields.positive_int("intermediate_size")
    layers = fields.positive_int("num_hidden_layers")
    heads = fields.positive_int("num_attention_heads")
    kv_heads = fields.positive_int("num_key_value_heads", default=heads)
    if heads % kv_heads:
        fields.fail(f"num_attention_heads={heads} is not a multiple of "
                    f"num_key_value_heads={kv_heads}", UnsupportedModelError)
    if raw.get("head_dim") is None:
        # Without an explicit head_dim, Hugging Face derives it; that needs an exact division.
        if hidden % heads:
            fields.fail(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                        "and there is no head_dim")
        head_dim = hidden // heads
    else:
        # An explicit head_dim may differ from hidden_size / num_attention_heads (Hugging Face
        # allows it, and so does the model); the checkpoint's q/k/v/o shapes must then agree,
        # which the weight loader checks.
        head_dim = fields.positive_int("head_dim")
    if head_dim not in SUPPORTED_HEAD_SIZES:
        fields.fail(f"head_dim={head_dim}: cupa's decode supports head sizes "
                    f"{', '.join(map(str, SUPPORTED_HEAD_SIZES))}", UnsupportedModelError)

    rope_theta = raw.get("rope_theta", 10000.0)
    scaling = raw.get("rope_scaling")
    # transformers >= 5 may write the rope settings under "rope_parameters" instead.
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        rope_theta = params.get("rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    scaling = _rope_scaling(fields, scaling)
    rope_theta = fields.positive_number("rope_theta", rope_theta, 10000.0)

    family = ARCHITECTURES[arch][0]
    sliding = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None  # Qwen2 configs carry a window that is switched off
    if family == "llama":
        sliding = None
    if sliding is not None:
        sliding = fields.positive_int("sliding_window")

    attention_bias = fields.flag("attention_bias")
    torch_dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    bos = fields.token_ids("bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=fields.positive_number("rms_norm_eps", raw.get("rms_norm_eps"), 1e-6),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings=fields.flag("tie_word_embeddings"),
        qkv_bias=ARCHITECTURES[arch][1] or attention_bias,
        o_bias=family == "llama" and attention_bias,
        mlp_bias=fields.flag("mlp_bias"),
        max_position_embeddings=fields.positive_int("max_position_embeddings", default=4096),
        sliding_window=sliding,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=fields.token_ids("eos_token_id"),
        torch_dtype=str(torch_dtype),
    )


def read_json(path: Path):
    """A JSON file's content; ConfigError naming the file when it is not valid JSON."""
    try:
        return json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for binary garbage
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def load_config(model_dir) -> ModelConfig:
    """config.json of a checkpoint directory; generation_config.json adds EOS ids when present."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        what = "is not a directory" if model_dir.exists() else "does not exist"
        raise FileNotFoundError(f"{model_dir} {what}: --model must be a Hugging Face checkpoint "
                                "directory (config.json + *.safetensors)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a Hugging Face checkpoint "
                                "directory (config.json + *.safetensors)")
    config = parse_config(read_json(path), source=str(path))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        raw = read_json(gen_path)
        extra = _Fields(raw if isinstance(raw, dict) else {}, str(gen_path)).token_ids(
            "eos_token_id")
        config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + extra))
    return config


def check_prompt_ids(prompts, config: ModelConfig) -> None:
    """Every prompt non-empty, shorter than the longest sequence the model computes, and with ids
    in [0, vocab_size): checked before any forward, where an id past the embedding would fail as
    an IndexError (a negative one would silently index from the end)."""
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise InvalidPromptError(f"prompt {i} has no tokens")
        bad = next((t for t in ids if not 0 <= t < config.vocab_size), None)
        if bad is not None:
            raise InvalidPromptError(f"prompt {i}: token id {bad} is outside the vocabulary "
                                     f"[0, {config.vocab_size}) of config.json")
        if len(ids) >= config.max_seq_len:
            # The engine would finish it at once ("length") without a single new token.
            raise InvalidPromptError(f"prompt {i} has {len(ids)} tokens, but this model computes "
                                     f"sequences of at most {config.max_seq_len} "
                                     "(max_position_embeddings, or sliding_window)")


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
