#!/usr/bin/env python3
"""Write a small random Llama / Mistral / Qwen2 checkpoint in Hugging Face layout.

    python examples/make_tiny_llama.py --out /tmp/tiny
    python examples/make_tiny_llama.py --out /tmp/tiny-qwen --arch qwen2 --dtype bfloat16

Writes config.json, generation_config.json, model.safetensors (or --shards N files plus
model.safetensors.index.json) and, when the `tokenizers` package is installed, a byte-level
tokenizer.json (ids 0-2 are <unk> <s> </s>, 3..258 the bytes 0..255, the rest unused specials).
Nothing is downloaded. The weights are random, so the text is gibberish, but every code path of
generate.py runs and Hugging Face transformers loads the same directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm.weights import save_safetensors  # noqa: E402

ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
         "qwen2": ("Qwen2ForCausalLM", "qwen2")}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
SIZES = {  # hidden, layers, heads, kv_heads, intermediate (head_dim is 64: cupa's smallest)
    "tiny": (256, 2, 4, 2, 512),
    "small": (512, 4, 8, 2, 1024),
}
SPECIALS = ["<unk>", "<s>", "</s>"]
BOS, EOS = 1, 2


def config_dict(arch, hidden, layers, heads, kv_heads, intermediate, vocab, dtype, *,
                tie=False, rope_scaling=None, max_positions=2048):
    arch_name, model_type = ARCHS[arch]
    config = {
        "architectures": [arch_name], "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "vocab_size": vocab, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": max_positions,
        "tie_word_embeddings": tie, "bos_token_id": BOS, "eos_token_id": EOS,
        "torch_dtype": dtype, "initializer_range": 0.02,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
        if rope_scaling == "llama3":
            config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 256}
            config["rope_theta"] = 500000.0
    elif rope_scaling:
        raise SystemExit("--rope-scaling llama3 is only for --arch llama")
    if arch == "mistral":
        config["sliding_window"] = None
    if arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    return config


def random_tensors(config, arch, seed):
    """HF-named float32 tensors. Scales keep activations O(1) and logits spread out (N(0, 1)-ish),
    so greedy choices are far from ties and comparisons between implementations are stable."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])

    def linear(out_features, in_features):
        return rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)

    def norm():
        return 1.0 + 0.1 * rng.standard_normal(hidden)

    embed = rng.standard_normal((config["vocab_size"], hidden))
    if config["tie_word_embeddings"]:
        # As the LM head, unit-norm rows give N(0, 1) logits; as the embedding they are then small
        # next to the layers' updates, so the model does not just repeat its input token.
        embed /= np.sqrt(hidden)
    tensors = {"model.embed_tokens.weight": embed}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm()
        tensors[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        if arch == "qwen2":
            for name, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                tensors[p + f"self_attn.{name}_proj.bias"] = 0.1 * rng.standard_normal(size * head_dim)
        tensors[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        tensors[p + "post_attention_layernorm.weight"] = norm()
        tensors[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    tensors["model.norm.weight"] = norm()
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = linear(config["vocab_size"], hidden)
    return tensors


def byte_to_char() -> list[str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    are moved to code points 256+ so that every byte is a visible, non-space character."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def write_tokenizer(out: Path, vocab_size: int) -> bool:
    """A byte-level tokenizer.json (no merges: one token per byte). False without `tokenizers`."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        return False
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b, ch in enumerate(byte_to_char()):
        vocab[ch] = len(SPECIALS) + b
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    extra = [f"<extra_{i}>" for i in range(vocab_size - len(vocab))]
    tokenizer.add_special_tokens(SPECIALS + extra)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False}, indent=2))
    return True


def make_checkpoint(out, *, arch="llama", dtype="float32", size="tiny", vocab=320, seed=0,
                    tie=False, rope_scaling=None, shards=1, tokenizer=True) -> Path:
    """Write the checkpoint directory `out` and return it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if vocab < len(SPECIALS) + 256 and tokenizer:
        raise SystemExit(f"--vocab must be >= {len(SPECIALS) + 256} for the byte tokenizer")
    hidden, layers, heads, kv_heads, inter = SIZES[size]
    config = config_dict(arch, hidden, layers, heads, kv_heads, inter, vocab, dtype, tie=tie,
                         rope_scaling=rope_scaling)
    tensors = {k: v.astype(np.float32).astype(DTYPES[dtype])
               for k, v in random_tensors(config, arch, seed).items()}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False}, indent=2))
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("*.index.json")):
        stale.unlink()
    if shards <= 1:
        save_safetensors(out / "model.safetensors", tensors)
    else:
        names = list(tensors)
        weight_map = {}
        for k, part in enumerate(np.array_split(np.arange(len(names)), shards)):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            save_safetensors(out / file, {names[i]: tensors[names[i]] for i in part})
            weight_map.update({names[i]: file for i in part})
        total = sum(t.nbytes for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer:
        write_tokenizer(out, vocab)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="weight dtype written to the file (default float32)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny",
                        help="tiny: 2 layers, hidden 256; small: 4 layers, hidden 512")
    parser.add_argument("--vocab", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-embeddings", action="store_true", help="lm_head = embed_tokens")
    parser.add_argument("--rope-scaling", choices=["llama3"], default=None)
    parser.add_argument("--shards", type=int, default=1,
                        help="split the weights over N files with an index (default 1)")
    args = parser.parse_args(argv)
    out = make_checkpoint(args.out, arch=args.arch, dtype=args.dtype, size=args.size,
                          vocab=args.vocab, seed=args.seed, tie=args.tie_embeddings,
                          rope_scaling=args.rope_scaling, shards=args.shards)
    tok = "with" if (out / "tokenizer.json").is_file() else "without (pip install tokenizers)"
    print(f"wrote {args.arch} checkpoint ({args.size}, {args.dtype}) to {out}, {tok} tokenizer.json",
          file=sys.stderr)


if __name__ == "__main__":
    main()
